"""The train loop, top to bottom: config -> mesh -> sharded state -> jitted step -> eval/ckpt.

Every task (``config.task``) provides the model, the loss and the data; this file is the same for
all of them. See ``train_and_evaluate``.
"""
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from icml_jax import sharding as mesh_lib
from icml_jax import tasks, xla_env
from icml_jax.analysis.flops import train_flops_per_token
from icml_jax.data import mass as data_mass
from icml_jax.models import contract as model_contract
from icml_jax.models import hetero
from icml_jax.train import checkpoint as ckpt_lib
from icml_jax.train import missing_checkpoints
from icml_jax.train import distributed
from icml_jax.train import evic as evic_lib
from icml_jax.train import workdir as workdir_lib
from icml_jax.train.metrics import MetricsWriter, plot_loss_curve, write_json
from icml_jax.train.optimizer import lr_schedule, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of completed updates
    params: dict
    opt_state: optax.OptState


@flax.struct.dataclass
class _TrainStateWithKey:
    """The train state as checkpoints written before 2026-12-02 hold it: with a PRNG key (uint32
    key data) that the step advanced and nothing read. Such steps restore through this layout."""
    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


def _with_key_layout(abstract: TrainState):
    """(restore target of the older layout, its conversion to ``TrainState``)."""
    sharding = jax.tree.leaves(abstract.params)[0].sharding
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(sharding.mesh, P()))
    return (_TrainStateWithKey(abstract.step, abstract.params, abstract.opt_state, key),
            lambda s: TrainState(s.step, s.params, s.opt_state))


