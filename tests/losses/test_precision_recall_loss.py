"""The candidate precision-recall token loss (docs/methods/precision_recall.md) and its errors."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.losses.precision_recall import pr_hinge_from_q, pr_loss, pr_token_losses

JIT = pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])


def _logits(seed=0, B=3, T=4, V=7, scale=2.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return scale * jax.random.normal(k1, (B, T, V)), jax.random.randint(k2, (B, T), 0, V)


def _q_y(logits, y):
    q = jax.nn.softmax(logits, -1)
    return np.asarray(jnp.take_along_axis(q, y[..., None], -1)[..., 0])


@JIT
@pytest.mark.parametrize("lam", [1.0, 1.5, 10.0])
def test_lambda_ge_1_is_one_minus_q(wrap, lam):
    logits, y = _logits()
    hinge, nll, q = wrap(functools.partial(pr_token_losses, pr_lambda=lam))(logits, y)
    chex.assert_shape(hinge, y.shape)
    np.testing.assert_allclose(hinge, 1.0 - _q_y(logits, y), atol=1e-6)
    np.testing.assert_allclose(q, _q_y(logits, y), rtol=1e-5)
    np.testing.assert_allclose(nll, -np.log(_q_y(logits, y)), rtol=1e-5)


@JIT
@pytest.mark.parametrize("lam", [0.05, 0.3, 0.5, 1.0])
def test_lambda_le_1_is_a_hinge(wrap, lam):
    logits, y = _logits(1)
    got = wrap(functools.partial(pr_token_losses, pr_lambda=lam))(logits, y)[0]
    want = np.maximum(lam - _q_y(logits, y), 0.0)
    np.testing.assert_allclose(got, want, atol=1e-6)
    if lam < 0.9:  # both regimes are exercised
        assert (want == 0).any() and (want > 0).any()


@JIT
def test_saturated_tokens_have_zero_loss_and_gradient(wrap):
    lam = 0.3
    logits = jnp.array([4.0, 0.0, 0.0, 0.0])  # q_0 ~ 0.95 >= lambda

    def f(lg):
        return pr_token_losses(lg[None, None], jnp.array([[0]]), pr_lambda=lam)[0].sum()
    val, g = wrap(jax.value_and_grad(f))(logits)
    assert float(val) == 0.0
    assert np.all(np.asarray(g) == 0.0)
    # in q: exactly 0 at and above lambda (the tie included), -1 below
    dq = jax.vmap(jax.grad(lambda q: pr_hinge_from_q(q, lam)))(jnp.array([0.1, 0.29, 0.3, 0.9]))
    np.testing.assert_array_equal(dq, [-1.0, -1.0, 0.0, 0.0])


@JIT
@pytest.mark.parametrize("lam", [0.5, 2.0])
def test_gradient_below_lambda(wrap, lam):
    logits = jnp.array([0.3, -1.0, 0.5, 2.0, 0.0])
    y = 1  # q_y ~ 0.03 < lambda
    q = jax.nn.softmax(logits)
    e = jnp.zeros(5).at[y].set(1.0)

    def f(lg):
        return pr_token_losses(lg[None, None], jnp.array([[y]]), pr_lambda=lam)[0].sum()
    g = wrap(jax.grad(f))(logits)
    np.testing.assert_allclose(g, -q[y] * (e - q), rtol=1e-5, atol=1e-7)
    assert float(pr_hinge_from_q(q[y], lam)) > 0


def test_pr_loss_mix_weights_and_reductions():
    logits, y = _logits(2)
    w = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], jnp.float32)
    hinge, nll, q = pr_token_losses(logits, y, pr_lambda=0.5)
    n = float(w.sum())
    loss, m = pr_loss(logits, y, w, loss_type="pr_hinge", pr_lambda=0.5, pr_mix_nll=0.25)
    np.testing.assert_allclose(loss, float(((hinge + 0.25 * nll) * w).sum()) / n, rtol=1e-5)
    np.testing.assert_allclose(m["token_nll"], float((nll * w).sum()) / n, rtol=1e-5)
    np.testing.assert_allclose(m["pr_hinge"], float((hinge * w).sum()) / n, rtol=1e-5)
    np.testing.assert_allclose(m["saturated"], float(((q >= 0.5) * w).sum()) / n, rtol=1e-6)
    s, ms = pr_loss(logits, y, w, loss_type="pr_hinge", pr_lambda=0.5, pr_mix_nll=0.25,
                    reduction="sum")
    np.testing.assert_allclose(s, float(loss) * n, rtol=1e-5)
    nl, _ = pr_loss(logits, y, w, loss_type="nll", pr_lambda=0.5)
    np.testing.assert_allclose(nl, m["token_nll"], rtol=1e-6)
    chex.assert_tree_all_finite((loss, m, ms))


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf"), "x"])
def test_bad_lambda_is_a_clear_error(bad):
    logits, y = _logits()
    with pytest.raises(ValueError, match="config.loss.pr_lambda"):
        pr_loss(logits, y, loss_type="pr_hinge", pr_lambda=bad)


def test_bad_type_and_mix_are_clear_errors():
    logits, y = _logits()
    with pytest.raises(ValueError, match="config.loss.type='kl'"):
        pr_loss(logits, y, loss_type="kl")
    with pytest.raises(ValueError, match="config.loss.pr_mix_nll"):
        pr_loss(logits, y, loss_type="pr_hinge", pr_lambda=0.5, pr_mix_nll=-1.0)
