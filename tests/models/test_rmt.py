"""Residual Matrix Transformer (icml_jax/models/rmt.py; docs/methods/rmt.md): parity against the
authors' code, zero logits at init, causality, ALiBi, flag equivalence, variance propagation,
parameter counts, KV-cache decoding, muP optimizer groups, z-loss, sharding on 8 fake devices."""
import functools
import json
import math
import os
import re
import subprocess
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from icml_jax.analysis.flops import param_count
from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.models import build_model
from icml_jax.models import rmt
from icml_jax.losses.logps import log_normalizer, token_logprobs, with_z_loss
from tests.jax_env import entry_computation, subprocess_env

DATA = os.path.join(os.path.dirname(__file__), "data", "rmt_reference.npz")


def _cfg(**model):
    c = load_config("configs/rmt.py:tiny", unlocked=True)
    rmt_over = model.pop("rmt", {})
    for k, v in model.items():
        c.model[k] = v
    for k, v in rmt_over.items():
        c.model.rmt[k] = v
    return c


def _init(m, B=2, T=12, seed=0):
    """(model, params, tokens [B, T] drawn with ``seed``); the params depend on the config alone
    (not on the input's shape), so init runs as one jitted program once per config."""
    m = ml_collections.FrozenConfigDict(m)
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, m.vocab_size)
    return build_model(m), _init_params(m), tokens


@functools.cache
def _init_params(m):
    return jax.jit(lambda t: nn.meta.unbox(build_model(m).init(jax.random.key(1), t)["params"]))(
        jnp.zeros((1, 8), jnp.int32))


def _param_shapes(m, B=2, T=12):
    """The param tree's shapes, without running init."""
    return nn.meta.unbox(jax.eval_shape(build_model(m).init, jax.random.key(1),
                                        jnp.zeros((B, T), jnp.int32))["params"])


@functools.partial(jax.jit, static_argnames="seed")
def _randomise(params, seed=0, scale=0.5):
    """Every leaf random and non-zero (query slice and unembedding included)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _forward(m):
    """model.apply as one jitted program (tokens, then optional positions and segment ids), one
    per config: tests of the same config and shapes share its compile."""
    return _forward_fn(ml_collections.FrozenConfigDict(m))


@functools.cache
def _forward_fn(m):
    model = build_model(m)
    return jax.jit(lambda p, *inputs: model.apply({"params": p}, *inputs))


# ----------------------------------------------------------------------------- parity

def _reference_params(ref, m):
    """Our param tree from the reference's weights (stored under ``w/<their path>``)."""
    return rmt.from_reference_weights({k[2:]: ref[k] for k in ref.files if k.startswith("w/")}, m)


def _parity_cfg():
    return _cfg(vocab_size=7, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=4, ffn_dim=6,
                max_seq_len=8, rmt=dict(key_dim=3)).model


def test_parity_with_reference_model():
    """Logits, mean CE and mean z-loss equal the authors' model (run in fp64, ours fp32)."""
    ref = np.load(DATA)
    m = _parity_cfg()
    ours = _reference_params(ref, m)
    chex.assert_trees_all_equal_shapes(ours, _param_shapes(m, B=1, T=4))
    model = build_model(m)

    @jax.jit
    def run(params, tokens, targets):
        logits = model.apply({"params": params}, tokens[None])[0]
        ce = -token_logprobs(logits[None], targets[None]).mean()
        return logits, ce, jnp.mean(jnp.square(log_normalizer(logits)))

    logits, ce, logz2 = run(ours, jnp.asarray(ref["tokens"]), jnp.asarray(ref["targets"]))
    ce, logz2 = float(ce), float(logz2)
    assert float(np.abs(ref["logits"]).max()) > 0.5  # non-trivial reference output
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-5, rtol=1e-5)
    assert abs(ce - float(ref["ce"])) < 1e-5
    assert abs(logz2 - float(ref["logz2"])) < 1e-4
    assert abs(ce + 1e-4 * logz2 - float(ref["zloss"])) < 1e-5


def test_parity_with_reference_model_in_float64():
    """In JAX's 64-bit mode with config.model.dtype = param_dtype = float64 the logits equal the
    authors' fp64 run to round-off (fp32 above: 2e-5); outside that mode float64 is refused."""
    ref = np.load(DATA)
    m = _parity_cfg()
    m.dtype = m.param_dtype = "float64"
    with jax.enable_x64(True):
        model = build_model(m)
        logits = jax.jit(lambda p, t: model.apply({"params": p}, t[None])[0])(
            _reference_params(ref, m), jnp.asarray(ref["tokens"]))
        assert logits.dtype == jnp.float64
        np.testing.assert_allclose(logits, ref["logits"], atol=1e-11, rtol=1e-11)
    with pytest.raises(ValueError, match=r"config.model.(param_)?dtype='float64' needs JAX's 64-bit mode"):
        build_model(m).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_reference_mapping_refuses_layouts_it_does_not_map():
    m = _parity_cfg()
    m.scan_layers = True
    with pytest.raises(ValueError, match="scan_layers=False"):
        rmt.from_reference_weights({}, m)


