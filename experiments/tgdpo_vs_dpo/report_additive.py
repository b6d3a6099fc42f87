"""The report of experiments/tgdpo_vs_dpo on the token-additive gold world (presets
``additive_tiny``/``additive``): results.csv (with a beta column), the win-rate-vs-KL frontiers per
alpha over the beta grid, TGDPO vs DPO at matched KL, the guidance's token rewards against the
world's true ones, the generated reading (gated on the pilot beating SFT) and the plots."""
import os

import numpy as np

from experiments.common import (git_commit, markdown_table, pm,
                                write_atomic, write_csv)
from experiments.tgdpo_vs_dpo import report
from experiments.tgdpo_vs_dpo.report import CSV_FIELDS, csv_rows, finish_win_vs_kl, plot_curves

ADDITIVE_CSV_FIELDS = CSV_FIELDS[:3] + ("beta",) + CSV_FIELDS[3:]


def head_to_head(results):
    """TGDPO run -> its per-prompt win rates against the DPO run of its beta and seed."""
    return report.head_to_head(results, partner=lambda r: f"dpo_b{r['beta']:g}_s{r['seed']}")


def cell_stats(results, h2h):
    """(alpha, beta, steps) -> ``report.arm_stats``'s metrics of that cell, plus its ``arm``."""
    cells = report.arm_stats(results, h2h, key=lambda r: (float(r["alpha"]), float(r["beta"]),
                                                          int(r["steps"])))
    return {k: {**c, "arm": results[c["runs"][0]]["arm"]} for k, c in sorted(cells.items())}


def frontier(cells, alpha):
    """[(kl, win, beta, steps)] of one alpha's cells (means over seeds), sorted by KL."""
    pts = [(c["kl"][0], c["win_vs_sft"][0], b, n) for (a, b, n), c in cells.items() if a == alpha]
    return sorted(pts)


def _against(kls, ys, kl, y):
    """DPO's points (KL ascending ``kls``, values ``ys``) against a TGDPO cell at (kl, y). DPO's
    frontier is their upper envelope (the points no lower-KL point beats: longer DPO runs can
    degrade, and a line through a degraded point is not what DPO can reach). Returns (the
    frontier at that KL, linear in KL between its points inside its range, else its nearest
    point; whether interpolated; the KL gap to that nearest point; the best DPO value at
    KL <= kl and its KL; the status)."""
    keep = [i for i in range(len(ys)) if i == 0 or ys[i] > ys[:i].max()]
    fk, fy = kls[keep], ys[keep]
    inside = bool(len(fk) > 1 and fk[0] <= kl <= fk[-1])
    if inside:
        ref, gap = float(np.interp(kl, fk, fy)), 0.0
    else:
        j = int(np.argmin(np.abs(fk - kl)))
        ref, gap = float(fy[j]), float(kl - fk[j])
    le = kls <= kl
    best = float(ys[le].max()) if le.any() else float("nan")
    best_kl = float(kls[le][np.argmax(ys[le])]) if le.any() else float("nan")
    status = ("dominated" if le.any() and best >= y else "above" if inside and y > ref
              else "unmatched")
    return ref, inside, gap, best, best_kl, status


def matched_kl(cells):
    """Per TGDPO cell (keyed (alpha, beta)), DPO at the cell's KL (means over seeds; DPO's
    points: every DPO cell, over the beta grid and the ``dpo_steps`` sweep):

    * ``dpo_win``: DPO's frontier (the upper envelope of its (KL, win rate) points), linear in
      KL, at the cell's KL when it lies inside the frontier's KL range (``interpolated``); else
      its nearest point, with the KL gap (``kl_gap``);
    * ``dpo_best``: the best DPO win rate at a KL no larger than the cell's (``dpo_best_kl`` its
      KL; NaN if every DPO KL is larger);
    * ``status``: ``dominated`` (some DPO cell wins at least as often at no more KL), ``above``
      (inside DPO's KL range and above its interpolated win rate, not dominated) or
      ``unmatched`` (beyond DPO's KL range and above every DPO cell of lower KL);
    * the same for mean gold (``dpo_gold``, ``gold_delta``, ``dpo_best_gold``,
      ``gold_status``): the measure that does not saturate when win rates reach 1."""
    dpo = sorted((c["kl"][0], c["win_vs_sft"][0], c["mean_gold"][0])
                 for (a, _, _), c in cells.items() if a == 0.0)
    out = {}
    if not dpo:
        return out
    kls, wins, golds = (np.asarray([p[i] for p in dpo]) for i in range(3))
    for (a, b, _), c in cells.items():
        if a == 0.0:
            continue
        kl, win, gold = c["kl"][0], c["win_vs_sft"][0], c["mean_gold"][0]
        ref, inside, gap, best, best_kl, status = _against(kls, wins, kl, win)
        g_ref, _, _, g_best, _, g_status = _against(kls, golds, kl, gold)
        out[(a, b)] = {"kl": kl, "win": win, "gold": gold, "dpo_win": ref,
                       "delta": win - ref, "interpolated": inside, "kl_gap": gap,
                       "dpo_best": best, "dpo_best_kl": best_kl, "dpo_gold": g_ref,
                       "gold_delta": gold - g_ref, "dpo_best_gold": g_best,
                       "gold_status": g_status, "status": status,
                       "win_std": c["win_vs_sft"][1], "gold_std": c["mean_gold"][1]}
    return out


