"""The training attention core and the reductions and tables around it: ``attention.causal_attention``
(hand-written VJP) against the autodiff of the blocked einsum attention, ``layers.row_max`` /
``layers.row_sum`` / ``layers.col_sum`` against jnp's reductions and the compiled program they exist
for, ``layers.rms_norm`` (hand-written VJP) against autodiff, ``layers.materialize`` (the RoPE
tables computed once), and that the transformer and the RMT are wired to the core and the norm."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.models import attention as A
from icml_jax.models import build_model
from icml_jax.models.layers import col_sum, materialize, rms_norm, row_max, row_sum, upcast
from tests.jax_env import entry_computation

B, T, G, R, K = 2, 16, 2, 2, 8


def _inputs(dtype=jnp.float32, window=5):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (B, T, G, R, K), dtype)
    k, v = (jax.random.normal(kk, (B, T, G, K), dtype) for kk in ks[1:3])
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * T])  # packed documents in row 0
    pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(T))])
    mask = A.attention_mask(seg, seg, idx, idx, pos, pos, window)
    return q, k, v, mask, jax.random.normal(ks[3], (B, T, G, R, K), dtype)


def _reference(q, k, v, mask, bias, n):
    """Autodiff's version: the einsum softmax attention per causal query block i (its queries,
    keys [0, end of the block)), concatenated; n = 1 is the plain masked attention."""
    c = q.shape[1] // n
    outs = []
    for i in range(n):
        lo, hi = i * c, (i + 1) * c
        b = None if bias is None else bias[..., lo:hi, :hi]
        outs.append(A._softmax_attend(q[:, lo:hi], k[:, :hi], v[:, :hi], mask[:, lo:hi, :hi], b))
    return jnp.concatenate(outs, axis=1)


def _jit_vjp(fn, args, do):
    """(fn(*args), its VJP at ``do``), one jitted program (op-by-op dispatch of the blocked
    attention's many small ops took ~3x longer than compiling it)."""
    def both(*a):
        out, vjp = jax.vjp(fn, *a)
        return out, vjp(do)
    return jax.jit(both)(*args)


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("bias_shape", [None, (B, G, R, T, T), (1, G, R, T, T), (B, 1, 1, T, T),
                                        (G, R, T, T), (T, T)])
def test_causal_attention_values_and_vjp_equal_autodiff(n, bias_shape):
    """Outputs and the gradients of q, k, v and the bias (ALiBi-style, full or broadcast) equal
    the autodiff of the blocked einsum attention to float32 rounding: packed documents, a
    sliding window, GQA, one block or four."""
    q, k, v, mask, do = _inputs()
    bias = None if bias_shape is None else jax.random.normal(jax.random.key(5), bias_shape)
    args = (q, k, v) if bias is None else (q, k, v, bias)
    (want, g_want), (got, g_got) = (
        _jit_vjp(lambda *a, f=f: f(*a[:3], mask, a[3] if len(a) > 3 else None, n), args, do)
        for f in (_reference, A.causal_attention))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def test_causal_attention_bfloat16_close_to_autodiff():
    """bf16 inputs: same output dtype and values within bf16 rounding of the autodiff path (the
    backward runs in float32 here, so it is at least as exact)."""
    q, k, v, mask, do = _inputs(jnp.bfloat16)
    want, g_want = _jit_vjp(lambda *a: _reference(*a, mask, None, 4), (q, k, v), do)
    got, g_got = _jit_vjp(lambda *a: A.causal_attention(*a, mask, None, 4), (q, k, v), do)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.float32(got), np.float32(want), atol=3e-2)
    for a, b in zip(g_got, g_want):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=6e-2)


@pytest.mark.parametrize("S", [7, 32, 96, 100])
def test_row_reductions_equal_jnp(S):
    """row_max / row_sum (chunked when 32 divides S) equal jnp.max / jnp.sum, and row_sum's
    gradient is the broadcast."""
    x = jax.random.normal(jax.random.key(1), (3, 5, S))
    np.testing.assert_array_equal(row_max(x), jnp.max(x, axis=-1, keepdims=True))
    np.testing.assert_allclose(row_sum(x), jnp.sum(x, axis=-1, keepdims=True), rtol=1e-6, atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(row_sum(x) * jnp.arange(5.0)[:, None]))(x)
    np.testing.assert_array_equal(g, jnp.broadcast_to(jnp.arange(5.0)[:, None], x.shape))


def test_attention_step_has_no_reduce_window():
    """The compiled forward and backward of the core at S = 128 keys (> 32) contain no
    reduce-window: XLA:CPU rewrites a long reduction into one (unfusable, its input is written
    out), which ``jnp.max`` / ``jnp.sum`` over the keys get and the chunked fold does not."""
    Tl = 128
    ks = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(ks[0], (1, Tl, 1, 2, 16))
    k, v = (jax.random.normal(kk, (1, Tl, 1, 16)) for kk in ks[1:])
    mask = jnp.tril(jnp.ones((Tl, Tl), bool))[None]
    loss = lambda f, *a: jnp.sum(f(*a, mask, None, 2) ** 2)  # noqa: E731

    def hlo(f):
        return jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()

    assert "reduce-window" in hlo(_reference)  # the rewrite this guards against happens here
    assert "reduce-window" not in hlo(A.causal_attention)


