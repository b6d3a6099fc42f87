"""Decoder: shapes, causality through gradients, packing isolation, params, variants."""
import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from icml_jax.analysis.flops import param_count
from icml_jax.config_utils import load_config
from icml_jax.models import build_model
from icml_jax.models.positions import apply_rotary, rope_inv_freq


# Init, forward and gradients run under jit: eagerly every primitive compiles on its own, which
# costs far more CPU than one compiled program. Models are hashable (a frozen config inside), so
# they are static arguments and equal models share one compiled program across tests.

def _init(cfg, B=2, T=16, seed=0):
    model = build_model(cfg.model)
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, cfg.model.vocab_size)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), tokens)["params"])
    return model, params, tokens


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens):
    return model.apply({"params": params}, tokens)


@functools.partial(jax.jit, static_argnums=0)
def _grad_of_sum(model, params, tokens):
    return jax.grad(lambda p: model.apply({"params": p}, tokens).sum())(params)


@jax.jit
def _stack_layers(layers):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


class DecoderTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_shapes_and_dtype(self):
        cfg = load_config("configs/lm.py:tiny")
        model, params, tokens = _init(cfg)
        logits = self.variant(lambda p, t: model.apply({"params": p}, t))(params, tokens)
        chex.assert_shape(logits, (2, 16, cfg.model.vocab_size))
        chex.assert_type(logits, jnp.float32)
        chex.assert_tree_all_finite(logits)


def test_causality_through_gradients(tiny_config):
    """d logits[t] / d input embedding s is zero for s > t and non-zero for s <= t.

    Untied embeddings, so the table enters only as the input (not through the output head)."""
    tiny_config.model.tie_embeddings = False
    model, params, tokens = _init(tiny_config, B=1, T=12)
    emb = params["io"]["embedding"]

    def logit_at(x_TD, t):
        p = jax.tree.map(lambda a: a, params)
        # feed x as the input embeddings: rows 0..T-1 of the table, looked up by tokens 0..T-1
        vocab = jnp.concatenate([x_TD, emb[x_TD.shape[0]:]], 0)
        p["io"]["embedding"] = vocab
        return model.apply({"params": p}, jnp.arange(x_TD.shape[0])[None])[0, t].sum()

    grad_at = jax.jit(jax.grad(logit_at))  # t is traced: one program for every position
    x = emb[tokens[0]]
    for t in (0, 5, 11):
        g = grad_at(x, t)
        norms = np.linalg.norm(np.asarray(g), axis=-1)
        assert np.all(norms[t + 1:] == 0.0), f"future tokens influence position {t}: {norms}"
        assert np.all(norms[: t + 1] > 0.0), f"past tokens do not influence position {t}: {norms}"


@pytest.mark.parametrize("tie", [True, False])
def test_param_count_formula(tiny_config, tie):
    tiny_config.model.tie_embeddings = tie
    model = build_model(tiny_config.model)  # the count needs only the shapes
    shapes = jax.eval_shape(model.init, jax.random.key(1), jnp.zeros((2, 16), jnp.int32))
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes["params"])))
    assert n == param_count(tiny_config.model)


def test_every_leaf_has_logical_axes(tiny_config):
    model = build_model(tiny_config.model)
    boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: hasattr(x, "names"))
    assert leaves and all(hasattr(x, "names") and len(x.names) == len(x.value.shape) for x in leaves)


@pytest.mark.parametrize("scan,remat", [(True, "none"), (True, "full"), (False, "dots")])
def test_scan_and_remat_match_plain_loop(tiny_config, scan, remat):
    """Scanned / rematerialised layers compute the same function as the plain layer loop."""
    model, params, tokens = _init(tiny_config)
    base = _forward(model, params, tokens)
    c2 = tiny_config.copy_and_resolve_references()
    c2.model.scan_layers, c2.model.remat = scan, remat
    m2 = build_model(c2.model)
    if scan:  # stack the per-layer params along a leading axis
        L = tiny_config.model.num_layers
        layers = [params[f"layer_{i}"] for i in range(L)]
        p2 = {"io": params["io"], "layers": _stack_layers(layers)}
    else:
        p2 = params
    out = _forward(m2, p2, tokens)
    chex.assert_trees_all_close(out, base, atol=1e-5)
    g1 = _grad_of_sum(model, params, tokens)
    g2 = _grad_of_sum(m2, p2, tokens)
    chex.assert_trees_all_close(g1["io"], g2["io"], atol=1e-4)


def test_bfloat16_compute_keeps_float32_logits(tiny_config):
    tiny_config.model.dtype = "bfloat16"
    model, params, tokens = _init(tiny_config)
    chex.assert_type(jax.tree.leaves(params), jnp.float32)
    logits = _forward(model, params, tokens)
    chex.assert_type(logits, jnp.float32)
    tiny_config.model.dtype = "float32"
    ref = _forward(build_model(tiny_config.model), params, tokens)
    diff = float(jnp.max(jnp.abs(logits - ref)))
    assert 0.0 < diff < 0.1, diff  # bf16 really was used for compute, and stays close to fp32


