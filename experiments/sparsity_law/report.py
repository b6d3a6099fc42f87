"""experiments/sparsity_law, the report: seed means, whether a law fit is of the law's form, the
trend of the activation ratio with data, the gate, the generated ``reading`` statements,
results.md and the plots."""
import os

from experiments.common import markdown_table, mean_spread, pm

ACTIVATIONS = ("relu_glu", "swiglu")
LABELS = {"relu_glu": "ReLU-GLU", "swiglu": "SiLU-GLU (SwiGLU)"}
# results.csv columns (one row per activation x seed x protocol x checkpoint)
FIELDS = ("activation", "seed", "protocol", "step", "tokens", "dense_ppl", "cett_slice_ppl_dense",
          "ppl_ratio", "cett", "activation_ratio", "sparsity", "gate_active", "thresholds")
# the law fits of fits.json: key -> (activation, what the label adds); ``swiglu_rising`` is fitted to
# SiLU-GLU's seed-mean points from their minimum on (the rising part after the early transient)
FIT_KEYS = {"relu_glu": ("relu_glu", ""), "swiglu": ("swiglu", ""),
            "swiglu_rising": ("swiglu", ", from its minimum on")}
# cett.csv columns (one row per model of the fixed protocol)
CETT_FIELDS = ("activation", "seed", "search_steps", "cett_full", "cett_half_a", "cett_half_b",
               "last_ratio_full", "last_ratio_half_a", "last_ratio_half_b", "mean_ppl_ratio", "search_upper")


def fit_problem(f: dict) -> str:
    """Why a fit is not of the law's form (alpha, c > 0; 0 < A0 <= 1), or "" when it is."""
    if "error" in f:
        return f["error"]
    bad = [f"{k} = {f[k]:.3g}" for k in ("alpha", "c") if not f[k] > 0]
    if 0 < f["alpha"] < 1e-4 and f["c"] > 1e4:
        bad.append(f"degenerate: α → 0 with c → ∞, i.e. a pure power law ∝ D^(−{f['c'] * f['alpha']:.2g}) "
                   "plus A₀")
    if not 0 < f["A0"] <= 1:
        bad.append(f"A0 = {f['A0']:.3g} (not a ratio)")
    return ", ".join(bad)


def _spearman(x, y) -> float:
    import numpy as np
    if len(x) < 3:
        return float("nan")
    rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def runs(rows) -> dict:
    """{(activation, seed): that model's rows in step order} (one protocol's rows)."""
    out = {}
    for r in sorted(rows, key=lambda r: (r["activation"], r["seed"], r["step"])):
        out.setdefault((r["activation"], r["seed"]), []).append(r)
    return out


def mean_rows(rows) -> list:
    """One row per activation x step: the mean over seeds (``activation_ratio``, ``dense_ppl``,
    ``cett``, ``ppl_ratio``) and the standard error of the activation ratio (``ratio_se``,
    ``n`` seeds)."""
    groups = {}
    for r in rows:
        groups.setdefault((r["activation"], r["step"]), []).append(r)
    out = []
    for (act, step), g in sorted(groups.items(), key=lambda kv: (ACTIVATIONS.index(kv[0][0]), kv[0][1])):
        m, se, n = mean_spread([r["activation_ratio"] for r in g])
        out.append({"activation": act, "step": step, "tokens": g[0]["tokens"], "activation_ratio": m,
                    "ratio_se": se, "n": n, **{k: mean_spread([r[k] for r in g])[0]
                                               for k in ("dense_ppl", "cett", "ppl_ratio", "gate_active")}})
    return out


def trend(pts) -> dict:
    """One model's direction with data: Spearman rank correlation of its activation ratio with D
    over all checkpoints and over the later half (after the early transient), the first / last /
    min / max ratio and the moves between adjacent checkpoints."""
    import numpy as np
    D = [r["tokens"] for r in pts]
    A = [r["activation_ratio"] for r in pts]
    h = len(pts) // 2
    steps = np.abs(np.diff(A)) if len(A) > 1 else np.zeros(1)
    return {"spearman": _spearman(D, A), "spearman_late": _spearman(D[h:], A[h:]),
            "first": A[0], "last": A[-1], "min": min(A), "max": max(A),
            "median_step": float(np.median(steps)), "max_step": float(np.max(steps))}


def trends(rows) -> dict:
    """{activation: {statistic: (mean, s.e., n) over seeds}} of ``trend``."""
    per = {}
    for (act, _), pts in runs(rows).items():
        per.setdefault(act, []).append(trend(pts))
    return {a: {k: mean_spread([t[k] for t in ts]) for k in ts[0]} for a, ts in per.items()}


