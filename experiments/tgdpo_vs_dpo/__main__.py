"""TGDPO vs DPO from one SFT start, judged by a gold reward (docs/methods/tgdpo.md).

  python -m experiments.tgdpo_vs_dpo --workdir=DIR [--preset=tiny|default|additive_tiny|additive]
      [--testbed=TESTBED_DIR]

``--testbed`` (default ``DIR/testbed``) is the shared preference testbed
(``experiments/preference_testbed.py``, at the preset of the same name): a byte-level SFT policy
on Shakespeare and gold-scored sample groups, gold = VADER compound sentiment of the continuation.

Steps:

1. **Pairs.** For each ``tgdpo_train`` prompt (5 SFT samples at T = 0.8) chosen = the gold-best,
   rejected = the gold-worst sample; groups whose samples all tie are skipped (counted).
   Validation pairs: the same rule on the SFT reference samples of the held-out ``tgdpo_eval``
   prompts. Both are written as TRL JSONL into DIR.
2. **Guidance policy pi_r.** DPO (sigmoid, beta = 0.1) from the SFT start on these pairs, with its
   own data-order seed (``guidance_seed``).
3. **Main runs.** From the same SFT start, on the same pairs, for the same steps and lr: DPO
   (``config.loss.type=sigmoid``, i.e. alpha = 0) and TGDPO (``tgdpo``, each alpha of
   ``alphas``) guided by pi_r, one run per data-order seed of ``seeds``.
4. **Evaluation** of each policy (and of the SFT policy itself, as a calibration row) on the
   held-out ``tgdpo_eval`` prompts: ``eval_samples`` samples per prompt at T = 0.8
   (``preference_testbed.sample_groups``, the same sampling seed for every policy);

   * win rate vs SFT: per prompt, every (policy sample, SFT reference sample) pair scores 1 if the
     policy's gold is higher, 0.5 on a tie, 0 otherwise; averaged over pairs, then prompts;
   * mean gold reward of the samples;
   * KL to the reference: the Monte-Carlo sequence-level estimate on the policy's own samples,
     mean over samples of sum over response tokens (eos included when the sample stopped) of
     log pi(y_t|s_t) - log pi_ref(y_t|s_t), both at temperature 1. The samples are drawn at
     T = 0.8, so this is the expected log-ratio under the sampling distribution (the usual
     "KL on samples" diagnostic), not exactly KL(pi || pi_ref);
   * TGDPO vs DPO head-to-head: the same pairwise rule between the TGDPO and the DPO policy of
     the same seed.

Every run trains through ``train_and_evaluate`` in ``DIR/<run>/`` (metrics.jsonl with the training
curves, checkpoints; a killed run resumes) and its digest (training curves, eval samples and
metrics) is cached in ``DIR/<run>/result.json`` under a key of everything it depends on, so a rerun
with the same settings recomputes nothing. A changed training config wipes that run's folder
first (so a stale checkpoint is never resumed under new settings).

Writes DIR/config.json, DIR/pairs_train.jsonl, DIR/pairs_eval.jsonl, DIR/results.csv (one row per
run), DIR/results.md, DIR/win_rate_vs_kl.png and DIR/training_curves.png.

**The additive world** (presets ``additive_tiny``, ``additive``: a ``world`` section instead of
``testbed``): the testbed is ``experiments/additive_testbed.py`` (an SFT policy imitating the
Markov chain of ``icml_jax/data/additive_gold.py``, gold = the sum of known per-letter rewards).
There the guidance pi_r is trained on pairs of the ``guidance_train`` prompts, disjoint from the
policies' ``tgdpo_train`` prompts (``DIR/pairs_guidance.jsonl``); the main runs cover alpha in
``alphas`` (0 = the DPO run) x beta in ``betas`` per seed; the report (``report_additive.py``)
draws the win-rate-vs-KL frontier of each alpha over beta, compares TGDPO with DPO's frontier at
matched KL, and correlates pi_r's token rewards with the true ones (``DIR/reward_recovery.json``);
results.md says so when the pilot does not beat SFT instead of interpreting the comparison.

Code: ``presets.py`` (the presets), ``stages.py`` (pairs, configs, training, evaluation, per-token
analysis), ``report.py`` (results.csv / results.md / plots); this file is the driver.
"""
import argparse
import json
import os
import sys

