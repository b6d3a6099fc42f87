"""The report of experiments/rmt: results.csv rows, per-run summaries (seed mean ± standard
error), paired-by-seed differences (final and along training), the lr-grid table, the generated
``reading`` statements, results.md and the four plots."""
import json
import os

import numpy as np

from experiments.common import markdown_table, mean_spread, pm, save_figure
from experiments.rmt.presets import as_dict
from experiments.rmt.stages import describe, residual_size


def config_json(preset_name, exp, runs, picked):
    """config.json: the preset (as the plain dict it was saved as before, ``lr`` as used), the lr
    stage's table and picks (``pick_lrs``) and every run's config."""
    return {"preset": preset_name, "exp": as_dict(exp),
            "lr_grid": {shape: {"picked": lr, "dev_loss": {f"{k:g}": v for k, v in t.items()}}
                        for shape, (lr, t) in sorted(picked.items())},
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
                         dev=mean_spread([r["final_eval_loss"] for r in rs], "se"),
                         dev_seeds=[r["final_eval_loss"] for r in rs],
                         train=mean_spread([r["final_train_loss"] for r in rs], "se"),
                         step_ms=mean_spread([r["step_seconds"] * 1e3 for r in rs], "se")[0],
                         lr=cfg.train.lr)
    return out


def t95(n):
    """Two-sided 95% Student-t factor for a mean of ``n`` values (inf for n < 2)."""
    from scipy import stats
    return float(stats.t.ppf(0.975, n - 1)) if n > 1 else float("inf")


def paired_gap(results, a, b, seeds):
    """Per eval point, ``a``'s dev loss minus ``b``'s over the shared ``seeds`` (paired: the same
    seed sees the same tokens in the same order): (tokens, [(mean, s.e., n)] per point)."""
    curves = {n: [results[(n, s)]["curve"] for s in seeds] for n in (a, b)}
    k = min(len(c) for n in (a, b) for c in curves[n])
    tokens = [curves[b][0][i]["tokens"] for i in range(k)]
    gaps = [mean_spread([ca[i]["eval_loss"] - cb[i]["eval_loss"]
                         for ca, cb in zip(curves[a], curves[b])], "se") for i in range(k)]
    return tokens, gaps


def gap_change(results, a, b, seeds):
    """Change of the paired gap from the eval point halfway through training to the final one,
    per seed: (mean, s.e., n), the tokens at the halfway point and at the end."""
    curves = {n: [results[(n, s)]["curve"] for s in seeds] for n in (a, b)}
    k = min(len(c) for n in (a, b) for c in curves[n])
    h = (k - 1) // 2
    d = [(ca[k - 1]["eval_loss"] - cb[k - 1]["eval_loss"]) - (ca[h]["eval_loss"] - cb[h]["eval_loss"])
         for ca, cb in zip(curves[a], curves[b])]
    return mean_spread(d, "se"), curves[b][0][h]["tokens"], curves[b][0][k - 1]["tokens"]


def ci(x):
    """``mean ± s.e.`` of a (mean, s.e., n) and whether the 95% t interval excludes 0."""
    m, se, n = x
    return f"{m:+.4f} ± {se:.4f}", n > 1 and abs(m) > t95(n) * se


def _verdict(x, what):
    text, resolved = ci(x)
    if x[2] < 2:
        return f"{text}, one seed: not tested against seed noise"
    return (f"{text} (s.e. over {x[2]} seeds), " + (f"{what} resolved: the 95% t interval "
            "excludes 0" if resolved else f"not resolved: the 95% t interval includes 0"))


