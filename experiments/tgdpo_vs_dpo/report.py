"""The report of experiments/tgdpo_vs_dpo: results.csv rows, the per-arm statistics over seeds,
the generated reading, results.md and the two plots."""
import os

import numpy as np

from experiments.common import (git_commit, markdown_table, mean_spread, pm, save_figure,
                                write_atomic, write_csv)
from experiments.tgdpo_vs_dpo.stages import N_BUCKETS, per_prompt_win, pop_se

CSV_FIELDS = ("run", "arm", "alpha", "seed", "steps", "win_vs_sft", "win_vs_sft_se", "mean_gold",
              "kl", "kl_se", "h2h_vs_dpo", "mean_len", "frac_zero_gold", "train_loss",
              "train_accuracy", "train_margin", "eval_accuracy", "eval_margin", "train_seconds",
              "eval_seconds")


def _pm(t, nd=3):
    """``mean ± spread`` of a (mean, spread, n) triple of ``arm_stats``."""
    return pm(t[0], t[1], nd)


# ----------------------------------------------------------------------------- summaries

def head_to_head(results, partner=lambda r: f"dpo_s{r['seed']}"):
    """TGDPO run -> its per-prompt win rates against its DPO partner run (``partner(run)``: the
    DPO run's name; default the DPO run of the same seed)."""
    out = {}
    for name, r in results.items():
        if r["arm"].startswith("TGDPO") and partner(r) in results:
            dpo = results[partner(r)]
            out[name] = per_prompt_win([g["gold"] for g in r["groups"]],
                                       [g["gold"] for g in dpo["groups"]])
    return out


def csv_rows(results, h2h):
    rows = []
    for name, r in results.items():
        ft, ev = r.get("final_train", {}), r.get("eval_pairs", {})
        rows.append(dict(
            run=name, arm=r["arm"], alpha="" if name == "sft" else r["alpha"], seed=r["seed"],
            steps=r.get("step", 0), win_vs_sft=round(r["win_vs_sft"], 5),
            win_vs_sft_se=round(r["win_vs_sft_se"], 5), mean_gold=round(r["mean_gold"], 5),
            kl=round(r["kl"], 5), kl_se=round(r["kl_se"], 5),
            h2h_vs_dpo=round(float(np.mean(h2h[name])), 5) if name in h2h else "",
            mean_len=round(r["mean_len"], 2), frac_zero_gold=round(r["frac_zero_gold"], 4),
            train_loss=_r(ft.get("loss")), train_accuracy=_r(ft.get("rewards/accuracies")),
            train_margin=_r(ft.get("rewards/margins")),
            eval_accuracy=_r(ev.get("eval_rewards/accuracies")),
            eval_margin=_r(ev.get("eval_rewards/margins")),
            train_seconds=_r(r.get("train_seconds"), 1), eval_seconds=_r(r.get("eval_seconds"), 1)))
    return rows


def _r(x, nd=5):
    return "" if x is None else round(float(x), nd)


def arm_stats(results, h2h, key=lambda r: r["arm"]):
    """key -> {metric: (mean, std over seeds, n)} over the main runs (guidance, SFT excluded),
    runs grouped by ``key(run)`` (default their arm)."""
    arms = {}
    for name, r in results.items():
        if name in ("sft", "guidance"):
            continue
        arms.setdefault(key(r), []).append(name)

    def ms(vals):  # the seed std (ddof = 1; one seed: 0), as the main table always had
        return mean_spread(vals, "std")

    out = {}
    for arm, names in arms.items():
        rs = [results[n] for n in names]
        out[arm] = {"win_vs_sft": ms([r["win_vs_sft"] for r in rs]),
                    "mean_gold": ms([r["mean_gold"] for r in rs]),
                    "kl": ms([r["kl"] for r in rs]),
                    "train_accuracy": ms([r["final_train"].get("rewards/accuracies", np.nan)
                                          for r in rs]),
                    "eval_accuracy": ms([r["eval_pairs"].get("eval_rewards/accuracies", np.nan)
                                         for r in rs]),
                    "runs": names}
        if names[0] in h2h:
            out[arm]["h2h"] = ms([np.mean(h2h[n]) for n in names])
            out[arm]["h2h_se"] = pop_se(np.concatenate([h2h[n] for n in names]))
    return out


