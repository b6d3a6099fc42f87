"""icml_jax.analysis.iti against honest_llama's own code, executed (fixture ``data/iti_reference.npz``).

How the fixture was made (once, by hand): ``/tmp/hlref/make_fixture.py``, a generator kept OUTSIDE
this repository because the project does not copy reference code. It imports ``utils.py`` of
likenneth/honest_llama at commit 2c6b2179be7b5aa8f0a171688cf9e01b812ca327 unchanged and executes
its ``get_separated_activations``, ``get_com_directions``, ``get_top_heads`` (-> ``train_probes``:
sklearn ``LogisticRegression(random_state=42, max_iter=1000)`` per head, ``accuracy_score`` on the
val rows, ``argsort(...)[::-1][:k]``) and ``get_interventions_dict`` (center-of-mass and probe
``coef_`` directions, ``proj_val_std = np.std``, i.e. ddof 0), with scikit-learn 1.9.1, numpy 2.4.6.
The fold and train/val split are the lines of ``validation/validate_2fold.py`` (``np.random.seed(42)``,
2 folds by ``np.array_split`` over questions, fold 0, ``np.random.choice`` of 80 % of the training
questions), split by question; the tuning activations are all rows, as in that script. Stubs: the
imports those functions do not use (transformers, baukit, openai, truthfulqa.*) are dummy modules;
``datasets.load_dataset`` returns a fake TruthfulQA split carrying only our ``mc2_targets`` labels.
Synthetic data: 150 questions x 2 answers (one true = 1, one false = 0), 2 layers x 4 heads x
head_dim 8, float32; per head a planted mean shift along a random direction of a distinct strength,
per-feature scales spanning 0.05-5, a random rotation and an offset (data seed 1: the first of 0-5
whose 8 val accuracies are all distinct, so the top-k order has no ties).

The reference's lbfgs stops at sklearn's default tol 1e-4, in float32 on float32 input: its
(coef_, intercept_) is 2e-4..4.2e-3 (relative to the probe's largest |parameter|) from the
minimiser of its own objective. So the fixture also holds a converged reference (``*_tight``): the
same ``train_probes`` / ``get_interventions_dict`` with ``tol=1e-10`` and the activations cast to
float64. Probe weights and intercepts are held to 1e-4 of the probe's largest |parameter| against
the converged reference (measured: 1.1e-5), to 6e-3 against the as-executed one.
"""
import os
from types import SimpleNamespace

import numpy as np
import pytest

from icml_jax.analysis import iti

REF = os.path.join(os.path.dirname(__file__), "data", "iti_reference.npz")


@pytest.fixture(scope="module")
def ref():
    with np.load(REF) as d:
        return {k: d[k] for k in d.files}


@pytest.fixture(scope="module")
def ours(ref):
    x, y = ref["acts"], ref["labels"]
    tr, va = ref["train_rows"], ref["val_rows"]
    probes = iti.fit_probes(x[tr], y[tr])
    return probes, iti.validation_accuracy(probes, x[va], y[va])


def _sel(ref):
    return tuple(ref["top_heads"].T)


def test_split_is_by_question(ref):
    q_of_row = np.searchsorted(ref["q_split"], np.arange(len(ref["labels"])), side="right")
    tr_q, va_q = set(q_of_row[ref["train_rows"]]), set(q_of_row[ref["val_rows"]])
    assert tr_q == set(ref["train_set_idxs"]) and va_q == set(ref["val_set_idxs"]) and not tr_q & va_q
    assert set(q_of_row[ref["com_rows"]]) == tr_q | va_q


def test_validation_accuracy_equal(ref, ours):
    _, acc = ours
    np.testing.assert_array_equal(acc, ref["val_acc"])


def test_top_heads_equal(ref, ours):
    _, acc = ours
    k = len(ref["top_heads"])
    ranked = np.sort(ref["val_acc"].ravel())[::-1]
    assert np.all(np.diff(ranked[:k + 1]) < 0), f"ties among the top {k + 1}: {ranked}"  # order is tie-free
    assert iti.top_heads(acc, k) == [tuple(h) for h in ref["top_heads"].tolist()]


def test_probe_weights(ref, ours):
    probes, _ = ours
    for name, tol in (("_tight", 1e-4), ("", 6e-3)):
        w, b = ref["probe_coef" + name], ref["probe_intercept" + name]
        scale = np.maximum(np.abs(w).max(-1), np.abs(b))  # [L, H]: the probe's largest parameter
        err_w = np.abs(probes.w - w).max(-1) / scale
        err_b = np.abs(probes.b - b) / scale
        assert err_w.max() < tol and err_b.max() < tol, (name, err_w, err_b)


def test_mass_mean_directions_and_sigma(ref):
    x, y = ref["acts"], ref["labels"]
    theta = iti.mass_mean_directions(x[ref["com_rows"]], y[ref["com_rows"]])
    raw = ref["com_directions"]
    np.testing.assert_allclose(theta, raw / np.linalg.norm(raw, axis=-1, keepdims=True), rtol=0, atol=1e-5)
    sel = _sel(ref)
    np.testing.assert_allclose(theta[sel], ref["com_dir_sel"], rtol=0, atol=1e-5)
    sigma = iti.projection_std(x[ref["tuning_rows"]], theta, ddof=0)
    np.testing.assert_allclose(sigma[sel], ref["com_std_sel"], rtol=1e-5, atol=0)


def test_probe_directions_and_sigma(ref, ours):
    probes, _ = ours
    x, sel = ref["acts"], _sel(ref)
    theta = iti.probe_directions(probes)
    sigma = iti.projection_std(x[ref["tuning_rows"]], theta, ddof=0)
    for name, tol in (("_tight", 1e-4), ("", 3e-3)):
        np.testing.assert_allclose(theta[sel], ref["probe_dir_sel" + name], rtol=0, atol=tol)
        np.testing.assert_allclose(sigma[sel], ref["probe_std_sel" + name], rtol=tol, atol=0)


def test_iti_deltas_use_reference_direction_and_sigma(ref):
    """α·σ·θ per selected head, placed at [g, r] with h = g * R + r (num_kv_heads 2 here)."""
    x, y, sel = ref["acts"], ref["labels"], _sel(ref)
    L, H, K = x.shape[1:]
    theta = iti.mass_mean_directions(x[ref["com_rows"]], y[ref["com_rows"]])
    sigma = iti.projection_std(x[ref["tuning_rows"]], theta)
    cfg = dict(num_layers=L, num_heads=H, head_dim=K, num_kv_heads=2)
    deltas = iti.iti_deltas(SimpleNamespace(**cfg), ref["top_heads"].tolist(), theta, sigma, alpha=15.0)
    for (layer, head), d, s in zip(ref["top_heads"].tolist(), ref["com_dir_sel"], ref["com_std_sel"]):
        np.testing.assert_allclose(deltas[layer].reshape(H, K)[head], 15.0 * s * d, rtol=0, atol=1e-4 * 15 * s)
