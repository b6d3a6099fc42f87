"""experiments/precision_recall, the report: results.csv rows, the matched-precision comparison with
the NLL + temperature frontier, the generated ``reading`` statements, results.md and the plots."""
import os

from experiments.common import markdown_table, save_figure


def at(result, t):
    """The metrics of ``result`` at temperature ``t``."""
    return next(r for r in result["by_temperature"] if abs(r["temperature"] - t) < 1e-9)


def nll_recall_at_precision(nll, precision):
    """The NLL model's recall at ``precision`` on its fine temperature frontier (linear between
    neighbouring temperatures of ``frontier_temperatures``; where several temperature segments
    reach that precision, the highest recall), or None outside the precision range it reaches."""
    pts = [(r["precision"], r["recall"]) for r in nll["frontier"]]
    best = None
    for (p0, r0), (p1, r1) in zip(pts[:-1], pts[1:]):
        lo, hi = min(p0, p1), max(p0, p1)
        if lo <= precision <= hi:
            r = r0 if p1 == p0 else r0 + (precision - p0) / (p1 - p0) * (r1 - r0)
            best = r if best is None else max(best, r)
    return best


MARGIN = 0.005  # recall gains below this (absolute) are not called a difference (one seed)


CSV_FIELDS = ("run", "loss_type", "pr_lambda", "pr_mix_nll", "init", "steps", "temperature",
              "precision", "recall", "recall_eps0.01", "off_support", "alpha_0.1", "beta_0.1",
              "alpha_1", "beta_1", "alpha_10", "beta_10", "d_0.1", "d_1", "d_10", "eval_token_nll")


def csv_rows(exp, results):
    """DIR/results.csv: one row per run and temperature (columns ``CSV_FIELDS``)."""
    rows = []
    for spec in exp["runs"]:
        r = results[spec["name"]]
        for m in r["by_temperature"]:
            row = dict(run=spec["name"], loss_type=spec["type"],
                       pr_lambda=spec.get("pr_lambda", "") if spec["type"] != "nll" else "",
                       pr_mix_nll=spec.get("pr_mix_nll", 0.0) if spec["type"] != "nll" else "",
                       init=spec.get("init", "scratch"), steps=r["steps"],
                       temperature=m["temperature"], precision=round(m["precision"], 6),
                       recall=round(m["recall"], 6), off_support=round(m["off_support"], 6),
                       eval_token_nll=round(r["eval_token_nll"], 5))
            row["recall_eps0.01"] = round(m["recall_eps0.01"], 6)
            for lam in ("0.1", "1", "10"):
                row[f"alpha_{lam}"], row[f"beta_{lam}"] = (round(x, 6) for x in m["prd"][lam])
                row[f"d_{lam}"] = round(m["d_lambda"][lam], 6)
            rows.append(row)
    return rows


def recall_gains(nll, result):
    """[(T, precision, recall, NLL recall at that precision or None, gain or None)] per T."""
    out = []
    for m in result["by_temperature"]:
        ref = nll_recall_at_precision(nll, m["precision"])
        out.append((m["temperature"], m["precision"], m["recall"], ref,
                    None if ref is None else m["recall"] - ref))
    return out


