"""Position embeddings (icml_jax/models/positions.py): RoPE, FoPE, ALiBi, NoPE.

FoPE numerics are checked two ways: against outputs of the authors' own module (run once, stored in
``data/fope_reference.npz``; how: ``data/make_fope_reference.py``) and against an independent
PyTorch re-implementation of the formula in docs/methods/fope.md (torch einsum + F.pad + cat), both at
fp32 tolerance 1e-5. Then the spec's property tests, RoPE relative-position invariance, ALiBi
slopes, packed rows and KV-cache decoding at an offset for all four, and the error messages.
"""
import functools
import math
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from icml_jax.config_utils import load_config
from icml_jax.inference.decode import init_cache
from icml_jax.models import build_model
from icml_jax.models import positions as P
from icml_jax.train.optimizer import make_optimizer

REF = np.load(os.path.join(os.path.dirname(__file__), "data", "fope_reference.npz"))
METHODS = ["rope", "fope", "alibi", "nope"]


def _model_cfg(position="fope", K=16, H=2, G=2, L=256, max_len=None, **fope):
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    c.position, c.head_dim, c.num_heads, c.num_kv_heads = position, K, H, G
    c.d_model = 32
    c.train_seq_len, c.max_seq_len = L, max_len or 2 * L
    for k, v in fope.items():
        c.fope[k] = v
    return ml_collections.FrozenConfigDict(c)


# Tests jit what they run: eagerly, every primitive of a forward/backward pass compiles on its own,
# which costs far more CPU than the few whole programs compiled here. Modules and frozen configs
# are hashable, so they go in as static arguments and equal ones share one compiled program.

@functools.partial(jax.jit, static_argnums=0)
def _apply_position(module, variables, q, k, q_pos, k_pos):
    return module.apply(variables, q, k, q_pos, k_pos)


def _apply_fope(cfg, sin, cos, q_BTGRK, k_BSGK, q_pos, k_pos):
    params = {"sin_coef": jnp.asarray(sin), "cos_coef": jnp.asarray(cos)}
    return _apply_position(P.FoPE(cfg), {"params": params}, q_BTGRK, k_BSGK, q_pos, k_pos)


@functools.partial(jax.jit, static_argnums=0)
def _forward(model, params, tokens, positions=None, segment_ids=None):
    return model.apply({"params": params}, tokens, positions, segment_ids)


@functools.partial(jax.jit, static_argnums=0)
def _decode(dec, params, cache, tokens, positions, segment_ids):
    """One prefill or decode call of a ``decode=True`` model: (logits, updated cache). Compiled
    once per (token count, cache size), so the per-token decode loop reuses one program."""
    logits, m = dec.apply({"params": params, "cache": cache}, tokens, positions, segment_ids,
                          mutable=["cache"])
    return logits, m["cache"]


def _init_params(cfg, seed):
    """The params of ``build_model(cfg)`` (they do not depend on the input's shape): one jitted init
    per (config, seed), shared by the tests that use it."""
    return _init_frozen(ml_collections.FrozenConfigDict(cfg), seed)


@functools.cache
def _init_frozen(cfg, seed):
    return nn.meta.unbox(jax.jit(build_model(cfg).init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))["params"])


@jax.jit
def _scores(q_BTGRK, k_BSGK):
    return jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK)


# ----------------------------------------------------------------------------- FoPE vs reference

@pytest.mark.parametrize("case", ["c32h2L256", "c32h2L256off", "c256h4L128"])
def test_fope_matches_reference_module_outputs(case):
    """Same coefficients, same input, same (absolute) positions -> the authors' output, 1e-5."""
    d, h, L, T, all_len = (int(v) for v in REF[f"{case}/meta"])
    K = d // h
    cfg = _model_cfg(K=K, H=h, G=h, L=int(L))
    omega, d_in, d_out = P.fope_frequencies(K, 1e4, int(L))
    np.testing.assert_array_equal(omega, REF[f"{case}/omega"])
    x = REF[f"{case}/x"]  # [1, H, T, K]
    x_BTGRK = jnp.asarray(x.transpose(0, 2, 1, 3))[:, :, :, None]
    pos = jnp.arange(all_len - T, all_len)[None]
    q, k = _apply_fope(cfg, REF[f"{case}/sin_coef"], REF[f"{case}/cos_coef"], x_BTGRK,
                       x_BTGRK[:, :, :, 0], pos, pos)
    want = REF[f"{case}/y"].transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(q[:, :, :, 0]), want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(k), want, atol=1e-5, rtol=1e-5)


