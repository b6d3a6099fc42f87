"""Sparsing Law at CPU scale: CETT-PPL-1% activation ratio of ReLU-GLU vs SiLU-GLU along training.

  python -m experiments.sparsity_law --workdir=runs/sparsity_law [--preset=tiny|default]
      [--activations=relu_glu,swiglu] [--steps=N] [--seed=S]

Each activation trains ``configs/sparsity.py:PRESET`` with only ``config.model.mlp.activation``
changed (same init seed, data order, schedule and steps) through ``train_and_evaluate`` in
``DIR/<activation>/``, keeping a checkpoint every ``config.train.checkpoint_every`` steps. A
log-spaced subset of those checkpoints (``eval_points`` of them, first and last included) is
loaded back with orbax and evaluated on the Shakespeare validation split:
  * CETT-PPL-p% (``icml_jax.analysis.sparsity.cett_ppl_search``, p = 1, tol 1e-6, the reference's
    threshold grid) on a held-out slice of ``cett_batches`` x ``cett_batch_size`` rows: the
    activation ratio (fraction of neuron slots not zeroed, over layers and tokens) at the largest
    shared target CETT whose sparse perplexity stays below 1.01 x the dense one;
  * dense validation perplexity on ``ppl_batches`` x ``ppl_batch_size`` rows (a larger slice).
Tokens seen D = step x batch_size x seq_len (packed rows). The ReLU law
A = exp(-c D^a + b) + A0 is fitted to the ReLU-GLU points and the SiLU law A = -c D^-a + A0 to
the SwiGLU points (``fit_relu_law`` / ``fit_silu_law``, D in billions of tokens as the paper).

Resumes: training resumes from its checkpoints, a finished run is not retrained (its
``train.json``), and each evaluated checkpoint's result is cached in
``DIR/<activation>/eval/step_<N>.json``. A workdir made with another preset or config stops with
an error instead of mixing runs.

Writes DIR/config.json, DIR/results.csv (one row per activation x checkpoint), DIR/results.md,
DIR/activation_ratio_vs_tokens.png and DIR/dense_ppl_vs_tokens.png; per run the trainer's
metrics.jsonl, TensorBoard events and checkpoints.
"""
import argparse
import json
import math
import os
import sys
import time

from experiments.common import cached, git_commit, markdown_table, write_atomic, write_csv, write_json
from icml_jax import xla_env

PRESETS = {
    # evaluated checkpoints, CETT slice, dense-PPL slice, CETT-PPL-p% settings
    "tiny": dict(eval_points=5, cett_batches=2, cett_batch_size=4, ppl_batches=2, ppl_batch_size=8,
                 p=1.0, tol=1e-6),
    "default": dict(eval_points=9, cett_batches=2, cett_batch_size=8, ppl_batches=8, ppl_batch_size=16,
                    p=1.0, tol=1e-6),
}
ACTIVATIONS = ("relu_glu", "swiglu")
LABELS = {"relu_glu": "ReLU-GLU", "swiglu": "SiLU-GLU (SwiGLU)"}
FIELDS = ("activation", "step", "tokens", "dense_ppl", "cett_slice_ppl_dense", "cett_slice_ppl_sparse",
          "ppl_ratio", "cett", "activation_ratio", "sparsity", "gate_active", "thresholds")


def eval_steps(steps: int, every: int, points: int) -> list:
    """``points`` log-spaced checkpoint steps from ``every`` to ``steps`` (multiples of ``every``,
    deduplicated, the last step always included)."""
    import numpy as np
    if steps < every:
        raise ValueError(f"train.steps={steps} is below train.checkpoint_every={every}: no checkpoint "
                         "to evaluate before the last")
    raw = np.geomspace(every, steps, points)
    out = sorted({min(steps, max(every, int(round(s / every)) * every)) for s in raw} | {steps})
    return out


