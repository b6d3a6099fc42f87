"""models/mlp: every activation against a numpy formula, the returned acts, the sparsity hook."""
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.models import build_model
from icml_jax.models import mlp
from icml_jax.models.mlp import ACTIVATIONS, is_gated

_erf = np.vectorize(math.erf)
FORMULAS = {  # (gated, numpy act)
    "swiglu": (True, lambda x: x / (1 + np.exp(-x))),
    "relu_glu": (True, lambda x: np.maximum(x, 0)),
    "relu": (False, lambda x: np.maximum(x, 0)),
    "relu2": (False, lambda x: np.maximum(x, 0) ** 2),
    "gelu": (False, lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2)))),
    "gelu_tanh": (False, lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))),
}


def _cfg(activation, compare="lt"):
    """configs/lm.py's model section (every key the modules read) at a tiny width."""
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.update(d_model=8, ffn_dim=16, init_std=0.5, dtype="float32", param_dtype="float32")
    cfg.mlp.update(activation=activation, sparse_compare=compare)
    return ml_collections.FrozenConfigDict(cfg)


def _mlp(activation, compare="lt"):
    m = ACTIVATIONS.get(activation)(_cfg(activation, compare))
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    params = nn.meta.unbox(m.init(jax.random.key(1), x)["params"])
    return m, params, x


def _numpy_mlp(activation, params, x):
    gated, act = FORMULAS[activation]
    x, wo = np.asarray(x, np.float64), np.asarray(params["wo"], np.float64)
    wi = np.asarray(params["wi"], np.float64)
    a = act(x @ wi[:, 0]) * (x @ wi[:, 1]) if gated else act(x @ wi)
    return a @ wo, a


def test_registry_covers_formulas():
    assert set(ACTIVATIONS.names()) == set(FORMULAS)
    for name, (gated, _) in FORMULAS.items():
        assert is_gated(name) == gated


