"""Collaborative decoding and its speculative drivers (Naive-CoS, CoS) give the same outputs."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from icml_jax.inference import collab

V = 6
COMBINERS = [collab.Combiner("we", weight_a=0.4), collab.Combiner("cd", alpha=0.3), collab.Combiner("target")]


def _tables(seed=0, V=V):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(V, V)) * 1.5, rng.normal(size=(V, V)) * 1.5


@pytest.mark.parametrize("combiner", COMBINERS, ids=lambda c: c.name)
def test_greedy_speculative_equals_greedy_collaborative(combiner):
    ta, tb = _tables(1, V=10)
    ref = collab.collaborative_decode([collab.TableLM(ta), collab.TableLM(tb)], [3], 40, combiner, temperature=0)
    for gamma, alternate in itertools.product((1, 3, 5), (False, True)):
        a, b = collab.TableLM(ta), collab.TableLM(tb)
        got = collab.speculative_decode([a, b], [3], 40, combiner, gamma=gamma, temperature=0, alternate=alternate)
        assert got == ref, (gamma, alternate)


def _exact_sequence_probs(combiner, ta, tb, first, n, temperature=1.0):
    """P(y_1..y_n) under ancestral sampling from r (tables: next logits depend on the last token)."""
    probs = {}
    for seq in itertools.product(range(V), repeat=n):
        p, prev = 1.0, first
        for y in seq:
            p *= combiner(ta[prev], tb[prev], temperature=temperature)[y]
            prev = y
        probs[seq] = p
    return probs


def _chi2_pvalue(sampler, exact, runs):
    counts = {k: 0 for k in exact}
    for s in range(runs):
        counts[tuple(sampler(s))] += 1
    keys = sorted(exact)
    obs = np.array([counts[k] for k in keys], float)
    exp = np.array([exact[k] for k in keys]) * runs
    big = exp >= 5  # pool the rare cells
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    return stats.chisquare(obs, exp).pvalue


@pytest.mark.parametrize("combiner", COMBINERS[:2], ids=lambda c: c.name)
def test_sampled_tokens_follow_r_and_a_wrong_rule_is_caught(combiner, monkeypatch):
    """T = 1, 3 tokens, V = 6: a chi-square test cannot tell CoS (and Naive-CoS) from ancestral
    sampling of r, and does tell an always-accept rule apart."""
    ta, tb = _tables(2)
    exact = _exact_sequence_probs(combiner, ta, tb, 0, 3)
    runs = 4000

    def run(alternate):
        return lambda s: collab.speculative_decode([collab.TableLM(ta), collab.TableLM(tb)], [0], 3, combiner,
                                                   gamma=2, temperature=1.0, alternate=alternate, seed=s)
    for alternate in (True, False):
        assert _chi2_pvalue(run(alternate), exact, runs) > 1e-3, alternate
    monkeypatch.setattr(collab, "_accept", lambda rng, r, q, x, greedy: True)
    assert _chi2_pvalue(run(True), exact, runs) < 1e-6
    monkeypatch.undo()  # the right acceptance, a wrong residual (resample from r after a rejection)
    monkeypatch.setattr(collab, "_residual", lambda r, q: np.asarray(r, np.float64))
    assert _chi2_pvalue(run(True), exact, runs) < 1e-6


def _np_softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("T", [0.6, 1.0, 1.7])
def test_combiners_are_the_reference_formulas(T):
    """Written out by hand, as the reference's ensemble sampler computes them: the weighted
    ensemble mixes each model's own tempered softmax (temperature before mixing, probabilities
    not logits), contrastive decoding tempers the contrast of the raw logits (expert minus alpha
    times amateur; no log-softmax, no plausibility mask), and n-model ensembles default to uniform."""
    rng = np.random.default_rng(11)
    la, lb, lc = (rng.normal(size=12) * 2 for _ in range(3))
    np.testing.assert_allclose(collab.Combiner("we", weight_a=0.3)(la, lb, temperature=T),
                               0.3 * _np_softmax(la / T) + 0.7 * _np_softmax(lb / T), rtol=1e-12)
    np.testing.assert_allclose(collab.Combiner("cd", alpha=0.4)(la, lb, temperature=T),
                               _np_softmax((lb - 0.4 * la) / T), rtol=1e-12)
    np.testing.assert_allclose(collab.Combiner("we")(la, lb, lc, temperature=T),
                               (_np_softmax(la / T) + _np_softmax(lb / T) + _np_softmax(lc / T)) / 3, rtol=1e-12)
    np.testing.assert_allclose(collab.Combiner("target")(la, lb, temperature=T), _np_softmax(lb / T), rtol=1e-12)
    if T != 1.0:  # tempering after mixing, or mixing logits, is another distribution
        mixed_after = _np_softmax(np.log(0.3 * _np_softmax(la) + 0.7 * _np_softmax(lb)) / T)
        assert np.abs(collab.Combiner("we", weight_a=0.3)(la, lb, temperature=T) - mixed_after).max() > 1e-3


def test_acceptance_rate_is_the_overlap_of_draft_and_target():
    """Spec property: one draft x ~ q is accepted with probability sum_x min(q(x), r(x)) (measured
    over 20,000 draws, within 4 standard errors), and for the weighted ensemble that is at least
    the drafter's weight (r >= weight_a * q)."""
    rng = np.random.default_rng(3)
    la, lb = rng.normal(size=8) * 2, rng.normal(size=8) * 2
    for comb in (collab.Combiner("we", weight_a=0.35), collab.Combiner("cd", alpha=0.5)):
        q, r = _np_softmax(la / 0.8), comb(la, lb, temperature=0.8)
        want = np.minimum(q, r).sum()
        draws = rng.choice(8, size=20000, p=q)
        got = np.mean([collab._accept(rng, r, q, int(x), greedy=False) for x in draws])
        assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / 20000) + 1e-9, (comb.name, got, want)
        if comb.name == "we":
            assert want >= 0.35


