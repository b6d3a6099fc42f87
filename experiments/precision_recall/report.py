"""experiments/precision_recall, the report: results.csv rows, the matched-precision comparison with
the NLL + temperature frontier, the generated ``reading`` statements, results.md and the plots."""
import os

from experiments.common import markdown_table, mean_spread, save_figure


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


MARGIN = 0.005  # recall gains below this (absolute) are not called a difference


CSV_FIELDS = ("seed", "run", "loss_type", "pr_lambda", "pr_mix_nll", "init", "steps", "temperature",
              "precision", "recall", "head_recall", "tail_recall", "recall_eps0.01", "off_support",
              "q_head", "q_tail", "nll_t_recall_at_precision", "recall_gain", "alpha_0.1",
              "beta_0.1", "alpha_1", "beta_1", "alpha_10", "beta_10", "d_0.1", "d_1", "d_10",
              "eval_token_nll")


def _r(x, nd=6):
    return "" if x is None else round(x, nd)


def csv_rows(exp, results):
    """DIR/results.csv: one row per seed, run and temperature (columns ``CSV_FIELDS``); the gain
    is the run's recall minus its seed's NLL + T frontier recall at the same precision."""
    rows = []
    for seed, res in results.items():
        for spec in exp["runs"]:
            r = res[spec["name"]]
            pr = spec["type"] != "nll"
            for m in r["by_temperature"]:
                ref = (nll_recall_at_precision(res[reference(spec)], m["precision"])
                       if spec["name"] != "nll" else None)
                row = dict(seed=seed, run=spec["name"], loss_type=spec["type"],
                           pr_lambda=spec.get("pr_lambda", "") if pr else "",
                           pr_mix_nll=spec.get("pr_mix_nll", 0.0) if pr else "",
                           init=spec.get("init", "scratch"), steps=r["steps"],
                           temperature=m["temperature"], eval_token_nll=round(r["eval_token_nll"], 5),
                           nll_t_recall_at_precision=_r(ref),
                           recall_gain=_r(None if ref is None else m["recall"] - ref))
                for k in ("precision", "recall", "head_recall", "tail_recall", "recall_eps0.01",
                          "off_support", "q_head", "q_tail"):
                    row[k] = round(m[k], 6)
                for lam in ("0.1", "1", "10"):
                    row[f"alpha_{lam}"], row[f"beta_{lam}"] = (round(x, 6) for x in m["prd"][lam])
                    row[f"d_{lam}"] = round(m["d_lambda"][lam], 6)
                rows.append(row)
    return rows


def gate(exp, results):
    """{seed: (passed, T=1 precision, T=1 head recall)} of every seed's NLL model: it must learn
    P's head before its recall, or a loss's gain over it, means anything."""
    g = exp["gate"]
    out = {}
    for seed, res in results.items():
        m = at(res["nll"], 1.0)
        out[seed] = (m["precision"] >= g["precision"] and m["head_recall"] >= g["head_recall"],
                     m["precision"], m["head_recall"])
    return out


def _ms(xs):
    """(mean, s.e., n) over seeds, or None if no seed has a value."""
    xs = [x for x in xs if x is not None]
    return mean_spread(xs, "se") if xs else None


def _fmt(ms, nd=4, signed=False):
    if ms is None:
        return "—"
    m, se, n = ms
    return (f"{m:+.{nd}f}" if signed else f"{m:.{nd}f}") + (f" ± {se:.{nd}f}" if n > 1 else "")


def per_t(exp, results, name, key):
    """{T: (mean, s.e., n)} of metric ``key`` of run ``name`` over the seeds."""
    return {t: _ms([at(res[name], t)[key] for res in results.values()])
            for t in exp["temperatures"]}


def reference(spec):
    """The NLL run whose T frontier ``spec`` is compared with: ``spec["reference"]`` (a warm
    start's: the NLL control trained as many more steps), else ``nll``."""
    return spec.get("reference", "nll")


