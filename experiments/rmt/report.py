"""The report of experiments/rmt: results.csv rows, per-run summaries (seed mean ± half-range),
the generated ``reading`` statements, results.md and the three plots."""
import json
import os

import numpy as np

from experiments.common import markdown_table, mean_spread, pm, save_figure
from experiments.rmt.presets import LR_PROBE, as_dict
from experiments.rmt.stages import describe, residual_size


def config_json(preset_name, exp, runs):
    """config.json: the preset (as the plain dict it was saved as before) and every run's config."""
    return {"preset": preset_name, "exp": as_dict(exp),
            "runs": {n: {"family": f, "group": g, "seeds": list(sd),
                         "config": json.loads(c.to_json_best_effort())}
                     for n, f, g, c, sd in runs}}


def mean_curve(results, name):
    """Eval points of ``name`` averaged over its seeds: (tokens, flops, loss) arrays."""
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
        out[name] = dict(family=family, group=group, desc=describe(cfg), seeds=list(seeds),
                         params=rs[0]["params"], params_formula=rs[0]["params_formula"],
                         residual=residual_size(cfg), key_dim=cfg.model.rmt.key_dim,
                         ffn_dim=cfg.model.ffn_dim,
                         flops_per_token=rs[0]["flops_per_token"],
                         exact_flops_per_token=rs[0]["exact_flops_per_token"], tokens=rs[0]["tokens"],
                         dev=mean_spread([r["final_eval_loss"] for r in rs], "half_range"),
                         dev_seeds=[r["final_eval_loss"] for r in rs],
                         train=mean_spread([r["final_train_loss"] for r in rs], "half_range"),
                         step_ms=mean_spread([r["step_seconds"] * 1e3 for r in rs], "half_range")[0])
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
    fmt = lambda x: pm(x[0], x[1], nd=4) if x[2] > 1 else f"{x[0]:.4f}"  # (mean, half-range, n)
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
        save_figure(fig, os.path.join(workdir, fname), dpi=120)
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
    save_figure(fig, os.path.join(workdir, "dev_loss_vs_residual.png"), dpi=120)