class NonFiniteLossError(FloatingPointError):
    """The loss, the gradient norm or the updated params of a step were not finite; the run stops
    before that state is checkpointed."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run at a step boundary (after saving a checkpoint)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> tuple:
    """Checks the cross-field constraints the type system cannot; returns the mesh shape."""
    t, m = config.train, config.model
    shape = mesh_lib.mesh_shape(config.mesh, num_devices)
    if config.data.seq_len > m.max_seq_len:
        raise ValueError(f"config.data.seq_len={config.data.seq_len} is above the model's maximum "
                         f"config.model.max_seq_len={m.max_seq_len}; lower seq_len or raise max_seq_len")
    if config.data.seq_len <= 0:
        raise ValueError(f"config.data.seq_len must be positive, got {config.data.seq_len}")
    if t.steps <= 0:
        raise ValueError(f"config.train.steps must be positive, got {t.steps}")
    for section, keys in _POSITIVE.items():
        for key in keys:
            value = config[section].get(key)
            if value is not None and value <= 0:
                raise ValueError(f"config.{section}.{key} must be positive, got {value}")
    rows = shape[0] * shape[1]
    if t.batch_size % (rows * t.grad_accum):
        raise ValueError(
            f"config.train.batch_size={t.batch_size} must be divisible by data*fsdp={rows} times "
            f"config.train.grad_accum={t.grad_accum}")
    for key in ("checkpoint_every", "eval_every", "log_every"):
        if t[key] <= 0:
            raise ValueError(f"config.train.{key} must be positive, got {t[key]}")
    bad = [s for s in (t.get("checkpoint_steps") or ()) if not (isinstance(s, int) and s > 0)]
    if bad:
        raise ValueError(f"config.train.checkpoint_steps holds {bad}: give positive integer steps, "
                         "e.g. --config.train.checkpoint_steps='(10, 30, 100)'")
    if t.lr < 0:
        raise ValueError(f"config.train.lr={t.lr} is negative: the updates would climb the loss; "
                         "use a positive learning rate")
    if not t.lr < np.finfo(np.float32).max:
        raise ValueError(f"config.train.lr={t.lr} is not a finite float32 (the updates would be "
                         "inf or NaN); use a learning rate below 1e38, typically 1e-4 .. 1e-2")
    if t.lr == 0 and jax.process_index() == 0:
        logging.warning("config.train.lr=0: the params will not change during training")
    if m.num_heads % m.num_kv_heads:
        raise ValueError(f"config.model.num_heads={m.num_heads} is not a multiple of "
                         f"config.model.num_kv_heads={m.num_kv_heads}")
    model_contract.validate(m)  # the residual stream's and position embedding's own checks
    evic_lib.settings(config)  # config.evic's own checks (when enabled)
    scores_path, _ = data_mass.check_select_config(config.data)  # data.select_scores / select_ratio
    if scores_path:
        data_mass.read_scores(scores_path)  # a missing or malformed file stops here, not after a compile
    if m.num_kv_heads % shape[2]:
        raise ValueError(f"config.mesh.tensor={shape[2]} does not divide config.model.num_kv_heads="
                         f"{m.num_kv_heads}: tensor parallelism splits the KV heads; pick a tensor "
                         "size that divides them")
    if hetero.is_hetero(m):
        odd = sorted({a for a, _ in hetero.layout(m) if isinstance(a, int) and a % shape[2]})
        if odd:
            raise ValueError(f"config.mesh.tensor={shape[2]} does not divide the KV heads {odd} of "
                             "config.model.blocks.attention; pick a tensor size that divides every entry")
    return shape


# sizes that must be >= 1 (a key absent from a task's config is skipped); keep_checkpoints=0
# would keep no checkpoint at all, so a rerun would start over
_POSITIVE = {
    "model": ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
              "vocab_size", "max_seq_len"),
    "train": ("batch_size", "grad_accum", "keep_checkpoints"),
}


def make_train_step(task, tx, grad_accum: int, schedule=None):
    """(state, batch) -> (state, metrics). Loss and grads are token-weighted means over the whole
    global batch, so gradient accumulation gives the same update as one big batch. With an optax
    ``schedule``, the metrics carry the learning rate this step used (computed on device)."""

    def loss_and_grad(params, batch):
        def f(p):
            lsum, n, msums = task.loss(p, batch)
            return lsum, (n, msums)
        (lsum, (n, msums)), g = jax.value_and_grad(f, has_aux=True)(params)
        return lsum, n, msums, g

    def step_fn(state: TrainState, batch):
        if grad_accum == 1:
            lsum, n, msums, gsum = loss_and_grad(state.params, batch)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape((x.shape[0] // grad_accum, grad_accum) + x.shape[1:]).swapaxes(0, 1),
                batch)

            def body(carry, mb):
                out = loss_and_grad(state.params, mb)
                return jax.tree.map(jnp.add, carry, out), None

            zeros = jax.tree.map(jnp.zeros_like,
                                 jax.eval_shape(loss_and_grad, state.params,
                                                jax.tree.map(lambda x: x[0], micro)))
            (lsum, n, msums, gsum), _ = jax.lax.scan(body, zeros, micro)
        denom = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda g: g / denom, gsum)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        grad_norm = optax.global_norm(grads)
        # 1 when the state this step commits is usable: the host stops before saving otherwise
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(lsum) & jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)]))
        metrics = {"loss": lsum / denom, "grad_norm": grad_norm, "tokens": n,
                   "finite": finite.astype(jnp.float32)}
        metrics.update({k: v / denom for k, v in msums.items()})
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state), metrics

    return step_fn


def make_eval_step(task):
    def eval_fn(params, batch):
        lsum, n, msums = task.loss(params, batch)
        clash = {"nll", "tokens"} & set(msums)
        if clash:
            raise ValueError(f"task {type(task).__name__} returns metric(s) {sorted(clash)}, names "
                             "the evaluation totals use; rename them")
        return {"nll": lsum, "tokens": n, **msums}
    return eval_fn


def evaluate(eval_step, params, batches, to_global, perplexity: bool = True) -> dict:
    totals = None
    for b in batches:
        out = jax.device_get(eval_step(params, to_global(b)))
        totals = out if totals is None else jax.tree.map(np.add, totals, out)
    if totals is None:
        raise ValueError("the evaluation split produced no batches: the validation corpus is empty "
                         "(check config.data.*)")
    n = max(float(totals["tokens"]), 1.0)
    loss = float(totals["nll"]) / n
    out = {"eval_loss": loss, "eval_tokens": n}
    if perplexity:
        out["eval_perplexity"] = math.exp(min(loss, 80.0))
    out.update({f"eval_{k}": float(v) / n for k, v in totals.items() if k not in ("nll", "tokens")})
    return out


def _state_init(task, tx, config, mesh, rules):
    """(init_rng, boxed init fn, NamedShardings of the TrainState, its boxed shapes) for
    ``mesh``."""
    c = config
    dummy = task.dummy_batch(1, c.data.seq_len)
    init_rng = jax.random.split(jax.random.key(c.seed))[0]  # the params' key since the start

    def init_boxed(rng):
        params = task.init_params(rng, dummy)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    with mesh, nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(init_boxed, init_rng)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    return init_rng, init_boxed, shardings, boxed


def sharded_state(task, tx, config, mesh, rules):
    """(abstract, shardings, init): the TrainState as ShapeDtypeStructs carrying their
    shardings on ``mesh`` (a restore target: orbax reads a checkpoint straight into this layout),
    its NamedShardings, and ``init()`` -> the initial state, computed by
    ``jit(init, out_shardings)``. Only ``init`` compiles anything; a resumed run never calls it."""
    init_rng, init_boxed, shardings, boxed = _state_init(task, tx, config, mesh, rules)

    def init():
        with mesh, nn.logical_axis_rules(rules):
            return jax.jit(lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=shardings)(init_rng)
    return restore_target(nn.meta.unbox(boxed), shardings), shardings, init


class Setup(NamedTuple):
    """What training and loading a run share: the mesh and its logical-axis rules, the optimizer,
    the TrainState's restore target (``abstract``), its shardings and ``init()``."""
    mesh: Mesh
    rules: tuple
    tx: optax.GradientTransformation
    abstract: Any
    shardings: Any
    init: Callable


