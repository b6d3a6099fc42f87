"""Multi-process runs: ``jax.distributed`` start-up, and which rows of a global batch a process feeds.

One process runs per host (TPU VM worker, GPU node or GPU, or a CPU process in tests); all of them
run the same command. ``initialize`` joins them into one JAX runtime, after which
``jax.devices()`` lists every device of every process and one ``Mesh`` spans them all.

Where the settings come from, first match wins:

* flags of ``icml_jax.main``: ``--coordinator_address``, ``--num_processes``, ``--process_id``
  (and ``--local_device_ids``);
* environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
  (``JAX_LOCAL_DEVICE_IDS`` is read by JAX itself);
* JAX's cluster auto-detection (Cloud TPU VMs and GKE TPU pods; with ``--distributed=on`` also
  SLURM and Open MPI), which fills in whatever was left unset.

``--distributed=auto`` (the default) starts the runtime when a coordinator address is given or a
Cloud TPU pod is detected, and otherwise runs as one process; ``on`` always starts it; ``off``
never does.

When every process runs on this machine (a loopback coordinator address such as
``127.0.0.1:PORT`` or ``localhost:PORT``), the coordinator binds to that address only and the CPU
collectives (gloo) use 127.0.0.1, so no traffic leaves the loopback interface.

If a process dies, the others stop with an error instead of waiting forever: a collective that
loses its peer fails at once, and JAX's coordination service ends every process whose peers stopped
sending heartbeats for ``heartbeat_timeout`` seconds.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
from absl import logging

MODES = ("auto", "on", "off")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


class DistributedSetupError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple | None = None
    initialization_timeout: int = 300
    heartbeat_timeout: int = 100


def _int_or_none(value, name: str, where: str):
    if value in (None, ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedSetupError(f"{where} {name}={value!r} is not an integer") from None


def resolve(settings: Settings, environ=None) -> Settings:
    """Fills unset fields from the environment and checks them; raises DistributedSetupError."""
    env = os.environ if environ is None else environ
    s = settings
    if s.mode not in MODES:
        raise DistributedSetupError(f"--distributed={s.mode!r}: use one of {', '.join(MODES)}")
    address = s.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    n = s.num_processes if s.num_processes is not None else _int_or_none(
        env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES", "environment variable")
    pid = s.process_id if s.process_id is not None else _int_or_none(
        env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID", "environment variable")
    if address is not None and ":" not in address.rsplit("]", 1)[-1]:
        raise DistributedSetupError(
            f"coordinator address {address!r} (--coordinator_address / JAX_COORDINATOR_ADDRESS) "
            "needs a port: HOST:PORT, e.g. 10.0.0.1:1234 (process 0's host)")
    if n is not None and n < 1:
        raise DistributedSetupError(f"--num_processes / JAX_NUM_PROCESSES={n} must be >= 1")
    if pid is not None and (pid < 0 or (n is not None and pid >= n)):
        raise DistributedSetupError(
            f"--process_id / JAX_PROCESS_ID={pid} must be in [0, num_processes={n})")
    if address is not None and s.mode != "off" and not _on_cloud_tpu() and (n is None or pid is None):
        missing = [f for f, v in (("--num_processes", n), ("--process_id", pid)) if v is None]
        raise DistributedSetupError(
            f"a coordinator address ({address}) is set but {' and '.join(missing)} is not: give "
            "every process the same --num_processes and its own --process_id (0 .. N-1), or the "
            "JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables")
    for name, v in (("initialization_timeout", s.initialization_timeout),
                    ("heartbeat_timeout", s.heartbeat_timeout)):
        if v <= 0:
            raise DistributedSetupError(f"--{name}={v} must be a positive number of seconds")
    return dataclasses.replace(s, coordinator_address=address, num_processes=n, process_id=pid)


def _on_cloud_tpu() -> bool:
    """True on a Cloud TPU VM that JAX's cluster detection recognises (GCE or GKE)."""
    try:
        from jax._src.clusters import cloud_tpu_cluster  # pylint: disable=g-import-not-at-top
        return bool(cloud_tpu_cluster.GceTpuCluster.is_env_present()
                    or cloud_tpu_cluster.GkeTpuCluster.is_env_present())
    except Exception:  # noqa: BLE001 - detection is best effort; JAX's internals may move
        return False


def is_loopback(address: str | None) -> bool:
    if not address:
        return False
    host = address.rsplit(":", 1)[0]
    return host in _LOOPBACK_HOSTS or host.startswith("127.")


