"""results.md and exact_match.png of the MASS study from its rows (``stages.train_and_score``) and the
selections' composition (``stages.composition``)."""
from __future__ import annotations

import os

import numpy as np

from experiments.common import gate_lines, markdown_table, mean_spread, pm, save_figure, write_atomic
from icml_jax.data import mass

LABELS = {"full": "full pool", "random": "random x%", "mass": "MASS x%", "filter": "rule filter x% (control)",
          "full_more": "full pool, more tokens"}


def _arms(rows):
    return [a for a in LABELS if any(r["arm"] == a for r in rows)]


def _col(rows, arm, key):
    return [r[key] for r in rows if r["arm"] == arm]


def paired(rows, a, b):
    """Mean ± se over seeds of arm a's exact match minus arm b's (same seed)."""
    ea = {r["seed"]: r["em"] for r in rows if r["arm"] == a}
    eb = {r["seed"]: r["em"] for r in rows if r["arm"] == b}
    return mean_spread([ea[s] - eb[s] for s in ea if s in eb], "se")


def reading(exp, rows, sel):
    x = f"{exp.keep_ratio:.0%}"
    out = []
    comp = {s["selection"]: s for s in sel}
    for a, b, what in (("mass", "random", f"MASS {x} vs random {x} at equal tokens"),
                       ("mass", "full", "MASS vs the full pool at equal tokens"),
                       ("mass", "filter", "MASS vs the rule filter (off-skill rows dropped, rest random)"),
                       ("mass", "full_more", f"MASS vs the full pool with {1 / exp.keep_ratio:g}x the tokens")):
        m, se, n = paired(rows, a, b)
        if n:
            out.append(f"- {what}: exact match difference {pm(m, se)} (paired by seed, n = {n}).")
    if "mass" in comp and "random_0" in comp:
        out.append(f"- Clean-row control: the MASS selection is {comp['mass']['share_clean']:.0%} clean rows and "
                   f"{comp['mass']['share_noisy']:.0%} rows with a slip ({comp['mass']['token_share_arith']:.0%} of its "
                   f"tokens arithmetic); a random selection {comp['random_0']['share_clean']:.0%} / "
                   f"{comp['random_0']['share_noisy']:.0%} ({comp['random_0']['token_share_arith']:.0%}); the rule "
                   f"filter {comp.get('filter', {}).get('share_clean', float('nan')):.0%} / "
                   f"{comp.get('filter', {}).get('share_noisy', float('nan')):.0%}. The pool: "
                   f"{comp['full']['share_clean']:.0%} / {comp['full']['share_noisy']:.0%}.")
    if "mass" in comp and "filter" in comp:
        ratios = {k: comp["mass"][f"skill_{k}"] / comp["filter"][f"skill_{k}"] for k in mass.SKILLS
                  if comp["filter"][f"skill_{k}"] > 0}
        lo, hi = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
        out.append(f"- Skill mix against the rule filter (both keep only arithmetic rows): MASS keeps "
                   f"`{lo}` documents at {ratios[lo]:.2f}x the filter's share ({comp['mass'][f'skill_{lo}']:.1%} "
                   f"vs {comp['filter'][f'skill_{lo}']:.1%}) and `{hi}` at {ratios[hi]:.2f}x "
                   f"({comp['mass'][f'skill_{hi}']:.1%} vs {comp['filter'][f'skill_{hi}']:.1%}).")
    return out


def write(wd, exp, rows, sel, gates, meta):
    arms = _arms(rows)
    skills = [s for s in mass.SKILLS if meta["test_skill_counts"].get(s)]
    header = ["arm", "tokens / run", "exact match"] + [f"{s} (n={meta['test_skill_counts'][s]})" for s in skills]
    table = []
    for a in arms:
        cells = [LABELS[a], f"{_col(rows, a, 'tokens')[0]:,}", pm(*mean_spread(_col(rows, a, "em"), "se")[:2])]
        cells += [pm(*mean_spread(_col(rows, a, f"em_{s}"), "se")[:2], nd=2) for s in skills]
        table.append(cells)
    sel_header = ["selection", "docs", "overlap with MASS", "clean", "noisy (slip)", "string (off-skill)",
                  "prose (off-skill)", "arith. token share"] + list(mass.SKILLS)
    sel_rows = [[s["selection"], s["docs"], f"{s['overlap_mass']:.3f}", f"{s['share_clean']:.3f}",
                 f"{s['share_noisy']:.3f}", f"{s['share_string']:.3f}", f"{s['share_prose']:.3f}",
                 f"{s['token_share_arith']:.3f}"]
                + [f"{s[f'skill_{k}']:.2f}" for k in mass.SKILLS] for s in sel]
    g = meta["graph"]
    graph_rows = [[s, int(c), f"{w:.3f}"] for s, c, w in zip(g["skills"], g["counts"], g["weights"])]
    lines = [
        "# MASS at tiny scale: skill-graph selection on a synthetic arithmetic pool", "",
        f"Preset `{meta['preset']}`, commit `{meta['commit']}`, {meta['minutes']:.1f} min for this invocation "
        f"(cached runs are reused; the arms' training took {sum(r['train_s'] for r in rows) / 60:.1f} min in "
        "all when they ran). "
        f"Pool: {exp.pool_n} documents ({meta['train_docs']} in the train split), shares "
        f"{dict(exp.shares)} (the rest clean); reference set {exp.ref_n} clean documents; {exp.test_n} held-out "
        f"test problems; keep ratio x = {exp.keep_ratio:g}; node weights `{exp.node_weight}`, score "
        f"`{exp.score_agg}`; seeds {list(exp.seeds)}. Exact match = the greedy solution's `Answer:` "
        "equals the true answer; mean ± standard error over seeds.", "",
        *gate_lines(gates, "The pilot gate failed: the full-pool baseline did not learn the arithmetic above "
                           "the floor, so the arm comparison below is not informative."),
        "## Exact match by arm and test skill", "",
        markdown_table(header, table),
        "## Reading (generated from the numbers)", "", *reading(exp, rows, sel), "",
        "## What each selection kept (train split of the pool)", "",
        "Shares of documents by kind; skill columns: share of kept documents carrying the tag. "
        "`mass_frequency`, `mass_weighted_max` and `mass_uniform` (every skill weight 1/K) are the same "
        "embeddings scored with other settings: selections only, not trained. Overlap = share of a "
        "selection's documents that the MASS selection also keeps.", "",
        markdown_table(sel_header, sel_rows),
        "## Skill graph of the reference set", "",
        markdown_table(["skill", "reference documents", "weight"], graph_rows),
        "![exact match](exact_match.png)", "",
    ]
    write_atomic(os.path.join(wd, "results.md"), "\n".join(lines))
    plot(wd, rows, arms, skills)


def plot(wd, rows, arms, skills):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = ["em"] + [f"em_{s}" for s in skills]
    names = ["all"] + skills
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(arms)
    for i, a in enumerate(arms):
        stats = [mean_spread(_col(rows, a, c), "se") for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, [s[0] for s in stats], width,
               yerr=[s[1] for s in stats], label=LABELS[a], capsize=2)
    ax.set_xticks(np.arange(len(cols)) + width * (len(arms) - 1) / 2)
    ax.set_xticklabels(names, rotation=20)
    ax.set_ylabel("exact match (mean ± se over seeds)")
    ax.set_title("held-out arithmetic, by test skill")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(wd, "exact_match.png"))