def gate(rows, cett_rows) -> list:
    """The pilot's failures (empty when it passes): a model that did not learn (last dense PPL
    not below 0.8 x the first) or whose CETT search never found a PPL cost (c = 1)."""
    bad = []
    for (act, seed), pts in runs(rows).items():
        if not pts[-1]["dense_ppl"] < 0.8 * pts[0]["dense_ppl"]:
            bad.append(f"{act} seed {seed} did not learn (dense PPL {pts[0]['dense_ppl']:.2f} → "
                       f"{pts[-1]['dense_ppl']:.2f})")
    for c in cett_rows:
        if not c["search_upper"] < 1.0:
            bad.append(f"{c['activation']} seed {c['seed']}: no CETT costs 1% PPL (search ended at c = 1)")
    return bad


def _pmp(t, nd=2):
    """(mean, s.e., n) of a ratio in percent."""
    return f"{100 * t[0]:.{nd}f} ± {100 * t[1]:.{nd}f}%"


def reading(rows, control_rows, cett_rows, fits) -> list:
    """Plain statements of whether the paper's directions hold in these numbers (seed means ±
    standard errors), and how much the per-checkpoint search adds to the noise."""
    tr = trends(rows)
    if not all(a in tr for a in ACTIVATIONS):
        return ["(Both activations are needed for the comparison.)"]
    rl, sl = tr["relu_glu"], tr["swiglu"]
    n = rl["last"][2]
    verdict = lambda ok: "**holds**" if ok else "**does not hold**"  # noqa: E731
    sig = lambda t: abs(t[0]) > 2 * t[1] if t[2] > 1 else None  # noqa: E731
    out = [f"* ReLU-GLU's activation ratio falls with data (paper): "
           f"{verdict(rl['last'][0] < rl['first'][0] and rl['spearman'][0] < 0)} here — "
           f"{_pmp(rl['first'])} at the first checkpoint → {_pmp(rl['last'])} at the last (mean ± s.e. "
           f"over {n} seeds); Spearman ρ(D, A) = {pm(*rl['spearman'][:2], nd=2)} over all checkpoints, "
           f"{pm(*rl['spearman_late'][:2], nd=2)} over the later half."]
    rise = sl["last"][0] >= sl["first"][0] and sl["spearman"][0] >= 0
    late = sig(sl["spearman_late"]) and sl["spearman_late"][0] > 0
    curve = [r for r in mean_rows(rows) if r["activation"] == "swiglu"]
    low = min(curve, key=lambda r: r["activation_ratio"])
    out.append(f"* SiLU-GLU's ratio rises with data (paper): "
               + (verdict(True) if rise else "**holds after an early transient**" if late else verdict(False))
               + f" here — {_pmp(sl['first'])} → {_pmp(sl['last'])}; the seed-mean curve's minimum is "
               f"{100 * low['activation_ratio']:.2f} ± {100 * low['ratio_se']:.2f}% at step {low['step']} "
               f"({low['tokens']:,} tokens); Spearman ρ = {pm(*sl['spearman'][:2], nd=2)} over all checkpoints, "
               f"{pm(*sl['spearman_late'][:2], nd=2)} over the later half"
               + ("" if sig(sl["spearman_late"]) is None else
                  (" (more than 2 s.e. from 0)" if sig(sl["spearman_late"]) else
                   " (within 2 s.e. of 0: no resolved trend late in training)")) + ".")
    pp = lambda t: f"{100 * t[0]:.2f} pp"  # noqa: E731
    out.append(f"* Noise: between adjacent checkpoints the ratio moves by a median {pp(rl['median_step'])} "
               f"for ReLU-GLU and {pp(sl['median_step'])} for SiLU-GLU (mean over seeds).")
    if control_rows:
        ct = trends(control_rows)
        same = trends([r for r in rows if any(r["activation"] == c["activation"] and r["seed"] == c["seed"]
                                              for c in control_rows)])
        out.append("* The per-checkpoint search (control, same models and slice) moves by a median "
                   + ", ".join(f"{pp(ct[a]['median_step'])} for {LABELS[a]} (fixed CETT: "
                               f"{pp(same[a]['median_step'])})" for a in ACTIVATIONS if a in ct) + ".")
    ks = []
    for seed in sorted({r["seed"] for r in rows}):
        last = {r["activation"]: r["activation_ratio"] for r in rows if r["seed"] == seed
                and r["step"] == max(x["step"] for x in rows)}
        if len(last) == 2 and last["relu_glu"] > 0:
            ks.append(last["swiglu"] / last["relu_glu"])
    k = mean_spread(ks)
    out.append(f"* ReLU several times sparser (paper ≈ 5×): SiLU/ReLU activation ratio at the last "
               f"checkpoint = {pm(*k[:2], nd=2)}× — {verdict(k[0] >= 2)} (taking 'several' as ≥ 2×).")
    last_step = max(r["step"] for r in rows)
    ppl = {a: mean_spread([r["dense_ppl"] for r in rows if r["activation"] == a and r["step"] == last_step])
           for a in ACTIVATIONS}
    gap = abs(ppl["relu_glu"][0] / ppl["swiglu"][0] - 1)
    out.append(f"* Comparable dense quality: final validation PPL {pm(*ppl['relu_glu'][:2])} (ReLU-GLU) vs "
               f"{pm(*ppl['swiglu'][:2])} (SiLU-GLU), {gap:.1%} apart — {verdict(gap < 0.05)} (within 5%).")
    if cett_rows and any(c.get("cett_half_a") is not None for c in cett_rows):
        d = [abs(c["cett_half_a"] - c["cett_half_b"]) for c in cett_rows]
        dr = [abs(c["last_ratio_half_a"] - c["last_ratio_half_b"]) for c in cett_rows]
        out.append(f"* Stability of the one CETT per model: the two halves of the slice give CETTs "
                   f"{min(d):.4f}–{max(d):.4f} apart (median {sorted(d)[len(d) // 2]:.4f}), and last-checkpoint "
                   f"activation ratios {100 * min(dr):.2f}–{100 * max(dr):.2f} pp apart.")
    for k, (a, extra) in FIT_KEYS.items():
        bad = fit_problem(fits[k]) if k in fits else ""
        if bad:
            out.append(f"* The {LABELS[a]}{extra} law fit is not usable ({bad}); its A₀ says nothing here.")
        elif k in fits:
            pts = [r["activation_ratio"] for r in mean_rows(rows) if r["activation"] == a]
            edge = min(pts) if a == "relu_glu" else max(pts)
            if abs(fits[k]["A0"] / edge - 1) < 0.01:
                out.append(f"* The {LABELS[a]}{extra} fit puts A₀ = {fits[k]['A0']:.2%} at the "
                           f"{'lowest' if a == 'relu_glu' else 'highest'} measured ratio ({edge:.2%}), the "
                           "bound of its form: the data do not resolve the asymptote, A₀ is "
                           f"{'an upper' if a == 'relu_glu' else 'a lower'} bound on it.")
    return out