def setup(config: ml_collections.ConfigDict, task, devices=None) -> Setup:
    """The one set-up of ``train_and_evaluate`` and ``load_state``: mesh over ``devices``
    (default: all), rules, optimizer (``make_optimizer(config.train, model_cfg=config.model)``)
    and the sharded state of ``task``'s model. Nothing is compiled until ``init()``."""
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    rules = mesh_lib.logical_rules(config.mesh)
    tx = make_optimizer(config.train, model_cfg=config.model)
    abstract, shardings, init = sharded_state(task, tx, config, mesh, rules)
    return Setup(mesh, rules, tx, abstract, shardings, init)


def create_sharded_state(task, tx, config, mesh, rules):
    """The initial TrainState and its shardings: eval_shape(init) -> logical specs ->
    NamedShardings -> jit(init, out_shardings)."""
    _, shardings, init = sharded_state(task, tx, config, mesh, rules)
    return init(), shardings


def restore_target(arrays, shardings):
    """ShapeDtypeStructs of ``arrays`` (arrays or shapes) laid out by ``shardings``."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        arrays, shardings)


def _config_dict(config) -> dict:
    return json.loads(config.to_json_best_effort())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """``train`` for its summary: the JSON-able dict also written to ``WORKDIR/summary.json``
    (losses, evaluation, steps, throughput, samples)."""
    return train(config, workdir)[1]


def train(config: ml_collections.ConfigDict, workdir: str) -> tuple[TrainState, dict]:
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint); returns (the final
    ``TrainState``, sharded as trained, and the summary ``train_and_evaluate`` returns).

    Before any compute: the config is validated, the workdir is locked for this run
    (``workdir.WorkdirLock``; a second run on it stops at once) and, when it holds checkpoints,
    the config they were written with is compared with this one (``_check_resume``)."""
    shape = validate_config(config, jax.device_count())
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"the workdir {workdir} is a file, not a folder; pass another --workdir")
    task = build_task(config, shape)
    evic_lib.check_task(config, task)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the workdir {workdir} ({e.strerror}); pass another "
                         "--workdir") from None
    lock = _lock_workdir(workdir)
    try:
        _check_resume(config, workdir)
        with _StopOnSignal() as stop:
            return _train(config, workdir, task, shape, stop)
    finally:
        if lock is not None:
            lock.release()