def test_parity_fixture_records_reference_init_facts():
    """The reference as initialised: zero logits (zero unembedding), random query slice."""
    ref = np.load(DATA)
    assert float(ref["init_logits_max"]) == 0.0
    assert float(ref["init_query_absmax"]) > 1e-3


def test_parity_breaks_without_inverse_layer_scaling():
    """The parity check is sensitive: switching a reference quirk off changes the logits."""
    ref = np.load(DATA)
    m = _parity_cfg()
    m.rmt.inverse_layer_scaling = False
    logits = _forward(m)(_reference_params(ref, m), jnp.asarray(ref["tokens"])[None])[0]
    assert float(np.abs(np.asarray(logits) - ref["logits"]).max()) > 1e-3


# ----------------------------------------------------------------------------- init, shapes

class RMTForwardTest(chex.TestCase):

    @chex.variants(with_jit=True)  # eager apply runs the same code (and compiles every primitive)
    def test_shapes_dtype_and_zero_logits_at_init(self):
        """muP init has a zero unembedding, so logits are exactly 0 and CE = log V."""
        for qz in (False, True):
            m = _cfg(rmt=dict(query_zero_init=qz)).model
            model, params, tokens = _init(m)
            logits = self.variant(lambda p, t: model.apply({"params": p}, t))(params, tokens)
            chex.assert_shape(logits, (2, 12, m.vocab_size))
            chex.assert_type(logits, jnp.float32)
            assert float(jnp.abs(logits).max()) == 0.0
            ce = -token_logprobs(logits, tokens).mean()
            assert abs(float(ce) - math.log(m.vocab_size)) < 1e-5


@pytest.mark.parametrize("qz", [False, True])
def test_query_slice_init(qz):
    """As executed the reference's query slice is random; the flag zeroes it (k, v stay random)."""
    m = _cfg(rmt=dict(query_zero_init=qz)).model
    _, params, _ = _init(m)
    w = params["layer_0"]["attn"]["qkv_retrieve"]  # [K, 3, R]
    assert (float(jnp.abs(w[:, 0]).max()) == 0.0) == qz
    assert float(jnp.abs(w[:, 1:]).min()) > 0.0
    std = float(jnp.std(params["layer_0"]["mlp"]["wi"]))
    assert 0.5 < std / (0.02 / math.sqrt(m.num_heads * m.head_dim)) < 1.5  # muP hidden std


def test_every_leaf_has_logical_axes():
    m = _cfg().model
    boxed = jax.eval_shape(build_model(m).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: hasattr(x, "names"))
    assert leaves and all(hasattr(x, "names") and len(x.names) == len(x.value.shape) for x in leaves)


def test_causality():
    """changing token t+1 leaves logits at positions <= t unchanged, and changes later ones."""
    m = _cfg().model
    _, params, tokens = _init(m, B=1, T=10)
    params = _randomise(params)
    fwd = _forward(m)  # one compile: every input has the same shape
    tokens = np.asarray(tokens)
    base = np.asarray(fwd(params, tokens))
    for t in (0, 4, 8):
        pert = tokens.copy()
        pert[0, t + 1] = (pert[0, t + 1] + 1) % m.vocab_size
        out = np.asarray(fwd(params, pert))
        np.testing.assert_array_equal(out[0, : t + 1], base[0, : t + 1])
        assert float(np.abs(out[0, t + 1:] - base[0, t + 1:]).max()) > 1e-4


def test_packed_documents_are_isolated():
    """A token attends only within its segment, and ALiBi uses per-document positions: a
    document packed second gives the same logits as alone."""
    m = _cfg().model
    _, params, tokens = _init(m, B=1, T=12)
    params = _randomise(params)
    seg = jnp.array([[1] * 5 + [2] * 7])
    pos = jnp.array([list(range(5)) + list(range(7))])
    fwd = _forward(m)
    packed = fwd(params, tokens, pos, seg)
    alone = fwd(params, tokens[:, 5:])
    np.testing.assert_allclose(packed[0, 5:], alone[0], atol=1e-5)


