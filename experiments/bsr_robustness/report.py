"""The outputs of experiments/bsr_robustness: results.csv rows, config.json, the reading
statements generated from the numbers, results.md and the three plots."""
import math
import os

import numpy as np

from experiments.bsr_robustness.presets import ARMS, seeds_of
from experiments.bsr_robustness.stages import OOD_SPLITS, SPLITS, ns_of
from experiments.common import (git_commit, markdown_table, pm, save_figure, write_atomic,
                                write_csv, write_json)

ARM_LABEL = {"bt": "BT", "bsr": "BT+BSR (λ=1e-3, paper)", "bsr_1e-2": "BT+BSR (λ=1e-2, not the paper's)"}
MAIN_METRICS = (("accuracy", "val_in pair acc"), ("tau_val_in", "τ val_in"),
                ("tau_val_prompt_ood", "τ prompt-OOD"), ("tau_val_response_ood", "τ response-OOD"),
                ("tau_val_both_ood", "τ both-OOD"), ("reward_std", "reward std"),
                ("reward_mean", "reward mean"), ("hidden_norm_std", "‖h‖ std"),
                ("hidden_norm_mean", "‖h‖ mean"), ("hidden_norm_cv", "‖h‖ std/mean"),
                ("residual_norm_std", "pre-norm ‖h‖ std"), ("residual_norm_cv", "pre-norm ‖h‖ std/mean"))


def _pm(ms) -> str:
    """An ``aggregate`` entry (mean, std over seeds, n) as ``mean ± std``."""
    return pm(ms[0], ms[1])


def write_results_csv(wd: str, metrics: dict, refs: dict) -> None:
    """DIR/results.csv: one row per run, seed and metric, then the oracle / random best-of-N."""
    rows = []
    for (arm, seed), m in metrics.items():
        for name, v in m.items():
            rows.append(dict(run=arm, bsr_lambda=ARMS[arm], seed=seed, metric=name, value=v))
    for ref, c in refs.items():
        for n, gv in zip(c["n"], c["gold"]):
            rows.append(dict(run=ref, bsr_lambda="", seed="", metric=f"bon_gold_N{n}", value=gv))
    write_csv(os.path.join(wd, "results.csv"), rows, ("run", "bsr_lambda", "seed", "metric", "value"))


def write_config(wd: str, preset_name: str, experiment: dict, tb_dir: str, data: dict,
                 configs: dict) -> dict:
    """DIR/config.json; returns the gold statistics of the parts used."""
    stats = {p: data["testbed"]["stats"][p] for p in ("train",) + SPLITS + ("bon",)}
    write_json(os.path.join(wd, "config.json"), {
        "preset": preset_name, "experiment": experiment, "testbed": tb_dir,
        "seq_len": data["seq_len"],
        "pairs": {"train": len(data["train_rows"]), "val_in": len(data["val_rows"]),
                  "rule": experiment["pair_rule"], "min_gap": experiment["min_gap"]},
        "gold_stats": stats, "runs": configs})
    return stats


