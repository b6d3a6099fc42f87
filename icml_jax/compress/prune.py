"""Model-level pruning with optional low-rank refinement (docs/methods/tlr_pruning.md).

``prune_model(params, model_cfg, ...)`` prunes every linear projection of every block (q, k, v,
o, gate, up, down, as Hugging Face names them; the embedding and the output head are left dense)
and returns params for ``model_cfg`` with ``lowrank`` = k (the low-rank factors, ``refine`` =
"svd" or "tlr") or the same config (``refine`` = "none"): a model the normal decoder, ``generate``
and training run (``models/lowrank.py``); ``merged_params`` folds the factors back into dense
kernels (e.g. for ``save_hf``).

The fused kernels are viewed as the HF matrices in PyTorch's [out, in] orientation:
  q [G*R*K, D], k [G*K, D], v [G*K, D] from ``attn/qkv`` [D, G, R+2, K];  o [D, G*R*K] from
  ``attn/out`` [G, R, K, D];  gate, up [F, D] from ``mlp/wi`` [D, 2, F];  down [D, F] from ``mlp/wo``.
Row order inside q/k/v differs from HF's by a permutation of rows at most, which changes none of
the masks (per row, or N:M along the inputs) nor the SVDs.

Calibration (Wanda) follows the reference's sequential order: layer l's input norms are measured
on the calibration tokens run through the model whose layers < l are already processed (with
their low-rank factors for TLR; without them for the one-shot baseline, as fusion_bench computes
the next layer's inputs before it extracts the factors), and layer l still dense.
"""
from __future__ import annotations

import copy
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.compress import masks as mask_lib
from icml_jax.compress import tlr as tlr_lib
from icml_jax.models.decoder import build_model
from icml_jax.models.mlp import is_gated

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
REFINES = ("none", "svd", "tlr")


def _dims(cfg):
    G, K = cfg.num_kv_heads, cfg.head_dim
    return G, cfg.num_heads // G, K


def matrices(layer: dict, cfg) -> dict[str, np.ndarray]:
    """The block's projections as [out, in] float32 matrices (see the module docstring)."""
    G, R, K = _dims(cfg)
    qkv = np.asarray(layer["attn"]["qkv"], np.float32)  # [D, G, R+2, K]
    D = qkv.shape[0]
    out = {"q": qkv[:, :, :R].reshape(D, G * R * K).T, "k": qkv[:, :, R].reshape(D, G * K).T,
           "v": qkv[:, :, R + 1].reshape(D, G * K).T,
           "o": np.asarray(layer["attn"]["out"], np.float32).reshape(G * R * K, D).T}
    wi = np.asarray(layer["mlp"]["wi"], np.float32)
    if wi.ndim == 3:
        out["gate"], out["up"] = wi[:, 0].T, wi[:, 1].T
    else:
        out["up"] = wi.T
    out["down"] = np.asarray(layer["mlp"]["wo"], np.float32).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def with_matrices(layer: dict, cfg, mats: dict[str, np.ndarray]) -> dict:
    """A copy of the block's params with the kernels rebuilt from ``mats`` (inverse of
    ``matrices``)."""
    G, R, K = _dims(cfg)
    new = copy.deepcopy(jax.tree.map(np.asarray, layer))
    qkv = new["attn"]["qkv"].copy()
    D = qkv.shape[0]
    qkv[:, :, :R] = mats["q"].T.reshape(D, G, R, K)
    qkv[:, :, R] = mats["k"].T.reshape(D, G, K)
    qkv[:, :, R + 1] = mats["v"].T.reshape(D, G, K)
    new["attn"]["qkv"] = qkv
    new["attn"]["out"] = mats["o"].T.reshape(G, R, K, D)
    if "gate" in mats:
        new["mlp"]["wi"] = np.stack([mats["gate"].T, mats["up"].T], axis=1)
    else:
        new["mlp"]["wi"] = mats["up"].T
    new["mlp"]["wo"] = mats["down"].T
    return new


