"""Implicit PRM: log-ratio rewards, prefix values, step rewards, CE/DPO and scoring (docs/methods/implicit_prm.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import prm_eval
from icml_jax.config_utils import load_config
from icml_jax.losses import dpo_loss, response_token_logps
from icml_jax.losses import implicit_prm as ip
from icml_jax.models import build_model

BETA = 0.05


def _case():
    """2 responses over 10 slots: response 0 starts at slot 2 with steps ending at 4, 6, 9;
    response 1 starts at 3 with steps ending at 5, 8 (one padding step)."""
    pol = jnp.array([np.linspace(-1, -0.1, 10), np.linspace(-2, -0.2, 10)], jnp.float32)
    ref = jnp.array([np.full(10, -0.5), np.full(10, -0.7)], jnp.float32)
    first = jnp.array([2, 3])
    ends = jnp.array([[4, 6, 9], [5, 8, 0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    return pol, ref, first, ends, mask


def test_hand_computed_step_rewards_and_sum_rule():
    pol, ref, first, ends, mask = _case()
    lr = ip.token_log_ratios(pol, ref, first)
    l0 = np.asarray(pol[0] - ref[0])
    want_q0 = BETA * np.array([l0[2:5].sum(), l0[2:7].sum(), l0[2:10].sum()])
    q = ip.prefix_values(lr, ends, mask, BETA)
    np.testing.assert_allclose(q[0], want_q0, rtol=1e-5)
    r = ip.step_rewards(q, mask)
    np.testing.assert_allclose(r[0], BETA * np.array([l0[2:5].sum(), l0[5:7].sum(), l0[7:10].sum()]),
                               rtol=1e-5)
    assert float(r[1, 2]) == 0.0 and float(q[1, 2]) == 0.0  # padding step
    # sum_k r_k = q_K = the outcome reward (last step ends at the last slot)
    np.testing.assert_allclose(r[0].sum(), ip.outcome_reward(lr, BETA)[0], rtol=1e-5)
    np.testing.assert_allclose(ip.aggregate(q, mask, "last")[0], ip.outcome_reward(lr, BETA)[0],
                               rtol=1e-5)
    # one step: r_1 is the outcome reward
    one = ip.step_rewards(ip.prefix_values(lr, jnp.array([[9], [9]]), jnp.ones((2, 1)), BETA),
                          jnp.ones((2, 1)))
    np.testing.assert_allclose(one[:, 0], ip.outcome_reward(lr, BETA), rtol=1e-5)


def test_aggregations_and_kappa_ranking_invariance():
    pol, ref, first, ends, mask = _case()
    lr = ip.token_log_ratios(pol, ref, first)
    r = ip.step_rewards(ip.prefix_values(lr, ends, mask, 1.0), mask)
    np.testing.assert_allclose(ip.aggregate(r, mask, "min"), [r[0].min(), r[1, :2].min()], rtol=1e-6)
    np.testing.assert_allclose(ip.aggregate(r, mask, "sum"), [r[0].sum(), r[1, :2].sum()], rtol=1e-6)
    rng = np.random.default_rng(0)
    lrs = jnp.asarray(rng.normal(size=(16, 10)), jnp.float32)
    e = jnp.tile(jnp.array([[3, 6, 9]]), (16, 1))
    m = jnp.ones((16, 3))
    for how in ("min", "sum"):
        for st in ip.SCORE_TYPES:
            ranks = [np.argsort(np.asarray(ip.score(lrs, e, m, kappa=k, score_type=st, how=how)))
                     for k in (0.001, 0.1, 3.0)]
            assert all(np.array_equal(ranks[0], x) for x in ranks[1:])
    # weighted majority voting depends on kappa, through ip.score: answer "a" (1 confident vote)
    # vs "b" (2 weak ones); the same log-ratios scored at kappa 1 pick a, at 0.001 pick b
    answers = [["a", "b", "b"]]
    lr3 = jnp.asarray([[3.0, 3.0], [-0.5, -0.5], [-0.5, -0.5]], jnp.float32)  # summed: 6, -1, -1
    e3, m3 = jnp.array([[1]] * 3), jnp.ones((3, 1))
    for kappa, want in ((1.0, 1.0), (0.001, 0.0)):
        sc = np.asarray(ip.score(lr3, e3, m3, kappa=kappa, score_type="accumulative", how="sum"))[None]
        assert prm_eval.weighted_majority(answers, sc, ["a"], [3])[3] == want, kappa


def test_changing_a_later_token_leaves_earlier_step_rewards(tiny_model):
    model, p_pol, p_ref = tiny_model
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, 200, (1, 16)), jnp.int32)
    ends, mask, first = jnp.array([[5, 9, 15]]), jnp.ones((1, 3)), jnp.array([2])
    full = jnp.ones((1, 16), jnp.int32)

    @jax.jit  # one compiled program for both token rows (eagerly every op compiles on its own)
    def step_r(p_pol, p_ref, t):
        lp = lambda p: response_token_logps(model.apply({"params": p}, t), t, full)  # noqa: E731
        lr = ip.token_log_ratios(lp(p_pol), lp(p_ref), first)
        return ip.step_rewards(ip.prefix_values(lr, ends, mask, BETA), mask)

    base = step_r(p_pol, p_ref, tokens)
    changed = step_r(p_pol, p_ref, tokens.at[0, 12].set(7))  # a token of step 3
    np.testing.assert_allclose(changed[0, :2], base[0, :2], rtol=1e-6, atol=1e-7)
    assert abs(float(changed[0, 2] - base[0, 2])) > 1e-6


@pytest.fixture(scope="module")
def tiny_model():
    c = load_config("configs/lm.py:tiny")
    model = build_model(c.model)
    init = jax.jit(lambda k: model.init(k, jnp.zeros((1, 16), jnp.int32))["params"])
    from flax.linen import meta
    return model, meta.unbox(init(jax.random.key(0))), meta.unbox(init(jax.random.key(1)))


def test_initialisation_gives_log2_losses():
    lp = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8)), jnp.float32)
    lr = ip.token_log_ratios(lp, lp, jnp.zeros(4, jnp.int32))
    r = ip.outcome_reward(lr, BETA)
    assert np.all(np.asarray(r) == 0)
    ce, _ = ip.ce_loss(r, jnp.array([1, 0, 1, 0]))
    np.testing.assert_allclose(ce, np.log(2), rtol=1e-6)
    s = lp.sum(-1)
    dpo, _ = dpo_loss(s[:2], s[2:], s[:2], s[2:], beta=BETA)
    np.testing.assert_allclose(dpo, np.log(2), rtol=1e-6)


def test_ce_is_bce_with_reference_clamp_and_gradient():
    r = jnp.array([2.0, -1.0, 0.3, 200.0, -200.0])
    y = jnp.array([1, 1, 0, 0, 1])
    loss, m = ip.ce_loss(r, y)
    p = 1 / (1 + np.exp(-np.asarray(r, np.float64)))
    with np.errstate(divide="ignore"):
        logs = np.where(np.asarray(y) == 1, np.log(p), np.log1p(-p))
    want = -np.maximum(logs, -100)  # torch BCELoss clamps the logs at -100
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-5)
    assert float(m["accuracy"]) == pytest.approx(1 / 5)  # only r=2 (label 1) is on the right side
    g = jax.grad(lambda x: ip.ce_loss(x, y[:3])[0] * 3)(r[:3])
    np.testing.assert_allclose(g, jax.nn.sigmoid(r[:3]) - y[:3], rtol=1e-5)
    loss_exact, _ = ip.ce_loss(r, y, log_clamp=None)
    assert float(loss_exact) > float(loss)  # -log sigma(-200) = 200 is not clamped


def test_dpo_variant_and_swap():
    pc, pr, rc, rr = map(jnp.array, ([-3.0], [-4.0], [-3.5], [-3.8]))
    delta = BETA * ((-3 + 4) - (-3.5 + 3.8))
    got, _ = dpo_loss(pc, pr, rc, rr, beta=BETA)
    np.testing.assert_allclose(got, -np.log(1 / (1 + np.exp(-delta))), rtol=1e-6)
    swapped, _ = dpo_loss(pr, pc, rr, rc, beta=BETA)
    np.testing.assert_allclose(swapped, -np.log(1 / (1 + np.exp(delta))), rtol=1e-6)


def test_gradients_only_through_the_policy():
    pol, ref, first, ends, mask = _case()
    f = lambda p, r: ip.score(ip.token_log_ratios(p, r, first), ends, mask, how="sum").sum()  # noqa: E731
    gp, gr = jax.grad(f, argnums=(0, 1))(pol, ref)
    assert np.any(np.asarray(gp) != 0) and np.all(np.asarray(gr) == 0)


def test_boundary_modes_differ_only_in_the_first_step():
    pol, ref, first, ends, mask = _case()
    resp = ip.step_rewards(ip.prefix_values(ip.token_log_ratios(pol, ref, first), ends, mask, BETA), mask)
    tmpl = ip.step_rewards(ip.prefix_values(ip.token_log_ratios(pol, ref, first - 2), ends, mask, BETA), mask)
    np.testing.assert_allclose(tmpl[:, 1:], resp[:, 1:], rtol=1e-6)
    lr = np.asarray(pol - ref)
    extra = BETA * np.array([lr[0, 0:2].sum(), lr[1, 1:3].sum()])
    np.testing.assert_allclose(tmpl[:, 0] - resp[:, 0], extra, rtol=1e-5)


def test_errors():
    with pytest.raises(ValueError, match="beta must be > 0"):
        ip.outcome_reward(jnp.zeros((1, 3)), 0.0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        ip.prefix_values(jnp.zeros((1, 3)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)), -1.0)
    with pytest.raises(ValueError, match="outside"):
        ip.check_steps([12], [[3]], [[1]], 10)
    with pytest.raises(ValueError, match=r"must lie in \[first_index=4"):
        ip.check_steps([4], [[3, 6]], [[1, 1]], 10)
    with pytest.raises(ValueError, match="must lie in"):
        ip.check_steps([1], [[3, 10]], [[1, 1]], 10)
    with pytest.raises(ValueError, match="not strictly increasing"):
        ip.check_steps([1], [[6, 3]], [[1, 1]], 10)
    ip.check_steps([1], [[3, 6, 0]], [[1, 1, 0]], 10)  # padding steps are ignored
    with pytest.raises(ValueError, match="unknown step aggregation"):
        ip.aggregate(jnp.zeros((1, 2)), jnp.ones((1, 2)), "mean")
    with pytest.raises(ValueError, match="unknown score type"):
        ip.score(jnp.zeros((1, 3)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)), score_type="x")