def test_the_drivers_acceptance_rate_is_the_overlap():
    """Through ``speculative_decode`` itself (fixed roles, one draft per round): with next-token
    tables that ignore the context, every draft is accepted with probability sum_x min(q, r);
    the run's accepted / drafted matches it within 4 standard errors, and for ``we`` it is at
    least the drafter's weight."""
    rng = np.random.default_rng(8)
    la, lb = rng.normal(size=V) * 1.5, rng.normal(size=V) * 1.5
    ta, tb = np.tile(la, (V, 1)), np.tile(lb, (V, 1))
    for comb in (collab.Combiner("we", weight_a=0.3), collab.Combiner("cd", alpha=0.5)):
        want = np.minimum(_np_softmax(la), comb(la, lb)).sum()
        st = {}
        collab.speculative_decode([collab.TableLM(ta), collab.TableLM(tb)], [0], 3000, comb, gamma=1,
                                  temperature=1.0, alternate=False, seed=1, stats=st)
        got = st["accepted"] / st["drafted"]
        assert abs(got - want) < 4 * np.sqrt(want * (1 - want) / st["drafted"]), (comb.name, got, want)
        if comb.name == "we":
            assert got > 0.3 - 4 * np.sqrt(0.21 / st["drafted"])


@pytest.mark.parametrize("combiner", COMBINERS[:2], ids=lambda c: c.name)
def test_sampled_tokens_follow_r_at_another_temperature(combiner):
    """T = 0.6: CoS's sampled sequences are still r's (chi-square over 3-token sequences, V = 6)."""
    ta, tb = _tables(4)
    exact = _exact_sequence_probs(combiner, ta, tb, 0, 3, temperature=0.6)
    run = lambda s: collab.speculative_decode([collab.TableLM(ta), collab.TableLM(tb)], [0], 3,  # noqa: E731
                                              combiner, gamma=2, temperature=0.6, seed=s)
    assert _chi2_pvalue(run, exact, 3000) > 1e-3


def test_edge_cases_and_counts():
    ta, tb = _tables(3)
    # r = q (all weight on the drafting model): every draft is accepted
    st = {}
    collab.speculative_decode([collab.TableLM(ta), collab.TableLM(tb)], [1], 30, collab.Combiner("we", weight_a=1.0),
                              gamma=3, temperature=1.0, alternate=False, stats=st)
    assert st["accepted"] == st["drafted"] > 0
    # cd with alpha 0 is model b alone
    r = collab.Combiner("cd", alpha=0.0)(ta[0], tb[0])
    np.testing.assert_allclose(r, collab.Combiner("target")(ta[0], tb[0]))
    # speculation calls the verifier less often than once per token
    a, b = collab.TableLM(ta), collab.TableLM(tb)
    collab.speculative_decode([a, b], [1], 30, collab.Combiner("we", weight_a=0.8), gamma=4, temperature=0)
    assert b.calls < 30 / 2
    with pytest.raises(ValueError, match="combiner"):
        collab.Combiner("mix")


