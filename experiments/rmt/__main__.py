"""Residual Matrix Transformer vs transformer on Shakespeare, and a residual-size (Dk) sweep.

  python -m experiments.rmt --workdir=runs/rmt [--preset=tiny|default] [--seeds=0,1] [--steps=N]

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

The main pair runs with ``seeds``, the sweep with ``sweep_seeds``. Every (run, seed) trains through
``train_and_evaluate`` in ``DIR/<run>_s<seed>/`` (metrics.jsonl, TensorBoard, checkpoints; a killed
run resumes from its last checkpoint) and its digest is cached in ``result.json`` there, so a
rerun with the same settings recomputes nothing.

Writes DIR/config.json, DIR/results.csv (one row per run and eval point), DIR/results.md,
DIR/loss_vs_tokens.png, DIR/loss_vs_flops.png and DIR/dev_loss_vs_residual.png.
"""
import argparse
import json
import os
import sys
import time

from experiments.common import (cached, git_commit, markdown_table, write_atomic, write_csv,
                                write_json)
from icml_jax import xla_env

# The tiny transformer of the experiment, GPT-2-like so that only the residual stream differs from the RMT.
TRANSFORMER = {"model.d_model": 128, "model.num_layers": 4, "model.num_heads": 4,
               "model.num_kv_heads": 4, "model.head_dim": 32, "model.ffn_dim": 512,
               "model.mlp.activation": "gelu_tanh", "model.tie_embeddings": False,
               "model.position": "alibi"}

PRESETS = {
    # train: overrides shared by every run; lr: peak learning rate per family (each family keeps
    # the rest of its config: the RMT its reference optimiser settings and z-loss).
    "tiny": dict(
        seeds=(0,), sweep_seeds=(0,), key_dims=(2, 8), main_key_dim=8,
        transformer={**TRANSFORMER, "model.d_model": 32, "model.num_layers": 1,
                     "model.num_heads": 2, "model.num_kv_heads": 2, "model.head_dim": 16,
                     "model.ffn_dim": 64, "model.max_seq_len": 128},
        rmt={"model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2,
             "model.head_dim": 16, "model.ffn_dim": 64, "model.max_seq_len": 128},
        lr={"transformer": 1e-2, "rmt": 1e-2},
        # seq_len 128 although the models are tiny: the trainer packs the whole validation split
        # into rows before picking eval batches, and that costs per row
        train={"data.seq_len": 128, "train.steps": 24, "train.batch_size": 4,
               "train.warmup_steps": 3, "train.log_every": 4, "train.eval_every": 8,
               "train.eval_batches": 2, "train.checkpoint_every": 12},
    ),
    "default": dict(
        seeds=(0, 1), sweep_seeds=(0,), key_dims=(4, 8, 16, 32), main_key_dim=16,
        transformer=dict(TRANSFORMER),
        rmt={},
        # peak lr per family: the best in LR_PROBE (1e-2 is also the RMT reference's lr)
        lr={"transformer": 3e-3, "rmt": 1e-2},
        train={"data.seq_len": 128, "train.steps": 250, "train.batch_size": 8,
               "train.warmup_steps": 25, "train.log_every": 10, "train.eval_every": 50,
               "train.eval_batches": 12, "train.checkpoint_every": 125},
    ),
}
QUIET = {"train.samples": 0, "train.progress": False}
# The probe that chose the default preset's peak lr per family (measured once, 2026-12-01, not rerun
# by the experiment): 80 steps x 8 rows x 128 tokens, warmup 8, seed 0, dev loss on 4 validation
# batches; transformer at the spec shape, RMT at Dk=16, N_ff=512.
LR_PROBE = {"transformer": {3e-3: 2.7571, 1e-2: 3.0314},
            "rmt": {3e-3: 2.8999, 1e-2: 2.7527, 3e-2: 3.1690}}


def _load(spec, overrides):
    from icml_jax.config_utils import load_config
    cfg = load_config(spec, unlocked=True)
    cfg.update_from_flattened_dict(dict(overrides))
    return cfg


def transformer_config(exp):
    return _load("configs/lm.py:small", {**exp["transformer"], **exp["train"], **QUIET,
                                          "train.lr": exp["lr"]["transformer"]})


