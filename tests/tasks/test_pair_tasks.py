"""The reward_model and preference tasks end to end on a tiny SFT policy and synthetic pairs."""
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from icml_jax.config_utils import load_config, mesh_shape
from icml_jax.data.preference import write_preference_jsonl
from icml_jax.losses import bsr_penalty, response_token_logps
from icml_jax.tasks import TASKS
from icml_jax.train.checkpoint import restore_model_params
from icml_jax.train.trainer import build_task, train_and_evaluate

from tests.tasks.helpers import synthetic_pairs as _pairs

# every test reads the module's SFT run (the `setup` fixture): one xdist worker builds it once
pytestmark = pytest.mark.xdist_group("pair_tasks_sft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    train, val = str(root / "train.jsonl"), str(root / "val.jsonl")
    write_preference_jsonl(train, _pairs(64, 0))
    write_preference_jsonl(val, _pairs(16, 1))
    sft = str(root / "sft")
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.train.steps, c.train.samples, c.train.eval_every, c.train.checkpoint_every = 10, 0, 10, 10
    train_and_evaluate(c, sft)
    return dict(root=root, train=train, val=val, sft=sft)


def _task(c):
    """``c.task``'s task with the context the trainer hands it (shard count, params reader)."""
    return build_task(c, mesh_shape(c.mesh, jax.device_count()))


def _config(name, s, **loss):
    c = load_config(f"configs/{name}.py:tiny", unlocked=True)
    c.data.path, c.data.eval_path, c.train.init_from = s["train"], s["val"], s["sft"]
    for k, v in loss.items():
        c.loss[k] = v
    return c


def _batch(task, n=8):
    it = task.train_iterator(seed=0)
    return jax.tree.map(jnp.asarray, next(it))


def _sgd_moves_and_learns(task, steps=12, lr=3e-3):
    """(per-step losses, largest parameter change) of ``steps`` Adam steps on one batch from the
    SFT params; the whole loop is one compiled program (a scan), so it compiles once."""
    params, _ = restore_model_params(task.config.train.init_from, task.config.model)
    tx = optax.adam(lr)

    @jax.jit
    def run(p0, b):
        def step(carry, _):
            p, o = carry
            (ls, n), g = jax.value_and_grad(lambda q: task.loss(q, b)[:2], has_aux=True)(p)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), ls / n

        (p, _), losses = jax.lax.scan(step, (p0, tx.init(p0)), length=steps)
        moved = jnp.max(jnp.stack([jnp.max(jnp.abs(a - a0)) for a, a0 in
                                   zip(jax.tree.leaves(p), jax.tree.leaves(p0))]))
        return losses, moved

    losses, moved = run(params, _batch(task))
    return np.asarray(losses).tolist(), float(moved)


def test_reward_model_trains_and_initialises_from_sft(setup, tmp_path):
    c = _config("reward_model", setup)
    c.train.steps, c.train.lr = 30, 1e-2
    out = train_and_evaluate(c, str(tmp_path / "rm"))
    assert out["eval_accuracy"] > 0.9, out  # the easy preference is learnt
    assert "eval_perplexity" not in out and "eval_hidden_norm/std" in out
    # init_from put the SFT decoder into the backbone: step-0 backbone == SFT params
    task = _task(c)
    sft, _ = restore_model_params(setup["sft"], c.model)
    from icml_jax.train.trainer import _init_from, create_sharded_state
    from icml_jax import sharding as mesh_lib
    from icml_jax.train.optimizer import make_optimizer
    tx = make_optimizer(c.train)
    mesh = mesh_lib.make_mesh(c.mesh)
    state, shard = create_sharded_state(task, tx, c, mesh, mesh_lib.logical_rules(c.mesh))
    params = _init_from(task, setup["sft"], state.params, shard.params)
    jax.tree.map(np.testing.assert_array_equal, params["backbone"], sft)
    assert params["score"].shape == (c.model.d_model, 1)


def test_reward_model_bsr_is_per_shard(setup):
    c = _config("reward_model", setup, bsr_lambda=0.05)
    task = _task(c)
    b = _batch(task)
    task.num_shards = 2  # as if the 8 rows sat on 2 data shards

    @jax.jit
    def loss_and_rewards(b):
        params = nn.meta.unbox(task.init_params(jax.random.key(0), b))
        r, _ = task.apply(params, b["inputs"].reshape(16, -1), b["positions"].reshape(16, -1),
                          b["segment_ids"].reshape(16, -1), b["lengths"].reshape(16))
        return task.loss(params, b), r.reshape(8, 2)

    (lsum, n, m), r = loss_and_rewards(b)
    want = bsr_penalty(r[:, 0], r[:, 1], bsr_lambda=0.05, num_shards=2, per_device_batch=4)
    np.testing.assert_allclose(m["loss/bsr"] / n, want, rtol=1e-5)
    glob = bsr_penalty(r[:, 0], r[:, 1], bsr_lambda=0.05, reduce="global", per_device_batch=4)
    assert abs(float(want) - float(glob)) > 1e-9  # the two shards' means differ