def test_causal_query_blocks_match_one_block():
    """config.model.attention_block (T=12, blocks of 3 -> 4 blocks) gives the one-block logits and
    gradients, with packed documents and the ALiBi bias, and fewer compiled FLOPs."""
    m = _cfg().model  # attention_block is set below (it changes no param)
    _, params, tokens = _init(m, B=1, T=12)
    params = _randomise(params)
    seg = jnp.array([[1] * 5 + [2] * 7])
    pos = jnp.array([list(range(5)) + list(range(7))])
    out, flops = [], []
    for blk in (0, 3):
        m.attention_block = blk
        model = build_model(m)
        f = jax.jit(jax.value_and_grad(lambda p: (model.apply({"params": p}, tokens, pos, seg) ** 2).mean()))
        out.append(f(params))
        flops.append(f.lower(params).compile().cost_analysis()["flops"])
    chex.assert_trees_all_close(out[1], out[0], rtol=1e-5, atol=1e-6)
    assert flops[1] < flops[0], flops


@pytest.mark.parametrize("flags", [dict(), dict(position="learned"), dict(norm="layernorm"),
                                   dict(param="lecun"), dict(inverse_layer_scaling=False)])
@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_param_count_matches_initialised_model(flags, activation):
    """the exact count equals the initialised tree under the flags and MLP kinds."""
    c = _cfg(rmt=dict(flags))
    c.model.mlp.activation = activation
    shapes = jax.eval_shape(build_model(c.model).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == param_count(c.model)


def test_param_count_depends_on_key_dim_only_through_key_terms():
    """ΔParams/ΔDk = 2R(3L+1) + (2L+1)·Dv (retrieval/storage keys + norm gains)."""
    c = load_config("configs/rmt.py:small", unlocked=True).model
    L, R, E = c.num_layers, c.num_heads, c.head_dim
    counts = {}
    for dk in (4, 8, 16, 32):
        c.rmt.key_dim = dk
        counts[dk] = param_count(c)
    per_dk = 2 * R * (3 * L + 1) + (2 * L + 1) * E
    for dk in (8, 16, 32):
        assert counts[dk] - counts[4] == per_dk * (dk - 4)
    assert (counts[32] - counts[4]) / counts[4] < 0.05  # nearly constant, as the paper claims


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scan_matches_layer_loop(remat):
    """Scanned layers (the layer counter rides in the carry) compute the loop's function, so the
    per-layer 1/(ℓ+1) scaling survives nn.scan and remat."""
    m = _cfg().model
    _, params, tokens = _init(m)
    params = _randomise(params)
    base = _forward(m)(params, tokens)
    m2 = _cfg(scan_layers=True, remat=remat).model
    layers = [params[f"layer_{i}"] for i in range(m.num_layers)]
    p2 = {"io": params["io"], "layers": jax.tree.map(lambda *xs: np.stack(xs), *layers)}
    chex.assert_trees_all_close(_forward(m2)(p2, tokens), base, atol=1e-5)


def test_bad_config_is_a_clear_error():
    m = _cfg(num_kv_heads=1).model
    with pytest.raises(ValueError, match="num_kv_heads"):
        _init(m)
    m = _cfg(rmt=dict(norm="batchnorm")).model
    with pytest.raises(ValueError, match="config.model.rmt.norm"):
        _init(m)


# ----------------------------------------------------------------------------- attention properties

def _attend(m, q, k, v, layer=0):
    """RMTAttention.attend on causal positions 0..T-1 (as numpy; one compile per config and
    shapes: the layer is a traced argument)."""
    return np.asarray(_attend_fn(ml_collections.FrozenConfigDict(m))(q, k, v, jnp.int32(layer)))


@functools.cache
def _attend_fn(m):
    @jax.jit
    def attend(q, k, v, layer):
        B, T = q.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(T), (B, T))
        mask = jnp.tril(jnp.ones((T, T), bool))[None].repeat(B, 0)
        return rmt.RMTAttention(m).apply({}, q, k, v, mask, jnp.full((B, 1), layer, jnp.int32), pos, pos,
                                         method="attend")
    return attend