def gate(results, cells):
    """(passed, lines): the pilot passes when the guidance policy and at least one DPO cell beat
    the SFT policy by more than 2 s.e. over prompts."""
    g = results["guidance"]
    g_ok = g["win_vs_sft"] - 0.5 > 2 * g["win_vs_sft_se"]
    dpo_ok = [k for k, c in cells.items() if k[0] == 0.0 and any(
        results[n]["win_vs_sft"] - 0.5 > 2 * results[n]["win_vs_sft_se"] for n in c["runs"])]
    lines = [f"* **Pilot gate.** The guidance policy π_r wins {g['win_vs_sft']:.3f} ± "
             f"{g['win_vs_sft_se']:.3f} (s.e. over prompts) against the SFT samples "
             f"({'beats' if g_ok else 'does NOT beat'} SFT by > 2 s.e.); DPO beats SFT by > 2 s.e. "
             f"in {len(dpo_ok)} of {sum(1 for k in cells if k[0] == 0.0)} DPO cells (β × steps)."]
    passed = g_ok and bool(dpo_ok)
    if not passed:
        lines.append("* **Failed pilot:** the preference training did not move the policies "
                     "above SFT, so the TGDPO-vs-DPO comparison below is not interpreted.")
    return passed, lines


def reading(results, cells, mk, rr, passed):
    lines = []
    t = rr["token"]
    lines.append(f"* **Token rewards.** r̂_t = β(log π_r − log π_ref)(y_t) against the true w[y_t] "
                 f"over {t['n']} response tokens of the held-out SFT samples: Pearson "
                 f"{t['pearson']:+.3f}, Spearman {t['spearman']:+.3f}; per letter (mean r̂ vs w, "
                 f"{rr['letter']['n']} letters) Pearson {rr['letter']['pearson']:+.3f}; per "
                 f"sequence (Σr̂ vs gold) Pearson {rr['sequence']['pearson']:+.3f}.")
    if not passed:
        return lines
    by_alpha = {}
    for (a, b), m in sorted(mk.items()):
        by_alpha.setdefault(a, []).append((b, m))
    dpo_std = np.mean([c["win_vs_sft"][1] for (a, _, _), c in cells.items() if a == 0.0])
    dpo_gold_std = np.mean([c["mean_gold"][1] for (a, _, _), c in cells.items() if a == 0.0])
    n_seeds = min(c["win_vs_sft"][2] for c in cells.values())
    for a, bms in by_alpha.items():
        per_beta = "; ".join(
            f"β={b:g}: win {m['win']:.3f} at KL {m['kl']:.1f} vs DPO's best {m['dpo_best']:.3f} "
            f"at KL ≤ it ({m['status']})" for b, m in bms)
        st = [m["status"] for _, m in bms]
        above = [m["delta"] for _, m in bms if m["status"] == "above"]
        noise = float(np.mean([m["win_std"] for _, m in bms]) + dpo_std)
        if all(x == "dominated" for x in st):
            verdict = ("does not show here: at every β some DPO run wins at least as often at no "
                       "more KL")
        elif all(x == "above" for x in st):
            verdict = ("shows here" if n_seeds > 1 and np.mean(above) > noise else
                       "points the paper's way but is not resolved (" +
                       ("one seed: seed noise unknown" if n_seeds < 2 else
                        f"mean Δ {np.mean(above):+.3f} within the seed stds' sum {noise:.3f}")
                       + ")")
        elif "above" not in st:
            verdict = ("does not show here: TGDPO is dominated by DPO or only wins more at a KL "
                       "beyond every DPO run's (" + ", ".join(f"{st.count(x)} {x}" for x in
                                                        ("dominated", "unmatched")) + ")")
        else:
            verdict = "is not consistent here (" + ", ".join(
                f"{st.count(x)} {x}" for x in ("above", "dominated", "unmatched")) + ")"
        lines.append(f"* **TGDPO α={a:g} vs DPO at matched KL.** {per_beta}. The paper's "
                     f"direction (TGDPO's frontier above DPO's) {verdict}.")
        g_noise = float(np.mean([m["gold_std"] for _, m in bms]) + dpo_gold_std)
        gst = [m["gold_status"] for _, m in bms]
        resolved = [b for b, m in bms if m["gold_status"] == "above" and m["gold_delta"] > g_noise]
        lines.append(
            f"* **TGDPO α={a:g} vs DPO by mean gold** (no ceiling): " + "; ".join(
                f"β={b:g}: {m['gold']:+.2f} vs DPO {m['dpo_gold']:+.2f} at KL {m['kl']:.1f} "
                f"(Δ {m['gold_delta']:+.2f}, " + ("interpolated" if m["interpolated"] else
                                                 f"nearest DPO point, KL gap {m['kl_gap']:+.1f}")
                + f"; {m['gold_status']})" for b, m in bms) +
            f". {len(resolved)} of {len(bms)} cells above DPO's gold frontier by more than the seed "
            f"stds' sum ({g_noise:.2f}); " + ", ".join(f"{gst.count(x)} {x}" for x in
                                                      ("above", "dominated", "unmatched")) + ".")
    if mk and max(m["win"] for m in mk.values()) > 0.97:
        lines.append("* **Ceiling.** Some cells win > 0.97 against SFT: the win rate saturates "
                     "there, so compare their mean gold (table below) as well.")
    sft = results["sft"]
    lines.append(f"* **Calibration.** Fresh SFT samples win {sft['win_vs_sft']:.3f} against the "
                 f"SFT reference samples (0.5 expected), mean gold {sft['mean_gold']:+.3f}.")
    return lines


