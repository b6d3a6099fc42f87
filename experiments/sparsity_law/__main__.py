"""Sparsing Law at CPU scale: CETT-PPL-1% activation ratio of ReLU-GLU vs SiLU-GLU along training.

  python -m experiments.sparsity_law --workdir=runs/sparsity_law [--preset=tiny|default]
      [--activations=relu_glu,swiglu] [--seeds=0,1,2] [--steps=N] [--protocol=fixed|per_checkpoint]

Each activation x seed trains ``configs/sparsity.py:PRESET`` with only
``config.model.mlp.activation`` and ``config.seed`` changed (same schedule and steps) through
``train_and_evaluate`` in ``DIR/<activation>/seed_<s>/``, checkpointing at ``eval_points``
log-spaced steps (``config.train.checkpoint_steps``; first and last included). Evaluation on
the Shakespeare validation split:

* **protocol ``fixed``** (default; the authors' ``calc_sparsity.sh`` + ``calc_cett.py``): one
  target CETT per model, the bisection (tol ``search_tol`` = 1e-3, result rounded to
  ``cett_digits`` = 4 decimals as the reference writes it) on the *mean* PPL ratio of its last
  ``last_checkpoints`` (5) evaluated checkpoints on the CETT slice
  (``icml_jax.analysis.sparsity.cett_ppl_search_checkpoints``); that CETT is then applied to
  every checkpoint, each with the per-layer thresholds of its own dense pass
  (``sparsity_at_cett``): the activation ratio and the PPL ratio it costs there.
* **protocol ``per_checkpoint``**: a fresh CETT-PPL-1% search at every checkpoint
  (``cett_ppl_search``), the earlier behaviour. With ``fixed`` it also runs, as a control, on the
  seeds of ``control_seeds`` (tol ``search_tol``), to show how much of the checkpoint-to-checkpoint
  jitter the per-checkpoint search adds.
* **stability of the CETT**: the fixed-protocol search repeated on each half of the CETT slice
  (``stability=True``); the three values and the last checkpoint's activation ratio at each.
* dense validation perplexity on ``ppl_batches`` x ``ppl_batch_size`` rows.

Tokens seen D = step x batch_size x seq_len (packed rows). The ReLU law A = exp(-c D^a + b) + A0
is fitted to ReLU-GLU's seed-mean points and the SiLU law A = -c D^-a + A0 to SwiGLU's
(``fit_relu_law`` / ``fit_silu_law``, D in billions of tokens as the paper).

Gate (the pilot): every model learns (its last checkpoint's dense PPL below 0.8 x its first's)
and sparsity costs perplexity (the CETT search ends below c = 1); results.md says when it fails.

Resumes: training resumes from its checkpoints, a finished run is not retrained (its
``train.json``), the CETT searches are cached in ``DIR/<activation>/seed_<s>/cett.json`` and each
checkpoint's evaluation in ``.../eval/``. A workdir made with another preset or config stops with
an error instead of mixing runs.

Writes DIR/config.json, DIR/results.csv (one row per activation x seed x protocol x checkpoint),
DIR/cett.csv (one row per model: the CETT and its stability), DIR/fits.json, DIR/results.md,
DIR/activation_ratio_vs_tokens.png and DIR/dense_ppl_vs_tokens.png; per run the trainer's
metrics.jsonl, TensorBoard events and checkpoints.
"""
import argparse
import functools
import json
import math
import os
import sys

from experiments.common import (cached, git_commit, preset, record, stopwatch, train_run, write_atomic,
                                write_csv, write_json)
from experiments.sparsity_law.report import ACTIVATIONS, CETT_FIELDS, FIELDS, markdown, mean_rows, plots
from icml_jax import xla_env