@pytest.mark.parametrize("activation", sorted(FORMULAS))
def test_activation_formula(activation):
    m, params, x = _mlp(activation)
    chex.assert_shape(params["wi"], (8, 2, 16) if FORMULAS[activation][0] else (8, 16))
    y, acts = m.apply({"params": params}, x)
    chex.assert_shape((y, acts), ((2, 5, 8), (2, 5, 16)))
    y_ref, a_ref = _numpy_mlp(activation, params, x)
    np.testing.assert_allclose(acts, a_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    # the returned acts are exactly what multiplies W_down
    np.testing.assert_allclose(y, jnp.einsum("BTF,FD->BTD", acts, params["wo"]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_sown_gate_and_up(activation):
    m, params, x = _mlp(activation)
    (y, acts), state = m.apply({"params": params}, x, mutable=["intermediates"])
    inter = state["intermediates"]
    if is_gated(activation):
        np.testing.assert_allclose(inter["mlp_gate"][0] * inter["mlp_up"][0], acts, rtol=1e-6)
    else:
        assert "mlp_up" not in inter
        np.testing.assert_array_equal(inter["mlp_gate"][0], acts)
    y2, _ = m.apply({"params": params}, x)
    np.testing.assert_array_equal(y, y2)  # sowing does not change the numerics


def _sparse(m, params, x, **variables):
    (y, acts), state = m.apply({"params": params, "sparsity": variables}, x, mutable=["intermediates"])
    return y, acts, np.asarray(state["intermediates"]["mlp_keep"][0]).astype(bool)


@pytest.mark.parametrize("activation", sorted(FORMULAS))
def test_threshold_zero_is_dense_bit_for_bit(activation):
    """At the MLP: threshold 0 keeps every neuron and changes no bit."""
    m, params, x = _mlp(activation)
    y, _ = m.apply({"params": params}, x)
    ys, _, keep = _sparse(m, params, x, threshold=jnp.float32(0))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ys))
    assert keep.all()


@pytest.mark.parametrize("compare", ["lt", "le"])
def test_zeroing_rule_equivalence(compare):
    """|a_j| < t / ||w_j|| <=> n_j < t, and the output is W_down applied to the kept acts.
    ``sparse_compare="le"`` zeroes ties too."""
    m, params, x = _mlp("swiglu", compare)
    _, acts = m.apply({"params": params}, x)
    a = np.abs(np.asarray(acts))
    wn = np.asarray(jnp.linalg.norm(params["wo"], axis=1))  # the same float32 norm as mlp.py
    n = a * wn
    t = np.float32(np.quantile(n, 0.5))
    ys, _, keep = _sparse(m, params, x, threshold=t)
    rule = a < t / wn if compare == "lt" else a <= t / wn
    near = np.abs(n - t) > 1e-6 * t  # away from the float boundary both forms agree
    np.testing.assert_array_equal((n < t)[near], rule[near])
    np.testing.assert_array_equal(keep, ~rule)
    np.testing.assert_allclose(ys, np.einsum("btf,fd->btd", np.where(keep, acts, 0), params["wo"]),
                               rtol=1e-5, atol=1e-6)
    # a tie: threshold exactly a neuron's |a| * ||w|| -> kept under "lt", zeroed under "le"
    j = (0, 0, 3)
    t_tie = np.float32(abs(float(acts[j]))) * np.float32(wn[3])
    _, _, k_tie = _sparse(m, params, x, threshold=jnp.float32(t_tie))
    a_cut = np.float32(t_tie) / np.float32(wn[3])
    expect = not (abs(np.float32(acts[j])) < a_cut) if compare == "lt" else not (abs(np.float32(acts[j])) <= a_cut)
    assert k_tie[j] == expect


@pytest.mark.parametrize("activation", ["relu_glu", "gelu"])
def test_gate_threshold(activation):
    """FAT-e: zeroed iff |act(gate)| < e (for plain MLPs the gate is the activation)."""
    m, params, x = _mlp(activation)
    (_, acts), state = m.apply({"params": params}, x, mutable=["intermediates"])
    gate = np.abs(np.asarray(state["intermediates"]["mlp_gate"][0]))
    e = np.float32(np.quantile(gate, 0.4))
    ys, _, keep = _sparse(m, params, x, gate_threshold=e)
    np.testing.assert_array_equal(keep, ~(gate < e))
    np.testing.assert_allclose(ys, np.einsum("btf,fd->btd", np.where(keep, acts, 0), params["wo"]), rtol=1e-5, atol=1e-6)
    # per-token thresholds broadcast over [B, T, 1]
    e_BT1 = np.full((2, 5, 1), e, np.float32)
    e_BT1[0] = 0.0
    _, _, keep2 = _sparse(m, params, x, gate_threshold=e_BT1)
    assert keep2[0].all() and np.array_equal(keep2[1], keep[1])


@pytest.mark.parametrize("per_token", [False, True])
def test_topk_zero(per_token):
    m, params, x = _mlp("swiglu")
    (_, acts), state = m.apply({"params": params}, x, mutable=["intermediates"])
    gate = np.abs(np.asarray(state["intermediates"]["mlp_gate"][0]))
    nz = 5 if per_token else 70
    name = "topk_zero_per_token" if per_token else "topk_zero"
    _, _, keep = _sparse(m, params, x, **{name: jnp.int32(nz)})
    if per_token:
        assert np.all((~keep).sum(-1) == nz)
        assert np.all(np.where(keep, gate, np.inf).min(-1) >= np.where(keep, -np.inf, gate).max(-1))
    else:
        assert (~keep).sum() == nz
        assert gate[keep].min() >= gate[~keep].max()
    # padding (token_mask False) is ranked last: never zeroed by the count
    mask = np.ones((2, 5), bool)
    mask[1, 2:] = False
    _, _, keep_m = _sparse(m, params, x, topk_zero=jnp.int32(30), token_mask=jnp.asarray(mask))
    assert keep_m[~mask].all() and (~keep_m[mask]).sum() == 30


@functools.partial(jax.jit, static_argnums=0)
def _decoder_logits(model, variables, tokens):
    """The whole decoder jitted (eagerly its every op compiles on its own, which costs far more
    CPU). The tiny MLPs above stay eager: there the per-op compiles are shared by all tests."""
    return model.apply(variables, tokens)


@pytest.mark.parametrize("scan", [False, True])
def test_decoder_hook_scan_and_loop(tiny_config, scan):
    """Through the decoder: thresholds 0 => bit-identical logits; a per-layer [L] threshold under
    scan equals the same thresholds given to the unscanned layers."""
    tiny_config.model.mlp.activation = "relu_glu"
    model = build_model(tiny_config.model)
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), tokens)["params"])
    L = tiny_config.model.num_layers
    th = [0.002, 0.004][:L]
    loop_sp = {f"layer_{i}": {"mlp": {"threshold": jnp.float32(th[i])}} for i in range(L)}
    base = _decoder_logits(model, {"params": params, "sparsity": loop_sp}, tokens)
    if scan:
        tiny_config.model.scan_layers = True
        model = build_model(tiny_config.model)
        params = {"io": params["io"],
                  "layers": jax.tree.map(lambda *a: jnp.stack(a), *[params[f"layer_{i}"] for i in range(L)])}
        sp, zero = ({"layers": {"mlp": {"threshold": jnp.asarray(v, jnp.float32)}}} for v in (th, [0.0] * L))
    else:
        sp = loop_sp
        zero = {f"layer_{i}": {"mlp": {"threshold": jnp.float32(0)}} for i in range(L)}
    dense = _decoder_logits(model, {"params": params}, tokens)
    np.testing.assert_array_equal(
        np.asarray(_decoder_logits(model, {"params": params, "sparsity": zero}, tokens)),
        np.asarray(dense))
    out = _decoder_logits(model, {"params": params, "sparsity": sp}, tokens)
    chex.assert_trees_all_close(out, base, atol=1e-5)
    assert float(jnp.max(jnp.abs(out - dense))) > 0  # the thresholds did zero something