def rmt_config(exp, key_dim, ffn_dim=None):
    over = {**exp["rmt"], **exp["train"], **QUIET, "train.lr": exp["lr"]["rmt"],
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


def plan(exp):
    """[(run name, family, group, config, seeds)] for the preset."""
    from icml_jax.analysis.flops import param_count
    tf = transformer_config(exp)
    dk_main = exp["main_key_dim"]
    if dk_main not in exp["key_dims"]:
        raise ValueError(f"main_key_dim={dk_main} must be one of key_dims={exp['key_dims']}")
    nff = matched_ffn_dim(param_count(tf.model), exp, dk_main)
    runs = [("transformer", "transformer", "main", tf, exp["seeds"]),
            ("rmt_matched", "rmt", "main", rmt_config(exp, dk_main, nff), exp["seeds"])]
    runs += [(f"rmt_dk{dk}", "rmt", "sweep", rmt_config(exp, dk), exp["sweep_seeds"])
             for dk in exp["key_dims"]]
    return runs


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
    """Trains (or resumes) one run; returns its digest: params, FLOPs/token, eval curve, step time."""
    from icml_jax.analysis.flops import param_count, train_flops_per_token
    from icml_jax.train.metrics import read_metrics
    from icml_jax.train.trainer import train_and_evaluate
    t0 = time.time()
    summary = train_and_evaluate(cfg, workdir)
    wall = time.time() - t0
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
            "flops_per_token": float(fpt_paper), "exact_flops_per_token": float(fpt), "curve": curve, "final_eval_loss": curve[-1]["eval_loss"],
            "final_train_loss": float(sum(train[-5:]) / len(train[-5:])),
            "tokens": curve[-1]["tokens"], "step_seconds": step_seconds(rows, cfg),
            "wall_seconds": _training_seconds(workdir, summary["start_step"], summary["step"], wall)}


def _describe(name, cfg):
    m = cfg.model
    if m.residual == "rmt":
        return (f"RMT L={m.num_layers}, Dk={m.rmt.key_dim}, Dv={m.head_dim}, R={m.num_heads}, "
                f"N_ff={m.ffn_dim}")
    return (f"transformer L={m.num_layers}, D={m.d_model}, {m.num_heads} heads of {m.head_dim}, "
            f"D_FF={m.ffn_dim}")


def residual_size(cfg):
    m = cfg.model
    return m.rmt.key_dim * m.head_dim if m.residual == "rmt" else m.d_model


def _mean_spread(xs):
    import numpy as np
    return float(np.mean(xs)), float(np.max(xs) - np.min(xs)) / 2, len(xs)


def mean_curve(results, name):
    """Eval points of ``name`` averaged over its seeds: (tokens, flops, loss) arrays."""
    import numpy as np
    curves = [r["curve"] for (n, _), r in sorted(results.items()) if n == name]
    k = min(len(c) for c in curves)
    pick = lambda f: np.mean([[p[f] for p in c[:k]] for c in curves], axis=0)
    return pick("tokens"), pick("flops"), pick("eval_loss")


def tokens_to_reach(results, name, target):
    """(tokens, FLOPs) at which ``name``'s seed-mean eval curve first reaches ``target`` (linear
    interpolation between eval points), or None if it never does."""
    tokens, flops, loss = mean_curve(results, name)
    for i in range(len(loss)):
        if loss[i] <= target:
            if i == 0:
                return float(tokens[0]), float(flops[0])
            w = (loss[i - 1] - target) / (loss[i - 1] - loss[i])
            return (float(tokens[i - 1] + w * (tokens[i] - tokens[i - 1])),
                    float(flops[i - 1] + w * (flops[i] - flops[i - 1])))
    return None


def csv_rows(runs, results):
    out = []
    for name, family, group, cfg, seeds in runs:
        for seed in seeds:
            r = results[(name, seed)]
            for p in r["curve"]:
                out.append(dict(run=name, family=family, group=group, seed=seed,
                                key_dim=cfg.model.rmt.key_dim if family == "rmt" else "",
                                residual_size=residual_size(cfg), ffn_dim=cfg.model.ffn_dim,
                                params=r["params"], flops_per_token=r["flops_per_token"],
                                exact_flops_per_token=r["exact_flops_per_token"],
                                step_ms=round(r["step_seconds"] * 1e3, 2), step=p["step"],
                                tokens=int(p["tokens"]), train_flops=p["flops"],
                                exact_train_flops=p["exact_flops"],
                                eval_loss=round(p["eval_loss"], 5)))
    return out


