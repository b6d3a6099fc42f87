"""Clear errors: bad config overrides, bad mesh, over-long sequences, missing corpora,
corrupted checkpoints and NaN losses."""
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from icml_jax.config_utils import load_config
from icml_jax.train import checkpoint as ckpt_lib
from icml_jax.train import trainer
from icml_jax.train.metrics import read_metrics
from tests.train.helpers import run_main


@pytest.fixture
def cfg(tmp_path):
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.train.samples = 0
    c.data.data_dir = str(tmp_path / "tfds")
    return c


@pytest.mark.parametrize("override,expect", [
    ("--config.train.stepz=3", "unknown config key in --config.train.stepz=3"),
    ("--config.train.steps=abc", "--config.train.steps=abc"),
    ("--config.train.lr=-0.01", "config.train.lr=-0.01 is negative"),
    ("--config.train.keep_checkpoints=0", "config.train.keep_checkpoints must be positive"),
    ("--config=configs/nope.py", "--config=configs/nope.py: no config file 'configs/nope.py'"),
    ("--config=configs/lm.py:hueg", "unknown preset 'hueg'; choose one of"),
    ("--flagfile=/nonexistent/flags.txt", "Unable to open flagfile"),
])
def test_bad_overrides_fail_in_one_line(tmp_path, override, expect):
    p = run_main(str(tmp_path / "w"), override, check=False, timeout=120)
    assert p.returncode != 0
    assert expect in p.stderr
    assert "Traceback" not in p.stderr
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


@pytest.mark.parametrize("section,key,value,expect", [
    ("train", "lr", -1e-3, "is negative"),
    ("train", "keep_checkpoints", 0, "keep_checkpoints must be positive"),
    ("train", "batch_size", 0, "batch_size must be positive"),
    ("train", "grad_accum", 0, "grad_accum must be positive"),
    ("train", "grad_accum", -2, "grad_accum must be positive"),
    ("model", "num_heads", 0, "num_heads must be positive"),
    ("model", "num_kv_heads", 0, "num_kv_heads must be positive"),
    ("model", "head_dim", -8, "head_dim must be positive"),
    ("model", "head_dim", 7, "head_dim=7 is odd"),
    ("model", "d_model", 0, "d_model must be positive"),
    ("model", "ffn_dim", 0, "ffn_dim must be positive"),
    ("train", "checkpoint_steps", (5, 0), r"checkpoint_steps holds \[0\]"),
])
def test_bad_sizes_and_rates_stop_before_any_compute(cfg, tmp_path, section, key, value, expect):
    """Found by validate_config, before the workdir is created or anything compiles."""
    cfg[section][key] = value
    wd = tmp_path / "w"
    with pytest.raises(ValueError, match=expect):
        trainer.train_and_evaluate(cfg, str(wd))
    assert not wd.exists()


def test_zero_lr_warns_and_tensor_must_divide_kv_heads(cfg, caplog):
    cfg.train.lr = 0.0
    trainer.validate_config(cfg, 1)
    assert "config.train.lr=0" in caplog.text
    cfg.train.lr = 1e-3
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = 1, 1, 4  # tiny: 2 KV heads
    with pytest.raises(ValueError, match="config.mesh.tensor=4 does not divide"):
        trainer.validate_config(cfg, 4)
    cfg.mesh.tensor = 2
    trainer.validate_config(cfg, 2)


def test_workdir_that_is_a_file(cfg, tmp_path):
    f = tmp_path / "w"
    f.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        trainer.train_and_evaluate(cfg, str(f))
    assert f.read_text() == "not a folder"


def test_mesh_that_does_not_divide_devices(cfg, tmp_path):
    cfg.mesh.data = 3
    with pytest.raises(ValueError, match="do not divide the 1 available device"):
        trainer.train_and_evaluate(cfg, str(tmp_path / "w"))


def test_sequence_length_above_model_maximum(cfg, tmp_path):
    cfg.data.seq_len = cfg.model.max_seq_len * 2
    with pytest.raises(ValueError, match="config.model.max_seq_len"):
        trainer.train_and_evaluate(cfg, str(tmp_path / "w"))


