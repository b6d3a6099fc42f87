"""orbax CheckpointManager holding train state + data-iterator state + config, with safe restore.

Layout: ``WORKDIR/checkpoints/<step>/{state,data_state,config}``. orbax writes each step into a
temporary directory and renames it on commit, so a run killed mid-save leaves no half-written step
behind. A step that fails to restore (corrupted files) is moved aside to ``corrupt_<step>_<time>``
(never deleted) and the previous step is tried, with a warning; in a multi-process run it is left
where it is and the run stops with an error instead (the processes cannot agree on a fallback).

Multi-process runs: every process writes the shards of the train state it holds and process 0
commits the step (orbax). The data iterator's position (``data_state``, JSON) is gathered from all
processes and written once: a single-stream iterator's state is the same everywhere (every process
walks the same global batches and keeps its rows), checked; per-stream states
(``config.data.streams`` > 1, each process holding some streams) are merged. So a checkpoint
restores under any process count, device count or mesh shape (the train state is read straight
into the new shardings).
Checkpoints of earlier versions kept the iterator as grain's per-process files (``data``); they
still restore when the process count is the one that wrote them.
"""
import errno
import json
import os
import time
import zlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from icml_jax.train import missing_checkpoints
from icml_jax.train import workdir as workdir_lib


class CheckpointError(RuntimeError):
    pass


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is readable but holds another structure than the one asked for (another
    model, optimizer or task): nothing is moved, the run stops."""


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 checksums: bool = True):
        self.directory = os.path.abspath(directory)
        self.checksums = checksums
        self._unsealed = []  # steps saved by this run whose checksum manifest is not written yet
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data_state": ocp.JsonCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),  # earlier checkpoints
                           "config": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state, data_iter, config_dict: dict) -> None:
        self._seal()
        args = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config_dict)}
        if data_iter is not None:
            args["data_state"] = ocp.args.JsonSave({**_data_state(data_iter), "step": int(step)})
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)
        self._unsealed.append(int(step))
        self.poll()  # a synchronous save is committed by now

    def poll(self):
        """Writes the checksums of committed steps once no save is in flight (cheap to call every
        step: the train loop does, so an async step is sealed within a step of its commit)."""
        if self._unsealed and not self.manager.is_saving_in_progress():
            self._seal()

    def _seal(self):
        """Waits for the save in flight, then writes the checksum manifest of every step this run
        committed (process 0; the other processes' shards are committed by then)."""
        if not self._unsealed:
            return
        self.manager.wait_until_finished()
        if self.checksums and jax.process_index() == 0:
            for step in self._unsealed:
                path = os.path.join(self.directory, str(step))
                if os.path.isdir(path):  # not already deleted by max_to_keep
                    workdir_lib.write_manifest(path)
        self._unsealed = []

    def all_steps(self):
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state, data_iter, set_aside: bool = True, older=()):
        """Restores the newest readable step into ``abstract_state`` (ShapeDtypeStructs with
        shardings) and ``data_iter``; returns (state, step), or (None, 0) without checkpoints.
        ``older``: functions ``abstract_state -> (target, convert)`` for layouts earlier versions
        wrote; a step whose tree fits ``target`` instead is restored into it and converted.

        A step is set aside (``corrupt_<step>_<time>``, never deleted) only when it is unreadable
        on its own terms: a file differs from its recorded checksum (or is missing), or its
        data-iterator state belongs to another step; or, for a step without checksums, its
        metadata or arrays cannot be read. Then the previous step is tried. Everything else leaves
        every file where it is and raises: a step that reads fine but holds another structure
        (``CheckpointMismatchError``), a step whose files match their checksums but still fail to
        restore (so the cause is elsewhere: memory, library version), file-system errors
        (permissions, I/O, open files) and old grain-format data states. ``set_aside=False``
        (readers that do not own the workdir) skips bad steps with a warning instead of moving
        them."""
        steps = self.all_steps()
        for step in reversed(steps):
            path = os.path.join(self.directory, str(step))
            sealed = self.checksums and workdir_lib.has_manifest(path)
            try:
                problem = workdir_lib.verify_manifest(path) if sealed else None
            except OSError as e:
                self._raise_if_environment(e, path, force=True)
            if problem:
                self._set_aside(step, f"a file differs from when it was saved: {problem}",
                                set_aside)
                continue
            try:
                saved = self.manager.item_metadata(step)["state"]
            except Exception as e:  # noqa: BLE001 - unparsable metadata
                self._raise_if_environment(e, path, force=sealed)
                self._set_aside(step, f"{type(e).__name__}: {str(e)[:300]}", set_aside)
                continue
            target, convert = abstract_state, None
            differences = tree_differences(saved, abstract_state)
            for layout in older if differences else ():
                alt, alt_convert = layout(abstract_state)
                if not tree_differences(saved, alt):
                    target, convert, differences = alt, alt_convert, []
                    break
            if differences:
                raise CheckpointMismatchError(
                    f"{path} holds a train state of another structure than this config builds "
                    f"({'; '.join(differences)}); nothing was moved. Resume with the config that "
                    "wrote it, or train elsewhere (another --workdir, or "
                    "--config.train.start_over=True to move this run aside)")
            try:
                args = {"state": ocp.args.StandardRestore(target)}
                json_data = os.path.isdir(os.path.join(path, "data_state"))
                if data_iter is not None:
                    args["data_state" if json_data else "data"] = (
                        ocp.args.JsonRestore() if json_data
                        else grain.checkpoint.CheckpointRestore(data_iter))
                restored = self.manager.restore(step, args=ocp.args.Composite(**args))
            except Exception as e:  # noqa: BLE001 - classified below
                # files that match their checksums, or an old grain-format data state (readable
                # only under the process count that wrote it), are not corrupt
                self._raise_if_environment(e, path, force=sealed or (
                    data_iter is not None and not json_data))
                self._set_aside(step, f"{type(e).__name__}: {str(e)[:300]}", set_aside)
                continue
            if data_iter is not None and json_data:
                saved_step = restored["data_state"].get("step", step)
                if saved_step != step:
                    self._set_aside(step, f"its data-iterator state is the one of step {saved_step}",
                                    set_aside)
                    continue
                data_iter.set_state(restored["data_state"]["iterator"])
            state = restored["state"]
            return (convert(state) if convert is not None else state), step
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} could be restored; "
                "see the warnings above, or start fresh in a new --workdir")
        return None, 0

    def _raise_if_environment(self, e: Exception, path: str, force: bool = False):
        """A failure of the machine (permissions, I/O, memory, open files), or any failure when
        ``force`` (the files are known good), says nothing against the checkpoint: stop without
        moving it."""
        if force or _environmental(e):
            cause = ("its files match their checksums, so the checkpoint is intact"
                     if force and not _environmental(e) else "a file-system or memory error")
            raise CheckpointError(
                f"checkpoint {path} could not be restored ({type(e).__name__}: {str(e)[:300]}); "
                f"{cause}. Nothing was moved: fix the cause (permissions, mount, memory, library "
                f"version) and rerun, or move the step aside yourself (mv {path} "
                f"{os.path.dirname(path)}/corrupt_{os.path.basename(path)}) to resume from the "
                "previous one") from e

    def _set_aside(self, step: int, why: str, move: bool = True):
        path = os.path.join(self.directory, str(step))
        if not move:
            logging.warning("checkpoint %s is unreadable (%s); using the previous step (nothing "
                            "was moved)", path, why)
            return
        if jax.process_count() > 1:
            raise CheckpointError(
                f"process {jax.process_index()}: checkpoint {path} could not be restored ({why}). "
                "Nothing was moved or deleted; resume this workdir in a single process (it then "
                "moves the bad step aside and falls back to the previous one), or start a new "
                "--workdir")
        if os.path.isdir(path):
            aside = os.path.join(self.directory, f"corrupt_{step}_{int(time.time())}")
            os.rename(path, aside)
            logging.warning("checkpoint %s is unreadable (%s); moved it to %s, falling back to "
                            "the previous step", path, why, aside)
        self.manager.reload()

    def close(self):
        self.manager.wait_until_finished()
        self._seal()
        self.manager.close()


