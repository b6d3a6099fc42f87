"""Multi-process training on one machine: 2 CPU processes x 4 fake devices = one 8-device mesh.

The processes talk over 127.0.0.1 only (coordinator + gloo collectives). Checked: the 2-process
run's losses equal a 1-process 1-device run's (the test's own process); its checkpoint resumes
exactly in 1 process on 1 device; a DPO run's frozen reference log-probs are scored in
per-process shares; a process that dies makes the other stop with an error; no socket leaves the
loopback interface. (A checkpoint restored onto other device counts and meshes:
test_reliability.py, from the 8-device run it shares with the sharded == one device test.)
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from icml_jax import launch_local
from icml_jax.config_utils import REPO_ROOT
from icml_jax.train import distributed
from tests.train.helpers import env, main_cmd, run_main, train_in_process, train_losses

# long multi-device / multi-process runs in subprocesses: one xdist worker takes all of them,
# first, while the other runs in-process tests (tests/README.md)
pytestmark = pytest.mark.xdist_group("heavy_subprocesses")

SPLIT_MESH = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
SHORT = ["--config.train.checkpoint_every=2", "--config.train.eval_every=2",
         "--config.train.progress=False", "--config.train.samples=0"]


@pytest.fixture(scope="module")
def data_dir(session_tfds_dir):
    """The Shakespeare build shared with the worker's other runs, prepared before any run: two
    processes started on a cold folder would have process 0 build it while process 1 waits in
    the collectives' set-up (30 s, then it fails)."""
    from icml_jax.data import shakespeare
    shakespeare.build(session_tfds_dir)
    return session_tfds_dir


def launch(workdir, *overrides, data_dir, n=2, devices=4, heartbeat=10, config=None):
    """Starts ``n`` processes of the entry point joined through a loopback coordinator."""
    main_args = main_cmd(workdir, *overrides)[3:] + ["--initialization_timeout=120"]
    if config:
        main_args[0] = f"--config={config}"
    return launch_local.spawn(main_args, num_processes=n, devices_per_process=devices,
                              heartbeat_timeout=heartbeat, cwd=REPO_ROOT, env=env(1, data_dir),
                              stdouts=[subprocess.PIPE] * n, stderrs=[subprocess.PIPE] * n)


def finish(procs, timeout):
    """Waits for every process; returns [(returncode, stdout, stderr)] (kills all on timeout)."""
    deadline = time.time() + timeout
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.time()))
            out.append((p.returncode, so, se))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    return out


def run_two(workdir, *overrides, data_dir, timeout=420, **kw):
    results = finish(launch(workdir, *overrides, data_dir=data_dir, **kw), timeout)
    for i, (rc, so, se) in enumerate(results):
        assert rc == 0, f"process {i} failed ({rc}):\n{so[-2000:]}\n{se[-3000:]}"
    return results


def eval_losses(workdir) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


@pytest.mark.parametrize("streams", [1, 4])
def test_two_processes_equal_one_process_and_resume_in_one(tmp_path, data_dir, streams, capsys):
    """streams=1: both processes pack the global batch and keep their halves; streams=4: each
    packs only its 2 streams, and the checkpoint merges the processes' iterator states. A constant
    learning rate after warmup makes a 4-step run the prefix of the 6-step reference, which (like
    the resume) runs in this test's process on its one device."""
    base = [f"--config.data.streams={streams}", "--config.train.min_lr_ratio=1.0", *SHORT]
    one = str(tmp_path / "one_process")
    train_in_process(one, *base, "--config.train.steps=6", data_dir=data_dir)
    two = str(tmp_path / "two_processes")
    # sampling at the end needs the params gathered from both processes
    sample = ["--config.train.samples=1", "--config.train.sample_len=8"] if streams == 1 else []
    (_, out0, _), (_, out1, _) = run_two(two, *SPLIT_MESH, *base, "--config.train.steps=4",
                                         *sample, data_dir=data_dir)

    want, got = train_losses(one), train_losses(two)
    assert sorted(got) == list(range(1, 5))
    assert max(abs(got[s] - want[s]) for s in got) <= 1e-5, (want, got)
    assert got[4] < got[1] - 0.3  # it trained
    ev1, ev2 = eval_losses(one), eval_losses(two)
    assert sorted(ev2) == [2, 4] and max(abs(ev2[s] - ev1[s]) for s in ev2) <= 1e-5
    # process 0 speaks for the run, process 1 prints none of the run's lines
    assert "8 cpu device(s) in 2 processes" in out0 and "step 4: eval_loss" in out0
    assert "Model:" not in out1 and "eval_loss" not in out1 and "--- sample ---" not in out1
    if sample:
        with open(os.path.join(two, "summary.json")) as f:
            texts = json.load(f)["samples"]
        assert "--- sample ---" in out0 and len(texts) == 1 and texts[0].startswith("ROMEO.")
    steps = sorted(int(s) for s in os.listdir(os.path.join(two, "checkpoints")) if s.isdigit())
    assert steps == [2, 4]

    # the 2-process checkpoint (8 devices) resumes exactly in 1 process on 1 device
    resumed = str(tmp_path / "resumed_on_one_device")
    shutil.copytree(two, resumed)
    capsys.readouterr()
    train_in_process(resumed, *base, "--config.train.steps=6", data_dir=data_dir)
    assert f"Resumed from {resumed}/checkpoints/4" in capsys.readouterr().out
    got = train_losses(resumed)
    assert sorted(got) == list(range(1, 7))
    assert max(abs(got[s] - want[s]) for s in (5, 6)) <= 1e-5, (want, got)