PROTOCOLS = ("fixed", "per_checkpoint")
PRESETS = {
    # seeds; evaluated checkpoints (log-spaced multiples of eval_grain); CETT slice; dense-PPL
    # slice; CETT-PPL-p% settings; the protocol and its settings
    # (tiny: the dense-PPL slice in the CETT slice's batch shape, so one compiled pass serves both)
    "tiny": preset(seeds=(0,), eval_points=5, eval_grain=5, cett_batches=2, cett_batch_size=4,
                   ppl_batches=4, ppl_batch_size=4, p=1.0, tol=1e-6, protocol="fixed", last_checkpoints=2,
                   search_tol=1e-3, cett_digits=4, control_seeds=(0,), stability=True),
    "default": preset(seeds=(0, 1, 2), eval_points=10, eval_grain=20, cett_batches=16, cett_batch_size=16,
                      ppl_batches=16, ppl_batch_size=32, p=1.0, tol=1e-6, protocol="fixed",
                      last_checkpoints=5, search_tol=1e-3, cett_digits=4, control_seeds=(0,),
                      stability=True),
}


def eval_steps(steps: int, every: int, points: int) -> list:
    """``points`` log-spaced checkpoint steps from ``every`` to ``steps`` (multiples of ``every``,
    deduplicated, the last step always included)."""
    import numpy as np
    if steps < every:
        raise ValueError(f"train.steps={steps} is below the evaluation grain {every}: no checkpoint "
                         "to evaluate before the last")
    raw = np.geomspace(every, steps, points)
    out = sorted({min(steps, max(every, int(round(s / every)) * every)) for s in raw} | {steps})
    return out


def check_workdir(path: str, meta: dict) -> None:
    """Stops when DIR/config.json was written for another preset / config (one line)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    for k in ("preset", "base_config", "exp"):
        if old.get(k) != meta[k]:
            what = (f"preset {old.get('preset')!r}" if k == "preset" else f"a different {k}")
            raise SystemExit(f"error: {path} holds results from {what} (this run: preset "
                             f"{meta['preset']!r}); use another --workdir or delete that one")


def load_params(ckpt_dir: str, step: int):
    """The params of checkpoint ``step`` (restored without a target: plain arrays)."""
    import orbax.checkpoint as ocp
    from icml_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(ckpt_dir, keep=1_000_000, async_save=False)
    try:
        if step not in ck.all_steps():
            raise FileNotFoundError(f"checkpoint {step} is missing from {ckpt_dir} (have "
                                    f"{ck.all_steps()}); delete {os.path.dirname(ckpt_dir)} to retrain")
        state = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return state["state"]["params"]
    finally:
        ck.close()


def search_checkpoint(model, params, cett_batches, exp, tol) -> dict:
    """Protocol ``per_checkpoint``: a CETT-PPL-p% search on this checkpoint alone."""
    from icml_jax.analysis import sparsity as sp
    r = sp.cett_ppl_search(model, params, cett_batches, p=exp["p"], tol=tol)
    return {"cett": r["cett"], "activation_ratio": r["activation_ratio"], "ppl_ratio": r["ppl_ratio"],
            "cett_slice_ppl_dense": r["ppl_dense"], "thresholds": [float(t) for t in r["thresholds"]]}


def at_cett(model, params, cett_batches, cett) -> dict:
    """Protocol ``fixed``: the model's one CETT applied to this checkpoint."""
    from icml_jax.analysis import sparsity as sp
    r = sp.sparsity_at_cett(model, params, cett_batches, cett)
    return {"cett": cett, "activation_ratio": r["activation_ratio"], "ppl_ratio": r["ppl_ratio"],
            "cett_slice_ppl_dense": r["ppl_dense"], "thresholds": [float(t) for t in r["thresholds"]]}


def run_checks(model, params, cett_batches, ppl_batches) -> dict:
    """Dense validation PPL and the share of (token, neuron) slots with act(gate) != 0 on the
    CETT slice: for ReLU-GLU the most neurons the exact decode-time sparse path
    (``models/sparse_ffn.py``) can have to gather."""
    import numpy as np
    from icml_jax.analysis import sparsity as sp
    nz = tot = 0
    for b in cett_batches:
        for g, _ in sp.collect_gate_up(model, params, b):
            nz, tot = nz + int(np.count_nonzero(g)), tot + g.size
    return {"gate_active": nz / tot, "dense_ppl": math.exp(sp.dense_loss(model, params, ppl_batches))}