def test_rope_scores_depend_only_on_relative_position():
    K = 16
    r = np.random.RandomState(0)
    q, k = r.randn(1, 1, 1, K).astype(np.float32), r.randn(1, 1, 1, K).astype(np.float32)
    inv = rope_inv_freq(K, 10000.0)
    rotate = jax.jit(apply_rotary)  # positions are traced: one program for every call

    def score(i, j):
        qi = rotate(jnp.asarray(q), jnp.array([[i]]), inv)
        kj = rotate(jnp.asarray(k), jnp.array([[j]]), inv)
        return float(jnp.sum(qi * kj))

    assert abs(score(5, 2) - score(13, 10)) < 1e-4
    assert abs(score(5, 2) - score(5, 4)) > 1e-3


def test_sequence_longer_than_max_is_rejected(tiny_config):
    model = build_model(tiny_config.model)
    T = tiny_config.model.max_seq_len + 1
    with pytest.raises(ValueError, match="max_seq_len"):
        model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))


def test_unknown_registry_name_is_a_clear_error(tiny_config):
    tiny_config.model.position = "sinusoidal_typo"
    with pytest.raises(ValueError, match="config.model.position"):
        _init(tiny_config)


def test_one_batch_overfits(tiny_config):
    """Repeating one batch drives the loss far below its starting value."""
    from icml_jax.losses.logps import token_logprobs
    model, params, tokens = _init(tiny_config, B=4, T=32)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(p, o):
        def loss(p):
            return -token_logprobs(model.apply({"params": p}, tokens[:, :-1]), tokens[:, 1:]).mean()
        l, g = jax.value_and_grad(loss)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, l

    first = None
    for _ in range(150):
        params, opt, l = step(params, opt)
        first = float(l) if first is None else first
    assert first > 5.0 and float(l) < 0.5, (first, float(l))


def test_float64_decoder_is_float64_throughout_and_agrees_with_float32(tiny_config):
    """RoPE, norms, attention and logits follow a float64 model (a parity check's precision);
    float32 is unchanged by it."""
    m32 = tiny_config.model
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, m32.vocab_size)
    with jax.enable_x64(True):
        m64 = ml_collections.ConfigDict(m32.to_dict())
        m64.dtype = m64.param_dtype = "float64"
        model64 = build_model(m64)
        p64 = jax.jit(model64.init)(jax.random.key(0), tokens)["params"]
        out64 = jax.jit(lambda p, t: model64.apply({"params": p}, t))(p64, tokens)
        assert out64.dtype == jnp.float64
        assert {x.dtype for x in jax.tree.leaves(p64)} == {jnp.dtype("float64")}
        p32 = jax.tree.map(lambda x: np.asarray(x, np.float32), p64)
    model32 = build_model(m32)
    out32 = jax.jit(lambda p, t: model32.apply({"params": p}, t))(p32, tokens)
    assert out32.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out64), np.asarray(out32), atol=2e-5, rtol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def _packed_loss_and_grad(model, params, tokens, positions, segment_ids):
    f = lambda p: model.apply({"params": p}, tokens, positions, segment_ids)  # noqa: E731
    logits = f(params)
    return logits, jax.grad(lambda p: (f(p) ** 2).mean())(params)


@pytest.mark.parametrize("position,window", [("rope", 0), ("alibi", 5)])
def test_dot_product_attention_impl_matches_ours(tiny_config, position, window):
    """config.model.attention_impl="xla" (jax.nn.dot_product_attention) gives our attention's
    logits and gradients: grouped-query heads, two packed documents, ALiBi bias, sliding window."""
    c = tiny_config
    c.model.update(num_heads=4, num_kv_heads=2, position=position, sliding_window=window)
    model, params, tokens = _init(c)
    seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
    pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
    ref, g_ref = _packed_loss_and_grad(model, params, tokens, pos, seg)
    c.model.attention_impl = "xla"
    got, g_got = _packed_loss_and_grad(build_model(c.model), params, tokens, pos, seg)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(g_got, g_ref, rtol=1e-4, atol=1e-6)
    c.model.attention_impl = "flash"
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        _init(c)


@pytest.mark.parametrize("position,window", [("rope", 0), ("alibi", 5)])
def test_causal_query_blocks_match_one_block_and_skip_work(tiny_config, position, window):
    """config.model.attention_block splits the queries into causal blocks (T=16, blocks of 4):
    logits and gradients equal the one-block attention (packed documents, GQA, ALiBi bias,
    sliding window), and the compiled step does fewer FLOPs (the masked key blocks are skipped)."""
    c = tiny_config
    c.model.update(num_heads=4, num_kv_heads=2, position=position, sliding_window=window,
                   attention_block=0)
    model, params, tokens = _init(c)
    seg = jnp.asarray([[1] * 9 + [2] * 7, [1] * 16], jnp.int32)
    pos = jnp.asarray([list(range(9)) + list(range(7)), list(range(16))], jnp.int32)
    ref, g_ref = _packed_loss_and_grad(model, params, tokens, pos, seg)
    c.model.attention_block = 4
    blocked = build_model(c.model)
    got, g_got = _packed_loss_and_grad(blocked, params, tokens, pos, seg)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(g_got, g_ref, rtol=1e-5, atol=1e-6)
    flops = [_packed_loss_and_grad.lower(m, params, tokens, pos, seg).compile().cost_analysis()["flops"]
             for m in (model, blocked)]
    assert flops[1] < flops[0], flops
