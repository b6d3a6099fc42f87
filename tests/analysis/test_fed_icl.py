"""Fed-ICL's round protocol (icml_jax/analysis/fed_icl.py): the spec's four property tests, selection,
aggregation, the Bayesian reference learner, and the ICLRegressor's prompt masking."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import fed_icl
from icml_jax.config_utils import load_config
from icml_jax.data.icl_regression import federated_tasks
from icml_jax.models.icl_regressor import build_icl_regressor

D, S = 4, 8


@pytest.fixture(scope="module")
def model_fn():
    """A tiny untrained ICLRegressor (1 layer, NoPE) as an ICL function, jitted once for [B, S]."""
    cfg = load_config("configs/lm.py:tiny").model
    cfg.update(dict(d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=8, ffn_dim=32, position="nope",
                    max_seq_len=S + 1))
    model = build_icl_regressor(cfg, products=True)
    z = (jnp.zeros((1, S, D)), jnp.zeros((1, S)), jnp.ones((1, S), bool), jnp.zeros((1, D)), jnp.zeros(1),
         jnp.zeros(1, bool))
    params = jax.jit(model.init)(jax.random.PRNGKey(0), *z)["params"]
    return fed_icl.model_icl_fn(model, params, batch=6)


def _tasks(B=6, K=3, n=5, seed=0):
    return federated_tasks(np.random.default_rng(seed), B, K, n, D, offset=1.5, spread=0.5, noise=0.1)


def test_one_client_one_round_is_centralised(model_fn):
    """Property 1: K = 1 client holding all the data, R = 1 = centralised ICL on the selected demos."""
    t = _tasks(K=3, n=4)
    B = t["X"].shape[0]
    X1, Y1 = t["X"].reshape(B, 1, 12, D), t["Y"].reshape(B, 1, 12)
    for f in (model_fn, fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D)):
        r = fed_icl.run_fed_icl(f, X1, Y1, t["xq"], m=S, rounds=1, slots=S)
        c = fed_icl.centralised(f, t["X"], t["Y"], t["xq"], m_total=S, slots=S)
        np.testing.assert_allclose(r.server[0], c, rtol=1e-6, atol=1e-6)
        assert np.abs(c).max() > 0


def test_aggregation_of_equal_answers_is_unchanged():
    """Property 2, and the aggregators on hand-made cases."""
    rng = np.random.default_rng(0)
    a = np.tile(rng.standard_normal(7), (4, 1))
    for method, w in (("mean", None), ("weighted", rng.random(4) + 0.1), ("weighted", rng.random((4, 7)) + 0.1)):
        np.testing.assert_allclose(fed_icl.aggregate(a, method, w), a[0], rtol=1e-12)
    ints = np.tile(np.array([3, 1, 4]), (5, 1))
    np.testing.assert_array_equal(fed_icl.aggregate(ints, "vote"), [3, 1, 4])
    votes = np.array([[1, 2], [1, 2], [2, 5], [3, 5]])
    np.testing.assert_array_equal(fed_icl.aggregate(votes, "vote"), [1, 2])  # majority; tie (2, 5) -> 2
    np.testing.assert_array_equal(fed_icl.aggregate(votes, "vote", np.array([1, 1, 3, 1.0])), [2, 5])
    np.testing.assert_allclose(fed_icl.aggregate(np.array([[1.0], [4.0]]), "weighted", np.array([3.0, 1.0])), [1.75])
    with pytest.raises(ValueError, match="fedicl_agg"):
        fed_icl.aggregate(a, "median")


def _vote_per_query(a, w=None):
    """The vote one query at a time: weighted counts of np.unique's values (NaNs grouped, sorted
    last), the first of the best in sorted order."""
    a = np.asarray(a)
    K = a.shape[0]
    w = np.ones(a.shape) if w is None else np.broadcast_to(
        np.asarray(w, np.float64).reshape((K,) + (1,) * (a.ndim - 1)) if np.ndim(w) == 1 else w, a.shape)
    out = np.empty(a.shape[1:], a.dtype)
    for b in np.ndindex(*a.shape[1:]):
        vals, inv = np.unique(a[(slice(None),) + b], return_inverse=True)
        out[b] = vals[np.argmax(np.bincount(inv.reshape(-1), weights=w[(slice(None),) + b]))]
    return out


def test_vote_equals_a_per_query_count():
    """The vectorised vote equals counting each query's answers one query at a time (weighted
    counts, ties to the smallest answer): random small-alphabet answers with many ties, integer
    and float answers, NaN answers, fractional weights of shape [K] or [K, B] (K up to 12, where
    the order the weights are added in decides near-ties), strings, K = 1, a 1-D input."""
    rng = np.random.default_rng(0)
    cases = []
    for K, shape in ((5, (40,)), (6, (7, 3)), (1, (4,)), (12, (300,)), (9, (200, 1))):
        ints = rng.integers(-2, 3, (K,) + shape)
        floats = np.where(rng.random(ints.shape) < 0.15, np.nan, ints / 2.0)
        for a in (ints, floats):
            cases += [(a, None), (a, rng.choice([0.1, 1 / 3, 0.7, 1.0], (K,) + shape)),
                      (a, rng.choice([0.1, 1 / 3, 0.2], K))]
    strings = np.array([["b", "a"], ["a", "c"], ["b", "c"], ["a", "a"]])
    cases += [(strings, None), (strings, np.array([1.0, 1.0, 2.0, 0.5])), (np.array([2.0, np.nan, 1.0]), None),
              (np.array([[1.0], [np.nan], [np.nan]]), None), (np.array([[1.0], [1.0], [np.nan]]), None)]
    for a, w in cases:
        got, want = fed_icl.aggregate(a, "vote", w), _vote_per_query(a, w)
        assert got.dtype == a.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    assert np.isnan(fed_icl.aggregate(np.array([[1.0], [np.nan], [np.nan]]), "vote")[0])
    assert fed_icl.aggregate(np.array([[1.0], [1.0], [np.nan]]), "vote")[0] == 1.0


def test_a_round_that_changes_nothing_is_a_fixed_point():
    """Property 3: an f that ignores the hint gives round 2 = round 1, so every later round is equal;
    with tol = 0 the run stops there."""
    t = _tasks()
    calls = []

    def f(X, Y, mask, xq, hint, has):
        calls.append(1)
        return fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D)(X, Y, mask, xq, hint, np.zeros_like(has))
    r = fed_icl.run_fed_icl(f, t["X"], t["Y"], t["xq"], m=3, rounds=6, slots=S, tol=-1.0)
    assert r.rounds_run == 6
    for s in r.server[1:]:
        np.testing.assert_array_equal(s, r.server[0])
    calls.clear()
    r2 = fed_icl.run_fed_icl(f, t["X"], t["Y"], t["xq"], m=3, rounds=6, slots=S)
    assert r2.rounds_run == 2 and len(calls) == 2 * 3
    np.testing.assert_array_equal(r2.server, r.server)
    # a learner that uses the hint, started at its own fixed point: a client answers the hint it
    # is given when there is one (else the Bayes answer); from init_B = a fixed answer a, every
    # round's clients and server return a exactly, and so does the broadcast
    a = np.linspace(-1.0, 1.0, t["xq"].shape[0])
    bayes = fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D)
    echo = lambda X, Y, mask, xq, hint, has: np.where(has > 0, hint, bayes(X, Y, mask, xq, hint, has))  # noqa: E731
    r5 = fed_icl.run_fed_icl(echo, t["X"], t["Y"], t["xq"], m=3, rounds=4, slots=S, tol=-1.0, init_B=a)
    for s in r5.server:
        np.testing.assert_array_equal(s, a)
    assert all(np.array_equal(msg["payload"]["answer"], a) for msg in r5.log if msg["sender"] == "server")
    # a learner that uses the hint keeps moving
    r3 = fed_icl.run_fed_icl(fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D), t["X"], t["Y"], t["xq"], m=3, rounds=3,
                             slots=S)
    assert r3.rounds_run == 3 and np.abs(r3.server[2] - r3.server[0]).max() > 1e-6
    # the ablation without the previous answer: nothing is broadcast but x_q, every round repeats round 1
    r4 = fed_icl.run_fed_icl(fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D), t["X"], t["Y"], t["xq"], m=3, rounds=3,
                             slots=S, include_prev_answer=False, tol=-1.0)
    assert all(msg["payload"]["answer"] is None for msg in r4.log if msg["sender"] == "server")
    np.testing.assert_array_equal(r4.server[2], r3.server[0])


def test_message_log_only_answers_travel():
    """Property 4: the server broadcasts only (x_q, ŷ); clients send back only answers (and their
    relevance weight); each client's model call sees only its own demonstrations."""
    t = _tasks(K=3, n=5)
    B, K = t["X"].shape[:2]
    f = fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D)
    for agg in ("mean", "weighted"):
        r = fed_icl.run_fed_icl(f, t["X"], t["Y"], t["xq"], m=3, rounds=3, slots=S, agg=agg, tol=-1.0)
        assert len(r.log) == 2 * K * 3
        for msg in r.log:
            if msg["sender"] == "server":
                assert set(msg["payload"]) == {"xq", "answer"} and msg["receiver"].startswith("client")
                np.testing.assert_array_equal(msg["payload"]["xq"], t["xq"])
                if msg["round"] == 0:
                    assert msg["payload"]["answer"] is None
                else:
                    np.testing.assert_array_equal(msg["payload"]["answer"], r.server[msg["round"] - 1])
            else:
                assert msg["receiver"] == "server"
                assert set(msg["payload"]) == ({"answer", "weight"} if agg == "weighted" else {"answer"})
                assert all(np.shape(v) == (B,) for v in msg["payload"].values())
        np.testing.assert_array_equal(r.clients[0][1], r.log[3]["payload"]["answer"])


