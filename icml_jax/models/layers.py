"""Shared building blocks: logically-partitioned params, dtypes, RMSNorm, layer-order sorting."""
import math
import re
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
           "float64": jnp.float64}


def get_dtype(name: str, key: str = "config.model.dtype"):
    """The dtype of a config string. ``float64`` (for parity checks against fp64 reference runs)
    needs JAX's 64-bit mode, without which JAX would silently compute in float32."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} for `{key}`; choose one of {sorted(_DTYPES)}")
    if name == "float64" and not jax.config.read("jax_enable_x64"):
        raise ValueError(f"{key}='float64' needs JAX's 64-bit mode (without it JAX computes in "
                         "float32): set JAX_ENABLE_X64=1, call jax.config.update('jax_enable_x64', "
                         "True) first, or build and run the model inside `with jax.enable_x64(True):`")
    return _DTYPES[name]


def wide_dtype(dtype) -> jnp.dtype:
    """At least float32, the precision of norms, softmax, positions and logits: bfloat16, float16
    and float32 give float32 (as before float64 existed), float64 stays float64."""
    return jnp.promote_types(dtype, jnp.float32)


def upcast(x: jax.Array) -> jax.Array:
    """``x`` in ``wide_dtype(x.dtype)``."""
    return x.astype(wide_dtype(x.dtype))


def param(module: nn.Module, name: str, init_fn, shape: Sequence[int], axes: Sequence[str | None],
          dtype):
    """Creates a param annotated with logical axis names (one name per dim)."""
    assert len(shape) == len(axes), (name, shape, axes)
    return module.param(name, nn.with_logical_partitioning(init_fn, tuple(axes)), tuple(shape), dtype)


def layer_order_key(path) -> list:
    """Sort key for a param / intermediates path (keys, or jax key-path entries) that compares the
    numbers inside names as numbers, so ``layer_2`` sorts before ``layer_10``."""
    return [tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(k))) for k in path]


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Logical sharding constraint on an activation (a no-op outside a mesh context)."""
    return nn.with_logical_constraint(x, tuple(axes))


def materialize(fn, x):
    """``fn(x)`` (a pytree of arrays), computed once into buffers by XLA:CPU: inside a conditional
    whose two branches are both ``fn`` (its predicate, x's first element == itself, is known only
    at run time, so XLA keeps the boundary and cannot fuse fn into each consumer). For cheap
    tables that many large elementwise fusions read (the RoPE sines and cosines: recomputed per
    element of q and k otherwise). Plain ``fn(x)`` on other backends (a GPU conditional reads its
    predicate on the host) and for an empty x."""
    if jax.default_backend() != "cpu" or x.size == 0:
        return fn(x)
    first = x.reshape(-1)[0].astype(jnp.float32)  # a float compare is never folded (NaN)
    return jax.lax.cond(first == first, fn, fn, x)


ROW_CHUNK = 32  # XLA:CPU's tree-reduction rewrite leaves reductions of up to this many alone


def _fold(op, x, axis: int, n: int):
    """x split into n equal parts along ``axis``, combined elementwise with ``op`` (one fused
    pass): the axis shrinks n-fold."""
    parts = jnp.split(x, n, axis=axis)
    y = parts[0]
    for p in parts[1:]:
        y = op(y, p)
    return y