def save_initial(config: ml_collections.ConfigDict, workdir: str, params) -> str:
    """Writes ``params`` (a host or device tree of ``config``'s model) as step 0 of a new run of
    ``config`` in ``workdir``, with fresh optimizer state and the data iterator at its start: the
    trainer resumes it (e.g. training a compressed model further) and ``config.train.init_from``
    reads it (e.g. the student of a distillation run). Refuses a workdir that holds committed
    checkpoints already (an unfinished save of a crashed call is no checkpoint: a retry works),
    and params of another layout, before anything is written -> ``workdir``."""
    shape = validate_config(config, jax.device_count())

    def check_unused():
        if workdir_lib.committed_steps(os.path.join(workdir, "checkpoints")):
            raise ValueError(f"{workdir} already holds checkpoints; save_initial writes new runs only: "
                             "pass an empty or new workdir")
    check_unused()
    task = build_task(config, shape)
    s = setup(config, task)
    differences = ckpt_lib.tree_differences(params, s.abstract.params, "params.")
    if differences:
        raise ValueError(f"save_initial: the params do not fit config.model ({'; '.join(differences[:5])})")
    os.makedirs(workdir, exist_ok=True)
    lock = _lock_workdir(workdir)
    try:
        check_unused()  # again, now that no other run can be writing it
        state = s.init()
        state = state.replace(params=jax.tree.map(
            lambda x, sh, a: jax.device_put(np.asarray(x, a.dtype), sh), params, s.shardings.params,
            s.abstract.params))
        shard = distributed.process_rows(mesh_lib.batch_sharding(s.mesh), config.train.batch_size)
        ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False,
                                     checksums=config.train.checkpoint_checksums)
        try:
            ckpt.save(0, state, task.train_iterator(seed=config.seed, shard=shard), _config_dict(config))
        finally:
            ckpt.close()
        if jax.process_index() == 0:
            write_json(os.path.join(workdir, "config.json"), _config_dict(config))
    finally:
        if lock is not None:
            lock.release()
    return workdir


def _on_process_0(fn, what: str):
    """``fn()`` on process 0 -> its result there (None elsewhere). When it raises, every process
    raises (process 0 the error itself), so none is left waiting in a collective."""
    result, error = None, None
    if jax.process_index() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every process
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        failed = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if failed and error is None:
            raise workdir_lib.WorkdirError(f"process 0 failed to {what}; see its log")
    if error is not None:
        raise error
    return result


def build_task(config, shape):
    """``config.task``'s task, handed the loop's context (``tasks.TaskContext``): the number of
    devices holding distinct batch rows of the (data, fsdp, tensor) mesh ``shape`` and the
    params reader for frozen reference / guidance runs."""
    def restore(workdir, model_cfg):
        try:
            return ckpt_lib.restore_model_params(workdir, model_cfg)[0]
        except ckpt_lib.CheckpointError as e:
            raise ValueError(str(e)) from e
    context = tasks.TaskContext(num_shards=shape[0] * shape[1], restore_params=restore)
    cls = tasks.TASKS.get(config.task)
    if not (isinstance(cls, type) and issubclass(cls, tasks.Task)):
        raise TypeError(f"config.task={config.task!r} is registered as {cls!r}, which does not "
                        "subclass icml_jax.tasks.Task (the contract of tasks/base.py)")
    return cls(config, context)


def _lock_workdir(workdir: str):
    """Process 0 takes the workdir's lock; every process learns whether it got it."""
    return _on_process_0(workdir_lib.WorkdirLock(workdir).acquire, "lock the workdir")


