"""DPO and TGDPO losses (docs/methods/tgdpo.md) and the per-token log-prob helper."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax import losses
from icml_jax.losses import dpo_loss, response_token_logps, sequence_logps, tgdpo_loss
from icml_jax.losses.preference import tgdpo_token_weights


def _logsig(x):
    return -np.log1p(np.exp(-x))


def _seq(seed, B=4, T=6):
    ks = jax.random.split(jax.random.key(seed), 8)
    lp = [-jnp.abs(jax.random.normal(k, (B, T))) for k in ks[:6]]
    mask = (jax.random.uniform(ks[6], (B, T)) > 0.3).astype(jnp.int32).at[:, 0].set(1)
    mask2 = (jax.random.uniform(ks[7], (B, T)) > 0.3).astype(jnp.int32).at[:, 0].set(1)
    return [x * m for x, m in zip(lp, [mask, mask2] * 3)], mask, mask2


def test_response_token_logps_alignment_and_masking():
    logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
    tokens = jnp.array([[1, 2, 3, 4, 0], [5, 6, 1, 0, 0]])
    mask = jnp.array([[0, 0, 1, 1, 0], [0, 1, 1, 0, 0]])
    lp = response_token_logps(logits, tokens, mask)
    ref = jax.nn.log_softmax(logits, -1)
    assert float(lp[0, 2]) == pytest.approx(float(ref[0, 1, 3]), abs=1e-6)  # slot t reads logits t-1
    assert float(lp[0, 3]) == pytest.approx(float(ref[0, 2, 4]), abs=1e-6)
    assert float(lp[1, 1]) == pytest.approx(float(ref[1, 0, 6]), abs=1e-6)
    assert np.all(np.asarray(lp)[np.asarray(mask) == 0] == 0.0)
    assert lp.dtype == jnp.float32
    # masked logits (even NaN) change nothing and get no gradient
    poisoned = logits.at[0, 3].set(jnp.nan).at[1, 2:].set(jnp.nan)
    np.testing.assert_array_equal(response_token_logps(poisoned, tokens, mask), lp)
    g = jax.grad(lambda x: response_token_logps(x, tokens, mask).sum())(logits)
    assert np.all(np.asarray(g[0, 3]) == 0) and np.all(np.asarray(g[1, 2:]) == 0)
    assert np.any(np.asarray(g[0, 1]) != 0)
    np.testing.assert_allclose(sequence_logps(lp, mask), lp.sum(-1), rtol=1e-6)
    np.testing.assert_allclose(sequence_logps(lp, mask, average=True), lp.sum(-1) / mask.sum(-1),
                               rtol=1e-6)


def test_dpo_hand_values():
    pc, pr, rc, rr = map(jnp.array, ([-3.0], [-5.0], [-4.0], [-4.5]))
    h = (-3 + 5) - (-4 + 4.5)  # 1.5
    beta = 0.1
    want = {"sigmoid": -_logsig(beta * h), "hinge": max(0.0, 1 - beta * h),
            "ipo": (h - 1 / (2 * beta)) ** 2}
    for t, w in want.items():
        got, m = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=t)
        np.testing.assert_allclose(got, w, rtol=1e-6, err_msg=t)
    np.testing.assert_allclose(m["rewards/chosen"], beta * 1.0, rtol=1e-6)
    np.testing.assert_allclose(m["rewards/rejected"], beta * -0.5, rtol=1e-6)
    np.testing.assert_allclose(m["rewards/margins"], beta * 1.5, rtol=1e-6)
    assert float(m["rewards/accuracies"]) == 1.0
    np.testing.assert_allclose(m["logps/chosen"], -3.0)
    np.testing.assert_allclose(m["logps/rejected"], -5.0)
    eps = 0.2
    got, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    np.testing.assert_allclose(got, -(1 - eps) * _logsig(beta * h) - eps * _logsig(-beta * h),
                               rtol=1e-6)
    got, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="robust", label_smoothing=eps)
    np.testing.assert_allclose(
        got, (-(1 - eps) * _logsig(beta * h) + eps * _logsig(-beta * h)) / (1 - 2 * eps), rtol=1e-6)
    got, m = dpo_loss(pc, pr, rc, rr, beta=beta, reference_free=True)
    np.testing.assert_allclose(got, -_logsig(beta * 2.0), rtol=1e-6)
    np.testing.assert_allclose(m["rewards/chosen"], beta * -3.0, rtol=1e-6)


def test_dpo_reference_is_frozen():
    (pc, pr, rc, rr, *_), _, _ = _seq(1)
    args = [x.sum(-1) for x in (pc, pr, rc, rr)]
    g = jax.grad(lambda *a: dpo_loss(*a)[0], argnums=(0, 1, 2, 3))(*args)
    assert np.any(np.asarray(g[0]) != 0) and np.any(np.asarray(g[1]) != 0)
    assert np.all(np.asarray(g[2]) == 0) and np.all(np.asarray(g[3]) == 0)


def test_tgdpo_alpha_zero_and_identity_guidance_equal_dpo():
    (pc, pr, rc, rr, gc, gr), mc, mr = _seq(2)
    dpo, m_dpo = dpo_loss(sequence_logps(pc, mc), sequence_logps(pr, mr), sequence_logps(rc, mc),
                          sequence_logps(rr, mr), beta=0.1)
    tg0, m_tg = tgdpo_loss(pc, pr, rc, rr, gc, gr, mc, mr, beta=0.1, alpha=0.0)
    np.testing.assert_allclose(tg0, dpo, rtol=1e-6)
    for k, v in m_dpo.items():
        np.testing.assert_allclose(m_tg[k], v, rtol=1e-5, err_msg=k)
    for alpha in (0.5, 1.0, 3.0):  # pi_r = pi_ref -> r = 0 -> DPO for every alpha
        tg, _ = tgdpo_loss(pc, pr, rc, rr, rc, rr, mc, mr, beta=0.1, alpha=alpha)
        np.testing.assert_allclose(tg, dpo, rtol=1e-6)
    tg, _ = tgdpo_loss(pc, pr, rc, rr, gc, gr, mc, mr, beta=0.1, alpha=0.5)
    assert abs(float(tg) - float(dpo)) > 1e-5  # the guidance does change the loss


def test_tgdpo_gradients_only_through_the_policy_and_masking():
    (pc, pr, rc, rr, gc, gr), mc, mr = _seq(3)
    f = lambda *a: tgdpo_loss(*a, mc, mr, beta=0.1, alpha=0.5)[0]  # noqa: E731
    g = jax.grad(f, argnums=tuple(range(6)))(pc, pr, rc, rr, gc, gr)
    assert np.any(np.asarray(g[0]) != 0) and np.any(np.asarray(g[1]) != 0)
    for i in (2, 3, 4, 5):
        assert np.all(np.asarray(g[i]) == 0), i
    base = f(pc, pr, rc, rr, gc, gr)
    junk = lambda x, m: jnp.where(m > 0, x, 123.0)  # noqa: E731
    changed = f(junk(pc, mc), junk(pr, mr), junk(rc, mc), junk(rr, mr), junk(gc, mc), junk(gr, mr))
    np.testing.assert_allclose(changed, base, rtol=1e-6)


def test_tgdpo_token_weights_and_relative_gradients():
    (pc, pr, rc, rr, gc, gr), mc, mr = _seq(4)
    beta, alpha = 0.1, 0.5
    r_w, r_l = beta * (gc - rc), beta * (gr - rr)
    np.testing.assert_allclose(tgdpo_token_weights(rc, gc, beta=beta, alpha=alpha, chosen=True),
                               beta * (1 + alpha * r_w), rtol=1e-6)
    np.testing.assert_allclose(tgdpo_token_weights(rr, gr, beta=beta, alpha=alpha, chosen=False),
                               beta * (1 - alpha * r_l), rtol=1e-6)
    # d loss / d rho_t is proportional to the guidance factor: ratios between tokens of one row
    rho_w, rho_l = pc - rc, pr - rr
    f = lambda a, b: tgdpo_loss(a + rc, b + rr, rc, rr, gc, gr, mc, mr, beta=beta, alpha=alpha)[0]  # noqa: E731
    gw, gl = jax.grad(f, argnums=(0, 1))(rho_w, rho_l)
    row = 0
    idx_w = np.flatnonzero(np.asarray(mc[row]))[:2]
    idx_l = np.flatnonzero(np.asarray(mr[row]))[:2]
    t, s = idx_w
    np.testing.assert_allclose(gw[row, t] / gw[row, s], (1 + alpha * r_w[row, t]) / (1 + alpha * r_w[row, s]),
                               rtol=1e-5)
    t, s = idx_l
    np.testing.assert_allclose(gl[row, t] / gl[row, s], (1 - alpha * r_l[row, t]) / (1 - alpha * r_l[row, s]),
                               rtol=1e-5)


def test_tgdpo_hand_value_and_clip():
    pc, rc, gc = jnp.array([[0.0, -1.0, -2.0]]), jnp.array([[0.0, -1.5, -1.0]]), jnp.array([[0.0, 9.0, -31.0]])
    pr, rr, gr = jnp.array([[0.0, -3.0]]), jnp.array([[0.0, -2.0]]), jnp.array([[0.0, -12.0]])
    mc, mr = jnp.array([[0, 1, 1]]), jnp.array([[0, 1]])
    beta, alpha = 0.1, 0.5
    # chosen: r = 0.1*(9+1.5)=1.05 -> w=0.1*1.525; r = 0.1*(-31+1)=-3 -> w=0.1*(-0.5) (negative: unclipped)
    # rejected: r = 0.1*(-12+2) = -1 -> w = 0.1*1.5
    logit = 0.1 * 1.525 * 0.5 + 0.1 * -0.5 * -1.0 - 0.1 * 1.5 * -1.0
    got, m = tgdpo_loss(pc, pr, rc, rr, gc, gr, mc, mr, beta=beta, alpha=alpha)
    np.testing.assert_allclose(got, -_logsig(logit), rtol=1e-6)
    np.testing.assert_allclose(m["tgdpo/nonpositive_weights"], 1 / 3, rtol=1e-6)
    clipped = 0.1 * 1.525 * 0.5 + 0.0 - 0.1 * 1.5 * -1.0
    got, _ = tgdpo_loss(pc, pr, rc, rr, gc, gr, mc, mr, beta=beta, alpha=alpha, weight_clip=(0.0, 2.0))
    np.testing.assert_allclose(got, -_logsig(clipped), rtol=1e-6)


def test_errors():
    x = jnp.zeros((2,))
    with pytest.raises(ValueError, match="config.loss.beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, label_smoothing=0.5)
    with pytest.raises(ValueError, match="config.loss.type"):
        dpo_loss(x, x, x, x, loss_type="kto")
    t = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="tgdpo_weight_clip"):
        tgdpo_loss(t, t, t, t, t, t, t, t, weight_clip=(2.0, 0.0))


def test_tgdpo_logit_on_arrays():
    """The exported array-level pieces: alpha = 0 gives beta times the DPO log-ratio margin over
    the masked tokens, and the loss is -log sigmoid of the logit."""
    from icml_jax.losses import tgdpo_logit, tgdpo_loss
    rng = np.random.default_rng(0)
    pc, pr, rc, rr, gc, gr = (jnp.asarray(rng.normal(size=(3, 5)), jnp.float32) for _ in range(6))
    mc = jnp.asarray(rng.integers(0, 2, (3, 5)))
    mr = jnp.asarray(rng.integers(0, 2, (3, 5)))
    logit, wc, wr = tgdpo_logit(pc, pr, rc, rr, gc, gr, mc, mr, beta=0.3, alpha=0.0)
    want = 0.3 * (jnp.sum((pc - rc) * mc, -1) - jnp.sum((pr - rr) * mr, -1))
    np.testing.assert_allclose(logit, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(wc, 0.3) and np.testing.assert_allclose(wr, 0.3)
    logit, _, _ = tgdpo_logit(pc, pr, rc, rr, gc, gr, mc, mr, beta=0.3, alpha=0.5)
    loss, _ = tgdpo_loss(pc, pr, rc, rr, gc, gr, mc, mr, beta=0.3, alpha=0.5)
    np.testing.assert_allclose(loss, jnp.mean(-jax.nn.log_sigmoid(logit)), rtol=1e-6)


def test_weighted_mean_is_the_one_padding_aware_mean():
    x, w = jnp.asarray([1.0, 2.0, 4.0]), jnp.asarray([1.0, 0.0, 3.0])
    assert float(losses.weighted_mean(x, w)) == pytest.approx(np.average(x, weights=w))
    assert float(losses.weighted_mean(x)) == pytest.approx(7.0 / 3.0)
    assert float(losses.weighted_mean(x, jnp.zeros(3))) == 0.0  # all padding: 0, not NaN