CSV_FIELDS = ("run", "family", "group", "seed", "key_dim", "residual_size", "ffn_dim", "params",
              "flops_per_token", "exact_flops_per_token", "step_ms", "step", "tokens",
              "train_flops", "exact_train_flops", "eval_loss")


def summarize(runs, results):
    """Per run name: description, params, FLOPs/token, final dev/train loss stats, step time."""
    out = {}
    for name, family, group, cfg, seeds in runs:
        rs = [results[(name, s)] for s in seeds]
        out[name] = dict(family=family, group=group, desc=_describe(name, cfg), seeds=list(seeds),
                         params=rs[0]["params"], params_formula=rs[0]["params_formula"],
                         residual=residual_size(cfg), key_dim=cfg.model.rmt.key_dim,
                         ffn_dim=cfg.model.ffn_dim,
                         flops_per_token=rs[0]["flops_per_token"],
                         exact_flops_per_token=rs[0]["exact_flops_per_token"], tokens=rs[0]["tokens"],
                         dev=_mean_spread([r["final_eval_loss"] for r in rs]),
                         dev_seeds=[r["final_eval_loss"] for r in rs],
                         train=_mean_spread([r["final_train_loss"] for r in rs]),
                         step_ms=_mean_spread([r["step_seconds"] * 1e3 for r in rs])[0])
    return out


def reading(s, results, exp):
    """Plain statements of what the numbers show (generated, so a rerun cannot contradict them)."""
    tf, rm = s["transformer"], s["rmt_matched"]
    spec = s[f"rmt_dk{exp['main_key_dim']}"]
    lines = []
    d = rm["dev"][0] - tf["dev"][0]
    noise = rm["dev"][1] + tf["dev"][1]
    if len(tf["seeds"]) < 2:
        verdict = "lower" if d < 0 else "higher"
        verdict += "; one seed, so not tested against seed noise"
    elif abs(d) > noise:
        verdict = ("lower" if d < 0 else "higher") + ", by more than the two seed half-ranges combined"
    else:
        verdict = ("lower" if d < 0 else "higher") + ", within the seed spread: not a resolved difference"
    holds = ("holds" if d < 0 and (len(tf["seeds"]) < 2 or abs(d) > noise) else
             "is not resolved" if d < 0 else "does not hold")
    lines.append(f"* **Matched parameters, equal tokens.** The RMT's final dev loss is "
                 f"{rm['dev'][0]:.4f} vs the transformer's {tf['dev'][0]:.4f} (Δ = {d:+.4f}, "
                 f"{verdict}; ± is half the range over {len(tf['seeds'])} seed(s)), at "
                 f"{rm['flops_per_token'] / tf['flops_per_token']:.2f}× the transformer's FLOPs/token. "
                 f"The paper's direction (the RMT is better at matched parameters) {holds} here.")
    reach = tokens_to_reach(results, "rmt_matched", tf["dev"][0])
    if reach:
        lines.append(f"* The matched RMT reaches the transformer's final dev loss after "
                     f"{reach[0] / tf['tokens']:.0%} of the tokens and {reach[1] / (tf['tokens'] * tf['flops_per_token']):.0%} "
                     f"of the transformer's training FLOPs (seed-mean curves, linear interpolation "
                     f"between eval points).")
    else:
        lines.append("* The matched RMT does not reach the transformer's final dev loss within the run.")
    d2 = spec["dev"][0] - tf["dev"][0]
    lines.append(f"* **Spec shapes (RMT with {1 - spec['params'] / tf['params']:.0%} fewer parameters, "
                 f"{spec['flops_per_token'] / tf['flops_per_token']:.2f}× the FLOPs/token).** Dev loss "
                 f"{spec['dev'][0]:.4f} vs {tf['dev'][0]:.4f} (Δ = {d2:+.4f}).")
    lines.append(f"* **Wall-clock.** RMT step {rm['step_ms']:.0f} ms vs transformer {tf['step_ms']:.0f} ms "
                 f"({rm['step_ms'] / tf['step_ms']:.2f}×; medians from the trainer's tokens/s on a "
                 "shared machine — `benchmarks/rmt_cost.py` measures it interleaved).")
    sweep = [s[f"rmt_dk{k}"] for k in sorted(exp["key_dims"])]
    devs = [x["dev"][0] for x in sweep]
    mono = all(b < a for a, b in zip(devs, devs[1:]))
    span = devs[0] - devs[-1]
    spread = max(x["dev"][1] for x in sweep)
    trend = ("falls monotonically" if mono else
             "does not fall monotonically" + (" but is lower at the largest Dk" if span > 0 else ""))
    lines.append(f"* **Residual-size sweep.** Dev loss {trend} as Dk·Dv grows from "
                 f"{sweep[0]['residual']} to {sweep[-1]['residual']}: "
                 + ", ".join(f"{x['residual']}: {x['dev'][0]:.4f}" for x in sweep)
                 + f" (largest minus smallest = {-span:+.4f}; parameters "
                 f"{sweep[0]['params']:,}–{sweep[-1]['params']:,}, FLOPs/token "
                 f"{sweep[0]['flops_per_token'] / 1e6:.2f}M–{sweep[-1]['flops_per_token'] / 1e6:.2f}M"
                 + (f"; seed half-range up to {spread:.4f}" if len(sweep[0]["seeds"]) > 1 else
                    "; one seed per point" + (f", so differences below the main pair's seed "
                                              f"half-range (≈{tf['dev'][1]:.4f}) are not resolved"
                                              if len(tf["seeds"]) > 1 else "")) + ").")
    return lines


