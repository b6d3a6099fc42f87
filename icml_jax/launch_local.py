"""Runs N processes of ``icml_jax.main`` on this machine as one multi-process JAX run.

    python -m icml_jax.launch_local --num_processes=2 --devices_per_process=4 -- \\
        --config=configs/lm.py:tiny --workdir=runs/two_processes --config.mesh.fsdp=4

Everything after ``--`` goes to every process. The processes join through a coordinator on
127.0.0.1 (a free port) and, on CPU, exchange data with gloo over loopback, which makes this the
way to try multi-host code paths on a laptop or CI machine: the same code runs across the hosts of
a TPU pod or a GPU cluster. ``--platform=cpu`` (default) gives each process
``--devices_per_process`` fake CPU devices; ``--platform=gpu`` gives process i the GPUs
``i*k .. i*k+k-1`` (k = devices_per_process) of this machine.

Process 0's output is shown; process i's goes to ``<workdir>/logs/process_<i>.log``. When a
process fails the others are stopped (after ``--grace`` seconds) and the exit code is the first
failing process's.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

_N = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Devices per process.")
_PLATFORM = flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"], "Device kind.")
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port on 127.0.0.1 (0 = a free one).")
_GRACE = flags.DEFINE_float("grace", 30.0, "Seconds the others get to stop after one fails.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 30, "Passed to every process.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(i: int, devices: int, platform: str, base=None) -> dict:
    env = dict(os.environ if base is None else base)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        flags_ = [f for f in env.get("XLA_FLAGS", "").split()
                  if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags_ + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def process_args(i: int, n: int, port: int, devices: int, platform: str, heartbeat: int) -> list:
    args = [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={n}", f"--process_id={i}",
            f"--heartbeat_timeout={heartbeat}"]
    if platform == "gpu":
        args.append("--local_device_ids=" + ",".join(str(i * devices + d) for d in range(devices)))
    return args


def spawn(main_args, *, num_processes: int, devices_per_process: int, platform: str = "cpu",
          port: int = 0, heartbeat_timeout: int = 30, cwd=None, env=None, stdouts=None,
          stderrs=None) -> list:
    """Starts the processes; returns their ``subprocess.Popen`` objects (process i at index i).
    ``stdouts`` / ``stderrs``: one file object (or ``subprocess.PIPE``) per process, default
    inherited."""
    port = port or free_port()
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-m", "icml_jax.main", *main_args,
               *process_args(i, num_processes, port, devices_per_process, platform,
                             heartbeat_timeout)]
        procs.append(subprocess.Popen(
            cmd, cwd=cwd, env=process_env(i, devices_per_process, platform, env),
            stdout=None if stdouts is None else stdouts[i],
            stderr=None if stderrs is None else stderrs[i], text=True))
    return procs


def supervise(procs, grace: float) -> int:
    """Waits for all processes; once one fails, the rest get ``grace`` seconds, then SIGKILL."""
    failed_at, code = None, 0
    while True:
        codes = [p.poll() for p in procs]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at, code = time.time(), bad[0]
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        if all(c is not None for c in codes):
            return code
        if failed_at is not None and time.time() - failed_at > grace:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)


def _workdir(main_args) -> str:
    for a in main_args:
        if a.startswith("--workdir="):
            return a.split("=", 1)[1]
    raise app.UsageError("pass --workdir=DIR after `--` (it is needed for the process logs)")


def main(argv):
    main_args = argv[1:]
    if _N.value < 1 or _DEVICES.value < 1:
        raise app.UsageError("--num_processes and --devices_per_process must be >= 1")
    logs = os.path.join(_workdir(main_args), "logs")
    os.makedirs(logs, exist_ok=True)
    files = [None] + [open(os.path.join(logs, f"process_{i}.log"), "w")  # noqa: SIM115
                      for i in range(1, _N.value)]
    try:
        procs = spawn(main_args, num_processes=_N.value, devices_per_process=_DEVICES.value,
                      platform=_PLATFORM.value, port=_PORT.value,
                      heartbeat_timeout=_HEARTBEAT.value, stdouts=files,
                      stderrs=[None] + files[1:])
        code = supervise(procs, _GRACE.value)
    finally:
        for f in files[1:]:
            f.close()
    if code:
        print(f"launch_local: a process failed (exit code {code}); the other processes' output is "
              f"in {logs}/", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    app.run(main)