def test_client_calls_see_only_their_own_rows():
    t = _tasks(K=3, n=5)
    B, K = t["X"].shape[:2]
    rows = []

    def f(X, Y, mask, xq, hint, has):
        rows.append([X[b][mask[b]] for b in range(B)])
        return np.zeros(B)
    fed_icl.run_fed_icl(f, t["X"], t["Y"], t["xq"], m=3, rounds=2, slots=S)
    for j, per_task in enumerate(rows):
        k = j % K
        for b, shown in enumerate(per_task):
            assert len(shown) == 3
            for x in shown:  # the row is client k's, and no other client's
                owners = [kk for kk in range(K) if np.any(np.all(np.isclose(t["X"][b, kk], x), axis=1))]
                assert owners == [k]


def test_knn_and_random_selection():
    rng = np.random.default_rng(0)
    X, Y, xq = rng.standard_normal((5, 9, D)), rng.standard_normal((5, 9)), rng.standard_normal((5, D))
    idx, Xs, Ys = fed_icl.select(X, Y, xq, 4)
    brute = np.argsort(np.linalg.norm(X - xq[:, None], axis=-1), axis=1)[:, :4]
    np.testing.assert_array_equal(idx, brute)
    np.testing.assert_array_equal(Xs, X[np.arange(5)[:, None], brute])
    np.testing.assert_array_equal(Ys, Y[np.arange(5)[:, None], brute])
    ridx, _, _ = fed_icl.select(X, Y, xq, 4, "random", np.random.default_rng(1))
    assert all(len(set(r.tolist())) == 4 for r in ridx)
    assert not np.array_equal(ridx, idx)
    with pytest.raises(ValueError, match="needs an rng"):
        fed_icl.select(X, Y, xq, 4, "random")
    with pytest.raises(ValueError, match="fedicl_select"):
        fed_icl.select(X, Y, xq, 4, "cosine")
    with pytest.raises(ValueError, match="slots"):
        fed_icl.pad_prompt(Xs, Ys, 3)