def _torch_fope(x_BHTK, pos_T, omega, sin_HIO, cos_HIO, pad_sin=1.0):
    """Independent re-implementation in PyTorch of FoPE's tables and rotation (docs/methods/fope.md)."""
    import torch
    import torch.nn.functional as F
    x = torch.from_numpy(x_BHTK)
    ang = torch.from_numpy(pos_T.astype(np.float32))[:, None] * torch.from_numpy(omega)[None]
    s = torch.einsum("tD,hDd->htd", ang.sin(), torch.from_numpy(sin_HIO))
    c = torch.einsum("tD,hDd->htd", ang.cos(), torch.from_numpy(cos_HIO))
    half = x.shape[-1] // 2
    s = F.pad(s, (0, half - s.shape[-1]), value=pad_sin)
    c = F.pad(c, (0, half - c.shape[-1]), value=1.0)
    s, c = torch.cat((s, s), -1)[None], torch.cat((c, c), -1)[None]
    x1, x2 = x[..., :half], x[..., half:]
    return (x * c + torch.cat((-x2, x1), -1) * s).numpy()


@pytest.mark.parametrize("pad", [1.0, 0.0])
def test_fope_matches_torch_reimplementation_with_gqa_and_packing(pad):
    """Random coefficients, per-token positions (two packed documents), pad 1 and pad 0."""
    K, H, L = 32, 4, 128
    cfg = _model_cfg(K=K, H=H, G=H, L=L, pad_sin_value=pad)
    omega, d_in, d_out = P.fope_frequencies(K, 1e4, L)
    r = np.random.RandomState(1)
    sin, cos = (r.randn(H, d_in, d_out).astype(np.float32) for _ in range(2))
    x = r.randn(1, H, 9, K).astype(np.float32)
    pos = np.array([0, 1, 2, 3, 0, 1, 2, 3, 4])
    want = _torch_fope(x, pos, omega, sin, cos, pad)
    x_BTGRK = jnp.asarray(x.transpose(0, 2, 1, 3))[:, :, :, None]
    q, _ = _apply_fope(cfg, sin, cos, x_BTGRK, x_BTGRK[:, :, :, 0], pos[None], pos[None])
    np.testing.assert_allclose(np.asarray(q[:, :, :, 0]), want.transpose(0, 2, 1, 3), atol=1e-5)


# ----------------------------------------------------------------------------- properties

def _eye_coefs(cfg):
    _, d_in, d_out = P.fope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.train_seq_len)
    e = np.broadcast_to(P.step_eye(d_in, d_out), (cfg.num_kv_heads, d_in, d_out))
    return e, e, d_in


def _rand_qk(cfg, T, seed=0):
    kq, kk = jax.random.split(jax.random.key(seed))
    G, R, K = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    return jax.random.normal(kq, (1, T, G, R, K)), jax.random.normal(kk, (1, T, G, K))


def test_identity_fope_pad0_is_clipped_rope_and_relative():
    """Property 1: S = C = I and pad 0 -> exactly RoPE on the kept frequencies (clipped RoPE);
    scores then depend only on m - n."""
    cfg = _model_cfg(K=16, H=4, G=2, L=64, pad_sin_value=0.0)
    sin, cos, d_in = _eye_coefs(cfg)
    q, k = _rand_qk(cfg, 1)
    T = 40
    q, k = jnp.tile(q, (1, T, 1, 1, 1)), jnp.tile(k, (1, T, 1, 1))  # same vector at every position
    pos = jnp.arange(T)[None]
    fq, fk = _apply_fope(cfg, sin, cos, q, k, pos, pos)
    rcfg = _model_cfg("rope", K=16, H=4, G=2, L=64).as_configdict()
    rcfg.rope_floor_clip = True
    rq, rk = _apply_position(P.RoPE(ml_collections.FrozenConfigDict(rcfg)), {}, q, k, pos, pos)
    np.testing.assert_allclose(fq, rq, atol=1e-5)
    np.testing.assert_allclose(fk, rk, atol=1e-5)
    s = np.asarray(_scores(fq, fk))[0, 0, 0]  # [T, S]
    for d in (0, 3, 17):
        diag = np.diagonal(s, offset=-d)
        np.testing.assert_allclose(diag, diag[0], atol=1e-4)


