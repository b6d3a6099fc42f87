"""What keeps a training workdir safe, without JAX: one run at a time, and a resumed run that is
the run which wrote the checkpoints.

* ``WorkdirLock``: an exclusive ``fcntl`` lock on ``WORKDIR/.lock`` held for the whole run (by
  process 0 of a multi-process run). The kernel drops it when the process dies, so a killed run
  never leaves a stale lock; the file itself stays and records who held it last.
* ``saved_config`` / ``config_changes``: the config the newest checkpoint was written with,
  compared key by key with the one about to resume. Keys that define the train state or the data
  stream (``task``, ``seed``, ``model.*``, ``data.*``, ``train.batch_size``) must not change;
  the schedule's keys may, with a warning.
* ``set_aside``: the explicit way to start over in a used workdir (``config.train.start_over``):
  the previous run's files move to ``WORKDIR/previous_runs/<time>/``; nothing is deleted.
* Checkpoint checksums: ``write_manifest`` records the CRC32 and size of every file of a committed
  checkpoint step in ``<step>/checksums.json``; ``verify_manifest`` compares them on restore.
* Reading a finished run: ``read_workdir`` (its config and tokenizer, checked without JAX) and
  ``load_workdir`` / ``latest_params`` (the params of its newest readable step), used by
  ``python -m icml_jax.sample``, the experiments and the notebooks.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import zlib

import ml_collections

from icml_jax.config_utils import complete_config
from icml_jax.data.tokenizers import build_tokenizer
from icml_jax.train import missing_checkpoints
from icml_jax.train.metrics import write_json

LOCK_FILE = ".lock"
MANIFEST = "checksums.json"

# keys whose change makes the checkpoint another run's state: its params, optimizer state or data
# position would be read into the wrong structure or continue the wrong stream
_FIXED_PREFIXES = ("task", "seed", "model.", "data.", "train.batch_size")
# keys under those prefixes that change neither the state nor the data: a location (moving the
# TFDS folder does not change the data) and how the same params are computed
_FREE_KEYS = ("data.data_dir", "model.remat", "model.dtype", "model.rmt.residual_dtype",
              "model.decode_unrolled")
# decode-time settings: the KV-cache policy is never part of training (the train forward has no
# cache), so a run resumes under another one (e.g. a changed default SnapKV pooling kernel)
_FREE_PREFIXES = ("model.kv_policy.",)
# config keys added later, with the value that means "as before": a run saved without one resumes
ADDED_DEFAULTS = {"model.lowrank": 0, "model.blocks.attention": "", "model.blocks.ffn": ""}
# keys that define the learning-rate schedule (optimizer.lr_schedule)
SCHEDULE_KEYS = ("train.steps", "train.lr", "train.warmup_steps", "train.min_lr_ratio")
# files and folders of a run that start_over moves aside
RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "config.json", "tensorboard",
             "loss_curve.png")


class WorkdirError(RuntimeError):
    """A workdir that cannot be used as asked; the message says why and what to do."""


class WorkdirLock:
    """``with WorkdirLock(workdir):`` owns the workdir or raises ``WorkdirError`` at once."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd = None

    def acquire(self) -> "WorkdirLock":
        workdir = os.path.dirname(self.path)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirError(f"cannot write the lock file {self.path} ({e.strerror}); the workdir "
                               "must be writable: fix its permissions or pass another --workdir"
                               ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise WorkdirError(
                f"the workdir {workdir} is in use by another run ({holder}); "
                "wait for it to finish, stop it, or pass another --workdir") from None
        except OSError as e:  # e.g. a network file system without lock support
            os.close(fd)
            raise WorkdirError(f"cannot lock {self.path} ({e.strerror}): the file system of the "
                               "workdir does not support fcntl locks; use a local or lock-capable "
                               "folder as --workdir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def committed_steps(checkpoint_dir: str) -> list[int]:
    """The step folders orbax committed (a ``commit_success.txt`` or ``_CHECKPOINT_METADATA`` in a
    numbered folder), ascending; temporary folders of unfinished saves are not steps."""
    if not os.path.isdir(checkpoint_dir):
        return []
    steps = []
    for name in os.listdir(checkpoint_dir):
        path = os.path.join(checkpoint_dir, name)
        if name.isdigit() and any(os.path.exists(os.path.join(path, f))
                                  for f in ("commit_success.txt", "_CHECKPOINT_METADATA")):
            steps.append(int(name))
    return sorted(steps)


def saved_config(workdir: str) -> tuple[dict | None, str]:
    """(config dict, where it was read) of the newest committed checkpoint step that has a
    readable config, else of ``WORKDIR/config.json``; (None, "") when neither exists."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    candidates = [os.path.join(ckpt_dir, str(s), "config", "metadata")
                  for s in reversed(committed_steps(ckpt_dir))]
    for path in candidates + [os.path.join(workdir, "config.json")]:
        try:
            with open(path) as f:
                return complete_config(json.load(f)), path
        except (OSError, ValueError):
            continue
    return None, ""


def _flat(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = tuple(v) if isinstance(v, list) else v
    return out


def config_changes(saved: dict, new: dict) -> dict:
    """{"fixed": [...], "schedule": [...], "other": [...]} of the dotted keys whose values differ
    (or that only one side has), each as "key: old -> new"."""
    a, b = (_flat(saved) if isinstance(saved, dict) else {}), _flat(new)
    out = {"fixed": [], "schedule": [], "other": []}
    for key in sorted(set(a) | set(b)):
        old, cur = a.get(key, "<absent>"), b.get(key, "<absent>")
        if old == "<absent>" and key in ADDED_DEFAULTS and _same(ADDED_DEFAULTS[key], cur):
            continue  # a key added after the run was written, at the value the run had
        if (_same(old, cur) or key in _FREE_KEYS or key.startswith(_FREE_PREFIXES)
                or key == "train.start_over"):
            continue
        kind = ("schedule" if key in SCHEDULE_KEYS else
                "fixed" if any(key == p or key.startswith(p) for p in _FIXED_PREFIXES) else "other")
        out[kind].append(f"{key}: {old!r} -> {cur!r}")
    return out


def _same(x, y) -> bool:
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    if isinstance(x, (int, float)) and isinstance(y, (int, float)) and not isinstance(x, bool):
        return float(x) == float(y)
    return x == y


def set_aside(workdir: str) -> str | None:
    """Moves the previous run's files (``RUN_FILES``) to ``WORKDIR/previous_runs/<time>/``;
    returns that folder, or None when there was nothing to move."""
    present = [n for n in RUN_FILES if os.path.lexists(os.path.join(workdir, n))]
    if not present:
        return None
    dest = os.path.join(workdir, "previous_runs", time.strftime("%Y%m%d-%H%M%S"))
    base, i = dest, 1
    while os.path.exists(dest):
        dest, i = f"{base}-{i}", i + 1
    os.makedirs(dest)
    for name in present:
        os.rename(os.path.join(workdir, name), os.path.join(dest, name))
    return dest


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, files in os.walk(step_dir):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str) -> None:
    """Writes ``step_dir/checksums.json`` ({relative path: [size, crc32]}) atomically."""
    entries = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _crc(os.path.join(step_dir, rel))]
               for rel in _files(step_dir)}
    write_json(os.path.join(step_dir, MANIFEST), {"version": 1, "files": entries}, indent=None)


def has_manifest(step_dir: str) -> bool:
    return os.path.exists(os.path.join(step_dir, MANIFEST))


def verify_manifest(step_dir: str) -> str | None:
    """None when every file listed in ``step_dir/checksums.json`` is present with its recorded size
    and CRC32 (or the step has no manifest: written before checksums, or killed right after its
    commit); else what differs, e.g. "state/d/ab12...: checksum differs". A file that cannot be
    read (permissions) raises OSError: that says nothing against the checkpoint."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entries = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__})"
    for rel, (size, crc) in sorted(entries.items()):
        full = os.path.join(step_dir, rel)
        try:  # only a file that is not there is "missing"; other OSErrors propagate
            actual = os.stat(full).st_size
        except FileNotFoundError:
            return f"{rel}: missing"
        if actual != size:
            return f"{rel}: size {actual} bytes, {size} when saved"
        if _crc(full) != crc:
            return f"{rel}: checksum differs from the one recorded when it was saved"
    return None


def read_workdir(workdir: str):
    """(config, tokenizer) of a training workdir, checked without loading JAX or the params:
    the folder, its config.json and a checkpoints/ folder must exist."""
    if not os.path.isdir(workdir):
        raise WorkdirError(f"{workdir}: no such folder")
    cfg_path = os.path.join(workdir, "config.json")
    if not os.path.exists(cfg_path):
        raise WorkdirError(f"{workdir}: no config.json; is this a training workdir? (the trainer "
                           "writes config.json and checkpoints/ there)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = ml_collections.ConfigDict(complete_config(json.load(f)))
        config.model.vocab_size, config.model.max_seq_len, config.data.tokenizer  # pylint: disable=pointless-statement
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # incl. JSON / UTF-8 errors
        raise WorkdirError(f"{cfg_path}: not a trainer config ({type(e).__name__}: "
                           f"{str(e)[:200]}); the trainer rewrites it on the next run of this "
                           "workdir") from None
    error = missing_checkpoints(workdir)
    if error:
        raise WorkdirError(error)
    tokenizer = build_tokenizer(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise WorkdirError(f"tokenizer vocab {tokenizer.vocab_size} > model vocab "
                           f"{config.model.vocab_size}")
    return config, tokenizer


def latest_params(workdir: str, model_cfg: ml_collections.ConfigDict):
    """Params of the newest readable checkpoint step in WORKDIR/checkpoints -> (params, step).
    Loads JAX (the only function here that does)."""
    from icml_jax.train.checkpoint import CheckpointError, restore_model_params  # pylint: disable=g-import-not-at-top
    try:
        return restore_model_params(workdir, model_cfg)
    except CheckpointError as e:
        raise WorkdirError(str(e)) from e


def load_workdir(workdir: str):
    """(model_cfg, params, tokenizer, description) of a training workdir's newest step."""
    config, tokenizer = read_workdir(workdir)
    params, step = latest_params(workdir, config.model)
    return config.model, params, tokenizer, f"{workdir} step {step}"