@functools.lru_cache(maxsize=None)
def _tiny(seed, **model):
    """(model config, params) of the tiny decoder with ``model`` overrides, made once per module
    (read them, never change them in place)."""
    from icml_jax.config_utils import load_config
    from icml_jax.models.decoder import build_model
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.update(model)
    m = build_model(cfg)
    params = jax.jit(lambda k: jax.tree.map(lambda x: x * 4.0, m.init(k, jnp.zeros((1, 8), jnp.int32))["params"]))(
        jax.random.key(seed))
    return cfg, params


def test_flax_models_greedy_cos_equals_collaborative_and_rollback_is_exact():
    """Two decoders of different depth: greedy CoS equals greedy collaborative decoding; after a
    rollback the cache gives the logits of a cache that never saw the dropped tokens."""
    (ca, pa), (cb, pb) = _tiny(0, num_layers=1), _tiny(1, num_layers=2)
    # every model below is a fresh fork of these two: forks share the compiled steps
    a, b = collab.FlaxLM(ca, pa, 64), collab.FlaxLM(cb, pb, 64)
    comb = collab.Combiner("we", weight_a=0.5)
    ref = collab.collaborative_decode([a.fork(), b.fork()], [1, 5, 9], 16, comb, temperature=0)
    st = {}
    got = collab.speculative_decode([a.fork(), b.fork()], [1, 5, 9], 16, comb, gamma=3, temperature=0, stats=st)
    assert got == ref and st["rounds"] < 16
    lm, fresh = b.fork(), b.fork()
    lm.feed([1, 5, 9, 20, 30, 40])
    lm.rollback(4)
    got = lm.feed([7, 8])
    want = fresh.feed([1, 5, 9, 20, 7, 8])[-2:]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    from icml_jax import xla_env  # the cached step compiles through decode_jit, with its options
    assert list(lm._step.variants) == [tuple((xla_env.decode_compiler_options() or {}).items())]
    # the step donates its cache (updated in place): forks of a used model start from zeros and
    # agree with it, and the donated input is gone
    old = lm.cache
    lm.feed([3])
    kv = [x for path, x in jax.tree_util.tree_leaves_with_path(old) if path[-1].key in ("k", "v")]
    assert kv and all(x.is_deleted() for x in kv)
    f1, f2 = lm.fork(), lm.fork()
    np.testing.assert_array_equal(f1.feed([1, 5, 9, 20, 7, 8]), want_full := fresh.fork().feed([1, 5, 9, 20, 7, 8]))
    f2.feed([1, 5])
    np.testing.assert_array_equal(f2.feed([9, 20, 7, 8]), want_full[2:])
    # a failed call keeps a cache it did not consume (the next feed sees the whole context) and
    # resets the model when its cache was donated and lost
    step = f2._step

    def failing(params, cache, *a, consume=False):
        if consume:
            jax.tree.map(lambda x: x.delete(), cache)
        raise RuntimeError("boom")
    for consume in (False, True):
        f3 = lm.fork()
        f3.feed([1, 5, 9])
        f3._step = functools.partial(failing, consume=consume)
        with pytest.raises(RuntimeError, match="boom"):
            f3.feed([20])
        f3._step = step
        if consume:
            assert f3.length == 0 and f3.cache is None
            f3.feed([1, 5, 9])
        np.testing.assert_array_equal(f3.feed([20, 7, 8]), want_full[3:])


