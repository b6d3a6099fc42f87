"""EpiCoder's feature trees (icml_jax/data/feature_tree.py): building from given features, the
depth/breadth budgets, the exact sampling distribution (chi-square against draws), evolution's
merge and frequencies, KCenterGreedy."""
import numpy as np
import pytest
from scipy import stats

from icml_jax.data import feature_tree as ft

SAMPLES = [
    {"algorithm": {"sorting": ["quick sort", "merge sort"]}, "data processing": ["cleaning"]},
    {"algorithm": {"sorting": ["quick sort"], "search": ["binary search"]}},
    {"algorithm": ["graph"], "file operation": ["read"], "data processing": {"cleaning": [], "parsing": ["csv"]}},
]


def _tree():
    """A small tree with unequal frequencies: 3 depth-1 features, 2-3 children each, some grandchildren."""
    return ft.FeatureTree.from_nested(
        {"a": {"a1": ["x", "y"], "a2": [], "a3": ["z"]}, "b": ["b1", "b2"], "c": {"c1": ["w"], "c2": []}},
        {("a",): 5.0, ("b",): 2.0, ("c",): 1.0, ("a", "a1"): 3.0, ("a", "a2"): 1.0, ("a", "a3"): 2.0,
         ("b", "b1"): 1.0, ("b", "b2"): 4.0, ("c", "c1"): 2.0, ("c", "c2"): 2.0, ("a", "a1", "x"): 2.0})


def test_from_samples_counts_and_layout():
    t = ft.FeatureTree.from_samples(SAMPLES)
    f = t.frequencies()
    assert f[("algorithm",)] == 3 and f[("algorithm", "sorting")] == 2
    assert f[("algorithm", "sorting", "quick sort")] == 2 and f[("algorithm", "sorting", "merge sort")] == 1
    assert f[("data processing",)] == 2 and f[("data processing", "cleaning")] == 2
    assert f[("file operation", "read")] == 1
    assert t.depth() == 3 and t.max_breadth() == [3, 3, 2]
    back = ft.FeatureTree.from_nested(t.to_nested())
    assert back.key() == t.key()
    # inner frequency defaults to the sum of its children's, a leaf's to 1
    u = ft.FeatureTree.from_nested({"a": ["x", "y"], "b": []}, {("a", "x"): 4})
    assert u.frequencies() == {("a",): 5.0, ("a", "x"): 4.0, ("a", "y"): 1.0, ("b",): 1.0}
    with pytest.raises(ValueError, match="not a dict, list or string"):
        ft.FeatureTree.from_nested({"a": 3})
    with pytest.raises(KeyError, match="'zz'"):
        ft.FeatureTree.from_nested({"a": []}, {("zz",): 1})


def test_samples_respect_depth_and_breadth_budgets():
    t = ft.FeatureTree.from_samples(SAMPLES * 2 + [{"algorithm": {"sorting": {"quick sort": ["3-way"]}}}])
    rng = np.random.default_rng(0)
    for breadth in ([2, 1], [1, 2, 1], [3]):
        for _ in range(50):
            s = ft.sample_subtree(t, rng, breadth, temperature=2.0)
            assert s.depth() <= len(breadth)
            assert all(b <= budget for b, budget in zip(s.max_breadth(), breadth))
            assert set(s.paths()) <= set(t.paths())
    s = ft.sample_subtree(t, rng, 9, depth=2)  # a budget above the tree's breadth keeps every child
    assert set(s.paths()) == {p for p in t.paths() if len(p) <= 2}
    # the authors' quirk: below the depth budget the whole remaining subtree comes along
    s = ft.sample_subtree(t, rng, [3], reference_tail=True)
    assert s.key() == t.key()
    # fixed depth-1 features are always in
    assert all(("file operation",) in ft.sample_subtree(t, rng, [1, 1], fixed=["file operation"]).paths()
               for _ in range(20))
    with pytest.raises(ValueError, match="tree_depth"):
        ft.sample_subtree(t, rng, 2)
    with pytest.raises(ValueError, match=">= 1"):
        ft.sample_subtree(t, rng, [2, 0])


@pytest.mark.parametrize("weight,temperature,breadth", [("frequency", 1.0, [2, 2]), ("descendants", 2.0, [1, 2]),
                                                        ("frequency", 100.0, [2, 1, 1])])