def test_cached_reference_logps_equal_recomputed(setup):
    task = _task(_config("dpo", setup))
    ref, _ = restore_model_params(setup["sft"], task.config.model)

    @jax.jit
    def token_logps(t, positions, segment_ids, response_mask):
        logits = task.model.apply({"params": ref}, t, positions, segment_ids)
        return response_token_logps(logits, t, response_mask)

    for arrays in (task.train_arrays, task.eval_arrays):
        t = arrays["inputs"].reshape(-1, arrays["inputs"].shape[-1])
        f = lambda k: arrays[k].reshape(t.shape)  # noqa: E731
        want = token_logps(t, f("positions"), f("segment_ids"), f("response_mask"))
        np.testing.assert_allclose(arrays["ref_logps"].reshape(t.shape), want, rtol=1e-5, atol=1e-6)
        assert np.all(arrays["ref_logps"][arrays["response_mask"] == 0] == 0)
        assert np.any(arrays["ref_logps"] < 0)
    b = _batch(task)
    assert b["ref_logps"].shape == b["inputs"].shape


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo"])
def test_each_dpo_loss_type_trains_the_policy(setup, loss_type):
    extra = {"label_smoothing": 0.1} if loss_type == "robust" else {}
    task = _task(_config("dpo", setup, type=loss_type, **extra))
    losses, moved = _sgd_moves_and_learns(task)
    assert moved > 1e-4
    assert losses[-1] < losses[0] - 1e-3, losses


def test_gradients_reach_only_the_policy(setup):
    task = _task(_config("dpo", setup))
    params, _ = restore_model_params(setup["sft"], task.config.model)
    b = _batch(task)

    @jax.jit
    def grads(params, b):  # of the loss sum w.r.t. the cached reference log-probs, and the policy
        g_ref = jax.grad(lambda r: task.loss(params, {**b, "ref_logps": r})[0])(b["ref_logps"])
        return g_ref, jax.grad(lambda p: task.loss(p, b)[0])(params)

    g_ref, g = grads(params, b)
    assert np.all(np.asarray(g_ref) == 0)
    assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)) > 0


def test_dpo_then_tgdpo_end_to_end(setup, tmp_path):
    dpo_dir = str(tmp_path / "dpo")
    c = _config("dpo", setup)
    c.train.steps = 10
    out = train_and_evaluate(c, dpo_dir)
    assert np.isfinite(out["eval_loss"]) and "eval_rewards/accuracies" in out
    # TGDPO guided by that DPO policy; alpha = 0 gives DPO's loss on the same batch
    tg = _task(_config("dpo", setup, type="tgdpo", guidance=dpo_dir))
    dpo = _task(_config("dpo", setup))
    params, _ = restore_model_params(setup["sft"], c.model)
    b = _batch(tg)
    assert np.any(np.asarray(b["guide_logps"]) != np.asarray(b["ref_logps"]))
    tg.config.loss.tgdpo_alpha = 0.0  # read when the losses are traced, below

    @jax.jit
    def tgdpo_and_dpo_losses(p, b):
        return tg.loss(p, b)[0], dpo.loss(p, {k: v for k, v in b.items() if k != "guide_logps"})[0]

    l0, ld = tgdpo_and_dpo_losses(params, b)
    np.testing.assert_allclose(l0, ld, rtol=1e-6)
    tg.config.loss.tgdpo_alpha = 0.5
    losses, moved = _sgd_moves_and_learns(tg)
    assert moved > 1e-4 and losses[-1] < losses[0]


def test_every_task_batch_uses_one_key_vocabulary(setup):
    """``inputs``/``positions``/``segment_ids`` in every batch (tasks/base.py); only LM rows have
    ``targets``; the dummy batch (init, tracing) has the real batch's keys."""
    for name, t in (("lm", _task(load_config("configs/lm.py:tiny"))),
                    ("reward_model", _task(_config("reward_model", setup))),
                    ("dpo", _task(_config("dpo", setup)))):
        real = next(t.train_iterator(seed=0))
        dummy = t.dummy_batch(2, real["inputs"].shape[-1])
        assert set(dummy) == set(real), name
        assert {"inputs", "positions", "segment_ids"} <= set(real) and "tokens" not in real, name
        assert real["inputs"].shape == real["positions"].shape == real["segment_ids"].shape, name
        assert ("targets" in real) == (name == "lm"), name


def test_errors(setup):
    with pytest.raises(ValueError, match="needs a frozen reference"):
        c = _config("dpo", setup)
        c.train.init_from = ""
        _task(c)
    with pytest.raises(ValueError, match="config.loss.guidance"):
        _task(_config("dpo", setup, type="tgdpo"))
    with pytest.raises(ValueError, match="unknown config.loss.type"):
        _task(_config("dpo", setup, type="kto"))
    with pytest.raises(ValueError, match="config.loss.reference=.*no checkpoints"):
        _task(_config("dpo", setup, reference=str(setup["root"])))
    with pytest.raises(ValueError, match=r"needs tasks\.TaskContext\(restore_params=\.\.\.\)"):
        TASKS.get("preference")(_config("dpo", setup))  # built without the loop's context
    c = _config("reward_model", setup)
    c.data.name = "shakespeare"
    with pytest.raises(ValueError, match="preference_jsonl"):
        _task(c)
    with pytest.raises(ValueError, match="config.loss.variant"):
        _task(_config("reward_model", setup, variant="bogus"))