def find_cett(model, load, steps, cett_batches, exp) -> dict:
    """The fixed protocol's search on the last checkpoints, and (``stability``) on each half of
    the slice; each with the last checkpoint's activation ratio at the CETT it found."""
    from icml_jax.analysis import sparsity as sp
    last = steps[-exp["last_checkpoints"]:]
    params = [load(s) for s in last]
    halves = {"full": list(cett_batches)}
    if exp["stability"]:
        h = len(cett_batches) // 2
        if h < 1:
            raise SystemExit(f"error: stability=True needs cett_batches >= 2 (two halves), got "
                             f"{len(cett_batches)}; set --exp.cett_batches or stability=False")
        halves.update(half_a=list(cett_batches[:h]), half_b=list(cett_batches[h:2 * h]))
    out = {"search_steps": last}
    for name, bs in halves.items():
        r = sp.cett_ppl_search_checkpoints(model, params, bs, p=exp["p"], tol=exp["search_tol"],
                                           digits=exp["cett_digits"])
        out[name] = {"cett": r["cett"], "mean_ppl_ratio": r["mean_ppl_ratio"], "ppl_ratios": r["ppl_ratios"],
                     "upper": r["upper"], "iterations": r["iterations"],
                     "last_activation_ratio": sp.sparsity_at_cett(model, params[-1], bs,
                                                                  r["cett"])["activation_ratio"]}
    return out


def run_model(cfg, run_dir, exp, steps, batches, protocols):
    """Trains (or resumes) one model, evaluates its checkpoints; returns (info, rows, cett row)."""
    from icml_jax.models import build_model
    key = {"config": json.loads(cfg.to_json_best_effort())}
    rec = record(exp)
    model = build_model(cfg.model)
    ckpts = os.path.join(run_dir, "checkpoints")

    def train():
        s, _, _ = train_run(cfg, run_dir)
        return {"final_loss": s.get("loss"), "eval_loss": s.get("eval_loss"), "params": s.get("params")}

    info = dict(cached(os.path.join(run_dir, "train.json"), key, train, seconds_key="train_seconds"),
                eval_seconds=0.0)
    # each step's checks and evaluation read the same checkpoint in turn: restore it once
    load = functools.lru_cache(maxsize=2)(lambda step: load_params(ckpts, step))
    act, seed = cfg.model.mlp.activation, cfg.seed
    cett = None
    if "fixed" in protocols:
        cett = cached(os.path.join(run_dir, "cett.json"), {**key, "exp": rec, "steps": steps},
                      lambda: find_cett(model, load, steps, batches[0], exp), seconds_key="eval_seconds")
        info["eval_seconds"] += cett["eval_seconds"]
    rows = []
    for step in steps:
        ck = cached(os.path.join(run_dir, "eval", f"checks_{step:06d}.json"), {**key, "exp": rec, "step": step},
                    lambda: run_checks(model, load(step), *batches))
        tokens = step * cfg.train.batch_size * cfg.data.seq_len
        for proto in protocols:
            if proto == "fixed":
                c = cett["full"]["cett"]
                ev = cached(os.path.join(run_dir, "eval", f"fixed_{step:06d}.json"),
                            {**key, "exp": rec, "step": step, "cett": c},
                            lambda: at_cett(model, load(step), batches[0], c), seconds_key="eval_seconds")
            else:
                tol = exp["tol"] if exp["protocol"] == "per_checkpoint" else exp["search_tol"]
                ev = cached(os.path.join(run_dir, "eval", f"search_{step:06d}.json"),
                            {**key, "exp": rec, "step": step, "tol": tol},
                            lambda: search_checkpoint(model, load(step), batches[0], exp, tol),
                            seconds_key="eval_seconds")
            info["eval_seconds"] += ev["eval_seconds"]
            rows.append({"activation": act, "seed": seed, "protocol": proto, "step": step, "tokens": tokens,
                         "dense_ppl": ck["dense_ppl"], "cett": ev["cett"],
                         "activation_ratio": ev["activation_ratio"], "sparsity": 1 - ev["activation_ratio"],
                         "ppl_ratio": ev["ppl_ratio"], "cett_slice_ppl_dense": ev["cett_slice_ppl_dense"],
                         "gate_active": ck["gate_active"], "thresholds": ev["thresholds"]})
            print(f"{act} seed {seed} step {step} ({tokens:,} tokens) [{proto}]: activation ratio "
                  f"{ev['activation_ratio']:.4f} (CETT {ev['cett']:.4f}, PPL ratio {ev['ppl_ratio']:.4f}), "
                  f"dense PPL {ck['dense_ppl']:.3f}", flush=True)
    crow = None
    if cett is not None:
        crow = {"activation": act, "seed": seed, "search_steps": " ".join(map(str, cett["search_steps"]))}
        for part in ("full", "half_a", "half_b"):
            if part in cett:
                crow.update({f"cett_{part}": cett[part]["cett"],
                             f"last_ratio_{part}": cett[part]["last_activation_ratio"]})
        crow.update(mean_ppl_ratio=cett["full"]["mean_ppl_ratio"], search_upper=cett["full"]["upper"])
    return info, rows, crow


