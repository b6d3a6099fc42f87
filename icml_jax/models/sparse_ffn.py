"""Decode-time sparse gated FFN for batch-1 decoding: compute only the neurons that can survive.

Axis letters: D model width, F ffn hidden, C capacity (static number of gathered neurons).

The dense reference is ``icml_jax.models.mlp`` with the ``sparsity`` collection: for a gated FFN
(``relu_glu`` or ``swiglu``) a = act(x W_gate) * (x W_up), neuron j is zeroed iff
|a_j| < t / ||W_down[j]|| (``compare="le"``: <=; optionally also iff |act(g_j)| < e, the FAT-e rule),
and y = a_kept W_down. This module computes the same y while touching only some rows of W_up and
W_down, with static shapes under ``jax.jit``:

1. g = act(x W_gate), dense (D*F multiply-adds).
2. Candidates. Neuron j is provably zeroed (or contributes exactly 0) without computing u_j = x W_up[:, j]
   when act(g_j) == 0, or when the Cauchy-Schwarz bound |a_j| <= |act(g_j)| ||x|| ||W_up[:, j]||
   (inflated by ``BOUND_MARGIN`` against float rounding) is already below t / ||W_down[j]||, or when
   the FAT-e gate rule zeroes it. Every other neuron is a candidate.
3. ``jnp.nonzero(candidates, size=capacity)`` gives C indices; the C rows of W_up^T and W_down
   (both stored [F, D], so each neuron's row is contiguous) are gathered,
   u_C = W_up^T[idx] x, a_C = act(g)[idx] * u_C, the exact threshold rule is applied to a_C, and
   y = a_C W_down[idx] (2*D*C multiply-adds).
4. If there are more candidates than ``capacity``, ``lax.cond`` runs the dense masked computation
   instead, so the output equals the masked dense MLP in every case (up to float summation order).

What is saved, honestly: only the up and down projections of non-candidate neurons. The gate
projection is always computed densely, so at activation ratio r (and capacity ~ r*F) the FFN costs
D*F + 2*D*C instead of 3*D*F multiply-adds: at most 3x fewer, e.g. 2.6x at r = 6.5%, before the cost
of the gather and the compare. For ReLU-GLU the candidates are essentially the neurons with a
positive gate (the bound prunes a few more); for SwiGLU silu(g) is almost never 0 and the
Cauchy-Schwarz bound is loose (|u_j| is typically ~sqrt(D) times smaller than it), so most neurons
stay candidates and the dense fallback usually runs. The paper's 4.1x speed-up at 93.5% sparsity
(2.4B ReLU model) additionally skips the gate rows with an activation *predictor* (a small network
that guesses the active set before the gate is computed); that is approximate, not exact. It is
here as an option (below, "Activation predictor"); ``predicted_ffn`` is the gather-everything
kernel it feeds, used by ``benchmarks/sparse_ffn.py`` with the true active set as an upper bound.

Activation predictor (approximate). A low-rank scorer per MLP, s = (x P_in) P_out + b
(``PREDICTOR_LEAVES``: ``pred_in`` [D, r], ``pred_out`` [r, F], ``pred_bias`` [F], float32),
trained by ``fit_predictor`` with a logistic loss to predict which neurons survive the CETT rule
(labels from a calibration pass: ``icml_jax.analysis.sparsity.fit_predictors``). At decode
``predicted_sparse_ffn`` takes the top-C scores (C = the capacity), computes gate, up and down
only for those C neurons (3*D*C + D*r + r*F multiply-adds instead of 3*D*F) and applies the exact
threshold rule to them; a neuron the predictor misses is dropped, so the output equals the masked
dense FFN only when every kept neuron is among the C (``predictor_recall`` measures how often).
In the decode path the MLP takes this route when the ``sparsity`` tree also holds the predictor
leaves (and ``sparse_capacity`` > 0); there is no dense fallback.

Batch 1 only: under ``vmap`` the ``lax.cond`` becomes a select and both branches would run.

As a decoding path. ``decode.generate(..., sparsity=tree, sparse_capacity=C)`` calls
``add_gather_rows(params, tree)`` once per call, before its while loop: every MLP node of the
thresholds tree (``layer_i/mlp`` or scanned ``layers/mlp``, leaves [L, ...]) gains the leaves of
``ROW_LEAVES`` (``gate_rows`` / ``up_rows`` [F, D], ``down_norm`` / ``up_norm`` [F]; W_down is the
param ``wo``, already [F, D]). ``models/mlp.py`` then runs ``sparse_ffn`` (``return_acts`` and
``return_stats`` on) for every [1, 1, D] input of a gated MLP when those leaves are present and
``config.model.mlp.sparse_capacity`` = C > 0, and the masked dense MLP otherwise (the prefill, and
any batch > 1). The prepared rows cost 2/3 of the FFN weights in extra memory.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

BOUND_MARGIN = 1e-3  # relative slack on the Cauchy-Schwarz bound (float32 dot-product rounding)
# ``sparsity``-collection leaves of one MLP for the gathered path (``add_gather_rows``); with the
# param ``wo`` they make its ``SparseFFNWeights`` (``from_leaves``)
ROW_LEAVES = ("gate_rows", "up_rows", "down_norm", "up_norm")
_RULE_VARIABLES = ("threshold", "gate_threshold")  # the rules this kernel implements

# ``sparsity``-collection leaves of one MLP's activation predictor (``fit_predictor``)
PREDICTOR_LEAVES = ("pred_in", "pred_out", "pred_bias")

_GATE_FNS = {"relu_glu": jax.nn.relu, "swiglu": jax.nn.silu}


class SparseFFNWeights(NamedTuple):
    """One gated FFN laid out for gathers (``prepare``)."""
    w_gate_FD: jax.Array  # [F, D]: row j = W_gate[:, j]
    w_up_FD: jax.Array  # [F, D]: row j = W_up[:, j]
    w_down_FD: jax.Array  # [F, D]: row j = W_down[j]
    down_norm_F: jax.Array  # float32 [F]: ||W_down[j]|| (the CETT rule's column norm)
    up_norm_F: jax.Array  # float32 [F]: ||W_up[:, j]||


def prepare(mlp_params: dict) -> SparseFFNWeights:
    """From an MLP's params ``{"wi": [D, 2, F] (gate, up), "wo": [F, D]}`` (``models/mlp.py``)."""
    mlp_params = nn.meta.unbox(mlp_params)
    shapes = {k: tuple(jnp.shape(v)) for k, v in mlp_params.items()}
    if set(shapes) != {"wi", "wo"} or len(shapes["wi"]) != 3:
        raise ValueError("sparse_ffn.prepare needs a gated MLP's params {'wi': [D, 2, F], 'wo': [F, D]}, "
                         f"got {shapes}")
    wi, wo = jnp.asarray(mlp_params["wi"]), jnp.asarray(mlp_params["wo"])
    w_up_FD = wi[:, 1, :].T
    return SparseFFNWeights(
        w_gate_FD=wi[:, 0, :].T, w_up_FD=w_up_FD, w_down_FD=wo,
        down_norm_F=jnp.linalg.norm(wo.astype(jnp.float32), axis=1),
        up_norm_F=jnp.linalg.norm(w_up_FD.astype(jnp.float32), axis=1))


