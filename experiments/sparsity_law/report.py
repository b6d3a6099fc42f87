"""experiments/sparsity_law, the report: whether a law fit is of the law's form, the trend of the
activation ratio with data, the generated ``reading`` statements, results.md and the plots."""
import os

from experiments.common import markdown_table

ACTIVATIONS = ("relu_glu", "swiglu")
LABELS = {"relu_glu": "ReLU-GLU", "swiglu": "SiLU-GLU (SwiGLU)"}
# results.csv columns (one row per activation x checkpoint)
FIELDS = ("activation", "step", "tokens", "dense_ppl", "cett_slice_ppl_dense", "cett_slice_ppl_sparse",
          "ppl_ratio", "cett", "activation_ratio", "sparsity", "gate_active", "thresholds")


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


def trend(pts) -> dict:
    """Direction of the ratio with data: Spearman rank correlation with D over all points, and over
    the second half of the log-spaced checkpoints (after the early transient)."""
    import numpy as np

    def spearman(x, y):
        if len(x) < 3:
            return float("nan")
        rx, ry = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
        return float(np.corrcoef(rx, ry)[0, 1])

    D = [r["tokens"] for r in pts]
    A = [r["activation_ratio"] for r in pts]
    h = len(pts) // 2
    steps = np.abs(np.diff(A)) if len(A) > 1 else np.zeros(1)
    return {"spearman": spearman(D, A), "spearman_late": spearman(D[h:], A[h:]),
            "first": A[0], "last": A[-1], "min": min(A), "max": max(A),
            "median_step": float(np.median(steps)), "max_step": float(np.max(steps))}


def reading(rows, fits) -> list:
    """Plain statements of whether the paper's four directions hold in these numbers."""
    by = {a: [r for r in rows if r["activation"] == a] for a in ACTIVATIONS}
    if not all(by.values()):
        return ["(Both activations are needed for the comparison.)"]
    tr = {a: trend(by[a]) for a in ACTIVATIONS}
    rl, sl = tr["relu_glu"], tr["swiglu"]
    out = []
    verdict = lambda ok: "**holds**" if ok else "**does not hold**"  # noqa: E731
    out.append(f"* ReLU-GLU's activation ratio falls with data (paper): {verdict(rl['last'] < rl['first'] and rl['spearman'] < 0)} "
               f"here — {rl['first']:.2%} at the first checkpoint → {rl['last']:.2%} at the last "
               f"(min {rl['min']:.2%}, max {rl['max']:.2%}); Spearman ρ(D, A) = {rl['spearman']:+.2f} over all "
               f"checkpoints, {rl['spearman_late']:+.2f} over the later half.")
    out.append(f"* SiLU-GLU's ratio rises or saturates (paper): {verdict(sl['last'] >= sl['first'] and sl['spearman'] >= 0)} "
               f"here — {sl['first']:.2%} → {sl['last']:.2%} (min {sl['min']:.2%}, max {sl['max']:.2%}); "
               f"Spearman ρ = {sl['spearman']:+.2f}, later half {sl['spearman_late']:+.2f}.")
    pp = lambda x: f"{100 * x:.1f} pp"  # noqa: E731
    out.append(f"* Noise: between adjacent checkpoints the ratio moves by a median {pp(rl['median_step'])} "
               f"(max {pp(rl['max_step'])}) for ReLU-GLU and {pp(sl['median_step'])} (max {pp(sl['max_step'])}) "
               "for SiLU-GLU; trends smaller than that are not resolved by this measurement.")
    k = sl["last"] / rl["last"] if rl["last"] > 0 else float("inf")
    out.append(f"* ReLU several times sparser (paper ≈ 5×): SiLU/ReLU activation ratio at the last "
               f"checkpoint = {k:.1f}× — {verdict(k >= 2)} (taking 'several' as ≥ 2×).")
    pr, ps = by["relu_glu"][-1]["dense_ppl"], by["swiglu"][-1]["dense_ppl"]
    out.append(f"* Comparable dense quality: final validation PPL {pr:.3f} (ReLU-GLU) vs {ps:.3f} "
               f"(SiLU-GLU), {abs(pr / ps - 1):.1%} apart — {verdict(abs(pr / ps - 1) < 0.05)} (within 5%).")
    for a in ACTIVATIONS:
        bad = fit_problem(fits[a]) if a in fits else ""
        if bad:
            out.append(f"* The {LABELS[a]} law fit is not usable ({bad}); its A₀ says nothing here.")
    return out