def gains(exp, results, spec):
    """{T: (mean, s.e., n) of the recall gain over each seed's own reference NLL + T frontier
    (``reference``) at the same precision, over the seeds where that precision is on it}."""
    out = {}
    for t in exp["temperatures"]:
        g = []
        for res in results.values():
            m = at(res[spec["name"]], t)
            ref = nll_recall_at_precision(res[reference(spec)], m["precision"])
            g.append(None if ref is None else m["recall"] - ref)
        out[t] = _ms(g)
    return out


def _pure(spec):
    """A pure-L_lambda run (no NLL term)."""
    return spec["type"] != "nll" and not spec.get("pr_mix_nll")


def reading(exp, results):
    """Plain statements of what the numbers show (generated, so a rerun cannot contradict them)."""
    temps = sorted(exp["temperatures"])
    t_lo, t_hi = temps[0], temps[-1]
    seeds = list(results)
    n = len(seeds)
    gates = gate(exp, results)
    failed = [s for s, (ok, _, _) in gates.items() if not ok]
    lines = [f"* **Gate** (each seed's NLL model at T=1: precision ≥ {exp['gate']['precision']:g} "
             f"and head recall ≥ {exp['gate']['head_recall']:g}, head = the most likely strings "
             "holding half of P): " + ", ".join(
                 f"seed {s} {'passes' if ok else 'FAILS'} (precision {p:.3f}, head recall {h:.3f})"
                 for s, (ok, p, h) in gates.items()) + "."
             + (f" **The gate fails for seed(s) {', '.join(map(str, failed))}: the NLL model did not "
                "learn the head, so the comparisons below are not evidence either way.**"
                if failed else "")]
    nll = {k: per_t(exp, results, "nll", k) for k in ("precision", "recall", "head_recall",
                                                        "tail_recall", "off_support", "q_tail")}
    lines.append(
        f"* **NLL at T=1** (mean ± s.e. over {n} training seeds): precision {_fmt(nll['precision'][1.0])}, "
        f"recall {_fmt(nll['recall'][1.0])} (head {_fmt(nll['head_recall'][1.0])}, tail "
        f"{_fmt(nll['tail_recall'][1.0])}): the headroom a recall-oriented loss could use is in the tail.")
    lines.append(
        f"* **Temperature, lowering it.** T=1 → {t_lo:g}: precision {_fmt(nll['precision'][1.0])} → "
        f"{_fmt(nll['precision'][t_lo])}, recall {_fmt(nll['recall'][1.0])} → {_fmt(nll['recall'][t_lo])}.")
    peaks = []
    for res in results.values():
        base = at(res["nll"], 1.0)
        hot = [f for f in res["nll"]["frontier"] if f["temperature"] > 1.0]
        top = max(hot, key=lambda f: f["recall"])
        peaks.append((top["recall"] - base["recall"], base["precision"] - top["precision"],
                      top["temperature"], top["tail_recall"] - base["tail_recall"]))
    gain_up, cost_up = _ms([p[0] for p in peaks]), _ms([p[1] for p in peaks])
    d_tail = {t: _ms([at(res["nll"], t)["q_tail"] - at(res["nll"], 1.0)["q_tail"]
                      for res in results.values()]) for t in temps if t > 1.0}
    d_off = {t: _ms([at(res["nll"], t)["off_support"] - at(res["nll"], 1.0)["off_support"]
                     for res in results.values()]) for t in temps if t > 1.0}
    hot_t = [t for t in temps if t > 1.0]
    lines.append(
        f"* **Temperature, raising it.** The best T > 1 on each seed's frontier (T ∈ "
        f"{{{', '.join(f'{p[2]:g}' for p in peaks)}}}) raises recall by {_fmt(gain_up, signed=True)} "
        f"(tail recall {_fmt(_ms([p[3] for p in peaks]), signed=True)}) at a precision cost of "
        f"{_fmt(cost_up)}; at T={t_hi:g} recall is {_fmt(nll['recall'][t_hi])}, precision "
        f"{_fmt(nll['precision'][t_hi])}. Where the extra mass goes, T=1 → "
        + "; ".join(f"{t:g}: Q on P's tail {_fmt(d_tail[t], signed=True)}, Q off the support "
                    f"{_fmt(d_off[t], signed=True)}" for t in hot_t) + ".")
    temp_fails = gain_up[0] <= 0 or gain_up[0] < cost_up[0]
    beats, items = [], []
    for spec in exp["runs"][1:]:
        control = spec["type"] == "nll"  # more NLL training: not a PR loss
        g = gains(exp, results, spec)
        prec, rec = per_t(exp, results, spec["name"], "precision"), per_t(exp, results, spec["name"], "recall")
        valid = {t: v for t, v in g.items() if v is not None and v[2] == n}
        best = max(valid, key=lambda t: valid[t][0]) if valid else None
        desc = (f"`{spec['name']}`: at T=1 precision {_fmt(prec[1.0])}, recall {_fmt(rec[1.0])}, gain "
                + (_fmt(g[1.0], signed=True) + (f" ({g[1.0][2]} of {n} seeds on the frontier)"
                                                if g[1.0][2] < n else "")
                   if g[1.0] is not None else "— (a precision no NLL temperature gives)"))
        if best is not None and best != 1.0:
            desc += (f"; best T of its sweep {best:g}: gain {_fmt(valid[best], signed=True)} at "
                     f"precision {_fmt(prec[best])}")
        items.append(desc + (f", against the `{reference(spec)}` frontier" if reference(spec) != "nll" else "")
                     + (" (a control: more NLL training, not a PR loss)" if control else ""))
        if best is not None and not control:
            m, se, _ = valid[best]
            if m > MARGIN and m - 2 * se > 0:
                beats.append(spec["name"])
    lines.append("* **PR-loss runs vs NLL + temperature at matched precision** (recall minus the "
                 "same seed's NLL frontier recall at the run's precision, mean ± s.e. over seeds; a "
                 "warm-started run is compared with the frontier of the NLL run trained as many "
                 "steps, its `reference`; a "
                 f"difference needs a mean > {MARGIN:g} and > 2 s.e.):\n"
                 + "\n".join(f"  * {x}" for x in items))
    if failed:
        verdict = "cannot say: the gate failed"
    elif temp_fails and beats:
        verdict = (f"shows: temperature fails to raise recall, and {', '.join(f'`{b}`' for b in beats)} "
                   "reach(es) recall the NLL model does not reach at any temperature at the same "
                   "precision")
    elif temp_fails:
        verdict = ("shows only in part: temperature behaves as described, but no PR-loss run beats "
                   "NLL + temperature by more than the margin")
    else:
        verdict = "does not show: raising T buys recall cheaply here"
    lines.append(f"* **Paper's direction** (temperature trades recall for precision well but fails "
                 f"to raise recall; the PR losses reach trade-offs temperature cannot): it {verdict}. "
                 f"{n} training seed(s), a {results[seeds[0]]['nll']['params'] / 1e3:.0f}k-parameter "
                 "model, and the spec's unverified candidate loss.")
    pure = [s for s in exp["runs"][1:] if _pure(s)]
    if pure:
        lines.append("* **Pure L_λ (no NLL term)**: " + ", ".join(
            f"`{s['name']}` precision {_fmt(per_t(exp, results, s['name'], 'precision')[1.0])}, recall "
            f"{_fmt(per_t(exp, results, s['name'], 'recall')[1.0])}, "
            f"{_ms([res[s['name']]['eval_saturated'] for res in results.values()])[0]:.1%} "
            "of held-out targets saturated (q_y ≥ λ, zero gradient)" for s in pure)
            + ". L_λ = 0 once every target has q_y ≥ λ; the rest of the mass is unconstrained "
            "(λ = 0.1), or the hinge drops the rarer successors once the likelier ones reach λ "
            "(λ = 0.5).")
    return lines