def test_identity_fope_default_pad_rotated_channels_equal_rope():
    """Property 2: with the default pad 1, channels < D_out still equal RoPE on Omega."""
    cfg = _model_cfg(K=16, H=2, G=2, L=64)
    sin, cos, d_in = _eye_coefs(cfg)
    q, k = _rand_qk(cfg, 12)
    pos = jnp.arange(3, 15)[None]
    fq, _ = _apply_fope(cfg, sin, cos, q, k, pos, pos)
    omega, _, _ = P.fope_frequencies(16, 1e4, 64)
    inv = jnp.zeros(8).at[:d_in].set(omega)
    rq = jax.jit(P.apply_rotary)(q, pos, inv)
    idx = np.r_[0:d_in, 8:8 + d_in]
    np.testing.assert_allclose(fq[..., idx], rq[..., idx], atol=1e-5)
    assert not np.allclose(fq[..., d_in:8], rq[..., d_in:8])  # pad-1 channels differ


@pytest.mark.parametrize("pad,factor", [(1.0, 2.0), (0.0, 1.0)])
def test_padded_channel_score_factor(pad, factor):
    """Property 3: a padded pair (j, j + K/2) contributes factor * (q_j k_j + q_j' k_j') to q'.k',
    at any positions (pad 1: 2x, the reference quirk; pad 0: 1x)."""
    cfg = _model_cfg(K=16, H=2, G=2, L=64, pad_sin_value=pad)
    _, d_in, d_out = P.fope_frequencies(16, 1e4, 64)
    r = np.random.RandomState(0)
    sin, cos = (r.randn(2, d_in, d_out).astype(np.float32) for _ in range(2))
    q, k = _rand_qk(cfg, 6)
    qp, kp = jnp.asarray([[0, 5, 9, 33, 60, 127]]), jnp.asarray([[2, 0, 50, 7, 1, 90]])
    fq, fk = _apply_fope(cfg, sin, cos, q, k, qp, kp)
    for j in range(d_out, 8):
        pair = [j, j + 8]
        got = jnp.einsum("BTGRK,BTGK->BTGR", fq[..., pair], fk[..., pair])
        want = jnp.einsum("BTGRK,BTGK->BTGR", q[..., pair], k[..., pair])
        np.testing.assert_allclose(got, factor * want, atol=1e-5)


@pytest.mark.parametrize("K,L,expect", [(64, 512, (16, 16)), (128, 512, (31, 31)),
                                        (64, 1024, (18, 16)), (128, 1024, (36, 32)),
                                        (64, 128, (11, 11))])