def reading(stats, results):
    """A plain statement of whether the paper's direction shows (generated from the numbers)."""
    dpo = stats["DPO"]
    lines = []
    for arm, s in stats.items():
        if arm == "DPO":
            continue
        d_win = s["win_vs_sft"][0] - dpo["win_vs_sft"][0]
        noise = s["win_vs_sft"][1] + dpo["win_vs_sft"][1]
        h, hse = s["h2h"][0], s["h2h_se"]
        kl_ratio = s["kl"][0] / dpo["kl"][0] if dpo["kl"][0] > 0 else float("nan")
        similar_kl = 0.75 <= kl_ratio <= 1.33
        resolved_h2h = abs(h - 0.5) > 2 * hse
        resolved_win = s["win_vs_sft"][2] > 1 and abs(d_win) > noise
        if d_win > 0 and h > 0.5 and similar_kl and resolved_h2h:
            verdict = "shows here: TGDPO wins more often at a similar KL"
        elif d_win > 0 and h > 0.5:
            verdict = ("points the paper's way but is not resolved" +
                       ("" if similar_kl else " (and the KLs differ by more than a third)"))
        else:
            verdict = "does not show here"
        lines.append(
            f"* **{arm} vs DPO.** Win rate against the SFT policy {_pm(s['win_vs_sft'])} vs "
            f"{_pm(dpo['win_vs_sft'])} (Δ = {d_win:+.3f}; the seed stds sum to {noise:.3f}"
            f"{'' if resolved_win else ', so the difference is within seed noise'}); mean gold "
            f"{s['mean_gold'][0]:+.3f} vs {dpo['mean_gold'][0]:+.3f}; KL {s['kl'][0]:.2f} vs "
            f"{dpo['kl'][0]:.2f} nats ({kl_ratio:.2f}×). Head-to-head against the DPO policy of the "
            f"same seed: {h:.3f} (± {hse:.3f} s.e. over prompts; 0.5 = even"
            f"{'' if resolved_h2h else ', within 2 s.e. of even'}). The paper's direction "
            f"(TGDPO beats DPO at a similar KL) {verdict}.")
    sft = results["sft"]
    lines.append(f"* **Calibration.** Fresh SFT samples win {sft['win_vs_sft']:.3f} against the SFT "
                 f"reference samples (0.5 expected) at mean gold {sft['mean_gold']:+.3f}; "
                 f"{sft['frac_zero_gold']:.0%} of SFT samples have gold exactly 0 (no VADER word), "
                 "so many comparisons are ties.")
    return lines


def token_lines(ta, results):
    """results.md lines of the per-token analysis."""
    d = ta["r_hat"]
    lines = [f"Token rewards of pi_r on the {ta['n_chosen_tokens']} chosen / "
             f"{ta['n_rejected_tokens']} rejected training tokens: r̂ = β(log π_r − log π_ref) has "
             f"mean {d['chosen']['mean']:+.4f} (5–95%: {d['chosen']['p05']:+.3f} … "
             f"{d['chosen']['p95']:+.3f}) on chosen and {d['rejected']['mean']:+.4f} "
             f"({d['rejected']['p05']:+.3f} … {d['rejected']['p95']:+.3f}) on rejected tokens."]
    for a, f in ta["factors"].items():
        lines.append(f"With α = {a} TGDPO's guidance factors are 1 + αr̂ ∈ [{f['chosen']['p05']:.3f}, "
                     f"{f['chosen']['p95']:.3f}] (5–95%) on chosen and 1 − αr̂ ∈ "
                     f"[{f['rejected']['p05']:.3f}, {f['rejected']['p95']:.3f}] on rejected tokens "
                     f"({f['frac_nonpositive']:.1%} ≤ 0).")
    lines += ["", "Mean chosen-token log-ratio ρ = log π − log π_ref of the final policies, by "
              "quintile of r̂ (low → high; the spec expects TGDPO's ρ to grow more for high-r̂ "
              "tokens):", ""]
    arms = {}
    for name, b in ta["buckets"].items():
        arms.setdefault(results[name]["arm"], []).append(b)
    e = ta["bucket_edges"]
    header = ["arm"] + [f"r̂ ∈ [{e[i]:+.3f}, {e[i + 1]:+.3f}]" for i in range(N_BUCKETS)]
    body = [[arm] + [f"{v:+.3f}" for v in np.mean(bs, axis=0)] for arm, bs in arms.items()]
    return lines + [markdown_table(header, body)]