def markdown(rows, cett_rows, fits, meta) -> str:
    """DIR/results.md."""
    proto = meta["protocol"]
    main = [r for r in rows if r["protocol"] == proto]
    control = [r for r in rows if r["protocol"] != proto]
    exp = meta["exp"]
    how = (f"one CETT per model, found by bisection (tol {exp['search_tol']:g}, rounded to "
           f"{exp['cett_digits']} decimals) on the mean PPL ratio of its last {exp['last_checkpoints']} "
           "evaluated checkpoints and applied to every checkpoint with that checkpoint's own per-layer "
           "thresholds (the authors' protocol)" if proto == "fixed" else
           f"a CETT-PPL-{exp['p']:g}% search at every checkpoint (tol {exp['tol']:g})")
    lines = ["# Sparsing Law: CETT-PPL-1% activation ratio vs training tokens (ReLU-GLU vs SiLU-GLU)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, seeds {meta['seeds']} (init and "
             f"data order), preset `{meta['preset']}`, {meta['steps']} steps. Time (recorded when each "
             f"piece was computed; {meta['cpus']} CPUs): training {meta['train_seconds'] / 60:.1f} min + "
             f"evaluation {meta['eval_seconds'] / 60:.1f} min for all models; this invocation "
             f"{meta['wall_seconds'] / 60:.1f} min (load average {meta['loadavg']:.1f} at its end).", "",
             f"Models: {meta['model']}; identical except `config.model.mlp.activation` and the seed. Data: "
             f"Shakespeare (byte tokens), train split; D = step × {meta['batch']} rows × {meta['seq_len']} "
             f"tokens. Evaluation on the validation split: CETT-PPL-{exp['p']:g}% (65536-point reference "
             f"grid, per-layer thresholds) on {meta['cett_tokens']:,} tokens, {how}; dense PPL on "
             f"{meta['ppl_tokens']:,} tokens.", ""]
    bad = gate(main, cett_rows)
    lines += ["## Gate", "", ("Passed: every model learns (last dense PPL < 0.8 × first) and a 1% PPL cost "
                              "bounds its CETT." if not bad else
                              "**Failed** — the comparison below is not evidence: " + "; ".join(bad) + "."), ""]
    lines += ["## Activation ratio along training (mean ± s.e. over seeds)", ""]
    lines.append(markdown_table(
        ["activation", "step", "tokens", "dense val PPL", "CETT", "activation ratio", "PPL ratio (slice)",
         "act(gate) ≠ 0", "seeds"],
        [[r["activation"], r["step"], f"{r['tokens']:,}", round(r["dense_ppl"], 3), round(r["cett"], 4),
          f"{100 * r['activation_ratio']:.2f} ± {100 * r['ratio_se']:.2f}%", round(r["ppl_ratio"], 4),
          f"{r['gate_active']:.1%}", r["n"]] for r in mean_rows(main)]))
    lines += ["Activation ratio = fraction of neuron slots (layers × tokens) kept at the thresholds; sparsity = "
              "1 − ratio. PPL ratio = exp(L_sparse − L_dense) on the CETT slice at that CETT: with one CETT per "
              "model a single checkpoint may pay more or less than 1% (the search bounds the mean over "
              "the last ones). `act(gate) ≠ 0` = fraction with a nonzero gate activation before any threshold "
              "(ReLU's natural sparsity; ≈ 100% for SiLU): the most neurons the exact decode-time sparse "
              "path of `icml_jax/models/sparse_ffn.py` has to gather. Every row per seed is in results.csv.", ""]
    if cett_rows:
        lines += ["## The one CETT per model and its stability", ""]
        lines.append(markdown_table(
            ["model", "seed", "searched on steps", "CETT (slice)", "CETT (half A)", "CETT (half B)",
             "last ratio (slice)", "last ratio (A)", "last ratio (B)", "mean PPL ratio"],
            [[c["activation"], c["seed"], c["search_steps"], c["cett_full"], c.get("cett_half_a", ""),
              c.get("cett_half_b", ""), f"{c['last_ratio_full']:.2%}",
              f"{c['last_ratio_half_a']:.2%}" if c.get("last_ratio_half_a") is not None else "",
              f"{c['last_ratio_half_b']:.2%}" if c.get("last_ratio_half_b") is not None else "",
              round(c["mean_ppl_ratio"], 4)] for c in cett_rows]))
        lines += ["Half A / B: the same search on the first / second half of the CETT slice; their "
                  "last-checkpoint ratios are measured on that half.", ""]
    if control:
        lines += ["## Control: a fresh search at every checkpoint (tol "
                  f"{exp['search_tol']:g}, seeds {sorted({r['seed'] for r in control})})", ""]
        lines.append(markdown_table(
            ["activation", "seed", "step", "CETT", "activation ratio", "fixed-CETT ratio"],
            [[r["activation"], r["seed"], r["step"], round(r["cett"], 4), f"{r['activation_ratio']:.2%}",
              next((f"{m['activation_ratio']:.2%}" for m in main if m["activation"] == r["activation"]
                    and m["seed"] == r["seed"] and m["step"] == r["step"]), "")] for r in control]))
    lines += ["## Fitted laws (seed-mean points, D in billions of tokens, as in the paper)", ""]
    frows = []
    for k, (a, extra) in FIT_KEYS.items():
        f = fits.get(k)
        if not f:
            continue
        name = LABELS[a] + (f"{extra} (step {f['from_step']})" if "from_step" in f else extra)
        if "error" in f:
            frows.append([name, "fit failed", "", "", "", "", "", f["error"]])
            continue
        form = "exp(−c·D^α + b) + A₀" if a == "relu_glu" else "−c·D^(−α) + A₀"
        frows.append([name, form, f"{f['alpha']:.3g}", f"{f['b']:.3g}" if "b" in f else "—",
                      f"{f['c']:.3g}", f"{f['A0']:.2%}", f"{f['mae']:.2%}",
                      fit_problem(f) or "yes"])
    lines.append(markdown_table(["model", "law", "α", "b", "c", "A₀", "mean abs error", "of the law's form"],
                                frows))
    lines += ["Paper (0.1B–2.4B models, tens of billions of tokens): ReLU A₀ ≈ 6–8%, SiLU A₀ ≈ 38–41%. The "
              "fits are constrained to the paper's forms (ReLU decreasing towards A₀ < min A, SiLU increasing "
              "towards A₀ > max A), so they cannot show the opposite direction; read the direction from "
              "the measured points and the Spearman ρ below.", "",
              "## Reading", ""] + reading(main, control, cett_rows, fits)
    lines += ["", "Plots: `activation_ratio_vs_tokens.png` (seed means ± s.e., the control's per-checkpoint "
              "searches, fitted laws; log–log), `dense_ppl_vs_tokens.png`.", ""]
    return "\n".join(lines)