def with_factors(layer: dict, cfg, factors: dict[str, tuple], rank: int) -> dict:
    """The block's params plus ``models/lowrank.py``'s factor leaves from per-projection
    (B [out, k], A [k, in]) pairs (zero-padded to ``rank``; a projection without factors gets
    zeros)."""
    G, R, K = _dims(cfg)
    new = copy.deepcopy(layer)
    D, F = cfg.d_model, cfg.ffn_dim

    def pair(name, m, n):
        b, a = factors.get(name, (np.zeros((m, 0), np.float32), np.zeros((0, n), np.float32)))
        bb, aa = np.zeros((m, rank), np.float32), np.zeros((rank, n), np.float32)
        bb[:, :b.shape[1]], aa[:a.shape[0]] = b, a
        return bb, aa  # y = x A^T B^T in our orientation

    (bq, aq), (bk, ak), (bv, av) = pair("q", G * R * K, D), pair("k", G * K, D), pair("v", G * K, D)
    new["attn"]["qkv_lr_a"] = np.stack([aq.T, ak.T, av.T])
    new["attn"]["q_lr_b"] = bq.T.reshape(rank, G, R, K)
    new["attn"]["kv_lr_b"] = np.stack([bk.T.reshape(rank, G, K), bv.T.reshape(rank, G, K)])
    bo, ao = pair("o", D, G * R * K)
    new["attn"]["out_lr_a"], new["attn"]["out_lr_b"] = ao.T.reshape(G, R, K, rank), bo.T
    ins = ["gate", "up"] if is_gated(cfg.mlp.activation) else ["up"]
    pairs = [pair(n, F, D) for n in ins]
    new["mlp"]["wi_lr_a"] = np.stack([a.T for _, a in pairs])
    new["mlp"]["wi_lr_b"] = np.stack([b.T for b, _ in pairs])
    bd, ad = pair("down", D, F)
    new["mlp"]["wo_lr_a"], new["mlp"]["wo_lr_b"] = ad.T, bd.T
    return new


def merged_params(params, model_cfg):
    """(dense params, config with lowrank = 0): every factor pair folded into its kernel."""
    rank = int(model_cfg.get("lowrank", 0) or 0)
    cfg = _with_rank(model_cfg, 0)
    if not rank:
        return params, cfg
    params = jax.tree.map(np.asarray, nn.meta.unbox(params))
    out = {}
    for name, sub in params.items():
        if not name.startswith("layer_"):
            out[name] = sub
            continue
        mats = matrices(sub, model_cfg)
        f = _factors_of(sub, model_cfg)
        merged = {k: mats[k] + f[k][0] @ f[k][1] for k in mats}
        dense = with_matrices(sub, model_cfg, merged)
        for part in ("attn", "mlp"):
            dense[part] = {k: v for k, v in dense[part].items() if "_lr_" not in k}
        out[name] = dense
    return out, cfg


def _factors_of(layer: dict, cfg) -> dict[str, tuple]:
    """Per projection (B [out, k], A [k, in]) read back from the factor leaves."""
    G, R, K = _dims(cfg)
    at, ml = layer["attn"], layer["mlp"]
    r = at["qkv_lr_a"].shape[-1]
    out = {"q": (at["q_lr_b"].reshape(r, -1).T, at["qkv_lr_a"][0].T),
           "k": (at["kv_lr_b"][0].reshape(r, -1).T, at["qkv_lr_a"][1].T),
           "v": (at["kv_lr_b"][1].reshape(r, -1).T, at["qkv_lr_a"][2].T),
           "o": (at["out_lr_b"].T, at["out_lr_a"].reshape(-1, r).T),
           "down": (ml["wo_lr_b"].T, ml["wo_lr_a"].T)}
    ins = ["gate", "up"] if ml["wi_lr_a"].shape[0] == 2 else ["up"]
    for i, n in enumerate(ins):
        out[n] = (ml["wi_lr_b"][i].T, ml["wi_lr_a"][i].T)
    return out


