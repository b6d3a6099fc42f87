"""Entry point: ``python -m icml_jax.main --config=configs/lm.py:PRESET --workdir=DIR [--config.a.b=v]``.

Rerunning the same command in the same workdir resumes from the latest checkpoint.

Several processes (hosts) run the same command, each with its own ``--process_id`` (or none on a
Cloud TPU pod, where it is detected); see ``icml_jax.train.distributed`` and the README's
"Multi-host" section. ``--workdir`` must then be one folder every process can write (a shared
file system).
"""
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from icml_jax import logs, xla_env


def expand_flagfiles(argv: list) -> list:
    """``argv`` with its ``--flagfile`` arguments replaced by the flags they hold (absl's own
    expansion, both ``--flagfile=F`` and ``--flagfile F``), so each file is read once. A flag file
    that cannot be read ends the program with a one-line error (exit status 2)."""
    try:
        return flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
    except flags.Error as e:
        print(f"error: {str(e).replace('ERROR:: ', '')}; fix the --flagfile path", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # Restart (huge pages) before any flag file is read, then read the flag files once, into argv:
    # ml_collections' config flag reads them while it is being defined and absl again when it
    # parses, which leaves a piped one (--flagfile=/dev/stdin, <(...)) empty the second time.
    xla_env.restart_with_hugepages()
    sys.argv = expand_flagfiles(sys.argv)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/lm.py:small.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and plots.")
flags.mark_flags_as_required(["config", "workdir"])
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "auto", ["auto", "on", "off"],
    "Start jax.distributed: auto = when a coordinator address is given (flag or "
    "JAX_COORDINATOR_ADDRESS) or a Cloud TPU pod is detected; on = always (JAX auto-detects "
    "TPU, SLURM, Open MPI settings left unset); off = never.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "HOST:PORT of process 0's coordinator (env JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Number of processes in the run (env JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "This process's index, 0 .. num_processes-1 (env JAX_PROCESS_ID).")
_LOCAL_DEVICES = flags.DEFINE_list("local_device_ids", None,
                                   "Local device ids this process uses (env JAX_LOCAL_DEVICE_IDS), "
                                   "e.g. 0 for one GPU per process.")
_INIT_TIMEOUT = flags.DEFINE_integer("initialization_timeout", 300,
                                     "Seconds to wait for all processes to join.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat_timeout", 100,
                                  "Seconds without heartbeats after which a process counts as dead "
                                  "and the others stop.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logs.show_own_logs()  # icml_jax's own lines at INFO; orbax & co. from WARNING
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation
    from icml_jax.train import distributed

    try:
        multi = distributed.initialize(distributed.Settings(
            mode=_DISTRIBUTED.value, coordinator_address=_COORDINATOR.value,
            num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
            local_device_ids=(tuple(int(i) for i in _LOCAL_DEVICES.value)
                              if _LOCAL_DEVICES.value else None),
            initialization_timeout=_INIT_TIMEOUT.value, heartbeat_timeout=_HEARTBEAT.value))
    except ValueError as e:  # DistributedSetupError and bad flag values
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)

    import jax  # after jax.distributed.initialize  # pylint: disable=g-import-not-at-top

    from icml_jax.train import checkpoint as ckpt_lib  # pylint: disable=g-import-not-at-top
    from icml_jax.train import trainer  # pylint: disable=g-import-not-at-top
    from icml_jax.train.workdir import WorkdirError  # pylint: disable=g-import-not-at-top

    where = f"process {jax.process_index()} of {jax.process_count()}: " if multi else ""
    try:
        trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except trainer.Interrupted as e:  # exit status of a process killed by that signal
        print(f"{where}{e}", file=sys.stderr, flush=True)
        _exit(128 + e.signum, multi)
    except (ValueError, FileNotFoundError, ckpt_lib.CheckpointError, WorkdirError,
            trainer.NonFiniteLossError) as e:
        print(f"error: {where}{e}", file=sys.stderr, flush=True)
        _exit(1, multi)
    except jax.errors.JaxRuntimeError as e:
        if not multi:
            raise
        print(f"error: {where}a computation across processes failed, most likely because another "
              f"process died or was stopped (see its log): {str(e)[:500]}", file=sys.stderr,
              flush=True)
        _exit(1, multi)


def _exit(code: int, multi: bool):
    """Exits; in a multi-process run without the shutdown barrier, which would wait (up to
    jax.distributed's shutdown timeout) for peers that may be dead or stuck."""
    if multi:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pylint: disable=protected-access
    sys.exit(code)


def config_flag_error(argv) -> str | None:
    """The one-line error for a ``--config`` (the last one, as absl reads it) that names no file
    or an unknown preset, else None; absl would report either as a traceback."""
    from icml_jax.config_utils import load_config  # pylint: disable=g-import-not-at-top
    spec = None
    for i, a in enumerate(argv[1:], 1):
        if a.startswith("--config="):
            spec = a.split("=", 1)[1]
        elif a == "--config" and i + 1 < len(argv):
            spec = argv[i + 1]
    if not spec:
        return None
    path = spec.partition(":")[0]
    if not os.path.isfile(path):
        return (f"--config={spec}: no config file {path!r} (relative to {os.getcwd()}); "
                "e.g. --config=configs/lm.py:tiny")
    try:
        load_config(spec)
    except ValueError as e:  # an unknown preset
        return f"--config={spec}: {e}"
    return None


def run():
    """app.run with config mistakes (missing file, unknown preset or key) reported in one line
    instead of a traceback."""
    bad_config = config_flag_error(sys.argv)
    if bad_config:
        print(f"error: {bad_config}", file=sys.stderr)
        sys.exit(2)
    try:
        app.run(main)
    except (KeyError, AttributeError) as e:
        if flags.FLAGS.is_parsed():  # not a flag-parsing failure: a real bug, keep the traceback
            raise
        bad = [a for a in sys.argv[1:] if a.startswith("--config.")]
        msg = str(e).strip("'\"").replace("\\n", " ").replace("\\'", "'").replace('\\"', '"')
        print(f"error: unknown config key in {' '.join(bad) or 'the config'}: {msg}. "
              "List the valid keys with `python -c \"from icml_jax.config_utils import load_config; "
              "print(load_config('CONFIG.py:PRESET'))\"`.", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
