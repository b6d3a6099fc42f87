"""MASS (Li et al., ICML 2025) at tiny scale: skill-graph data selection on a synthetic arithmetic pool.

  python -m experiments.mass --workdir=DIR [--preset=tiny|default]

A mixed-quality target pool (``icml_jax/data/mass.py``): clean step-by-step arithmetic solutions
drawn mostly from easy one-step +/- problems, the same with one arithmetic slip (noisy), string
puzzles in the same ``Problem:/Answer:`` layout and prose (both off-skill). A small clean reference set
of the target distribution (every skill) is tagged by rules; its skill graph (PageRank node weights,
co-occurrence edges) and the mean-pooled last-layer states of a tiny LM trained on the whole pool
(the embedder) give each pool document its MASS score. Arms, each a byte-level decoder trained with
the normal trainer (``data.select_scores`` / ``data.select_ratio`` pick the subset):

  full       the whole pool, S steps
  random     a random x% of the pool, S steps (equal tokens)
  mass       the MASS top x%, S steps (equal tokens)
  filter     control: a random x% of the rows the rule tagger tags with any skill (drops off-skill)
  full_more  the whole pool, S / x steps (more tokens)

Metric: exact match of the greedy solution's ``Answer:`` on held-out problems of the target
distribution, overall and by skill; mean ± standard error over seeds. Gate: the full-pool arm's
exact match is above ``em_floor``. Controls: each selection's share of clean / noisy / off-skill rows
and its skill mix. Outputs: DIR/results.csv (one row per run), DIR/selections.csv,
DIR/results.md, DIR/exact_match.png, DIR/config.json, corpora, scores and runs.
"""
import os

import numpy as np

from experiments.common import git_commit, preset, record, start, write_csv, write_json

_MODEL = dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=192, max_seq_len=256)
_BASE = dict(data_seed=0, shares=dict(noisy=0.2, string=0.2, prose=0.2), keep_ratio=0.5,
             node_weight="pagerank", score_agg="weighted_sum", damping=0.85, embedder_seed=100,
             embed_len=128, new_tokens=64, eval_batch=100, arms=("full", "random", "mass", "filter", "full_more"))
PRESETS = {
    "tiny": preset(**{**_BASE, **dict(
        pool_n=120, ref_n=30, test_n=16, seeds=(0,), embedder_steps=0, em_floor=0.0, new_tokens=8,
        eval_batch=16, arms=("full", "mass"),  # the tests: two trainings
        run=dict(model=dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64,
                            max_seq_len=128),
                 data=dict(seq_len=64),
                 train=dict(steps=4, batch_size=4, lr=1e-2, warmup_steps=1, log_every=2, eval_every=4,
                            eval_batches=1, checkpoint_every=4)))}),
    "default": preset(**{**_BASE, **dict(
        pool_n=12000, ref_n=400, test_n=400, seeds=(0, 1, 2), embedder_steps=150, em_floor=0.05,
        run=dict(model=_MODEL, data=dict(seq_len=128),
                 train=dict(steps=300, batch_size=16, lr=1e-2, warmup_steps=30, log_every=100, eval_every=400,
                            eval_batches=1, checkpoint_every=400)))}),
}


def main(argv=None):
    from experiments.mass import report, stages
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    wd = args.workdir
    pool, ref, test = stages.corpora(exp)
    corpus = os.path.join(wd, "pool.jsonl")
    stages.write_jsonl(corpus, [r.text for r in pool])
    texts = stages.train_split(stages.run_config(exp, corpus, 0))
    kind_of = {r.text: r.kind for r in pool}
    paths, graph = stages.selection_scores(exp, wd, corpus, texts, [r.text for r in ref])
    from icml_jax.data import mass
    sel = []
    chosen = mass.top_fraction(mass.read_scores(paths["mass"]), exp.keep_ratio)
    for key, path in paths.items():
        keep = mass.top_fraction(mass.read_scores(path), exp.keep_ratio)
        sel.append(dict(selection=key, **stages.composition(texts, keep, kind_of, chosen)))
    sel.append(dict(selection="full", **stages.composition(texts, np.arange(len(texts)), kind_of, chosen)))
    rows, samples = stages.train_and_score(exp, wd, corpus, paths, test)
    full = [r["em"] for r in rows if r["arm"] == "full"]
    gates = {f"full pool learns the arithmetic (mean exact match {np.mean(full):.3f} > {exp.em_floor:g})":
             bool(np.mean(full) > exp.em_floor)}
    meta = dict(preset=args.preset, commit=git_commit(), minutes=elapsed() / 60, graph=graph, samples=samples,
                train_docs=len(texts), test_skill_counts={s: int(sum(s in mass.tag_skills(r.text) for r in test))
                                                          for s in mass.SKILLS})
    write_csv(os.path.join(wd, "results.csv"), rows, list(rows[0]))
    write_csv(os.path.join(wd, "selections.csv"), sel, list(sel[0]))
    write_json(os.path.join(wd, "config.json"), dict(exp=record(exp, ("run",)), meta=meta, gates=gates))
    report.write(wd, exp, rows, sel, gates, meta)
    print(f"done in {meta['minutes']:.1f} min; results in {wd}/results.md")


if __name__ == "__main__":
    main()