def markdown(rows, fits, meta) -> str:
    """DIR/results.md."""
    lines = ["# Sparsing Law: CETT-PPL-1% activation ratio vs training tokens (ReLU-GLU vs SiLU-GLU)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, seed {meta['seed']} (init and "
             f"data order, both models), preset `{meta['preset']}`, {meta['steps']} steps. Time (recorded "
             f"when each piece was computed; {meta['cpus']} CPUs shared with other jobs): training "
             f"{meta['train_seconds'] / 60:.1f} min + CETT-PPL evaluation {meta['eval_seconds'] / 60:.1f} "
             f"min for both models; this invocation {meta['wall_seconds'] / 60:.1f} min (load average "
             f"{meta['loadavg']:.1f} at its end).", "",
             f"Models: {meta['model']}; identical except `config.model.mlp.activation`. Data: Shakespeare "
             f"(byte tokens), train split; D = step × {meta['batch']} rows × {meta['seq_len']} tokens. "
             f"Evaluation on the validation split: CETT-PPL-{meta['p']:g}% (tol {meta['tol']:g}, 65536-point "
             f"reference grid, per-layer thresholds) on {meta['cett_tokens']:,} token slots; dense PPL "
             f"on {meta['ppl_tokens']:,}.", "",
             "## Measurements", ""]
    header = ["activation", "step", "tokens", "dense val PPL", "CETT", "activation ratio", "sparsity",
              "PPL ratio (slice)", "act(gate) ≠ 0"]
    lines.append(markdown_table(header, [
        [r["activation"], r["step"], f"{r['tokens']:,}", round(r["dense_ppl"], 3), round(r["cett"], 4),
         f"{r['activation_ratio']:.2%}", f"{r['sparsity']:.2%}", round(r["ppl_ratio"], 4),
         f"{r['gate_active']:.1%}"] for r in rows]))
    lines += ["Activation ratio = fraction of neuron slots (layers × tokens) kept at the CETT-PPL-1% "
              "thresholds. `act(gate) ≠ 0` = fraction with a nonzero gate activation before any threshold "
              "(ReLU's natural sparsity; ≈ 100% for SiLU): the most neurons the exact decode-time sparse "
              "path of `icml_jax/models/sparse_ffn.py` has to gather.", ""]
    lines += ["## Fitted laws (D in billions of tokens, as in the paper)", ""]
    frows = []
    for a in ACTIVATIONS:
        f = fits.get(a)
        if not f:
            continue
        if "error" in f:
            frows.append([LABELS[a], "fit failed", "", "", "", "", "", f["error"]])
            continue
        form = "exp(−c·D^α + b) + A₀" if a == "relu_glu" else "−c·D^(−α) + A₀"
        frows.append([LABELS[a], form, f"{f['alpha']:.3g}", f"{f['b']:.3g}" if "b" in f else "—",
                      f"{f['c']:.3g}", f"{f['A0']:.2%}", f"{f['mae']:.2%}",
                      fit_problem(f) or "yes"])
    lines.append(markdown_table(["model", "law", "α", "b", "c", "A₀", "mean abs error", "of the law's form"],
                                frows))
    lines += ["Paper (0.1B–2.4B models, tens of billions of tokens): ReLU A₀ ≈ 6–8%, SiLU A₀ ≈ 38–41%. The "
              "fits are constrained to the paper's forms (ReLU decreasing towards A₀ < min A, SiLU increasing "
              "towards A₀ > max A), so they cannot show the opposite direction; read the direction from "
              "the measured points and the Spearman ρ below.", "",
              "## Reading", ""] + reading(rows, fits)
    lines += ["", "Plots: `activation_ratio_vs_tokens.png` (points and fitted laws, log–log), "
              "`dense_ppl_vs_tokens.png`.", ""]
    return "\n".join(lines)


def plots(rows, fits, workdir) -> None:
    """DIR/activation_ratio_vs_tokens.png and DIR/dense_ppl_vs_tokens.png."""
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

    fig, ax = plt.subplots(figsize=(6.6, 5.0))
    for a in ACTIVATIONS:
        pts = [r for r in rows if r["activation"] == a]
        if not pts:
            continue
        D = np.array([r["tokens"] for r in pts], float)
        ax.plot(D, [r["activation_ratio"] for r in pts], "o", color=colors[a], label=f"{LABELS[a]} (measured)")
        f = fits.get(a, {})
        if f and "error" not in f:
            grid = np.geomspace(D.min(), D.max(), 200)
            y = (sp.relu_law(grid / 1e9, f["alpha"], f["b"], f["c"], f["A0"]) if a == "relu_glu"
                 else sp.silu_law(grid / 1e9, f["alpha"], f["c"], f["A0"]))
            ok = not fit_problem(f)
            note = "" if ok else " (flagged, see results.md)"
            ax.plot(grid, y, "-" if ok else "--", color=colors[a], lw=1.5,
                    label=f"{LABELS[a]} law fit, A₀ = {f['A0']:.1%}{note}")
            if 0 < f["A0"] <= 1:
                ax.axhline(f["A0"], color=colors[a], ls=":", lw=1)
    ratios = [r["activation_ratio"] for r in rows]
    ax.set_yscale("log")
    ax.set_ylim(min(ratios) / 1.6, min(1.0, max(ratios) * 1.6))
    axes(ax, "CETT-PPL-1% activation ratio",
         "Activation ratio vs training tokens (lines: fitted laws; dotted: A₀)", True)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "activation_ratio_vs_tokens.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.6, 4.6))
    for a in ACTIVATIONS:
        pts = [r for r in rows if r["activation"] == a]
        if pts:
            ax.plot([r["tokens"] for r in pts], [r["dense_ppl"] for r in pts], "o-", color=colors[a],
                    label=LABELS[a])
    ax.set_yscale("log")
    axes(ax, "dense validation perplexity", "Dense validation perplexity vs training tokens", False)
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "dense_ppl_vs_tokens.png"), dpi=120, bbox_inches="tight")
    plt.close(fig)