from experiments import preference_testbed
from experiments.common import stopwatch, write_json
from experiments.tgdpo_vs_dpo.presets import PRESETS, is_additive, saved_experiment
from experiments.tgdpo_vs_dpo.report import CSV_FIELDS, summary_lines, write_outputs
from experiments.tgdpo_vs_dpo.stages import (cached_reward_recovery, cached_token_analysis,
                                             make_pairs, per_prompt_win, planned_configs, run_all,
                                             win_rate)
from icml_jax import xla_env

__all__ = ["CSV_FIELDS", "PRESETS", "main", "per_prompt_win", "win_rate"]


def main(argv=None):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        description="TGDPO vs DPO on the sentiment testbed or the token-additive world")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--testbed", default="", help="testbed folder (default: WORKDIR/testbed)")
    a = p.parse_args(argv)
    elapsed = stopwatch()
    exp = PRESETS[a.preset]
    os.makedirs(a.workdir, exist_ok=True)
    tb_dir = a.testbed or os.path.join(a.workdir, "testbed")
    additive = is_additive(exp)
    if additive:
        from experiments.additive_testbed import build_additive_testbed
        tb = build_additive_testbed(tb_dir, exp.world.to_dict())
    else:
        tb = preference_testbed.build_testbed(tb_dir, preference_testbed.preset_dict(exp.testbed))
    t_tb = elapsed()
    pairs = make_pairs(tb, a.workdir, guidance_part="guidance_train" if additive else None)
    print(f"[tgdpo_vs_dpo] {pairs['n_train']} train pairs ({pairs['n_tied_train']} tied groups "
          f"skipped), {pairs['n_eval']} validation pairs", flush=True)
    # "experiment": the preset as the plain dict it was before the ConfigDicts (same bytes)
    write_json(os.path.join(a.workdir, "config.json"), {
        "preset": a.preset, "experiment": saved_experiment(exp), "testbed": tb_dir,
        "pairs": dict(pairs), "runs": planned_configs(exp, tb, pairs, a.workdir)})
    results = run_all(exp, tb, pairs, a.workdir, log=lambda *m: print(*m, flush=True))
    ta = cached_token_analysis(exp, tb, pairs, a.workdir, results)
    rr = cached_reward_recovery(exp, tb, pairs, a.workdir, results) if additive else None
    seconds = elapsed()
    timing_path = os.path.join(a.workdir, "timing.json")
    old = {}
    if os.path.exists(timing_path):
        with open(timing_path) as f:
            old = json.load(f)
    longest = max(seconds, old.get("longest_invocation_seconds",
                                   old.get("seconds_this_invocation", 0.0)))
    if additive:
        from experiments.tgdpo_vs_dpo import report_additive
        stats = report_additive.write_outputs(a.workdir, exp, a.preset, argv, tb, pairs, results,
                                              (seconds, longest), ta, rr)
        lines = report_additive.summary_lines(stats)
    else:
        stats = write_outputs(a.workdir, exp, a.preset, argv, tb, pairs, results,
                              (seconds, longest), ta)
        lines = summary_lines(stats)
    write_json(timing_path, {"seconds_this_invocation": seconds,
                             "longest_invocation_seconds": longest,
                             "testbed_seconds_this_invocation": t_tb,
                             "testbed_measured": tb["seconds"]})
    print(f"[tgdpo_vs_dpo] done in {seconds:.1f} s; results in {a.workdir}/results.md")
    for line in lines:
        print(line)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
