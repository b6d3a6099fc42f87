"""The ``gkd`` task (Puzzle's global distillation): its losses against numpy, zero loss for a
child equal to its parent, the LM term, a short distillation of a heterogeneous child through the
trainer and the config checks."""
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.compress import puzzle_blocks
from icml_jax.config_utils import load_config
from icml_jax.losses.distill import cosine_distance, gkd_loss, kl_parent_child
from icml_jax.models import build_model
from icml_jax.tasks import TaskContext
from icml_jax.tasks.gkd import GKDTask
from icml_jax.train import trainer
from tests.tasks.helpers import restore_params, tiny_lm_run
from tests.train.helpers import train_in_process

pytestmark = pytest.mark.xdist_group("gkd_task")

CHILD = {"attention": "1,linear", "ffn": "noop,32"}


@pytest.fixture(scope="module")
def parent(tmp_path_factory, session_tfds_dir):
    """A configs/lm.py:tiny run of 4 steps (the parent every test here distils from)."""
    return tiny_lm_run(str(tmp_path_factory.mktemp("gkd") / "parent"), session_tfds_dir)


def _config(teacher, tfds_dir, blocks=None, **gkd):
    c = load_config("configs/gkd.py:tiny", unlocked=True)
    c.gkd.teacher = teacher
    c.gkd.update(gkd)
    c.data.data_dir = tfds_dir
    if blocks:
        c.model.blocks.update(blocks)
    return c


def _mean(fn, params, batches):
    """{metric: mean per valid token} of ``fn(params, batch)`` over ``batches``."""
    tot = None
    for b in batches:
        lsum, n, m = jax.device_get(fn(params, b))
        row = {"loss": lsum, "n": n, **m}
        tot = row if tot is None else {k: tot[k] + row[k] for k in tot}
    return {k: float(v) / float(tot["n"]) for k, v in tot.items() if k != "n"}


# ------------------------------------------------------------------ the losses alone


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_losses_equal_a_direct_numpy_computation():
    rng = np.random.default_rng(0)
    B, L, T, D, V = 2, 3, 5, 8, 11
    hp, hc = rng.normal(size=(2, B, L, T, D)).astype(np.float32)
    zp, zc = (3 * rng.normal(size=(2, B, T, V))).astype(np.float32)
    y = rng.integers(0, V, (B, T))
    w = (rng.random((B, T)) < 0.7).astype(np.float32)
    cos = (hp * hc).sum(-1) / np.linalg.norm(hp, axis=-1) / np.linalg.norm(hc, axis=-1)  # [B, L, T]
    cos_ref = ((1 - cos).sum(1) * w).sum()
    lp, lq = _np_log_softmax(zp.astype(np.float64)), _np_log_softmax(zc.astype(np.float64))
    kl_ref = ((np.exp(lp) * (lp - lq)).sum(-1) * w).sum()
    ce_ref = (-np.take_along_axis(lq, y[..., None], -1)[..., 0] * w).sum()
    acc_ref = ((zc.argmax(-1) == y) * w).sum()
    np.testing.assert_allclose(cosine_distance(hp, hc, w), cos_ref, rtol=1e-5)
    np.testing.assert_allclose(kl_parent_child(zp, zc, w), kl_ref, rtol=1e-5)
    total, n, m = gkd_loss(zc, hc, zp, hp, y, w, cosine_weight=0.5, kl_weight=2.0)
    np.testing.assert_allclose(total, 0.5 * cos_ref + 2 * kl_ref, rtol=1e-5)
    assert float(n) == w.sum()
    np.testing.assert_allclose([m["cosine"], m["kl"], m["ce"]], [cos_ref, kl_ref, ce_ref], rtol=1e-5)
    assert float(m["accuracy"]) == acc_ref
    # the LM term adds exactly lm_weight * CE (and nothing else changes)
    with_lm, _, m2 = gkd_loss(zc, hc, zp, hp, y, w, cosine_weight=0.5, kl_weight=2.0, lm_weight=0.3)
    np.testing.assert_allclose(with_lm - total, 0.3 * m["ce"], rtol=1e-5)
    assert jax.tree.map(float, m2) == jax.tree.map(float, m)
    # the KL's gradient is zero where the child equals the parent; bf16 inputs are upcast
    g = jax.grad(lambda z: kl_parent_child(zp, z, w))(jnp.asarray(zp))
    np.testing.assert_allclose(g, 0, atol=1e-6)
    np.testing.assert_allclose(cosine_distance(jnp.asarray(hp, jnp.bfloat16), jnp.asarray(hp, jnp.bfloat16), w),
                               0, atol=1e-4)


# ------------------------------------------------------------------ the task