def test_fope_shapes_and_sigma(K, L, expect):
    """Property 4: D_in/D_out for the spec's table (equal to what the reference module builds) and
    sigma = g*sqrt(2/(D_out*(D_in+H))): the spec's numbers (60M g=0.3: 0.02165; 180M g=0.4:
    0.01627; 1.2B H=16 g=0.6: 0.02223) and the reference's measured init std (8 heads, g=0.3)."""
    _, d_in, d_out = P.fope_frequencies(K, 1e4, L)
    assert (d_in, d_out) == expect == tuple(REF[f"shape_{K}_{L}"])
    sigma = P.fope_init_std(8, d_in, d_out, 0.3)
    assert abs(sigma - float(REF[f"std_{K}_{L}"][0])) < 0.08 * sigma  # sampling noise of the ref
    if (K, L) == (64, 512):
        assert round(sigma, 5) == 0.02165
    if (K, L) == (128, 512):
        assert round(P.fope_init_std(8, d_in, d_out, 0.4), 5) == 0.01627
        assert round(P.fope_init_std(16, d_in, d_out, 0.6), 5) == 0.02223
    assert P.fope_init_std(8, d_in, d_out, 0.3, "gain") == 0.3
    _, _, d8 = P.fope_frequencies(K, 1e4, L, dout_divisor=8)
    assert d8 == min(d_in, K // 8)


def test_fope_init_eye_placement_and_std():
    """Property 5: S - E has empirical std ~ sigma; E at (d*step, d), broadcast over heads."""
    c = _model_cfg(K=64, H=8, G=8, L=1024, init_gain=0.3).as_configdict()
    c.d_model = 512
    cfg = ml_collections.FrozenConfigDict(c)
    v = nn.meta.unbox(jax.jit(P.FoPE(cfg).init)(jax.random.key(0), *_rand_qk(cfg, 2),
                                                jnp.zeros((1, 2), jnp.int32),
                                                jnp.zeros((1, 2), jnp.int32)))
    S, C = np.asarray(v["params"]["sin_coef"]), np.asarray(v["params"]["cos_coef"])
    assert S.shape == (8, 18, 16)
    E = np.zeros((18, 16))
    # step = ceil(18/16) = 2 and a one only where d*step < D_in: d = 0..8. Output channels 9..15
    # get no dominant frequency at all (a reference quirk, reproduced).
    E[np.arange(9) * 2, np.arange(9)] = 1
    np.testing.assert_array_equal(P.step_eye(18, 16), E)
    sigma = P.fope_init_std(8, 18, 16, 0.3)
    for X in (S, C):
        assert abs((X - E).std() - sigma) < 0.05 * sigma
        assert abs((X - E).mean()) < 0.1 * sigma
    assert not np.allclose(S, C)  # drawn independently


@pytest.mark.parametrize("learnable", [False, True])
def test_fope_gradient_and_optimizer_freeze(learnable):
    """Property 6: fixed coefficients get zero gradient and the optimizer leaves them exactly
    unchanged (no weight decay: reference = requires_grad False); learnable ones move."""
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.model.position, c.model.head_dim, c.model.train_seq_len = "fope", 16, 32
    c.model.fope.learnable = learnable
    model = build_model(c.model)
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 200)
    params = _init_params(c.model, 1)
    c.train.weight_decay = 0.5
    tx = make_optimizer(c.train, model_cfg=c.model)

    @jax.jit
    def step(p, st):  # also returns the gradient at p: one compiled program for both checks
        g = jax.grad(lambda p: model.apply({"params": p}, tok).mean())(p)
        upd, st = tx.update(g, st, p)
        return optax.apply_updates(p, upd), st, g

    new, st, g = step(params, jax.jit(tx.init)(params))
    norm = float(optax.global_norm(g["layer_0"]["attn"]["position"]))
    assert (norm > 0) == learnable, norm
    for _ in range(2):
        new, st, _ = step(new, st)
    moved = not np.allclose(new["layer_0"]["attn"]["position"]["sin_coef"],
                            params["layer_0"]["attn"]["position"]["sin_coef"])
    assert moved == learnable
    assert not np.allclose(new["layer_0"]["attn"]["qkv"], params["layer_0"]["attn"]["qkv"])


@pytest.mark.parametrize("fresh", [True, False])
def test_fope_context_extension(fresh):
    """Property 7: expanding L copies the old coefficients into the top-left block."""
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.model.position, c.model.head_dim, c.model.max_seq_len = "fope", 64, 512
    c.model.train_seq_len = 128
    params = _init_params(c.model, 1)
    c.model.train_seq_len = 1024
    c.model.max_seq_len = 1024
    new = jax.jit(lambda p, key: P.extend_fope_params(p, c.model, key, fresh_init=fresh))(
        params, jax.random.key(2))
    old_s = params["layer_1"]["attn"]["position"]["sin_coef"]
    new_s = np.asarray(new["layer_1"]["attn"]["position"]["sin_coef"])
    assert old_s.shape == (2, 11, 11) and new_s.shape == (2, 18, 16)
    np.testing.assert_array_equal(new_s[:, :11, :11], old_s)
    rest = new_s.copy()
    rest[:, :11, :11] = 0
    assert (np.abs(rest).sum() > 0) == fresh
    if fresh:
        assert rest[:, 12, 6].tolist() == pytest.approx([1.0, 1.0], abs=0.2)  # step eye (12, 6)
    np.testing.assert_array_equal(new["layer_1"]["attn"]["qkv"], params["layer_1"]["attn"]["qkv"])
    out = _forward(build_model(c.model), new, jnp.zeros((1, 600), jnp.int32))
    chex.assert_tree_all_finite(out)