def fit_laws(rows) -> dict:
    """{fit key of report.FIT_KEYS: fit dict or {"error": ...}} on the seed-mean points, D in
    billions of tokens; ``swiglu_rising`` (with its ``from_step``) only when SiLU-GLU's minimum
    leaves at least 4 points after it."""
    from icml_jax.analysis import sparsity as sp
    out = {}
    means = mean_rows(rows)
    for key, act, fit in (("relu_glu", "relu_glu", sp.fit_relu_law), ("swiglu", "swiglu", sp.fit_silu_law),
                          ("swiglu_rising", "swiglu", sp.fit_silu_law)):
        pts = [r for r in means if r["activation"] == act]
        extra = {}
        if key == "swiglu_rising":
            i = min(range(len(pts)), key=lambda j: pts[j]["activation_ratio"]) if pts else 0
            if i == 0 or len(pts) - i < 4:
                continue
            pts, extra = pts[i:], {"from_step": pts[i]["step"]}
        if not pts:
            continue
        try:
            out[key] = {**fit([r["tokens"] / 1e9 for r in pts], [r["activation_ratio"] for r in pts]), **extra}
        except (ValueError, RuntimeError, FloatingPointError) as e:
            out[key] = {"error": f"{type(e).__name__}: {e}", **extra}
    return out


def _int_list(text, flag):
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"error: {flag} takes comma-separated integers, got {text!r}") from None


