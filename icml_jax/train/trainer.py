"""The train loop, top to bottom: config -> mesh -> sharded state -> jitted step -> eval/ckpt.

Every task (``config.task``) provides the model, the loss and the data; this file is the same for
all of them. See ``train_and_evaluate``.
"""
import functools
import json
import math
import os
import sys
import time

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from tqdm import tqdm

from icml_jax import tasks
from icml_jax.analysis.flops import train_flops_per_token
from icml_jax.models.positions import frozen_param_mask
from icml_jax.train import checkpoint as ckpt_lib
from icml_jax.train import missing_checkpoints
from icml_jax.train import distributed
from icml_jax.train import mesh as mesh_lib
from icml_jax.train.metrics import MetricsWriter, plot_loss_curve
from icml_jax.train.optimizer import lr_schedule, make_optimizer


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of completed updates
    params: dict
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data, advanced every step


class NonFiniteLossError(FloatingPointError):
    pass


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
    if t.lr < 0:
        raise ValueError(f"config.train.lr={t.lr} is negative: the updates would climb the loss; "
                         "use a positive learning rate")
    if t.lr == 0 and jax.process_index() == 0:
        print("WARNING: config.train.lr=0: the params will not change during training",
              file=sys.stderr, flush=True)
    if m.num_heads % m.num_kv_heads:
        raise ValueError(f"config.model.num_heads={m.num_heads} is not a multiple of "
                         f"config.model.num_kv_heads={m.num_kv_heads}")
    if m.get("position") == "rope" and m.head_dim % 2:
        raise ValueError(f"config.model.head_dim={m.head_dim} is odd: RoPE rotates pairs of "
                         "channels; use an even head_dim")
    if m.num_kv_heads % shape[2]:
        raise ValueError(f"config.mesh.tensor={shape[2]} does not divide config.model.num_kv_heads="
                         f"{m.num_kv_heads}: tensor parallelism splits the KV heads; pick a tensor "
                         "size that divides them")
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
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
        metrics = {"loss": lsum / denom, "grad_norm": optax.global_norm(grads), "tokens": n}
        metrics.update({k: v / denom for k, v in msums.items()})
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return TrainState(state.step + 1, params, opt_state, rng), metrics

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
    """(init_rng, boxed init fn, NamedShardings of the TrainState) for ``mesh``."""
    c = config
    dummy = task.dummy_batch(1, c.data.seq_len)
    init_rng, state_rng = jax.random.split(jax.random.key(c.seed))

    def init_boxed(rng):
        params = task.init_params(rng, dummy)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params),
                          jax.random.key_data(state_rng))

    with mesh, nn.logical_axis_rules(rules):
        abstract = jax.eval_shape(init_boxed, init_rng)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    return init_rng, init_boxed, shardings


def create_sharded_state(task, tx, config, mesh, rules):
    """eval_shape(init) -> logical specs -> NamedShardings -> jit(init, out_shardings)."""
    init_rng, init_boxed, shardings = _state_init(task, tx, config, mesh, rules)
    with mesh, nn.logical_axis_rules(rules):
        init = jax.jit(lambda r: nn.meta.unbox(init_boxed(r)), out_shardings=shardings)
        state = init(init_rng)
    return state, shardings


def abstract_state(task, tx, config, mesh, rules):
    """The TrainState as ShapeDtypeStructs carrying their shardings on ``mesh`` (a restore
    target: orbax reads a checkpoint straight into this layout)."""
    init_rng, init_boxed, shardings = _state_init(task, tx, config, mesh, rules)
    with mesh, nn.logical_axis_rules(rules):
        shapes = jax.eval_shape(lambda r: nn.meta.unbox(init_boxed(r)), init_rng)
    return restore_target(shapes, shardings)


