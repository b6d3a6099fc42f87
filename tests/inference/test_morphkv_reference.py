"""MorphKV's kept sets against the authors' own code, executed (fixture ``data/morphkv_reference.npz``).

How the fixture was made (once, by hand): ``/tmp/mkref/make_fixture.py``, a generator kept OUTSIDE
this repository because the project does not copy reference code. It imports ``morphkv/`` of
ghadiaravi13/MorphKV at commit 8903d2a (``morph_cache.py``, ``models/patch_llama.py``, unchanged) with
torch 2.13 CPU and transformers 5.23, and executes the reference's attention modules directly:
``LlamaFlashAttention2Morph.forward`` for the prompt (it stores the last W queries' raw logit rows
in ``attn_cache`` and compresses nothing), whose decode path (one token) is
``LlamaAttentionMorph.forward`` -> ``morphkv_mask`` (each window row softmaxed over the columns
older than the window, fused by sum or max, top max_capacity - W of them plus the last W + 1 kept)
-> ``DynamicCache.cleanup`` (index_select of the kept key / value / window columns), plus the
forward's own roll-and-append of the window rows. 2 layers, hidden 32, 2 heads = 2 KV heads
(num_key_value_groups = 1: no GQA, so the documented GQA deviation does not enter), chained with a
residual over random token embeddings; ``morph_type`` "sum_fused" / "max_fused", evict_after 1.
Stubs, none in the selection math: the package ``__init__`` is bypassed (it imports the other
models' patches); transformers 5.x lacks ``is_hqq_available`` / ``is_quanto_available`` (-> False)
and the "default" RoPE init (-> the standard inverse frequencies), and its ``Cache.__init__``
demands layers (the reference's DynamicCache gets a bare base); ``_flash_attention_forward`` (no
flash-attn on CPU) is eager causal attention (it gives the prefill's output only); the CUDA-only
``MorphOffloadedCache`` is replaced by the plain reference ``DynamicCache`` plus its ``cleaned``
flag. ``llama_model_forward`` is not run (it needs transformers 4.4x's ``_update_causal_mask``).

The fixture holds, per setting s{0,1,2} and fusion, for each (layer, head): the rotated q / k the
reference computed (``_q``, ``_k``: [layers, heads, T, head_dim]); the logit map ``_L`` [layers, heads,
T, T] (query t, key s; causal; the exact values the reference used where it computed them, the
rest the same torch matmul); the original positions its cache holds after the prompt and after
each decode step (``_kept`` [steps + 1, layers, heads, .], -1 padded); ``_min_gap``, the smallest
relative gap between the last kept and first evicted fused score over all its evictions
(>= 1.1e-3, so float32 rounding cannot flip a choice). Settings (P, steps, W, max_capacity, seed):
(20, 10, 4, 12, 0), (16, 12, 3, 8, 1), (3, 16, 4, 10, 2) (a prompt shorter than the window: the
reference's fill path). Our N = max_capacity + 1.

The reference never compresses the prompt: it holds all P positions until its first decode step
cuts the cache. Our ``prefill_select`` keeps at once what that step keeps of the prompt (N - 1
slots, one left free for the first generated token), so our post-prefill set is compared with the
reference's set after its first step without that token.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.inference import kv_policies as kp
from tests.inference.helpers import decode_kept, kept_sets

REF = os.path.join(os.path.dirname(__file__), "data", "morphkv_reference.npz")
CASES = [(s, f) for s in range(3) for f in ("sum", "max")]


@pytest.fixture(scope="module")
def ref():
    with np.load(REF) as d:
        return {k: d[k] for k in d.files}


def _case(ref, s, fuse):
    P, steps, W, cap, _ = (int(x) for x in ref["settings"][s])
    L = ref[f"s{s}_{fuse}_L"]
    nl, nh, T, _ = L.shape
    kept = ref[f"s{s}_{fuse}_kept"].reshape(steps + 1, nl * nh, -1)
    ref_sets = [[sorted(int(x) for x in row if x >= 0) for row in k] for k in kept]
    return P, W, cap, L.reshape(nl * nh, T, T), ref_sets


def _ours(policy, N, L, P):
    """Our slot rules on the reference's logits, rows = (layer, head): the prompt's slots as the
    cache module keeps them (``prefill_state`` on the causal prompt logits), then ``choose_slot`` /
    ``write`` / ``observe`` per decode step. Kept positions after the prompt and after each step."""
    H = L.shape[0]
    Lj = jnp.asarray(L)
    _, state = kp.prefill_state(policy, N, jnp.broadcast_to(jnp.arange(P), (H, P)), jnp.ones((H, P), bool),
                                Lj[:, :P, :P])
    steps = decode_kept(policy, Lj, state, P)  # [H, steps, N]
    return [kept_sets(state.pos)] + [kept_sets(steps[:, i]) for i in range(steps.shape[1])]


def _check(ours, ref_sets, P, N):
    """Our sets equal the reference's at every step (after the prompt: see the module docstring)."""
    H = len(ref_sets[0])
    assert all(ref_sets[0][h] == list(range(P)) for h in range(H))  # it never compresses the prompt
    want0 = [[p for p in ref_sets[1][h] if p < P] for h in range(H)] if P + 1 > N else ref_sets[0]
    assert ours[0] == want0, "after the prompt"
    for i in range(1, len(ref_sets)):
        assert ours[i] == ref_sets[i], f"after decode step {i} (t = {P + i - 1})"


