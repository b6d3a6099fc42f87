"""What experiments/rmt computes: the run configs (transformer, parameter-matched RMT, Dk sweep),
the lr stage (a grid per tuned shape, its argmin), training each (run, seed) with its cached
digest (params, FLOPs/token, eval curve, step time)."""
import json
import os

from experiments.common import cached, run_overrides, stopwatch

QUIET = {"train.samples": 0, "train.progress": False}


def _load(spec, overrides):
    from icml_jax.config_utils import load_config
    cfg = load_config(spec, unlocked=True)
    cfg.update_from_flattened_dict(dict(overrides))
    return cfg


def transformer_config(exp, lr=None):
    return _load("configs/lm.py:small", {**run_overrides(exp["transformer"]),
                                          **run_overrides(exp["train"]), **QUIET,
                                          "train.lr": lr or exp["lr"]["transformer"]})


def rmt_config(exp, key_dim, ffn_dim=None, lr=None):
    """The RMT at Dk = ``key_dim`` (N_ff = ``ffn_dim`` if given); lr: ``lr``, else the preset's
    ``rmt_matched`` lr when N_ff is widened, its ``rmt_spec`` lr otherwise."""
    over = {**run_overrides(exp["rmt"]), **run_overrides(exp["train"]), **QUIET,
            "train.lr": lr or exp["lr"]["rmt_matched" if ffn_dim else "rmt_spec"],
            "model.rmt.key_dim": key_dim}
    if ffn_dim:
        over["model.ffn_dim"] = ffn_dim
    return _load("configs/rmt.py:small", over)


def matched_ffn_dim(target_params: int, exp, key_dim) -> int:
    """N_ff at which the RMT's parameter count is closest to ``target_params`` (it is linear in N_ff:
    2·L·R·Dv per unit)."""
    from icml_jax.analysis.flops import param_count
    m = rmt_config(exp, key_dim).model
    per_unit = param_count(rmt_config(exp, key_dim, m.ffn_dim + 1).model) - param_count(m)
    return max(1, m.ffn_dim + round((target_params - param_count(m)) / per_unit))


def shape_configs(exp, lrs=None):
    """{tuned shape: config} at the lrs ``lrs`` (default: the preset's ``lr``): ``transformer``,
    ``rmt_matched`` (Dk = ``main_key_dim``, N_ff matched to the transformer's parameters) and
    ``rmt_spec`` (the spec-shaped RMT at ``main_key_dim``)."""
    from icml_jax.analysis.flops import param_count
    base = exp["lr"]
    lrs = {**(base.to_dict() if hasattr(base, "to_dict") else base), **(lrs or {})}
    dk = exp["main_key_dim"]
    tf = transformer_config(exp, lrs["transformer"])
    nff = matched_ffn_dim(param_count(tf.model), exp, dk)
    return {"transformer": tf, "rmt_matched": rmt_config(exp, dk, nff, lrs["rmt_matched"]),
            "rmt_spec": rmt_config(exp, dk, lr=lrs["rmt_spec"])}