def _with_rank(model_cfg, rank: int):
    cfg = ml_collections.ConfigDict(model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else model_cfg)
    cfg.lowrank = int(rank)
    return cfg


@functools.lru_cache(maxsize=8)
def _intermediates_fn(model_cfg):
    """One jitted forward per architecture returning the sown intermediates (the sequential
    calibration runs it once per block)."""
    model = build_model(model_cfg)
    return jax.jit(lambda p, t, pos, seg: model.apply({"params": p}, t, pos, seg,
                                                       mutable=["intermediates"])[1]["intermediates"])


def input_norms(params, model_cfg, tokens: np.ndarray, layer: int, segment_ids=None,
                positions=None) -> dict:
    """||X_:,i||_2 of each projection's calibration inputs in block ``layer`` (over the tokens
    whose segment id is > 0): q/k/v read the attention input, o the attention output before its
    projection, gate/up the MLP input, down the MLP activations."""
    tokens = jnp.asarray(tokens, jnp.int32)
    seg = jnp.ones_like(tokens) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    pos = (jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
           if positions is None else jnp.asarray(positions, jnp.int32))
    inter = _intermediates_fn(ml_collections.FrozenConfigDict(model_cfg))(params, tokens, pos, seg)
    inter = inter[f"layer_{layer}"]
    w = np.asarray(seg > 0, np.float32).reshape(-1)

    def norm(x):
        x = np.asarray(x[0] if isinstance(x, tuple) else x, np.float32)
        x = x.reshape(w.size, -1)
        return np.sqrt((x * x * w[:, None]).sum(0))

    x_in, o = norm(inter["attn"]["attn_in"]), norm(inter["attn"]["attn_out_in"])
    m_in, acts = norm(inter["mlp"]["mlp_in"]), norm(inter["mlp_acts"])
    return {"q": x_in, "k": x_in, "v": x_in, "o": o, "gate": m_in, "up": m_in, "down": acts}


