"""The static-slot KV policies keep exactly the set their rule names (brute-force NumPy references).

Everything a test computes with JAX runs jitted (eagerly, every primitive compiles on its own)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.inference import kv_policies as kp
from tests.inference.helpers import decode_kept, kept_sets

T_STEPS = 48


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _reference_decode(policy, N, L):
    """Set-based rule on a [T, T] logit map: the kept positions after each step t."""
    S, acc, kept = [], {}, []
    probs_hist = []  # (j, {n: p_j[n]}) for the queries so far
    for t in range(L.shape[0]):
        if len(S) == N:
            W = policy.window
            if policy.name == "streaming":
                victim = min(n for n in S if n >= policy.sinks)
            elif policy.name == "h2o":
                victim = min((n for n in S if n < t - W), key=lambda n: acc[n])
            elif policy.name == "morphkv":
                old = [n for n in S if n < t - W]
                rows = [j for j in range(max(0, t - W), t)]
                fused = {n: [] for n in old}
                for j in rows:
                    a = _softmax(np.array([L[j, n] for n in old]))
                    for n, v in zip(old, a):
                        fused[n].append(v)
                agg = (lambda v: sum(v)) if policy.fuse == "sum" else (lambda v: max(v) if v else 0.0)
                victim = min(old, key=lambda n: agg(fused[n]))
            else:
                raise AssertionError("no decode eviction")
            S.remove(victim)
        S.append(t)
        acc[t] = 0.0
        p = _softmax(np.array([L[t, n] for n in S]))
        for n, v in zip(S, p):
            acc[n] += v
        probs_hist.append(p)
        kept.append(sorted(S))
    return kept


def _static_decode(policy, N, L):
    """The jitted slot rules driven by the same logits: kept positions after each step."""
    return kept_sets(decode_kept(policy, L[None], kp.init_state(policy, (1,), N), 0)[0])


@pytest.mark.parametrize("policy,N", [
    (kp.KVPolicy("streaming", sinks=4), 12),
    (kp.KVPolicy("h2o", window=4), 12),
    (kp.KVPolicy("morphkv", window=4, fuse="sum"), 12),
    (kp.KVPolicy("morphkv", window=4, fuse="max"), 12),
    (kp.KVPolicy("morphkv", window=6, fuse="sum"), 9),
])
def test_evict_one_slots_keep_the_rule_set_at_every_step(policy, N):
    L = np.random.default_rng(0).normal(size=(T_STEPS, T_STEPS)) * 2.0
    ref = _reference_decode(policy, N, L)
    got = _static_decode(policy, N, L)
    assert got == ref
    assert all(len(k) == min(t + 1, N) for t, k in enumerate(got))  # constant size once full
    if policy.name == "morphkv":  # evict-one equals the reference's top-(C - W) set rule (spec: [inferred])
        topk = _reference_prompt_decode(policy, N, L, 1)[1:]  # one-token prompt, then the set rule each step
        assert got[1:] == topk


def test_policies_evict_differently():
    """The rules are not the same rule: on one logit map the kept sets differ."""
    L = np.random.default_rng(1).normal(size=(T_STEPS, T_STEPS)) * 2.0
    finals = {name: tuple(_static_decode(kp.KVPolicy(name, window=4), 12, L)[-1])
              for name in ("streaming", "h2o", "morphkv")}
    assert len(set(finals.values())) == 3, finals


def test_morphkv_without_old_budget_is_a_sliding_window():
    W = 5
    L = np.random.default_rng(2).normal(size=(30, 30))
    got = _static_decode(kp.KVPolicy("morphkv", window=W), W + 1, L)
    assert got == [list(range(max(0, t - W), t + 1)) for t in range(30)]


def test_budget_at_least_the_sequence_evicts_nothing():
    L = np.random.default_rng(3).normal(size=(20, 20))
    for name in kp.POLICIES:
        got = _static_decode(kp.KVPolicy(name, window=4), 20, L)
        assert got[-1] == list(range(20)), name


def test_morph_scores_without_old_slots_are_not_nan():
    policy = kp.KVPolicy("morphkv", window=4)

    @jax.jit
    def write_and_observe(state, t):
        state = kp.write(policy, state, kp.choose_slot(policy, state, t), t)
        return kp.observe(policy, state, jnp.zeros((2, 8)), jnp.zeros((2, 8)))

    state = kp.init_state(policy, (2,), 8)
    for t in range(3):  # three tokens, all inside the window: no old slot yet
        state = write_and_observe(state, jnp.int32(t))
    s, slot = jax.jit(lambda st, t: (kp.morph_scores(policy, st, t), kp.choose_slot(policy, st, t)))(
        state, jnp.int32(3))
    assert not np.isnan(np.asarray(s)).any() and np.isneginf(np.asarray(s)).all()
    np.testing.assert_array_equal(slot, [3, 3])


def _causal_logits(P, seed):
    z = np.random.default_rng(seed).normal(size=(P, P)) * 2.0
    return np.where(np.tril(np.ones((P, P), bool)), z, -np.inf)


def _row_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _morph_first_step_keep(z, N, W, fuse):
    """What MorphKV's reference keeps of an uncompressed P-token prompt at its first decode step
    (t = P; it never compresses at prefill): the last W prompt positions, the new token, and the
    top N - W - 1 positions before them by the last W prompt queries' rows, each a softmax over
    those older positions, fused by sum or max. Returns the kept prompt positions, ascending."""
    P = z.shape[0]
    old = np.arange(P) < P - W
    a = _row_softmax(np.where(old, z[P - W:], -np.inf))
    s = a.sum(0) if fuse == "sum" else a.max(0)
    top = np.argsort(-np.where(old, s, -np.inf), kind="stable")[:N - W - 1]
    return np.sort(np.concatenate([top, np.arange(P - W, P)]))


# the policy and the slot count are static (they fix the shapes): one program per policy and shape
_prefill_keep = jax.jit(kp.prefill_keep, static_argnums=(0, 1))
_prefill_select = jax.jit(kp.prefill_select, static_argnums=(0, 1))


def test_prefill_keep_matches_numpy_rules():
    P, N, W = 40, 16, 6
    z = _causal_logits(P, 4)
    p = _row_softmax(z)
    idx = np.arange(P)
    # snapkv (snapkv_utils.update_kv): the last W queries' probabilities over the positions before
    # the window, summed, avg-pooled with zero padding (divisor = kernel); top N - W + the window.
    # Queries that attend to themselves (a raised diagonal) give the window's columns mass, which
    # pooling over them too would spill onto the positions before the window: another set here.
    zs = z.copy()
    zs[idx, idx] += 4.0
    ps = _row_softmax(zs)
    for pool in (5, 7):
        pol = kp.KVPolicy("snapkv", window=W, pool=pool)
        pool_avg = lambda obs: np.convolve(np.pad(obs, pool // 2), np.ones(pool) / pool, mode="valid")  # noqa: E731
        top = np.argsort(-pool_avg(ps[P - W:, :P - W].sum(0)), kind="stable")[:N - W]
        want = np.sort(np.concatenate([top, np.arange(P - W, P)]))
        np.testing.assert_array_equal(_prefill_keep(pol, N, probs_PP=jnp.asarray(ps, jnp.float32)), want)
        spilled = np.argsort(-pool_avg(ps[P - W:].sum(0))[:P - W], kind="stable")[:N - W]
        assert set(spilled) != set(top), pool
    # morphkv: the reference's first decode step after the uncompressed prompt (N - 1 kept)
    for fuse in ("sum", "max"):
        pol = kp.KVPolicy("morphkv", window=W, fuse=fuse)
        want = _morph_first_step_keep(z, N, W, fuse)
        assert len(want) == N - 1
        np.testing.assert_array_equal(_prefill_keep(pol, N, logits_PP=jnp.asarray(z, jnp.float32)), want)
    # a prompt no longer than the slots is kept whole, for both fusions
    for fuse in ("sum", "max"):
        for n in (1, W, W + 1, N):
            idx, chosen = _prefill_select(kp.KVPolicy("morphkv", window=W, fuse=fuse), N, jnp.arange(n),
                                            jnp.ones(n, bool), logits_PP=jnp.asarray(z[:n, :n], jnp.float32))
            np.testing.assert_array_equal(idx, np.arange(n))
            assert bool(chosen.all())
    # streaming: sinks and the latest
    got = _prefill_keep(kp.KVPolicy("streaming", sinks=4), N, logits_PP=jnp.asarray(z))
    np.testing.assert_array_equal(got, list(range(4)) + list(range(P - (N - 4), P)))


def test_morphkv_prompt_then_decode_matches_the_reference_with_gqa():
    """The cache module itself (``PolicyKVCache``, GQA with 3 query heads per KV head): a 40-token
    prompt through prefill and then decode steps keeps, after each step, the set the reference
    keeps when it scores with the query group's raw logits summed before the softmax (spec
    property 4), starting from its uncompressed prompt. Scoring with the heads' averaged softmaxes
    instead keeps another set (the check has teeth)."""
    from icml_jax.models.attention import PolicyKVCache
    P, steps, N, W, G, R, K = 40, 6, 16, 6, 2, 3, 8
    rng = np.random.default_rng(5)
    q = rng.normal(size=(1, P + steps, G, R, K)).astype(np.float32) * 2
    k = rng.normal(size=(1, P + steps, G, K)).astype(np.float32)
    v = rng.normal(size=(1, P + steps, G, K)).astype(np.float32)
    pos = np.arange(P + steps)[None].astype(np.int32)
    seg = np.ones_like(pos)
    pol = kp.KVPolicy("morphkv", slots=N, window=W, fuse="sum")
    init, step = _cache_fns(PolicyKVCache(pol))
    sl = lambda x, a, b: jnp.asarray(x[:, a:b])  # noqa: E731
    cache = init(sl(q, 0, P), sl(k, 0, P), sl(v, 0, P), sl(pos, 0, P), sl(seg, 0, P))
    kept = []
    for a, b in [(0, P)] + [(t, t + 1) for t in range(P, P + steps)]:
        _, upd = step(cache, sl(q, a, b), sl(k, a, b), sl(v, a, b), sl(pos, a, b), sl(seg, a, b))
        cache = upd["cache"]
        slot_pos = np.asarray(cache["slot_pos"])[0]  # [G, N]
        kept.append([sorted(int(x) for x in row if x >= 0) for row in slot_pos])
    for g in range(G):
        zsum = np.einsum("trk,sk->ts", q[0, :, g], k[0, :, g]) / np.sqrt(K)  # group-summed logits
        zsum = np.where(np.tril(np.ones(zsum.shape, bool)), zsum, -np.inf)
        ref = _reference_prompt_decode(pol, N, zsum, P)
        assert kept[0][g] == ref[0], g  # after prefill: N - 1 prompt slots
        assert kept[1:] and [kp_[g] for kp_ in kept[1:]] == ref[1:], g
        # averaged per-head softmaxes as the score: another set on this draw
        per_head = np.einsum("trk,sk->rts", q[0, :, g], k[0, :, g]) / np.sqrt(K)
        avg = np.log(np.mean([_row_softmax(np.where(np.tril(np.ones(h.shape, bool)), h, -np.inf))
                              for h in per_head], axis=0) + 1e-30)
        assert _reference_prompt_decode(pol, N, avg, P) != ref, g


@pytest.mark.parametrize("name", ["morphkv", "h2o", "streaming"])
def test_a_left_padded_batch_of_mixed_prompt_lengths_equals_each_row_alone(name):
    """Rows of 24, 10, 7 and 15 real tokens (left-padded to 24) with 10 slots: some compressed at
    prefill, some not. Each row keeps the slots, and attends to the values, it would alone, through
    the prefill and 4 decode steps; a compressed MorphKV row leaves one slot free for the first
    generated token, an uncompressed one has its N - n free slots."""
    from icml_jax.models.attention import PolicyKVCache
    P, N, W, G, R, K, steps, lens = 24, 10, 3, 2, 2, 4, 4, [24, 10, 7, 15]
    B, T = len(lens), P + steps
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, G, R, K)).astype(np.float32) * 2
    k = rng.normal(size=(B, T, G, K)).astype(np.float32)
    v = rng.normal(size=(B, T, G, K)).astype(np.float32)
    pos, seg = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b, n in enumerate(lens):
        pos[b, P - n:] = np.arange(n + steps)
        seg[b, P - n:] = 1
    init, step = _cache_fns(PolicyKVCache(kp.KVPolicy(name, slots=N, window=W, sinks=2)))

    def run(arrs, prompt):
        part = lambda a, b: [jnp.asarray(x[:, a:b]) for x in arrs]  # noqa: E731
        cache = init(*part(0, prompt))
        outs, kept = [], []
        for a, b in [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + steps)]:
            o, upd = step(cache, *part(a, b))
            cache = upd["cache"]
            outs.append(np.asarray(o[:, -1]))
            kept.append(np.sort(np.asarray(cache["slot_pos"]), -1))
        return outs, kept

    outs, kept = run((q, k, v, pos, seg), P)
    for b, n in enumerate(lens):
        alone_outs, alone_kept = run([x[b:b + 1, P - n:] for x in (q, k, v, pos, seg)], n)
        for i in range(len(kept)):
            np.testing.assert_array_equal(kept[i][b], alone_kept[i][0], err_msg=f"{name} row {b} step {i}")
        for i in range(1, len(outs)):
            np.testing.assert_allclose(outs[i][b], alone_outs[i][0], rtol=1e-5, atol=1e-5)
        if name == "morphkv":
            free = (kept[0][b] < 0).sum(-1)
            np.testing.assert_array_equal(free, 1 if n > N else N - n)


def _cache_fns(mod):
    """(init, step) of a ``PolicyKVCache`` without a position bias, each one jitted program per shape:
    ``init(q, k, v, pos, seg)`` -> its cache, ``step(cache, q, k, v, pos, seg)`` -> (output,
    {"cache": updated cache}) for a prefill or a decode call."""
    no_bias = lambda *_: None  # noqa: E731
    init = jax.jit(lambda *x: mod.init(jax.random.key(0), *x, no_bias)["cache"])
    step = jax.jit(lambda cache, *x: mod.apply({"cache": cache}, *x, no_bias, mutable=["cache"]))
    return init, step


def _reference_prompt_decode(policy, N, L, P):
    """The reference repo's MorphKV on a logit map L [T, T] with a P-token prompt: no compression
    at prefill; at each decode step t >= P the cache (kept positions plus t) is cut to N by keeping
    the last W + 1 and the top N - W - 1 older ones by the fused score of the rows t - W .. t - 1.
    Returns the kept positions after prefill (the first step's choice, without t) and after each
    decode step."""
    W = policy.window
    S, out = list(range(P)), []
    for t in range(P, L.shape[0]):
        cache = S + [t]
        if len(cache) > N:
            old = [n for n in cache if n < t - W]
            a = _row_softmax(np.where(np.isin(np.arange(L.shape[1]), old), L[t - W:t], -np.inf))[:, old]
            s = a.sum(0) if policy.fuse == "sum" else a.max(0)
            top = [old[i] for i in np.argsort(-s, kind="stable")[:N - W - 1]]
            cache = sorted(top + [n for n in cache if n >= t - W])
        if t == P:
            out.append([n for n in cache if n < P])
        S = cache
        out.append(sorted(S))
    return out


def test_bad_policies_are_clear_errors():
    with pytest.raises(ValueError, match="choose one of"):
        kp.KVPolicy("lru")
    with pytest.raises(ValueError, match="fuse"):
        kp.KVPolicy("morphkv", fuse="mean")
    with pytest.raises(ValueError, match="window \\+ 1"):
        kp.KVPolicy("morphkv", slots=4, window=4)
    with pytest.raises(ValueError, match="exceed sinks"):
        kp.KVPolicy("streaming", slots=4, sinks=4)


# ----------------------------------------------------------------------------- in generate

PROMPTS = [[1, 40, 51, 62, 73, 84, 95, 17, 23, 31, 45, 58], [1, 9, 27, 81]]
N_NEW = 12


def _lm(scan_layers=False, position="rope"):
    """(config.model, params) of the tiny decoder: params built once per setting, a fresh copy of
    the config every call."""
    cfg, params = _built_lm(scan_layers, position)
    return ml_collections_copy(cfg), params


@functools.cache
def _built_lm(scan_layers, position):
    from icml_jax.config_utils import load_config
    from icml_jax.models.decoder import build_model
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.update(dict(scan_layers=scan_layers, position=position))
    m = build_model(cfg)
    params = jax.jit(lambda key: jax.tree.map(lambda x: x * 4.0, m.init(key, jnp.zeros((1, 8), jnp.int32))["params"]))(
        jax.random.key(0))
    return cfg, params


def _gen(cfg, params, prompts=PROMPTS, **kw):
    from icml_jax.inference.decode import generate
    return generate(cfg, params, prompts, key=jax.random.key(0), max_new_tokens=N_NEW, temperature=0,
                    return_logits=True, **kw)


@pytest.mark.parametrize("scan_layers,position", [(False, "rope"), (True, "rope"), (False, "alibi")])
def test_every_policy_with_room_for_everything_equals_the_full_cache(scan_layers, position):
    """Slots >= prompt + response: no eviction, so each policy's decode (left-padded batch, GQA)
    gives the full cache's tokens and logits."""
    cfg, params = _lm(scan_layers=scan_layers, position=position)
    full = _gen(cfg, params)
    room = 16 + N_NEW  # the prompt bucket + the response
    for name in ("streaming", "h2o", "morphkv", "snapkv"):
        out = _gen(cfg, params, kv_policy=kp.KVPolicy(name, slots=room, window=4, sinks=2))
        np.testing.assert_array_equal(out.tokens, full.tokens, err_msg=name)
        np.testing.assert_allclose(out.logits, full.logits, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_evicting_caches_equal_sliding_window_attention(position):
    """StreamingLLM without sinks and MorphKV without an old budget keep exactly the last N
    tokens, which is sliding-window attention of width N with the full cache (prompt <= N); the
    caches hold N slots per KV head, and fewer slots change the output."""
    from icml_jax.inference.decode import init_cache
    from icml_jax.models.decoder import build_model
    prompts = [PROMPTS[0][:6]]
    cfg, params = _lm(position=position)
    N = 7
    cfg_w = ml_collections_copy(cfg, sliding_window=N)
    ref = _gen(cfg_w, params, prompts)
    for pol in (kp.KVPolicy("streaming", slots=N, sinks=0), kp.KVPolicy("morphkv", slots=N, window=N - 1)):
        out = _gen(cfg, params, prompts, kv_policy=pol)
        np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=pol.name)
        np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-5, err_msg=pol.name)
    full = _gen(cfg, params, prompts)
    assert np.abs(full.logits - ref.logits).max() > 1e-3  # the window matters: the test has teeth
    from icml_jax.inference.decode import _with_kv_policy
    cache = init_cache(build_model(_with_kv_policy(cfg, kp.KVPolicy("h2o", slots=N, window=2)), decode=True),
                       1, 16 + N_NEW)
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(cache)[0]}
    assert all(s[2] == N for k, s in shapes.items() if k.endswith("['k']") or k.endswith("['v']")), shapes