@pytest.mark.parametrize("s,fuse", CASES)
def test_slot_rules_keep_the_references_sets(ref, s, fuse):
    P, W, cap, L, ref_sets = _case(ref, s, fuse)
    assert ref[f"s{s}_{fuse}_min_gap"] > 1e-3
    N = cap + 1
    assert max(len(r) for r in ref_sets[-1]) == N  # the reference's steady size: max_capacity + 1
    _check(_ours(kp.KVPolicy("morphkv", slots=N, window=W, fuse=fuse), N, L, P), ref_sets, P, N)


def test_the_fixture_separates_sum_from_max(ref):
    """The other fusion's rule on the same logits keeps another set somewhere (the check has teeth)."""
    differs = 0
    for s, fuse in CASES:
        P, W, cap, L, ref_sets = _case(ref, s, fuse)
        other = "max" if fuse == "sum" else "sum"
        ours = _ours(kp.KVPolicy("morphkv", slots=cap + 1, window=W, fuse=other), cap + 1, L, P)
        differs += ours[1:] != ref_sets[1:]
    assert differs == len(CASES), differs


@pytest.mark.parametrize("s,fuse", [(0, "sum"), (2, "max")])
def test_the_cache_module_on_the_references_q_k_keeps_its_sets(ref, s, fuse):
    """``PolicyKVCache`` itself (prefill, then one-token decode steps) on the reference's rotated q / k,
    each (layer, head) a KV head with one query head: its slot positions are the reference's sets."""
    from icml_jax.models.attention import PolicyKVCache
    P, W, cap, L, ref_sets = _case(ref, s, fuse)
    q, k = ref[f"s{s}_{fuse}_q"], ref[f"s{s}_{fuse}_k"]  # [layers, heads, T, D]
    nl, nh, T, D = q.shape
    G = nl * nh
    q = jnp.asarray(q.reshape(G, T, D).transpose(1, 0, 2)[None, :, :, None])  # [1, T, G, 1, D]
    k = jnp.asarray(k.reshape(G, T, D).transpose(1, 0, 2)[None])  # [1, T, G, D]
    v = jnp.asarray(np.random.default_rng(0).normal(size=k.shape).astype(np.float32))
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    seg = jnp.ones_like(pos)
    N = cap + 1
    mod = PolicyKVCache(kp.KVPolicy("morphkv", slots=N, window=W, fuse=fuse))
    no_bias = lambda a, b: None  # noqa: E731

    pr = (q[:, :P], k[:, :P], v[:, :P], pos[:, :P], seg[:, :P], no_bias)

    @jax.jit
    def prefill():
        cache = mod.init(jax.random.key(0), *pr)["cache"]
        return mod.apply({"cache": cache}, *pr, mutable=["cache"])[1]["cache"]

    cache = prefill()

    @jax.jit
    def dec(c, t):  # one compiled decode step; t traced
        sl = lambda x: jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)  # noqa: E731
        _, upd = mod.apply({"cache": c}, sl(q), sl(k), sl(v), sl(pos), sl(seg), no_bias, mutable=["cache"])
        return upd["cache"]

    sets = lambda c: [sorted(int(x) for x in r if x >= 0) for r in np.asarray(c["slot_pos"])[0]]  # noqa: E731
    ours = [sets(cache)]
    for t in range(P, T):
        cache = dec(cache, t)
        ours.append(sets(cache))
    _check(ours, ref_sets, P, N)
