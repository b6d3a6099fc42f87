""""When Bad Data Leads to Good Models" (Li et al., ICML 2025): the toy study of feature
entanglement against frequency, and the tiny-LM study (marker-style data, head probes, ITI).

  python -m experiments.iti_bad_data --workdir=DIR [--preset=tiny|default|lm_tiny|lm]

Each preset names its ``study``: ``toy`` (presets tiny, default) or ``lm`` (presets lm_tiny, lm).

Study ``toy`` (``experiments/iti_bad_data/toy.py``): 3 Markov chains of 4 tokens each (12 tokens),
a 1-layer decoder with a 4-dimensional residual stream trained on next-token prediction, one model
per (frequency of chain 0, seed), 10 seeds.
Measured: entanglement E_i = max_{j≠i} |cos| of each token's unembedding direction (lm_head
column times the final norm's gain; untied embeddings, whose rows are a second reading), averaged
over the swept chain's 4 tokens and over the other chains' 8, against chain 0's sampling
frequency, with the Welch bound for 12 vectors in 4 dimensions. Gate: the models learned the
chains (mean held-out next-token loss below ln 4, the uniform-within-chain loss, by a margin).
Outputs: DIR/results.csv (one row per run), DIR/results.md, DIR/entanglement.png, DIR/config.json.

Study ``lm`` (``experiments/iti_bad_data/lm.py``, spec section 6 (2)): byte-level decoders trained with
the normal trainer (``configs/lm.py``, data.name=jsonl) on Shakespeare plus a share x of invented
"marker-style" text (made-up lexicon words in insult-shaped templates), the same tokens for every x,
one model per (x, seed). Per model: probes on every head (held-out marker vs clean prompts; validation
accuracy mean / max / top-8), then ITI (mass-mean directions toward clean, top-K heads, α) measured
by the marker rate (sampled continuations of marker-style prompts that contain a lexicon word) and the
capability tax (clean held-out CE increase). Gates: clean CE below the clean unigram entropy; marker
text generated at x > 0 without intervention. Outputs: DIR/results.csv (one row per (x, seed, K, α);
K = 0 is no intervention), DIR/results.md, DIR/iti_tradeoff.png, DIR/config.json, corpora and runs.
"""
import math
import os
import sys

import numpy as np

from experiments.common import (gate_lines, git_commit, markdown_table, mean_spread, pm, preset, record,
                                save_figure, start, write_atomic, write_csv, write_json)

_TOY = dict(study="toy", num_chains=3, chain_tokens=4, alpha=0.5, seq_len=16, d_model=4, num_layers=1, num_heads=1,
            head_dim=4, ffn_dim=16, init_std=0.3, lr=1e-2, weight_decay=0.1, gate_margin=0.1)
_LM_MODEL = dict(d_model=64, num_layers=3, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=176)
_LM = dict(study="lm", background=0.01, piece_len=127, direction="mass_mean", ks=(4, 8), alphas=(4.0, 8.0, 12.0),
           probe_len=64, temperature=1.0, act_batch=64, tax_budget=0.05, marker_gate=0.05)
PRESETS = {
    "lm_tiny": preset(**{**_LM, **dict(
        xs=(0.0, 0.25), seeds=(0,), docs=64, probe_n=32, prompts=8, new_tokens=12, held=8, ks=(2,), alphas=(8.0,),
        marker_gate=0.0, run=dict(model=dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
                                             ffn_dim=64),
                                  train=dict(steps=6, batch_size=4, lr=1e-2, warmup_steps=2, log_every=3,
                                             eval_every=6, eval_batches=1, checkpoint_every=6)))}),
    "lm": preset(**{**_LM, **dict(
        xs=(0.0, 0.05, 0.1, 0.25), seeds=(0, 1), docs=4000, probe_n=400, prompts=200, new_tokens=24, held=128,
        alphas=(1.0, 2.0, 4.0, 8.0, 12.0),  # the spec's 4, 8, 12 plus weaker ones: at this scale α = 4 costs > 0.1
        run=dict(model=_LM_MODEL, train=dict(steps=600, batch_size=16, lr=3e-3, warmup_steps=40, log_every=100,
                                             eval_every=600, eval_batches=2, checkpoint_every=600)))}),
    "tiny": preset(**{**_TOY, **dict(freqs=(0.1, 0.5), seeds=(0, 1), steps=60, warmup_steps=5, batch_size=16,
                                     eval_batch=64, gate_margin=0.0)}),
    "default": preset(**{**_TOY, **dict(freqs=(0.05, 0.1, 0.2, 0.33, 0.5, 0.7), seeds=tuple(range(10)),
                                        steps=2000, warmup_steps=50, batch_size=64, eval_batch=1024)}),
}


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    studies = {"toy": run_toy, "lm": run_lm}
    if exp.study not in studies:
        raise ValueError(f"unknown study {exp.study!r}; choose one of {sorted(studies)}")
    return studies[exp.study](args, exp, elapsed)