def test_alibi_slopes_and_bias():
    """m_r = 2^(-8(r+1)/R) (the reference's geomspace); with q = 0 the attention weights
    are softmax(-m_r (t - s)) over s <= t, i.e. the bias is 0 on the diagonal."""
    for R in (1, 2, 3, 8, 12):
        np.testing.assert_allclose(rmt.alibi_slopes(R), 2.0 ** (-8 * np.arange(1, R + 1) / R), rtol=1e-6)
        np.testing.assert_allclose(rmt.alibi_slopes(R), np.geomspace(2 ** (-8 / R), 2 ** -8, R), rtol=1e-6)
    T = 6
    m = _cfg(num_heads=3, num_kv_heads=3, head_dim=T).model
    v = jnp.zeros((1, T, 3, T)).at[0, jnp.arange(T), :, jnp.arange(T)].set(1.0)  # one-hot per slot
    o = _attend(m, jnp.zeros((1, T, 3, T)), jnp.zeros((1, T, 3, T)), v)  # o[t, r, s] = p_r(t, s)
    slopes = rmt.alibi_slopes(3)
    for r in range(3):
        for t in range(T):
            logit = -slopes[r] * (t - np.arange(t + 1))
            want = np.exp(logit) / np.exp(logit).sum()
            np.testing.assert_allclose(o[0, t, r, : t + 1], want, rtol=1e-5)
            assert float(np.abs(o[0, t, r, t + 1:]).max(initial=0.0)) == 0.0


def test_inverse_layer_scaling_flag_equivalence():
    """with inverse scaling off, layer ℓ's q·k logits are (ℓ+1)x those with it on."""
    on = _cfg().model
    off = _cfg(rmt=dict(inverse_layer_scaling=False)).model
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 7, 2, 8)) for kk in ks)
    for layer in (0, 1, 3):
        a = _attend(on, q * (layer + 1), k, v, layer)
        b = _attend(off, q, k, v, layer)
        np.testing.assert_allclose(a, b, atol=1e-5)
        if layer:
            assert float(np.abs(_attend(on, q, k, v, layer) - b).max()) > 1e-3


def test_variance_propagation_at_init():
    """Paper Table 1, Monte Carlo: storage Var = R σ_w²(σ² + μ²) forward and Dk σ_w²(σ_g² + μ_g²)
    backward, retrieval Var = Dk σ_w²(σ² + μ²) forward and R σ_w²(σ_g² + μ_g²) backward, means 0."""
    R, K, E, n = 8, 16, 4, 4000
    sw, mu, sd = 0.3, 0.5, 1.5

    @jax.jit
    def moments():
        kx, kw = jax.random.split(jax.random.key(0))
        x_NTRE = mu + sd * jax.random.normal(kx, (n, 1, R, E))
        w_NRK = sw * jax.random.normal(kw, (n, R, K))
        X = jax.vmap(lambda x, w: rmt.store(x[None], w)[0])(x_NTRE, w_NRK)  # [n, 1, E, K]
        Xin = mu + sd * jax.random.normal(kx, (n, 1, E, K))
        a_NKR = sw * jax.random.normal(kw, (n, K, R))
        y = jax.vmap(lambda x, a: rmt.retrieve(x[None], a)[0])(Xin, a_NKR)
        # backward: cotangents of mean mu and std sd through each map (Table 1's gradient column)
        kg1, kg2 = jax.random.split(jax.random.key(1))
        g_X = mu + sd * jax.random.normal(kg1, X.shape)
        dx = jax.vmap(lambda x, w, g: jax.vjp(lambda v: rmt.store(v[None], w)[0], x)[1](g)[0])(x_NTRE, w_NRK, g_X)
        g_y = mu + sd * jax.random.normal(kg2, y.shape)
        dX = jax.vmap(lambda x, a, g: jax.vjp(lambda v: rmt.retrieve(v[None], a)[0], x)[1](g)[0])(Xin, a_NKR, g_y)
        return X.var(), X.mean(), y.var(), y.mean(), dx.var(), dx.mean(), dX.var(), dX.mean()

    X_var, X_mean, y_var, y_mean, dx_var, dx_mean, dX_var, dX_mean = map(float, moments())
    scale = sw ** 2 * (sd ** 2 + mu ** 2)
    assert abs(X_var / (R * scale) - 1) < 0.05
    assert abs(X_mean) < 0.05
    assert abs(y_var / (K * scale) - 1) < 0.05
    assert abs(y_mean) < 0.05
    assert abs(dx_var / (K * scale) - 1) < 0.05  # storage backward: Dk sw^2 (sd^2 + mu^2)
    assert abs(dx_mean) < 0.05
    assert abs(dX_var / (R * scale) - 1) < 0.05  # retrieval backward: R sw^2 (sd^2 + mu^2)
    assert abs(dX_mean) < 0.05


# ----------------------------------------------------------------------------- decoding