def test_bayes_learner_is_ridge_with_the_hint_as_a_demo():
    rng = np.random.default_rng(2)
    X, Y, xq = rng.standard_normal((1, 6, D)), rng.standard_normal((1, 6)), rng.standard_normal((1, D))
    mask = np.ones((1, 6), bool)
    noise, tau, pv = 0.2, 0.5, 0.3
    f = fed_icl.bayes_icl_fn(noise, tau, pv)
    A = np.concatenate([X[0] / noise, xq / tau, np.eye(D) / np.sqrt(pv)])
    b = np.concatenate([Y[0] / noise, [1.7 / tau], np.zeros(D)])
    w = np.linalg.lstsq(A, b, rcond=None)[0]
    np.testing.assert_allclose(f(X, Y, mask, xq, np.array([1.7]), np.array([True])), xq @ w, rtol=1e-10)
    # no hint = a hint with infinite noise; masked slots are ignored
    far = fed_icl.bayes_icl_fn(noise, 1e8, pv)(X, Y, mask, xq, np.array([1.7]), np.array([True]))
    np.testing.assert_allclose(f(X, Y, mask, xq, np.array([1.7]), np.array([False])), far, rtol=1e-6)
    m2 = mask.copy()
    m2[0, :2] = False
    np.testing.assert_allclose(f(X, Y, m2, xq, np.zeros(1), np.zeros(1, bool)),
                               f(X[:, 2:], Y[:, 2:], mask[:, 2:], xq, np.zeros(1), np.zeros(1, bool)))