def test_implicit_prm_ce_task(setup, tmp_path):
    from icml_jax.data.preference import write_unpaired_jsonl
    rows = [{"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in _pairs(32, 3) for k in ("chosen", "rejected")]
    path = str(tmp_path / "labelled.jsonl")
    write_unpaired_jsonl(path, rows)
    c = load_config("configs/implicit_prm.py:tiny", unlocked=True)
    c.data.path, c.train.init_from = path, setup["sft"]
    task = _task(c)
    assert task.train_arrays["label"].tolist() == [1.0, 0.0] * 32
    b = _batch(task)
    params, _ = restore_model_params(setup["sft"], c.model)

    @jax.jit
    def loss_and_ref_grad(params, b):
        g = jax.grad(lambda r: task.loss(params, {**b, "ref_logps": r})[0])(b["ref_logps"])
        return task.loss(params, b), g

    (lsum, n, m), g = loss_and_ref_grad(params, b)
    # pi = ref at the start: every reward is 0 and the CE loss is log 2
    np.testing.assert_allclose(lsum / n, np.log(2), rtol=1e-5)
    # the cached reference is frozen
    assert np.all(np.asarray(g) == 0)
    losses, moved = _sgd_moves_and_learns(task, lr=3e-3)
    assert moved > 1e-4 and losses[-1] < losses[0] - 1e-3, losses
    with pytest.raises(ValueError, match="config.loss.beta"):
        c2 = c.copy_and_resolve_references()
        c2.loss.beta = 0.0
        _task(c2)


def test_frozen_logps_are_kept_on_disk_reused_and_invalidated(setup, monkeypatch, tmp_path):
    """A second task over the same reference and data reads WORKDIR/frozen_logps instead of
    scoring again, with the same arrays; other data or other params score again."""
    from icml_jax import tasks
    from icml_jax.tasks import pairs
    calls = []
    real = pairs.batched_apply
    monkeypatch.setattr(pairs, "batched_apply", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = _config("dpo", setup)
    first = _task(c)  # computes, or reads what an earlier test of this module left
    files = os.listdir(os.path.join(setup["sft"], "frozen_logps"))
    calls.clear()
    again = _task(c)
    assert not calls, "the second task recomputed the reference log-probs"
    np.testing.assert_array_equal(again.train_arrays["ref_logps"], first.train_arrays["ref_logps"])
    shutil.rmtree(os.path.join(setup["sft"], "frozen_logps"))  # forced recompute: equal
    np.testing.assert_array_equal(_task(c).eval_arrays["ref_logps"], first.eval_arrays["ref_logps"])
    kept = os.listdir(os.path.join(setup["sft"], "frozen_logps"))
    assert calls and len(kept) == 1 and set(kept) <= set(files)  # the same fingerprint again
    calls.clear()
    other = str(tmp_path / "other.jsonl")
    write_preference_jsonl(other, _pairs(64, 7))  # another dataset
    c2 = _config("dpo", setup)
    c2.data.path = other
    _task(c2)
    assert calls and len(os.listdir(os.path.join(setup["sft"], "frozen_logps"))) == 2
    calls.clear()
    ref, _ = restore_model_params(setup["sft"], c.model)
    moved = jax.tree.map(lambda x: x + 1e-3, ref)  # another checkpoint of the same model
    ctx = tasks.TaskContext(num_shards=1, restore_params=lambda wd, m: moved)
    task = tasks.TASKS.get("preference")(c, ctx)
    assert calls and not np.array_equal(task.train_arrays["ref_logps"], first.train_arrays["ref_logps"])


def test_processes_read_the_frozen_logps_cache_only_together(monkeypatch):
    """Multi-process runs (the gather faked for a second process): the file is read only when
    every process can read it, and processes with different fingerprints stop with an error."""
    from jax.experimental import multihost_utils
    from icml_jax.tasks import pairs
    mine, theirs = "ab" * 16, []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x: np.stack([x, theirs[0]]))

    def other(fingerprint, readable):
        theirs[:] = [np.frombuffer(bytes.fromhex(fingerprint) + bytes([readable]), np.uint8)]

    other(mine, True)
    assert pairs._everyone_can_read(mine, True, "config.loss.reference", "sft")
    assert not pairs._everyone_can_read(mine, False, "config.loss.reference", "sft")
    other(mine, False)
    assert not pairs._everyone_can_read(mine, True, "config.loss.reference", "sft")
    other("cd" * 16, True)
    with pytest.raises(ValueError, match="config.loss.reference='sft': the processes disagree"):
        pairs._everyone_can_read(mine, True, "config.loss.reference", "sft")