@pytest.mark.parametrize("scan_layers,position", [(False, "alibi"), (True, "alibi"), (False, "learned")])
def test_cached_greedy_equals_full_forward(scan_layers, position):
    """KV-cache greedy decoding equals recomputing the whole prefix; the left-padded shorter row
    equals that row decoded alone (learned positions are per-document, so padding must not shift
    them)."""
    from icml_jax.inference.decode import generate
    m = _cfg(scan_layers=scan_layers, rmt=dict(position=position)).model
    model = build_model(m)
    params = _randomise(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"],
                        scale=1.0)
    prompt, n = [1, 40, 51, 62, 73], 8
    fwd = jax.jit(lambda p, t, i: model.apply({"params": p}, t)[0, i])  # one compile for every step
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, :len(prompt)] = prompt
    want, want_logits = [], []
    for i in range(n):
        lg = np.asarray(fwd(params, buf, len(prompt) + i - 1))
        want.append(int(lg.argmax()))
        want_logits.append(lg)
        buf[0, len(prompt) + i] = want[-1]
    out = generate(m, params, [prompt, [1, 3]], key=jax.random.key(0), max_new_tokens=n,
                   temperature=0, return_logits=True)
    np.testing.assert_array_equal(out.tokens[0], want)
    np.testing.assert_allclose(out.logits[0], np.stack(want_logits), atol=1e-4, rtol=1e-5)
    alone = generate(m, params, [[1, 3]], key=jax.random.key(0), max_new_tokens=n, temperature=0)
    np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])


# ----------------------------------------------------------------------------- optimizer, z-loss

def _tx(base_key_dim=0, wd=0.0, **train):
    from icml_jax.train.optimizer import make_optimizer
    c = _cfg(rmt=dict(base_key_dim=base_key_dim))
    c.train.weight_decay, c.train.warmup_steps, c.train.steps = wd, 0, 10
    for k, v in train.items():
        c.train[k] = v
    return c, make_optimizer(c.train, model_cfg=c.model)


def test_mup_lr_divides_hidden_params_by_width_ratio():
    """base Dk = Dk/2 -> width ratio 2 for the Dk-input kernels: their first Adam step is half
    the size; the embedding (input), unembedding (output), norms and Rank-input keys are not."""
    c, tx = _tx(base_key_dim=2)  # tiny: Dk = 4
    _, params, _ = _init(c.model)
    grads = _randomise(params, seed=3)
    c1, tx1 = _tx()

    @jax.jit
    def first_updates(grads, params):
        u2, _ = tx.update(grads, tx.init(params), params)
        u1, _ = tx1.update(grads, tx1.init(params), params)
        return jax.tree.map(lambda a, b: jnp.abs(a).sum() / jnp.abs(b).sum(), u2, u1), u1

    ratio, u1 = first_updates(grads, params)
    ratio = jax.tree.map(float, ratio)
    assert abs(ratio["layer_0"]["attn"]["qkv_retrieve"] - 0.5) < 1e-6
    assert abs(ratio["io"]["unembed_retrieve"] - 0.5) < 1e-6
    assert abs(ratio["layer_1"]["mlp_retrieve"] - 0.5) < 1e-6
    for leaf in (ratio["io"]["embedding"], ratio["io"]["unembed"], ratio["layer_0"]["attn_store"],
                 ratio["layer_0"]["mlp"]["wi"], ratio["io"]["final_norm"]["scale"]):
        assert abs(leaf - 1.0) < 1e-6
    # the peak lr multiplies the Adam direction (first step |update| ~ lr for every entry)
    assert abs(float(jnp.abs(u1["layer_0"]["mlp"]["wo"]).mean()) / c1.train.lr - 1) < 0.01


def test_mup_decay_is_added_after_lr_and_masked():
    """Zero gradients: the update is -schedule·wd·θ on hidden kernels, independent of the peak
    lr, and 0 on the embedding, the unembedding and the norm gains."""
    for lr in (1e-2, 1e-3):
        c, tx = _tx(wd=0.1, lr=lr)
        _, params, _ = _init(c.model)
        params = _randomise(params, seed=1)
        zeros = jax.tree.map(np.zeros_like, params)
        u, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(zeros, params)
        np.testing.assert_allclose(u["layer_0"]["mlp"]["wi"], -0.1 * params["layer_0"]["mlp"]["wi"], rtol=1e-5)
        np.testing.assert_allclose(u["layer_1"]["attn"]["qkv_retrieve"],
                                   -0.1 * params["layer_1"]["attn"]["qkv_retrieve"], rtol=1e-5)
        for leaf in (u["io"]["embedding"], u["io"]["unembed"], u["layer_0"]["attn_norm"]["scale"]):
            assert float(jnp.abs(leaf).max()) == 0.0


