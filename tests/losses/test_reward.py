"""Reward-model losses: Bradley-Terry variants and BSR (docs/methods/bsr.md)."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.losses import bsr_penalty, reward_loss


def _rewards(seed=0, B=8, shift=0.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k1, (B,)) + shift, jax.random.normal(k2, (B,)) + shift)


def _logsig(x):
    return -np.log1p(np.exp(-x))


def test_bt_hand_values_and_lambda_zero():
    rw, rl = jnp.array([2.0, 0.0]), jnp.array([1.0, 1.0])
    loss, m = reward_loss(rw, rl)
    np.testing.assert_allclose(loss, -(_logsig(1.0) + _logsig(-1.0)) / 2, rtol=1e-6)
    assert float(m["accuracy"]) == 0.5 and float(m["margin"]) == 0.0
    np.testing.assert_allclose(m["rewards/mean"], 1.0)
    np.testing.assert_allclose(m["rewards/std"], np.std([2.0, 0.0, 1.0, 1.0]), rtol=1e-6)
    loss0, m0 = reward_loss(rw, rl, bsr_lambda=0.0)
    assert float(loss0) == float(loss) and float(m0["loss/bsr"]) == 0.0


def test_variants_hand_values():
    rw, rl = jnp.array([1.5]), jnp.array([0.5])
    cases = {
        ("bt", 0.3): -_logsig(1.0 - 0.3),
        ("hinge", 2.0): 1.0,
        ("hinge", 0.0): 0.0,
        ("normalized", 0.0): -_logsig(1.0 / np.sqrt(1.5 ** 2 + 0.5 ** 2)),
        ("eurus", 0.0): -_logsig(1.0) - _logsig(1.5) - _logsig(-0.5),
    }
    for (variant, margin), want in cases.items():
        got, _ = reward_loss(rw, rl, variant=variant, margin=margin)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=variant)
    # TRL's per-example margin
    got, _ = reward_loss(jnp.array([1.0, 1.0]), jnp.array([0.0, 0.0]), margin=jnp.array([0.0, 1.0]))
    np.testing.assert_allclose(got, -(_logsig(1.0) + _logsig(0.0)) / 2, rtol=1e-6)


def test_shift_behaviour():
    rw, rl = _rewards(1, shift=3.0)
    c = 2.7
    bt, _ = reward_loss(rw, rl)
    bt_shift, _ = reward_loss(rw + c, rl + c)
    np.testing.assert_allclose(bt, bt_shift, rtol=1e-6)
    lam = 1e-2
    _, m = reward_loss(rw, rl, bsr_lambda=lam)
    assert float(m["loss/bsr"]) > 0
    mean = (jnp.sum(rw) + jnp.sum(rl)) / (2 * rw.shape[0])
    loss_c, m_c = reward_loss(rw - mean, rl - mean, bsr_lambda=lam)
    np.testing.assert_allclose(m_c["loss/pair"], bt, rtol=1e-6)
    np.testing.assert_allclose(m_c["loss/bsr"], 0.0, atol=1e-12)
    np.testing.assert_allclose(loss_c, bt, rtol=1e-6)


def test_bsr_value_and_gradient_match_the_spec():
    B, lam = 8, 1e-3
    rw, rl = _rewards(2, B=B, shift=1.5)
    pen = bsr_penalty(rw, rl, bsr_lambda=lam)
    lam_eff = lam * B
    mean = (jnp.sum(rw) + jnp.sum(rl)) / (2 * B)
    np.testing.assert_allclose(pen, lam_eff * mean ** 2, rtol=1e-6)
    # equivalent form (lambda / 4B) (sum)^2 when B = B_dev
    np.testing.assert_allclose(pen, lam / (4 * B) * (jnp.sum(rw) + jnp.sum(rl)) ** 2, rtol=1e-6)
    gw, gl = jax.grad(lambda a, b: bsr_penalty(a, b, bsr_lambda=lam), argnums=(0, 1))(rw, rl)
    want = lam_eff * mean / B
    np.testing.assert_allclose(np.concatenate([gw, gl]), np.full(2 * B, want), rtol=1e-5)
    # and through reward_loss: the BSR part of the gradient is that constant for every reward
    g_all = jax.grad(lambda a, b: reward_loss(a, b, bsr_lambda=lam)[0], argnums=(0, 1))(rw, rl)
    g_bt = jax.grad(lambda a, b: reward_loss(a, b)[0], argnums=(0, 1))(rw, rl)
    np.testing.assert_allclose(np.concatenate(g_all) - np.concatenate(g_bt), want, rtol=1e-4)


def test_scale_by_batch_multiplies_by_b_dev():
    rw, rl = _rewards(3, B=12, shift=0.4)
    scaled = bsr_penalty(rw, rl, bsr_lambda=1e-3, scale_by_batch=True)
    plain = bsr_penalty(rw, rl, bsr_lambda=1e-3, scale_by_batch=False)
    np.testing.assert_allclose(scaled, 12 * plain, rtol=1e-6)
    # with 3 shards the per-device batch is 4
    s3 = bsr_penalty(rw, rl, bsr_lambda=1e-3, num_shards=3)
    p3 = bsr_penalty(rw, rl, bsr_lambda=1e-3, num_shards=3, scale_by_batch=False)
    np.testing.assert_allclose(s3, 4 * p3, rtol=1e-6)


def test_local_vs_global():
    rw, rl = _rewards(4, B=8)
    one = dict(bsr_lambda=1e-3, per_device_batch=8)
    np.testing.assert_allclose(bsr_penalty(rw, rl, reduce="local", **one),
                               bsr_penalty(rw, rl, reduce="global", **one), rtol=1e-6)
    # two shards with different means: local = lam_eff * (m1^2 + m2^2) / 2, global = lam_eff * m^2
    rw2 = rw.at[:4].add(2.0).at[4:].add(-1.0)
    rl2 = rl.at[:4].add(2.0).at[4:].add(-1.0)
    m1 = (jnp.sum(rw2[:4]) + jnp.sum(rl2[:4])) / 8
    m2 = (jnp.sum(rw2[4:]) + jnp.sum(rl2[4:])) / 8
    lam_eff = 1e-3 * 4
    local = bsr_penalty(rw2, rl2, bsr_lambda=1e-3, num_shards=2)
    glob = bsr_penalty(rw2, rl2, bsr_lambda=1e-3, num_shards=2, reduce="global")
    np.testing.assert_allclose(local, lam_eff * (m1 ** 2 + m2 ** 2) / 2, rtol=1e-5)
    np.testing.assert_allclose(glob, lam_eff * ((m1 + m2) / 2) ** 2, rtol=1e-5)
    np.testing.assert_allclose(local - glob, lam_eff * ((m1 - m2) / 2) ** 2, rtol=1e-4)


def test_center_is_the_intended_squared_penalty():
    rw, rl = _rewards(5, B=6, shift=0.8)
    loss, m = reward_loss(rw, rl, center_coef=0.01)
    np.testing.assert_allclose(m["loss/center"], 0.01 * jnp.mean((rw + rl) ** 2), rtol=1e-6)
    np.testing.assert_allclose(loss, m["loss/pair"] + m["loss/center"], rtol=1e-6)


def test_weights_drop_padding_pairs():
    rw, rl = _rewards(6, B=4, shift=0.5)
    full, mf = reward_loss(rw[:3], rl[:3], bsr_lambda=1e-2, per_device_batch=3)
    padded, mp = reward_loss(rw.at[3].set(50.0), rl.at[3].set(-50.0), bsr_lambda=1e-2,
                             per_device_batch=3, weights_B=jnp.array([1.0, 1.0, 1.0, 0.0]))
    np.testing.assert_allclose(padded, full, rtol=1e-6)
    chex.assert_trees_all_close(mp, mf, rtol=1e-5, atol=1e-7)


def test_errors():
    rw, rl = _rewards(0, B=6)
    with pytest.raises(ValueError, match="config.loss.variant"):
        reward_loss(rw, rl, variant="bogus")
    with pytest.raises(ValueError, match="config.loss.bsr_reduce"):
        bsr_penalty(rw, rl, bsr_lambda=1.0, reduce="all")
    with pytest.raises(ValueError, match="does not split into 4"):
        bsr_penalty(rw, rl, bsr_lambda=1.0, num_shards=4)