def from_leaves(leaves: dict, w_down_FD) -> SparseFFNWeights:
    """``SparseFFNWeights`` from one MLP's ``ROW_LEAVES`` (a mapping) and its W_down [F, D]."""
    return SparseFFNWeights(w_gate_FD=leaves["gate_rows"], w_up_FD=leaves["up_rows"], w_down_FD=w_down_FD,
                            down_norm_F=leaves["down_norm"], up_norm_F=leaves["up_norm"])


def add_gather_rows(params, sparsity: dict) -> dict:
    """A copy of the ``sparsity`` tree where every node holding a ``threshold`` or
    ``gate_threshold`` also holds the ``ROW_LEAVES`` of the gated MLP at the same path of
    ``params``; scanned params (``wi`` [L, D, 2, F], ``wo`` [L, F, D]) give [L, F, D] / [L, F] leaves.
    Jit-friendly (transposes and norms only)."""
    params = nn.meta.unbox(params)

    def walk(node, par, path):
        out = {}
        for k, v in node.items():
            if isinstance(v, dict) or hasattr(v, "items"):
                if k not in par:
                    raise ValueError(f"sparsity tree node {'/'.join(path + (k,))} has no params node")
                out[k] = walk(v, par[k], path + (k,))
            else:
                out[k] = v
        if any(n in node for n in _RULE_VARIABLES):
            if "wi" not in par or jnp.ndim(par["wi"]) not in (3, 4):
                raise ValueError(f"sparse capacity needs a gated MLP at {'/'.join(path)} (params "
                                 "{'wi': [D, 2, F], 'wo': [F, D]}); use relu_glu or swiglu")
            mlp = {"wi": par["wi"], "wo": par["wo"]}
            w = jax.vmap(prepare)(mlp) if jnp.ndim(par["wi"]) == 4 else prepare(mlp)
            out.update(gate_rows=w.w_gate_FD, up_rows=w.w_up_FD, down_norm=w.down_norm_F, up_norm=w.up_norm_F)
        return out

    return walk(sparsity, params, ())