def prune_model(params, model_cfg, *, method: str = "magnitude", pattern: str = "unstructured",
                sparsity: float = 0.5, scope: str = "row", refine: str = "none", rank: int = 8,
                iters: int = 10, early_stop: float | None = 0.99, calib_tokens=None,
                calib_segments=None, calib_positions=None, seed: int = 0):
    """Prunes every block projection; returns (params, model config, report).

    Args:
      params, model_cfg: an unscanned standard decoder (``lowrank`` 0).
      method: magnitude | wanda (needs ``calib_tokens`` int [N, T]) | random.
      pattern: unstructured (``sparsity``: a share, or a dict projection name -> share;
        ``scope`` row / matrix / global) or "N:M" (e.g. 2:4).
      refine: none (prune only) | svd (one-shot rank-``rank`` SVD of the pruned-away part) |
        tlr (``iters`` alternations, ``early_stop`` on the spectral mass, None = all).
    Report: per projection the kept share, ||W - S - BA|| / ||W||, and TLR's iterations.
    """
    if method not in mask_lib.METHODS:
        raise ValueError(f"method must be one of {mask_lib.METHODS}, got {method!r}")
    if refine not in REFINES:
        raise ValueError(f"refine must be one of {REFINES}, got {refine!r}")
    if model_cfg.get("scan_layers", False) or model_cfg.get("residual", "standard") != "standard":
        raise ValueError("prune_model needs an unscanned standard decoder (config.model.scan_layers"
                         "=False, residual='standard'); the scanned params are the same values stacked")
    if int(model_cfg.get("lowrank", 0) or 0):
        raise ValueError("prune_model takes a dense model (config.model.lowrank=0); merge the "
                         "factors first with merged_params")
    nm = mask_lib.parse_pattern(pattern)
    if scope == "global" and isinstance(sparsity, dict):
        raise ValueError("scope='global' takes one sparsity for the whole model, not a per-projection dict")
    if scope == "global" and (method == "wanda" or nm is not None):
        raise ValueError("scope='global' ranks magnitude or random scores of all matrices together; "
                         "use scope='row' or 'matrix' for wanda and N:M patterns")
    if method == "wanda" and calib_tokens is None:
        raise ValueError("method='wanda' needs calib_tokens (int [N, T] calibration rows)")
    rng = np.random.default_rng(seed)
    params = jax.tree.map(np.asarray, nn.meta.unbox(params))
    k = rank if refine != "none" else 0
    out_cfg = _with_rank(model_cfg, k)
    L = model_cfg.num_layers
    layers = [params[f"layer_{i}"] for i in range(L)]
    global_keep = None
    if scope == "global":
        all_scores = [mask_lib.scores(m, method, rng=rng) for lay in layers for m in matrices(lay, model_cfg).values()]
        flat = mask_lib.global_masks(all_scores, sparsity)
        names = list(matrices(layers[0], model_cfg))
        global_keep = [dict(zip(names, flat[i * len(names):(i + 1) * len(names)])) for i in range(L)]
    current = dict(params)  # the model as processed so far (calibration input of the next layer)
    calib_cfg = _with_rank(model_cfg, k if refine == "tlr" else 0)
    if refine == "tlr":
        current = {n: (with_factors(v, calib_cfg, {}, k) if n.startswith("layer_") else v)
                   for n, v in current.items()}
    final = dict(current)
    report = {}
    for i in range(L):
        mats = matrices(layers[i], model_cfg)
        norms = (input_norms(current, calib_cfg, calib_tokens, i, calib_segments, calib_positions)
                 if method == "wanda" else {})
        sparse, factors = {}, {}
        for name, w in mats.items():
            if global_keep is not None:
                keep = global_keep[i][name]
            else:
                sc = mask_lib.scores(w, method, norms.get(name), rng)
                sp = sparsity[name] if isinstance(sparsity, dict) else sparsity
                keep = (mask_lib.n_of_m(sc, *nm) if nm else mask_lib.unstructured(sc, sp, scope))
            keep = keep & (w != 0)  # the reference's mask: weights that are non-zero after pruning
            entry = {"kept": float(keep.mean())}
            if refine == "tlr":
                s, b, a, info = tlr_lib.tlr(w, keep, rank, iters, early_stop)
                factors[name] = (b, a)
                entry.update(iterations=info["iterations"])
            elif refine == "svd":
                s, b, a = tlr_lib.one_shot(w, keep, rank)
                factors[name] = (b, a)
            else:
                s, b, a = np.where(keep, w, 0.0).astype(np.float32), None, None
            entry["rel_error"] = tlr_lib.relative_error(w, s, b, a)
            sparse[name] = s
            report[f"layer_{i}/{name}"] = entry
        pruned = with_matrices(layers[i], model_cfg, sparse)
        done = with_factors(pruned, out_cfg, factors, k) if k else pruned
        final[f"layer_{i}"] = done
        # the next layer's calibration input: through this layer as the reference computes it
        current[f"layer_{i}"] = done if refine != "svd" else pruned
    return final, out_cfg, report


def sparse_param_count(params, model_cfg) -> dict:
    """{"nonzero": non-zero block-projection weights + factor entries, "dense": the dense
    projections' size}: the parameter cost nnz(S) + k (m + n) per matrix."""
    params = jax.tree.map(np.asarray, nn.meta.unbox(params))
    nz = dense = 0
    for i in range(model_cfg.num_layers):
        lay = params[f"layer_{i}"]
        for w in matrices(lay, model_cfg).values():
            nz += int(np.count_nonzero(w))
            dense += w.size
        for part in ("attn", "mlp"):
            nz += sum(int(np.count_nonzero(v)) for k2, v in lay[part].items() if "_lr_" in k2)
    return {"nonzero": nz, "dense": dense}