def reading(agg: dict, arms, seeds, refs, n_val_pairs: int, gold: str = "a VADER gold") -> list[str]:
    """Plain statements generated from the numbers (so a rerun cannot contradict them)."""
    ns = list(refs["oracle"]["n"])
    top, mid = ns[-1], (8 if 8 in ns[:-1] else ns[len(ns) // 2])
    if "bt" not in agg or "bsr" not in agg:
        return ["* Needs both the bt and bsr arms for a comparison."]
    bt, bs = agg["bt"], agg["bsr"]
    one = len(seeds) < 2
    note = " (one seed: not tested against seed noise)" if one else ""

    def cmp(metric, lower_better=False):
        d = bs[metric][0] - bt[metric][0]
        noise = bs[metric][1] + bt[metric][1]
        resolved = (not one) and abs(d) > noise
        better = d < 0 if lower_better else d > 0
        return d, better, resolved

    lines = []
    # above chance: the seed-mean accuracy beats 0.5 by two binomial standard errors of the val set
    chance = 0.5 + 2 * 0.5 / math.sqrt(max(n_val_pairs, 1))
    learned = {x: agg[x]["accuracy"][0] > chance for x in ("bt", "bsr")}
    if not all(learned.values()):
        lines.append(
            f"* **Caveat first: {' and '.join(ARM_LABEL[x] for x in learned if not learned[x])} "
            f"did not learn beyond chance** (val_in accuracy "
            + ", ".join(f"{ARM_LABEL[x]} {agg[x]['accuracy'][0]:.3f}" for x in learned if not learned[x])
            + f" ≤ {chance:.3f}, the chance bound: 0.5 plus two binomial standard errors over "
            f"{n_val_pairs} pairs). A reward model at chance "
            "ranks responses by features unrelated to gold, so the τ, dispersion and best-of-N "
            "differences below say nothing about the paper's claims; they are reported as measured.")
    da = bs["accuracy"][0] - bt["accuracy"][0]
    lines.append(f"* **In-domain accuracy.** BT {_pm(bt['accuracy'])}, BSR {_pm(bs['accuracy'])} "
                 f"(Δ = {da:+.3f}; chance 0.5){note}.")
    parts, n_better, n_res = [], 0, 0
    for sp in OOD_SPLITS:
        d, better, res = cmp(f"tau_{sp}")
        n_better += better
        n_res += better and res
        parts.append(f"{sp} Δτ = {d:+.3f}{'' if one else (' (beyond seed std)' if res else ' (within seed std)')}")
    lines.append(f"* **OOD Kendall τ (BSR − BT).** " + "; ".join(parts) +
                 f". BSR is higher on {n_better}/3 OOD splits" +
                 ("" if one else f", {n_res}/3 by more than the two seed stds combined") + ".")
    disp = []
    pre = bt["residual_norm_std"][0] == bt["residual_norm_std"][0]  # scored before the final norm
    for metric, name in (("reward_std", "reward std"), ("hidden_norm_std", "‖h‖ std"),
                         ("hidden_norm_cv", "‖h‖ std/mean")) + (
            (("residual_norm_std", "pre-norm ‖h‖ std"), ("residual_norm_cv", "pre-norm ‖h‖ std/mean"))
            if pre else ()):
        d, better, res = cmp(metric, lower_better=True)
        disp.append(f"{name} {bt[metric][0]:.3g} → {bs[metric][0]:.3g} "
                    f"({'lower' if better else 'higher'}{'' if one else (', beyond seed std' if res else ', within seed std')})")
    lines.append("* **Dispersion on val_in (BT → BSR).** " + "; ".join(disp) + ".")
    g = lambda a, n: a[f"bon_gold_N{n}"][0]
    peak = lambda a: max(refs["oracle"]["n"], key=lambda n: g(a, n))
    lines.append(
        f"* **Best-of-N gold (N = 1 / {mid} / {top}).** BT {g(bt, 1):.3f} / {g(bt, mid):.3f} / "
        f"{g(bt, top):.3f} (peak at N = {peak(bt)}), BSR {g(bs, 1):.3f} / {g(bs, mid):.3f} / "
        f"{g(bs, top):.3f} (peak at N = {peak(bs)}); oracle {refs['oracle']['gold'][-1]:.3f} and "
        f"random {refs['random']['gold'][-1]:.3f} at N = {top}.")
    acc_close = abs(da) <= 0.03
    tau_dir = n_better >= 2
    # the paper's dispersion is the hidden state's before a final norm pins it, where measured
    h_metric = "residual_norm_std" if pre else "hidden_norm_std"
    disp_dir = cmp("reward_std", True)[1] and cmp(h_metric, True)[1]
    bon_dir = g(bs, top) > g(bt, top) and peak(bs) >= peak(bt)
    verdicts = [("both above chance", all(learned.values())),
                ("similar in-domain accuracy (|Δ| ≤ 0.03)", acc_close),
                ("lower dispersion of rewards and " + ("pre-norm ‖h‖" if pre else "‖h‖") + " with BSR",
                 disp_dir),
                ("higher OOD τ with BSR on most splits", tau_dir),
                (f"best-of-N gold at N = {top} higher with BSR, peaking no earlier", bon_dir)]
    shown = sum(v for _, v in verdicts[2:])
    lines.append("* **The paper's direction here.** " + "; ".join(
        f"{t}: {'yes' if v else 'no'}" for t, v in verdicts) +
        f". {shown}/3 of the paper's predicted effects show"
        + (" on one seed." if one else f" on the seed means ({len(seeds)} seeds); see the ± "
           "columns for which differences exceed the seed spread.") +
        f" This is a tiny byte-level model on {gold}, not the paper's 8B setting" +
        ("." if all(learned.values()) else
         "; with a model at chance the direction is not tested here."))
    if "bsr_1e-2" in agg:
        s = agg["bsr_1e-2"]
        lines.append(f"* **Stronger λ = 1e-2 (not the paper's setting).** accuracy {_pm(s['accuracy'])}, "
                     f"reward std {s['reward_std'][0]:.3g}, OOD τ " + ", ".join(
                         f"{s[f'tau_{sp}'][0]:+.3f}" for sp in OOD_SPLITS) +
                     f", best-of-64 gold {g(s, 64):.3f}.")
    return lines


def write_plots(wd, exp, arms, curves, refs, agg, results):
    """DIR/best_of_n.png, DIR/kendall_tau.png and DIR/dispersion.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colors = {"bt": "tab:red", "bsr": "tab:blue", "bsr_1e-2": "tab:green"}
    kl = np.asarray(refs["oracle"]["kl_bound"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for a in arms:
        seeds = seeds_of(exp, a)
        ys = np.asarray([curves[(a, s)]["gold"] for s in seeds])
        err = ys.std(0, ddof=1) if len(seeds) > 1 else np.asarray(curves[(a, seeds[0])]["gold_sem"])
        ax.errorbar(kl, ys.mean(0), yerr=err, marker="o", capsize=3, color=colors.get(a),
                    label=ARM_LABEL[a])
    for name, ls in (("oracle", "--"), ("random", ":")):
        ax.plot(kl, refs[name]["gold"], ls, color="gray", label=f"{name} pick")
    for x, n in zip(kl, ns_of(exp)):
        ax.annotate(f"N={n}", (x, ax.get_ylim()[0]), fontsize=7, ha="center", va="bottom")
    ax.set_xlabel("KL(best-of-N ‖ policy) bound, nats  [log N − (N−1)/N]")
    ax.set_ylabel("gold reward of the proxy's pick")
    single = [len(seeds_of(exp, a)) < 2 for a in arms]
    bars = ("s.e. over prompts (one seed)" if all(single) else "std over seeds" if not any(single)
            else "std over seeds; one-seed arms: s.e. over prompts")
    ax.set_title("Best-of-N on held-out prompts (gold = "
                 f"{'token-additive' if 'world' in exp else 'VADER'})\nbars: {bars}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, os.path.join(wd, "best_of_n.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    w = 0.8 / len(arms)
    x = np.arange(len(SPLITS))
    for i, a in enumerate(arms):
        ax.bar(x + (i - (len(arms) - 1) / 2) * w, [agg[a][f"tau_{sp}"][0] for sp in SPLITS], w,
               yerr=[agg[a][f"tau_{sp}"][1] for sp in SPLITS], capsize=3, color=colors.get(a),
               label=ARM_LABEL[a])
    ax.set_xticks(x, [sp.replace("val_", "") for sp in SPLITS])
    ax.axhline(0, color="k", lw=0.5)
    ax.set_ylabel("mean per-prompt Kendall τ vs gold")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, os.path.join(wd, "kendall_tau.png"), dpi=120)

    # the residual norm (before the final norm) where the runs scored it
    pre = all("residual_norm" in results[(a, seeds_of(exp, a)[0])]["scores"]["val_in"] for a in arms)
    keys = ("reward", "hidden_norm") + (("residual_norm",) if pre else ())
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4))
    for a in arms:
        sc = results[(a, seeds_of(exp, a)[0])]["scores"]["val_in"]
        for ax, k in zip(axes, keys):
            ax.hist(np.concatenate([np.asarray(v) for v in sc[k]]), bins=40, histtype="step",
                    color=colors.get(a), label=ARM_LABEL[a])
    axes[0].set_xlabel("reward (val_in responses)")
    axes[1].set_xlabel("‖h‖ at the scoring token, after the final norm")
    if pre:
        axes[2].set_xlabel("‖h‖ at the scoring token, before the final norm")
    axes[0].legend(fontsize=6)
    axes[0].set_title("first seed of each run", fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(wd, "dispersion.png"), dpi=120)


def write_results_md(wd: str, *, preset_name: str, cmd: str, exp, arms, seeds, tb_dir: str,
                     data: dict, stats: dict, results: dict, agg: dict, refs: dict,
                     run_seconds) -> str:
    """DIR/results.md; returns its text. ``run_seconds()``: the seconds this run has taken."""
    testbed, groups = data["testbed"], data["groups"]
    n_train, n_val, seq_len = len(data["train_rows"]), len(data["val_rows"]), data["seq_len"]
    t = exp.train.train
    extra = "".join(f" ({x}: {list(seeds_of(exp, x))})" for x in arms
                    if seeds_of(exp, x) != seeds)
    train_total = sum(r["train_seconds"] for r in results.values())
    additive = "world" in exp
    model = testbed["sft_config"]["model"]
    backbone = (f"a fresh decoder ({model['num_layers']} layers, d={model['d_model']}, byte tokens; "
                f"`{exp.model}`) trained from scratch with its scalar head" if additive else
                f"the SFT policy's decoder ({model['num_layers']} layers, d={model['d_model']}, "
                "byte tokens) + a fresh scalar head")
    position = exp.train.get("loss", {}).get("reward_position", "last")
    backbone += ("; the reward is read at the response's last token (`loss.reward_position="
                 "last_response_token`)" if position == "last_response_token" else
                 "; the reward is read at the appended eos (`loss.reward_position=last`)")
    md = [f"# BT vs BT+BSR reward models: robustness on the "
          f"{'token-additive gold world' if additive else 'VADER-gold testbed'} ({preset_name})\n",
          f"Command: `{cmd}` · seeds {list(seeds)}{extra} · commit {git_commit()} · " +
          (f"world generated in {data['testbed_s']:.0f} s" if additive else
           f"testbed `{tb_dir}` (built/loaded in {data['testbed_s']:.0f} s this run; SFT "
           f"{testbed['sft']['seconds']:.0f} s when built)") + " · reward-model training "
          f"{train_total:.0f} s in all when trained · this run {run_seconds():.0f} s.\n",
          f"Setup: {backbone}; "
          f"{n_train} training pairs (every gold-untied pair of the {len(groups['train'])} "
          f"`train` groups, rule `{exp.pair_rule}`, min_gap {exp.min_gap}), "
          f"{n_val} val_in pairs; {t.steps} steps × {t.batch_size} pairs, "
          f"AdamW lr {t.lr} (warmup {t.warmup_steps}, linear-cosine decay to 0 "
          f"as configs/lm.py's schedule), seq_len {seq_len}. BSR: λ_eff = λ·B_dev "
          f"(= λ·{t.batch_size}), local batch mean. The seed sets the data order and the "
          f"score-head init. Gold ties: {stats['val_in']['frac_tied_pairs']:.0%} of val_in "
          f"response pairs have equal gold{'' if additive else ' (mostly both 0: no sentiment word)'} and are not "
          f"labelled; τ leaves out groups with constant gold. Dispersion is over the "
          f"{stats['val_in']['responses']} val_in responses ('reward std, all val' over the union "
          f"of the four val splits is in results.csv). ± is the std over seeds.\n",
          "## Main table\n",
          markdown_table(["run", "seeds"] + [h for _, h in MAIN_METRICS],
                         [[ARM_LABEL[arm], len(seeds_of(exp, arm))] + [_pm(agg[arm][m]) for m, _ in MAIN_METRICS]
                          for arm in arms]),
          "\n## Best-of-N on `bon` (gold reward of the proxy's top pick)\n",
          f"{len(groups['bon'])} held-out in-domain prompts × {len(groups['bon'][0]['responses'])} "
          f"responses; for each N, {exp.bon_draws} random N-subsets per prompt; mean gold of the "
          "pick (± std over seeds). KL bound = log N − (N−1)/N nats.\n",
          markdown_table(["N", "KL bound"] + [ARM_LABEL[x] for x in arms] + ["oracle", "random"],
                         [[n, round(refs["oracle"]["kl_bound"][i], 3)] +
                          [_pm(agg[x][f"bon_gold_N{n}"]) for x in arms] +
                          [round(refs["oracle"]["gold"][i], 4), round(refs["random"]["gold"][i], 4)]
                          for i, n in enumerate(ns_of(exp))]),
          "\n## Reading\n", "\n".join(reading(agg, arms, seeds, refs, n_val, "a token-additive gold" if additive else "a VADER gold")) + "\n",
          "\nPlots: `best_of_n.png` (gold vs the KL bound), `kendall_tau.png` (τ per split), "
          "`dispersion.png` (val_in reward and ‖h‖ histograms after and, where scored, before the final "
          "norm; first seed).\n"]
    text = "\n".join(md)
    write_atomic(os.path.join(wd, "results.md"), text)
    return text