def test_a_child_equal_to_its_parent_has_zero_loss_and_batches_resume(parent, session_tfds_dir):
    task = GKDTask(_config(parent, session_tfds_dir), TaskContext(restore_params=restore_params))
    params = task.teacher_params
    it = task.train_iterator(seed=0)
    state = it.get_state()
    batch = next(it)
    assert batch["teacher_logits"].shape == (8, 32, 384)
    assert batch["teacher_hidden"].shape == (8, 2, 32, 32)
    it.set_state(state)  # the wrapper's position is the rows': the same batch again
    again = next(it)
    for k in batch:
        np.testing.assert_array_equal(np.asarray(batch[k]), np.asarray(again[k]))
    out = _mean(jax.jit(task.loss), params, [batch] + task.eval_batches())
    assert out["loss"] < 1e-6 and out["kl"] < 1e-6 and out["cosine"] < 1e-6
    assert out["ce"] > 1.0  # the CE is still the parent's own
    # lm_weight > 0 through the task: exactly lm_weight * CE more
    task.weights["lm_weight"] = 0.25
    with_lm = _mean(jax.jit(task.loss), params, [batch])
    np.testing.assert_allclose(with_lm["loss"], with_lm["cosine"] + with_lm["kl"] + 0.25 * with_lm["ce"],
                               rtol=1e-6)


def _assemble_child(parent_params, child_cfg):
    """The child's params from the parent's (Puzzle's initialisation): layer 0 keeps one KV head
    (mean of the parent's), layer 1's FFN its 32 channels of largest |W_down| rows, linear maps
    keep their fresh init, everything else is the parent's."""
    init = build_model(child_cfg).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))["params"]
    child = jax.device_get(nn.meta.unbox(init))
    p = jax.device_get(parent_params)
    out = {"io": p["io"], "layer_0": {"attn_norm": p["layer_0"]["attn_norm"],
                                      "attn": puzzle_blocks.merge_kv_heads(p["layer_0"]["attn"], 1)}}
    mlp = p["layer_1"]["mlp"]
    keep = puzzle_blocks.top_channels(np.linalg.norm(mlp["wo"], axis=1), 32)
    out["layer_1"] = {"attn_norm": p["layer_1"]["attn_norm"], "attn": child["layer_1"]["attn"],
                      "mlp_norm": p["layer_1"]["mlp_norm"], "mlp": puzzle_blocks.shrink_ffn(mlp, keep)}
    assert jax.tree.map(np.shape, out) == jax.tree.map(np.shape, child)
    return out


def test_distilling_a_heterogeneous_child_lowers_the_eval_kl(parent, session_tfds_dir, tmp_path):
    cfg = _config(parent, session_tfds_dir, blocks=CHILD)
    task = GKDTask(cfg, TaskContext(restore_params=restore_params))
    start = _assemble_child(task.teacher_params, cfg.model)
    child_cfg = load_config("configs/lm.py:tiny", unlocked=True)  # the child as Puzzle writes it
    child_cfg.model.blocks.update(CHILD)
    child_cfg.data.data_dir = session_tfds_dir
    init_wd = trainer.save_initial(child_cfg, str(tmp_path / "child"), start)
    before = _mean(jax.jit(task.loss), start, task.eval_batches())
    summary = train_in_process(
        str(tmp_path / "gkd"), f"--config.gkd.teacher={parent}", f"--config.train.init_from={init_wd}",
        f"--config.model.blocks.attention={CHILD['attention']}", f"--config.model.blocks.ffn={CHILD['ffn']}",
        config="configs/gkd.py:tiny", data_dir=session_tfds_dir)
    assert summary["step"] == 8
    assert "eval_perplexity" not in summary
    assert {"eval_kl", "eval_cosine", "eval_ce", "eval_accuracy"} <= set(summary)
    np.testing.assert_allclose(summary["eval_loss"], summary["eval_kl"] + summary["eval_cosine"], rtol=1e-5)
    assert summary["eval_kl"] < 0.9 * before["kl"], (before, summary)
    assert summary["eval_loss"] < before["loss"]


def test_a_missing_or_mismatched_teacher_fails_naming_the_key(parent, session_tfds_dir, tmp_path):
    for teacher in ("", str(tmp_path / "nowhere")):
        wd = tmp_path / "run"
        with pytest.raises(ValueError, match=r"^config\.gkd\.teacher") as e:
            trainer.train(_config(teacher, session_tfds_dir), str(wd))
        assert "\n" not in str(e.value)
        assert not wd.exists()  # refused before the workdir was even made
    other = tmp_path / "other"
    os.makedirs(other)
    for key, value, name in (("num_layers", 3, "num_layers"), ("vocab_size", 512, "vocab_size")):
        saved = json.loads(load_config("configs/lm.py:tiny").to_json_best_effort())
        saved["model"][key] = value
        (other / "config.json").write_text(json.dumps(saved))
        with pytest.raises(ValueError, match=rf"config\.gkd\.teacher=.*model\.{name}=") as e:
            GKDTask(_config(str(other), session_tfds_dir), TaskContext(restore_params=restore_params))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"config\.gkd\.kl_weight"):
        GKDTask(_config(parent, session_tfds_dir, kl_weight=-1.0),
                TaskContext(restore_params=restore_params))
