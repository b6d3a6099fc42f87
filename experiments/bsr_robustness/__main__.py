"""Reward-model robustness: Bradley-Terry vs BT + BSR on the gold-scored preference testbed.

  python -m experiments.bsr_robustness --workdir=DIR [--preset=tiny|default|additive_tiny|additive]
      [--testbed=TESTBED]

(``additive*``: the token-additive gold world of icml_jax/data/additive_gold.py instead of the
sentiment testbed; reward models from scratch, no SFT policy; see docs/methods/bsr.md.)

The small-scale reproduction of docs/methods/bsr.md (Hong et al., ICML 2025). Steps:

1. ``experiments.preference_testbed.build_testbed(TESTBED, PRESETS[preset.testbed])`` (TESTBED
   defaults to DIR/testbed; pass a shared build to reuse it): the SFT policy and its gold-scored
   groups (gold = VADER compound sentiment of the continuation).
2. Training pairs from the ``train`` groups, validation pairs from ``val_in`` (both with
   ``pairs_from_groups(rule=preset.pair_rule, min_gap=preset.min_gap)``: every untied pair
   of a group, the gold-higher one chosen), written to DIR/pairs_train.jsonl, DIR/pairs_val_in.jsonl.
3. Proxy reward models (``configs/reward_model.py``, the SFT decoder as backbone via
   ``train.init_from``, a fresh score head) for every arm of the preset and every seed (the seed
   sets the data order and the score-head init; the backbone start is the same SFT policy):
   ``bt`` (bsr_lambda = 0), ``bsr`` (bsr_lambda = 1e-3 scaled by the per-device batch, the
   paper's/reference setting) and, in ``default``, ``bsr_1e-2`` (a 10x stronger lambda, not the
   paper's setting). Same pairs, steps, lr and schedule for every arm.
4. Every response of the val_in / val_response_ood / val_prompt_ood / val_both_ood and ``bon``
   groups is scored by each model (reward and final hidden-state norm at the scoring token).
   Metrics: val_in pair accuracy; mean per-prompt Kendall tau vs gold per split; dispersion
   (std of rewards and of hidden norms over the val_in responses, and the reward std over the
   union of the four val splits); best-of-N on ``bon`` (gold of the proxy's pick, N = 1..64, with
   the KL bound log N - (N-1)/N), beside the oracle (gold as proxy) and a random pick.

Each (arm, seed) trains in DIR/runs/<arm>_s<seed>_<config hash>/ (a killed run resumes; a changed
config gets a fresh folder) and its scores are cached in result.json there, keyed by the run
config and a digest of the data, so a rerun with the same settings recomputes nothing.

Writes DIR/config.json, DIR/results.csv (one row per run, seed and metric), DIR/results.md,
DIR/best_of_n.png, DIR/kendall_tau.png and DIR/dispersion.png.

Code: ``presets.py`` (the presets, ConfigDicts), ``stages.py`` (testbed and pairs, configs,
training, scoring, metrics), ``report.py`` (results.csv, config.json, results.md, plots); this
file parses the flags and runs the stages.
"""
import argparse
import os
import sys

from experiments.bsr_robustness import report, stages
from experiments.bsr_robustness.presets import ARMS, presets, saved_experiment
from experiments.common import stopwatch
from icml_jax import xla_env


def main(argv=None) -> dict:
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    exps = presets()
    p = argparse.ArgumentParser(description="BT vs BT+BSR reward-model robustness (docs/methods/bsr.md)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(exps))
    p.add_argument("--testbed", default="", help="testbed folder (default: WORKDIR/testbed)")
    p.add_argument("--seeds", default="", help="comma-separated seeds (default: the preset's)")
    p.add_argument("--arms", default="", help=f"comma-separated arms of {sorted(ARMS)}")
    p.add_argument("--steps", type=int, default=0, help="reward-model steps (default: the preset's)")
    p.add_argument("--lr", type=float, default=0.0, help="reward-model peak lr (default: the preset's)")
    a = p.parse_args(argv)
    run_seconds = stopwatch()

    exp = exps[a.preset]
    try:
        if a.seeds:
            exp.seeds = tuple(int(x) for x in a.seeds.split(","))
            exp.arm_seeds = {}  # every arm on the given seeds
    except ValueError:
        p.error(f"--seeds={a.seeds!r}: give comma-separated integers, e.g. --seeds=0,1")
    if a.arms:
        exp.arms = tuple(a.arms.split(","))
        if not set(exp.arms) <= set(ARMS):
            p.error(f"--arms={a.arms!r}: choose from {sorted(ARMS)}")
    if a.steps:
        exp.train.train.steps = a.steps
    if a.lr:
        exp.train.train.lr = a.lr
    wd = os.path.abspath(a.workdir)
    tb_dir = os.path.abspath(a.testbed or os.path.join(wd, "testbed"))

    data = stages.prepare(wd, tb_dir, exp)
    arms, seeds = tuple(exp.arms), tuple(int(s) for s in exp.seeds)
    results, configs = stages.train_runs(wd, exp, data)
    metrics, curves = {}, {}
    for k, res in results.items():
        metrics[k], curves[k] = stages.run_metrics(res, data["groups"], exp)
    refs = stages.reference_bon(data["groups"], exp)
    agg = stages.aggregate(metrics, exp)

    report.write_results_csv(wd, metrics, refs)
    stats = report.write_config(wd, a.preset, saved_experiment(exp), tb_dir, data, configs)
    report.write_plots(wd, exp, arms, curves, refs, agg, results)
    cmd = f"python -m experiments.bsr_robustness --workdir={a.workdir} --preset={a.preset}" + "".join(
        f" --{k}={v}" for k, v in (("testbed", a.testbed), ("seeds", a.seeds), ("arms", a.arms),
                                   ("steps", a.steps), ("lr", a.lr)) if v)
    md = report.write_results_md(wd, preset_name=a.preset, cmd=cmd, exp=exp, arms=arms,
                                 seeds=seeds, tb_dir=tb_dir, data=data, stats=stats,
                                 results=results, agg=agg, refs=refs, run_seconds=run_seconds)
    print(md)
    return {"metrics": metrics, "agg": agg, "refs": refs, "results": results}


if __name__ == "__main__":
    main(sys.argv[1:])
