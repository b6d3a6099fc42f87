"""ECON's Flax modules (icml_jax/models/econ.py): the mixer's monotonicity, the action bounds."""
import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.models import econ as M

N, D, C = 3, 8, 4


def test_mixer_is_monotone_in_every_local_q():
    """Spec property 1: dQ_tot/dQ_i >= 0 for random inputs and random parameters (8 draws, one
    compiled program); the hypernetwork weights are nonnegative and the gradient is not trivially 0."""
    mixer = M.Mixer(N, C, mixing_dim=4, feature_dim=8, hyper_hidden=8)

    @jax.jit
    def draw(key):
        kp, kq, ka, kg = jax.random.split(key, 4)
        q = 3.0 * jax.random.normal(kq, (5, N))
        a = jax.random.uniform(ka, (5, N, 2))
        g = 2.0 * jax.random.normal(kg, (5, D))
        params = mixer.init(kp, q, a, g)
        grad = jax.grad(lambda q: mixer.apply(params, q, a, g)["q_tot"].sum())(q)
        out = mixer.apply(params, q, a, g)
        return grad, out["w1"], out["w2"]

    grads, w1s, w2s = zip(*(draw(jax.random.key(s)) for s in range(8)))
    grads = np.stack(grads)
    assert grads.min() >= 0.0
    assert grads.max() > 0.0
    assert min(np.min(w) for w in w1s + w2s) >= 0.0


def test_actions_stay_in_their_ranges():
    """Spec property 2, for extreme pre-activations and for a belief network's outputs."""
    logits = jnp.array([-jnp.inf, -1e6, -3.0, 0.0, 5.0, 1e6, jnp.inf])
    t, p = M.bounded_actions(logits, logits)
    assert float(t.min()) >= 0.1 and float(t.max()) <= 2.0
    assert float(p.min()) >= 0.1 and float(p.max()) <= 0.9
    np.testing.assert_allclose([t[3], p[3]], [0.1 + 1.9 / 2, 0.1 + 0.8 / 2], rtol=1e-6)

    nets = M.BeliefNetworks(N, dict(vocab_size=20, hidden_dim=8, belief_dim=D, heads=2, layers=1, max_len=6))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 20, (2, N, 6)), jnp.int32)
    tokens = tokens.at[:, :, 4:].set(0)

    @jax.jit
    def run(key, tokens):
        params = nets.init(key, tokens)
        return params, nets.apply(params, tokens)

    params, out = run(jax.random.key(0), tokens)
    assert out["belief"].shape == (2, N, D) and out["q"].shape == (2, N)
    for k, (lo, hi) in (("temperature", M.T_RANGE), ("top_p", M.P_RANGE)):
        assert float(out[k].min()) >= lo and float(out[k].max()) <= hi
    # one parameter set per executor: identical observations give different actions
    assert jax.tree.leaves(params)[0].shape[0] == N
    assert float(jnp.abs(out["temperature"][:, 0] - out["temperature"][:, 1]).max()) > 0


def test_belief_network_ignores_right_padding():
    """A padded row gives the outputs of its real tokens alone: pad keys are masked per row and
    the last real token is pooled (the reference's row-0 mask gives NaN on padded batches)."""
    net = M.BeliefNetwork(vocab_size=16, hidden_dim=16, belief_dim=8, heads=2, layers=2, max_len=8)
    toks = jnp.array([[5, 6, 7, 0, 0], [3, 9, 4, 11, 2]])
    apply = jax.jit(net.apply)  # one compile per shape: the padded batch [2, 5], the row alone [1, 3]
    params = jax.jit(net.init)(jax.random.key(0), toks)
    padded = apply(params, toks)
    alone = apply(params, toks[:1, :3])
    for k in ("belief", "q", "temperature", "top_p"):
        np.testing.assert_allclose(padded[k][0], alone[k][0], rtol=1e-5, atol=1e-6, err_msg=k)
        assert np.isfinite(np.asarray(padded[k])).all()
    # a real token's change does move the belief (the comparison has teeth)
    other = apply(params, toks.at[0, 2].set(8))
    assert np.abs(np.asarray(other["belief"][0] - padded["belief"][0])).max() > 1e-4
