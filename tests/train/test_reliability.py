"""Reliability of the train loop: exact resume after SIGKILL, sharded == single device, errors."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from icml_jax.config_utils import REPO_ROOT
from tests.train.helpers import (env, main_cmd, run_main, sharding_digest, train_in_process,
                                 train_losses)

# long multi-device / multi-process runs in subprocesses: one xdist worker takes all of them,
# first, while the other runs in-process tests (tests/README.md)
pytestmark = pytest.mark.xdist_group("heavy_subprocesses")


@pytest.fixture(scope="module")
def data_dir(session_tfds_dir):
    return session_tfds_dir  # the Shakespeare build is shared with the worker's other runs


def test_sigkill_mid_training_resumes_exactly(tmp_path, data_dir):
    args = ["--config.train.steps=40", "--config.train.checkpoint_every=5",
            "--config.train.async_checkpoint=True", "--config.train.samples=0"]
    ref = str(tmp_path / "ref")  # the uninterrupted run, in this process
    train_in_process(ref, *args, data_dir=data_dir)
    want = train_losses(ref)
    assert sorted(want) == list(range(1, 41))

    killed = str(tmp_path / "killed")
    proc = subprocess.Popen(main_cmd(killed, *args), cwd=REPO_ROOT, env=env(data_dir=data_dir),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = os.path.join(killed, "metrics.jsonl")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(train_losses(killed)) >= 17:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(train_losses(killed))
    assert 17 <= killed_at < 40
    steps = sorted(int(s) for s in os.listdir(os.path.join(killed, "checkpoints")) if s.isdigit())
    assert steps and steps[-1] < 40

    p = run_main(killed, *args, data_dir=data_dir)
    assert "Resumed from" in p.stdout
    got = train_losses(killed)
    assert sorted(got) == list(range(1, 41))
    diffs = [abs(got[s] - want[s]) for s in range(1, 41)]
    assert max(diffs) <= 1e-6, diffs


_SHARDED_SCRIPT = r"""
import json, sys
from icml_jax.config_utils import load_config
from icml_jax.train import trainer
from tests.train.helpers import sharding_digest

c = load_config("configs/lm.py:tiny", unlocked=True)
c.train.samples = 0
c.train.steps = 12
c.mesh.data, c.mesh.fsdp, c.mesh.tensor = [int(x) for x in sys.argv[2:5]]
state, s = trainer.train(c, sys.argv[1])
print("RESULT" + json.dumps(sharding_digest(state, s)))
"""


def _run_sharded(workdir, devices, mesh, data_dir):
    p = subprocess.run([sys.executable, "-c", _SHARDED_SCRIPT, workdir, *map(str, mesh)], cwd=REPO_ROOT,
                       env=env(devices, data_dir), capture_output=True, text=True, timeout=300,
                       executable=None)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):]), train_losses(workdir)


def test_fsdp_tensor_parallel_matches_one_device(tmp_path, data_dir):
    # the one-device run is the script's training in this process
    one = sharding_digest(*train_in_process(str(tmp_path / "one"), "--config.train.samples=0",
                                             "--config.train.steps=12", data_dir=data_dir,
                                             with_state=True))
    l1 = train_losses(str(tmp_path / "one"))
    eight, l8 = _run_sharded(str(tmp_path / "eight"), 8, (1, 4, 2), data_dir)
    assert one["devices"] == 1 and eight["devices"] == 8
    assert sorted(l1) == sorted(l8) == list(range(1, 13))
    assert max(abs(l1[s] - l8[s]) for s in l1) <= 1e-5
    assert abs(one["eval_loss"] - eight["eval_loss"]) <= 1e-5
    spec, shape, shard = eight["shardings"]["['layer_0']['attn']['qkv']"]
    assert "fsdp" in spec and "tensor" in spec
    assert shard[0] == shape[0] // 4 and shard[1] == shape[1] // 2, (spec, shape, shard)
    spec, shape, shard = eight["shardings"]["['layer_0']['mlp']['wi']"]
    assert shard[0] == shape[0] // 4 and shard[2] == shape[2] // 2, (spec, shape, shard)
    n_sharded = sum(v[1] != v[2] for v in eight["shardings"].values())
    assert n_sharded >= len(eight["shardings"]) // 2