_ENV_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EIO,
               errno.EMFILE, errno.ENFILE, errno.ESTALE, errno.ETIMEDOUT, errno.ENOMEM)
_ENV_MARKERS = ("PERMISSION_DENIED", "Permission denied", "RESOURCE_EXHAUSTED", "out of memory",
                "Too many open files", "Input/output error", "Stale file handle")


def _environmental(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno in _ENV_ERRNOS):
            return True
        text = str(e)
        if any(marker in text for marker in _ENV_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


def _leaf_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _leaves(tree) -> dict:
    """{dotted leaf name: (shape, dtype name)} of arrays, ShapeDtypeStructs or orbax metadata."""
    return {_leaf_name(p): (tuple(x.shape), np.dtype(x.dtype).name)
            for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(x, "shape") and hasattr(x, "dtype")}


def tree_differences(saved, wanted, prefix: str = "", ignore=()) -> list[str]:
    """How the leaves of ``saved`` (a checkpoint's metadata tree) and ``wanted`` (the restore
    target) differ: names missing from the checkpoint, names only the checkpoint has (except
    those under an ``ignore`` path) and leaves of another shape or dtype; [] when they match.
    ``prefix`` is put before every name shown."""
    a, b = _leaves(saved), _leaves(wanted)

    def names(keys):
        keys = sorted(keys)
        shown = ", ".join(prefix + k for k in keys[:6])
        return shown + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    out = []
    missing = set(b) - set(a)
    extra = {k for k in set(a) - set(b) if not any(k == i or k.startswith(i + ".") for i in ignore)}
    if missing:
        out.append(f"missing from the checkpoint: {names(missing)}")
    if extra:
        out.append(f"in the checkpoint but not in this model: {names(extra)}")
    changed = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    for k in changed[:6]:
        out.append(f"{prefix}{k} is {list(a[k][0])} {a[k][1]} in the checkpoint, "
                   f"{list(b[k][0])} {b[k][1]} here")
    if len(changed) > 6:
        out.append(f"and {len(changed) - 6} more leaves of another shape or dtype")
    return out


def _allgather_json(obj) -> list:
    """``obj`` of every process (JSON-able), in process order."""
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    blob = np.frombuffer(json.dumps(obj, sort_keys=True).encode(), np.uint8)
    n = int(np.max(multihost_utils.process_allgather(np.asarray(len(blob), np.int32))))
    rows = multihost_utils.process_allgather(np.pad(blob, (0, n - len(blob))))
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in np.asarray(rows).reshape(-1, n)]


