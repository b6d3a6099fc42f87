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
import json
import os
import sys
import time
import zlib

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from icml_jax.train import missing_checkpoints


class CheckpointError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data_state": ocp.JsonCheckpointHandler(),
                           "data": grain.checkpoint.CheckpointHandler(),  # earlier checkpoints
                           "config": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state, data_iter, config_dict: dict) -> None:
        args = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config_dict)}
        if data_iter is not None:
            args["data_state"] = ocp.args.JsonSave(_data_state(data_iter))
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def all_steps(self):
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state, data_iter):
        """Restores the newest readable step into ``abstract_state`` (ShapeDtypeStructs with
        shardings) and ``data_iter``; returns (state, step), or (None, 0) without checkpoints."""
        steps = self.all_steps()
        for step in reversed(steps):
            path = os.path.join(self.directory, str(step))
            try:
                args = {"state": ocp.args.StandardRestore(abstract_state)}
                json_data = os.path.isdir(os.path.join(path, "data_state"))
                if data_iter is not None:
                    args["data_state" if json_data else "data"] = (
                        ocp.args.JsonRestore() if json_data
                        else grain.checkpoint.CheckpointRestore(data_iter))
                restored = self.manager.restore(step, args=ocp.args.Composite(**args))
                if data_iter is not None and json_data:
                    data_iter.set_state(restored["data_state"]["iterator"])
                return restored["state"], step
            except Exception as e:  # noqa: BLE001 - any read/parse failure means a bad checkpoint
                if jax.process_count() > 1:
                    raise CheckpointError(
                        f"process {jax.process_index()}: checkpoint {path} could not be restored "
                        f"({type(e).__name__}: {str(e)[:300]}). Nothing was moved or deleted; "
                        "resume this workdir in a single process (it then moves the bad step "
                        "aside and falls back to the previous one), or start a new --workdir"
                    ) from e
                if os.path.isdir(path):
                    aside = os.path.join(self.directory, f"corrupt_{step}_{int(time.time())}")
                    os.rename(path, aside)
                    logging.warning("checkpoint %s could not be restored (%s: %s); moved it to %s "
                                    "and trying the previous one", path, type(e).__name__, e, aside)
                    print(f"WARNING: checkpoint {path} is unreadable ({type(e).__name__}: "
                          f"{str(e)[:300]}); moved it to {aside}, falling back to the previous step")
                self.manager.reload()
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} could be restored; "
                "see the warnings above, or start fresh in a new --workdir")
        return None, 0

    def wait(self):
        """Blocks until an asynchronous save has been committed."""
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()


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


def restore_params(workdir: str, abstract_params):
    """Only the params of the newest readable step of a training workdir -> (params, step).

    ``abstract_params`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (the layout to
    restore into: any mesh or device count, whatever the run that wrote it used). The rest of the
    saved train state (optimizer, rng, data iterator) is not read. An unreadable step is skipped
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
    target = {"params": abstract_params}
    errors = []
    for step in reversed(steps):
        try:
            restored = manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    target, partial_restore=True,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(target))))
            return restored["state"]["params"], step
        except Exception as e:  # noqa: BLE001 - any read/parse failure: try the previous step
            errors.append(f"step {step}: {type(e).__name__}: {str(e)[:300]}")
            print(f"WARNING: checkpoint {directory}/{step} could not be restored "
                  f"({type(e).__name__}: {str(e)[:300]}); trying the previous step", file=sys.stderr)
    raise CheckpointError(f"none of the checkpoints {steps} in {directory} could be restored:\n  "
                          + "\n  ".join(errors))


def restore_model_params(workdir: str, model_cfg):
    """``restore_params`` for a decoder of ``model_cfg`` (e.g. an SFT or DPO policy) onto this
    process's first device -> (params, step)."""
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    from icml_jax.models.decoder import build_model  # pylint: disable=g-import-not-at-top

    tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
    abstract = nn.meta.unbox(jax.eval_shape(
        lambda: build_model(model_cfg).init(jax.random.key(0), tokens))["params"])
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            abstract)
    return restore_params(workdir, abstract)