def test_z_loss_value_is_ce_gradient_includes_z():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 11)) * 3
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    w = jnp.ones((2, 5)).at[1, 3:].set(0.0)

    def objective(lg):
        nll = (-token_logprobs(lg, targets) * w).sum()
        return with_z_loss(nll, lg, w, 1e-2)

    def plain(lg):
        nll = (-token_logprobs(lg, targets) * w).sum()
        return nll + 1e-2 * (jnp.square(jax.nn.logsumexp(lg, -1)) * w).sum()

    @jax.jit
    def run(lg):
        val, zsum = objective(lg)
        nll = (-token_logprobs(lg, targets) * w).sum()
        return val, zsum, nll, plain(lg), jax.grad(lambda x: objective(x)[0])(lg), jax.grad(plain)(lg)

    val, zsum, nll, plain_val, grad_z, grad_plain = run(logits)
    assert float(val) == float(nll)
    assert abs(float(zsum) - float(plain_val - nll)) < 1e-4 and float(zsum) > 0
    chex.assert_trees_all_close(grad_z, grad_plain, atol=1e-6)


def test_lm_task_reports_plain_ce_and_z_loss_metric():
    from icml_jax.tasks.lm import LMTask
    c = _cfg()
    task = LMTask(c)
    batch = task.dummy_batch(2, 16)
    batch["inputs"] = jax.random.randint(jax.random.key(0), (2, 16), 0, 200)
    batch["targets"] = jnp.roll(batch["inputs"], -1, axis=1)
    c0 = _cfg()
    c0.train.z_loss = 0.0
    task0 = LMTask(c0)

    @jax.jit
    def run(batch):  # with and without the z-loss: values, metrics and gradients in one program
        params = _randomise(nn.meta.unbox(task.init_params(jax.random.key(1), batch)), scale=0.3)
        (lsum, (_, metrics)), g = jax.value_and_grad(lambda p: _split(task.loss(p, batch)), has_aux=True)(params)
        (lsum0, (_, metrics0)), g0 = jax.value_and_grad(lambda p: _split(task0.loss(p, batch)),
                                                        has_aux=True)(params)
        return lsum, metrics, g, lsum0, metrics0, g0

    lsum, metrics, g, lsum0, metrics0, g0 = run(batch)
    assert float(lsum) == float(lsum0) and "z_loss" not in metrics0
    assert float(metrics["z_loss"]) > 0
    assert float(jnp.abs(g["io"]["unembed"] - g0["io"]["unembed"]).max()) > 0


def _split(loss_out):
    """(loss sum, (token count, metrics)): task.loss's output as value_and_grad's (value, aux)."""
    lsum, n, metrics = loss_out
    return lsum, (n, metrics)


# ----------------------------------------------------------------------------- sharding (8 fake devices)

_SHARD_SCRIPT = r"""
import json, jax, jax.numpy as jnp, flax.linen as nn
from icml_jax.config_utils import load_config
from icml_jax.tasks.lm import LMTask
from icml_jax import sharding as mesh_lib
from icml_jax.train import trainer
from icml_jax.train.optimizer import make_optimizer, lr_schedule


def run(mesh_shape, devices):
    c = load_config("configs/rmt.py:tiny", unlocked=True)
    c.model.num_heads = c.model.num_kv_heads = 4
    c.model.rmt.key_dim = 8
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh_shape
    task = LMTask(c)
    tx = make_optimizer(c.train, model_cfg=c.model)
    mesh, rules = mesh_lib.make_mesh(c.mesh, devices), mesh_lib.logical_rules(c.mesh)
    state, shardings = trainer.create_sharded_state(task, tx, c, mesh, rules)
    toks = jax.random.randint(jax.random.key(0), (8, 33), 0, 250)
    batch = dict(inputs=toks[:, :-1], targets=toks[:, 1:], segment_ids=jnp.ones((8, 32), jnp.int32),
                 positions=jnp.broadcast_to(jnp.arange(32), (8, 32)))
    bs = mesh_lib.batch_sharding(mesh)
    batch = jax.device_put(batch, bs)
    with mesh, nn.logical_axis_rules(rules):
        step = jax.jit(trainer.make_train_step(task, tx, 1, lr_schedule(c.train)),
                       in_shardings=(shardings, bs), out_shardings=(shardings, None))
        losses = []
        for _ in range(4):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    out = {"devices": mesh.devices.size, "losses": losses, "shardings": {}}
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        out["shardings"][jax.tree_util.keystr(path)] = [str(x.sharding.spec), list(x.shape),
                                                        list(x.addressable_shards[0].data.shape)]
    return out


assert jax.device_count() == 8
print("RESULT" + json.dumps([run((1, 1, 1), jax.devices()[:1]), run((1, 4, 2), jax.devices())]))
"""