def _check_resume(config, workdir: str) -> None:
    """``config.train.start_over``: the previous run is moved aside (once: checkpoints written by
    a start_over run with this same config are resumed, so rerunning the command after a
    preemption continues). Otherwise, when the workdir holds checkpoints, their config must agree
    with this one on the keys that define the train state and the data stream (else ValueError
    naming them, nothing touched); a changed schedule is reported on stderr, other changed keys
    on stdout. Also checks that checkpoints can be written there."""
    is_main = jax.process_index() == 0
    ckpt_dir = os.path.join(workdir, "checkpoints")
    saved, where = workdir_lib.saved_config(workdir) if workdir_lib.committed_steps(ckpt_dir) \
        else (None, "")
    changes = workdir_lib.config_changes(saved, _config_dict(config)) if saved else {}
    # start_over acts once: checkpoints that a start_over run wrote, with this config, resume
    again = bool(saved and saved.get("train", {}).get("start_over")) and not changes.get("fixed")
    if config.train.start_over and not again:
        moved = _on_process_0(lambda: workdir_lib.set_aside(workdir), "move the previous run aside")
        if moved:
            logging.warning("config.train.start_over=True: moved the previous run to %s; "
                            "training from step 0", moved)
    elif saved:
        if changes.get("fixed"):
            raise ValueError(
                f"{workdir} holds checkpoints of another run: {'; '.join(changes['fixed'])} "
                f"(saved config: {where}). Nothing was changed. Resume with the same values, "
                "pass another --workdir, or add --config.train.start_over=True to move the old "
                "run aside and start from step 0")
        if changes.get("schedule") and is_main:
            logging.warning("resuming %s with a changed learning-rate schedule (%s); the "
                            "remaining steps follow the new one", workdir,
                            "; ".join(changes["schedule"]))
        if changes.get("other") and is_main:
            logging.info("resuming %s with changed settings: %s", workdir,
                         "; ".join(changes["other"]))
    _on_process_0(lambda: _check_writable(ckpt_dir), "write to the checkpoints folder")