def test_protocol_with_the_bayes_learner_improves_on_local():
    """With an ideal learner on non-IID clients, Fed-ICL's error falls over rounds, beats local-only
    and stays above centralised."""
    t = federated_tasks(np.random.default_rng(1), 300, 4, 12, D, offset=1.5, spread=0.5, noise=0.1)
    f = fed_icl.bayes_icl_fn(0.1, 0.3, 1 / D)
    r = fed_icl.run_fed_icl(f, t["X"], t["Y"], t["xq"], m=4, rounds=5, slots=16)
    err = ((r.server - t["yq"]) ** 2).mean(1)
    local = ((fed_icl.local_only(f, t["X"], t["Y"], t["xq"], m=4, slots=16) - t["yq"]) ** 2).mean()
    central = ((fed_icl.centralised(f, t["X"], t["Y"], t["xq"], m_total=16) - t["yq"]) ** 2).mean()
    assert err[-1] < err[0] < local and central < err[-1]


def test_regressor_ignores_padding(model_fn):
    """Empty slots (mask False) do not change the answer, whatever they hold."""
    t = _tasks(B=6, K=1, n=5)
    Xs, Ys = t["X"][:, 0], t["Y"][:, 0]
    X, Y, mask = fed_icl.pad_prompt(Xs, Ys, S)
    junk_X, junk_Y = X.copy(), Y.copy()
    junk_X[:, :S - 5] = 7.0
    junk_Y[:, :S - 5] = -3.0
    args = (t["xq"], np.full(6, 0.4), np.ones(6, bool))
    a = model_fn(X, Y, mask, *args)
    np.testing.assert_allclose(model_fn(junk_X, junk_Y, mask, *args), a, rtol=1e-5, atol=1e-6)
    assert np.abs(model_fn(X, Y, mask, t["xq"], np.full(6, -2.0), np.ones(6, bool)) - a).max() > 1e-4


def test_federated_training_prompts():
    """Training prompts pool r ∈ {1..K} clients and keep the r·m nearest demonstrations, last slots."""
    from icml_jax.data.icl_regression import federated_training_batch, training_batch
    b = federated_training_batch(np.random.default_rng(0), 64, 3, 5, 2, D, p_no_hint=0.5)
    n_demos = b["mask"].sum(1)
    assert set(n_demos.tolist()) == {2, 4, 6} and b["X"].shape == (64, 6, D)
    for i in range(64):  # filled slots are the last ones; empty ones are zero
        assert b["mask"][i, 6 - n_demos[i]:].all() and not b["X"][i, ~b["mask"][i]].any()
        d = np.linalg.norm(b["X"][i, b["mask"][i]] - b["xq"][i], axis=-1)
        assert np.all(np.diff(d) >= 0)  # nearest first
    assert 0.3 < b["has_hint"].mean() < 0.7 and not b["hint"][~b["has_hint"]].any()
    r = training_batch(np.random.default_rng(0), 32, 6, D)
    assert r["mask"].sum(1).min() >= 1 and not r["Y"][~r["mask"]].any()