def reading(s, results, exp, picked):
    """Plain statements of what the numbers show (generated, so a rerun cannot contradict them)."""
    tf, rm = s["transformer"], s["rmt_matched"]
    spec_name = f"rmt_dk{exp['main_key_dim']}"
    spec = s[spec_name]
    seeds = list(exp["seeds"])
    lines = []
    gap = paired_gap(results, "rmt_matched", "transformer", seeds)[1][-1]
    d = gap[0]
    holds = ("holds" if d < 0 and ci(gap)[1] else "is not resolved" if d < 0 or not ci(gap)[1]
             else "does not hold")
    lines.append(f"* **Matched parameters, equal tokens.** The RMT's final dev loss is "
                 f"{rm['dev'][0]:.4f} vs the transformer's {tf['dev'][0]:.4f}: Δ (RMT − transformer, "
                 f"paired by seed) = {_verdict(gap, 'the difference is')}, at "
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
    for name in ("rmt_matched", spec_name):
        if not set(seeds) <= set(s[name]["seeds"]):
            continue
        ch, t_half, t_end = gap_change(results, name, "transformer", seeds)
        _, gaps = paired_gap(results, name, "transformer", seeds)
        lines.append(f"* **Gap against tokens ({name} − transformer).** "
                     + ", ".join(f"{g[0]:+.3f}" for g in gaps) + " at the eval points "
                     f"(`gap_vs_tokens.png`); from {t_half:,.0f} to {t_end:,.0f} tokens it "
                     f"changes by {_verdict(ch, 'the change is')}: "
                     + ("no resolved trend." if ch[2] < 2 or not ci(ch)[1] else
                        "the gap shrinks, the RMT gains on the transformer." if ch[0] < 0 else
                        "the gap grows, the RMT falls further behind."))
    ms = [results[("rmt_matched", x)]["final_eval_loss"] - results[(spec_name, x)]["final_eval_loss"]
          for x in seeds if (spec_name, x) in results]
    how = lambda shape: "grid pick" if shape in picked else "fixed"
    lr_note = (f" (lr {rm['lr']:g}, {how('rmt_matched')}, and {spec['lr']:g}, "
               f"{how('rmt_spec')})")
    lines.append(f"* **Matched vs spec-shaped RMT** (N_ff {rm['ffn_dim']} vs {spec['ffn_dim']}, "
                 f"{rm['params'] / spec['params']:.2f}× the parameters, same Dk = "
                 f"{exp['main_key_dim']}){lr_note}: Δ (matched − spec) = "
                 f"{_verdict(mean_spread(ms, 'se'), 'the difference is')}. Spec-shaped vs "
                 f"transformer ({1 - spec['params'] / tf['params']:.0%} fewer parameters, "
                 f"{spec['flops_per_token'] / tf['flops_per_token']:.2f}× the FLOPs/token): Δ = "
                 + _verdict(paired_gap(results, spec_name, "transformer",
                                       [x for x in seeds if x in spec["seeds"]])[1][-1],
                            "the difference is") + ".")
    lines.append(f"* **Wall-clock.** RMT step {rm['step_ms']:.0f} ms vs transformer {tf['step_ms']:.0f} ms "
                 f"({rm['step_ms'] / tf['step_ms']:.2f}×; medians from the trainer's tokens/s — "
                 "`benchmarks/rmt_cost.py` measures it interleaved).")
    ks = sorted(exp["key_dims"])
    sweep = [s[f"rmt_dk{k}"] for k in ks]
    devs = [x["dev"][0] for x in sweep]
    mono = all(b < a for a, b in zip(devs, devs[1:]))
    steps = [sweep_step(results, exp, a, b) for a, b in zip(ks, ks[1:])]
    lines.append(f"* **Residual-size sweep** (lr {sweep[0]['lr']:g}). Mean dev loss "
                 + ("falls monotonically" if mono else "does not fall monotonically")
                 + f" as Dk·Dv grows from {sweep[0]['residual']} to {sweep[-1]['residual']}: "
                 + ", ".join(f"{x['residual']}: {pm(x['dev'][0], x['dev'][1], nd=4)}" for x in sweep)
                 + f" (± s.e. over {sweep[0]['dev'][2]} seed(s); parameters "
                 f"{sweep[0]['params']:,}–{sweep[-1]['params']:,}, FLOPs/token "
                 f"{sweep[0]['flops_per_token'] / 1e6:.2f}M–{sweep[-1]['flops_per_token'] / 1e6:.2f}M). "
                 "Each step up in Dk, paired by seed: "
                 + "; ".join(f"Dk {a} → {b}: {ci(st)[0]}" + ("" if ci(st)[1] else " (not resolved)")
                             for (a, b), st in zip(zip(ks, ks[1:]), steps)) + ".")
    return lines


def sweep_step(results, exp, a, b):
    """Dev loss at Dk = ``b`` minus at Dk = ``a``, paired by sweep seed: (mean, s.e., n)."""
    return mean_spread([results[(f"rmt_dk{b}", x)]["final_eval_loss"]
                        - results[(f"rmt_dk{a}", x)]["final_eval_loss"]
                        for x in exp["sweep_seeds"]], "se")


def sweep_rows(s, results, exp, fmt):
    ks = sorted(exp["key_dims"])
    rows = []
    for i, k in enumerate(ks):
        x = s[f"rmt_dk{k}"]
        rows.append([k, x["residual"], f"{x['params']:,}", f"{x['flops_per_token'] / 1e6:.3f}M",
                     fmt(x["dev"]), ", ".join(f"{v:.4f}" for v in x["dev_seeds"]),
                     ci(sweep_step(results, exp, ks[i - 1], k))[0] if i else "—"])
    return rows


def grid_rows(picked):
    return [[shape, f"{lr:g}", f"{v:.4f}", "**picked**" if lr == best else ""]
            for shape, (best, t) in sorted(picked.items()) for lr, v in sorted(t.items())]


def markdown(runs, results, exp, meta, picked):
    s = summarize(runs, results)
    tf, rm, spec = s["transformer"], s["rmt_matched"], s[f"rmt_dk{exp['main_key_dim']}"]
    t = runs[0][3]
    tokens = t.train.steps * t.train.batch_size * t.data.seq_len
    fmt = lambda x: pm(x[0], x[1], nd=4) if x[2] > 1 else f"{x[0]:.4f}"  # (mean, s.e., n)
    seeds = list(exp["seeds"])
    tok, gaps = paired_gap(results, "rmt_matched", "transformer", seeds)
    spec_ok = set(seeds) <= set(spec["seeds"])
    gaps_spec = paired_gap(results, f"rmt_dk{exp['main_key_dim']}", "transformer", seeds)[1] \
        if spec_ok else [None] * len(gaps)
    fixed = sorted(set(exp["lr"]) - set(picked))
    gs = exp["grid_steps"]
    lines = ["# Residual Matrix Transformer vs transformer (Shakespeare, byte-level)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, preset `{meta['preset']}`, "
             f"seeds {seeds} (main pair), {list(exp['sweep_seeds'])} (Dk sweep). Wall time: "
             f"{meta['wall_seconds'] / 60:.1f} min for this invocation; "
             f"{(sum(r['wall_seconds'] for r in results.values()) + meta['wall_seconds_grid']) / 60:.1f} "
             f"min of training and evaluation summed over the {len(results)} runs and the "
             f"{meta['grid_runs']} lr-grid runs (measured when each ran; {meta['cpus']} CPUs, load average "
             f"{meta['load']:.1f} at the end).", "",
             f"Training: every run sees the same {tokens:,} tokens ({t.train.steps} steps × "
             f"{t.train.batch_size} rows × {t.data.seq_len}; same order per seed), warmup "
             f"{t.train.warmup_steps} steps then cosine decay. Each family keeps the rest of its "
             f"config: `configs/lm.py` AdamW (weight decay {t.train.weight_decay}, multiplied by "
             f"the lr) for the transformer, `configs/rmt.py` (the reference's muP AdamW, weight "
             f"decay {runs[1][3].train.weight_decay} not multiplied by the lr, z-loss "
             f"{runs[1][3].train.z_loss}) for the RMT. Dev loss = CE (nats/byte) on "
             f"{t.train.eval_batches} fixed validation batches (the same tokens for every run). "
             "± is the standard error over seeds; a difference is *resolved* when its 95% "
             "Student-t interval (paired by seed) excludes 0. Training FLOPs = tokens × "
             "`icml_jax.analysis.flops.train_flops_per_token(..., convention=\"paper\")`, the "
             "paper's Table 7 formulas (docs/methods/rmt.md, RMT vocabulary term R·V) for both "
             "families; the `exact` convention (every matmul, causal attention as half) is in the "
             "CSV and the last table column.", "",
             "## Learning rate (the lr stage)", "",
             (f"Each tuned shape trains {gs} steps (warmup scaled alike, seed {exp['grid_seed']}) at "
              "each lr of its grid; the lowest final dev loss picks the lr its runs use "
              f"(`rmt_spec`'s for every sweep point). A run of {gs} steps can favour another lr "
              f"than one of {t.train.steps}; the grid is one seed."
              if picked else "No lr grid in this run.")
             + (f" Fixed (not tuned): " + ", ".join(f"{k} {exp['lr'][k]:g}" for k in fixed) + "."
                if fixed else ""), ""]
    if picked:
        lines += [markdown_table(["shape", "peak lr", f"dev loss after {gs} steps", ""],
                                 grid_rows(picked))]
    lines += [
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
                 ["run", "model", "peak lr", "params", "residual size", "train FLOPs/token (paper)",
                  "final dev loss", "final train loss", "step ms", "step vs transformer",
                  "FLOPs/token (exact)"],
                 [[n, s[n]["desc"], f"{s[n]['lr']:g}", f"{s[n]['params']:,}", s[n]["residual"],
                   f"{s[n]['flops_per_token'] / 1e6:.2f}M", fmt(s[n]["dev"]), fmt(s[n]["train"]),
                   f"{s[n]['step_ms']:.0f}", f"{s[n]['step_ms'] / tf['step_ms']:.2f}×",
                   f"{s[n]['exact_flops_per_token'] / 1e6:.2f}M"]
                  for n in ("transformer", "rmt_matched", f"rmt_dk{exp['main_key_dim']}")]),
             "## Gap to the transformer against tokens (dev loss, RMT − transformer, paired by seed)", "",
             markdown_table(["step", "tokens", "transformer dev loss", "rmt_matched − transformer",
                             f"rmt_dk{exp['main_key_dim']} − transformer"],
                            [[p["step"], f"{p['tokens']:,.0f}",
                              fmt(mean_spread([results[("transformer", x)]["curve"][i]["eval_loss"]
                                               for x in seeds], "se")),
                              ci(g)[0], ci(gsp)[0] if gsp else "—"]
                             for i, (p, g, gsp) in enumerate(zip(
                                 results[("transformer", seeds[0])]["curve"], gaps, gaps_spec))]),
             "## Residual-size sweep (fixed Dv, R, N_ff)", "",
             markdown_table(["Dk", "Dk·Dv", "params", "train FLOPs/token", "final dev loss",
                             "per seed", "Δ vs previous Dk (paired)"],
                            sweep_rows(s, results, exp, fmt)),
             "## Reading", ""]
    lines += reading(s, results, exp, picked)
    lines += ["", "Paper (docs/methods/rmt.md): at 46M–405M parameters and billions of tokens the RMT "
              "matches the transformer's loss with fewer parameters, FLOPs and tokens, and dev loss "
              f"falls monotonically with Dk·Dv. Tested here: one {tf['params'] / 1e6:.2f}M-parameter "
              f"pair and a {spec['params'] / 1e6:.2f}M RMT sweep on {tokens:,} byte tokens, {6.04e9 / tokens:,.0f}× fewer tokens than the "
              f"paper's 6.04e9 and {405e6 / tf['params']:,.0f}× fewer parameters than its 405M "
              "transformer, with the lrs from a one-seed short grid and no other tuning. The gap "
              "against tokens covers one run length; it says what happens at this scale only, not "
              "whether the paper's scaling claims hold.", "",
              "Plots: `loss_vs_tokens.png`, `loss_vs_flops.png`, `gap_vs_tokens.png`, "
              "`dev_loss_vs_residual.png`. Per-run metrics: `<run>_s<seed>/metrics.jsonl` (and "
              "TensorBoard) in the workdir; the grid's in `lr_grid/`.", ""]
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
    seeds = list(exp["seeds"])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for n in shown[1:]:
        if not set(seeds) <= set(s[n]["seeds"]):
            continue
        tok, gaps = paired_gap(results, n, "transformer", seeds)
        ax.errorbar(tok, [g[0] for g in gaps], yerr=[g[1] for g in gaps], marker="o", ms=3,
                    capsize=3, color=colors[n], label=f"{n} − transformer")
    ax.axhline(0, color="tab:blue", ls="--", lw=0.8)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("dev loss gap (nats/byte)")
    ax.set_title(f"RMT − transformer dev loss, paired by seed (± s.e., {len(seeds)} seeds)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "gap_vs_tokens.png"), dpi=120)
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
    ax.errorbar(xs, [s[f"rmt_dk{k}"]["dev"][0] for k in ks],
                yerr=[s[f"rmt_dk{k}"]["dev"][1] for k in ks], marker="o", capsize=3,
                color="tab:orange", label=f"RMT, N_ff={s[f'rmt_dk{ks[0]}']['ffn_dim']} (Dk = {', '.join(map(str, ks))})")
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
    ax.set_title("Final dev loss vs residual size (equal tokens; mean ± s.e., dots: seeds)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "dev_loss_vs_residual.png"), dpi=120)