# ----------------------------------------------------------------------------- plots

def _colors(arms):
    base = {"DPO": "tab:blue", "SFT": "black", "guidance": "tab:gray"}
    extra = iter(["tab:orange", "tab:red", "tab:green", "tab:purple"])
    return {a: base.get(a) or next(extra) for a in arms}


def plot_win_vs_kl(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = list(dict.fromkeys(r["arm"] for r in results.values()))
    col = _colors(arms)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    seen = set()
    for name, r in results.items():
        ax.errorbar(r["kl"], r["win_vs_sft"], xerr=r["kl_se"], yerr=r["win_vs_sft_se"],
                    fmt="s" if name in ("sft", "guidance") else "o", color=col[r["arm"]],
                    label=None if r["arm"] in seen else r["arm"], capsize=2)
        seen.add(r["arm"])
    finish_win_vs_kl(fig, ax, "TGDPO vs DPO (held-out prompts; bars: ±1 s.e.)", path)


def finish_win_vs_kl(fig, ax, title: str, path: str) -> None:
    """The win-rate-vs-KL plot's axes, even line, legend and atomic save (both reports)."""
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("KL to reference (MC, nats per sequence)")
    ax.set_ylabel("gold win rate vs SFT samples")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def plot_curves(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {n: r for n, r in results.items() if n != "sft"}
    col = _colors(list(dict.fromkeys(r["arm"] for r in runs.values())))
    keys = ("loss", "rewards/margins", "rewards/accuracies")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    seen = set()
    for name, r in runs.items():
        steps = [c["step"] for c in r["curve"]]
        for ax, k in zip(axes, keys):
            ax.plot(steps, [c.get(k, float("nan")) for c in r["curve"]], color=col[r["arm"]],
                    alpha=0.8, lw=1.2, label=None if r["arm"] in seen else r["arm"])
        seen.add(r["arm"])
    for ax, k in zip(axes, keys):
        ax.set_xlabel("step")
        ax.set_title(f"train {k}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------- results.md

def write_outputs(workdir, exp, preset, argv, tb, pairs, results, seconds, ta):
    """results.csv, results.md and the plots; returns ``arm_stats``. ``seconds``: (this
    invocation, the longest one in this workdir)."""
    h2h = head_to_head(results)
    rows = csv_rows(results, h2h)
    write_csv(os.path.join(workdir, "results.csv"), rows, CSV_FIELDS)
    stats = arm_stats(results, h2h)
    cmd = "python -m experiments.tgdpo_vs_dpo " + " ".join(argv)
    t = exp.train.train
    md = [f"# TGDPO vs DPO on the sentiment testbed ({preset} preset)", "",
          f"Command: `{cmd}` | seeds {list(exp.seeds)} (data order; guidance pi_r seed "
          f"{exp.guidance_seed}) | commit {git_commit()} | wall time {seconds[0]:.0f} s this "
          f"invocation ({seconds[1]:.0f} s for the longest one in this workdir, the one that "
          "computed the runs; the testbed's own build time is in its testbed.json).", "",
          f"SFT policy: {tb['sft_config']['model']['num_layers']} layers, d = "
          f"{tb['sft_config']['model']['d_model']}, byte tokens (testbed "
          f"`{tb['workdir']}`). Gold: VADER compound sentiment of the continuation. Pairs: best vs "
          f"worst of 5 SFT samples (T = 0.8) for {pairs['n_train_groups']} prompts → "
          f"{pairs['n_train']} pairs ({pairs['n_tied_train']} tied group(s) skipped; mean gold gap "
          f"{pairs['mean_gap']:.3f}); validation pairs: {pairs['n_eval']} from the SFT reference "
          f"samples of {pairs['n_eval_groups']} held-out prompts. Every run: {t.steps} steps "
          f"× {t.batch_size} pairs, lr {t.lr:g} (warmup "
          f"{t.warmup_steps}, cosine to 0), beta {exp.beta}, from the SFT start; TGDPO is "
          "guided by the DPO policy pi_r trained on the same pairs (seed "
          f"{exp.guidance_seed}). Evaluation: {exp.eval_samples} samples per held-out prompt "
          f"at T = {exp.eval_temperature} against the {tb['preset']['responses']['tgdpo_eval']} "
          "SFT reference samples of each prompt.", "",
          "## Main table (mean ± std over seeds)", ""]
    header = ["arm", "runs", "win rate vs SFT", "mean gold", "KL (nats)", "h2h vs DPO",
              "train acc", "val pair acc"]
    body = []
    for arm, s in stats.items():
        body.append([arm, s["win_vs_sft"][2], _pm(s["win_vs_sft"]), _pm(s["mean_gold"]),
                     _pm(s["kl"], 2), _pm(s["h2h"]) if "h2h" in s else "—",
                     _pm(s["train_accuracy"], 2), _pm(s["eval_accuracy"], 2)])
    sft = results["sft"]
    body.append(["SFT (fresh samples)", 1, f"{sft['win_vs_sft']:.3f}", f"{sft['mean_gold']:+.3f}",
                 f"{sft['kl']:.2f}", "—", "—", "—"])
    md.append(markdown_table(header, body))
    md += ["Win rate: per prompt, all (policy sample, SFT sample) pairs, 1 win / 0.5 tie / 0 loss "
           "under gold, averaged. KL: Monte-Carlo sequence-level estimate on the policy's own "
           "samples, mean over samples of Σ_t (log π − log π_ref) over the response tokens (at "
           "temperature 1; the samples are drawn at T = 0.8, so it is the log-ratio expected under "
           "the sampling distribution). h2h: TGDPO vs the DPO policy of the same seed, same rule. "
           "train acc: `rewards/accuracies` over the last fifth of training; val pair acc: "
           "`eval_rewards/accuracies` on the validation pairs at the end"
           + (" (this preset has no validation pairs: the trainer then evaluates on the first "
              "training pairs, so it is a training-pair accuracy)" if not pairs["n_eval"] else "")
           + ".", "",
           "## Reading", ""] + reading(stats, results) + [
               "", "## Per-token analysis (training pairs)", ""] + token_lines(ta, results) + [
               "## Per run", ""]
    md.append(markdown_table(
        ["run", "arm", "seed", "win vs SFT", "mean gold", "KL", "h2h vs DPO", "train acc",
         "train margin", "val acc", "train s", "eval s"],
        [[r["run"], r["arm"], r["seed"], r["win_vs_sft"], r["mean_gold"], r["kl"], r["h2h_vs_dpo"],
          r["train_accuracy"], r["train_margin"], r["eval_accuracy"], r["train_seconds"],
          r["eval_seconds"]] for r in rows]))
    md += ["Plots: `win_rate_vs_kl.png` (one point per run), `training_curves.png` (train loss, "
           "rewards/margins, rewards/accuracies per logged step)."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_win_vs_kl(results, os.path.join(workdir, "win_rate_vs_kl.png"))
    plot_curves(results, os.path.join(workdir, "training_curves.png"))
    return stats


def summary_lines(stats):
    """The per-arm lines printed at the end of a run."""
    return [f"  {arm:14s} win vs SFT {_pm(s['win_vs_sft'])}  gold {_pm(s['mean_gold'])}  "
            f"KL {_pm(s['kl'], 2)}" + (f"  h2h {_pm(s['h2h'])}" if "h2h" in s else "")
            for arm, s in stats.items()]