def test_sampling_distribution_chi_square(weight, temperature, breadth):
    t = _tree()
    exact = ft.subtree_distribution(t, breadth, temperature=temperature, weight=weight)
    assert sum(exact.values()) == pytest.approx(1.0)
    rng = np.random.default_rng(1)
    n = 1500
    counts = {}
    for _ in range(n):
        k = ft.sample_subtree(t, rng, breadth, temperature=temperature, weight=weight).key()
        assert k in exact  # nothing outside the support
        counts[k] = counts.get(k, 0) + 1
    keys = list(exact)
    obs = np.array([counts.get(k, 0) for k in keys], float)
    exp = np.array([exact[k] for k in keys]) * n
    assert stats.chisquare(obs, exp).pvalue > 1e-3
    # and the test has power: a sampler that ignores the weights is rejected
    if temperature < 100:
        uni = ft.subtree_distribution(t, breadth, temperature=100.0)
        assert stats.chisquare(obs, np.array([uni[k] for k in keys]) * n).pvalue < 1e-6


def test_exact_distribution_by_hand():
    t = ft.FeatureTree.from_nested({"a": [], "b": [], "c": []}, {("a",): 1, ("b",): 2, ("c",): 3})
    d = ft.subtree_distribution(t, [2])
    # P({a, b}) = P(a then b) + P(b then a) = 1/6 * 2/5 + 2/6 * 1/4
    assert d[(("a", ()), ("b", ()))] == pytest.approx(1 / 6 * 2 / 5 + 2 / 6 * 1 / 4)
    d2 = ft.subtree_distribution(t, [1], temperature=2.0)  # weights sqrt(1), sqrt(2), sqrt(3)
    assert d2[(("c", ()),)] == pytest.approx(np.sqrt(3) / (1 + np.sqrt(2) + np.sqrt(3)))


def test_evolve_merges_and_sets_new_frequencies():
    t = _tree()

    def expand(nested):  # deeper: a child under every leaf; broader: a sibling beside every node
        def grow(x):
            if isinstance(x, dict):
                return {**{k: grow(v) for k, v in x.items()}, **{f"{k}+": [] for k in x}}
            return {"new leaf": []}
        return grow(nested)
    rng = np.random.default_rng(3)
    new_tree, sampled, new = ft.evolve(t, expand, rng, [2, 1])
    assert set(t.paths()) < set(new_tree.paths())
    assert set(new) == set(new_tree.paths()) - set(t.paths())
    old = t.frequencies()
    assert all(new_tree.node(p).frequency == f for p, f in old.items())  # old nodes unchanged
    for p in new:
        f = new_tree.node(p).frequency
        if len(p) == 1:
            assert f == 1.0
        elif p[:-1] in old and sampled.node(p[:-1]).children:
            assert f == pytest.approx(np.mean([c.frequency for c in sampled.node(p[:-1]).children.values()]))
    # a sibling added beside a sampled depth-2 node gets the mean of the sampled siblings
    parent = next(p for p in sampled.paths() if len(p) == 1)
    sib = parent + (next(iter(sampled.node(parent).children)) + "+",)
    assert new_tree.node(sib).frequency == pytest.approx(
        np.mean([c.frequency for c in sampled.node(parent).children.values()]))
    # under a former leaf with no sampled children: the parent's old mean child frequency, else 1
    merged, added = ft.merge(t, {"b": {"b2": ["deep"]}, "a": {"a2": {"q": []}}})
    assert merged.node(("b", "b2", "deep")).frequency == 1.0 and set(added) == {("b", "b2", "deep"), ("a", "a2", "q")}


def test_kcenter_greedy():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 3))
    radii = []
    for k in range(1, 12):
        idx, r = ft.kcenter_greedy(X, k)
        assert len(set(idx.tolist())) == k
        d = np.linalg.norm(X[:, None] - X[idx][None], axis=-1).min(1)
        assert r == pytest.approx(d.max())
        radii.append(r)
    assert all(b <= a + 1e-12 for a, b in zip(radii, radii[1:]))
    # farthest-first on a line: 0, then the far end, then the middle
    line = np.array([[0.0], [1.0], [2.0], [10.0]])
    assert ft.kcenter_greedy(line, 3)[0].tolist() == [0, 3, 2]
    assert len(set(ft.select_seeds(X, 5, "random", rng).tolist())) == 5
    with pytest.raises(ValueError, match="seed_selection"):
        ft.select_seeds(X, 5, "farthest")