def test_frozen_logps_are_scored_in_shares_equal_one_process_and_read_back(tmp_path, data_dir):
    """A 2-process DPO run scores its reference's log-probs in shares (each process whole
    scoring batches of its own), gathers them equal to one process's (the same cache file name)
    with every row where the train batches need it (step-1 loss = log 2: policy = reference),
    and keeps them on disk; a second 2-process run reads them."""
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.train.trainer import build_task
    from tests.tasks.helpers import synthetic_pairs
    from tests.train.helpers import cli_config

    sft = str(tmp_path / "sft")
    train_in_process(sft, "--config.train.steps=1", *SHORT, data_dir=data_dir)
    data = str(tmp_path / "pairs.jsonl")
    # 72 train rows = 5 scoring batches of 16 (3 + 2 per process), 32 eval rows = 2 (1 + 1)
    write_preference_jsonl(data, synthetic_pairs(36, 0))
    dpo = [f"--config.data.path={data}", f"--config.train.init_from={sft}",
           "--config.train.steps=1", "--config.train.log_every=1"]
    one = build_task(cli_config("configs/dpo.py:tiny", *dpo), (1, 1, 1))  # this process: 1 device
    cache = os.path.join(sft, "frozen_logps")
    [name] = os.listdir(cache)
    shutil.rmtree(cache)

    kw = dict(config="configs/dpo.py:tiny", devices=2, data_dir=data_dir)
    (_, _, err0), _ = run_two(str(tmp_path / "dpo"), *dpo, **kw)
    assert "frozen log-probs ref_logps (config.loss.reference=" in err0
    assert "computed 64 of 104 rows on this process (64 + 40 in 2 processes)" in err0, err0[-3000:]
    assert os.listdir(cache) == [name]
    with np.load(os.path.join(cache, name)) as z:
        for split, arrays in (("train", one.train_arrays), ("eval", one.eval_arrays)):
            np.testing.assert_allclose(z[split], arrays["ref_logps"], rtol=0, atol=1e-6)
    assert abs(train_losses(str(tmp_path / "dpo"))[1] - np.log(2)) < 1e-5

    (_, _, err0), _ = run_two(str(tmp_path / "dpo_again"), *dpo, **kw)
    assert f"read {os.path.join(cache, name)}" in err0 and "rows on this process" not in err0