def _gate_fn(activation: str):
    if activation not in _GATE_FNS:
        raise ValueError(f"sparse_ffn supports the gated activations {sorted(_GATE_FNS)}, got "
                         f"{activation!r}")
    return _GATE_FNS[activation]


def _below(compare: str):
    if compare not in ("lt", "le"):
        raise ValueError(f"compare={compare!r}; choose 'lt' (reference) or 'le'")
    return (lambda x, t: x <= t) if compare == "le" else (lambda x, t: x < t)


def _keep(a, gate, down_norm, threshold, gate_threshold, below):
    """The mlp.py rule on a subset of neurons: bool mask, True = kept."""
    t = jnp.asarray(threshold, jnp.float32)
    keep = ~below(jnp.abs(a.astype(jnp.float32)), t / down_norm)
    if gate_threshold is not None:
        keep &= ~below(jnp.abs(gate.astype(jnp.float32)), jnp.asarray(gate_threshold, jnp.float32))
    return keep


def dense_masked_ffn(w: SparseFFNWeights, x_D, threshold, *, activation: str, compare: str = "lt",
                     gate_threshold=None):
    """The masked dense FFN (all 3*D*F multiply-adds): y [D]."""
    return _dense(w, x_D, threshold, activation, gate_threshold, _below(compare))[0]


def _dense(w, x_D, threshold, activation, gate_threshold, below):
    """(y [D], number of kept neurons, kept activations [F]) of the masked dense FFN."""
    g_F = _gate_fn(activation)(w.w_gate_FD @ x_D)
    a_F = g_F * (w.w_up_FD @ x_D)
    keep = _keep(a_F, g_F, w.down_norm_F, threshold, gate_threshold, below)
    a_F = jnp.where(keep, a_F, 0)
    return a_F @ w.w_down_FD, keep.sum(), a_F


def predicted_ffn(w: SparseFFNWeights, x_D, idx_C, valid_C, threshold, *, activation: str,
                  compare: str = "lt", gate_threshold=None):
    """FFN over the neurons ``idx_C`` only (where ``valid_C``), gate included: 3*D*C multiply-adds.

    What an activation predictor would run: exact iff every neuron that survives the threshold
    rule is in the set. ``sparse_ffn`` calls it with the gate already computed."""
    g_C = _gate_fn(activation)(_rows(w.w_gate_FD, idx_C) @ x_D)
    return _gathered(w, x_D, idx_C, valid_C, g_C, threshold, gate_threshold, _below(compare))[0]


def _rows(w_FD, idx_C, is_sorted=False):
    """Rows ``idx_C`` (in range [0, F)) of w, without bounds handling (the fastest gather)."""
    return w_FD.at[idx_C].get(mode="promise_in_bounds", indices_are_sorted=is_sorted)


def _one_token(x_D, capacity: int, F: int, name: str):
    """x as [D] after checking it is one token and 0 < capacity <= F."""
    shape = jnp.shape(x_D)
    if jnp.size(x_D) != shape[-1]:
        raise ValueError(f"{name} is for one token (batch 1): x has shape {shape}")
    if not 0 < capacity <= F:
        raise ValueError(f"capacity must be in [1, F={F}], got {capacity}")
    return jnp.reshape(x_D, (shape[-1],))


def _gathered(w, x_D, idx_C, valid_C, g_C, threshold, gate_threshold, below, is_sorted=False):
    a_C = g_C * (_rows(w.w_up_FD, idx_C, is_sorted) @ x_D)
    keep = valid_C & _keep(a_C, g_C, w.down_norm_F[idx_C], threshold, gate_threshold, below)
    a_C = jnp.where(keep, a_C, 0)
    return a_C @ _rows(w.w_down_FD, idx_C, is_sorted), keep.sum(), a_C


def candidates(w: SparseFFNWeights, x_D, g_F, threshold, *, compare: str = "lt", gate_threshold=None):
    """bool [F]: neurons not provably zeroed before their up projection is computed."""
    below = _below(compare)
    g32 = jnp.abs(g_F.astype(jnp.float32))
    bound_F = g32 * jnp.linalg.norm(x_D.astype(jnp.float32)) * w.up_norm_F * (1 + BOUND_MARGIN)
    cand = (g_F != 0) & ~below(bound_F, jnp.asarray(threshold, jnp.float32) / w.down_norm_F)
    if gate_threshold is not None:
        cand &= ~below(g32, jnp.asarray(gate_threshold, jnp.float32))
    return cand


