"""The reward-model task on 8 fake devices (data x fsdp x tensor) equals 1 device, BSR per shard."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from icml_jax.config_utils import REPO_ROOT
from icml_jax.data.preference import write_preference_jsonl
from tests.jax_env import subprocess_env
from tests.tasks.helpers import synthetic_pairs as _pairs
from tests.train.helpers import train_in_process

# long multi-device / multi-process runs in subprocesses: one xdist worker takes all of them,
# first, while the other runs in-process tests (tests/README.md)
pytestmark = pytest.mark.xdist_group("heavy_subprocesses")


CONFIG = "configs/reward_model.py:tiny"


def _overrides(data, *extra):
    return [f"--config.data.path={data}", "--config.train.steps=4", "--config.train.log_every=1",
            "--config.train.eval_every=4", "--config.train.checkpoint_every=4",
            "--config.loss.bsr_lambda=0.05", *extra]


def _rows(workdir):
    rows = [json.loads(x) for x in open(os.path.join(workdir, "metrics.jsonl"))]
    return {r["step"]: r for r in rows if "loss" in r}


def _run(workdir, data, devices, *extra):
    """The CLI in a subprocess with ``devices`` fake devices, or (1 device) in this process."""
    if devices == 1:
        train_in_process(workdir, *_overrides(data, *extra), config=CONFIG)
        return _rows(workdir)
    cmd = [sys.executable, "-m", "icml_jax.main", f"--config={CONFIG}", f"--workdir={workdir}",
           *_overrides(data, *extra)]
    p = subprocess.run(cmd, cwd=REPO_ROOT, env=subprocess_env(devices), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return _rows(workdir)


def test_eight_devices_match_one_with_per_shard_bsr(tmp_path):
    data = str(tmp_path / "pairs.jsonl")
    write_preference_jsonl(data, _pairs(32, 0))
    sharded = _run(tmp_path / "d8", data, 8, "--config.mesh.data=2", "--config.mesh.fsdp=2",
                   "--config.mesh.tensor=2")
    # one device computing the BSR means over the same 4 row blocks (data*fsdp = 4 shards)
    single = _run(tmp_path / "d1", data, 1, "--config.loss.bsr_num_shards=4")
    assert sorted(sharded) == sorted(single) == [1, 2, 3, 4]
    for s in sharded:
        for k in ("loss", "loss/bsr", "accuracy", "hidden_norm/std"):
            np.testing.assert_allclose(sharded[s][k], single[s][k], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {s} {k}")
    assert sharded[1]["loss/bsr"] > 0
    assert sharded[4]["loss"] != sharded[1]["loss"]  # it trained
