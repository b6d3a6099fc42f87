"""icml_jax.analysis.iti (spec iti_bad_data.md, section 5): α = 0 is the identity; only the
selected heads change, only at the intervened positions, by exactly α·σ_h·θ_h; ‖θ_h‖ = 1 and σ_h
is the std of the projections; top_heads picks the K best; probes find a planted direction (and
only there); an edited generate equals the argmax of the edited full forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from icml_jax.analysis import iti
from icml_jax.config_utils import load_config
from icml_jax.inference.decode import generate
from icml_jax.models import build_model, hooks

T = 16
TOKENS = np.random.RandomState(0).randint(3, 250, (3, T)).astype(np.int32)
HEADS = [(1, 2), (0, 1), (1, 0)]


@pytest.fixture(scope="module")
def tiny():
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # 2 layers, 4 heads (2 KV), K 8
    p = meta.unbox(build_model(m).init(jax.random.key(0), jnp.asarray(TOKENS))["params"])
    rng = np.random.default_rng(1)
    dirs = iti._unit(rng.normal(size=(2, 4, 8))).astype(np.float32)
    sig = rng.uniform(0.5, 2.0, size=(2, 4)).astype(np.float32)
    return m, p, dirs, sig


def _logits(m, p, edits=None):
    return np.asarray(build_model(m, edits=edits).apply({"params": p}, jnp.asarray(TOKENS)))


def _heads(m, p, edits=None):
    got = hooks.capture(build_model(m, edits=edits), p, jnp.asarray(TOKENS),
                        points=["layer_0/attn_heads", "layer_1/attn_heads"])
    return np.stack([np.asarray(got[f"layer_{i}/attn_heads"]).reshape(3, T, 4, 8) for i in range(2)], 2)


def test_alpha_zero_leaves_logits_bit_identical(tiny):
    m, p, dirs, sig = tiny
    for pos in ("last", "all"):
        np.testing.assert_array_equal(_logits(m, p, iti.iti_edits(m, HEADS, dirs, sig, 0.0, pos)), _logits(m, p))


@pytest.mark.parametrize("positions", ["last", "all", 5])
def test_only_selected_heads_at_intervened_positions_change_by_alpha_sigma_theta(tiny, positions):
    m, p, dirs, sig = tiny
    alpha = 3.0
    edits = iti.iti_edits(m, HEADS, dirs, sig, alpha, positions)
    plain, edited = _heads(m, p), _heads(m, p, edits)  # [B, T, L, H, K]
    at = {"last": [T - 1], "all": list(range(T)), 5: list(range(5, T))}[positions]
    first = at[0]
    # layer 0 is upstream of nothing edited before it: its unselected heads are bit-identical everywhere
    sel = np.zeros((2, 4), bool)
    for layer, head in HEADS:
        sel[layer, head] = True
    np.testing.assert_array_equal(edited[:, :, 0][:, :, ~sel[0]], plain[:, :, 0][:, :, ~sel[0]])
    # positions before the first edited one see no change in any layer (causal)
    np.testing.assert_array_equal(edited[:, :first], plain[:, :first])
    # layer 0's selected head: exactly plain + α σ θ at the edited positions, unchanged elsewhere
    delta = np.float32(alpha) * sig[0, 1] * dirs[0, 1]
    np.testing.assert_array_equal(edited[:, at, 0, 1], plain[:, at, 0, 1] + delta)
    np.testing.assert_array_equal(np.delete(edited[:, :, 0, 1], at, axis=1), np.delete(plain[:, :, 0, 1], at, axis=1))
    # layer 1: the edit is exactly x + α σ θ of the (already changed) unedited value of that layer
    x1 = _heads(m, p, iti.iti_edits(m, [(0, 1)], dirs, sig, alpha, positions))[:, :, 1]
    for head in range(4):
        want = x1[:, :, head].copy()
        if sel[1, head]:
            want[:, at] = want[:, at] + np.float32(alpha) * sig[1, head] * dirs[1, head]
        np.testing.assert_array_equal(edited[:, :, 1, head], want)


def test_directions_unit_norm_signed_and_sigma_is_projection_std():
    rng = np.random.default_rng(0)
    acts = rng.normal(size=(200, 2, 3, 5)).astype(np.float32)
    labels = rng.integers(0, 2, 200)
    acts[labels == 1] += 0.7  # desired class shifted along +1
    for desired in (1, 0):
        theta = iti.mass_mean_directions(acts, labels, desired)
        np.testing.assert_allclose(np.linalg.norm(theta, axis=-1), 1.0, rtol=1e-6)
        mu_d = acts[labels == desired].mean(0)
        mu_u = acts[labels != desired].mean(0)
        assert (np.einsum("lhk,lhk->lh", mu_d - mu_u, theta) > 0).all()  # moves toward desired
    probes = iti.fit_probes(acts, labels)
    for desired in (1, 0):
        theta = iti.probe_directions(probes, desired)
        np.testing.assert_allclose(np.linalg.norm(theta, axis=-1), 1.0, rtol=1e-6)
        proj = np.einsum("nlhk,lhk->nlh", acts, theta)
        assert (proj[labels == desired].mean(0) > proj[labels != desired].mean(0)).all()
    sig = iti.projection_std(acts, theta)
    for layer in range(2):
        for head in range(3):
            np.testing.assert_allclose(sig[layer, head], np.std(acts[:, layer, head] @ theta[layer, head]), rtol=1e-5)
    np.testing.assert_allclose(iti.projection_std(acts, theta, ddof=1), proj.std(0, ddof=1), rtol=1e-5)


def test_top_heads_returns_the_k_best_ties_lower_index_first():
    acc = np.array([[0.5, 0.9, 0.7], [0.9, 0.6, 0.95]])
    assert iti.top_heads(acc, 3) == [(1, 2), (0, 1), (1, 0)]
    assert iti.top_heads(acc, 1) == [(1, 2)]
    rng = np.random.default_rng(0)
    acc = rng.uniform(size=(4, 8))
    got = iti.top_heads(acc, 5)
    assert sorted(acc[lh] for lh in got) == sorted(np.sort(acc.ravel())[-5:])
    with pytest.raises(ValueError):
        iti.top_heads(acc, 33)


@pytest.mark.parametrize("scale", [1.0, 0.02])
def test_probes_are_scikit_learns_logistic_regression(scale):
    """The default probes solve honest_llama's probe, ``LogisticRegression(max_iter=1000)`` (C=1,
    unpenalised intercept, raw activations), to float32 precision: the same weights, accuracies
    and top heads, on correlated features of uneven scale, at scale 1 and at a small raw scale
    where the penalty dominates. Standardised features (the option) are another probe there."""
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(1)
    N, L, H, K = 160, 2, 3, 12
    mix = rng.normal(size=(L, H, K, K)) * rng.uniform(0.2, 3.0, size=(L, H, 1, K))
    acts = (np.einsum("nlhk,lhkj->nlhj", rng.normal(size=(N, L, H, K)), mix) * scale).astype(np.float32)
    labels = (acts[:, 1, 1, 0] / scale + 2.0 * rng.normal(size=N) > 0).astype(int)
    train, val = np.arange(120), np.arange(120, N)
    probes = iti.fit_probes(acts[train], labels[train])
    acc = np.zeros((L, H))
    for layer in range(L):
        for head in range(H):
            x = acts[train, layer, head].astype(np.float64)
            sk = LogisticRegression(max_iter=1000, tol=1e-10).fit(x, labels[train])
            w = sk.coef_[0]
            np.testing.assert_allclose(probes.w[layer, head], w, rtol=0, atol=1e-4 * np.abs(w).max())
            assert abs(probes.b[layer, head] - sk.intercept_[0]) < 1e-4 * max(1.0, abs(sk.intercept_[0]))
            acc[layer, head] = sk.score(acts[val, layer, head], labels[val])
    ours = iti.validation_accuracy(probes, acts[val], labels[val])
    np.testing.assert_array_equal(ours, acc)
    assert iti.top_heads(ours, 3) == iti.top_heads(acc, 3)
    if scale != 1.0:  # the penalty on standardised weights is not the reference's
        std = iti.fit_probes(acts[train], labels[train], standardize=True)
        assert np.abs(std.w - probes.w).max() > 0.1 * np.abs(probes.w).max()


def test_probes_on_separable_and_constant_features_stay_finite_and_match_scikit_learn():
    """Perfectly separable classes at a large scale and a constant feature: the penalty keeps the
    optimum finite, the damped steps reach it (no NaN, no divergence), and the constant feature's
    weight stays 0, as scikit-learn's does."""
    from sklearn.linear_model import LogisticRegression
    rng = np.random.default_rng(4)
    N, K = 80, 5
    labels = np.arange(N) % 2
    x = rng.normal(size=(N, K)) * 100.0
    x[:, 0] = np.where(labels == 1, 300.0, -300.0) + rng.normal(size=N)  # separable by a wide gap
    x[:, 4] = 7.0  # constant
    probes = iti.fit_probes(x[:, None, None].astype(np.float32), labels)
    w, b = probes.w[0, 0], probes.b[0, 0]
    assert np.isfinite(w).all() and np.isfinite(b)
    sk = LogisticRegression(max_iter=5000, tol=1e-12).fit(x, labels)
    np.testing.assert_allclose(w, sk.coef_[0], rtol=0, atol=1e-3 * np.abs(sk.coef_[0]).max())
    assert abs(w[4]) < 1e-6


