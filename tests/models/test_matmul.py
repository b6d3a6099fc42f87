"""``icml_jax.models.layers.matmul``: einsum values and gradients, and the layout it exists for (the
train step writes no transposed copy of the MLP's 2F-wide gate/up cotangent)."""
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.models import build_model
from icml_jax.models.layers import matmul
from tests.jax_env import entry_computation, subprocess_env


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
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

    def loss(p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    hlo = entry_computation(jax.jit(jax.grad(loss)).lower(params).compile().as_text())
    assert re.search(r"= f32\[24,80\]|= f32\[2,12,2,40\]", hlo)  # (the shapes are the right ones)
    assert not re.search(r"= f32\[80,24\]|= f32\[2,40,2,12\]|= f32\[80,2,12\]", hlo)


@pytest.mark.parametrize("preset", ["configs/lm.py:tiny", "configs/rmt.py:tiny"])
def test_dots_remat_saves_the_custom_vjp_matmuls(preset):
    """remat="dots" recomputes no matmul: its compiled gradient holds as many dots as remat="none"
    (a custom VJP hides its dot from the dots policy, the checkpoint name keeps it saved), while
    remat="full" recomputes the forward's matmuls (more dots) and more FLOPs than "dots"."""
    dots, flops = {}, {}
    for remat in ("none", "dots", "full"):
        c = load_config(preset, unlocked=True).model
        c.remat = remat
        model = build_model(c)
        tokens = jnp.zeros((2, 32), jnp.int32)
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]  # compiled, never run
        grad = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, tokens) ** 2)))
        compiled = grad.lower(params).compile()
        dots[remat] = len(re.findall(r"= [^ ]+ dot\(", compiled.as_text()))
        cost = compiled.cost_analysis()
        flops[remat] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert dots["dots"] == dots["none"] < dots["full"], dots
    assert flops["none"] <= flops["dots"] < flops["full"], flops


_SHARD_SCRIPT = r"""
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from icml_jax.models.layers import matmul
import numpy as np
mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
x = jax.ShapeDtypeStruct((8, 6, 16), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
w = jax.ShapeDtypeStruct((16, 2, 24), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None, "tensor")))
ein = lambda x, w: jnp.einsum("BTD,DCF->BTCF", x, w)
def collectives(mm):
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(mm(x, w) ** 2), argnums=(0, 1)))
    hlo = f.lower(x, w).compile().as_text()
    return sum(hlo.count(op) for op in (" all-gather(", " all-to-all(", " collective-permute("))
print("RESULT", collectives(matmul), collectives(ein))
"""


def test_matmul_keeps_a_tensor_parallel_kernel_sharded():
    """On a (fsdp 2, tensor 2) mesh, the gradient of a [D, 2, F] kernel whose F is split over
    `tensor` (the gated MLP's wi) needs no more gathers or permutes with matmul than with the
    einsum: matmul keeps w's axes (flattening 2F would make GSPMD gather the kernel)."""
    p = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], cwd=REPO_ROOT, env=subprocess_env(4),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ours, einsum = map(int, [x for x in p.stdout.splitlines() if x.startswith("RESULT")][-1].split()[1:])
    assert ours <= einsum, (ours, einsum)