def reading(exp, results):
    """Plain statements of what the numbers show (generated, so a rerun cannot contradict them)."""
    nll = results["nll"]
    temps = sorted(exp["temperatures"])
    t_lo = temps[0]
    base, lo = at(nll, 1.0), at(nll, t_lo)
    hot = [f for f in nll["frontier"] if f["temperature"] > 1.0]
    top = max(hot, key=lambda f: f["recall"])
    gain_up, cost_up = top["recall"] - base["recall"], base["precision"] - top["precision"]
    lines = [
        f"* **Temperature, lowering it.** NLL model at T={t_lo:g} vs T=1: precision "
        f"{base['precision']:.4f} → {lo['precision']:.4f} ({lo['precision'] - base['precision']:+.4f}), "
        f"recall {base['recall']:.4f} → {lo['recall']:.4f} ({lo['recall'] - base['recall']:+.4f}).",
        f"* **Temperature, raising it.** Over T ∈ (1, {hot[-1]['temperature']:g}] (steps of "
        f"{(hot[-1]['temperature'] - hot[0]['temperature']) / max(len(hot) - 1, 1):.2g}) the NLL model's recall peaks at "
        f"{top['recall']:.4f} (T={top['temperature']:g}, {gain_up:+.4f} vs T=1) while precision "
        f"falls to {top['precision']:.4f} ({-cost_up:+.4f}); at T={temps[-1]:g} recall is "
        f"{at(nll, temps[-1])['recall']:.4f} and precision {at(nll, temps[-1])['precision']:.4f}. "
        + ("Raising T buys little recall at a large precision cost"
           f" ({cost_up / gain_up:.0f} points of precision per point of recall)."
           if 0 < gain_up < cost_up else "Raising T does not raise recall." if gain_up <= 0 else
           "Raising T buys recall at least as cheaply as it costs precision.")]
    beats, items = [], []
    for spec in exp["runs"][1:]:
        g = recall_gains(nll, results[spec["name"]])
        t1 = next(x for x in g if x[0] == 1.0)
        valid = [x for x in g if x[4] is not None]
        best = max(valid, key=lambda x: x[4]) if valid else None
        desc = (f"`{spec['name']}`: at T=1 precision {t1[1]:.4f}, recall {t1[2]:.4f} "
                + (f"vs NLL's {t1[3]:.4f} ({t1[4]:+.4f})" if t1[3] is not None else
                   "(a precision no NLL temperature gives)"))
        if best is not None and best[0] != 1.0:
            desc += f"; best over its T sweep {best[4]:+.4f} at T={best[0]:g} (precision {best[1]:.4f})"
        items.append(desc)
        if best is not None and best[4] > MARGIN:
            beats.append(spec["name"])
    lines.append("* **PR-loss runs vs NLL + temperature at matched precision** (recall minus the "
                 "NLL frontier's recall at the same precision; a difference needs > "
                 f"{MARGIN:g}):\n" + "\n".join(f"  * {x}" for x in items))
    temp_shows = 0 < gain_up < cost_up or gain_up <= 0
    if temp_shows and beats:
        verdict = (f"shows: temperature fails to raise recall, and {', '.join(f'`{b}`' for b in beats)} "
                   "reach(es) recall the NLL model does not reach at any temperature at the same "
                   "precision")
    elif temp_shows:
        verdict = ("shows only in part: temperature behaves as described, but no PR-loss run beats "
                   "NLL + temperature by more than the margin")
    else:
        verdict = "does not show: raising T buys recall cheaply here"
    lines.append(f"* **Paper's direction** (temperature trades recall for precision well but fails "
                 f"to raise recall; the PR losses reach trade-offs temperature cannot): it {verdict}. "
                 f"One seed, a {nll['params'] / 1e3:.0f}k-parameter model, and the spec's "
                 "unverified candidate loss.")
    pure = [s for s in exp["runs"][1:] if not s.get("pr_mix_nll")]
    if pure:
        lines.append("* **Pure L_λ (no NLL term)**: " + ", ".join(
            f"`{s['name']}` precision {at(results[s['name']], 1.0)['precision']:.4f}, recall "
            f"{at(results[s['name']], 1.0)['recall']:.4f}, {results[s['name']]['eval_saturated']:.1%} "
            "of held-out targets saturated (q_y ≥ λ, zero gradient)" for s in pure)
            + ". L_λ = 0 once every target has q_y ≥ λ; the rest of the mass is unconstrained "
            "(λ = 0.1), or the hinge drops the rarer successors once the likelier ones reach λ "
            "(λ = 0.5). A small NLL term (or a warm start from NLL plus that term) is what makes "
            "the loss usable here.")
    return lines