def test_missing_and_empty_corpus(cfg, tmp_path):
    cfg.data.name = "text_files"
    cfg.data.path = str(tmp_path / "nope")
    with pytest.raises((ValueError, FileNotFoundError), match="config.data.path"):
        trainer.train_and_evaluate(cfg, str(tmp_path / "w"))
    (tmp_path / "empty").mkdir()
    cfg.data.path = str(tmp_path / "empty")
    with pytest.raises((ValueError, FileNotFoundError), match="txt"):
        trainer.train_and_evaluate(cfg, str(tmp_path / "w"))


def _corrupt(step_dir):
    """Overwrites every file of the saved train state with garbage."""
    n = 0
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"\x00garbage" * 7)
            n += 1
    assert n > 0


def test_all_checkpoints_corrupted_stops_naming_the_directory(cfg, tmp_path):
    wd = str(tmp_path / "w")
    cfg.train.steps, cfg.train.checkpoint_every = 10, 5
    trainer.train_and_evaluate(cfg, wd)
    for s in ("5", "10"):
        _corrupt(os.path.join(wd, "checkpoints", s))
    with pytest.raises(ckpt_lib.CheckpointError, match=os.path.join(wd, "checkpoints")):
        trainer.train_and_evaluate(cfg, wd)


def test_nan_loss_stops_naming_the_step_and_keeps_last_good_checkpoint(cfg, tmp_path):
    wd = str(tmp_path / "w")
    cfg.train.steps, cfg.train.checkpoint_every, cfg.train.log_every = 30, 2, 1
    cfg.train.lr, cfg.train.clip_norm, cfg.train.warmup_steps = 1e30, 0.0, 3
    with pytest.raises(trainer.NonFiniteLossError, match=r"at step (\d+)") as e:
        trainer.train_and_evaluate(cfg, wd)
    bad_step = int(str(e.value).split("at step ")[1].split(";")[0])
    ckpts = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
    assert ckpts and max(ckpts) < bad_step
    assert f"last good checkpoint is step {max(ckpts)}" in str(e.value)
    losses = [r["loss"] for r in read_metrics(os.path.join(wd, "metrics.jsonl")) if "loss" in r]
    assert all(np.isfinite(losses)) and len(losses) == bad_step - 1
    # the kept checkpoint restores to finite params
    c = ckpt_lib.Checkpointer(os.path.join(wd, "checkpoints"), async_save=False)
    restored = c.manager.restore(
        max(ckpts), args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    c.close()
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(restored["state"]["params"]))


@pytest.mark.parametrize("module,flag_lines,expect,flagfile", [
    ("icml_jax.main", "--config=configs/lm.py:hueg\n--workdir={wd}\n", "unknown preset 'hueg'",
     ["--flagfile=/dev/stdin"]),
    ("icml_jax.main", "--config=configs/lm.py:hueg\n--workdir={wd}\n", "unknown preset 'hueg'",
     ["--flagfile", "/dev/stdin"]),
    ("icml_jax.sample", "--checkpoint={wd}\n--prompt=hi\n", "w: no such folder", ["--flagfile=/dev/stdin"]),
])
def test_flags_from_a_pipe_survive_the_huge_page_restart(tmp_path, module, flag_lines, expect, flagfile):
    """``--flagfile=/dev/stdin``: the entry point restarts (ICML_JAX_HUGEPAGES=1 forces it where
    glibc allows) before any flag file is read, and main.py reads a piped flag file once (the
    ml_collections config flag reads flag files while it is defined), so the flags arrive."""
    import subprocess
    import sys
    from tests.train.helpers import REPO_ROOT, env
    p = subprocess.run([sys.executable, "-m", module, *flagfile], cwd=REPO_ROOT,
                       env={**env(1, None), "ICML_JAX_HUGEPAGES": "1"},
                       input=flag_lines.format(wd=tmp_path / "w"), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and expect in p.stderr, p.stderr[-2000:]
    assert not os.path.exists(tmp_path / "w")