def test_probes_find_a_planted_direction_in_one_head_and_chance_elsewhere():
    rng = np.random.default_rng(0)
    N, L, H, K = 500, 2, 4, 8
    acts = rng.normal(size=(N, L, H, K)).astype(np.float32) * 0.05  # small raw scale
    labels = rng.integers(0, 2, N)
    v = iti._unit(rng.normal(size=K))
    acts[:, 1, 2] += np.float32(0.2) * (2 * labels[:, None] - 1) * v  # 4σ separation in head (1, 2)
    out = iti.fit_iti(acts, labels, k=1, direction="probe_weights")
    acc = out["accuracy"]
    assert len(out["val_idx"]) == 100 and len(out["train_idx"]) == 400  # 4:1
    assert acc[1, 2] >= 0.98
    others = np.delete(acc.ravel(), 1 * H + 2)
    assert abs(others.mean() - 0.5) < 0.08 and others.max() < 0.7
    assert out["heads"] == [(1, 2)]
    assert float(out["directions"][1, 2] @ v) > 0.9  # the probe normal is near the planted direction, signed


def test_head_activations_last_valid_token_matches_capture(tiny):
    m, p, _, _ = tiny
    seg = np.ones_like(TOKENS)
    seg[0, 10:] = 0  # row 0 right-padded after 10 tokens
    seg[2, 4:] = 0
    full = _heads(m, p)  # [B, T, L, H, K] (causal: padding after a token does not change it)
    got = iti.head_activations(m, p, TOKENS, segment_ids=seg, batch_size=2)
    assert got.shape == (3, 2, 4, 8)
    np.testing.assert_allclose(got, full[[0, 1, 2], [9, T - 1, 3]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(iti.head_activations(m, p, TOKENS, at="all"), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("positions", ["last", "all"])
def test_edited_generate_equals_argmax_of_edited_full_forward(tiny, positions):
    m, p, dirs, sig = tiny
    n_new = 6
    edits = iti.iti_edits(m, HEADS, dirs, sig, 8.0, positions)
    out = generate(m, p, TOKENS.tolist(), key=jax.random.key(0), max_new_tokens=n_new, temperature=0.0,
                   edits=edits)
    assert not np.array_equal(out.tokens, generate(m, p, TOKENS.tolist(), key=jax.random.key(0),
                                                   max_new_tokens=n_new, temperature=0.0).tokens)
    seq = np.concatenate([TOKENS, out.tokens], axis=1)
    # "last" in decoding edits the last prompt token, then every generated token: positions T-1..
    full = iti.iti_edits(m, HEADS, dirs, sig, 8.0, T - 1 if positions == "last" else "all")
    logits = build_model(m, edits=full).apply({"params": p}, jnp.asarray(seq[:, :-1]))
    np.testing.assert_array_equal(np.argmax(np.asarray(logits)[:, T - 1:], -1), out.tokens)