def _source_line(exp, meta, corpus):
    src = meta["source"]
    if src.get("kind") == "zipf":
        what = (f"{src['strings']:,} distinct random strings of {src['min_len']}–{src['max_len']} "
                f"letters over {src['letters']} letters, P(rank i) ∝ i^-{src['exponent']:g} "
                "(`icml_jax.data.zipf_source`)")
    else:
        what = (f"a mixture of {src['chains']} sparse Markov chains over {src['letters']} letters "
                f"(branching {exp['source'].get('branching', 3)}, strings of 1–{src['max_len']} "
                "letters; `icml_jax.data.markov_source`)")
    seen = corpus.get("p_mass_seen")
    return (f"Source: {what}; |supp P| = {meta['support']:,} strings, H(P) = {meta['entropy']:.3f} "
            f"nats, half of P's mass in its {meta['head50']:,} most likely strings (the head) and 99% "
            f"in {meta['head99']:,}. Training corpus: {corpus['documents']:,} samples "
            f"({corpus['distinct']:,} distinct)"
            + (": P's mass in strings it holds " + ", ".join(f"{k} times {v:.3f}" for k, v in seen.items()
                                                             if k != "0")
               + f", never {seen['0']:.3f}" if seen else "") + ".")


def markdown(exp, results, meta, corpus):
    """DIR/results.md."""
    seeds = list(results)
    first = results[seeds[0]]
    header = ["run", "objective", "init", "T", "precision", f"recall (ε={exp['recall_eps']:g})",
              "head recall", "tail recall", "Q off supp P", "α/β at λ=1",
              "recall − NLL+T recall at this precision (reference run)", "eval NLL"]
    rows = []
    for spec in exp["runs"]:
        name = spec["name"]
        obj = ("NLL" if spec["type"] == "nll" else
               f"L_λ, λ={spec['pr_lambda']:g}" + (f" + {spec['pr_mix_nll']:g}·NLL"
                                                   if spec.get("pr_mix_nll") else ""))
        metric = {k: per_t(exp, results, name, k) for k in
                  ("precision", "recall", "head_recall", "tail_recall", "off_support")}
        g = gains(exp, results, spec) if name != "nll" else {}
        for t in exp["temperatures"]:
            if _pure(spec) and t != 1.0:
                continue  # the pure-L_lambda runs: T=1 only (all T are in results.csv)
            a1 = _ms([at(res[name], t)["prd"]["1"][0] for res in results.values()])
            gt = g.get(t)
            rows.append([name, obj, spec.get("init", "scratch") + f", {first[name]['steps']} steps",
                         f"{t:g}", *[_fmt(metric[k][t]) for k in metric], _fmt(a1, 3),
                         "—" if gt is None else _fmt(gt, signed=True)
                         + (f" ({gt[2]}/{len(seeds)} seeds)" if gt[2] < len(seeds) else "")
                         + f" ({reference(spec)})",
                         _fmt(_ms([res[name]["eval_token_nll"] for res in results.values()]))])
    train_min = sum((r["train_seconds"] or 0) for res in results.values() for r in res.values()) / 60
    kind = meta["source"].get("kind", "markov")
    lines = [f"# Precision–recall: NLL + temperature vs PR losses (exact, synthetic {kind} source)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, preset `{meta['preset']}`, "
             f"training seeds {seeds} (model init and data order), source seed {exp['source']['seed']}, "
             f"corpus seed {exp['data_seed']}. Wall time: this invocation {meta['wall_seconds'] / 60:.1f} "
             f"min ({train_min:.1f} min of training measured when the runs trained; {meta['cpus']} CPUs, "
             f"load average {meta['load']:.1f} at the end).", "",
             _source_line(exp, meta, corpus) + f" Models: `configs/precision_recall.py:{exp['config']}` "
             f"({first['nll']['params']:,} params, byte tokens, vocabulary 384).", "",
             "Metrics, exact by enumerating supp P: precision = Q_T(supp P); recall = "
             f"P({{x : Q_T(x) ≥ ε·P(x)}}) with ε = {exp['recall_eps']:g} (ε = 0.01 in results.csv); "
             "head / tail recall = that recall within the head / the rest of supp P, normalised; "
             "(α_λ, β_λ) = (Σ min(λP, Q_T), α_λ/λ), α_1 = β_1 shown. Q_T(x) = Π_t "
             "softmax(logits_t/T)[x_t] over [bos] x [eos], what temperature sampling generates. "
             "L_λ = min(λ,1) − min(λ, q_y) is the spec's **unverified** candidate loss (the paper's "
             "exact loss is unknown). The NLL+T reference recall is read off the same seed's NLL "
             f"frontier over T = {exp['frontier_temperatures'][0]:g}…{exp['frontier_temperatures'][-1]:g} "
             f"({len(exp['frontier_temperatures'])} temperatures, linear in between). Cells are mean ± "
             f"s.e. over the {len(seeds)} seeds; every seed, run and T is a row of results.csv. "
             "Pure-L_λ runs are shown at T=1 only.", "",
             markdown_table(header, rows), "## Reading", ""]
    lines += reading(exp, results)
    lines += ["", "Plots: `pr_points.png` (precision vs recall: each seed's NLL frontier over T as a "
              "line, every run's mean over seeds at each T with s.e. bars), `prd_curves.png` (β_λ vs "
              f"α_λ, seed {seeds[0]}, λ ∈ {{0.1, 1, 10}} marked). Per-run training metrics: "
              "`seed<k>/<run>/metrics.jsonl` in the workdir.", ""]
    return "\n".join(lines)


