"""EVIC (icml_jax/train/evic.py): the spec's property tests on a linear softmax model and on the
``sft`` task's tiny decoder, the sampler, and the refresh inside the train loop (schedule,
selection, exact resume)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from icml_jax.config_utils import load_config
from icml_jax.data import multidomain
from icml_jax.data.preference import SubsetIterator
from icml_jax.train import evic, trainer
from tests import jax_env
from tests.train.helpers import train_losses

B1, B2, EPS = 0.9, 0.95, 1e-8


def _softmax_loss(params, ex):
    logits = ex["x"] @ params["w"] + params["b"]
    return -jax.nn.log_softmax(logits)[ex["y"]]


def _linear(n=12, d=6, v=5, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(d, v)), jnp.float32) * 0.1,
              "b": jnp.zeros((v,), jnp.float32)}
    ex = {"x": jnp.asarray(rng.normal(size=(n, d)), jnp.float32),
          "y": jnp.asarray(rng.integers(0, v, n), jnp.int32)}
    return params, ex


def _stepped_adam_state(params, steps=3, seed=1):
    """An optax Adam state after a few random-gradient steps (non-zero moments, count 3)."""
    tx = optax.adam(1e-2, b1=B1, b2=B2, eps=EPS)
    st = tx.init(params)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        g = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        _, st = tx.update(g, st, params)
    return tx, st


def _exact_features(loss, params, ex, direction=None):
    """Per-example gradients one at a time (no vmap; one compiled gradient reused for every
    example), flattened: the reference for the sketch."""
    @jax.jit
    def one(example):
        g = jax.grad(loss)(params, example)
        return ravel_pytree(g)[0], ravel_pytree(direction(g) if direction else g)[0]

    n = jax.tree.leaves(ex)[0].shape[0]
    a, b = zip(*[one(jax.tree.map(lambda x: x[i], ex)) for i in range(n)])
    return np.stack(a), np.stack(b)


def test_adam_direction_is_optax_update_over_minus_lr():
    params, _ = _linear()
    tx, st = _stepped_adam_state(params)
    g = jax.tree.map(lambda p: jnp.full(p.shape, 0.3) + jnp.arange(p.size).reshape(p.shape) * 0.01,
                     params)
    updates, _ = tx.update(g, st, params)
    got = evic.adam_direction(g, evic.adam_state(st), B1, B2, EPS)
    for u, d in zip(jax.tree.leaves(updates), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(u) / -1e-2, np.asarray(d), rtol=1e-5, atol=1e-6)
    # the state is found inside a chain (clip + adamw, as make_optimizer builds it)
    chain = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1))
    assert isinstance(evic.adam_state(chain.init(params)), optax.ScaleByAdamState)
    with pytest.raises(ValueError, match="precond='sgd'"):
        evic.adam_state(optax.sgd(0.1).init(params))


def test_sgd_symmetric_adam_asymmetric_and_exact_without_projection():
    params, ex = _linear()
    none = evic.make_sketch(params, "none")
    a, b = evic.features(_softmax_loss, params, ex, none, chunk=5)  # 12 = 5 + 5 + 2 (padding)
    ea, eb = _exact_features(_softmax_loss, params, ex)
    np.testing.assert_allclose(a, ea, rtol=1e-5, atol=1e-6)
    sgd = np.asarray(evic.interactions(a, b))
    np.testing.assert_allclose(sgd, sgd.T, rtol=1e-5, atol=1e-6)
    assert (np.diag(sgd) >= 0).all()

    _, st = _stepped_adam_state(params)
    direction = lambda g: evic.adam_direction(g, evic.adam_state(st), B1, B2, EPS)  # noqa: E731
    a, b = evic.features(_softmax_loss, params, ex, none, direction=direction, chunk=4)
    ea, eb = _exact_features(_softmax_loss, params, ex, direction)
    np.testing.assert_allclose(np.asarray(b), eb, rtol=1e-4, atol=1e-5)
    adam = np.asarray(evic.interactions(a, b))
    assert np.abs(adam - adam.T).max() > 1e-2 * np.abs(adam).max()
    np.testing.assert_allclose(np.asarray(evic.influence(a, b)), adam.sum(0), rtol=1e-4, atol=1e-5)


def _sketched_interactions(params, ex, kind, k, seeds):
    """Int under the ``kind`` sketch of width ``k``, one matrix per seed: the seeds' random tables
    are a vmapped argument, so all of them run in one compiled program."""
    tables = jax.tree.map(lambda *t: jnp.stack(t),
                          *[evic.make_sketch(params, kind, k, seed=s).tables for s in seeds])

    def one(t):
        return evic.interactions(*evic.features(_softmax_loss, params, ex, evic.Sketch(kind, k, t)))
    return np.asarray(jax.jit(jax.vmap(one))(tables))


def test_sketch_error_shrinks_with_k():
    params, ex = _linear(n=10, d=40, v=25)  # 1,025 parameters
    exact = np.asarray(jax.jit(lambda p, e: evic.interactions(
        *evic.features(_softmax_loss, p, e, evic.make_sketch(params, "none"))))(params, ex))
    for kind in ("rademacher", "countsketch"):
        errs = {k: float(np.mean([np.linalg.norm(m - exact) / np.linalg.norm(exact) for m in
                                  _sketched_interactions(params, ex, kind, k, range(4))]))
                for k in (16, 1024)}
        assert errs[1024] < errs[16] / 3, (kind, errs)  # JL: error ~ 1/sqrt(k), so ~8x here
        assert errs[1024] < 0.15, (kind, errs)


def test_duplicates_and_flipped_twin():
    params, ex = _linear(n=4)
    x = ex["x"].at[1].set(ex["x"][0]).at[2].set(ex["x"][0])
    y = ex["y"].at[1].set(ex["y"][0]).at[2].set((ex["y"][0] + 1) % 5)  # 1: duplicate, 2: flipped
    ex = {"x": x, "y": y}
    _, st = _stepped_adam_state(params)
    for direction in (None, lambda g: evic.adam_direction(g, evic.adam_state(st), B1, B2, EPS)):
        a, b = evic.features(_softmax_loss, params, ex, evic.make_sketch(params, "none"),
                             direction=direction)
        m = np.asarray(evic.interactions(a, b))
        np.testing.assert_allclose(m[0], m[1], rtol=1e-6)
        np.testing.assert_allclose(m[:, 0], m[:, 1], rtol=1e-6)
        assert m[0, 2] < 0 and m[2, 0] < 0, m


def test_selection_is_positive_column_sums_and_eta_free():
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.normal(size=(30, 8)), jnp.float32) for _ in range(2))
    want = np.asarray(evic.interactions(a, b)).sum(0) > 0
    for eta in (1e-4, 1.0, 37.0):
        np.testing.assert_array_equal(evic.select(np.asarray(evic.influence(a, b, eta))), want)
    top = evic.select(np.arange(10.0)[::-1], "top", 0.25)
    np.testing.assert_array_equal(np.flatnonzero(top), [0, 1, 2])  # ceil(2.5) largest
    with pytest.raises(ValueError, match="config.evic.select"):
        evic.select(np.ones(3), "bogus")


def test_subset_iterator_draws_only_the_selection_and_resumes():
    arrays = {"inputs": np.arange(20)[:, None].repeat(3, 1)}
    it = SubsetIterator(arrays, 4, seed=3, process_index=0, process_count=1)
    first = np.concatenate([next(it)["inputs"][:, 0] for _ in range(5)])
    assert sorted(first) == list(range(20))  # one epoch = every row once
    mask = np.zeros(20, bool)
    mask[[2, 5, 11]] = True
    it.select(mask, round_id=1)
    drawn = np.concatenate([next(it)["inputs"][:, 0] for _ in range(3)])
    assert set(drawn) == {2, 5, 11} and np.bincount(drawn, minlength=20)[[2, 5, 11]].tolist() == [4] * 3
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it)["inputs"][:, 0].tolist() for _ in range(3)]
    again = SubsetIterator(arrays, 4, seed=3, process_index=0, process_count=1)
    again.set_state(state)
    assert [next(again)["inputs"][:, 0].tolist() for _ in range(3)] == want
    with pytest.raises(ValueError, match="at least one row"):
        it.select(np.zeros(20, bool), 2)


# ------------------------------------------------------------------------------ in the loop


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("evic") / "train.jsonl"
    with open(path, "w") as f:
        for r in multidomain.make_rows(16, 0, corrupt_frac=0.25):
            f.write(json.dumps(r) + "\n")
    return str(path)


def _config(data, **evic_over):
    c = load_config("configs/sft.py:tiny", unlocked=True)
    c.data.path = data
    c.train.checkpoint_steps = (5,)
    c.train.keep_checkpoints = 5
    c.evic.update(dict(enabled=True, every=4, start=2, proj="countsketch", proj_dim=256,
                       select="top", top_fraction=0.25), **evic_over)
    return c


def _rounds(workdir):
    folder = os.path.join(workdir, "evic")
    return {int(n[6:13]): dict(np.load(os.path.join(folder, n))) for n in sorted(os.listdir(folder))
            if n.endswith(".npz")}


def test_refresh_schedule_selection_and_exact_resume(tmp_path, sft_data):
    ref = str(tmp_path / "ref")
    with jax_env.caching_every_compilation():  # the resume below reads the same programs
        trainer.train(_config(sft_data), ref)
    rounds = _rounds(ref)
    assert sorted(rounds) == [2, 6, 10]  # start=2, every=4, steps=12
    n = len(rounds[2]["mask"])
    assert n == 48
    for r in rounds.values():
        assert r["mask"].sum() == 12  # top 25% of 48
        np.testing.assert_array_equal(r["mask"], evic.select(r["influence"], "top", 0.25))
        np.testing.assert_allclose(r["interactions"].sum(0), r["influence"], rtol=1e-3, atol=1e-4)
    lines = [json.loads(x) for x in open(os.path.join(ref, "metrics.jsonl"))]
    assert [x["step"] for x in lines if "evic/selected" in x] == [2, 6, 10]
    assert all(x["evic/selected"] == 0.25 for x in lines if "evic/selected" in x)

    # a run killed after step 7 restarts from checkpoint 5 (mid-round: the selection comes from
    # the sampler's saved state) and recomputes the refresh of step 10 from the restored state
    killed = str(tmp_path / "killed")
    shutil.copytree(ref, killed)
    for s in os.listdir(os.path.join(killed, "checkpoints")):
        if s.isdigit() and int(s) > 5:
            shutil.rmtree(os.path.join(killed, "checkpoints", s))
    shutil.rmtree(os.path.join(killed, "evic"))
    with jax_env.caching_every_compilation():
        trainer.train(_config(sft_data), killed)
    want, got = train_losses(ref), train_losses(killed)
    assert sorted(got) == list(range(1, 13))
    assert max(abs(got[s] - want[s]) for s in range(6, 13)) <= 1e-6
    again = _rounds(killed)
    assert sorted(again) == [6, 10]
    np.testing.assert_array_equal(again[10]["mask"], rounds[10]["mask"])


def test_bad_settings_fail_before_compute(tmp_path, sft_data):
    with pytest.raises(ValueError, match="config.evic.proj must be one of"):
        trainer.train(_config(sft_data, proj="gaussian"), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="config.evic.every must be >= 1"):
        trainer.train(_config(sft_data, every=0), str(tmp_path / "b"))
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.evic = _config(sft_data).evic
    with pytest.raises(ValueError, match="needs a task with per-example losses"):
        trainer.train(c, str(tmp_path / "c"))
    assert not os.path.exists(str(tmp_path / "c" / "checkpoints"))


def test_first_refresh_defaults_to_one_interval_of_warm_up(sft_data, tmp_path):
    """``config.evic.start`` -1 (the default) is ``every``: the first selection comes after a
    warm-up interval, not at step 0 where the Adam moments are zero; below -1 is an error."""
    c = load_config("configs/sft.py:tiny", unlocked=True)
    c.evic.update(enabled=True, every=7)
    assert evic.settings(c)["start"] == 7
    c.evic.start = 3
    assert evic.settings(c)["start"] == 3
    with pytest.raises(ValueError, match="config.evic.start must be >= 0"):
        trainer.train(_config(sft_data, start=-2), str(tmp_path / "a"))
    c.evic.start = -1
    c.evic.every = 200  # the default interval in a 12-step run: no refresh would ever run
    with pytest.raises(ValueError, match="no refresh would run"):
        evic.settings(c)