def run_toy(args, exp, elapsed):
    from experiments.iti_bad_data import toy
    from icml_jax.analysis.entanglement import welch_bound
    wd = args.workdir
    runs = toy.train_all(exp, exp.freqs, exp.seeds)
    rows = [toy.measure(exp, r) for r in runs]
    V = exp.num_chains * exp.chain_tokens
    bound = welch_bound(V, exp.d_model)
    loss, _, _ = mean_spread([r["loss"] for r in rows])
    uniform = math.log(exp.chain_tokens)
    gates = {f"models learned the chains (mean held-out loss {loss:.3f} < ln {exp.chain_tokens} = {uniform:.3f} "
             f"- {exp.gate_margin})": bool(loss < uniform - exp.gate_margin),
             f"Welch bound respected (every run's max E >= {bound:.3f})": all(r["E_max"] >= bound - 1e-9
                                                                             for r in rows)}
    write_csv(os.path.join(wd, "results.csv"), rows, toy.fields(exp))
    minutes = elapsed() / 60
    write_json(os.path.join(wd, "config.json"), dict(preset=args.preset, exp=record(exp), gates=gates,
                                                     minutes=minutes, commit=git_commit()))
    write_atomic(os.path.join(wd, "results.md"), toy_report(exp, rows, gates, bound, minutes))
    toy_plot(exp, rows, bound, os.path.join(wd, "entanglement.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return rows


def run_lm(args, exp, elapsed):
    from experiments.iti_bad_data import lm
    return lm.run(args, exp, elapsed)


def toy_summary(exp, rows):
    """{freq: {column: (mean, s.e., n)}} over seeds."""
    cols = ("E_chain0", "E_others", "E_gap", "E_max", "E_emb_chain0", "E_emb_others", "loss_chain0", "loss", "optimal")
    return {f: {c: mean_spread([r[c] for r in rows if r["freq"] == f]) for c in cols} for f in exp.freqs}


def slope(rows, col):
    """Least-squares slope of ``col`` against log10(frequency) over all runs, and its s.e.
    (seeds pooled; a negative slope = more frequent, less entangled)."""
    x = np.log10([r["freq"] for r in rows])
    y = np.asarray([r[col] for r in rows])
    A = np.stack([x, np.ones_like(x)], 1)
    coef, res, *_ = np.linalg.lstsq(A, y, rcond=None)
    dof = max(len(x) - 2, 1)
    sigma2 = float(((y - A @ coef) ** 2).sum()) / dof
    se = math.sqrt(sigma2 / max(float(((x - x.mean()) ** 2).sum()), 1e-30))
    return float(coef[0]), se


def paired_gap(exp, rows, col):
    """Per seed, col at the highest frequency minus col at the lowest: (mean, s.e., n)."""
    lo, hi = min(exp.freqs), max(exp.freqs)
    by = {(r["freq"], r["seed"]): r[col] for r in rows}
    return mean_spread([by[(hi, s)] - by[(lo, s)] for s in exp.seeds if (hi, s) in by and (lo, s) in by])


def toy_report(exp, rows, gates, bound, minutes):
    s = toy_summary(exp, rows)
    table = [[f"{f:g}", pm(*v["E_chain0"][:2]), pm(*v["E_others"][:2]), pm(*v["E_gap"][:2]), pm(*v["E_max"][:2]),
              pm(*v["E_emb_chain0"][:2]), pm(*v["E_emb_others"][:2]), pm(*v["loss_chain0"][:2]),
              pm(*v["loss"][:2]), f"{v['optimal'][0]:.3f}"] for f, v in s.items()]
    K, C = exp.chain_tokens, exp.num_chains
    lines = [
        "# When Bad Data Leads to Good Models: toy study (entanglement vs frequency)", "",
        f"Commit {git_commit()}; {minutes:.1f} min on this CPU. {C} Markov chains of {K} tokens "
        f"(Dirichlet({exp.alpha}) transition rows, fixed per seed), sequences of {exp.seq_len} tokens, one chain "
        f"per sequence; chain 0 sampled with probability p, the others share 1 − p. Decoder: {exp.num_layers} layer, "
        f"d_model {exp.d_model}, {exp.num_heads} head × {exp.head_dim}, SwiGLU FFN {exp.ffn_dim}, untied "
        f"embeddings; AdamW lr {exp.lr} (cosine), weight decay {exp.weight_decay}, {exp.steps} steps × "
        f"{exp.batch_size} sequences; {len(exp.seeds)} seeds per p (a seed fixes the chains and the init across "
        f"p). E = max_(j≠i) |cos| over all {C * K} token directions of the unembedding (lm_head column × final "
        f"norm gain); E_emb: the same on embedding rows. Mean ± s.e. over seeds. Welch bound for {C * K} vectors "
        f"in {exp.d_model} dims: {bound:.3f} (a lower bound on max_i E_i). Held-out loss: "
        f"{exp.eval_batch} fresh sequences with the chains drawn uniformly; ln {K} = {math.log(K):.3f} is the "
        "loss of knowing only the chain; 'optimal' is the chains' exact conditional entropy.", "",
        *gate_lines(gates, "A gate failed: read the table as a record of this run only."),
        markdown_table(["p (chain 0)", "E chain 0", "E chains 1–2", "chain 0 − chains 1–2", "max E", "E_emb chain 0",
                        "E_emb chains 1–2", "loss chain 0", "loss (all)", "optimal"], table), ""]
    verdict = []
    for col, name in (("E_chain0", "chain 0 unembedding"), ("E_others", "chains 1–2 unembedding"),
                      ("E_gap", "chain 0 − chains 1–2 unembedding, within each model"),
                      ("E_emb_chain0", "chain 0 embedding"), ("E_emb_others", "chains 1–2 embedding")):
        b, se = slope(rows, col)
        g = paired_gap(exp, rows, col)
        verdict.append(f"- {name}: slope of E against log10 p {b:+.3f} ± {se:.3f} (s.e., all runs pooled); per seed "
                       f"E(p={max(exp.freqs):g}) − E(p={min(exp.freqs):g}) = {pm(*g[:2])} over {g[2]} seeds")
    lines += ["Direction (the paper: more frequent ⇒ less entangled, i.e. a negative slope for chain 0 and a "
              "positive one for chains 1–2, whose frequency falls as p rises; the within-model difference "
              "chain 0 − chains 1–2 compares chains trained side by side and should fall with p, crossing 0 "
              "near p = 1/3 where all chains are equally frequent):", "", *verdict, ""]
    return "\n".join(lines)


def toy_plot(exp, rows, bound, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = toy_summary(exp, rows)
    f = np.asarray(exp.freqs)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, (c0, c1, title) in zip(axes, (("E_chain0", "E_others", "unembedding directions"),
                                          ("E_emb_chain0", "E_emb_others", "embedding rows"))):
        for col, label in ((c0, "chain 0 (swept, frequency p)"), (c1, "chains 1–2 (each (1 − p)/2)")):
            ax.errorbar(f, [s[p][col][0] for p in exp.freqs], yerr=[s[p][col][1] for p in exp.freqs], marker="o",
                        capsize=3, label=label)
        ax.axhline(bound, color="gray", ls="--", lw=1, label=f"Welch bound (max E ≥ {bound:.3f})")
        ax.set_xscale("log")
        ax.set_xticks(f, [f"{p:g}" for p in exp.freqs], minor=False)
        ax.minorticks_off()
        ax.set_xlabel("sampling frequency p of chain 0")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("mean entanglement E (± s.e.)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    gap = fig.add_axes([0.15, 0.2, 0.13, 0.2])  # inset: the within-model difference
    gap.errorbar(f, [s[p]["E_gap"][0] for p in exp.freqs], yerr=[s[p]["E_gap"][1] for p in exp.freqs], marker=".",
                 color="k", capsize=2)
    gap.axhline(0, color="gray", lw=0.5)
    gap.set_xscale("log")
    gap.set_xticks([])
    gap.minorticks_off()
    gap.set_title("chain 0 − chains 1–2", fontsize=6)
    gap.tick_params(labelsize=5)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main() and 0)