def plots(exp, results, workdir):
    """DIR/pr_points.png and DIR/prd_curves.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    seeds = list(results)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, res in enumerate(results.values()):
        fr = res["nll"]["frontier"]
        ax.plot([m["recall"] for m in fr], [m["precision"] for m in fr], "-", color="tab:blue",
                lw=0.8, alpha=0.6, label="NLL + temperature T (frontier, each seed)" if i == 0 else None)
    markers = "os^vDPX*"
    for i, spec in enumerate(exp["runs"]):
        c = plt.cm.tab10(i)
        prec = per_t(exp, results, spec["name"], "precision")
        rec = per_t(exp, results, spec["name"], "recall")
        ts = list(exp["temperatures"])
        ax.errorbar([rec[t][0] for t in ts], [prec[t][0] for t in ts],
                    xerr=[rec[t][1] for t in ts], yerr=[prec[t][1] for t in ts],
                    fmt=markers[i % len(markers)] + ("" if spec["type"] == "nll" else "--"),
                    color=c, ms=5, lw=0.8, capsize=2,
                    label=f"{spec['name']} (mean ± s.e. at T = {', '.join(f'{t:g}' for t in ts)})")
        if spec["type"] == "nll":
            for t in ts:
                ax.annotate(f"T={t:g}", (rec[t][0], prec[t][0]), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=c)
    ax.set_xlabel(f"recall  P{{x : Q(x) ≥ {exp['recall_eps']:g}·P(x)}}")
    ax.set_ylabel("precision  Q(supp P)")
    ax.set_title(f"Exact precision vs recall ({len(seeds)} seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower left")
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "pr_points.png"), dpi=120)

    first = results[seeds[0]]
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, spec in enumerate(exp["runs"]):
        r = first[spec["name"]]
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
    ax.set_title(f"PRD curves (α_λ, β_λ) over λ, seed {seeds[0]}; dots at λ = 0.1, 1, 10 (T=1)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "prd_curves.png"), dpi=120)