def _socket_addresses(pid: int) -> list:
    """(local, remote) IPv4/IPv6 addresses of the TCP sockets process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def decode(hexaddr: str) -> str:
        ip = hexaddr.split(":")[0]
        raw = bytes.fromhex(ip)
        if len(raw) == 4:
            return socket.inet_ntop(socket.AF_INET, raw[::-1])
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, words)

    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[9] in inodes:
                    out.append((decode(cols[1]), decode(cols[2])))
    return out


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "::ffff:127.0.0.1") or (
        addr.startswith("::ffff:127."))


@pytest.mark.parametrize("victim", [1, 0])
def test_a_dying_process_stops_the_other_and_traffic_stays_on_loopback(tmp_path, data_dir, victim):
    wd = str(tmp_path / "run")
    procs = launch(wd, *SPLIT_MESH, "--config.train.steps=2000", "--config.train.log_every=1",
                   "--config.train.eval_every=2000", "--config.train.checkpoint_every=2000",
                   "--config.train.progress=False", data_dir=data_dir, heartbeat=10)
    try:
        metrics = os.path.join(wd, "metrics.jsonl")
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            if os.path.exists(metrics) and len(train_losses(wd)) >= 3:
                break
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        assert len(train_losses(wd)) >= 3, "training did not start"
        sockets = [a for p in procs for a in _socket_addresses(p.pid)]
        assert sockets, "no TCP sockets found: the processes do not talk over TCP?"
        outside = [a for a in sockets if not (_loopback(a[0]) and (_loopback(a[1]) or
                                                                     set(a[1]) <= set("0.:")))]
        assert not outside, f"sockets off the loopback interface: {outside}"
        listening_anywhere = [a for a in sockets if a[0] in ("0.0.0.0", "::")]
        assert not listening_anywhere, listening_anywhere

        procs[victim].send_signal(signal.SIGKILL)
        killed_at = time.time()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=90)
        took = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert survivor.returncode != 0
    assert took < 60, took
    assert ("another process died" in err or "another task died" in err
            or "leader task was preempted/died" in err), err[-3000:]


@pytest.mark.parametrize("settings, expect", [
    (dict(coordinator_address="127.0.0.1:1234", num_processes=2), "--process_id"),
    (dict(coordinator_address="127.0.0.1", num_processes=2, process_id=0), "needs a port"),
    (dict(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2), "must be in [0"),
    (dict(num_processes=0), ">= 1"),
    (dict(mode="maybe"), "auto, on, off"),
    (dict(heartbeat_timeout=0), "--heartbeat_timeout=0"),
])
def test_bad_distributed_settings_are_named(settings, expect):
    with pytest.raises(distributed.DistributedSetupError, match=None) as e:
        distributed.resolve(distributed.Settings(**settings), environ={})
    assert expect in str(e.value)


def test_settings_from_environment_and_when_to_start():
    env_vars = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:9", "JAX_NUM_PROCESSES": "4",
                "JAX_PROCESS_ID": "3"}
    s = distributed.resolve(distributed.Settings(), environ=env_vars)
    assert (s.coordinator_address, s.num_processes, s.process_id) == ("127.0.0.1:9", 4, 3)
    assert distributed.wanted(s)
    # a flag wins over the environment
    s = distributed.resolve(distributed.Settings(process_id=1), environ=env_vars)
    assert s.process_id == 1
    assert not distributed.wanted(distributed.resolve(distributed.Settings(mode="off"), env_vars))
    assert not distributed.wanted(distributed.resolve(distributed.Settings(), environ={}))
    with pytest.raises(distributed.DistributedSetupError, match="JAX_NUM_PROCESSES"):
        distributed.resolve(distributed.Settings(), environ={"JAX_NUM_PROCESSES": "two"})
    assert distributed.is_loopback("localhost:1") and distributed.is_loopback("127.0.0.2:1")
    assert not distributed.is_loopback("10.0.0.1:1234")


class _FakeSharding:
    """A process's view of a batch sharding: the row slices its devices hold."""

    def __init__(self, slices):
        self.slices = slices

    def addressable_devices_indices_map(self, shape):
        return {i: (slice(a, b),) for i, (a, b) in enumerate(self.slices)}


def test_process_rows_from_the_sharding():
    # process 1 of 2 holding rows 8..16 of 16 on 4 devices (two of them replicas)
    assert distributed.process_rows(_FakeSharding([(8, 12), (8, 12), (12, 16), (12, 16)]), 16) == (1, 2)
    # a tensor axis across processes: every process feeds the whole batch
    assert distributed.process_rows(_FakeSharding([(0, 16)]), 16) == (0, 1)
    with pytest.raises(distributed.DistributedSetupError, match="not one aligned block"):
        distributed.process_rows(_FakeSharding([(0, 4), (8, 12)]), 16)


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
    p = run_main(str(tmp_path / "wd"), f"--coordinator_address=127.0.0.1:{launch_local.free_port()}",
                 "--num_processes=2", "--process_id=1", "--initialization_timeout=2",
                 check=False, timeout=120)
    assert p.returncode == 1
    assert "process 1 of 2: nothing answered at the coordinator address" in p.stderr
    assert not os.path.exists(str(tmp_path / "wd"))