def check_workdir(path: str, meta: dict) -> None:
    """Stops when DIR/config.json was written for another preset / config (one line)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    for k in ("preset", "base_config", "exp"):
        if old.get(k) != meta[k]:
            what = (f"preset {old.get('preset')!r}" if k == "preset" else f"a different {k}")
            raise SystemExit(f"error: {path} holds results from {what} (this run: preset "
                             f"{meta['preset']!r}); use another --workdir or delete that one")


def load_params(ckpt_dir: str, step: int):
    """The params of checkpoint ``step`` (restored without a target: plain arrays)."""
    import orbax.checkpoint as ocp
    from icml_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(ckpt_dir, keep=1_000_000, async_save=False)
    try:
        if step not in ck.all_steps():
            raise FileNotFoundError(f"checkpoint {step} is missing from {ckpt_dir} (have "
                                    f"{ck.all_steps()}); delete {os.path.dirname(ckpt_dir)} to retrain")
        state = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return state["state"]["params"]
    finally:
        ck.close()


def evaluate_checkpoint(cfg, params, cett_batches, ppl_batches, exp) -> dict:
    from icml_jax.analysis import sparsity as sp
    from icml_jax.models import build_model
    model = build_model(cfg.model)
    t0 = time.time()
    r = sp.cett_ppl_search(model, params, cett_batches, p=exp["p"], tol=exp["tol"])
    dense_ppl = math.exp(sp.dense_loss(model, params, ppl_batches))
    return {"dense_ppl": dense_ppl, "cett_slice_ppl_dense": r["ppl_dense"],
            "cett_slice_ppl_sparse": r["ppl_sparse"], "ppl_ratio": r["ppl_ratio"], "cett": r["cett"],
            "activation_ratio": r["activation_ratio"], "sparsity": r["sparsity"],
            "thresholds": [float(t) for t in r["thresholds"]], "iterations": r["iterations"],
            "eval_seconds": time.time() - t0}


def gate_active(cfg, params, cett_batches) -> dict:
    """Share of (token, neuron) slots with act(gate) != 0 on the CETT slice: for ReLU-GLU the most
    neurons the exact decode-time sparse path (``models/sparse_ffn.py``) can have to gather."""
    import numpy as np
    from icml_jax.analysis import sparsity as sp
    from icml_jax.models import build_model
    model = build_model(cfg.model)
    nz = tot = 0
    for b in cett_batches:
        for g, _ in sp.collect_gate_up(model, params, b):
            nz, tot = nz + int(np.count_nonzero(g)), tot + g.size
    return {"gate_active": nz / tot}


def run_activation(cfg, run_dir, exp, steps, batches):
    """Trains (or resumes) one model, evaluates its checkpoints; returns (train info, rows)."""
    from icml_jax.train.trainer import train_and_evaluate
    key = {"config": json.loads(cfg.to_json_best_effort())}

    def train():
        t0 = time.time()
        s = train_and_evaluate(cfg, run_dir)
        return {"train_seconds": time.time() - t0, "final_loss": s.get("loss"),
                "eval_loss": s.get("eval_loss"), "params": s.get("params")}

    info = dict(cached(os.path.join(run_dir, "train.json"), key, train), eval_seconds=0.0)
    rows = []
    for step in steps:
        ev = cached(os.path.join(run_dir, "eval", f"step_{step:06d}.json"), {**key, "exp": exp, "step": step},
                    lambda: evaluate_checkpoint(cfg, load_params(os.path.join(run_dir, "checkpoints"),
                                                                 step), *batches, exp))
        ga = cached(os.path.join(run_dir, "eval", f"gate_{step:06d}.json"), {**key, "exp": exp, "step": step},
                    lambda: gate_active(cfg, load_params(os.path.join(run_dir, "checkpoints"), step),
                                        batches[0]))
        info["eval_seconds"] += ev["eval_seconds"]
        tokens = step * cfg.train.batch_size * cfg.data.seq_len
        rows.append({"activation": cfg.model.mlp.activation, "step": step, "tokens": tokens,
                     **{k: ev[k] for k in FIELDS if k in ev}, "gate_active": ga["gate_active"]})
        print(f"{cfg.model.mlp.activation} step {step} ({tokens:,} tokens): activation ratio "
              f"{ev['activation_ratio']:.4f} (CETT {ev['cett']:.4f}), dense PPL {ev['dense_ppl']:.3f}",
              flush=True)
    return info, rows


def fit_laws(rows) -> dict:
    """{activation: fit dict or {"error": ...}} with D in billions of tokens."""
    from icml_jax.analysis import sparsity as sp
    out = {}
    for act, fit in (("relu_glu", sp.fit_relu_law), ("swiglu", sp.fit_silu_law)):
        pts = [r for r in rows if r["activation"] == act]
        if not pts:
            continue
        try:
            out[act] = fit([r["tokens"] / 1e9 for r in pts], [r["activation_ratio"] for r in pts])
        except (ValueError, RuntimeError, FloatingPointError) as e:
            out[act] = {"error": f"{type(e).__name__}: {e}"}
    return out


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


def main(argv=None):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="Sparsing Law: activation ratio vs tokens, ReLU-GLU vs SiLU-GLU")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--activations", default=",".join(ACTIVATIONS))
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    p.add_argument("--seed", type=int, default=None, help="override config.seed")
    a = p.parse_args(argv)
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, make_eval_batches

    t_start = time.time()
    acts = tuple(x for x in a.activations.split(",") if x)
    bad = [x for x in acts if x not in ACTIVATIONS]
    if bad or not acts:
        raise SystemExit(f"error: --activations takes a subset of {list(ACTIVATIONS)}, got {a.activations!r}")
    exp = dict(PRESETS[a.preset])
    base = load_config(f"configs/sparsity.py:{a.preset}", unlocked=True)
    if a.steps:
        base.train.steps = a.steps
    if a.seed is not None:
        base.seed = a.seed
    t = base.train
    steps = eval_steps(t.steps, t.checkpoint_every, exp["eval_points"])
    if t.steps // t.checkpoint_every > t.keep_checkpoints:
        raise SystemExit(f"error: {t.steps // t.checkpoint_every} checkpoints would be written but only "
                         f"train.keep_checkpoints={t.keep_checkpoints} kept; the evaluated ones would be lost")
    meta_cfg = {"preset": a.preset, "activations": list(acts), "exp": exp, "eval_steps": steps,
                "base_config": json.loads(base.to_json_best_effort())}
    os.makedirs(a.workdir, exist_ok=True)
    check_workdir(os.path.join(a.workdir, "config.json"), meta_cfg)
    write_json(os.path.join(a.workdir, "config.json"), meta_cfg)
    tok = build_tokenizer(base.data.tokenizer)
    L = base.data.seq_len
    batches = tuple(make_eval_batches(base.data, tok, split="validation", seq_len=L, batch_size=bs,
                                      max_batches=nb)
                    for nb, bs in ((exp["cett_batches"], exp["cett_batch_size"]),
                                   (exp["ppl_batches"], exp["ppl_batch_size"])))
    rows, infos = [], {}
    for act in acts:
        cfg = load_config(f"configs/sparsity.py:{a.preset}", unlocked=True)
        cfg.update_from_flattened_dict({"train.steps": t.steps, "seed": base.seed})
        cfg.model.mlp.activation = act
        print(f"=== {act} ===", flush=True)
        infos[act], r = run_activation(cfg, os.path.join(a.workdir, act), exp, steps, batches)
        rows += r
    fits = fit_laws(rows)
    out_rows = [{**r, "thresholds": " ".join(f"{x:.6g}" for x in r["thresholds"])} for r in rows]
    write_csv(os.path.join(a.workdir, "results.csv"), out_rows, FIELDS)
    write_json(os.path.join(a.workdir, "fits.json"), fits)
    m = base.model
    meta = {"command": "python -m experiments.sparsity_law " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "seed": base.seed, "preset": a.preset, "steps": t.steps,
            "wall_seconds": time.time() - t_start, "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "train_seconds": sum(i["train_seconds"] for i in infos.values()),
            "eval_seconds": sum(i["eval_seconds"] for i in infos.values()),
            "batch": t.batch_size, "seq_len": L, "p": exp["p"], "tol": exp["tol"],
            "cett_tokens": exp["cett_batches"] * exp["cett_batch_size"] * L,
            "ppl_tokens": exp["ppl_batches"] * exp["ppl_batch_size"] * L,
            "model": f"{m.num_layers} layers, d_model {m.d_model}, d_ff {m.ffn_dim} (gated), {m.num_heads} "
                     f"heads of {m.head_dim}, RoPE, {infos[acts[0]].get('params') or 0:,} params; AdamW lr "
                     f"{t.lr}, {t.warmup_steps} warmup steps then constant, batch {t.batch_size} × {L}"}
    write_atomic(os.path.join(a.workdir, "results.md"), markdown(rows, fits, meta))
    plots(rows, fits, a.workdir)
    print(open(os.path.join(a.workdir, "results.md")).read())
    return {"rows": rows, "fits": fits, "infos": infos}


if __name__ == "__main__":
    main()
