"""icml_jax.analysis.toedit against the authors' own code, executed (fixture ``data/toedit_reference.npz``).

How the fixture was made (once, by hand): ``/tmp/terf/make_fixture.py``, a generator kept OUTSIDE
this repository because the project does not copy reference code. It imports ``toedit_resampling.py``
of Xuekai-Zhu/toedit at commit 5b769ad (HEAD) unchanged, with stub modules for vllm, transformers,
torch.utils.data and tqdm (the rule functions use none of them), and executes its three rule
functions on a fake vLLM ``RequestOutput``: ``prompt_token_ids`` = [BOS = 0] + 300 targets,
``prompt_logprobs`` = [None] + one dict per position {token_id: Logprob(.logprob, .rank)} built as
vLLM's sampler builds it (the prompt token first, then the top k = 8 by rank; float32 log_softmax of
the stored logits, handed over as Python floats). V = 20; the logits are synthetic (data seed 0):
120 confident positions (P in (0.99, 0.99997)), 12 within 1e-4..2e-6 of 0.99 on either side, 108
middling, 50 below 0.001 and 10 within 1e-3..1e-4 (relative) of 0.001; no position lies within
float rounding of a threshold and no top-k has a tie at the k-th place. Executed:

- ``online_resampling_json_low_drop_up_revise``: resample when P > 0.99 (beta 1), else delete when
  P < 0.001;
- ``online_resampling_json_up_revise``: resample when P > 0.99 with beta 1.5;
- ``filtering_out``: keep a token iff P >= 0.001.

Their thresholds are hard-coded (0.99, 0.001) and the comparison is ``>`` (our ``compare="gt"``).
Observation only: ``np.random.choice`` was wrapped by a pass-through recorder (same global
RandomState, so the draws are the reference's own), the prompt ids were int subclasses carrying
their position and ``prompt_logprobs`` recorded the position being iterated, so the token list the
reference hands to (a fake) ``tokenizer.decode`` gives its kept / resampled / deleted positions,
and each recorded ``np.random.choice`` call gives the candidate list and ``softmax(logprobs /
beta)`` it drew from. ``counts_beta1`` / ``counts_beta15``: the replacement tokens at the 126
resampled positions over 2,000 executions each (``np.random.seed(1000 + s)``) of the beta-1 and
beta-1.5 functions.

Known, documented deviation (not asserted equal): the reference draws from the raw top-k, BOS
included, and its decode then deletes a drawn special; ours with ``banned_ids`` draws from the k best
ordinary tokens (last test).
"""
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from icml_jax.analysis import toedit

REF = os.path.join(os.path.dirname(__file__), "data", "toedit_reference.npz")
N_OURS = 10_000


@pytest.fixture(scope="module")
def ref():
    with np.load(REF) as d:
        return {k: d[k] for k in d.files}


def _cfg(ref, **kw):
    base = dict(p=float(ref["p_up"]), k=int(ref["k"]), beta=1.0, compare=str(ref["compare"]), drop_below=0.0)
    return toedit.ToEditConfig(**{**base, **kw})


def _run_editor(ref, cfg, key=0):
    """Our jitted editor (make_editor: resample + drop) on the fixture's logits, via a stand-in model."""
    logits, targets = jnp.asarray(ref["logits"])[None], ref["targets"][None]
    model = SimpleNamespace(apply=lambda variables, inputs, pos, seg: logits)
    edit = toedit.make_editor(model, cfg)
    ones = np.ones_like(targets, bool)
    new, hit, drop = edit({}, np.zeros_like(targets), targets, ones, ones, jax.random.key(key))
    return np.asarray(new)[0], np.asarray(hit)[0], np.asarray(drop)[0]


def _our_counts(ref, cfg, banned_ids=()):
    """[R, V] counts of our replacement token at the reference's resampled positions over N_OURS keys
    (one vmapped edit_targets call: the top-k is computed once, the draws are batched)."""
    idx = ref["resampled_idx"]
    logits, targets = jnp.asarray(ref["logits"][idx])[None], jnp.asarray(ref["targets"][idx])[None]
    keys = jax.random.split(jax.random.key(123), N_OURS)
    draw = jax.jit(jax.vmap(lambda k: toedit.edit_targets(logits, targets, k, cfg, banned_ids)[0][0]))
    new = np.asarray(draw(keys))  # [N, R]
    V = ref["logits"].shape[1]
    return np.stack([np.bincount(new[:, j], minlength=V) for j in range(new.shape[1])])


def _merged_cells(expected_rows, *count_rows, min_expected=5.0):
    """Per position: cells sorted by expected count, the smallest merged until each has >= min_expected."""
    for r in range(len(expected_rows)):
        e = expected_rows[r]
        order = np.argsort(e)
        groups, cur = [], []
        for j in order:
            cur.append(j)
            if e[cur].sum() >= min_expected:
                groups.append(cur)
                cur = []
        if cur:
            groups[-1] = groups[-1] + cur if groups else cur
        yield [np.array([c[r][g].sum() for g in groups]) for c in (expected_rows,) + count_rows]