def wanted(s: Settings) -> bool:
    if s.mode == "off":
        return False
    if s.mode == "on":
        return True
    if s.num_processes == 1 and s.coordinator_address is None:
        return False
    return s.coordinator_address is not None or _on_cloud_tpu()


def _pin_gloo_to_loopback() -> None:
    """Makes the CPU collectives (gloo) listen on 127.0.0.1 instead of the host name's address."""
    import functools  # pylint: disable=g-import-not-at-top

    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    make = getattr(xla_bridge._jax, "make_gloo_tcp_collectives", None)  # pylint: disable=protected-access
    if make is None or isinstance(make, functools.partial):
        return
    xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(make, hostname="127.0.0.1")  # pylint: disable=protected-access


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _check_coordinator(s: Settings) -> None:
    """Fails with a clear error where JAX would abort the process: process 0's port is taken, or
    (other processes) nothing listens at the coordinator address within the timeout."""
    import socket  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    host, port = _split(s.coordinator_address)
    if s.process_id == 0:
        if not is_loopback(s.coordinator_address):
            return  # binds on all interfaces under another name; let JAX report it
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError as e:
                raise DistributedSetupError(
                    f"process 0 cannot serve the coordinator at {s.coordinator_address}: {e}; "
                    "pick a free port (the same one for every process)") from e
        return
    deadline = time.monotonic() + s.initialization_timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedSetupError(
                    f"process {s.process_id} of {s.num_processes}: nothing answered at the "
                    f"coordinator address {s.coordinator_address} within "
                    f"{s.initialization_timeout} s ({e}); start process 0 with the same "
                    "--coordinator_address, or raise --initialization_timeout") from e
            time.sleep(0.2)


def initialize(settings: Settings) -> bool:
    """Starts ``jax.distributed`` when ``settings`` ask for it (see the module docstring).

    Must run before anything touches a JAX device. Returns True when the runtime was started.
    Non-zero processes get absl logging at ERROR level only (process 0 does the talking)."""
    s = resolve(settings)
    if not wanted(s):
        return False
    import jax  # pylint: disable=g-import-not-at-top

    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = dict(coordinator_address=s.coordinator_address, num_processes=s.num_processes,
                  process_id=s.process_id, initialization_timeout=s.initialization_timeout,
                  heartbeat_timeout_seconds=s.heartbeat_timeout)
    if s.coordinator_address is not None and s.process_id is not None:
        _check_coordinator(s)
    if s.local_device_ids is not None:
        kwargs["local_device_ids"] = list(s.local_device_ids)
    if is_loopback(s.coordinator_address):
        kwargs["coordinator_bind_address"] = s.coordinator_address
        try:
            _pin_gloo_to_loopback()
        except Exception as e:  # noqa: BLE001 - JAX internals moved: collectives use the host name
            logging.warning("could not pin the CPU collectives to 127.0.0.1 (%s)", e)
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        who = (f"process {s.process_id} of {s.num_processes}" if s.process_id is not None
               else "this process")
        raise DistributedSetupError(
            f"{who} could not join the distributed runtime at "
            f"{s.coordinator_address or '(auto-detected coordinator)'}: {e}. Check that every "
            "process was started with the same --coordinator_address and --num_processes, that "
            "process 0 is running, and that the port is free and reachable") from e
    if jax.process_index() != 0:
        logging.set_verbosity(logging.ERROR)
    return True


def process_rows(sharding, global_batch: int) -> tuple[int, int]:
    """(index, count) such that this process feeds rows [index * B / count, (index + 1) * B / count)
    of every global batch of ``global_batch`` rows laid out by ``sharding`` (rows over its first
    axis). Processes whose devices hold the same rows (e.g. a tensor axis spanning processes)
    get the same index; with one process it is (0, 1)."""
    index_map = sharding.addressable_devices_indices_map((global_batch,))
    spans = sorted({(sl[0].indices(global_batch)[0], sl[0].indices(global_batch)[1])
                    for sl in index_map.values()})
    start, stop = spans[0][0], spans[-1][1]
    covered = np.zeros(global_batch, bool)
    for a, b in spans:
        covered[a:b] = True
    size = stop - start
    if not covered[start:stop].all() or global_batch % size or start % size:
        raise DistributedSetupError(
            f"this process's devices hold rows {spans} of a {global_batch}-row batch, which are "
            "not one aligned block; order config.mesh so that each process's devices are "
            "contiguous along data*fsdp (put 'tensor' within a host)")
    return start // size, global_batch // size


def barrier(name: str) -> None:
    """Waits until every process of a multi-process run reaches this point (no-op alone)."""
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        multihost_utils.sync_global_devices(name)