# ----------------------------------------------------------------------------- RoPE, ALiBi

@pytest.mark.parametrize("clip", [False, True])
def test_rope_scores_depend_only_on_offset(clip):
    c = _model_cfg("rope", K=16, H=2, G=2, L=64).as_configdict()
    c.rope_floor_clip = clip
    rope = P.RoPE(ml_collections.FrozenConfigDict(c))
    q, k = _rand_qk(c, 1, seed=3)
    T = 30
    q, k = jnp.tile(q, (1, T, 1, 1, 1)), jnp.tile(k, (1, T, 1, 1))
    pos = jnp.arange(T)[None]
    s = np.asarray(_scores(*_apply_position(rope, {}, q, k, pos, pos)))[0, 0, 0]
    for d in (0, 1, 7, 20):
        diag = np.diagonal(s, offset=-d)
        np.testing.assert_allclose(diag, diag[0], atol=1e-4)
    s2 = np.asarray(_scores(*_apply_position(rope, {}, q, k, pos + 100, pos + 100)))[0, 0, 0]
    np.testing.assert_allclose(s2, s, atol=1e-3)
    inv = np.asarray(rope.apply({}, 16, method=P.RoPE.inv_freq))
    full = 1e4 ** (-np.arange(0, 16, 2) / 16)
    kept = full >= 2 * np.pi / 64
    assert kept.sum() == 3  # 1, 0.316, 0.1 kept; 0.0316 (period 199 > 64) dropped
    np.testing.assert_allclose(inv, np.where(kept, full, 0.0) if clip else full, rtol=1e-6)


def test_alibi_slopes():
    np.testing.assert_allclose(P.alibi_slopes(8), [2.0 ** -i for i in range(1, 9)])
    np.testing.assert_allclose(P.alibi_slopes(4), [2.0 ** (-2 * i) for i in range(1, 5)])
    # not a power of two (the paper's recipe): slopes of 4, then every other slope of 8
    np.testing.assert_allclose(P.alibi_slopes(6), [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8])
    np.testing.assert_allclose(P.alibi_slopes(12)[:8], P.alibi_slopes(8))


def test_alibi_bias_layout():
    """bias[b, g, r, t, s] = -slope[g*R + r] * (q_pos[t] - k_pos[s]), float32."""
    c = _model_cfg("alibi", K=8, H=4, G=2, L=32)
    qp, kp = jnp.asarray([[5, 6]]), jnp.asarray([[0, 3, 6]])
    b = P.ALiBi(c).apply({}, qp, kp, method=P.ALiBi.bias)
    assert b.dtype == jnp.float32 and b.shape == (1, 2, 2, 2, 3)
    slopes = P.alibi_slopes(4)
    for g in range(2):
        for r in range(2):
            want = -slopes[g * 2 + r] * (np.array([[5], [6]]) - np.array([[0, 3, 6]]))
            np.testing.assert_allclose(b[0, g, r], want)


# ----------------------------------------------------------------------------- all four methods

@functools.cache  # read-only: shared by the packing, KV-cache and methods-differ tests
def _lm(position, seed=0):
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    c.position, c.head_dim, c.train_seq_len, c.max_seq_len = position, 16, 32, 64
    c = ml_collections.FrozenConfigDict(c)
    model = build_model(c)
    params = _init_params(c, seed)
    # larger weights than init -> position effects are visible in the logits
    params = jax.jit(lambda ps: jax.tree_util.tree_map_with_path(
        lambda p, x: x if "position" in jax.tree_util.keystr(p) else x * 3.0, ps))(params)
    return c, model, params


