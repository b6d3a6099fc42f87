"""icml_jax.analysis.entanglement: the spec's properties (orthonormal set -> 0; the Welch bound
holds for random unit vectors with N > M) and a case worked by hand."""
import math

import numpy as np
import pytest

from icml_jax.analysis.entanglement import entanglement, welch_bound


def test_orthonormal_set_has_zero_entanglement():
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    np.testing.assert_allclose(entanglement(q), 0.0, atol=1e-12)
    np.testing.assert_allclose(entanglement(np.eye(4)[:3] * [[2.0], [0.5], [7.0]]), 0.0)  # scale is moot


@pytest.mark.parametrize("n,m", [(12, 4), (5, 2), (20, 8), (9, 3)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_welch_bound_holds_for_random_unit_vectors(n, m, seed):
    v = np.random.default_rng(seed).normal(size=(n, m))
    assert entanglement(v).max() >= welch_bound(n, m) - 1e-12


def test_welch_bound_is_tight_for_the_simplex():
    """N = M + 1 vectors of a regular simplex meet the bound with equality: |cos| = 1/M."""
    m = 3
    simplex = np.eye(m + 1) - 1.0 / (m + 1)  # rows span the 3-d subspace orthogonal to ones
    basis = np.linalg.svd(simplex)[2][:m]  # coordinates in that subspace
    e = entanglement(simplex @ basis.T)
    np.testing.assert_allclose(e, 1.0 / m, atol=1e-12)
    assert welch_bound(m + 1, m) == pytest.approx(1.0 / m)


def test_hand_computed_case():
    # (1, 0), (1, 1)/sqrt2, (0, 2): |cos| 1-2 = 1/sqrt2, 1-3 = 0, 2-3 = 1/sqrt2
    e = entanglement([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    np.testing.assert_allclose(e, [1 / math.sqrt(2)] * 3)
    # (3, 4) and (4, 3): cos = 24/25; (0, -1) against them: 4/5 and 3/5
    e = entanglement([[3.0, 4.0], [4.0, 3.0], [0.0, -1.0]])
    np.testing.assert_allclose(e, [24 / 25, 24 / 25, 4 / 5])
    assert welch_bound(3, 2) == pytest.approx(math.sqrt(1 / 4))
    assert welch_bound(12, 4) == pytest.approx(math.sqrt(8 / 44))
    assert welch_bound(4, 4) == 0.0 and welch_bound(3, 5) == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="zero"):
        entanglement([[1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match="two"):
        entanglement([[1.0, 0.0]])
    with pytest.raises(ValueError):
        entanglement([1.0, 2.0])