def sweep_rows(s, exp, fmt):
    ks = sorted(exp["key_dims"])
    base = s[f"rmt_dk{ks[0]}"]["dev"][0]
    rows = []
    for k in ks:
        x = s[f"rmt_dk{k}"]
        rows.append([k, x["residual"], f"{x['params']:,}", f"{x['flops_per_token'] / 1e6:.3f}M",
                     fmt(x["dev"]), ", ".join(f"{v:.4f}" for v in x["dev_seeds"]),
                     f"{x['dev'][0] - base:+.4f}"])
    return rows


def markdown(runs, results, exp, meta):
    s = summarize(runs, results)
    tf, rm, spec = s["transformer"], s["rmt_matched"], s[f"rmt_dk{exp['main_key_dim']}"]
    t = runs[0][3]
    tokens = t.train.steps * t.train.batch_size * t.data.seq_len
    fmt = lambda x: f"{x[0]:.4f} ± {x[1]:.4f}" if x[2] > 1 else f"{x[0]:.4f}"
    lines = ["# Residual Matrix Transformer vs transformer (Shakespeare, byte-level)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, preset `{meta['preset']}`, "
             f"seeds {list(exp['seeds'])} (main pair), {list(exp['sweep_seeds'])} (Dk sweep). Wall time: "
             f"{sum(r['wall_seconds'] for r in results.values()) / 60:.1f} min of training and "
             f"evaluation summed over the {len(results)} runs (measured when each ran); this "
             f"invocation {meta['wall_seconds'] / 60:.1f} min ({meta['cpus']} CPUs, shared with "
             f"other jobs; load average {meta['load']:.1f} at the end).", "",
             f"Training: every run sees the same {tokens:,} tokens ({t.train.steps} steps × "
             f"{t.train.batch_size} rows × {t.data.seq_len}; same order per seed), warmup "
             f"{t.train.warmup_steps} steps then cosine decay. Peak lr: transformer "
             f"{exp['lr']['transformer']}, RMT {exp['lr']['rmt']}"
             + (" — each the best of a short probe (`LR_PROBE`: 80 steps × 8 × 128 tokens, dev loss "
                + "; ".join(f"{fam} " + ", ".join(f"{lr:g} → {v}" for lr, v in probe.items())
                            for fam, probe in LR_PROBE.items()) + ")"
                if meta["preset"] == "default" else "")
             + ". Each family keeps the rest of its config: `configs/lm.py` AdamW (weight decay "
             f"{t.train.weight_decay}) for the transformer, `configs/rmt.py` (reference muP AdamW, "
             f"weight decay {runs[1][3].train.weight_decay}, z-loss {runs[1][3].train.z_loss}) for the "
             "RMT. Dev "
             f"loss = CE (nats/byte) on {t.train.eval_batches} fixed validation batches (the same "
             "tokens for every run). Training FLOPs = tokens × `icml_jax.analysis.flops."
             "train_flops_per_token(..., convention=\"paper\")`, the paper's Table 7 formulas "
             "(docs/methods/rmt.md, RMT vocabulary term R·V) for both families; the `exact` convention "
             "(every matmul, causal attention as half) is in the CSV and the last table column.", "",
             "**Parameter matching.** At the spec's shapes the RMT has fewer parameters than the "
             "transformer (it has no 4·D² attention matrices). The main comparison therefore keeps "
             "the transformer at the spec's shape and widens the RMT's FFN (`rmt_matched`, "
             f"N_ff = {rm['ffn_dim']}) until the parameter counts match "
             f"({rm['params']:,} vs {tf['params']:,}); the spec-shaped RMT (N_ff = "
             f"{spec['ffn_dim']}, {1 - spec['params'] / tf['params']:.0%} fewer parameters) at the "
             f"same Dk = {exp['main_key_dim']} is reported too (a sweep point). Dk = "
             f"{exp['main_key_dim']} gives Dk·Dv = {rm['residual']} = "
             f"{rm['residual'] / tf['residual']:g}× the transformer's D, as for the paper's 305M RMT "
             "vs its 405M transformer (4096 = 4·1024).", "",
             "## Main comparison (equal tokens)", "",
             markdown_table(
                 ["run", "model", "params", "residual size", "train FLOPs/token (paper)",
                  "final dev loss", "final train loss", "step ms", "step vs transformer",
                  "FLOPs/token (exact)"],
                 [[n, s[n]["desc"], f"{s[n]['params']:,}", s[n]["residual"],
                   f"{s[n]['flops_per_token'] / 1e6:.2f}M", fmt(s[n]["dev"]), fmt(s[n]["train"]),
                   f"{s[n]['step_ms']:.0f}", f"{s[n]['step_ms'] / tf['step_ms']:.2f}×",
                   f"{s[n]['exact_flops_per_token'] / 1e6:.2f}M"]
                  for n in ("transformer", "rmt_matched", f"rmt_dk{exp['main_key_dim']}")]),
             "## Residual-size sweep (fixed Dv, R, N_ff)", "",
             markdown_table(["Dk", "Dk·Dv", "params", "train FLOPs/token", "final dev loss",
                             "per seed", "Δ vs smallest Dk"], sweep_rows(s, exp, fmt)),
             "## Reading", ""]
    lines += reading(s, results, exp)
    lines += ["", "Paper (docs/methods/rmt.md): at 46M–405M parameters and billions of tokens the RMT "
              "matches the transformer's loss with fewer parameters, FLOPs and tokens, and dev loss "
              "falls monotonically with Dk·Dv. These runs train on "
              f"{6.04e9 / tokens:,.0f}× fewer tokens than the paper's 6.04e9 and with "
              f"{405e6 / tf['params']:,.0f}× fewer parameters than its 405M transformer, with the "
              "learning rates picked by one short probe and no other tuning; they say what happens at "
              "this scale only, not whether the paper's scaling claims hold.", "",
              "Plots: `loss_vs_tokens.png`, `loss_vs_flops.png`, `dev_loss_vs_residual.png`. "
              "Per-run metrics: `<run>_s<seed>/metrics.jsonl` (and TensorBoard) in the workdir.", ""]
    return "\n".join(lines)


