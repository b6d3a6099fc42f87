"""CETT on arrays: neuron output norms, the tail-output ratio, the MLP's zeroing rule, and the
reference's threshold search (grid + binary search) for a target CETT.

Axis letters: N tokens (valid tokens of all batches, pooled), F ffn hidden, D model width, K grid
points, L layers.

  n_j     = |a_j| * ||W_down[j]||                                   (neuron output norm)
  CETT(t) = mean_tokens ||sum_{j: n_j <= t} a_j W_down[j]|| / ||sum_j a_j W_down[j]||
  sparse inference zeroes neuron j iff n_j < t_l, i.e. |a_j| < t_l / ||W_down[j]|| (models/mlp.py)

The reference (``thunlp/SparsingLaw`` @ a6d9b4c, ``src/model_utils.py``), as read and checked:
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
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from icml_jax.models.mlp import is_gated

GRID_SIZE = 65536
QUANTILE = 0.99
_HI = jax.lax.Precision.HIGHEST


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