def plots(rows, fits, workdir, protocol: str = "fixed") -> None:
    """DIR/activation_ratio_vs_tokens.png (seed means ± s.e. of the ``protocol`` rows, the other
    protocol's rows as faint points, the fitted laws) and DIR/dense_ppl_vs_tokens.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np
    from icml_jax.analysis import sparsity as sp
    colors = {"relu_glu": "tab:blue", "swiglu": "tab:orange"}
    def axes(ax, ylabel, title, percent):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        lo, hi = ax.get_ylim()
        ticks = [v for v in ((0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0) if percent else
                             (2, 3, 5, 7, 10, 15, 20, 30, 50, 100, 200)) if lo <= v <= hi]
        ax.set_yticks(ticks, [f"{v:.0%}" if percent else f"{v:g}" for v in ticks])
        xlo, xhi = ax.get_xlim()
        xt = [m * 10 ** e for e in range(2, 10) for m in (1, 2, 5) if xlo <= m * 10 ** e <= xhi]
        ax.set_xticks(xt, [f"{v / 1e6:g}M" if v >= 1e6 else f"{v / 1e3:g}k" for v in xt])
        ax.set_xlabel("training tokens D")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, fontsize=8)

    means = mean_rows([r for r in rows if r["protocol"] == protocol])
    control = [r for r in rows if r["protocol"] != protocol]
    fig, ax = plt.subplots(figsize=(6.6, 5.0))
    for a in ACTIVATIONS:
        pts = [r for r in means if r["activation"] == a]
        if not pts:
            continue
        D = np.array([r["tokens"] for r in pts], float)
        ax.errorbar(D, [r["activation_ratio"] for r in pts], yerr=[r["ratio_se"] for r in pts], fmt="o",
                    color=colors[a], capsize=3, label=f"{LABELS[a]} ({protocol} CETT; mean ± s.e., "
                                                      f"{pts[0]['n']} seeds)")
        cp = [r for r in control if r["activation"] == a]
        if cp:
            ax.plot([r["tokens"] for r in cp], [r["activation_ratio"] for r in cp], "x", color=colors[a],
                    alpha=0.5, label=f"{LABELS[a]} (search at each checkpoint, seed(s) "
                                     f"{sorted({r['seed'] for r in cp})})")
        for k in (k for k, (fa, _) in FIT_KEYS.items() if fa == a):
            f = fits.get(k, {})
            if not f or "error" in f:
                continue
            lo = next((r["tokens"] for r in pts if r["step"] == f.get("from_step")), D.min())
            grid = np.geomspace(lo, D.max(), 200)
            y = (sp.relu_law(grid / 1e9, f["alpha"], f["b"], f["c"], f["A0"]) if a == "relu_glu"
                 else sp.silu_law(grid / 1e9, f["alpha"], f["c"], f["A0"]))
            ok = not fit_problem(f)
            note = "" if ok else " (flagged, see results.md)"
            ax.plot(grid, y, ("-" if ok else "--") if "from_step" not in f else "-.", color=colors[a], lw=1.5,
                    label=f"{LABELS[a]} law fit{FIT_KEYS[k][1]}, A₀ = {f['A0']:.1%}{note}")
            if ok and 0 < f["A0"] <= 1:
                ax.axhline(f["A0"], color=colors[a], ls=":", lw=1)
    ratios = [r["activation_ratio"] for r in means + control]
    ax.set_yscale("log")
    ax.set_ylim(min(ratios) / 1.6, min(1.0, max(ratios) * 1.6))
    axes(ax, "CETT-PPL-1% activation ratio",
         "Activation ratio vs training tokens (lines: fitted laws; dotted: A₀)", True)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "activation_ratio_vs_tokens.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.6, 4.6))
    for a in ACTIVATIONS:
        pts = [r for r in means if r["activation"] == a]
        if pts:
            ax.plot([r["tokens"] for r in pts], [r["dense_ppl"] for r in pts], "o-", color=colors[a],
                    label=f"{LABELS[a]} (mean over seeds)")
    ax.set_yscale("log")
    axes(ax, "dense validation perplexity", "Dense validation perplexity vs training tokens", False)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "dense_ppl_vs_tokens.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