def _check_writable(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write_probe_"):
            pass
    except OSError as e:
        raise ValueError(f"checkpoints cannot be written to {directory} ({e.strerror or e}); fix "
                         "its permissions or pass another --workdir") from None


class _StopOnSignal:
    """While active (main thread only): the first SIGINT/SIGTERM sets ``signum``, so the train
    loop stops at the next step boundary; the handlers are then the previous ones again, so a
    second signal acts at once (KeyboardInterrupt / termination)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def _handle(self, signum, frame):
        del frame  # nothing is printed here: a handler may interrupt a write to stderr
        self.signum = signum
        self._restore()

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:  # e.g. SIGINT of a `cmd &` job
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self._restore()

    def requested(self, step: int, every: int) -> bool:
        """Whether to stop before ``step``. Processes of a multi-process run decide together (one
        gather every ``every`` steps), so they all stop at the same boundary."""
        if jax.process_count() == 1:
            return self.signum is not None
        if step % every:
            return False
        from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
        flags = np.asarray(multihost_utils.process_allgather(np.int32(self.signum or 0)))
        # decided from the gathered flags alone: a signal landing during the gather is seen by
        # every process at the next one
        if not np.any(flags):
            return False
        self.signum = self.signum or int(np.max(flags))
        return True


def _train(config, workdir: str, task, shape, stop: _StopOnSignal) -> tuple[TrainState, dict]:
    t = config.train
    is_main = jax.process_index() == 0
    mesh, rules, tx, abstract, state_shardings, init_state = setup(config, task)
    n_params = sum(x.size for x in jax.tree.leaves(abstract.params))
    batch_sharding = mesh_lib.batch_sharding(mesh)
    # this process feeds its rows of every global batch: those its devices hold
    shard = distributed.process_rows(batch_sharding, t.batch_size)
    data_iter = task.train_iterator(seed=config.seed, shard=shard)
    evic_opts = evic_lib.settings(config)
    refresh = None if evic_opts is None else evic_lib.Refresher(
        evic_opts, config, task, data_iter, abstract, workdir)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                                 async_save=t.async_checkpoint,
                                 checksums=t.checkpoint_checksums)
    log = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    try:  # a refused restore or init_from closes the manager before the error goes up
        restored, start = ckpt.restore_latest(abstract, data_iter, older=(_with_key_layout,))
        if restored is not None:
            state = restored
            log(f"Resumed from {ckpt.directory}/{start}")
        else:
            state = init_state()
            if t.init_from:
                state = state.replace(params=_init_from(task, t.init_from, state.params,
                                                        state_shardings.params))
                log(f"Initialised the params from {t.init_from}")
    except Exception:
        ckpt.close()
        raise
    if is_main:  # only now: a run refused above leaves the workdir's config.json as it was
        write_json(os.path.join(workdir, "config.json"), _config_dict(config))
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    log(f"Model: {n_params:,} params | mesh data={shape[0]} fsdp={shape[1]} tensor={shape[2]} "
        f"| {jax.device_count()} {jax.devices()[0].platform} device(s){procs} "
        f"| workdir {os.path.abspath(workdir)}")

    def to_global(b):
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(
            batch_sharding, x, (t.batch_size,) + x.shape[1:]), b)

    with mesh, nn.logical_axis_rules(rules):
        train_step = jax.jit(make_train_step(task, tx, t.grad_accum, lr_schedule(t)),
                             in_shardings=(state_shardings, batch_sharding),
                             out_shardings=(state_shardings, None), donate_argnums=0)
        eval_step = jax.jit(make_eval_step(task), in_shardings=(state_shardings.params, batch_sharding))
    eval_batches = task.eval_batches("validation", shard=shard)
    writer = MetricsWriter(workdir, start, enabled=is_main)
    # A task whose loss is a mean over examples (pairs) says how many tokens one example trains
    # on; the LM's loss unit is the token itself.
    unit = task.loss_unit
    tokens_per_unit = task.tokens_per_unit
    flops_per_token = train_flops_per_token(config.model, config.data.seq_len)
    perplexity = task.reports_perplexity
    pending, window_start = [], time.time()
    bar = tqdm(total=t.steps, initial=start, disable=not (is_main and t.progress), unit="step",
               dynamic_ncols=True)
    last_good = start if restored is not None else None
    summary = {"params": int(n_params), "start_step": int(start)}

    def flush():
        """Fetches the queued step metrics, stops on a non-finite loss, writes the lines."""
        nonlocal pending, window_start
        rows = jax.device_get([m for _, m in pending])
        elapsed = max(time.time() - window_start, 1e-9)
        tokens = sum(float(r["tokens"]) for r in rows) * tokens_per_unit
        tok_s = tokens / elapsed
        for (s, _), r in zip(pending, rows):
            if not (np.isfinite(r["loss"]) and r.pop("finite", 1.0) == 1.0):
                where = (f"the last good checkpoint is step {last_good} in {ckpt.directory}"
                         if last_good is not None else "no checkpoint was written yet")
                what = (f"loss became {float(r['loss'])}" if not np.isfinite(r["loss"]) else
                        f"the update was not finite (loss {float(r['loss']):.4g}, gradient norm "
                        f"{float(r['grad_norm']):.4g})")
                raise NonFiniteLossError(
                    f"{what} at step {s}; training stopped, {where}. "
                    "Lower config.train.lr, raise config.train.warmup_steps or check the data.")
            line = {k: float(v) for k, v in r.items()}
            line.update(tokens_per_sec=tok_s,
                        model_tflops_per_sec=tok_s * flops_per_token / 1e12)
            if unit != "tokens":
                line[f"{unit}_per_sec"] = tok_s / tokens_per_unit
            writer.write(s, line)
        if rows:
            bar.set_postfix(loss=f"{float(rows[-1]['loss']):.3f}", tok_s=f"{tok_s:,.0f}")
            summary.update(loss=float(rows[-1]["loss"]), tokens_per_sec=tok_s)
        pending, window_start = [], time.time()

    def stop_here(step):
        """At a step boundary after SIGINT/SIGTERM: flush, checkpoint, raise Interrupted."""
        flush()
        saved = ""
        if step > start:
            if last_good != step:
                ckpt.save(step, state, data_iter, _config_dict(config))
            saved = f"; checkpoint {ckpt.directory}/{step} is saved"
        name = signal.Signals(stop.signum).name
        bar.write(f"{name}: stopping at step {step} (a second signal stops at once)",
                  file=sys.stderr) if is_main else None
        raise Interrupted(f"stopped by {name} after step {step}{saved}; rerun the same command "
                          "to resume", stop.signum)

    extra_ckpts = frozenset(t.get("checkpoint_steps") or ())
    first_eval = True
    try:
        for step in range(start, t.steps):
            if stop.requested(step, t.log_every):
                stop_here(step)
            ckpt.poll()
            if refresh is not None and refresh.due(step):  # EVIC: re-select before this update
                with mesh, nn.logical_axis_rules(rules):
                    writer.write(step, refresh(step, state))
            batch = to_global(next(data_iter))
            state, metrics = train_step(state, batch)
            if step == start:  # the step is compiled: hand the compiler's freed memory back
                xla_env.release_host_memory()
            s = step + 1
            pending.append((s, metrics))
            bar.update(1)
            do_eval = s % t.eval_every == 0 or s == t.steps
            do_ckpt = s % t.checkpoint_every == 0 or s == t.steps or s in extra_ckpts
            if s % t.log_every == 0 or do_eval or do_ckpt:
                flush()
            if do_eval:
                ev = evaluate(eval_step, state.params, eval_batches, to_global, perplexity)
                if first_eval:  # the eval step is compiled too
                    xla_env.release_host_memory()
                    first_eval = False
                writer.write(s, ev)
                summary.update(ev)
                bar.write(f"step {s}: eval_loss={ev['eval_loss']:.4f}" + (
                    f" perplexity={ev['eval_perplexity']:.2f}" if perplexity else "")) if is_main else None
            if do_ckpt:
                ckpt.save(s, state, data_iter, _config_dict(config))
                last_good = s
        flush()
    finally:
        bar.close()
        ckpt.close()
        writer.close()

    if start >= t.steps and restored is not None:  # already finished: report the eval again
        summary.update(evaluate(eval_step, state.params, eval_batches, to_global, perplexity))
    summary["step"] = int(jax.device_get(state.step))
    sample = t.samples > 0 and task.can_sample
    # every process takes part in gathering the params; process 0 alone then samples
    host_params = _gather_to_host(state.params) if sample else None
    if is_main:
        plot_loss_curve(writer.path, os.path.join(workdir, "loss_curve.png"))
        if sample:
            summary["samples"] = _print_samples(task, host_params, config, log)
        write_json(os.path.join(workdir, "summary.json"), summary)
    return state, summary


def _gather_to_host(tree):
    """numpy copies of (possibly cross-process sharded) arrays on every process."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return multihost_utils.process_allgather(tree, tiled=True)


def load_state(config: ml_collections.ConfigDict, workdir: str, devices=None):
    """The newest checkpoint of ``workdir`` as a ``TrainState`` sharded for ``config.mesh`` over
    ``devices`` (default: all), whatever device count, mesh or process count wrote it -> (state,
    step). E.g. params trained on a 64-chip pod, inspected on 1 GPU with ``config.mesh`` all 1.
    An unreadable newest step is skipped with a warning and the previous one is used; nothing is
    moved (the workdir may belong to a live run)."""
    shape = validate_config(config, len(jax.devices() if devices is None else devices))
    abstract = setup(config, build_task(config, shape), devices).abstract
    error = missing_checkpoints(workdir)
    if error:
        raise ckpt_lib.CheckpointError(error)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=10**9, async_save=False)
    try:
        state, step = ckpt.restore_latest(abstract, None, set_aside=False,
                                          older=(_with_key_layout,))
    finally:
        ckpt.close()
    if state is None:
        raise ckpt_lib.CheckpointError(f"{workdir}: no checkpoint to load")
    return state, step


