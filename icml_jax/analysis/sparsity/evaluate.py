"""Activation sparsity of a model: collecting the MLP activations, per-layer threshold trees,
sparse evaluation (loss, activation ratio), the CETT-PPL-p% search and the FAT / top-k baselines.

Axis letters: N tokens (valid tokens of all batches, pooled), F ffn hidden, D model width,
L layers, B batch, T length.

The reference (``thunlp/SparsingLaw`` @ a6d9b4c, ``src/calc_activation.py``), as read and checked:
  * Loss: HF ``labels = input_ids`` (mean CE over the shifted next tokens). Our batches are already
    shifted (inputs / targets); we take the token-weighted mean CE over tokens with segment_id > 0,
    pooled over all batches (the reference scores one unpadded text). Thresholds are computed from
    the pooled valid tokens of all batches (the reference: the valid tokens of its one input).
  * Activation ratio: the reference averages ``1 - mask.mean(-1)`` over layers and all positions
    (no padding in its use); we average the kept fraction over layers and valid tokens.
  * Top-k baseline: ranks |act(gate)| over the flattened (batch, seq, d_ff) tensor of *one forward
    pass*, inside the sparse pass (so layer l sees the already-sparsified layers before it), zeroes
    ``int(numel * (1 - k))`` entries, then counts |gate| < 1e-18 as off too. Ours is the same per
    batch (padding excluded), through ``mlp.py``'s ``topk_zero`` variable; ``scope="per_token"``
    ranks within each token. FAT-e zeroes |act(gate)| < e + 1e-18.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.analysis.sparsity.cett import GRID_SIZE, LayerStats, _check_rules, check_gated
from icml_jax.losses.logps import token_logprobs
from icml_jax.models.layers import layer_order_key
from icml_jax.models.mlp import TINY_GATE

Batch = dict


# ----------------------------------------------------------------------------- model plumbing


def _find_sown(tree, name: str, prefix=()):
    """Paths (tuples of keys) of the modules that sowed ``name`` in an intermediates tree."""
    out = []
    for k, v in tree.items():
        if k == name:
            out.append(prefix)
        elif isinstance(v, dict) or hasattr(v, "items"):
            out += _find_sown(v, name, prefix + (k,))
    return sorted(out, key=layer_order_key)


def _subtree(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _find_w_down(params, path, F: int):
    """(module path of W_down, W_down) for the block at ``path``: the leaf ``wo`` with F rows,
    preferring ``<path>/mlp/wo``."""
    sub = _subtree(params, path)
    if "mlp" in sub and "wo" in sub["mlp"]:
        return path + ("mlp",), sub["mlp"]["wo"]
    hits = [(path + tuple(k.key for k in kp[:-1]), w) for kp, w in
            jax.tree_util.tree_flatten_with_path(sub)[0]
            if getattr(kp[-1], "key", None) == "wo" and w.ndim >= 2 and w.shape[-2] == F]
    if len(hits) != 1:
        raise ValueError(f"block {'/'.join(map(str, path))}: found {len(hits)} W_down kernels named "
                         f"'wo' with {F} rows; expected exactly one")
    return hits[0]


def _valid(batch) -> np.ndarray:
    return np.asarray(batch["segment_ids"]).reshape(-1) > 0


def _prune(tree, names):
    """The sub-tree of an intermediates tree holding only the leaves sown under ``names``."""
    out = {}
    for k, v in tree.items():
        if k in names:
            out[k] = v
        elif hasattr(v, "items"):
            sub = _prune(v, names)
            if sub:
                out[k] = sub
    return out


@functools.partial(jax.jit, static_argnums=(0, 1))
def _dense_sown(model, names, params, inputs, positions, segment_ids):
    _, state = model.apply({"params": params}, inputs, positions, segment_ids,
                           mutable=["intermediates"])
    return _prune(state["intermediates"], names)


def _per_layer(x, scanned: bool):
    return x if scanned else x[None]  # [L', B, T, F]


class MLPSites:
    """Where a model's MLPs live: the param paths of their modules (for ``sparsity`` trees) and
    whether layers are scanned (a leading [L] axis on every sown value / variable)."""

    def __init__(self, paths: list[tuple], scanned: bool, num_layers: int):
        self.paths, self.scanned, self.num_layers = paths, scanned, num_layers

    def tree(self, name: str, values: Sequence[Any], dtype=jnp.float32) -> dict:
        """A ``sparsity`` collection with one value per layer of variable ``name``."""
        values = [jnp.asarray(v, dtype) for v in values]
        if len(values) != self.num_layers:
            raise ValueError(f"got {len(values)} per-layer values for {self.num_layers} MLP layers")
        out: dict = {}
        if self.scanned:
            groups = [(p, jnp.stack(values)) for p in self.paths]
        else:
            groups = list(zip(self.paths, values))
        for path, v in groups:
            node = out
            for k in path:
                node = node.setdefault(k, {})
            node[name] = v
        return out


def _unbox(params):
    return nn.meta.unbox(params)


def collect_mlp(model: nn.Module, params, batch: Batch, *, with_sites: bool = False):
    """One dense pass; per layer (acts_NF float32, w_down_FD float32) over the tokens with
    segment_id > 0, in layer order. Works for scanned and unscanned layers and any residual stream
    whose Block sows ``intermediates/mlp_acts``. ``with_sites`` also returns the ``MLPSites``."""
    params = _unbox(params)
    inter = _dense_sown(model, ("mlp_acts",), params, batch["inputs"], batch["positions"],
                        batch["segment_ids"])
    valid = _valid(batch)
    if not valid.any():
        raise ValueError("batch has no tokens with segment_id > 0")
    scanned = bool(model.cfg.scan_layers)
    layers, paths = [], []
    for path in _find_sown(inter, "mlp_acts"):
        acts = _subtree(inter, path)["mlp_acts"][0]
        F = acts.shape[-1]
        mpath, w = _find_w_down(params, path, F)
        paths.append(mpath)
        for a, wl in zip(_per_layer(acts, scanned), _per_layer(w, scanned)):
            layers.append((np.asarray(a, np.float32).reshape(-1, F)[valid], np.asarray(wl, np.float32)))
    if not layers:
        raise ValueError("the model sowed no intermediates/mlp_acts; its residual Block must sow them")
    sites = MLPSites(paths, scanned, len(layers))
    return (layers, sites) if with_sites else layers


def collect_gate_up(model: nn.Module, params, batch: Batch, *, require_gate: bool = True):
    """Per layer (act(gate)_NF, up_NF) float32 over valid tokens, for analyses of the gate and up
    projections separately (the reference's MLP is always gated). A plain activation raises
    unless ``require_gate=False``; then its up is None and its gate is the activation itself."""
    check_gated(model.cfg.mlp.activation, require_gate)
    inter = _dense_sown(model, ("mlp_gate", "mlp_up"), _unbox(params), batch["inputs"],
                        batch["positions"], batch["segment_ids"])
    valid = _valid(batch)
    if not valid.any():
        raise ValueError("batch has no tokens with segment_id > 0")
    scanned = bool(model.cfg.scan_layers)
    out = []
    for path in _find_sown(inter, "mlp_gate"):
        node = _subtree(inter, path)
        flat = lambda x: [np.asarray(v, np.float32).reshape(-1, v.shape[-1])[valid]  # noqa: E731
                          for v in _per_layer(x[0], scanned)]
        gates = flat(node["mlp_gate"])
        ups = flat(node["mlp_up"]) if "mlp_up" in node else [None] * len(gates)
        out += list(zip(gates, ups))
    return out


def collect_mlp_batches(model, params, batches: Iterable[Batch]):
    """``collect_mlp`` over several batches, tokens pooled per layer; returns (layers, sites)."""
    per, sites = [], None
    for b in batches:
        layers, sites = collect_mlp(model, params, b, with_sites=True)
        per.append(layers)
    if not per:
        raise ValueError("no batches given")
    return [(np.concatenate([p[l][0] for p in per]), per[0][l][1]) for l in range(len(per[0]))], sites


def default_sites(model_cfg) -> MLPSites:
    """The standard decoder's MLP module paths: ``layer_i/mlp`` or scanned ``layers/mlp``."""
    L = model_cfg.num_layers
    if model_cfg.scan_layers:
        return MLPSites([("layers", "mlp")], True, L)
    return MLPSites([(f"layer_{i}", "mlp") for i in range(L)], False, L)


def predictor_data(model: nn.Module, params, thresholds: Sequence[float], batches: Iterable[Batch]):
    """Calibration data for activation predictors (``models/sparse_ffn.fit_predictor``): per
    layer (x_ND, keep_NF) over the valid tokens of ``batches`` (one dense pass each), x the MLP's
    input and keep the CETT rule at that layer's threshold (|a_j| >= t / ||W_down[j]||, or > with
    ``config.model.mlp.sparse_compare="le"``); also the ``MLPSites``."""
    params = _unbox(params)
    le = model.cfg.mlp.get("sparse_compare", "lt") == "le"
    scanned = bool(model.cfg.scan_layers)
    xs, acts, paths, w_down = [], [], None, None
    for b in batches:  # one dense pass per batch gives both the inputs and the activations
        inter = _dense_sown(model, ("mlp_in", "mlp_acts"), params, b["inputs"], b["positions"],
                            b["segment_ids"])
        valid = _valid(b)
        flat = lambda v: [np.asarray(u, np.float32).reshape(-1, u.shape[-1])[valid]  # noqa: E731
                          for u in _per_layer(v, scanned)]
        found = _find_sown(inter, "mlp_acts")
        xs.append([x for p in found for x in flat(_subtree(inter, p + ("mlp",))["mlp_in"][0])])
        acts.append([a for p in found for a in flat(_subtree(inter, p)["mlp_acts"][0])])
        if paths is None:
            F = acts[-1][0].shape[-1]
            paths, w_down = [], []
            for p in found:
                mpath, w = _find_w_down(params, p, F)
                paths.append(mpath)
                w_down += [np.asarray(wl, np.float32) for wl in _per_layer(w, scanned)]
    if not xs:
        raise ValueError("no batches given")
    if len(thresholds) != len(w_down):
        raise ValueError(f"got {len(thresholds)} thresholds for {len(w_down)} MLP layers")
    out = []
    for l, (w_FD, t) in enumerate(zip(w_down, thresholds)):
        a_NF = np.concatenate([a[l] for a in acts])
        bound = float(t) / np.linalg.norm(w_FD, axis=1)
        keep = np.abs(a_NF) > bound if le else np.abs(a_NF) >= bound
        out.append((np.concatenate([x[l] for x in xs]), keep))
    return out, MLPSites(paths, scanned, len(w_down))


def predictor_tree(sites: MLPSites, predictors: Sequence[dict], base: dict | None = None) -> dict:
    """A ``sparsity`` collection holding each layer's predictor leaves (``fit_predictor``'s
    outputs, in layer order) at its MLP, merged into ``base`` (e.g. a ``thresholds_tree``)."""
    from icml_jax.models.sparse_ffn import PREDICTOR_LEAVES

    def merge(a, b):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if k in out and isinstance(v, dict) else v
        return out

    out = dict(base or {})
    for name in PREDICTOR_LEAVES:
        out = merge(out, sites.tree(name, [p[name] for p in predictors]))
    return out


def thresholds_tree(model_cfg, per_layer_thresholds: Sequence[float], *, sites: MLPSites | None = None) -> dict:
    """The ``sparsity`` collection for ``model.apply({"params": p, "sparsity": tree}, ...)``:
    ``layer_i/mlp/threshold`` scalars, or ``layers/mlp/threshold`` [L] when scanned."""
    return (sites or default_sites(model_cfg)).tree("threshold", per_layer_thresholds)


def _as_tree(model, sparsity, sites):
    if isinstance(sparsity, dict):
        return sparsity
    return thresholds_tree(model.cfg, list(sparsity), sites=sites)


@functools.partial(jax.jit, static_argnums=0)
def _sparse_stats(model, params, sparsity, inputs, positions, segment_ids, targets):
    """(sum NLL, tokens, kept neuron-slots, all neuron-slots) over valid tokens of one batch."""
    logits, state = model.apply({"params": params, "sparsity": sparsity}, inputs, positions,
                                segment_ids, mutable=["intermediates"])
    w = (segment_ids > 0).astype(jnp.float32)
    nll = -jnp.sum(token_logprobs(logits, targets) * w)
    kept = total = jnp.float32(0)
    for path in _find_sown(state["intermediates"], "mlp_keep"):
        keep = _subtree(state["intermediates"], path)["mlp_keep"][0]  # [..., B, T, F]
        kept += jnp.sum(keep * w[..., None])
        total += keep.size / w.size * jnp.sum(w)
    return nll, jnp.sum(w), kept, total


@functools.partial(jax.jit, static_argnums=0)
def _dense_nll(model, params, inputs, positions, segment_ids, targets):
    logits = model.apply({"params": params}, inputs, positions, segment_ids)
    w = (segment_ids > 0).astype(jnp.float32)
    return -jnp.sum(token_logprobs(logits, targets) * w), jnp.sum(w)


def _args(b):
    return b["inputs"], b["positions"], b["segment_ids"], b["targets"]


def dense_loss(model, params, batches: Sequence[Batch]) -> float:
    """Token-weighted mean CE (nats) of the dense model over valid tokens of all batches."""
    params = _unbox(params)
    s = [np.asarray(x, np.float64) for b in batches for x in _dense_nll(model, params, *_args(b))]
    nll, n = sum(s[0::2]), sum(s[1::2])
    if n == 0:
        raise ValueError("no tokens with segment_id > 0 in the batches")
    return float(nll / n)


def sparse_eval(model, params, sparsity, batches: Sequence[Batch], *, sites: MLPSites | None = None) -> dict:
    """Sparse pass over ``batches``: {"loss", "activation_ratio"} (valid tokens, all layers).
    ``sparsity`` is a ``sparsity`` tree, a list of per-layer thresholds, or a callable
    ``batch -> tree`` (for batch-dependent variables such as the top-k counts)."""
    params = _unbox(params)
    tot = np.zeros(4)
    for b in batches:
        tree = sparsity(b) if callable(sparsity) else _as_tree(model, sparsity, sites)
        tot += [float(x) for x in _sparse_stats(model, params, tree, *_args(b))]
    if tot[1] == 0:
        raise ValueError("no tokens with segment_id > 0 in the batches")
    return {"loss": float(tot[0] / tot[1]),
            "activation_ratio": float(tot[2] / tot[3]) if tot[3] else float("nan")}


def sparse_apply(model, params, sparsity, inputs, positions=None, segment_ids=None):
    """(logits [B, T, V], keep masks: list of float32 [..., B, T, F] per MLP site) of the sparse model."""
    logits, state = model.apply({"params": _unbox(params), "sparsity": _as_tree(model, sparsity, None)},
                                inputs, positions, segment_ids, mutable=["intermediates"])
    inter = state["intermediates"]
    return logits, [_subtree(inter, p)["mlp_keep"][0] for p in _find_sown(inter, "mlp_keep")]


def sparse_logits(model, params, sparsity, inputs, positions=None, segment_ids=None):
    """Logits [B, T, V] of the sparse model (``sparsity``: tree or per-layer thresholds)."""
    return model.apply({"params": _unbox(params), "sparsity": _as_tree(model, sparsity, None)},
                       inputs, positions, segment_ids)


def activation_ratio(model, params, sparsity, batches: Sequence[Batch]) -> float:
    """Fraction of neuron slots not zeroed, over layers and valid tokens (the reference's metric)."""
    return sparse_eval(model, params, sparsity, batches)["activation_ratio"]


# ----------------------------------------------------------------------------- CETT-PPL-p%


class CettProbe:
    """One checkpoint on one token slice, ready for repeated CETT targets: its MLP activations and
    threshold grids (``LayerStats``) and dense loss, computed once. ``at(c)`` recomputes the
    per-layer thresholds for target CETT ``c`` from this checkpoint's dense pass and runs the
    sparse pass: {"thresholds", "loss_sparse", "ppl_ratio" = exp(L_sparse - L_dense),
    "activation_ratio"}."""

    def __init__(self, model: nn.Module, params, batches: Sequence[Batch], *, grid_size: int = GRID_SIZE,
                 index_rule: str = "prev", wrap_at_zero: str = "wrap"):
        _check_rules(index_rule, wrap_at_zero)
        self.model, self.params, self.batches = model, _unbox(params), list(batches)
        self.rules = (index_rule, wrap_at_zero)
        layers, self.sites = collect_mlp_batches(model, self.params, self.batches)
        self.stats = LayerStats(layers, grid_size)
        self.loss_dense = dense_loss(model, self.params, self.batches)

    def at(self, c: float) -> dict:
        th = self.stats.thresholds(c, *self.rules)
        ev = sparse_eval(self.model, self.params, th, self.batches, sites=self.sites)
        return {"thresholds": th, "loss_sparse": ev["loss"], "activation_ratio": ev["activation_ratio"],
                "ppl_ratio": math.exp(ev["loss"] - self.loss_dense)}


def _bisect(score, target_ratio: float, tol: float, max_iterations: int):
    """The reference's outer search: halve [0, 1] keeping ``score(c) < target_ratio`` on the lower
    side; returns (midpoint, lower, upper, iterations, history of (c, score))."""
    lower, upper, it, history = 0.0, 1.0, 0, []
    while upper - lower > tol and it < max_iterations:
        c = (lower + upper) / 2
        rho = score(c)
        history.append((c, rho))
        lower, upper = (c, upper) if rho < target_ratio else (lower, c)
        it += 1
    return (lower + upper) / 2, lower, upper, it, history


def _check_search(p: float, tol: float):
    if not p > 0:
        raise ValueError(f"p (the allowed PPL increase in %) must be > 0; got {p}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0; got {tol}")


def cett_ppl_search(model: nn.Module, params, batches: Sequence[Batch], *, p: float = 1.0,
                    tol: float = 1e-6, grid_size: int = GRID_SIZE, index_rule: str = "prev",
                    wrap_at_zero: str = "wrap", max_iterations: int = 64) -> dict:
    """CETT-PPL-p%: binary search over c in [0, 1] for the largest shared target CETT whose sparse
    model keeps exp(L_sparse - L_dense) < 1 + p/100 (the reference's
    ``calc_cett_for_target_ppl_ratio``), then the activation ratio at the final midpoint.

    Returns {"cett", "activation_ratio", "sparsity", "thresholds" (per layer), "ppl_dense",
    "ppl_sparse", "ppl_ratio", "loss_dense", "loss_sparse", "lower", "upper", "iterations",
    "history" (list of (c, ppl_ratio, activation_ratio))}."""
    _check_search(p, tol)
    probe = CettProbe(model, params, batches, grid_size=grid_size, index_rule=index_rule,
                      wrap_at_zero=wrap_at_zero)
    seen = []

    def score(c):
        r = probe.at(c)
        seen.append(r["activation_ratio"])
        return r["ppl_ratio"]

    c, lower, upper, it, hist = _bisect(score, 1.0 + p / 100.0, tol, max_iterations)
    r = probe.at(c)
    return {"cett": c, "activation_ratio": r["activation_ratio"], "sparsity": 1.0 - r["activation_ratio"],
            "thresholds": r["thresholds"], "ppl_dense": math.exp(probe.loss_dense),
            "ppl_sparse": math.exp(r["loss_sparse"]), "ppl_ratio": r["ppl_ratio"],
            "loss_dense": probe.loss_dense, "loss_sparse": r["loss_sparse"], "lower": lower,
            "upper": upper, "iterations": it,
            "history": [(c_, rho, a) for (c_, rho), a in zip(hist, seen)]}


def cett_ppl_search_checkpoints(model: nn.Module, params_list: Sequence[Any], batches: Sequence[Batch], *,
                                p: float = 1.0, tol: float = 1e-3, digits: int | None = 4,
                                grid_size: int = GRID_SIZE, index_rule: str = "prev",
                                wrap_at_zero: str = "wrap", max_iterations: int = 64) -> dict:
    """One CETT for a whole training run, the Sparsing-Law authors' protocol (``calc_cett.py`` and
    ``calc_sparsity.sh`` of thunlp/SparsingLaw): binary search over c in [0, 1] on the **mean**
    over checkpoints (the reference passes the run's last 5) of each checkpoint's PPL ratio
    exp(L_sparse - L_dense) at c, keeping the mean below 1 + p/100; tolerance 1e-3 as there. The
    reference writes the result with 4 decimals and applies that rounded value to every
    checkpoint; ``digits=4`` reproduces it (``None`` keeps the midpoint). Each checkpoint's
    thresholds come from its own dense pass at c (thresholds differ by checkpoint, c does not).

    Returns {"cett", "cett_unrounded", "mean_ppl_ratio" and "ppl_ratios" (per checkpoint) at
    "cett", "iterations", "lower", "upper", "history" (list of (c, mean PPL ratio))}."""
    _check_search(p, tol)
    params_list = list(params_list)
    if not params_list:
        raise ValueError("cett_ppl_search_checkpoints needs at least one checkpoint's params")
    probes = [CettProbe(model, pr, batches, grid_size=grid_size, index_rule=index_rule,
                        wrap_at_zero=wrap_at_zero) for pr in params_list]

    def score(c):
        return float(np.mean([pb.at(c)["ppl_ratio"] for pb in probes]))

    mid, lower, upper, it, hist = _bisect(score, 1.0 + p / 100.0, tol, max_iterations)
    c = round(mid, digits) if digits is not None else mid
    ratios = [pb.at(c)["ppl_ratio"] for pb in probes]
    return {"cett": c, "cett_unrounded": mid, "mean_ppl_ratio": float(np.mean(ratios)),
            "ppl_ratios": ratios, "iterations": it, "lower": lower, "upper": upper, "history": hist}


def sparsity_at_cett(model: nn.Module, params, batches: Sequence[Batch], cett: float, *,
                     grid_size: int = GRID_SIZE, index_rule: str = "prev", wrap_at_zero: str = "wrap") -> dict:
    """A fixed target CETT applied to one checkpoint (the second half of the authors' protocol):
    {"cett", "thresholds", "activation_ratio", "sparsity", "ppl_dense", "ppl_sparse", "ppl_ratio"}."""
    probe = CettProbe(model, params, batches, grid_size=grid_size, index_rule=index_rule,
                      wrap_at_zero=wrap_at_zero)
    r = probe.at(cett)
    return {"cett": cett, "thresholds": r["thresholds"], "activation_ratio": r["activation_ratio"],
            "sparsity": 1.0 - r["activation_ratio"], "ppl_dense": math.exp(probe.loss_dense),
            "ppl_sparse": math.exp(r["loss_sparse"]), "ppl_ratio": r["ppl_ratio"]}


# ----------------------------------------------------------------------------- baselines


def _baseline_result(model, params, batches, sparsity, sites):
    batches = list(batches)
    loss_dense = dense_loss(model, params, batches)
    ev = sparse_eval(model, params, sparsity, batches, sites=sites)
    return {"activation_ratio": ev["activation_ratio"], "sparsity": 1.0 - ev["activation_ratio"],
            "ppl_dense": math.exp(loss_dense), "ppl_sparse": math.exp(ev["loss"]),
            "ppl_ratio": math.exp(ev["loss"] - loss_dense)}


def fat_baseline(model, params, batches: Sequence[Batch], eps: float, *, require_gate: bool = False) -> dict:
    """FAT-e: zero neurons with |act(gate)| < eps (+1e-18, as the reference; a plain MLP's gate is
    its activation, unless ``require_gate``). Returns {"activation_ratio", "sparsity",
    "ppl_dense", "ppl_sparse", "ppl_ratio"}."""
    check_gated(model.cfg.mlp.activation, require_gate)
    if not eps >= 0:
        raise ValueError(f"FAT eps must be >= 0; got {eps}")
    sites = default_sites(model.cfg)
    tree = sites.tree("gate_threshold", [float(np.float64(eps) + TINY_GATE)] * sites.num_layers)
    return _baseline_result(model, params, batches, tree, sites)


def topk_baseline(model, params, batches: Sequence[Batch], k: float, scope: str = "global", *,
                  require_gate: bool = False) -> dict:
    """Top-k on |act(gate)| keeping a fraction ``k``: ``scope="global"`` (reference) ranks the
    whole flattened (batch, seq, d_ff) tensor of each batch's valid tokens inside the sparse pass
    and zeroes int(numel * (1 - k)) entries; ``"per_token"`` zeroes int(F * (1 - k)) per token."""
    check_gated(model.cfg.mlp.activation, require_gate)
    if not 0.0 <= k <= 1.0:
        raise ValueError(f"top-k keep fraction k must lie in [0, 1]; got {k}")
    if scope not in ("global", "per_token"):
        raise ValueError(f"topk_scope={scope!r}; choose 'global' (reference) or 'per_token'")
    sites = default_sites(model.cfg)
    F = model.cfg.ffn_dim

    def tree(b):
        valid = np.asarray(b["segment_ids"]) > 0
        if scope == "per_token":
            return sites.tree("topk_zero_per_token", [int(F * (1 - k))] * sites.num_layers, jnp.int32)
        t = sites.tree("topk_zero", [int(valid.sum() * F * (1 - k))] * sites.num_layers, jnp.int32)
        masks = sites.tree("token_mask", [valid] * sites.num_layers, bool)
        return _merge(t, masks)

    return _baseline_result(model, params, batches, tree, sites)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out
