"""The jitted train step: gradient accumulation is exact; the schedule warms up and decays."""
import chex
import jax
import numpy as np

from icml_jax.config_utils import load_config
from icml_jax.tasks import TASKS
from icml_jax import sharding as mesh_lib
from icml_jax.train.optimizer import lr_schedule, make_optimizer
from icml_jax.train.trainer import create_sharded_state, make_train_step


def _batch(B, T, seed=0):
    r = np.random.RandomState(seed)
    x = r.randint(3, 259, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2:] = 2
    seg[0, -3:] = 0  # some padding, so token weighting matters
    pos = np.concatenate([np.arange(T // 2), np.arange(T - T // 2)])[None].repeat(B, 0)
    return dict(inputs=x[:, :-1], targets=x[:, 1:], segment_ids=seg, positions=pos.astype(np.int32))


def _run(accum, steps=3):
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.train.grad_accum = accum
    task = TASKS.get("lm")(c)
    tx = make_optimizer(c.train)
    mesh, rules = mesh_lib.make_mesh(c.mesh), mesh_lib.logical_rules(c.mesh)
    state, _ = create_sharded_state(task, tx, c, mesh, rules)
    schedule = lr_schedule(c.train)
    step = jax.jit(make_train_step(task, tx, accum, schedule))
    losses = []
    for i in range(steps):
        state, m = step(state, _batch(c.train.batch_size, c.data.seq_len, seed=i))
        losses.append(float(m["loss"]))
        np.testing.assert_allclose(float(m["lr"]), float(schedule(i)), rtol=1e-6)
    return state, losses


def test_gradient_accumulation_equals_one_big_batch():
    s1, l1 = _run(1)
    s4, l4 = _run(4)
    np.testing.assert_allclose(l1, l4, rtol=0, atol=1e-5)
    chex.assert_trees_all_close(s1.params, s4.params, atol=1e-5)
    assert int(s1.step) == int(s4.step) == 3
    assert l1[0] != l1[1]  # params really moved


def test_lr_schedule_warmup_then_cosine_to_floor():
    c = load_config("configs/lm.py:small").train
    s = lr_schedule(c)
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(c.warmup_steps)), c.lr, rtol=1e-6)
    np.testing.assert_allclose(float(s(c.steps)), c.lr * c.min_lr_ratio, rtol=1e-5)
    mid = float(s((c.warmup_steps + c.steps) // 2))
    assert c.lr * c.min_lr_ratio < mid < c.lr