def _fold_chunks(op, x):
    """x [..., S] -> [..., c]: its chunks of c = ``ROW_CHUNK`` combined elementwise with ``op``
    (x itself when S <= c or c does not divide S)."""
    S, c = x.shape[-1], ROW_CHUNK
    return x if S <= c or S % c else _fold(op, x, -1, S // c)


def row_max(x):
    """max over the last axis (keepdims), as an elementwise fold of 32-wide chunks and one short
    reduction. XLA:CPU rewrites a reduction over more than 32 elements into a reduce-window +
    reduce pair that cannot fuse with its producer (the producer is written out for it), and it
    merges a reduce of a reduce back into one; an elementwise fold fuses into the reduction."""
    return jnp.max(_fold_chunks(jnp.maximum, x), axis=-1, keepdims=True)


@jax.custom_jvp
def row_sum(x):
    """sum over the last axis (keepdims), formed like :func:`row_max` (the summation order differs
    from ``jnp.sum``'s in the last bits); its derivative is ``jnp.sum``'s (a broadcast)."""
    return jnp.sum(_fold_chunks(jnp.add, x), axis=-1, keepdims=True)


@row_sum.defjvp
def _row_sum_jvp(primals, tangents):
    return row_sum(primals[0]), jnp.sum(tangents[0], axis=-1, keepdims=True)


def col_sum(x):
    """x [..., D] summed over all leading axes -> [D]: each run of ``ROW_CHUNK`` consecutive rows
    is first summed elementwise (one fused pass), so the reduction XLA:CPU rewrites into a
    reduce-window reads a 32x smaller array."""
    x = x.reshape(-1, x.shape[-1])
    N, c = x.shape[0], ROW_CHUNK
    if N > c and N % c == 0:  # rows n*c + j, j < c, summed over j: each run of rows stays local
        x = _fold(jnp.add, x.reshape(N // c, c, x.shape[-1]), 1, c)[:, 0]  # to its device when
    return jnp.sum(x, axis=0)  # the rows are batch-sharded


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis with a learned gain (Llama style, eps inside sqrt).

    The statistic is computed in (at least) float32; the result is cast back to ``dtype``."""
    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x):
        scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,),
                      self.param_dtype)
        return rms_norm(x, scale, self.eps, jnp.dtype(self.dtype))


def rms_norm(x, scale, eps: float, dtype):
    """(x / sqrt(mean(x^2) + eps)) * scale over the last axis, in (at least) float32, cast to
    ``dtype``; a hand-written VJP whose row sums are :func:`row_sum`'s and whose gain gradient
    folds the rows in 32 blocks before reducing (autodiff's reductions over the D features and
    over the B*T rows each became an unfusable reduce-window pass on XLA:CPU)."""
    return _rms_norm(eps, dtype, x, scale)


def _rms_norm_fwd(eps, dtype, x, scale):
    x32 = upcast(x)
    r = jax.lax.rsqrt(row_sum(x32 * x32) / x.shape[-1] + eps)
    return ((x32 * r) * upcast(scale)).astype(dtype), (x, r, scale)


def _rms_norm_bwd(eps, dtype, res, dy):
    x, r, scale = res
    xhat, dy32 = upcast(x) * r, upcast(dy)
    dxhat = dy32 * upcast(scale)
    dx = r * (dxhat - xhat * (row_sum(dxhat * xhat) / x.shape[-1]))
    return dx.astype(x.dtype), col_sum(dy32 * xhat).astype(scale.dtype)


_rms_norm = jax.custom_vjp(lambda eps, dtype, x, scale: _rms_norm_fwd(eps, dtype, x, scale)[0],
                           nondiff_argnums=(0, 1))
_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


MATMUL_NAME = "matmul"  # checkpoint name of matmul's outputs (remat policies save them like dots)


def matmul(x, w):
    """``x [..., D] @ w [D, *out] -> [..., *out]`` as one dot over the flattened rows of x, whose
    backward pass transposes the narrower operand for the weight gradient.

    The weight gradient contracts the rows of both x and the output cotangent dy, so one of them
    must be transposed for the CPU matmul. XLA's default for an einsum transposes whichever its
    operand order gives, often the wider one (e.g. the 2F-wide gate/up cotangent, written
    transposed beside its row-major copy); here it is the narrower one (min(D, out) wide).
    w keeps its axes (a sharded axis inside a flattened one would make GSPMD gather w); x's
    leading axes are flattened (only the major one, batch, is sharded by our rules).
    The output carries the checkpoint name ``MATMUL_NAME``: remat's dot policies do not see into
    a custom VJP, so ``models.decoder``'s "dots" policies save it by name."""
    return checkpoint_name(_matmul(x, w), MATMUL_NAME)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


@jax.custom_vjp
def _matmul(x, w):
    y = jax.lax.dot_general(_rows(x), w, (((1,), (0,)), ((), ())))  # [N, *out]
    return y.reshape(x.shape[:-1] + w.shape[1:])


def _matmul_fwd(x, w):
    return _matmul(x, w), (x, w)


def _matmul_bwd(res, dy):
    x, w = res
    x2, out = _rows(x), tuple(range(1, w.ndim))
    dy2 = dy.reshape((x2.shape[0],) + w.shape[1:])
    dx = jax.lax.dot_general(dy2, w, ((out, out), ((), ())))  # [N, D]
    if x.shape[-1] <= math.prod(w.shape[1:]):  # transpose x (D wide): dw = x^T dy
        dw = jax.lax.dot_general(x2, dy2, (((0,), (0,)), ((), ())))  # [D, *out]
    else:  # transpose dy (out wide): dw = (dy^T x)^T
        dw = jnp.moveaxis(jax.lax.dot_general(dy2, x2, (((0,), (0,)), ((), ()))), -1, 0)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)