def sparse_ffn(w: SparseFFNWeights, x_D, threshold, *, activation: str, capacity: int,
               compare: str = "lt", gate_threshold=None, return_stats: bool = False,
               return_acts: bool = False):
    """The masked FFN output y [D] (x_D: [D], or [1, D] / [1, 1, D] for one decoded token).

    ``threshold`` is this layer's CETT threshold t (a scalar; 0 = dense); ``capacity`` (static) the
    number of neurons gathered (choose it a little above the expected candidate count); more
    candidates than that fall back to the dense masked computation. ``return_acts`` adds the kept
    activations [F] (a_j where neuron j is kept, 0 elsewhere: on the gathered branch the other
    neurons' a_j are never computed); ``return_stats`` then adds
    ``{"candidates": int, "kept": int, "sparse": bool}``."""
    shape, F = jnp.shape(x_D), w.w_gate_FD.shape[0]
    x_D = _one_token(x_D, capacity, F, "sparse_ffn")
    below = _below(compare)
    g_F = _gate_fn(activation)(w.w_gate_FD @ x_D)
    cand_F = candidates(w, x_D, g_F, threshold, compare=compare, gate_threshold=gate_threshold)
    count = cand_F.sum()

    def sparse(_):
        # padding slots repeat F - 1 so the indices stay sorted; they are masked out by valid_C
        (idx_C,) = jnp.nonzero(cand_F, size=capacity, fill_value=F - 1)
        valid_C = jnp.arange(capacity) < count
        y, kept, a_C = _gathered(w, x_D, idx_C, valid_C, g_F[idx_C], threshold, gate_threshold, below, True)
        if not return_acts:
            return y, kept
        # padding slots hold a_C = 0, so adding them at F - 1 changes nothing
        return y, kept, jnp.zeros((F,), a_C.dtype).at[idx_C].add(a_C, mode="promise_in_bounds")

    def dense(_):
        return _dense(w, x_D, threshold, activation, gate_threshold, below)[:3 if return_acts else 2]

    use_sparse = count <= capacity
    y_D, kept, *acts = jax.lax.cond(use_sparse, sparse, dense, None)
    out = (y_D.reshape(shape),) + tuple(acts)
    if return_stats:
        out += ({"candidates": count, "kept": kept, "sparse": use_sparse},)
    return out[0] if len(out) == 1 else out


