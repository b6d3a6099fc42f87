"""``icml_jax.models.layers.matmul``: einsum values and gradients, and the layout it exists for (the
train step writes no transposed copy of the MLP's 2F-wide gate/up cotangent)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.models import build_model
from icml_jax.models.layers import matmul


@pytest.mark.parametrize("x_shape,w_shape", [((2, 3, 4), (4, 10)),  # D < out: x transposed
                                             ((2, 3, 12), (12, 5)),  # D > out: dy transposed
                                             ((2, 3, 6), (6, 2, 3, 4))])  # several output axes
def test_matmul_values_and_vjp_equal_einsum(x_shape, w_shape):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    out = "abc"[:len(w_shape) - 1]
    ein = lambda x, w: jnp.einsum(f"BTD,D{out}->BT{out}", x, w)  # noqa: E731
    want, vjp_want = jax.vjp(ein, x, w)
    got, vjp_got = jax.vjp(matmul, x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g = jax.random.normal(kg, want.shape)
    for a, b in zip(vjp_got(g), vjp_want(g)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_train_step_writes_no_transposed_gate_up_cotangent():
    """The gated MLP's [B·T, 2F] pre-activation cotangent is written once, row-major: the weight
    gradient transposes the D-wide input instead (the einsum version wrote a [2F, B·T] copy
    beside it, the largest non-matmul thunks of the `small` step)."""
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    c.mlp.activation, c.ffn_dim, c.d_model = "swiglu", 40, 16
    model = build_model(c)
    tokens = jnp.zeros((2, 12), jnp.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]

    def loss(p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    hlo = hlo[hlo.index("\nENTRY"):]
    hlo = hlo[:hlo.index("\n}")]
    assert re.search(r"= f32\[24,80\]|= f32\[2,12,2,40\]", hlo)  # (the shapes are the right ones)
    assert not re.search(r"= f32\[80,24\]|= f32\[2,40,2,12\]|= f32\[80,2,12\]", hlo)


@pytest.mark.parametrize("preset", ["configs/lm.py:tiny", "configs/rmt.py:tiny"])
def test_dots_remat_saves_the_custom_vjp_matmuls(preset):
    """remat="dots" recomputes no matmul: of the FLOPs remat="full" adds to the compiled gradient
    (the forward's matmuls and elementwise work), "dots" adds under half (the elementwise part; a
    custom VJP hides its dot from the dots policy, the checkpoint name keeps it saved)."""
    flops = {}
    for remat in ("none", "dots", "full"):
        c = load_config(preset, unlocked=True).model
        c.remat = remat
        model = build_model(c)
        tokens = jnp.zeros((2, 32), jnp.int32)
        params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
        grad = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2)))
        cost = grad.lower(params).compile().cost_analysis()
        flops[remat] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    # the part of full remat's recompute that "dots" still does: elementwise work only
    assert flops["dots"] - flops["none"] < 0.45 * (flops["full"] - flops["none"]), flops