def test_materialize_is_a_runtime_boundary_with_fn_values():
    """materialize(fn, x) == fn(x); on the CPU it is one conditional (both branches fn), and an
    empty x is computed inline. The RoPE tables of one position per row (decode) skip it."""
    from icml_jax.models.positions import rotary_tables
    x = jnp.arange(24.0).reshape(2, 3, 4)
    fn = lambda a: (jnp.cos(a), jnp.sin(a))  # noqa: E731
    for got, want in zip(materialize(fn, x), fn(x)):
        np.testing.assert_array_equal(got, want)
    compiled = lambda f, *a: jax.jit(f).lower(*a).compile().as_text()  # noqa: E731
    assert "conditional(" in compiled(lambda a: materialize(fn, a), x)
    assert "conditional(" not in compiled(lambda a: materialize(fn, a), x[:, :0])
    inv = jnp.asarray([1.0, 0.1])
    pos = jnp.arange(6).reshape(2, 3)
    assert "conditional(" in compiled(lambda p: rotary_tables(p, inv, jnp.float32), pos)
    assert "conditional(" not in compiled(lambda p: rotary_tables(p, inv, jnp.float32), pos[:, :1])


def test_rope_tables_computed_once_per_layer():
    """In the compiled gradient of a RoPE decoder the sines are computed in the tables only (one
    table per layer shared by q and k, inside the conditional's two branches); without
    ``materialize`` XLA fused a sine into every consumer of q's and k's rotation."""
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    model = build_model(c)
    tokens = jnp.zeros((2, 12), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]  # compiled, never run

    def loss(p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    assert "conditional(" in entry_computation(text)
    assert len(re.findall(r"\ssine\(", text)) <= 2 * c.num_layers, len(re.findall(r"\ssine\(", text))


def test_causal_attention_row_scale_equals_scaled_queries():
    """row_scale [B] replaces K^-0.5 row by row (the RMT's scale / (layer + 1)): equal to the
    default path with q multiplied by row_scale * sqrt(K), values and q/k/v gradients."""
    q, k, v, mask, do = _inputs()
    rs = jnp.asarray([0.2, 0.05])
    got, g_got = _jit_vjp(lambda q, k, v: A.causal_attention(q, k, v, mask, None, 4, row_scale=rs), (q, k, v), do)
    f = (rs * K ** 0.5)[:, None, None, None, None]
    want, g_want = _jit_vjp(lambda q, k, v: A.causal_attention(q * f, k, v, mask, None, 4), (q, k, v), do)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)


def _rms_autodiff(x, scale, eps, dtype):
    x32 = upcast(x)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * upcast(scale)).astype(dtype)


@pytest.mark.parametrize("shape,dtype", [((2, 64, 96), jnp.float32), ((3, 5, 16), jnp.float32),
                                         ((2, 64, 96), jnp.bfloat16)])
def test_rms_norm_values_and_vjp_equal_autodiff(shape, dtype):
    """rms_norm's output and its x / gain gradients equal the autodiff of the plain formula (the
    64-row case folds the gain gradient's rows, the 15-row one does not); bf16 in and out."""
    kx, kg, kd = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, shape, dtype)
    g = 1 + 0.1 * jax.random.normal(kg, shape[-1:])
    dy = jax.random.normal(kd, shape, dtype)
    want, g_want = _jit_vjp(lambda x, g: _rms_autodiff(x, g, 1e-5, dtype), (x, g), dy)
    got, g_got = _jit_vjp(lambda x, g: rms_norm(x, g, 1e-5, dtype), (x, g), dy)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.float32(got), np.float32(want), **tol)
    for a, b in zip(g_got, g_want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(np.float32(a), np.float32(b), **tol)


@pytest.mark.parametrize("shape", [(4, 16, 8), (3, 5, 8), (64, 3)])
def test_col_sum_equals_sum_over_leading_axes(shape):
    x = jax.random.normal(jax.random.key(4), shape)
    np.testing.assert_allclose(col_sum(x), jnp.sum(x.reshape(-1, shape[-1]), axis=0), rtol=1e-5, atol=1e-5)


def test_causal_attention_refuses_inputs_outside_its_contract():
    """Keys that are not the queries' own (S != T), a block count that does not divide T and a
    bias whose last axes are not (T, S) are errors, not silently wrong attention."""
    q, k, v, mask, _ = _inputs()
    with pytest.raises(ValueError, match="S = T"):
        A.causal_attention(q, jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1), mask, None, 4)
    with pytest.raises(ValueError, match="n dividing T"):
        A.causal_attention(q, k, v, mask, None, 3)
    with pytest.raises(ValueError, match="must end in"):
        A.causal_attention(q, k, v, mask, jnp.zeros((B, G, R, T, 1)), 4)


@pytest.mark.parametrize("preset", ["configs/lm.py:tiny", "configs/rmt.py:tiny"])
def test_the_models_train_through_the_core_and_the_norm_vjp(monkeypatch, preset):
    """The transformer and the RMT run their training attention through ``causal_attention`` once
    per layer and every RMSNorm / rms_matrix norm through ``rms_norm`` (values are the same either
    way, so only the wiring shows a revert to plain jnp ops)."""
    from icml_jax.models import layers, rmt
    calls = {"attn": 0, "norm": 0}

    def spy(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped

    core, norm = spy("attn", A.causal_attention), spy("norm", layers.rms_norm)
    for mod in (A, rmt):
        monkeypatch.setattr(mod, "causal_attention", core)
    for mod in (layers, rmt):
        monkeypatch.setattr(mod, "rms_norm", norm)
    c = load_config(preset, unlocked=True).model
    model = build_model(c)
    tokens = jnp.zeros((2, 32), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    calls.update(attn=0, norm=0)
    jax.eval_shape(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2)), params)
    assert calls == {"attn": c.num_layers, "norm": 2 * c.num_layers + 1}, calls