def test_draw_is_numpy_choice():
    """``_draw`` returns the index ``rng.choice(V, p=normalised p)`` returns, from the same random
    stream (so seeded runs keep their tokens), for unnormalised weights with zeros; weights numpy
    refuses (negative, infinite, NaN, all zero) raise."""
    g = np.random.default_rng(0)
    for trial in range(300):
        p = g.dirichlet(np.full(int(g.integers(2, 300)), 0.3)) * g.uniform(0.5, 2.0)
        p[g.integers(len(p))] = 0.0
        r1, r2 = np.random.default_rng(trial), np.random.default_rng(trial)
        assert [collab._draw(r1, p) for _ in range(4)] == [int(r2.choice(len(p), p=p / p.sum())) for _ in range(4)]
        assert r1.random() == r2.random()
    for bad in (np.zeros(4), np.array([0.5, -0.1, 0.6]), np.array([1.0, np.inf]), np.array([np.nan, 1.0])):
        with pytest.raises(ValueError, match="cannot sample"):
            collab._draw(g, bad)


def _three(seed=4, V=V):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(V, V)) * 1.5 for _ in range(3)]


def test_three_models_greedy_equals_collaborative_and_samples_follow_r():
    """n = 3 (weighted ensemble with explicit weights, and the last model alone): greedy CoS and
    Naive-CoS equal greedy collaborative decoding for several per-model draft lengths; at T = 1 a
    chi-square test cannot tell CoS from ancestral sampling of r; the big models are called less
    than once per token."""
    tabs = _three(V=10)
    for comb in (collab.Combiner("we", weights=(0.5, 0.3, 0.2)), collab.Combiner("target")):
        ref = collab.collaborative_decode([collab.TableLM(t) for t in tabs], [2], 40, comb, temperature=0)
        for gamma, alternate in itertools.product((3, (4, 2, 1), (1, 1, 1)), (True, False)):
            got = collab.speculative_decode([collab.TableLM(t) for t in tabs], [2], 40, comb, gamma=gamma,
                                            temperature=0, alternate=alternate)
            assert got == ref, (comb.name, gamma, alternate)
    tabs = _three()
    comb = collab.Combiner("we", weights=(0.5, 0.3, 0.2))
    exact = {}
    for seq in itertools.product(range(V), repeat=3):
        p, prev = 1.0, 0
        for y in seq:
            p *= comb(*(t[prev] for t in tabs))[y]
            prev = y
        exact[seq] = p
    run = lambda s: collab.speculative_decode([collab.TableLM(t) for t in tabs], [0], 3, comb,  # noqa: E731
                                              gamma=(2, 1, 1), temperature=1.0, seed=s)
    assert _chi2_pvalue(run, exact, 4000) > 1e-3
    models = [collab.TableLM(t) for t in tabs]
    collab.speculative_decode(models, [1], 30, collab.Combiner("we", weights=(0.8, 0.1, 0.1)), gamma=4,
                              temperature=0)
    assert models[1].calls < 30 / 2 and models[2].calls < 30 / 2
    with pytest.raises(ValueError, match="two models"):
        collab.Combiner("cd")(*tabs[0][:3])
    with pytest.raises(ValueError, match="weights"):
        collab.Combiner("we", weights=(0.5, 0.5))(*tabs[0][:3])
    with pytest.raises(ValueError, match="gamma"):
        collab.speculative_decode(models, [1], 3, comb, gamma=(2, 1))


def test_flax_lm_of_a_scanned_model_decodes_unrolled_with_the_same_logits():
    """A ``scan_layers`` model's FlaxLM runs its layers unrolled on the split params (its cache has
    per-layer entries, no stacked ``layers`` cache, so nothing copies a layer's cache each step) and
    gives the scanned model's full-forward logits."""
    from icml_jax.models.decoder import build_model
    cfg, params = _tiny(2, num_layers=2, scan_layers=True)
    assert "layers" in params
    lm = collab.FlaxLM(cfg, params, 64)
    got = lm.feed([1, 5, 9, 20])
    assert "layers" not in lm.params and {"layer_0", "layer_1"} <= set(lm.params)
    assert not any("layers" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(lm.cache))
    want = jax.jit(build_model(cfg).apply)({"params": params}, jnp.asarray([[1, 5, 9, 20]]))[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_flax_lm_refuses_an_evicting_kv_policy():
    """A policy cache keeps what it chose, which rollback by pointer cannot undo: a clear error."""
    import ml_collections
    cfg, params = _tiny(1, num_layers=2)  # the model of the rollback test, made once
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    cfg.kv_policy = dict(name="h2o", slots=16, window=4)
    with pytest.raises(ValueError, match="kv_policy.name='h2o'.*rollback"):
        collab.FlaxLM(cfg, params)