@pytest.mark.parametrize("position", METHODS)
def test_packed_rows_equal_documents_alone(position):
    c, model, params = _lm(position)
    r = np.random.RandomState(0)
    a, b = r.randint(3, 259, 7), r.randint(3, 259, 11)
    row = np.concatenate([a, b])[None]
    seg = np.array([[1] * 7 + [2] * 11])
    pos = np.array([list(range(7)) + list(range(11))])
    packed = _forward(model, params, row, pos, seg)[0]
    chex.assert_trees_all_close(packed[:7], _forward(model, params, a[None])[0], atol=1e-5)
    chex.assert_trees_all_close(packed[7:], _forward(model, params, b[None])[0], atol=1e-5)
    # changing the first document leaves the second one's logits untouched
    row2 = row.copy()
    row2[0, :7] = r.randint(3, 259, 7)
    packed2 = _forward(model, params, row2, pos, seg)[0]
    chex.assert_trees_all_close(packed2[7:], packed[7:], atol=1e-6)
    assert not np.allclose(packed2[:7], packed[:7])


@pytest.mark.parametrize("position", METHODS)
def test_kv_cache_decoding_at_offset_equals_full_forward(position):
    """A document whose positions start at 9 (an offset): prefill 5 tokens into the KV cache, then
    decode the rest one at a time; logits equal one full forward over the same positions. Also a
    cache with a stale other-document prefix in front (segment 2 at slots 0..2)."""
    c, model, params = _lm(position)
    T, off, pre = 18, 9, 5  # T and the segment ids as the packed test's: its compiled full forward
    # numpy inputs: slicing them per step compiles nothing
    tok = np.asarray(jax.random.randint(jax.random.key(4), (1, T), 3, 259))
    pos = off + np.arange(T)[None]
    full = _forward(model, params, tok, pos, np.ones((1, T), np.int32))
    dec = build_model(c, decode=True)
    for lead in (0, 3):
        cache = init_cache(dec, 1, lead + T)
        outs = []
        if lead:
            _, cache = _decode(dec, params, cache, tok[:, :lead], jnp.arange(lead)[None],
                               jnp.full((1, lead), 2))
        logits, cache = _decode(dec, params, cache, tok[:, :pre], pos[:, :pre],
                                jnp.ones((1, pre), jnp.int32))
        outs.append(logits)
        for t in range(pre, T):
            logits, cache = _decode(dec, params, cache, tok[:, t:t + 1], pos[:, t:t + 1],
                                    jnp.ones((1, 1), jnp.int32))
            outs.append(logits)
        np.testing.assert_allclose(np.concatenate(outs, 1), full, atol=2e-4, rtol=2e-4)


def test_methods_differ_from_each_other():
    """Guards against a registry entry silently aliasing another."""
    tok = jax.random.randint(jax.random.key(4), (1, 11), 3, 259)  # the packed test's 2nd document's shape
    outs = {}
    for p in METHODS:
        _, model, params = _lm(p)
        outs[p] = np.asarray(_forward(model, params, tok))
    for i, a in enumerate(METHODS):
        for b in METHODS[i + 1:]:
            assert not np.allclose(outs[a], outs[b], atol=1e-3), (a, b)


# ----------------------------------------------------------------------------- errors

def test_unknown_position_is_a_clear_error():
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    c.position = "sinusoidal"
    with pytest.raises(ValueError, match=r"unknown position embedding 'sinusoidal'.*"
                                         r"config.model.position.*alibi.*fope.*nope.*rope"):
        build_model(c).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


def test_fope_training_length_without_frequencies_is_a_clear_error():
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    c.position, c.train_seq_len = "fope", 4  # 2*pi/4 > 1 = the highest frequency
    with pytest.raises(ValueError, match=r"FoPE: training length 4 .*keeps no frequency"):
        build_model(c).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    assert math.isclose(P.fope_frequencies(8, 1e4, 7)[0][0], 1.0)  # 2*pi/7 < 1: one is kept