def markdown(exp, results, meta, corpus):
    """DIR/results.md."""
    nll = results["nll"]
    src = meta["source"]
    header = ["run", "objective", "init", "T", "precision", "recall (ε={:g})".format(exp["recall_eps"]),
              "recall (ε=0.01)", "α/β at λ=0.1", "α/β at λ=1", "α/β at λ=10", "NLL+T recall at this precision (Δ)",
              "eval NLL"]
    rows = []
    for spec in exp["runs"]:
        r = results[spec["name"]]
        obj = ("NLL" if spec["type"] == "nll" else
               f"L_λ, λ={spec['pr_lambda']:g}" + (f" + {spec['pr_mix_nll']:g}·NLL"
                                                   if spec.get("pr_mix_nll") else ""))
        for m in r["by_temperature"]:
            if spec["type"] != "nll" and not spec.get("pr_mix_nll") and m["temperature"] != 1.0:
                continue  # the pure-L_lambda runs: T=1 only (all T are in results.csv)
            ref = (nll_recall_at_precision(nll, m["precision"]) if spec["type"] != "nll" else None)
            rows.append([spec["name"], obj, spec.get("init", "scratch") + f", {r['steps']} steps",
                         f"{m['temperature']:g}", f"{m['precision']:.4f}", f"{m['recall']:.4f}",
                         f"{m['recall_eps0.01']:.4f}",
                         *[f"{m['prd'][k][0]:.3f} / {m['prd'][k][1]:.3f}" for k in ("0.1", "1", "10")],
                         "—" if ref is None else f"{ref:.4f} ({m['recall'] - ref:+.4f})",
                         f"{r['eval_token_nll']:.4f}"])
    train_min = sum((r["train_seconds"] or 0) for r in results.values()) / 60
    lines = ["# Precision–recall: NLL + temperature vs PR losses (exact, synthetic Markov source)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, preset `{meta['preset']}`, "
             f"model/data seed {exp['seed']}, source seed {exp['source']['seed']}, corpus seed "
             f"{exp['data_seed']}. Wall time: this invocation {meta['wall_seconds'] / 60:.1f} min "
             f"({train_min:.1f} min of training measured when the runs trained; {meta['cpus']} CPUs "
             f"shared with other jobs, load average {meta['load']:.1f} at the end).", "",
             f"Source: a mixture of {src['chains']} sparse Markov chains over {src['letters']} letters "
             f"(branching {exp['source'].get('branching', 3)}, strings of 1–{src['max_len']} letters); "
             f"|supp P| = {meta['support']:,} strings, H(P) = {meta['entropy']:.3f} nats, half of P's "
             f"mass in its {meta['head50']:,} most likely strings and 99% in {meta['head99']:,}. "
             f"Training corpus: {corpus['documents']:,} samples ({corpus['distinct']:,} distinct). "
             f"Models: `configs/precision_recall.py:{exp['config']}` ({nll['params']:,} params, byte "
             "tokens, vocabulary 384).", "",
             "Metrics, exact by enumerating supp P: precision = Q_T(supp P); recall = "
             f"P({{x : Q_T(x) ≥ ε·P(x)}}) with ε = {exp['recall_eps']:g} (and 0.01); (α_λ, β_λ) = "
             "(Σ min(λP, Q_T), α_λ/λ). Q_T(x) = Π_t softmax(logits_t/T)[x_t] over [bos] x [eos], "
             "what temperature sampling generates. L_λ = min(λ,1) − min(λ, q_y) is the spec's "
             "**unverified** candidate loss (the paper's exact loss is unknown). The NLL+T "
             "reference recall is read off the NLL model's frontier over T = "
             f"{exp['frontier_temperatures'][0]:g}…{exp['frontier_temperatures'][-1]:g} "
             f"({len(exp['frontier_temperatures'])} temperatures, linear in between). Pure-L_λ "
             "runs are shown at T=1 only (every run at every T is in results.csv).", "",
             markdown_table(header, rows), "## Reading", ""]
    lines += reading(exp, results)
    lines += ["", "Plots: `pr_points.png` (precision vs recall: NLL over temperature as a curve, the "
              "PR-loss runs at T=1 as points), `prd_curves.png` (β_λ vs α_λ at T=1, λ ∈ {0.1, 1, 10} "
              "marked). Per-run training metrics: `<run>/metrics.jsonl` in the workdir.", ""]
    return "\n".join(lines)


def plots(exp, results, workdir):
    """DIR/pr_points.png and DIR/prd_curves.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    nll = results["nll"]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    pts = nll["by_temperature"]
    ax.plot([m["recall"] for m in nll["frontier"]], [m["precision"] for m in nll["frontier"]], "-",
            color="tab:blue", label="NLL + temperature T (frontier)")
    ax.plot([m["recall"] for m in pts], [m["precision"] for m in pts], "o", color="tab:blue")
    for m in pts:
        ax.annotate(f"T={m['temperature']:g}", (m["recall"], m["precision"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:blue")
    markers = "s^vDPX*"
    for i, spec in enumerate(exp["runs"][1:]):
        r = results[spec["name"]]
        c = plt.cm.tab10(i + 1)
        ts = r["by_temperature"]
        ax.plot([m["recall"] for m in ts], [m["precision"] for m in ts], "-", color=c, alpha=0.25)
        m = at(r, 1.0)
        ax.scatter([m["recall"]], [m["precision"]], marker=markers[i % len(markers)], s=50, color=c,
                   zorder=3, label=f"{spec['name']} (T=1; faint: its T sweep)")
    ax.set_xlabel(f"recall  P{{x : Q(x) ≥ {exp['recall_eps']:g}·P(x)}}")
    ax.set_ylabel("precision  Q(supp P)")
    ax.set_title("Exact precision vs recall on the Markov-mixture source", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "pr_points.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, spec in enumerate(exp["runs"]):
        r = results[spec["name"]]
        c = plt.cm.tab10(i)
        temps = [t for t in exp["temperatures"] if spec["type"] == "nll" or t == 1.0]
        for t in temps:
            m = at(r, t)
            ls = "-" if t == 1.0 else ":"
            ax.plot([x for x, _ in m["curve"]], [y for _, y in m["curve"]], ls, color=c, lw=1.2,
                    label=f"{spec['name']}" + (f" T={t:g}" if spec["type"] == "nll" else ""),
                    alpha=1.0 if t == 1.0 else 0.6)
            if t == 1.0:
                for lam in ("0.1", "1", "10"):
                    x, y = m["prd"][lam]
                    ax.scatter([y], [x], color=c, s=14, zorder=3)
    ax.set_xlabel("β_λ (recall side)")
    ax.set_ylabel("α_λ (precision side)")
    ax.set_title("PRD curves (α_λ, β_λ) over λ; dots at λ = 0.1, 1, 10 (T=1)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "prd_curves.png"), dpi=120)
