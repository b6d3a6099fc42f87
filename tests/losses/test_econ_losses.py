"""ECON's training signals (icml_jax/losses/econ.py) on hand-made cases computed by hand / numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.losses import econ as L


def test_td_loss_elementwise_masked_and_reference_broadcast():
    q, y = jnp.array([1.0, 2.0]), jnp.array([0.0, 4.0])
    assert float(L.td_loss(q, y, jnp.ones(2))) == pytest.approx((1 + 4) / 2)
    assert float(L.td_loss(q, y, jnp.array([1.0, 0.0]))) == pytest.approx(1.0)
    # the reference's [B] - [B, 1] broadcast: every Q_tot against every target
    # j=0: (1-0)^2 + (2-0)^2 = 5; j=1: (1-4)^2 + (2-4)^2 = 13; / sum(mask) = 2
    assert float(L.td_loss(q, y, jnp.ones(2), reference_broadcast=True)) == pytest.approx(9.0)
    # the target is a constant: no gradient flows into it
    assert float(jax.grad(lambda t: L.td_loss(q, t, jnp.ones(2)))(y).sum()) == 0.0


def test_consistency_term_by_hand():
    c = jnp.array([[1.0, 0.0]])
    same = jnp.array([[[2.0, 0.0], [0.5, 0.0]]])           # cos = 1 for both agents
    assert float(L.consistency_loss(same, c)) == pytest.approx(0.0, abs=1e-7)   # spec property 3
    mixed = jnp.array([[[0.0, 3.0], [-1.0, 0.0]]])         # cos = 0 and -1: (1-0)^2 + (1+1)^2
    assert float(L.consistency_loss(mixed, c)) == pytest.approx(5.0)
    two = jnp.concatenate([same, mixed]), jnp.concatenate([c, c])  # mean over the batch
    assert float(L.consistency_loss(*two)) == pytest.approx(2.5)


def test_alignment_term_by_hand_and_stops_gradient_at_q_tot():
    local, q_tot = jnp.array([[1.0, 3.0], [2.0, 2.0]]), jnp.array([2.0, 2.0])
    assert float(L.alignment_loss(local, q_tot)) == pytest.approx((1 + 1 + 0 + 0) / 2)
    assert float(L.alignment_loss(jnp.array([[2.0, 2.0]]), jnp.array([2.0]))) == 0.0   # property 4
    g_tot = jax.grad(lambda t: L.alignment_loss(local, t))(q_tot)
    g_loc = jax.grad(lambda x: L.alignment_loss(x, q_tot))(local)
    assert np.all(np.asarray(g_tot) == 0.0)
    np.testing.assert_allclose(g_loc, [[-1.0, 1.0], [0.0, 0.0]])   # d/dQ_i mean_b Σ_i (.)^2 = 2(.)/B


def test_mix_loss_matches_numpy():
    rng = np.random.default_rng(0)
    B, N, C = 4, 3, 5
    q_tot, local = rng.normal(size=B), rng.normal(size=(B, N))
    feats, emb = rng.normal(size=(B, N, C)), rng.normal(size=(B, C))
    q_target, r = rng.normal(size=B), rng.uniform(size=B)
    term, mask = np.array([1.0, 0.0, 1.0, 0.0]), np.array([1.0, 1.0, 0.0, 1.0])
    gamma = 0.9
    y = r + gamma * q_target * (1 - term)
    td = np.sum((q_tot - y) ** 2 * mask) / mask.sum()
    cos = np.sum(feats * emb[:, None], -1) / (np.linalg.norm(feats, axis=-1) * np.linalg.norm(emb, axis=-1)[:, None])
    sd = np.mean(np.sum((1 - cos) ** 2, 1))
    qa = np.mean(np.sum((local - q_tot[:, None]) ** 2, 1))
    total, m = L.mix_loss(*(jnp.asarray(a, jnp.float32) for a in (q_tot, local, feats, emb, q_target, r, term, mask)),
                          gamma=gamma, lambda_sd=0.1, lambda_m=0.2)
    np.testing.assert_allclose([m["td_loss"], m["sd_loss"], m["q_align_loss"], total],
                               [td, sd, qa, td + 0.1 * sd + 0.2 * qa], rtol=1e-5)
    # the learner's target r + γ(1 - t) Q' enters again inside (the reference's double bootstrap)
    np.testing.assert_allclose(L.td_target_in(r, q_target, gamma, term), r + gamma * (1 - term) * q_target, rtol=1e-6)


def test_bne_refine_one_sweep_and_convergence():
    rng = np.random.default_rng(1)
    b = rng.normal(size=(2, 3, 4)).astype(np.float32)
    u = b / np.linalg.norm(b, axis=-1, keepdims=True)
    s = np.einsum("bid,bjd->bij", u, u)
    a = np.exp(s) / np.exp(s).sum(-1, keepdims=True) * (1 - np.eye(3))
    one = b + 0.1 * np.einsum("bij,bjd->bid", a, b)
    enc = lambda x: x.sum(1)  # noqa: E731
    out, group, sweeps = L.bne_refine(jnp.asarray(b), enc, max_iters=1, tol=0.0)
    np.testing.assert_allclose(out, one, rtol=1e-5)
    np.testing.assert_allclose(group, one.sum(1), rtol=1e-5)
    assert int(sweeps) == 1
    # a huge tolerance stops after the first sweep; zero tolerance runs all of them
    assert int(L.bne_refine(jnp.asarray(b), enc, max_iters=5, tol=1e9)[2]) == 1
    assert int(L.bne_refine(jnp.asarray(b), enc, max_iters=5, tol=0.0)[2]) == 5


def test_belief_and_encoder_losses_match_numpy():
    rng = np.random.default_rng(2)
    b1, b2 = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    q1, q2, y, mask = rng.normal(size=(2, 3)), rng.normal(size=(2, 3)), rng.normal(size=2), np.array([1.0, 0.0])
    td = np.sum(((q1 - y[:, None]) * mask[:, None]) ** 2) / 1.0
    cons = np.sum(((q2 - q2.mean(-1, keepdims=True)) * mask[:, None]) ** 2)
    evo = np.sum((np.linalg.norm(b2 - b1, axis=-1) - 0.1) ** 2 * mask[:, None])
    reg = np.linalg.norm(b1, axis=-1).mean() + np.linalg.norm(b2, axis=-1).mean()
    total, _ = L.belief_loss(*(jnp.asarray(a, jnp.float32) for a in (b1, b2, q1, q2, y, mask)), stage2_weight=0.3)
    assert float(total) == pytest.approx(td + 0.3 * cons + 0.1 * evo + 0.01 * reg, rel=1e-5)
    g1, g2 = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    u = g2 / np.linalg.norm(g2, axis=-1, keepdims=True)
    want = 0.1 * np.mean((g2 - g1) ** 2) + 0.01 * np.mean(np.abs(u @ u.T - np.eye(3)))
    got, _ = L.encoder_loss(jnp.asarray(g1), jnp.asarray(g2), jnp.asarray(g1), jnp.asarray(g2))
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_reward_weights_and_linearity():
    w = L.init_reward_weights()
    assert float(w.sum()) == pytest.approx(1.0)                                  # property 5
    np.testing.assert_allclose(w, np.exp([0.4, 0.4, 0.2]) / np.exp([0.4, 0.4, 0.2]).sum(), rtol=1e-6)
    x, z = np.array([0.2, 1.0, 0.5]), np.array([0.7, 0.0, 0.1])
    r = lambda v: float(L.reward(*v, weights=tuple(np.asarray(w))))  # noqa: E731
    assert r(2 * x + 3 * z) == pytest.approx(2 * r(x) + 3 * r(z), rel=1e-6)
    assert float(L.reward(1.0, 0.0, 0.0)) == pytest.approx(L.AL_TS_CC_ENV_WEIGHTS[0])
    hist = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    w2 = L.update_reward_weights(w, hist, lr=0.1)
    assert float(w2.sum()) == pytest.approx(1.0)
    assert float(L.reward_weight_loss(w, hist)) == pytest.approx(float(np.sum((np.asarray(hist) - np.asarray(w)) ** 2)))