def grid_plan(exp, fixed=()):
    """The lr stage's runs, as ``plan``'s tuples: each shape of ``lr_grid`` (but those in ``fixed``)
    at each of its lrs, ``grid_steps`` steps (warmup scaled by grid_steps / steps, one eval at
    the end and one halfway), seed ``grid_seed``; named ``<shape>_lr<lr>``."""
    t = exp["train"]["train"]
    n = exp["grid_steps"]
    runs = []
    for shape, lrs in sorted(exp["lr_grid"].items()):
        if shape in fixed:
            continue
        for lr in lrs:
            cfg = shape_configs(exp, {shape: lr})[shape]
            cfg.train.update(steps=n, warmup_steps=max(1, round(t["warmup_steps"] * n / t["steps"])),
                             eval_every=max(1, n // 2), checkpoint_every=n)
            runs.append((f"{shape}_lr{lr:g}", shape, "grid", cfg, (exp["grid_seed"],)))
    return runs


def pick_lrs(grid_runs, grid_results):
    """{shape: (the grid lr with the lowest final dev loss, {lr: dev loss})} from the lr stage."""
    table = {}
    for name, shape, _, cfg, seeds in grid_runs:
        table.setdefault(shape, {})[cfg.train.lr] = grid_results[(name, seeds[0])]["final_eval_loss"]
    return {shape: (min(t, key=t.get), t) for shape, t in table.items()}


def plan(exp, lrs=None):
    """[(run name, family, group, config, seeds)] for the preset at the lrs ``lrs`` (default:
    the preset's ``lr``; ``rmt_spec``'s for every sweep point)."""
    dk_main = exp["main_key_dim"]
    if dk_main not in exp["key_dims"]:
        raise ValueError(f"main_key_dim={dk_main} must be one of key_dims={list(exp['key_dims'])}")
    shapes = shape_configs(exp, lrs)
    runs = [("transformer", "transformer", "main", shapes["transformer"], exp["seeds"]),
            ("rmt_matched", "rmt", "main", shapes["rmt_matched"], exp["seeds"])]
    lr = shapes["rmt_spec"].train.lr
    runs += [(f"rmt_dk{dk}", "rmt", "sweep", rmt_config(exp, dk, lr=lr), exp["sweep_seeds"])
             for dk in exp["key_dims"]]
    return runs


def describe(cfg):
    m = cfg.model
    if m.residual == "rmt":
        return (f"RMT L={m.num_layers}, Dk={m.rmt.key_dim}, Dv={m.head_dim}, R={m.num_heads}, "
                f"N_ff={m.ffn_dim}")
    return (f"transformer L={m.num_layers}, D={m.d_model}, {m.num_heads} heads of {m.head_dim}, "
            f"D_FF={m.ffn_dim}")


def residual_size(cfg):
    m = cfg.model
    return m.rmt.key_dim * m.head_dim if m.residual == "rmt" else m.d_model


def step_seconds(rows, cfg):
    """Median wall-clock seconds per train step from the trainer's per-window tokens/s, leaving out
    the first window (compilation) and the windows that follow an evaluation (they include it)."""
    import numpy as np
    t = cfg.train
    per_step = t.batch_size * cfg.data.seq_len
    ends = sorted({r["step"] for r in rows if "tokens_per_sec" in r})
    times, prev = [], None
    for s in ends:
        r = next(r for r in rows if r.get("step") == s and "tokens_per_sec" in r)
        if prev is not None and prev % t.eval_every:
            times.append(per_step / r["tokens_per_sec"])
        prev = s
    return float(np.median(times)) if times else float("nan")


def _training_seconds(workdir, start, end, seconds):
    """Appends this invocation's (start step, end step, seconds) to ``workdir/timing.jsonl`` and
    returns the seconds of every invocation that trained (a resumed, already finished run only
    re-evaluates: its time is not training time, and the original measurement is kept)."""
    path = os.path.join(workdir, "timing.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"start_step": start, "end_step": end, "seconds": seconds}) + "\n")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return float(sum(r["seconds"] for r in rows if r["start_step"] < r["end_step"]))


def train_one(cfg, workdir):
    """Trains (or resumes) one run; returns its digest: params, FLOPs/token, eval curve, step time.
    Not ``common.train_run``: that one wipes a workdir trained with another config, while here a
    changed cache key (e.g. a new base-config key) resumes from the final checkpoint, only
    re-evaluates and keeps the measured training time (``_training_seconds``)."""
    from icml_jax.analysis.flops import param_count, train_flops_per_token
    from icml_jax.train.metrics import read_metrics
    from icml_jax.train.trainer import train_and_evaluate
    elapsed = stopwatch()
    summary = train_and_evaluate(cfg, workdir)
    wall = elapsed()
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    fpt = train_flops_per_token(cfg.model, cfg.data.seq_len)
    fpt_paper = train_flops_per_token(cfg.model, cfg.data.seq_len, convention="paper")
    tokens, cum = 0.0, {}
    for r in rows:
        if "loss" in r and "tokens" in r:
            tokens += r["tokens"]
            cum[r["step"]] = tokens
    curve = [{"step": r["step"], "tokens": cum[r["step"]], "flops": cum[r["step"]] * fpt_paper,
              "exact_flops": cum[r["step"]] * fpt, "eval_loss": r["eval_loss"]}
             for r in rows if "eval_loss" in r]
    if not curve:
        raise RuntimeError(f"{workdir}/metrics.jsonl has no eval_loss lines")
    train = [r["loss"] for r in rows if "loss" in r]
    return {"params": int(summary["params"]), "params_formula": int(param_count(cfg.model)),
            "flops_per_token": float(fpt_paper), "exact_flops_per_token": float(fpt),
            "curve": curve, "final_eval_loss": curve[-1]["eval_loss"],
            "final_train_loss": float(sum(train[-5:]) / len(train[-5:])),
            "tokens": curve[-1]["tokens"], "step_seconds": step_seconds(rows, cfg),
            "wall_seconds": _training_seconds(workdir, summary["start_step"], summary["step"], wall)}


def train_all(runs, workdir):
    """Trains every (run, seed) of ``plan`` in ``workdir/<run>_s<seed>/``, its digest cached in
    ``result.json`` there (key: the run's full config); returns {(run, seed): digest}."""
    results = {}
    for name, family, group, cfg, seeds in runs:
        for seed in seeds:
            cfg = cfg.copy_and_resolve_references()
            cfg.seed = seed
            wd = os.path.join(workdir, f"{name}_s{seed}")
            print(f"=== {name} seed {seed}: {describe(cfg)} ===", flush=True)
            key = {"config": json.loads(cfg.to_json_best_effort())}
            results[(name, seed)] = r = cached(os.path.join(wd, "result.json"), key,
                                               lambda: train_one(cfg, wd))
            print(f"{name} s{seed}: dev {r['final_eval_loss']:.4f}, {r['params']:,} params, "
                  f"{r['step_seconds'] * 1e3:.0f} ms/step, {r['wall_seconds']:.0f} s", flush=True)
    return results


def enable_compilation_cache(path):
    """Persistent XLA cache: the second seed of a config (same HLO) skips its compilations. Only
    for the command line (a process-wide setting; tests call ``main`` without it)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