def main(argv=None):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="Sparsing Law: activation ratio vs tokens, ReLU-GLU vs SiLU-GLU")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--activations", default=",".join(ACTIVATIONS))
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (init and data order); "
                   "default: the preset's")
    p.add_argument("--protocol", default=None, choices=PROTOCOLS,
                   help="fixed: one CETT per model from its last checkpoints (the authors'); "
                        "per_checkpoint: a CETT-PPL search at every checkpoint")
    a = p.parse_args(argv)
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, make_eval_batches

    elapsed = stopwatch()
    acts = tuple(x for x in a.activations.split(",") if x)
    bad = [x for x in acts if x not in ACTIVATIONS]
    if bad or not acts:
        raise SystemExit(f"error: --activations takes a subset of {list(ACTIVATIONS)}, got {a.activations!r}")
    exp = PRESETS[a.preset].copy_and_resolve_references()
    if a.seeds is not None:
        exp.seeds = _int_list(a.seeds, "--seeds")
        if not exp.seeds:
            raise SystemExit("error: --seeds is empty; give at least one seed, e.g. --seeds=0")
    if a.protocol:
        exp.protocol = a.protocol
    protocols = ["fixed", "per_checkpoint"] if exp.protocol == "fixed" else ["per_checkpoint"]
    base = load_config(f"configs/sparsity.py:{a.preset}", unlocked=True)
    if a.steps:
        base.train.steps = a.steps
    t = base.train
    steps = eval_steps(t.steps, exp.eval_grain, exp.eval_points)
    if exp.protocol == "fixed" and not 1 <= exp.last_checkpoints <= len(steps):
        raise SystemExit(f"error: last_checkpoints={exp.last_checkpoints} must be between 1 and the "
                         f"{len(steps)} evaluated checkpoints")
    base.train.checkpoint_steps = tuple(steps)
    n_ckpt = len(set(steps) | set(range(t.checkpoint_every, t.steps + 1, t.checkpoint_every)))
    if n_ckpt > t.keep_checkpoints:
        raise SystemExit(f"error: {n_ckpt} checkpoints would be written but only "
                         f"train.keep_checkpoints={t.keep_checkpoints} kept; the evaluated ones would be lost")
    meta_cfg = {"preset": a.preset, "activations": list(acts), "exp": record(exp), "eval_steps": steps,
                "base_config": json.loads(base.to_json_best_effort())}
    os.makedirs(a.workdir, exist_ok=True)
    check_workdir(os.path.join(a.workdir, "config.json"), meta_cfg)
    write_json(os.path.join(a.workdir, "config.json"), meta_cfg)
    tok = build_tokenizer(base.data.tokenizer)
    L = base.data.seq_len
    batches = tuple(make_eval_batches(base.data, tok, split="validation", seq_len=L, batch_size=bs,
                                      max_batches=nb)
                    for nb, bs in ((exp.cett_batches, exp.cett_batch_size),
                                   (exp.ppl_batches, exp.ppl_batch_size)))
    rows, infos, cett_rows = [], {}, []
    for act in acts:
        for seed in exp.seeds:
            cfg = base.copy_and_resolve_references()
            cfg.seed = seed
            cfg.model.mlp.activation = act
            control = exp.protocol == "per_checkpoint" or seed in exp.control_seeds
            print(f"=== {act}, seed {seed} ===", flush=True)
            infos[(act, seed)], r, crow = run_model(cfg, os.path.join(a.workdir, act, f"seed_{seed}"), exp,
                                                    steps, batches,
                                                    [x for x in protocols if x == "fixed" or control])
            rows += r
            cett_rows += [crow] if crow else []
    main_rows = [r for r in rows if r["protocol"] == exp.protocol]
    fits = fit_laws(main_rows)
    write_csv(os.path.join(a.workdir, "results.csv"),
              [{**r, "thresholds": " ".join(f"{x:.6g}" for x in r["thresholds"])} for r in rows], FIELDS)
    write_csv(os.path.join(a.workdir, "cett.csv"), cett_rows, CETT_FIELDS)
    write_json(os.path.join(a.workdir, "fits.json"), fits)
    m = base.model
    meta = {"command": "python -m experiments.sparsity_law " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "seeds": list(exp.seeds), "preset": a.preset, "steps": t.steps,
            "protocol": exp.protocol, "exp": record(exp),
            "wall_seconds": elapsed(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "train_seconds": sum(i["train_seconds"] for i in infos.values()),
            "eval_seconds": sum(i["eval_seconds"] for i in infos.values()),
            "batch": t.batch_size, "seq_len": L,
            "cett_tokens": int(sum(float(b["segment_ids"].astype(bool).sum()) for b in batches[0])),
            "ppl_tokens": int(sum(float(b["segment_ids"].astype(bool).sum()) for b in batches[1])),
            "model": f"{m.num_layers} layers, d_model {m.d_model}, d_ff {m.ffn_dim} (gated), {m.num_heads} "
                     f"heads of {m.head_dim}, RoPE, {next(iter(infos.values())).get('params') or 0:,} params; "
                     f"AdamW lr {t.lr}, {t.warmup_steps} warmup steps then constant, batch {t.batch_size} × {L}"}
    md = markdown(rows, cett_rows, fits, meta)
    write_atomic(os.path.join(a.workdir, "results.md"), md)
    plots(rows, fits, a.workdir, exp.protocol)
    print(md)
    return {"rows": rows, "cett": cett_rows, "fits": fits, "infos": infos}


if __name__ == "__main__":
    main(sys.argv[1:])