def _init_from(task, workdir: str, params, shardings):
    """The params of ``workdir``'s newest checkpoint (a run of the same model, e.g. the SFT policy)
    restored straight into this run's shardings; a task whose params hold the decoder under a
    key (``task.pretrained_key``, e.g. a reward model's ``backbone``) gets them there."""
    key = task.pretrained_key
    sub, sub_shard = (params, shardings) if key is None else (params[key], shardings[key])
    abstract = restore_target(sub, sub_shard)
    try:
        loaded, _ = ckpt_lib.restore_params(workdir, abstract)
    except ckpt_lib.CheckpointError as e:
        raise ckpt_lib.CheckpointError(f"config.train.init_from={workdir!r}: {e}") from e
    return loaded if key is None else {**params, key: loaded}


def _print_samples(task, params, config, log):
    from icml_jax.inference.sampling import generate
    t = config.train
    prompts = list(t.sample_prompts)[: t.samples]
    params = jax.device_get(params)
    texts = generate(task.model, params, task.tokenizer, prompts, jax.random.key(config.seed + 1),
                     max_new=t.sample_len, temperature=t.sample_temperature,
                     max_len=None)
    for p, x in zip(prompts, texts):
        log(f"--- sample ---\n{p}{x}")
    return [p + x for p, x in zip(prompts, texts)]
