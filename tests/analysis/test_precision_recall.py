"""Exact PRD / PR-divergence and k-NN precision-recall (docs/methods/precision_recall.md)."""
import numpy as np
import pytest

from icml_jax.analysis import precision_recall as prm

LAMS = np.array([1e-3, 0.1, 0.5, 1.0, 2.0, 10.0, 1e3])


def _pq(seed, n=20, sparse=True):
    rng = np.random.default_rng(seed)
    p, q = rng.dirichlet(np.full(n, 0.5)), rng.dirichlet(np.full(n, 0.5))
    if sparse:  # some outcomes outside each support
        p[:3], q[-3:] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
    return p, q


@pytest.mark.parametrize("seed", range(5))
def test_prd_properties(seed):
    p, q = _pq(seed)
    a = prm.alpha(p, q, LAMS)
    assert np.all(a <= np.minimum(LAMS, 1.0) + 1e-12)
    np.testing.assert_allclose(prm.beta(p, q, LAMS), a / LAMS)
    ca, cb = prm.prd_curve(p, q, LAMS)
    np.testing.assert_allclose(ca, a)
    np.testing.assert_allclose(cb, a / LAMS)
    for lam in LAMS:
        d = prm.pr_divergence(p, q, lam)
        assert d >= -1e-12
        # D_lambda from its f-divergence definition equals min(lambda, 1) - alpha_lambda
        np.testing.assert_allclose(prm.pr_divergence_from_f(p, q, lam), d, atol=1e-12)
    # limits: alpha -> Q(supp P) as lambda -> inf, beta -> P(supp Q) as lambda -> 0
    np.testing.assert_allclose(prm.alpha(p, q, 1e9), prm.precision_limit(p, q), atol=1e-9)
    np.testing.assert_allclose(prm.beta(p, q, 1e-9), prm.recall_limit(p, q), atol=1e-9)
    assert prm.precision_limit(p, q) < 1 and prm.recall_limit(p, q) < 1


def test_identical_distributions():
    p, _ = _pq(7)
    np.testing.assert_allclose(prm.alpha(p, p, LAMS), np.minimum(LAMS, 1.0))
    for lam in LAMS:
        assert abs(prm.pr_divergence(p, p, lam)) < 1e-12
        assert abs(prm.pr_divergence_from_f(p, p, lam)) < 1e-12
    assert prm.precision_limit(p, p) == pytest.approx(1.0)
    assert prm.recall_limit(p, p) == pytest.approx(1.0)
    assert prm.threshold_recall(p, p, 0.1) == pytest.approx(1.0)


def test_disjoint_supports_give_zero():
    p = np.array([0.5, 0.5, 0.0, 0.0])
    q = np.array([0.0, 0.0, 0.3, 0.7])
    np.testing.assert_array_equal(prm.alpha(p, q, LAMS), 0.0)
    assert prm.precision_limit(p, q) == 0.0 and prm.recall_limit(p, q) == 0.0
    np.testing.assert_allclose([prm.pr_divergence(p, q, lam) for lam in LAMS], np.minimum(LAMS, 1))


def test_perturbed_distribution_loses_precision_and_recall():
    p, _ = _pq(3, sparse=False)
    q_sup = p.copy()
    q_sup[np.argsort(p)[:5]] = 0.0  # drop the five rarest modes
    q_sup *= 0.8 / q_sup.sum()  # and put 20% of the mass off the support
    P, Q = prm.align(p, q_sup)
    assert len(P) == len(p) + 1 and Q[-1] == pytest.approx(0.2) and P[-1] == 0
    assert prm.precision_limit(P, Q) == pytest.approx(0.8)
    dropped = np.sort(p)[:5].sum()
    assert prm.threshold_recall(P, Q, 0.1) == pytest.approx(1 - dropped)
    assert prm.alpha(P, Q, 1.0) < 1.0


def test_bad_inputs_are_clear_errors():
    p, q = _pq(0)
    for bad in (0.0, -1.0, [1.0, 0.0]):
        with pytest.raises(ValueError, match="lambda must be > 0"):
            prm.alpha(p, q, bad)
    with pytest.raises(ValueError, match="lambda must be > 0"):
        prm.pr_divergence(p, q, -2.0)
    with pytest.raises(ValueError, match="sum to 1"):
        prm.alpha(p, q * 0.5, 1.0)
    with pytest.raises(ValueError, match="aligned"):
        prm.alpha(p, q[:-1], 1.0)
    with pytest.raises(ValueError, match="eps"):
        prm.threshold_recall(p, q, 0.0)


def test_knn_identical_sets():
    x = np.random.default_rng(0).normal(size=(60, 5))
    out = prm.knn_precision_recall(x, x.copy(), k=3)
    assert out["precision"] == 1.0 and out["recall"] == 1.0 and out["k"] == 3
    out = prm.knn_precision_recall(x, x.copy(), k=3, pca_dim=2)
    assert out["precision"] == 1.0 and out["recall"] == 1.0 and out["pca_dim"] == 2


def test_knn_sub_cluster_has_full_precision_low_recall():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(150, 4))
    b = rng.normal(size=(150, 4)) + 10.0
    ref = np.concatenate([a, b])
    gen = rng.normal(size=(150, 4))  # only the first cluster
    out = prm.knn_precision_recall(ref, gen, k=5, pca_dim=3)
    assert out["precision"] > 0.9
    assert out["recall"] < 0.6
    with pytest.raises(ValueError, match="k must be"):
        prm.knn_precision_recall(ref, gen[:3], k=5)


def test_knn_authors_protocol_settings():
    # the group's public text evaluation: L2-normalised rows, PCA on both sets to 90% of the
    # variance, k = 4, strict inside
    rng = np.random.default_rng(2)
    x = rng.normal(size=(80, 6)) * np.array([10.0, 5.0, 0.1, 0.1, 0.1, 0.1])
    out = prm.knn_precision_recall(x, x.copy(), **prm.AUTHORS_PROTOCOL)
    assert out["precision"] == 1.0 and out["recall"] == 1.0 and out["k"] == 4
    assert out["normalize"] and out["pca_fit"] == "both" and out["strict"]
    # two strong directions hold > 90% of the variance: two components are kept
    assert prm.pca_project(x, x, variance=0.9).shape[1] == 2
    assert prm.pca_project(x, x, variance=1.0).shape[1] == 6
    # normalising makes the estimate blind to a rescaled generator
    gen = rng.normal(size=(80, 6)) * np.array([10.0, 5.0, 0.1, 0.1, 0.1, 0.1])
    a = prm.knn_precision_recall(x, gen, k=4, normalize=True)
    b = prm.knn_precision_recall(x, 3.0 * gen, k=4, normalize=True)
    assert (a["precision"], a["recall"]) == (b["precision"], b["recall"])
    # strict "<" leaves out a point exactly on a ball's edge; "<=" keeps it
    ref = np.array([[0.0], [1.0], [20.0], [21.0]])  # every 1-NN radius is 1
    on_edge = np.array([[2.0], [10.0], [30.0]])  # 2.0 is on ref[1]'s edge, the others far out
    assert prm.knn_precision_recall(ref, on_edge, k=1)["precision"] == pytest.approx(1 / 3)
    assert prm.knn_precision_recall(ref, on_edge, k=1, strict=True)["precision"] == 0.0
    with pytest.raises(ValueError, match="pca_fit"):
        prm.knn_precision_recall(x, gen, pca_fit="generated", pca_dim=2)
    with pytest.raises(ValueError, match="pca_variance"):
        prm.knn_precision_recall(x, gen, pca_dim=2, pca_variance=0.9)