def plots(runs, results, exp, workdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = summarize(runs, results)
    shown = ("transformer", "rmt_matched", f"rmt_dk{exp['main_key_dim']}")
    colors = dict(zip(shown, ("tab:blue", "tab:red", "tab:orange")))
    for xname, xlabel, fname in (("tokens", "training tokens", "loss_vs_tokens.png"),
                                 ("flops", "training FLOPs (paper formulas)", "loss_vs_flops.png")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for n in shown:
            for (rn, seed), r in sorted(results.items()):
                if rn == n and len(s[n]["seeds"]) > 1:
                    ax.plot([p[xname] for p in r["curve"]], [p["eval_loss"] for p in r["curve"]],
                            color=colors[n], alpha=0.3, lw=0.8)
            tok, fl, loss = mean_curve(results, n)
            kind = "Dk·Dv" if s[n]["family"] == "rmt" else "D"
            ax.plot(tok if xname == "tokens" else fl, loss, marker="o", ms=3, color=colors[n],
                    label=f"{n}: {s[n]['params'] / 1e6:.2f}M params, residual {kind} = {s[n]['residual']}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("dev loss (nats/byte)")
        ax.set_title(f"Dev loss vs {xlabel.split(' (')[0]}" + (" (mean of seeds; faint: each seed)"
                                                             if len(exp["seeds"]) > 1 else ""),
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(workdir, fname), dpi=120)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ks = sorted(exp["key_dims"])
    for k in ks:
        x = s[f"rmt_dk{k}"]
        ax.annotate(f"Dk={k}\n{x['params'] / 1e6:.3f}M", (x["residual"], x["dev"][0]),
                    textcoords="offset points", xytext=(0, -10), ha="center", va="top", fontsize=7)
    xs = [s[f"rmt_dk{k}"]["residual"] for k in ks]
    for x, k in zip(xs, ks):
        ax.scatter([x] * len(s[f"rmt_dk{k}"]["dev_seeds"]), s[f"rmt_dk{k}"]["dev_seeds"],
                   color="tab:orange", alpha=0.5, s=14)
    ax.plot(xs, [s[f"rmt_dk{k}"]["dev"][0] for k in ks], marker="o", color="tab:orange",
            label=f"RMT, N_ff={s[f'rmt_dk{ks[0]}']['ffn_dim']} (Dk = {', '.join(map(str, ks))})")
    ax.axhline(s["transformer"]["dev"][0], color="tab:blue", ls="--",
               label=f"transformer D={s['transformer']['residual']} "
                     f"({s['transformer']['params'] / 1e6:.2f}M params)")
    ax.scatter([s["rmt_matched"]["residual"]], [s["rmt_matched"]["dev"][0]], color="tab:red",
               marker="s", zorder=3, label=f"rmt_matched ({s['rmt_matched']['params'] / 1e6:.2f}M params)")
    ax.margins(y=0.15)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("residual size Dk·Dv (log2)")
    ax.set_ylabel("final dev loss (nats/byte)")
    ax.set_title("Final dev loss vs residual size (equal tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "dev_loss_vs_residual.png"), dpi=120)
    plt.close(fig)


def main(argv=None, compile_cache=False):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="RMT vs transformer experiment (docs/methods/rmt.md)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--seeds", default="", help="comma-separated seeds of the main pair")
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    a = p.parse_args(argv)
    t_start = time.time()
    exp = json.loads(json.dumps(PRESETS[a.preset]))  # a deep copy with lists
    if a.seeds:
        try:
            exp["seeds"] = [int(x) for x in a.seeds.split(",")]
        except ValueError:
            raise SystemExit(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    if a.steps < 0:
        raise SystemExit(f"--steps must be positive, got {a.steps}")
    if a.steps:
        exp["train"]["train.steps"] = a.steps
    runs = plan(exp)
    os.makedirs(a.workdir, exist_ok=True)
    if compile_cache:
        enable_compilation_cache(os.path.join(os.path.abspath(a.workdir), "jax_cache"))
    write_json(os.path.join(a.workdir, "config.json"),
               {"preset": a.preset, "exp": exp,
                "runs": {n: {"family": f, "group": g, "seeds": list(sd),
                             "config": json.loads(c.to_json_best_effort())}
                         for n, f, g, c, sd in runs}})
    results = {}
    for name, family, group, cfg, seeds in runs:
        for seed in seeds:
            cfg = cfg.copy_and_resolve_references()
            cfg.seed = seed
            wd = os.path.join(a.workdir, f"{name}_s{seed}")
            print(f"=== {name} seed {seed}: {_describe(name, cfg)} ===", flush=True)
            key = {"config": json.loads(cfg.to_json_best_effort())}
            results[(name, seed)] = r = cached(os.path.join(wd, "result.json"), key,
                                               lambda: train_one(cfg, wd))
            print(f"{name} s{seed}: dev {r['final_eval_loss']:.4f}, {r['params']:,} params, "
                  f"{r['step_seconds'] * 1e3:.0f} ms/step, {r['wall_seconds']:.0f} s", flush=True)
    write_csv(os.path.join(a.workdir, "results.csv"), csv_rows(runs, results), CSV_FIELDS)
    meta = {"command": "python -m experiments.rmt " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "preset": a.preset, "wall_seconds": time.time() - t_start,
            "cpus": os.cpu_count(), "load": os.getloadavg()[0]}
    write_atomic(os.path.join(a.workdir, "results.md"), markdown(runs, results, exp, meta))
    plots(runs, results, exp, a.workdir)
    print(open(os.path.join(a.workdir, "results.md")).read())
    return results


def enable_compilation_cache(path):
    """Persistent XLA cache: the second seed of a config (same HLO) skips its compilations. Only
    for the command line (a process-wide setting; tests call ``main`` without it)."""
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


if __name__ == "__main__":
    main(compile_cache=True)
