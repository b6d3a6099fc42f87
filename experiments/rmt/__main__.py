"""Residual Matrix Transformer vs transformer on Shakespeare, and a residual-size (Dk) sweep.

  python -m experiments.rmt --workdir=runs/rmt [--preset=tiny|default] [--seeds=0,1,2] [--steps=N]
                            [--lr=transformer=3e-3,rmt_matched=1e-2,rmt_spec=1e-2]

Runs (docs/methods/rmt.md), all on the same byte-level Shakespeare tokens in the same order per seed,
with the same batch, sequence length, steps, warmup and schedule shape:

* ``transformer``  ``configs/lm.py`` with the spec's tiny transformer shapes (L=4, D=128, 4 heads,
  D_FF=512) made GPT-2-like to differ from the RMT only in the residual stream: plain gelu_tanh
  FFN, untied embeddings, ALiBi (the RMT reference's position scheme).
* ``rmt_matched``  ``configs/rmt.py`` (the spec's tiny RMT: L=4, Dv=32, R=4) at ``main_key_dim``
  (16 in ``default``: Dk·Dv = 4·R·Dv, the paper's 305M-vs-405M ratio) with N_ff widened so that
  its parameter count matches the transformer's (the RMT has no 4·D² attention matrices;
  ``matched_ffn_dim``).
* ``rmt_dk<Dk>``   the sweep: the spec's tiny RMT (N_ff=512) at each Dk of ``key_dims``, fixed
  Dv, R, N_ff (the run at ``main_key_dim`` is also the spec-shaped RMT of the main table).

First the lr stage: each tuned shape (``transformer``, ``rmt_matched``, ``rmt_spec`` = the spec-shaped
RMT, whose lr every sweep point uses) trains ``grid_steps`` steps at each lr of its ``lr_grid``
(seed ``grid_seed``, in ``DIR/lr_grid/``); the lr with the lowest final dev loss is then that
shape's lr. ``--lr=shape=value,...`` fixes a shape's lr instead (its grid is skipped).

The main pair runs with ``seeds``, the sweep with ``sweep_seeds``. Every (run, seed) trains through
``train_and_evaluate`` in ``DIR/<run>_s<seed>/`` (metrics.jsonl, TensorBoard, checkpoints; a killed
run resumes from its last checkpoint) and its digest is cached in ``result.json`` there, so a
rerun with the same settings recomputes nothing.

Writes DIR/config.json, DIR/results.csv (one row per run and eval point), DIR/results.md,
DIR/loss_vs_tokens.png, DIR/loss_vs_flops.png, DIR/gap_vs_tokens.png and
DIR/dev_loss_vs_residual.png.
"""
import argparse
import os
import sys

from experiments.common import git_commit, stopwatch, write_atomic, write_csv, write_json
# re-exported: benchmarks/rmt_cost.py imports PRESETS and the config stages from here
from experiments.rmt.presets import PRESETS, TRANSFORMER  # noqa: F401
from experiments.rmt.report import CSV_FIELDS, config_json, csv_rows, markdown, plots
from experiments.rmt.stages import (enable_compilation_cache, grid_plan,  # noqa: F401
                                    matched_ffn_dim, pick_lrs, plan, rmt_config, train_all,
                                    train_one, transformer_config)
from icml_jax import xla_env


def main(argv=None, compile_cache=False):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="RMT vs transformer experiment (docs/methods/rmt.md)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--seeds", default="", help="comma-separated seeds of the main pair")
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    p.add_argument("--lr", default="", help="fixed peak lrs, e.g. transformer=3e-3,rmt_spec=1e-2 "
                   "(shapes: transformer, rmt_matched, rmt_spec); the others are tuned")
    a = p.parse_args(argv)
    elapsed = stopwatch()
    exp = PRESETS[a.preset].copy_and_resolve_references()  # a deep copy
    if a.seeds:
        try:
            exp.seeds = tuple(int(x) for x in a.seeds.split(","))
        except ValueError:
            raise SystemExit(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    if a.steps < 0:
        raise SystemExit(f"--steps must be positive, got {a.steps}")
    if a.steps:
        exp.train.train.steps = a.steps
    fixed = _fixed_lrs(a.lr, exp)
    os.makedirs(a.workdir, exist_ok=True)
    if compile_cache:
        enable_compilation_cache(os.path.join(os.path.abspath(a.workdir), "jax_cache"))
    grid = grid_plan(exp, fixed)
    grid_results = train_all(grid, os.path.join(a.workdir, "lr_grid"))
    picked = pick_lrs(grid, grid_results)
    exp.lr.update({shape: lr for shape, (lr, _) in picked.items()})
    runs = plan(exp)
    write_json(os.path.join(a.workdir, "config.json"), config_json(a.preset, exp, runs, picked))
    results = train_all(runs, a.workdir)
    write_csv(os.path.join(a.workdir, "results.csv"), csv_rows(runs, results), CSV_FIELDS)
    meta = {"command": "python -m experiments.rmt " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "preset": a.preset, "wall_seconds": elapsed(),
            "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    meta["wall_seconds_grid"] = sum(r["wall_seconds"] for r in grid_results.values())
    meta["grid_runs"] = len(grid_results)
    write_atomic(os.path.join(a.workdir, "results.md"), markdown(runs, results, exp, meta, picked))
    plots(runs, results, exp, a.workdir)
    print(open(os.path.join(a.workdir, "results.md")).read())
    return results


def _fixed_lrs(arg, exp):
    """Applies ``--lr=shape=value,...`` to ``exp.lr``; returns the shapes it fixed."""
    fixed = {}
    for item in filter(None, arg.split(",")):
        shape, _, value = item.partition("=")
        if shape not in exp.lr:
            raise SystemExit(f"--lr: unknown shape {shape!r}; choose from {sorted(exp.lr)}")
        try:
            fixed[shape] = float(value)
        except ValueError:
            raise SystemExit(f"--lr: {shape}={value!r} is not a number")
        if not fixed[shape] > 0:
            raise SystemExit(f"--lr: {shape} must be positive, got {value}")
    exp.lr.update(fixed)
    return set(fixed)


if __name__ == "__main__":
    main(sys.argv[1:], compile_cache=True)