def ml_collections_copy(cfg, **kw):
    import ml_collections
    c = ml_collections.ConfigDict(cfg.to_dict())
    c.update(kw)
    return c


def test_scored_decode_equals_the_full_forward_and_a_sliding_window_model():
    """Teacher-forced scoring through the cached step: with the full cache (and a policy with room)
    it gives the full forward's per-token log-probs; StreamingLLM without sinks while evicting
    gives the log-probs of a sliding-window model's full forward."""
    from icml_jax.inference.decode import scored_decode
    from icml_jax.models.decoder import build_model
    cfg, params = _lm()
    toks = np.asarray(jax.random.randint(jax.random.key(7), (2, 24), 1, cfg.vocab_size))

    def forward_lp(c, argmax=False):
        model = build_model(c)
        lp = np.asarray(jax.jit(lambda p, t: jax.nn.log_softmax(
            model.apply({"params": p}, t)[:, :-1].astype(jnp.float32), -1))(params, jnp.asarray(toks)))
        got = np.take_along_axis(lp, toks[:, 1:, None], -1)[..., 0]
        return (got, lp.argmax(-1)) if argmax else got

    ref, ref_top = forward_lp(cfg, argmax=True)
    lp, top = scored_decode(cfg, params, toks, prompt_len=5, return_argmax=True)
    np.testing.assert_allclose(lp, ref, rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(top, ref_top)  # prompt and decoded steps alike
    for pol in (kp.KVPolicy("h2o", slots=24, window=4), kp.KVPolicy("morphkv", slots=24, window=4)):
        np.testing.assert_allclose(scored_decode(cfg, params, toks, prompt_len=5, kv_policy=pol),
                                   ref, rtol=1e-5, atol=2e-5, err_msg=pol.name)
    N = 6
    win = forward_lp(ml_collections_copy(cfg, sliding_window=N))
    got = scored_decode(cfg, params, toks, prompt_len=4, kv_policy=kp.KVPolicy("streaming", slots=N, sinks=0))
    np.testing.assert_allclose(got, win, rtol=1e-5, atol=2e-5)
    assert np.abs(win - ref).max() > 1e-3
    with pytest.raises(ValueError, match="prompt_len"):
        scored_decode(cfg, params, toks, prompt_len=24)
    from icml_jax import xla_env  # compiled through decode_jit, with its options
    from icml_jax.inference import decode
    assert list(decode._scored.variants) == [tuple((xla_env.decode_compiler_options() or {}).items())]