def test_checkpoints_of_the_earlier_layout_still_resume(tmp_path):
    """Before the JSON data state, the iterator was saved as grain's per-process files."""
    import grain
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from icml_jax import tasks
    from icml_jax.config_utils import load_config
    from icml_jax.train import checkpoint as ckpt_lib

    cfg = load_config("configs/lm.py:tiny")
    task = tasks.TASKS.get(cfg.task)(cfg)
    it = task.train_iterator(seed=0)
    for _ in range(3):
        next(it)
    want = next(it)  # the 4th batch
    it = task.train_iterator(seed=0)
    for _ in range(3):
        next(it)
    ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    ck.manager.save(3, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"w": jnp.arange(3.0)}),
        data=grain.checkpoint.CheckpointSave(it), config=ocp.args.JsonSave({})), force=True)
    ck.close()
    assert not os.path.exists(tmp_path / "checkpoints" / "3" / "data_state")

    fresh = task.train_iterator(seed=0)
    ck = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"), async_save=False)
    state, step = ck.restore_latest({"w": jnp.zeros(3)}, fresh)
    ck.close()
    assert step == 3
    np.testing.assert_array_equal(state["w"], np.arange(3.0))
    got = next(fresh)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_launch_local_stops_and_reports_a_failing_run(tmp_path):
    wd = str(tmp_path / "wd")
    p = subprocess.run([sys.executable, "-m", "icml_jax.launch_local", "--num_processes=2",
                        "--devices_per_process=2", "--grace=5", "--",
                        "--config=configs/lm.py:tiny", f"--workdir={wd}",
                        "--config.train.steps=0"], cwd=REPO_ROOT, env=env(1), capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "process 0 of 2: config.train.steps must be positive" in p.stderr
    assert "launch_local: a process failed (exit code 1)" in p.stderr
    with open(os.path.join(wd, "logs", "process_1.log")) as f:
        log1 = f.read()
    # process 1 reports the same error, unless process 0's exit (the coordinator's) ended it first
    assert ("process 1 of 2: config.train.steps must be positive" in log1
            or "another task died" in log1 or "leader task was preempted/died" in log1), log1[-2000:]


def test_initialize_passes_the_settings_to_jax(monkeypatch):
    """What reaches jax.distributed.initialize (recorded, not run): a loopback coordinator binds
    to loopback only; on a detected Cloud TPU pod nothing is set and JAX fills everything in."""
    import jax

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(distributed, "_check_coordinator", lambda s: None)
    monkeypatch.setattr(distributed, "_pin_gloo_to_loopback", lambda: None)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)

    monkeypatch.setattr(distributed, "_on_cloud_tpu", lambda: False)
    assert not distributed.initialize(distributed.Settings())
    assert distributed.initialize(distributed.Settings(
        coordinator_address="127.0.0.1:4321", num_processes=2, process_id=0, heartbeat_timeout=7,
        local_device_ids=(0, 1)))
    assert calls[-1]["coordinator_bind_address"] == "127.0.0.1:4321"
    assert (calls[-1]["num_processes"], calls[-1]["process_id"]) == (2, 0)
    assert calls[-1]["heartbeat_timeout_seconds"] == 7 and calls[-1]["local_device_ids"] == [0, 1]
    distributed.initialize(distributed.Settings(coordinator_address="10.0.0.1:4321",
                                                num_processes=4, process_id=3))
    assert "coordinator_bind_address" not in calls[-1]
    assert len(calls) == 2

    monkeypatch.setattr(distributed, "_on_cloud_tpu", lambda: True)
    assert distributed.initialize(distributed.Settings())
    assert calls[-1]["coordinator_address"] is None and calls[-1]["process_id"] is None
    assert not distributed.initialize(distributed.Settings(mode="off"))
    assert len(calls) == 3