def _data_state(data_iter) -> dict:
    """The iterator position as JSON valid for any process count. In a multi-process run the
    processes' states are gathered: per-stream states (``StreamsIterator``) are merged, a whole
    iterator's state must be the same everywhere; a disagreement means the processes read
    different data and stops the save."""
    state = data_iter.get_state()
    if jax.process_count() == 1:
        return {"iterator": state}
    states = _allgather_json(state)
    if all(isinstance(st, dict) and "streams" in st for st in states):
        merged = {}
        for st in states:
            for k, v in st["streams"].items():
                if merged.setdefault(k, v) != v:
                    _positions_differ(states)
        return {"iterator": {"streams": merged}}
    if any(st != states[0] for st in states):
        _positions_differ(states)
    return {"iterator": state}


def _positions_differ(states):
    crcs = [zlib.crc32(json.dumps(st, sort_keys=True).encode()) for st in states]
    raise CheckpointError(
        f"the data iterators of the processes are at different positions (state checksums {crcs}), "
        "so the checkpoint was not written; every process must run the same config (same data, "
        "batch size, streams and seed)")


def restore_params(workdir: str, abstract_params, ignore=(), step: int | None = None):
    """Only the params of the newest readable step of a training workdir -> (params, step);
    with ``step``, that step's (CheckpointError when it was not kept or cannot be read).

    ``abstract_params`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (the layout to
    restore into: any mesh or device count, whatever the run that wrote it used). The rest of the
    saved train state (optimizer, rng, data iterator) is not read. The checkpoint's params must be
    exactly the target's: a leaf missing from either side, or of another shape or dtype, raises
    ``CheckpointMismatchError`` naming them, except checkpoint leaves under the dotted param paths
    the caller declares unused (``ignore``, e.g. ``("io.lm_head",)``). An unreadable step (checksum, read error) is skipped
    with a warning; nothing is moved or deleted (the workdir may belong to a live run)."""
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    error = missing_checkpoints(workdir)
    if error:
        raise CheckpointError(error)
    manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_handlers={"state": ocp.PyTreeCheckpointHandler()})
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointError(f"{directory} holds no finished checkpoint step; train longer (steps >= "
                              "config.train.checkpoint_every, or to the end of the run)")
    if step is not None:
        if step not in steps:
            raise CheckpointError(f"{directory} holds no checkpoint of step {step} (it has "
                                  f"{steps}); pick one of those, or keep more with "
                                  "config.train.keep_checkpoints / checkpoint_steps")
        steps = [step]
    target = {"params": abstract_params}
    errors = []
    for step in reversed(steps):
        path = os.path.join(directory, str(step))
        try:
            problem = workdir_lib.verify_manifest(path)
            if problem:
                raise CheckpointError(f"a file differs from when it was saved: {problem}")
            saved = manager.item_metadata(step)["state"]
            differences = tree_differences(saved.get("params", {}), abstract_params, "params.",
                                           ignore)
            if differences:
                task = _saved_task(path)
                raise CheckpointMismatchError(
                    f"{path}: its params do not fit the model asked for ("
                    + "; ".join(differences) + ")" + (f"; the workdir was trained by task {task!r}"
                                                     if task else ""))
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, partial_restore=True,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(target))))
            return restored["state"]["params"], step
        except CheckpointMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 - any read/parse failure: try the previous step
            errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
            logging.warning("checkpoint %s could not be restored (%s: %s); trying the previous "
                            "step", path, type(e).__name__, str(e)[:300])
    raise CheckpointError(f"none of the checkpoints {steps} in {directory} could be restored:\n  "
                          + "\n  ".join(errors))


def _saved_task(step_dir: str) -> str | None:
    try:
        with open(os.path.join(step_dir, "config", "metadata")) as f:
            return json.load(f).get("task")
    except (OSError, ValueError, AttributeError):
        return None


def restore_model_params(workdir: str, model_cfg, step: int | None = None):
    """``restore_params`` for a decoder of ``model_cfg`` (e.g. an SFT or DPO policy) onto this
    process's first device -> (params, step); ``step``: that step's, else the newest."""
    from icml_jax.models.decoder import build_model  # pylint: disable=g-import-not-at-top

    tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
    return restore_module_params(workdir, build_model(model_cfg), tokens, step=step)


def restore_module_params(workdir: str, module, *example_args, step: int | None = None):
    """``restore_params`` for the params of the flax ``module`` (their layout: what
    ``module.init(key, *example_args)`` makes; e.g. a ``StepClassifier`` or ``RewardModel``) onto
    this process's first device -> (params, step)."""
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    abstract = nn.meta.unbox(jax.eval_shape(
        lambda: module.init(jax.random.key(0), *example_args))["params"])
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            abstract)
    return restore_params(workdir, abstract, step=step)