def _gof_pvalue(counts, probs_full):
    """Sum over positions of Pearson chi-square (our counts vs exact probabilities)."""
    n = counts.sum(1, keepdims=True)
    stat, df = 0.0, 0
    for e, o in _merged_cells(probs_full * n, counts):
        stat += ((o - e) ** 2 / e).sum()
        df += len(e) - 1
    return stats.chi2.sf(stat, df)


def _homogeneity_pvalue(ours, theirs):
    """Sum over positions of the 2 x cells chi-square of homogeneity (ours vs the reference's counts)."""
    n1, n2 = ours.sum(1, keepdims=True), theirs.sum(1, keepdims=True)
    pooled = (ours + theirs) / (n1 + n2)
    stat, df = 0.0, 0
    for e2, o1, o2, e1 in _merged_cells(pooled * n2, ours, theirs, pooled * n1):
        stat += ((o1 - e1) ** 2 / e1).sum() + ((o2 - e2) ** 2 / e2).sum()
        df += len(e2) - 1
    return stats.chi2.sf(stat, df)


def _full(ref, probs):
    out = np.zeros((len(probs), ref["logits"].shape[1]))
    np.put_along_axis(out, ref["cand_resampled"], probs, 1)
    return out


def test_fixture_is_consistent(ref):
    # every position's vLLM dict holds the top-k; the resampled ones hold exactly the top-k
    assert ref["compare"] == "gt" and ref["resampled_low_drop_up_revise"].sum() == len(ref["resampled_idx"])
    np.testing.assert_array_equal(ref["resampled_low_drop_up_revise"], ref["resampled_up_revise"])
    assert (ref["cand_dict"][ref["resampled_idx"], -1] == -1).all()
    # the reference's executed draws follow its own softmax(top-k / beta) (checks the chi-square too)
    for c, pr in [("counts_beta1", "probs_beta1"), ("counts_beta15", "probs_beta15")]:
        assert (ref[c].sum(1) == ref["n_runs"]).all()
        assert _gof_pvalue(ref[c], _full(ref, ref[pr])) > 1e-3


@pytest.mark.parametrize("drop_below", [0.0, float(1e-3)])
def test_masks_equal_the_reference(ref, drop_below):
    """low_drop_up_revise = (gt, 0.99, drop 0.001); up_revise = (gt, 0.99, no drop)."""
    new, hit, drop = _run_editor(ref, _cfg(ref, drop_below=drop_below))
    np.testing.assert_array_equal(hit, ref["resampled_low_drop_up_revise"])
    np.testing.assert_array_equal(drop, ref["dropped_low_drop_up_revise"] if drop_below else False)
    kept = ~hit
    np.testing.assert_array_equal(new[kept], ref["targets"][kept])
    for j, i in enumerate(ref["resampled_idx"]):
        assert new[i] in ref["cand_resampled"][j]


def test_filtering_equals_the_reference(ref):
    """filtering_out = our --p=1.01 --drop_below=0.001 (docs/methods/toedit.md)."""
    _, hit, drop = _run_editor(ref, _cfg(ref, p=1.01, drop_below=float(ref["p_low"])))
    assert not hit.any()
    np.testing.assert_array_equal(drop, ref["dropped_filtering"])


@pytest.mark.parametrize("beta,name", [(1.0, "beta1"), (1.5, "beta15")])
def test_draws_follow_the_reference(ref, beta, name):
    ours = _our_counts(ref, _cfg(ref, beta=beta))
    cand = ref["cand_resampled"]
    outside = ours.copy()
    np.put_along_axis(outside, cand, 0, 1)
    assert outside.sum() == 0, "a draw outside the reference's candidate set"
    assert _gof_pvalue(ours, _full(ref, ref["probs_" + name])) > 1e-3
    assert _homogeneity_pvalue(ours, ref["counts_" + name]) > 1e-3


def test_banned_ids_replace_a_special_by_the_next_ordinary_token(ref):
    """Documented deviation: where BOS is in the reference's top-k (it draws it, decode deletes it),
    ours draws from the top-k minus BOS plus the (k+1)-th token; never BOS."""
    bos, k = int(ref["bos"]), int(ref["k"])
    ours = _our_counts(ref, _cfg(ref, beta=1.5), banned_ids=(bos,))
    assert ours[:, bos].sum() == 0
    logits = ref["logits"][ref["resampled_idx"]]
    order = np.argsort(-logits, 1, kind="stable")
    for j, cand in enumerate(ref["cand_resampled"]):
        allowed = set(cand.tolist()) - {bos} | ({int(order[j, k])} if bos in cand else set())
        assert set(np.flatnonzero(ours[j]).tolist()) <= allowed
