"""VocAgnoLM: lexical alignment (icml_jax/data/alignment.py) and the guided selection loss
(icml_jax/losses/vocagnolm.py), on hand-made cases and against brute force."""
import fractions
import math

import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.data import alignment
from icml_jax.losses import vocagnolm


def test_alignment_hand_cases_and_multibyte():
    # text "héllo wörld": byte student tokens; teacher tokens "hé", "llo", " w", "ö", "rld"
    text = "héllo wörld"
    student = alignment.byte_char_spans(text)
    assert len(student) == len(text.encode()) and (student[1] == student[2]).all()  # é is 2 bytes
    teacher = np.array([(0, 2), (2, 5), (5, 7), (7, 8), (8, 11)])
    start, end, mapped = alignment.align(student, teacher)
    assert mapped.all()
    assert (start == end).all()  # every byte lies inside one teacher token (many-to-one)
    assert start.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 4]
    # one-to-many: a student token "llo wö" spanning three teacher tokens; BOS (zero width) unmapped;
    # a student span with no teacher token over it (a normalisation artefact) unmapped
    start, end, mapped = alignment.align([(0, 0), (2, 8), (8, 11), (11, 12)], teacher)
    assert mapped.tolist() == [False, True, True, False]
    assert (start[1], end[1]) == (1, 3) and (start[2], end[2]) == (4, 4)
    # a zero-width special token inside a teacher token is still unmapped
    assert alignment.align([(1, 1)], teacher)[2].tolist() == [False]


def test_alignment_matches_brute_force_overlap():
    rng = np.random.default_rng(0)
    for _ in range(50):
        def spans(n):
            cuts = np.sort(rng.choice(np.arange(1, 60), n - 1, replace=False))
            edges = np.concatenate([[0], cuts, [60]])
            return np.stack([edges[:-1], edges[1:]], 1)
        s, t = spans(int(rng.integers(2, 30))), spans(int(rng.integers(2, 30)))
        start, end, mapped = alignment.align(s, t)
        for i, (a, b) in enumerate(s):
            overlap = [j for j, (c, d) in enumerate(t) if c < b and d > a]
            assert mapped[i] == bool(overlap)
            assert list(range(start[i], end[i] + 1)) == overlap
    idx, win, trunc = alignment.windows(np.array([0, 2]), np.array([3, 2]), np.array([True, True]), span_pad=2)
    assert win.tolist() == [[True, True], [True, False]] and trunc == 0.5


def _case(rng, B=2, T=12, M=9):
    sl = jnp.asarray(rng.uniform(0, 5, (B, T)), jnp.float32)
    tl = jnp.asarray(rng.uniform(0, 5, (B, M)), jnp.float32)
    start = rng.integers(0, M - 2, (B, T))
    end = start + rng.integers(0, 3, (B, T))
    mapped = rng.uniform(size=(B, T)) < 0.8
    valid = np.ones((B, T), bool)
    valid[1, -3:] = False  # padding
    idx, win, _ = alignment.windows(start, end, mapped, span_pad=4)
    return sl, tl, jnp.asarray(idx), jnp.asarray(win), jnp.asarray(mapped), jnp.asarray(valid)


def test_selection_counts_unmapped_padding_and_aggregations():
    rng = np.random.default_rng(1)
    sl, tl, idx, win, mapped, valid = _case(rng)
    w, score = vocagnolm.selection_weights(sl, tl, idx, win, mapped, valid, k_ratio=0.4)
    w, score, m, v = np.asarray(w), np.asarray(score), np.asarray(mapped), np.asarray(valid)
    cand = m & v
    assert w[cand].sum() == math.ceil(0.4 * cand.sum())  # exactly ceil(k n) mapped tokens
    assert score[cand][w[cand] > 0].min() >= score[cand][w[cand] == 0].max()  # the highest scores
    assert (w[~m & v] == 1).all() and (w[~v] == 0).all()  # unmapped valid always in, padding never
    w2, _ = vocagnolm.selection_weights(sl, tl, idx, win, mapped, valid, include_unmapped=False)
    assert (np.asarray(w2)[~m] == 0).all()
    # the aggregated teacher loss against a loop; max >= mean, so max's scores <= mean's
    t_np, i_np, win_np = np.asarray(tl), np.asarray(idx), np.asarray(win)
    want = np.array([[t_np[b, i_np[b, t][win_np[b, t]]].max() if win_np[b, t].any() else 0.0
                      for t in range(i_np.shape[1])] for b in range(i_np.shape[0])])
    np.testing.assert_allclose(vocagnolm.aggregate_teacher(tl, idx, win, "max"), want, rtol=1e-6)
    _, s_mean = vocagnolm.selection_weights(sl, tl, idx, win, mapped, valid, agg="mean")
    assert (score[cand] <= np.asarray(s_mean)[cand] + 1e-6).all()
    # per-sequence scope: each row selects ceil(k n_row) of its own
    ws, _ = vocagnolm.selection_weights(sl, tl, idx, win, mapped, valid, scope="sequence")
    for b in range(2):
        assert np.asarray(ws)[b][cand[b]].sum() == math.ceil(0.4 * cand[b].sum())


@pytest.mark.parametrize("k_ratio", [0.3, 0.6, 0.45])
def test_selection_count_is_exact_at_ratios_float32_rounds_up(k_ratio):
    """ceil(k n) with k a decimal ratio: in float32, 0.3 * 50 and 0.6 * 25 round above 15 and
    their ceilings are 16; the count is the exact one for every n up to 400."""
    for n in range(1, 401):
        want = math.ceil(fractions.Fraction(str(k_ratio)) * n)
        got = int(vocagnolm._ceil_ratio(jnp.int32(n), k_ratio))
        assert got == want, (k_ratio, n, got, want)
    score = jnp.asarray(np.random.default_rng(0).normal(size=50), jnp.float32)
    sel = vocagnolm._top_count(score, jnp.ones(50, bool), 0.3)
    assert int(sel.sum()) == 15


def test_identical_tokenizers_are_rho1_and_full_ratio_is_mean_ce():
    rng = np.random.default_rng(2)
    T = 10
    spans = np.stack([np.arange(T), np.arange(1, T + 1)], 1)
    start, end, mapped = alignment.align(spans, spans)
    assert (start == np.arange(T)).all() and (end == np.arange(T)).all() and mapped.all()
    idx, win, _ = alignment.windows(start[None], end[None], mapped[None], span_pad=2)
    sl = jnp.asarray(rng.uniform(0, 5, (1, T)), jnp.float32)
    tl = jnp.asarray(rng.uniform(0, 5, (1, T)), jnp.float32)
    ones = jnp.ones((1, T), bool)
    w, score = vocagnolm.selection_weights(sl, tl, jnp.asarray(idx), jnp.asarray(win), ones, ones, k_ratio=0.3)
    excess = np.asarray(sl - tl)[0]
    np.testing.assert_allclose(np.asarray(score)[0], excess, rtol=1e-6)  # Rho-1's excess loss
    assert set(np.nonzero(np.asarray(w)[0])[0]) == set(np.argsort(-excess)[:3])
    loss, _ = vocagnolm.guided_loss(sl, tl, jnp.asarray(idx), jnp.asarray(win), ones, ones, k_ratio=1.0)
    assert float(loss) == pytest.approx(float(sl.mean()), rel=1e-6)
    with pytest.raises(ValueError, match="k_ratio"):
        vocagnolm.selection_weights(sl, tl, jnp.asarray(idx), jnp.asarray(win), ones, ones, k_ratio=0.0)