def test_bad_sparse_compare():
    m, params, x = _mlp("swiglu")
    bad = ACTIVATIONS.get("swiglu")(_cfg("swiglu", "leq"))
    with pytest.raises(ValueError, match="sparse_compare"):
        bad.apply({"params": params, "sparsity": {"threshold": jnp.float32(0)}}, x)


@pytest.mark.parametrize("kind", ["glu", "activation"])
def test_rematerialised_activation_same_values_less_memory(kind):
    """mlp.glu / mlp.activation give autodiff's values and gradients, and the compiled gradient
    holds fewer temporaries: act(gate) (and silu's sigmoid) are recomputed from h, not kept
    (two [N, F] buffers here for the GLU, one for gelu_tanh)."""
    from icml_jax.models.layers import matmul
    kx, ki, ko = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (4, 64, 32))
    F = 256
    wi = 0.1 * jax.random.normal(ki, (32, 2, F) if kind == "glu" else (32, F))
    wo = 0.1 * jax.random.normal(ko, (F, 32))
    if kind == "glu":
        ours = lambda h: mlp.glu(jax.nn.silu, h)  # noqa: E731
        plain = lambda h: jax.nn.silu(h[..., 0, :]) * h[..., 1, :]  # noqa: E731
    else:
        act = lambda h: jax.nn.gelu(h, approximate=True)  # noqa: E731
        ours, plain = (lambda h: mlp.activation(act, h)), act

    def grad_fn(f):
        return jax.jit(jax.value_and_grad(lambda wi, wo: jnp.sum(matmul(f(matmul(x, wi)), wo) ** 2),
                                          argnums=(0, 1)))

    got, want = grad_fn(ours)(wi, wo), grad_fn(plain)(wi, wo)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    temp = [grad_fn(f).lower(wi, wo).compile().memory_analysis().temp_size_in_bytes for f in (ours, plain)]
    assert temp[1] - temp[0] >= 4 * 64 * F * 4, temp  # at least one [N, F] float32 buffer fewer
