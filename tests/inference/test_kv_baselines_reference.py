"""SnapKV, H2O and StreamingLLM in ``icml_jax.models.kv_policies`` against the authors' own cache code,
executed (fixture ``data/kv_baselines_reference.npz``).

How the fixture was made (once, by hand): ``/tmp/kvref/make_fixture.py``, a generator kept OUTSIDE
this repository because the project does not copy reference code. It extracts, unchanged, and imports
  * FasterDecoding/SnapKV @ e216ddc84c5bd210378cbdbbba12ba02102aa640, ``snapkv/monkeypatch/snapkv_utils.py``:
    ``SnapKVCluster(window_size=6, max_capacity_prompt=16, kernel_size=5 | 7, pooling="avgpool")
    .update_kv(k, q, v, None, 1)`` on one head (batch 1, head_dim 8) of a 40-token prompt: q, k
    random (q = N(0, 1) + 1.5 k, a raised diagonal so the window's own columns carry mass), value s
    = s in every dim, so the returned values name the kept positions (the returned keys are checked
    to be those positions' keys). ``snap_logits`` = q k^T / sqrt(8), causal: the map update_kv's own
    matmul computes (float64 here, float32 there; the 10th/11th pooled scores differ by > 1e-4).
  * FMInference/H2O @ ac75c2a8a9e76832b2a4139b9363373b56336bfb, ``h2o_hf/utils_real_drop/modify_llama.py``:
    ``H2OKVCache_LayerWise(hh_size=5, recent_size=6)`` (the module imported whole, with the real
    transformers 5.23.0; the cache class uses none of it), driven as ``H2OLlamaAttention.forward``
    does: past + the new token concatenated, the softmax of a fixed logit map L[h, t, s] over those
    columns in cache order, then ``past = kv_cache(past, attn)``. Keys carry their position in
    every dim, to read the kept positions back. A 40-token prompt (causal softmax of L[:40, :40])
    then 12 decode steps, and a token-by-token run from a one-token prompt. TWO independent heads:
    with one head in batch 1, ``past_key_values[0].squeeze()[mask]`` squeezes the head axis away
    too and raises IndexError (the code is written for multi-head Llama); heads do not interact.
  * mit-han-lab/streaming-llm @ 2e5042606d69933d88fbf909bd77907456b9b4dd, ``streaming_llm/kv_cache.py``:
    ``StartRecentKVCache(start_size=4, recent_size=8)``: ``__call__`` on a 40-token prompt cache
    (eval_long_ppl.py's use), then ``evict_for_space(past, 1)`` before each of 12 decode tokens is
    appended (run_streaming_llama.py's use); and a token-by-token run from empty the same way.
No stubs were needed (torch 2.13.0+cpu). Each case's kept / attended sets are in the npz.

Convention mapping (ours: N slots that hold the current token too; W = ``window``):
  SnapKV   N = max_capacity_prompt = 16, W = window_size = 6, ``pool`` = kernel_size. Equal sets.
  H2O      the reference's cache holds hh + recent between steps and attends over that plus the new
           token; ours evicts before writing, so the attended set is our N slots:
           N = hh + recent + 1 = 12, W = recent = 6 (the W positions before t, t itself, and
           N - W - 1 = hh heavy hitters). Evict-the-least-older-slot equals the reference's
           top-hh re-selection each step (continuous scores, no ties). At prefill ours keeps N
           (the reference hh + recent): our set is the reference's plus one position older than
           the window, the one our first decode step evicts; from then on the sets are equal.
  Streaming N = start_size + recent_size = 12, ``sinks`` = start_size = 4 (evict_for_space(., 1)
           leaves N - 1, the new token makes N); ``__call__`` on the prompt keeps N = prefill_keep.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.models import kv_policies as kp
from tests.inference.helpers import decode_kept, kept_sets

REF = os.path.join(os.path.dirname(__file__), "data", "kv_baselines_reference.npz")


@pytest.fixture(scope="module")
def ref():
    with np.load(REF) as d:
        return {k: d[k] for k in d.files}


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _causal(z):
    T = z.shape[-1]
    return np.where(np.tril(np.ones((T, T), bool)), z, -np.inf)


@pytest.mark.parametrize("kernel", [5, 7])
def test_snapkv_prefill_keeps_update_kv_set(ref, kernel):
    W, N = int(ref["snap_window"]), int(ref["snap_capacity"])
    probs = _softmax(ref["snap_logits"].astype(np.float64)).astype(np.float32)
    got = kp.prefill_keep(kp.KVPolicy("snapkv", window=W, pool=kernel), N, probs_PP=jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(got), ref[f"snap_kept_k{kernel}"])


def _h2o_policy(ref):
    hh, recent = int(ref["h2o_hh"]), int(ref["h2o_recent"])
    return kp.KVPolicy("h2o", window=recent), hh + recent + 1  # N = hh + recent + 1, W = recent


def test_h2o_prompt_then_decode_matches_h2o_kv_cache(ref):
    pol, N = _h2o_policy(ref)
    L, P = ref["h2o_logits"], int(ref["h2o_P"])
    probs = _softmax(_causal(L[:, :P, :P].astype(np.float64))).astype(np.float32)  # [H, P, P]
    kept = np.asarray(kp.prefill_keep(pol, N, probs_PP=jnp.asarray(probs)))  # [H, N]
    for h in range(L.shape[0]):  # ours = the reference's hh + recent, plus one older than the window
        extra = set(kept[h]) - set(ref["h2o_prefill_kept"][h])
        assert set(ref["h2o_prefill_kept"][h]) <= set(kept[h]) and len(extra) == 1, h
        assert max(extra) < P - pol.window, h
    state = kp.init_state(pol, (L.shape[0],), N)
    acc = probs.sum(-2)  # as PolicyKVCache._fill seeds h2o's scores: the prompt queries' column sums
    state = state._replace(pos=jnp.asarray(kept, jnp.int32),
                           score=jnp.asarray(np.take_along_axis(acc, kept, -1), jnp.float32))
    got = decode_kept(pol, L, state, P)  # [H, steps, N]
    np.testing.assert_array_equal(got, ref["h2o_prompt_attended"])  # the set each step attends over
    # the reference's kept set after step t is ours after step t + 1 without t + 1
    ours_next = [[[p for p in got[h, i + 1] if p != P + i + 1] for i in range(got.shape[1] - 1)]
                 for h in range(got.shape[0])]
    assert ours_next == ref["h2o_prompt_kept"][:, :-1].tolist()


def test_h2o_token_by_token_matches_h2o_kv_cache(ref):
    pol, N = _h2o_policy(ref)
    L = ref["h2o_logits"]
    state = kp.init_state(pol, (L.shape[0],), N)
    got = decode_kept(pol, L, state, 0)  # ours from empty: step 0 is the reference's one-token prompt
    att = ref["h2o_stream_attended"]  # steps 1 .. T-1
    for h in range(L.shape[0]):
        assert kept_sets(got[h, 1:]) == kept_sets(att[h]), h


def test_streaming_prompt_then_decode_matches_start_recent_kv_cache(ref):
    N, S, P = int(ref["stream_slots"]), int(ref["stream_sinks"]), int(ref["stream_P"])
    pol = kp.KVPolicy("streaming", sinks=S)
    T = int(ref["stream_T"])
    L = np.zeros((1, T, T), np.float32)  # streaming reads no scores
    kept = np.asarray(kp.prefill_keep(pol, N, logits_PP=jnp.asarray(L[0, :P, :P])))
    np.testing.assert_array_equal(kept, ref["stream_prefill_kept"])
    state = kp.init_state(pol, (1,), N)._replace(pos=jnp.asarray(kept[None], jnp.int32))
    np.testing.assert_array_equal(decode_kept(pol, L, state, P)[0], ref["stream_prompt_attended"])
    got = decode_kept(pol, L, kp.init_state(pol, (1,), N), 0)[0]
    assert kept_sets(got) == kept_sets(ref["stream_stream_attended"])


def test_fixture_discriminates(ref):
    """The cases can tell the rules apart: kernel 5 and 7 keep different SnapKV sets; H2O's and
    StreamingLLM's kept sets are not the plain sliding window."""
    assert set(ref["snap_kept_k5"]) != set(ref["snap_kept_k7"])
    P, recent = int(ref["h2o_P"]), int(ref["h2o_recent"])
    assert any(min(s) < P - recent - 1 for s in ref["h2o_prefill_kept"])
    assert ref["stream_prefill_kept"][0] == 0