def restore_target(arrays, shardings):
    """ShapeDtypeStructs of ``arrays`` (arrays or shapes) laid out by ``shardings``."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        arrays, shardings)


def _config_dict(config) -> dict:
    return json.loads(config.to_json_best_effort())


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains ``config`` in ``workdir`` (resuming from its latest checkpoint); returns a summary."""
    t = config.train
    is_main = jax.process_index() == 0
    shape = validate_config(config, jax.device_count())
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ValueError(f"the workdir {workdir} is a file, not a folder; pass another --workdir")
    task = tasks.TASKS.get(config.task)(config)
    mesh, rules = mesh_lib.make_mesh(config.mesh), mesh_lib.logical_rules(config.mesh)
    tx = make_optimizer(t, frozen_mask=functools.partial(frozen_param_mask, config.model),
                        model_cfg=config.model)
    os.makedirs(workdir, exist_ok=True)
    if is_main:
        with open(os.path.join(workdir, "config.json.tmp"), "w") as f:
            json.dump(_config_dict(config), f, indent=2)
        os.replace(os.path.join(workdir, "config.json.tmp"), os.path.join(workdir, "config.json"))

    state, state_shardings = create_sharded_state(task, tx, config, mesh, rules)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    batch_sharding = mesh_lib.batch_sharding(mesh)
    # this process feeds its rows of every global batch: those its devices hold
    shard = distributed.process_rows(batch_sharding, t.batch_size)
    data_iter = task.train_iterator(seed=config.seed, shard=shard)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=t.keep_checkpoints,
                                 async_save=t.async_checkpoint)
    abstract = restore_target(state, state_shardings)
    restored, start = ckpt.restore_latest(abstract, data_iter)
    log = (lambda *a: print(*a, flush=True)) if is_main else (lambda *a: None)
    if restored is not None:
        state = restored
        log(f"Resumed from {ckpt.directory}/{start}")
    elif t.get("init_from", ""):
        state = state.replace(params=_init_from(task, t.init_from, state.params,
                                                state_shardings.params))
        log(f"Initialised the params from {t.init_from}")
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
    unit = getattr(task, "loss_unit", "tokens")
    tokens_per_unit = getattr(task, "tokens_per_unit", 1)
    flops_per_token = train_flops_per_token(config.model, config.data.seq_len)
    perplexity = getattr(task, "reports_perplexity", True)
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
            if not np.isfinite(r["loss"]):
                where = (f"the last good checkpoint is step {last_good} in {ckpt.directory}"
                         if last_good is not None else "no checkpoint was written yet")
                raise NonFiniteLossError(
                    f"loss became {float(r['loss'])} at step {s}; training stopped, {where}. "
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

    try:
        for step in range(start, t.steps):
            batch = to_global(next(data_iter))
            state, metrics = train_step(state, batch)
            s = step + 1
            pending.append((s, metrics))
            bar.update(1)
            do_eval = s % t.eval_every == 0 or s == t.steps
            do_ckpt = s % t.checkpoint_every == 0 or s == t.steps
            if s % t.log_every == 0 or do_eval or do_ckpt:
                flush()
            if do_eval:
                ev = evaluate(eval_step, state.params, eval_batches, to_global, perplexity)
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
    sample = t.samples > 0 and getattr(task, "can_sample", True)
    # every process takes part in gathering the params; process 0 alone then samples
    host_params = _gather_to_host(state.params) if sample else None
    if is_main:
        plot_loss_curve(writer.path, os.path.join(workdir, "loss_curve.png"))
        if sample:
            summary["samples"] = _print_samples(task, host_params, config, log)
        with open(os.path.join(workdir, "summary.json.tmp"), "w") as f:
            json.dump({k: v for k, v in summary.items()}, f, indent=2)
        os.replace(os.path.join(workdir, "summary.json.tmp"), os.path.join(workdir, "summary.json"))
    summary["state"] = state
    return summary


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
    As when resuming, an unreadable newest step is moved aside and the previous one is used."""
    validate_config(config, len(jax.devices() if devices is None else devices))
    task = tasks.TASKS.get(config.task)(config)
    mesh = mesh_lib.make_mesh(config.mesh, devices)
    rules = mesh_lib.logical_rules(config.mesh)
    tx = make_optimizer(config.train, frozen_mask=functools.partial(frozen_param_mask, config.model),
                        model_cfg=config.model)
    abstract = abstract_state(task, tx, config, mesh, rules)
    error = missing_checkpoints(workdir)
    if error:
        raise ckpt_lib.CheckpointError(error)
    ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=10**9, async_save=False)
    try:
        state, step = ckpt.restore_latest(abstract, None)
    finally:
        ckpt.close()
    if state is None:
        raise ckpt_lib.CheckpointError(f"{workdir}: no checkpoint to load")
    return state, step


def _init_from(task, workdir: str, params, shardings):
    """The params of ``workdir``'s newest checkpoint (a run of the same model, e.g. the SFT policy)
    restored straight into this run's shardings; a task whose params hold the decoder under a
    key (``task.pretrained_key``, e.g. a reward model's ``backbone``) gets them there."""
    key = getattr(task, "pretrained_key", None)
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