def plot_frontiers(results, cells, steps, path):
    """Win rate against KL per alpha (``steps``: the preset's; other step counts are labelled)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4.2))
    alphas = sorted({k[0] for k in cells})
    colors = dict(zip(alphas, ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"]))
    for a in alphas:
        for (ca, _, _), c in cells.items():
            if ca == a:
                for n in c["runs"]:
                    ax.plot(results[n]["kl"], results[n]["win_vs_sft"], ".", color=colors[a],
                            alpha=0.35)
        pts = frontier(cells, a)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[a],
                label="DPO (α=0)" if a == 0.0 else f"TGDPO α={a:g}")
        for kl, win, b, n in pts:
            ax.annotate(f"β={b:g}" + (f", {n} steps" if n != steps else ""), (kl, win),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    g, s = results["guidance"], results["sft"]
    ax.plot(g["kl"], g["win_vs_sft"], "s", color="tab:gray", label="guidance π_r")
    ax.plot(s["kl"], s["win_vs_sft"], "s", color="black", label="SFT")
    finish_win_vs_kl(fig, ax, "Frontiers over β (means over seeds; dots: runs)", path)


def write_outputs(workdir, exp, preset, argv, tb, pairs, results, seconds, ta, rr):
    """results.csv, results.md, win_rate_vs_kl.png (the frontiers), training_curves.png; returns
    the per-(alpha, beta) statistics."""
    h2h = head_to_head(results)
    rows = csv_rows(results, h2h)
    for row in rows:
        r = results[row["run"]]
        row["beta"] = "" if row["run"] == "sft" else r.get("beta", float(exp.beta))
    write_csv(os.path.join(workdir, "results.csv"), rows, ADDITIVE_CSV_FIELDS)
    cells = cell_stats(results, h2h)
    mk = matched_kl(cells)
    passed, gate_lines = gate(results, cells)
    w, t = tb["preset"], exp.train.train
    cmd = "python -m experiments.tgdpo_vs_dpo " + " ".join(argv)
    md = [f"# TGDPO vs DPO on the token-additive gold world ({preset} preset)", "",
          f"Command: `{cmd}` | seeds {list(exp.seeds)} (data order; guidance π_r seed "
          f"{exp.guidance_seed}) | commit {git_commit()} | wall time {seconds[0]:.0f} s this "
          f"invocation ({seconds[1]:.0f} s for the longest one in this workdir).", "",
          f"World: {w['num_letters']} letters, a random first-order Markov chain, gold(y) = Σ_t "
          f"w[y_t] with w ~ N(0, 1) per letter (world seed {w['world_seed']}; bytes outside the "
          f"alphabet score 0). Prompts: {w['prompt_len']} chain letters; responses: up to "
          f"{w['max_new_tokens']} bytes. SFT policy: {tb['sft_config']['model']['num_layers']} "
          f"layer(s), d = {tb['sft_config']['model']['d_model']}, byte tokens, "
          f"{tb['sft']['step']} steps on {w['corpus_docs']} chain strings (eval loss "
          f"{tb['sft']['eval_loss']:.3f} nats/byte; testbed `{tb['workdir']}`). Pairs: best vs "
          f"worst of {w['responses']['tgdpo_train']} SFT samples (T = {w['temperature']}) for "
          f"{pairs['n_train_groups']} `tgdpo_train` prompts → {pairs['n_train']} policy pairs "
          f"(mean gold gap {pairs['mean_gap']:.3f}); the guidance π_r (DPO, β = {exp.beta}) is "
          f"trained on {pairs['n_guidance']} pairs of {pairs['n_guidance_groups']} DISJOINT "
          f"`guidance_train` prompts ({pairs['guidance_prompts_in_train']} shared with the "
          f"policy pairs); validation pairs: {pairs['n_eval']} from held-out `tgdpo_eval` prompts. "
          f"Every run: {t.steps} steps × {t.batch_size} pairs, lr {t.lr:g} (warmup "
          f"{t.warmup_steps}, cosine to 0), from the SFT start. Arms: α ∈ "
          f"{[float(a) for a in exp.alphas]} (α = 0 is DPO) × β ∈ {[float(b) for b in exp.betas]}"
          + (f"; DPO also at {[int(n) for n in exp.dpo_steps]} steps per β (the KL sweep: DPO "
             "points at the KL the TGDPO runs reach)" if exp.get("dpo_steps") else "") +
          f". Evaluation: {exp.eval_samples} samples per held-out prompt at T = "
          f"{exp.eval_temperature} against the {w['responses']['tgdpo_eval']} SFT reference "
          "samples of each prompt.", "", "## Reading", ""]
    md += gate_lines + reading(results, cells, mk, rr, passed)
    md += ["", "## Per (α, β) (mean ± std over seeds)", ""]
    header = ["arm", "β", "steps", "runs", "win rate vs SFT", "mean gold", "KL (nats)",
              "h2h vs DPO (same β)", "train acc", "val pair acc"]
    body = [[c["arm"], f"{b:g}", n, c["win_vs_sft"][2], pm(*c["win_vs_sft"][:2]),
             pm(*c["mean_gold"][:2]), pm(*c["kl"][:2], 2),
             pm(*c["h2h"][:2]) if "h2h" in c else "—", pm(*c["train_accuracy"][:2], 2),
             pm(*c["eval_accuracy"][:2], 2)] for (a, b, n), c in cells.items()]
    for n, label in (("guidance", "guidance π_r"), ("sft", "SFT (fresh samples)")):
        r = results[n]
        body.append([label, f"{exp.beta:g}" if n == "guidance" else "—",
                     r.get("steps", "—") if n == "guidance" else "—", 1,
                     f"{r['win_vs_sft']:.3f}", f"{r['mean_gold']:+.3f}", f"{r['kl']:.2f}", "—",
                     "—", "—"])
    md.append(markdown_table(header, body))
    md += ["## TGDPO vs DPO at matched KL", "",
           "Means over seeds. \"DPO win at this KL\": DPO's frontier (the upper envelope of its "
           "(KL, win rate) points over β and the step sweep: a longer run that degrades is not on "
           "it), linear in KL, at the TGDPO cell's KL; outside the frontier's KL range its "
           "nearest point (KL gap stated). \"DPO best at ≤ KL\": the best DPO cell whose KL is no larger. Status: "
           "dominated (a DPO cell wins at least as often at no more KL), above (inside DPO's KL "
           "range, above its interpolated win rate and not dominated), unmatched (beyond DPO's KL "
           "range and above every DPO cell of lower KL: a matched comparison needs DPO runs of "
           "higher KL). The gold columns: the same with mean gold in place of the win rate.", ""]
    md.append(markdown_table(
        ["arm", "β", "KL", "win vs SFT", "DPO win at this KL", "Δ", "how", "DPO best win at ≤ KL",
         "(its KL)", "status", "mean gold", "DPO gold at this KL", "Δ gold",
         "DPO best gold at ≤ KL", "gold status"],
        [[f"TGDPO α={a:g}", f"{b:g}", f"{m['kl']:.2f}", f"{m['win']:.3f}", f"{m['dpo_win']:.3f}",
          f"{m['delta']:+.3f}", "interpolated" if m["interpolated"] else
          f"nearest DPO point (KL gap {m['kl_gap']:+.2f})", f"{m['dpo_best']:.3f}",
          f"{m['dpo_best_kl']:.2f}", m["status"], f"{m['gold']:+.2f}", f"{m['dpo_gold']:+.2f}",
          f"{m['gold_delta']:+.2f}", f"{m['dpo_best_gold']:+.2f}", m["gold_status"]]
         for (a, b), m in sorted(mk.items())]))
    md += ["## Guidance token rewards vs the true token rewards", "",
           f"r̂_t = β(log π_r − log π_ref)(y_t), β = {rr['beta']}, on {rr['n_tokens']} response "
           f"tokens of {rr['n_responses']} held-out SFT samples ({rr['frac_unknown_tokens']:.1%} "
           f"bytes outside the alphabet, true reward 0). r̂: mean {rr['r_hat']['mean']:+.4f}, "
           f"5–95% {rr['r_hat']['p05']:+.3f} … {rr['r_hat']['p95']:+.3f}. (Inside a TGDPO run's "
           "loss r̂ is scaled by that run's β, as in the reference; a correlation does not depend "
           "on the scale.)", ""]
    md.append(markdown_table(
        ["level", "n", "Pearson", "Spearman"],
        [[lvl, rr[lvl]["n"], f"{rr[lvl]['pearson']:+.3f}", f"{rr[lvl]['spearman']:+.3f}"]
         for lvl in ("token", "letter", "sequence")]))
    md.append(markdown_table(["letter", "true w", "mean r̂", "count"],
                             [[p["letter"], f"{p['w']:+.3f}", f"{p['mean_r_hat']:+.4f}",
                               p["count"]] for p in rr["per_letter"]]))
    d = ta["r_hat"]
    md += [f"On the policies' training pairs r̂ has mean {d['chosen']['mean']:+.4f} on chosen and "
           f"{d['rejected']['mean']:+.4f} on rejected tokens (token_analysis.json also holds the "
           "guidance factors and the policies' log-ratios by r̂ quintile).", "", "## Per run", ""]
    md.append(markdown_table(
        ["run", "arm", "β", "seed", "win vs SFT", "mean gold", "KL", "h2h vs DPO", "train acc",
         "val acc", "train s", "eval s"],
        [[r["run"], r["arm"], r["beta"], r["seed"], r["win_vs_sft"], r["mean_gold"], r["kl"],
          r["h2h_vs_dpo"], r["train_accuracy"], r["eval_accuracy"], r["train_seconds"],
          r["eval_seconds"]] for r in rows]))
    md += ["Win rate: per prompt, all (policy sample, SFT sample) pairs, 1 win / 0.5 tie / 0 loss "
           "under gold, averaged over pairs then prompts. KL: Monte-Carlo sequence-level estimate "
           "on the policy's own samples (Σ_t log π − log π_ref over the response tokens, eos "
           "included when the sample stopped). Plots: `win_rate_vs_kl.png` (the frontiers), "
           "`training_curves.png`."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_frontiers(results, cells, int(exp.train.train.steps),
                   os.path.join(workdir, "win_rate_vs_kl.png"))
    plot_curves(results, os.path.join(workdir, "training_curves.png"))
    return {"cells": cells, "matched_kl": mk, "passed": passed}


def summary_lines(stats):
    out = [f"  {c['arm']:14s} β={b:<5g} {n:4d} steps  win vs SFT {pm(*c['win_vs_sft'][:2])}  "
           f"gold {pm(*c['mean_gold'][:2], 2)}  KL {pm(*c['kl'][:2], 2)}"
           for (a, b, n), c in stats["cells"].items()]
    out += [f"  TGDPO α={a:g} β={b:g}: win {m['win']:.3f} at KL {m['kl']:.2f}; DPO's best at "
            f"≤ KL {m['dpo_best']:.3f} ({m['status']})"
            for (a, b), m in sorted(stats["matched_kl"].items())]
    return out + [f"  pilot gate {'passed' if stats['passed'] else 'FAILED'}"]