def capacity_for(ratio: float, F: int, margin: float = 1.25, multiple: int = 8) -> int:
    """A capacity for an expected candidate ratio: ``margin`` x ratio x F, rounded up to a multiple."""
    c = int(-(-ratio * margin * F // multiple) * multiple)
    return max(multiple, min(F, c))


def capacity_from_counts(counts, F: int, quantile: float = 0.95, multiple: int = 8) -> int:
    """A capacity from observed candidate counts (e.g. ``generate(..., return_sparse_stats=True)``'s
    ``sparse_stats["candidates"]`` of a calibration run with capacity F, one count per decode step
    and MLP): their ``quantile`` rounded up to a multiple of ``multiple``, within [multiple, F].
    The counts are heavy-tailed, so a capacity sized for the mean overflows (and falls back to the
    dense MLP) on many steps; this one overflows on at most 1 - quantile of the observed ones."""
    import numpy as np
    c = np.asarray(counts).ravel()
    if not c.size:
        raise ValueError("capacity_from_counts needs at least one observed candidate count")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1]; got {quantile}")
    q = float(np.quantile(c, quantile, method="higher"))
    return max(multiple, min(F, int(-(-q // multiple) * multiple)))


# ----------------------------------------------------------------------------- activation predictor

def predictor_scores(pred, x):
    """Predictor logits [..., F] for inputs x [..., D] (``pred``: a mapping of ``PREDICTOR_LEAVES``)."""
    x = jnp.asarray(x, jnp.float32)
    return (x @ pred["pred_in"]) @ pred["pred_out"] + pred["pred_bias"]


def predicted_sparse_ffn(w: SparseFFNWeights, x_D, pred, threshold, *, activation: str, capacity: int,
                         compare: str = "lt", gate_threshold=None, return_stats: bool = False,
                         return_acts: bool = False):
    """``sparse_ffn``'s outputs with the C = ``capacity`` neurons the predictor scores highest in
    place of the exact candidates (gate rows gathered too, no dense fallback): approximate, exact
    iff every neuron the threshold rule keeps is among them. Stats: ``candidates`` = C,
    ``kept``, ``sparse`` = True."""
    shape, F = jnp.shape(x_D), w.w_gate_FD.shape[0]
    x_D = _one_token(x_D, capacity, F, "predicted_sparse_ffn")
    _, idx_C = jax.lax.top_k(predictor_scores(pred, x_D), capacity)
    idx_C = jnp.sort(idx_C)  # sorted rows gather faster
    g_C = _gate_fn(activation)(_rows(w.w_gate_FD, idx_C, True) @ x_D)
    y, kept, a_C = _gathered(w, x_D, idx_C, jnp.ones((capacity,), bool), g_C, threshold,
                             gate_threshold, _below(compare), True)
    out = (y.reshape(shape),)
    if return_acts:
        out += (jnp.zeros((F,), a_C.dtype).at[idx_C].set(a_C, mode="promise_in_bounds"),)
    if return_stats:
        out += ({"candidates": jnp.int32(capacity), "kept": kept, "sparse": jnp.bool_(True)},)
    return out[0] if len(out) == 1 else out


def fit_predictor(x_ND, keep_NF, *, rank: int = 64, steps: int = 300, lr: float = 1e-2,
                  seed: int = 0) -> dict:
    """A low-rank activation predictor fitted to calibration data: x_ND the MLP inputs of N tokens,
    keep_NF whether each neuron survived the threshold rule there. Full-batch Adam on the mean
    logistic loss, positives weighted by (negatives / positives) so rare active neurons count as
    much as the inactive majority; P_in ~ N(0, 1/D), P_out = 0, b = 0 at the start. Returns the
    ``PREDICTOR_LEAVES`` (float32)."""
    import optax
    x = jnp.asarray(x_ND, jnp.float32)
    y = jnp.asarray(keep_NF, jnp.float32)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise ValueError(f"fit_predictor needs x [N, D] and keep [N, F] with N > 0, got {x.shape} and "
                         f"{y.shape}")
    (N, D), F = x.shape, y.shape[1]
    if not 0 < rank <= min(D, F):
        raise ValueError(f"rank must be in [1, min(D, F)={min(D, F)}], got {rank}")
    pos = jnp.clip(y.mean(), 1e-6, 1 - 1e-6)
    weight = jnp.where(y > 0, (1 - pos) / pos, 1.0)
    pred = {"pred_in": jax.random.normal(jax.random.key(seed), (D, rank)) / jnp.sqrt(D),
            "pred_out": jnp.zeros((rank, F)), "pred_bias": jnp.zeros((F,))}
    tx = optax.adam(lr)

    def loss(p):
        return jnp.mean(weight * optax.sigmoid_binary_cross_entropy(predictor_scores(p, x), y))

    def step(carry, _):
        p, opt = carry
        g = jax.grad(loss)(p)
        upd, opt = tx.update(g, opt, p)
        return (optax.apply_updates(p, upd), opt), None

    (pred, _), _ = jax.lax.scan(step, (pred, tx.init(pred)), None, length=steps)
    return pred


def predictor_recall(pred, x_ND, keep_NF, capacity: int) -> dict:
    """How well the top-``capacity`` predicted neurons cover the kept ones, over N tokens:
    ``recall`` (kept neurons inside the top-C / all kept, pooled), ``exact_share`` (tokens whose
    every kept neuron is inside: there the predicted FFN equals the masked dense one) and
    ``kept_mean`` (kept neurons per token)."""
    import numpy as np
    scores = np.asarray(predictor_scores(pred, x_ND))
    keep = np.asarray(keep_NF, bool)
    top = np.argpartition(-scores, capacity - 1, axis=1)[:, :capacity]
    chosen = np.zeros_like(keep)
    np.put_along_axis(chosen, top, True, axis=1)
    hit = (chosen & keep).sum(1)
    total = keep.sum(1)
    return {"recall": float(hit.sum() / max(total.sum(), 1)),
            "exact_share": float(np.mean(hit == total)), "kept_mean": float(total.mean())}


def predictor_capacity(pred, x_ND, keep_NF, recall: float = 0.999, multiple: int = 8) -> int:
    """The smallest capacity (a multiple of ``multiple``, at most F) at which the predictor's
    top-C neurons hold at least ``recall`` of the kept neurons of the given tokens (pooled): the
    ``recall`` quantile of the kept neurons' ranks in the predictor's order, plus one, rounded up."""
    import numpy as np
    scores = np.asarray(predictor_scores(pred, x_ND))
    keep = np.asarray(keep_NF, bool)
    F = keep.shape[1]
    if not keep.any():
        return multiple
    rank = np.argsort(np.argsort(-scores, axis=1, kind="stable"), axis=1, kind="stable")
    need = int(np.ceil(np.quantile(rank[keep], recall, method="higher"))) + 1
    return int(min(F, max(multiple, -(-need // multiple) * multiple)))