def _run_one_and_eight():
    """One process on 8 fake devices trains the same model twice: on a mesh of its first device
    alone, and on all 8 as (data, fsdp, tensor) = (1, 4, 2)."""
    p = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], cwd=REPO_ROOT, env=subprocess_env(8),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT")][-1][6:])


def test_fsdp_tensor_sharding_matches_one_device():
    one, eight = _run_one_and_eight()
    assert one["devices"] == 1 and eight["devices"] == 8
    np.testing.assert_allclose(one["losses"], eight["losses"], atol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    spec, shape, shard = eight["shardings"]["['layer_0']['attn']['qkv_retrieve']"]  # [K, 3, R]
    assert shard == [shape[0] // 4, 3, shape[2] // 2], (spec, shape, shard)
    spec, shape, shard = eight["shardings"]["['io']['embedding']"]  # [V, R, E]: vocab on tensor
    assert shard[0] == shape[0] // 2, (spec, shape, shard)
    spec, shape, shard = eight["shardings"]["['layer_0']['mlp']['wi']"]  # [R*E, F]
    assert shard == [shape[0] // 4, shape[1] // 2], (spec, shape, shard)
    n_sharded = sum(v[1] != v[2] for v in eight["shardings"].values())
    assert n_sharded >= len(eight["shardings"]) // 2


# ----------------------------------------------------------------------------- step layout, residual dtype

def _store_retrieve_inputs(seed=0, B=2, T=3, E=5, K=4, R=3):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(ks[0], (B, T, E, K)), jax.random.normal(ks[1], (B, T, R, E)),
            jax.random.normal(ks[2], (R, K)), jax.random.normal(ks[3], (K, R)),
            jax.random.normal(ks[4], (B, T, E, K)))


def test_store_add_and_retrieve_match_einsum_values_and_gradients():
    """The fused store (X + Σ_r v_r ⊗ s_r) and the transpose-free retrieval give the einsums'
    values and vector-Jacobian products (fp32 to 1e-5), and the bfloat16 residual rounds once."""
    def ours(x, v, s, a):
        y = rmt.store_add(x, v, s, jnp.float32)
        return rmt.retrieve(y, a)

    def einsums(x, v, s, a):
        y = x + jnp.einsum("BTRE,RK->BTEK", v, s)
        return jnp.einsum("BTEK,KR->BTRE", y, a)

    @jax.jit
    def run(x, v, s, a, g):  # every value and gradient checked below, as one program
        want, vjp_want = jax.vjp(einsums, x, v, s, a)
        got, vjp_got = jax.vjp(ours, x, v, s, a)
        ct = jax.random.normal(jax.random.key(9), want.shape)
        xb = x.astype(jnp.bfloat16)
        yb, vjp_b = jax.vjp(lambda x, v, s: rmt.store_add(x, v, s, jnp.bfloat16), xb, v, s)
        yb_want = (xb.astype(jnp.float32) + jnp.einsum("BTRE,RK->BTEK", v, s)).astype(jnp.bfloat16)
        gb = g.astype(jnp.bfloat16)
        _, vjp_f = jax.vjp(lambda v, s: jnp.einsum("BTRE,RK->BTEK", v, s), v, s)
        return (got, want, vjp_got(ct), vjp_want(ct), yb, yb_want, vjp_b(gb), vjp_f(gb.astype(jnp.float32)))

    got, want, grads_got, grads_want, yb, yb_want, (dx, dv, ds), grads_f = run(*_store_retrieve_inputs())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for gw, gg in zip(grads_want, grads_got):
        np.testing.assert_allclose(gg, gw, rtol=1e-5, atol=1e-5)
    # bfloat16 residual: summed in float32, rounded once; gradients come back in the inputs' dtypes
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb.astype(jnp.float32)), np.asarray(yb_want.astype(jnp.float32)))
    assert (dx.dtype, dv.dtype, ds.dtype) == (jnp.bfloat16, jnp.float32, jnp.float32)
    # the float32 operands stay float32 in the backward dots (only the cotangent is bfloat16)
    for got_, want_ in zip((dv, ds), grads_f):
        np.testing.assert_allclose(got_, want_, rtol=1e-5, atol=1e-5)


