"""Reliability of the train loop: exact resume after SIGKILL, sharded == single device, a
checkpoint restores onto other device counts and mesh shapes with the same params, errors."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from icml_jax.config_utils import REPO_ROOT
from tests.train.helpers import (env, main_cmd, restore_digest, sharding_digest, train_in_process,
                                 train_losses)

# long multi-device / multi-process runs in subprocesses: one xdist worker takes all of them,
# first, while the other runs in-process tests (tests/README.md)
pytestmark = pytest.mark.xdist_group("heavy_subprocesses")


@pytest.fixture(scope="module")
def data_dir(session_tfds_dir):
    return session_tfds_dir  # the Shakespeare build is shared with the worker's other runs


def test_sigkill_mid_training_resumes_exactly(tmp_path, data_dir, capsys):
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

    # the rerun of the same command resumes (in this process: what it restores is on disk)
    capsys.readouterr()
    train_in_process(killed, *args, data_dir=data_dir)
    assert "Resumed from" in capsys.readouterr().out
    got = train_losses(killed)
    assert sorted(got) == list(range(1, 41))
    diffs = [abs(got[s] - want[s]) for s in range(1, 41)]
    assert max(diffs) <= 1e-6, diffs


EIGHT_DEVICE_MESH = [1, 4, 2]  # data x fsdp x tensor

# trains what test_fsdp_tensor_parallel_matches_one_device trains on one device, then restores
# the checkpoint it wrote onto the same 8 devices (the reference of the restore test)
_EIGHT_DEVICE_SCRIPT = r"""
import json, sys
from icml_jax.config_utils import load_config
from icml_jax.train import trainer
from tests.train.helpers import restore_digest, sharding_digest

workdir, params_out, mesh = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
c = load_config("configs/lm.py:tiny", unlocked=True)
c.train.samples = 0
c.train.steps = 12
c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
state, s = trainer.train(c, workdir)
print("RESULT" + json.dumps(sharding_digest(state, s)))
print("RESTORED" + json.dumps(restore_digest(workdir, params_out, mesh)))
"""


def _last_json(stdout, tag):
    line = [x for x in stdout.splitlines() if x.startswith(tag)][-1]
    return json.loads(line[len(tag):])


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory, data_dir):
    """One 12-step tiny run on 8 fake devices (one subprocess): its workdir, sharding digest,
    losses, and the digest and params file of its checkpoint restored onto the same mesh."""
    root = tmp_path_factory.mktemp("eight_devices")
    workdir, params = str(root / "run"), str(root / "params_8_1x4x2.npz")
    p = subprocess.run([sys.executable, "-c", _EIGHT_DEVICE_SCRIPT, workdir, params,
                        json.dumps(EIGHT_DEVICE_MESH)], cwd=REPO_ROOT, env=env(8, data_dir),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return dict(workdir=workdir, digest=_last_json(p.stdout, "RESULT"),
                losses=train_losses(workdir), restored=_last_json(p.stdout, "RESTORED"),
                params=params)


def test_fsdp_tensor_parallel_matches_one_device(tmp_path, data_dir, eight_devices):
    # the one-device run is the script's training in this process
    one = sharding_digest(*train_in_process(str(tmp_path / "one"), "--config.train.samples=0",
                                             "--config.train.steps=12", data_dir=data_dir,
                                             with_state=True))
    l1 = train_losses(str(tmp_path / "one"))
    eight, l8 = eight_devices["digest"], eight_devices["losses"]
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


_RESTORE_SCRIPT = r"""
import json, sys
from tests.train.helpers import restore_digest
print(json.dumps(restore_digest(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))
"""


def test_restore_onto_other_device_counts_and_meshes(tmp_path, data_dir, eight_devices):
    """The 8-device run's checkpoint (restored on its own mesh by the run's process) restores
    onto 1 device (this process) and onto 4 devices with another mesh, with the same params and
    optimizer state."""
    wd, own = eight_devices["workdir"], (8, tuple(EIGHT_DEVICE_MESH))
    restored = {own: (eight_devices["restored"], eight_devices["params"])}  # (digest, npz file)
    for devices, mesh in ((1, (1, 1, 1)), (4, (2, 1, 2))):
        out = str(tmp_path / f"params_{devices}_{'x'.join(map(str, mesh))}.npz")
        if devices == 1:  # this process has one device
            info = restore_digest(wd, out, list(mesh))
        else:
            p = subprocess.run([sys.executable, "-c", _RESTORE_SCRIPT, wd, out, json.dumps(mesh)],
                               cwd=REPO_ROOT, env=env(devices, data_dir), capture_output=True,
                               text=True, timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
            info = json.loads(p.stdout.strip().splitlines()[-1])
        restored[(devices, mesh)] = (info, out)
    got = {}
    for (devices, mesh), (info, out) in restored.items():
        assert info["step"] == 12 and info["devices"] == devices
        if mesh[1] * mesh[2] > 1:  # params really are split over the new mesh
            assert info["split"], info
        with np.load(out) as z:
            got[(devices, mesh)] = {k: z[k] for k in z.files}
    ref = got.pop(own)
    assert len(ref) > 10
    for key, arrays in got.items():
        assert arrays.keys() == ref.keys(), key
        for name in ref:
            np.testing.assert_array_equal(arrays[name], ref[name], err_msg=f"{key} {name}")
