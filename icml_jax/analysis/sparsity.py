"""Activation sparsity: CETT, per-layer thresholds, CETT-PPL-p%, baselines and the sparsing laws.

Method page: ``docs/methods/sparsity_cett.md`` (Luo, Song et al., *Sparsing Law*, ICML 2025); reference code
``thunlp/SparsingLaw`` @ a6d9b4c (``src/model_utils.py``, ``src/calc_activation.py``) and the fit
data ``Raincleared-Song/SparsingLawData`` @ 1cab443 (``calc.py``, ``show.py``).

Axis letters: N tokens (valid tokens of all batches, pooled), F ffn hidden, D model width, K grid
points, L layers, B batch, T length.

  layers = collect_mlp(model, params, batch)              # [(acts_NF, w_down_FD)] per layer
  t = threshold_for_cett(*layers[0], 0.2)                 # the reference's grid + binary search
  res = cett_ppl_search(model, params, batches, p=1.0)    # res["activation_ratio"], res["thresholds"]
  fit_relu_law(D_billions, ratios)                        # {"alpha", "b", "c", "A0"}

Definitions (a_j = the per-neuron activation that multiplies row j of W_down, see models/mlp.py):
  n_j     = |a_j| * ||W_down[j]||                                   (neuron output norm)
  CETT(t) = mean_tokens ||sum_{j: n_j <= t} a_j W_down[j]|| / ||sum_j a_j W_down[j]||
  sparse inference zeroes neuron j iff n_j < t_l, i.e. |a_j| < t_l / ||W_down[j]|| (mlp.py)

Findings from reading the reference (the spec's [unverified] / quirk items, checked against it):
  * Grid: ``torch.linspace(min n, q, 65536)`` in float32; q = ``quantile(0.99)`` (linear
    interpolation) of ``n.view(-1)[::max(numel // 65536, 1)]`` (row-major token x neuron order).
    We reproduce torch's two-sided linspace formula, so grids agree to float32 rounding.
  * Binary search: ``left, right = 0, K - 1``; while left < right: mid = (left + right) // 2,
    CETT(G[mid]) > c ? right = mid : left = mid + 1; return ``G[left - 1]``. The last grid index
    is never evaluated, so when no evaluated point exceeds c the result is G[K - 2] (not the
    0.99-quantile); i* = 0 returns G[-1] = G[K - 1] (the wrap; we log a warning).
  * The comparison is float32 CETT > float32(c) (torch casts the Python float to the tensor dtype).
  * Tokens whose dense FFN output is exactly zero make the reference's CETT NaN (0 / 0), which
    silently drives the search to G[K - 2]. We leave such tokens out of the mean and log a warning
    (deviation; it never happens with SiLU and needs a token whose every ReLU gate is off).
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
  * Fits: the released ``calc.py`` does not fit the power laws; it evaluates hand-tuned parameters
    (``CURVE_PARAM``) and fits only the logarithmic and sigmoid-like baselines with ``curve_fit``.
    ``show.py`` shows how those parameters were found: A0 (and b for ReLU) chosen with sliders so
    that the linearised points ln(b - ln(A - A0)) (ReLU) or ln(A0 - A) (SiLU) lie on the line
    alpha * ln D + ln c (SiLU: -alpha * ln D + ln c). We automate that: for each (A0[, b]) the
    line is the linear least-squares fit of the linearised points; (A0[, b]) are chosen by a
    bounded search minimising the squared error of A itself; then a Levenberg-Marquardt
    ``curve_fit`` of all parameters on A polishes the result (kept only when it lowers the error).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from icml_jax.models.layers import layer_order_key
from icml_jax.models.mlp import TINY_GATE, is_gated
from icml_jax.losses.logps import token_logprobs

GRID_SIZE = 65536
QUANTILE = 0.99
_HI = jax.lax.Precision.HIGHEST
Batch = dict


# ----------------------------------------------------------------------------- checks


def _check_pair(acts_NF, w_down_FD):
    if acts_NF.ndim != 2 or w_down_FD.ndim != 2:
        raise ValueError(f"acts must be [N, F] and w_down [F, D]; got {acts_NF.shape} and {w_down_FD.shape}")
    if acts_NF.shape[1] != w_down_FD.shape[0]:
        raise ValueError(f"acts [N, F={acts_NF.shape[1]}] and w_down [F={w_down_FD.shape[0]}, D] disagree on F")
    if acts_NF.shape[0] == 0:
        raise ValueError("no tokens to analyse (acts has N = 0; are all segment_ids 0?)")


def _check_target(target: float):
    if not 0.0 <= float(target) <= 1.0 or math.isnan(float(target)):
        raise ValueError(f"target CETT must lie in [0, 1]; got {target}")


def _check_rules(index_rule: str, wrap_at_zero: str):
    if index_rule not in ("prev", "first_exceed"):
        raise ValueError(f"cett_threshold_index={index_rule!r}; choose 'prev' (reference) or 'first_exceed'")
    if wrap_at_zero not in ("wrap", "clamp"):
        raise ValueError(f"cett_wrap_at_zero={wrap_at_zero!r}; choose 'wrap' (reference) or 'clamp'")


def check_gated(activation: str, require_gate: bool = True):
    """Raises for an analysis that needs separate act(gate) and up on a plain activation."""
    if require_gate and not is_gated(activation):
        raise ValueError(f"this analysis needs a gated (GLU) MLP with act(gate) and up; activation "
                         f"{activation!r} has no gate (use swiglu or relu_glu)")


# ----------------------------------------------------------------------------- CETT


def neuron_output_norms(acts_NF, w_down_FD) -> jax.Array:
    """n_j = |a_j| * ||W_down[j]||, float32 [N, F]."""
    _check_pair(acts_NF, w_down_FD)
    return _norms(jnp.asarray(acts_NF, jnp.float32), jnp.asarray(w_down_FD, jnp.float32))


def _norms(a_NF, w_FD):
    return jnp.abs(a_NF) * jnp.linalg.norm(w_FD, axis=1)


def _cett_at(a_NF, w_FD, n_NF, ynorm_N, t):
    """CETT at threshold t (float32 scalar); tokens with a zero dense output are left out."""
    tail_ND = jnp.matmul(jnp.where(n_NF > t, 0.0, a_NF), w_FD, precision=_HI)
    ok = ynorm_N > 0
    ratio = jnp.where(ok, jnp.linalg.norm(tail_ND, axis=-1) / jnp.where(ok, ynorm_N, 1.0), 0.0)
    return jnp.sum(ratio) / jnp.sum(ok)


def _dense_out_norm(a_NF, w_FD):
    return jnp.linalg.norm(jnp.matmul(a_NF, w_FD, precision=_HI), axis=-1)


def cett(acts_NF, w_down_FD, threshold: float) -> float:
    """CETT of one layer at threshold t: mean over tokens of the tail-output norm ratio."""
    _check_pair(acts_NF, w_down_FD)
    a, w = jnp.asarray(acts_NF, jnp.float32), jnp.asarray(w_down_FD, jnp.float32)
    return float(_jit_cett(a, w, jnp.float32(threshold)))


@jax.jit
def _jit_cett(a, w, t):
    return _cett_at(a, w, _norms(a, w), _dense_out_norm(a, w), t)


def kept_neurons(acts_NF, w_down_FD, threshold: float, compare: str = "lt") -> np.ndarray:
    """bool [N, F]: the neurons a CETT threshold t keeps, by the rule the MLP applies
    (``models/mlp.py``): neuron j is zeroed iff |a_j| < t / ||W_down[j]|| (``compare="lt"``, the
    reference; ``"le"``: <=, ``config.model.mlp.sparse_compare``)."""
    _check_pair(acts_NF, w_down_FD)
    if compare not in ("lt", "le"):
        raise ValueError(f"compare={compare!r}; choose 'lt' (reference) or 'le'")
    a = jnp.abs(jnp.asarray(acts_NF, jnp.float32))
    bound = jnp.float32(threshold) / jnp.linalg.norm(jnp.asarray(w_down_FD, jnp.float32), axis=1)
    return np.asarray(~(a <= bound) if compare == "le" else ~(a < bound))


def activation_ratio_at(acts_NF, w_down_FD, threshold: float, compare: str = "lt") -> float:
    """One layer's activation ratio at threshold t from arrays: the fraction of (token, neuron)
    entries ``kept_neurons`` keeps (what ``activation_ratio`` reports for a model, per layer)."""
    return float(np.mean(kept_neurons(acts_NF, w_down_FD, threshold, compare)))


# ----------------------------------------------------------------------------- threshold search


def torch_linspace(start, end, steps: int):
    """float32 [steps] with torch's CPU formula: start + i*step for i < steps//2, else
    end - (steps-1-i)*step, step = (end - start) / (steps - 1)."""
    start, end = jnp.float32(start), jnp.float32(end)
    step = (end - start) / jnp.float32(max(steps - 1, 1))
    i = jnp.arange(steps, dtype=jnp.float32)
    return jnp.where(jnp.arange(steps) < steps // 2, start + step * i, end - step * (steps - 1 - i))


def _prepare(a_NF, w_FD, grid_size: int):
    """(n_NF, ||y||_N, grid_K) of one layer: the reference's candidate grid."""
    n_NF = _norms(a_NF, w_FD)
    flat = n_NF.reshape(-1)
    sub = flat[::max(flat.size // grid_size, 1)]
    grid = torch_linspace(flat.min(), jnp.quantile(sub, QUANTILE), grid_size)
    return n_NF, _dense_out_norm(a_NF, w_FD), grid


def _search_index(a_NF, w_FD, n_NF, ynorm_N, grid_K, target):
    """The reference's binary search: first evaluated index i* with CETT(G[i*]) > target (or K-1)."""

    def body(lr):
        left, right = lr
        mid = (left + right) // 2
        exceed = _cett_at(a_NF, w_FD, n_NF, ynorm_N, grid_K[mid]) > target
        return jnp.where(exceed, left, mid + 1), jnp.where(exceed, mid, right)

    left, _ = jax.lax.while_loop(lambda lr: lr[0] < lr[1], body,
                                 (jnp.int32(0), jnp.int32(grid_K.shape[0] - 1)))
    return left


@functools.partial(jax.jit, static_argnames=("grid_size",))
def _prepare_layers(a_LNF, w_LFD, grid_size):
    return jax.vmap(lambda a, w: _prepare(a, w, grid_size))(a_LNF, w_LFD)


@jax.jit
def _search_layers(a_LNF, w_LFD, n_LNF, ynorm_LN, grid_LK, target):
    return jax.vmap(_search_index, in_axes=(0, 0, 0, 0, 0, None))(a_LNF, w_LFD, n_LNF, ynorm_LN,
                                                                 grid_LK, target)


def _pick(grid_K: np.ndarray, i_star: int, index_rule: str, wrap_at_zero: str, where: str) -> float:
    if index_rule == "first_exceed":
        return float(grid_K[i_star])
    if i_star == 0:
        if wrap_at_zero == "clamp":
            return float(grid_K[0])
        logging.warning("CETT search %s: even the smallest grid threshold exceeds the target CETT; "
                        "the reference's index -1 wraps to the 0.99-quantile %.4g (zeroes almost "
                        "everything; cett_wrap_at_zero='clamp' returns the grid minimum)", where,
                        grid_K[-1])
    return float(grid_K[i_star - 1])


class LayerStats:
    """Per-layer data for repeated threshold searches: stacked float32 acts [L, N, F], W_down
    [L, F, D], norms, dense output norms and the candidate grids [L, K] (computed once)."""

    def __init__(self, layers: Sequence[tuple[Any, Any]], grid_size: int = GRID_SIZE):
        if not layers:
            raise ValueError("no MLP layers to analyse")
        for a, w in layers:
            _check_pair(a, w)
        if grid_size < 2:
            raise ValueError(f"grid_size must be >= 2; got {grid_size}")
        self.a = jnp.stack([jnp.asarray(a, jnp.float32) for a, _ in layers])
        self.w = jnp.stack([jnp.asarray(w, jnp.float32) for _, w in layers])
        self.n, self.ynorm, self.grid = _prepare_layers(self.a, self.w, grid_size)
        self.grid_np = np.asarray(self.grid)
        zero = np.asarray(jnp.sum(self.ynorm == 0, axis=1))
        for lid, z in enumerate(zero):
            if z:
                logging.warning("layer %d: %d of %d tokens have a zero FFN output; they are left "
                                "out of the CETT mean (the reference would get NaN)", lid, z,
                                self.a.shape[1])

    def thresholds(self, target: float, index_rule: str = "prev", wrap_at_zero: str = "wrap") -> list[float]:
        """t_l(target) for every layer (the reference's ``calc_thresholds_given_cett``)."""
        _check_target(target)
        _check_rules(index_rule, wrap_at_zero)
        idx = np.asarray(_search_layers(self.a, self.w, self.n, self.ynorm, self.grid,
                                        jnp.float32(target)))
        return [_pick(g, int(i), index_rule, wrap_at_zero, f"layer {lid}, c={target:g}")
                for lid, (g, i) in enumerate(zip(self.grid_np, idx))]


def threshold_for_cett(acts_NF, w_down_FD, target: float, *, grid_size: int = GRID_SIZE,
                       index_rule: str = "prev", wrap_at_zero: str = "wrap") -> float:
    """The layer threshold t for target CETT c, exactly as the reference searches it (see module
    docstring). ``index_rule`` is the spec flag ``cett_threshold_index`` (prev | first_exceed),
    ``wrap_at_zero`` is ``cett_wrap_at_zero`` (wrap | clamp)."""
    _check_target(target)
    _check_rules(index_rule, wrap_at_zero)
    return LayerStats([(acts_NF, w_down_FD)], grid_size).thresholds(target, index_rule, wrap_at_zero)[0]


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
    scanned = bool(model.cfg.get("scan_layers", False))
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
    scanned = bool(model.cfg.get("scan_layers", False))
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
    if model_cfg.get("scan_layers", False):
        return MLPSites([("layers", "mlp")], True, L)
    return MLPSites([(f"layer_{i}", "mlp") for i in range(L)], False, L)


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


def cett_ppl_search(model: nn.Module, params, batches: Sequence[Batch], *, p: float = 1.0,
                    tol: float = 1e-6, grid_size: int = GRID_SIZE, index_rule: str = "prev",
                    wrap_at_zero: str = "wrap", max_iterations: int = 64) -> dict:
    """CETT-PPL-p%: binary search over c in [0, 1] for the largest shared target CETT whose sparse
    model keeps exp(L_sparse - L_dense) < 1 + p/100 (the reference's
    ``calc_cett_for_target_ppl_ratio``), then the activation ratio at the final midpoint.

    Returns {"cett", "activation_ratio", "sparsity", "thresholds" (per layer), "ppl_dense",
    "ppl_sparse", "ppl_ratio", "loss_dense", "loss_sparse", "lower", "upper", "iterations",
    "history" (list of (c, ppl_ratio, activation_ratio))}."""
    if not p > 0:
        raise ValueError(f"p (the allowed PPL increase in %) must be > 0; got {p}")
    if not tol > 0:
        raise ValueError(f"tol must be > 0; got {tol}")
    _check_rules(index_rule, wrap_at_zero)
    batches = list(batches)
    params = _unbox(params)
    layers, sites = collect_mlp_batches(model, params, batches)
    stats = LayerStats(layers, grid_size)
    loss_dense = dense_loss(model, params, batches)
    target_ratio = 1.0 + p / 100.0
    history = []

    def evaluate(c):
        th = stats.thresholds(c, index_rule, wrap_at_zero)
        ev = sparse_eval(model, params, th, batches, sites=sites)
        rho = math.exp(ev["loss"] - loss_dense)
        history.append((c, rho, ev["activation_ratio"]))
        return th, ev, rho

    lower, upper, it = 0.0, 1.0, 0
    while upper - lower > tol and it < max_iterations:
        c = (lower + upper) / 2
        _, _, rho = evaluate(c)
        lower, upper = (c, upper) if rho < target_ratio else (lower, c)
        it += 1
    c = (lower + upper) / 2
    th, ev, rho = evaluate(c)
    return {"cett": c, "activation_ratio": ev["activation_ratio"],
            "sparsity": 1.0 - ev["activation_ratio"], "thresholds": th,
            "ppl_dense": math.exp(loss_dense), "ppl_sparse": math.exp(ev["loss"]), "ppl_ratio": rho,
            "loss_dense": loss_dense, "loss_sparse": ev["loss"], "lower": lower, "upper": upper,
            "iterations": it, "history": history[:-1]}


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


# ----------------------------------------------------------------------------- sparsing laws


def relu_law(D, alpha: float, b: float, c: float, A0: float):
    """ReLU: A(D) = exp(-c * D^alpha + b) + A0 (D in billions of tokens); decreasing, -> A0."""
    return np.exp(-c * np.asarray(D, np.float64) ** alpha + b) + A0


def silu_law(D, alpha: float, c: float, A0: float):
    """SiLU: A(D) = -c * D^(-alpha) + A0 (D in billions of tokens); increasing, -> A0."""
    return -c * np.asarray(D, np.float64) ** (-alpha) + A0


def _line(x, y):
    """Least-squares slope and intercept of y on x (closed form)."""
    xm, ym = x.mean(), y.mean()
    slope = float(np.sum((x - xm) * (y - ym)) / np.sum((x - xm) ** 2))
    return slope, float(ym - slope * xm)


def _check_fit_data(D, A):
    D, A = np.asarray(D, np.float64).reshape(-1), np.asarray(A, np.float64).reshape(-1)
    if D.shape != A.shape or D.size < 4:
        raise ValueError(f"need matching D and A with >= 4 points; got {D.shape} and {A.shape}")
    if np.any(D <= 0) or not np.all(np.isfinite(A)):
        raise ValueError("D must be > 0 (billions of tokens) and A finite")
    if np.unique(D).size < 2:
        raise ValueError("D needs at least two distinct values")
    return D, A


def _sse(f, D, A, *params):
    with np.errstate(all="ignore"):
        r = f(D, *params) - A
    s = float(np.sum(r * r))
    return s if np.isfinite(s) else np.inf


def _polish(f, D, A, p0, keys, valid):
    """Levenberg-Marquardt (``curve_fit``) refinement on A itself, kept only when it lowers the
    squared error and the parameters stay ``valid`` (the form's constraints)."""
    from scipy.optimize import OptimizeWarning, curve_fit
    import warnings
    best = np.asarray(p0, np.float64)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            popt, _ = curve_fit(f, D, A, p0=best, method="lm", maxfev=40000)
        if valid(*popt) and _sse(f, D, A, *popt) < _sse(f, D, A, *best):
            best = popt
    except (RuntimeError, ValueError):
        pass
    out = dict(zip(keys, map(float, best)))
    # the linearised line fit leaves alpha's sign free: data that does not follow the law's
    # direction (e.g. a rising ReLU ratio) gives parameters outside the form, flagged here
    out["valid"] = bool(valid(*best))
    out["mse"] = _sse(f, D, A, *best) / D.size
    out["mae"] = float(np.mean(np.abs(f(D, *best) - A)))
    return out


def fit_silu_law(D, A) -> dict:
    """Fit A = -c * D^(-alpha) + A0 (D in billions): for each A0 > max A the line
    ln(A0 - A) = -alpha ln D + ln c by least squares; A0 by a bounded search on the squared error
    of A; then LM polish. Returns {"alpha", "c", "A0", "valid", "mse", "mae"}; ``valid`` says whether
    the parameters satisfy the form (alpha, c > 0, A0 > max A: increasing towards A0)."""
    from scipy.optimize import minimize_scalar
    D, A = _check_fit_data(D, A)
    x, top, span = np.log(D), float(A.max()), max(float(np.ptp(A)), 1e-12)

    def given(z):  # A0 = max A + span * exp(z); non-finite candidates score inf in _sse
        with np.errstate(all="ignore"):
            A0 = top + span * float(np.exp(z))
            slope, icpt = _line(x, np.log(A0 - A))
            return -slope, float(np.exp(icpt)), A0

    grid = np.linspace(-12.0, 6.0, 73)
    z = grid[int(np.argmin([_sse(silu_law, D, A, *given(g)) for g in grid]))]
    res = minimize_scalar(lambda g: _sse(silu_law, D, A, *given(g)), bounds=(z - 0.25, z + 0.25),
                          method="bounded", options={"xatol": 1e-10})
    return _polish(silu_law, D, A, given(res.x), ("alpha", "c", "A0"),
                   lambda a, c, A0: a > 0 and c > 0 and A0 > top)


def fit_relu_law(D, A) -> dict:
    """Fit A = exp(-c * D^alpha + b) + A0 (D in billions): for each (0 < A0 < min A,
    b > max ln(A - A0)) the line ln(b - ln(A - A0)) = alpha ln D + ln c by least squares;
    (A0, b) from a coarse grid then Nelder-Mead on the squared error of A; then LM polish.
    Returns {"alpha", "b", "c", "A0", "valid", "mse", "mae"}; ``valid`` says whether the
    parameters satisfy the form (alpha, c > 0, 0 <= A0 < min A: decreasing towards A0)."""
    from scipy.optimize import minimize
    D, A = _check_fit_data(D, A)
    x, low = np.log(D), float(A.min())
    if low <= 0:
        raise ValueError(f"the ReLU law needs activation ratios A > 0; min A = {low}")

    def given(z):  # A0 = min A * sigmoid(z0), b = max ln(A - A0) + exp(z1); non-finite -> inf loss
        with np.errstate(all="ignore"):
            A0 = low / (1.0 + float(np.exp(-z[0])))
            b = float(np.log(A - A0).max()) + float(np.exp(z[1]))
            alpha, icpt = _line(x, np.log(b - np.log(A - A0)))
            return alpha, b, float(np.exp(icpt)), A0

    loss = lambda z: _sse(relu_law, D, A, *given(z))  # noqa: E731
    starts = sorted(((loss((z0, z1)), (z0, z1)) for z0 in np.linspace(-4, 10, 15)
                     for z1 in np.linspace(-6, 3, 10)), key=lambda t: t[0])[:3]
    best = min((minimize(loss, np.array(z), method="Nelder-Mead",
                         options={"xatol": 1e-9, "fatol": 1e-22, "maxiter": 3000}) for _, z in starts),
               key=lambda r: r.fun)
    return _polish(relu_law, D, A, given(best.x), ("alpha", "b", "c", "A0"),
                   lambda a, b, c, A0: a > 0 and c > 0 and 0 <= A0 < low)