def test_train_step_makes_no_transposed_copy_of_the_residual():
    """In the compiled forward + backward no instruction writes the residual matrices transposed
    ([K, B·T·E]): the retrieval and storage weight gradients transpose their R-wide operand
    instead (XLA's default for the einsums copies X transposed 4 times per layer), and every store
    is at most one fused X-sized write (the embedding's with its gather, the layers' with the
    residual add)."""
    m = _cfg(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=6, ffn_dim=20, vocab_size=61,
             rmt=dict(key_dim=5)).model
    model, params = build_model(m), _param_shapes(m)  # compiled only, never run: shapes suffice
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, m.vocab_size)
    N = 2 * 7 * 6

    def loss(p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    hlo = entry_computation(jax.jit(jax.grad(loss)).lower(params).compile().as_text())
    assert not re.search(rf"= f32\[5,{N}\]", hlo), "an X-sized transposed copy is back"
    assert re.search(rf"= f32\[{N},5\]", hlo)  # (the check looks at the right shapes)
    adds = [ln for ln in hlo.split("\n") if re.search(r"= f32\[2,7,6,5\]", ln) and "jvp(" in ln
            and "transpose(" not in ln and "/add" in ln]
    # two stores per layer + the embedding's; the last layer's may be fused into the final norm's
    # fusions instead (seen on a 2-core Xeon: no separate add writes it), so one fewer is fine
    assert 2 * m.num_layers <= len(adds) <= 2 * m.num_layers + 1, adds


def test_bfloat16_residual_dtype():
    """config.model.rmt.residual_dtype=bfloat16 keeps X in bfloat16 between layers: logits stay
    close to the float32 model's, greedy KV-cache decoding equals the full forward of the same
    model, and an unknown dtype is a one-line error naming the key."""
    from icml_jax.inference.decode import generate
    m32 = _cfg().model
    m16 = _cfg(rmt=dict(residual_dtype="bfloat16")).model
    model32, params, tokens = _init(m32)
    params = _randomise(params, scale=0.3)
    l32 = np.asarray(_forward(m32)(params, tokens))
    l16 = np.asarray(_forward(m16)(params, tokens))
    assert np.abs(l16 - l32).max() < 0.05 * np.abs(l32).max()
    assert np.abs(l16 - l32).max() > 0  # (it is a different computation)
    B, T = tokens.shape
    x_shape = f"[{B},{T},{m16.head_dim},{m16.rmt.key_dim}]"
    jaxpr16 = str(jax.make_jaxpr(lambda p, t: build_model(m16).apply({"params": p}, t))(params, tokens))
    jaxpr32 = str(jax.make_jaxpr(lambda p, t: build_model(m32).apply({"params": p}, t))(params, tokens))
    assert f"bf16{x_shape}" in jaxpr16 and f"bf16{x_shape}" not in jaxpr32
    prompt, n = [1, 40, 51], 6
    out = generate(m16, params, [prompt], key=jax.random.key(0), max_new_tokens=n, temperature=0)
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, :len(prompt)] = prompt
    fwd = _forward(m16)
    for i in range(n):
        buf[0, len(prompt) + i] = int(np.asarray(fwd(params, buf))[0, len(prompt) + i - 1].argmax())
    np.testing.assert_array_equal(out.tokens[0], buf[0, len(prompt):])
    with pytest.raises(ValueError, match="config.model.rmt.residual_dtype"):
        _init(_cfg(rmt=dict(residual_dtype="bf16")).model)


@pytest.mark.parametrize("kind", ["rms_matrix", "layernorm"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matrix_norm_equals_its_formula(kind, dtype):
    """MatrixNorm (both kinds on ``layers.rms_norm`` over the E·K entries) equals the reference
    formula, (x [- mean]) / sqrt(mean((x [- mean])²) + eps) · g over each token's [E, K] matrix, in
    values and in gradients for x and g (statistics in float32, output in the model dtype)."""
    eps = 1e-5
    kx, kg, kd = jax.random.split(jax.random.key(3), 3)
    x = (jax.random.normal(kx, (2, 3, 6, 5)) * 2 + 0.5).astype(dtype)
    g = 1 + 0.1 * jax.random.normal(kg, (6, 5))
    dy = jax.random.normal(kd, x.shape)
    norm = rmt.MatrixNorm(kind, eps, dtype, jnp.float32)

    def ours(x, g):
        return norm.apply({"params": {"scale": g}}, x)

    def formula(x, g):
        y = x.astype(jnp.float32)
        if kind == "layernorm":
            y = y - jnp.mean(y, axis=(-2, -1), keepdims=True)
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=(-2, -1), keepdims=True) + eps)
        return (y * g).astype(dtype)

    @jax.jit
    def values_and_grads(x, g, dy):
        (a, va), (b, vb) = jax.vjp(ours, x, g), jax.vjp(formula, x, g)
        return a, b, va(dy.astype(dtype)), vb(dy.astype(dtype))

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    a, b, grads_ours, grads_formula = values_and_grads(x, g, dy)
    assert a.dtype == b.dtype == dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
    for u, w in zip(grads_ours, grads_formula):
        assert u.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(w, np.float32), **tol)
