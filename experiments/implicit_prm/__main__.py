"""Implicit PRM on the arithmetic testbed: best-of-N and first-error detection (docs/methods/implicit_prm.md).

  python -m experiments.implicit_prm --workdir=DIR [--preset=tiny|default|easy]

Steps, per seed of the preset's ``seeds`` (default: its ``seed``; one seed works in DIR, several
in DIR/seed_<s>, each with its own problems, generator, samples and PRMs). Every stage is cached
under that folder with a key of everything it depends on, so a rerun with the same settings
recomputes nothing and a killed run resumes:

1. **Problems and generator.** ``icml_jax.data.arithmetic.make_splits`` (the preset's knobs) gives
   the generator's corpus problems (train split) and the held-out test problems. The generator is
   a byte-level LM (``configs/lm.py``, data ``jsonl``) trained on ``sft_corpus`` (30% of the
   solutions carry one injected, propagating arithmetic slip), in ``DIR/generator``.
2. **Outcome-labelled data.** ``responses`` samples (T = 1.0) for each of the first
   ``prm_problems`` training problems, labelled ONLY by ``check_solution(...).answer_correct``
   (the per-step labels are never computed for these samples). CE data ``DIR/ce_m<M>.jsonl``:
   every (prompt, completion, label) of the first M samples per problem, for each M of
   ``ce_responses``; DPO data ``DIR/dpo_pairs.jsonl``: per problem, its i-th correct sample paired
   with its i-th incorrect sample (min(#correct, #incorrect) pairs).
3. **Implicit PRMs**, initialised from the generator (= the frozen reference): CE
   (``configs/implicit_prm.py``, beta = 0.05) per M, and DPO (``configs/dpo.py``, sigmoid,
   beta = 0.05) on the pairs of all ``responses`` samples, in ``DIR/prm_<name>``. The upper
   bound: a **step-label PRM** (``configs/step_prm.py``, TRL's PRMTrainer recipe) on the same
   samples with the checker's step labels (``DIR/steps.jsonl``; the last step also needs the
   right answer), from the generator with the CE schedule or the preset's ``step_prm`` override
   of it (``easy``: 300 steps at lr 1e-3), in ``DIR/prm_steps``; the only stage
   that sees a step label.
4. **Evaluation samples.** ``eval_samples`` samples (T = 1.0) per held-out problem; the checker
   gives the answer, its correctness and the true first error (evaluation only).
5. **Scoring.** Per response and PRM: token log-ratios l_t = log pi_PRM - log pi_gen from the first
   response token (``first_response_index``), step ends ``step_end_token_indices`` (steps tile
   the response, so sum_k r_k = q_K), and with ``icml_jax.losses.implicit_prm``: ``min r_k``
   (the reference's default: single/min), ``min q_k`` and ``sum q_k`` (accumulative),
   ``q_K = sum r_k`` (outcome only: the implicit ORM's reward), and weighted majority voting
   with sigma(kappa * min r_k) for kappa = beta (the training scale) and the reference's 0.001.
   The step-label PRM: ``min p_k`` and ``prod p_k`` of its per-step probabilities.
   Baselines: random pick (the expected accuracy of a uniform pick = mean correctness of the n),
   majority vote over the answers, the generator's own log-prob, and pass@n (an oracle, an upper
   bound). Best-of-N over each problem's first n samples (``best_of_n``), averaged over
   ``orders`` random orders of the 32 samples (the same orders for every selector); the mean
   length (bytes) of the response each selector picks, beside.
6. **First-error detection** (ProcessBench rule, ``predict_first_error``): first k with
   sigma(beta * q_k) < tau; tau chosen (grid of 1001 values) on the eval responses of the
   even-indexed test problems, F1 (harmonic mean of the accuracy on erroneous and on error-free
   responses) reported on the odd-indexed ones. kappa = beta, not the reference's 0.001: at 0.001
   every sigma is within 0.01 of 0.5 for these short responses and the 0.01 tau grid cannot
   separate them.

Writes DIR/config.json, DIR/results.csv (one row per selector, N and seed), DIR/results.md (cells:
mean ± s.e. over the seeds when there are several), DIR/best_of_n.png, DIR/first_error_f1.png.
"""
import argparse
import os
import sys

import ml_collections
import numpy as np

from experiments.common import digest, stopwatch, write_json
from experiments.implicit_prm import stages
from experiments.implicit_prm.presets import PRESETS, record
from experiments.implicit_prm.report import (best_of_n_table, first_error_table, means, per_seed,
                                             run_info, write_outputs)
from experiments.implicit_prm.stages import problems  # noqa: F401  (notebooks/implicit_prm_quickstart)
from icml_jax import xla_env


def run(exp, workdir, timing):
    """Every stage of one seed in order (each cached under ``workdir``); returns {"table",
    "lengths", "ranking", "first_error", "prm_names", "info"}."""
    from icml_jax.data import arithmetic as ar
    from icml_jax.data.tokenizers import build_tokenizer
    elapsed = stopwatch()
    train, test = stages.problems(exp)
    gen_dir, gen = stages.build_generator(exp, workdir, train)
    timing["generator"] = elapsed()
    gen_key = digest(gen["key"])
    policy = stages.LazyPolicy(gen_dir)

    prm_problems = train[: int(exp["prm_problems"])]
    prompts = [ar.prompt_text(p) for p in prm_problems]
    elapsed = stopwatch()
    groups = stages.sample_stage(exp, workdir, policy, gen_key, prompts, exp["responses"],
                                 int(exp["seed"]) * 1000 + 1, "train")
    labels = stages.label_train(prm_problems, groups)
    timing["sample_train"] = elapsed()
    paths, n_pairs = stages.prm_datasets(exp, workdir, prompts, groups, labels)
    if exp.get("step_prm", True):  # the upper bound: the same samples with the checker's step labels
        paths["steps"] = stages.step_dataset(workdir, prm_problems, prompts, groups)
    tok = build_tokenizer(ml_collections.ConfigDict(gen["key"]["config"]["data"]["tokenizer"]))
    seq_len = stages.seq_len_for(exp, tok, prompts + [ar.prompt_text(p) for p in test])
    elapsed = stopwatch()
    prm_names, prm_info, prm_cfgs, prm_dirs = stages.train_prms(exp, workdir, gen_dir, gen, paths,
                                                                seq_len)
    timing["prm_train"] = elapsed()

    elapsed = stopwatch()
    eval_prompts = [ar.prompt_text(p) for p in test]
    eval_groups = stages.sample_stage(exp, workdir, policy, gen_key, eval_prompts,
                                      exp["eval_samples"], int(exp["seed"]) * 1000 + 2, "eval")
    ev = stages.label_eval(test, eval_groups)
    timing["sample_eval"] = elapsed()

    elapsed = stopwatch()
    sc = stages.score_stage(exp, workdir, policy, eval_prompts, eval_groups, seq_len, prm_names,
                            prm_info, prm_dirs)
    timing["score"] = elapsed()
    M = np.array(sc["step_mask"], np.int32)
    implicit = [n for n in prm_names if n != stages.STEP_PRM]
    prm_scores = [(n, np.array(sc["q_raw"][n]), M) for n in implicit]
    step_scores = [(n, np.array(sc["step_logit"][n]), M) for n in sc["step_logit"]]
    nbytes = np.array([len(r.encode()) for g in eval_groups for r in g], np.float64)
    table, lengths, diag = best_of_n_table(exp, test, ev, prm_scores, np.array(sc["ref_sum"]),
                                           step_scores, nbytes)
    fe = first_error_table(exp, ev, prm_scores, step_scores)
    info = run_info(gen_dir, gen, labels, n_pairs, ev, prm_info, prm_cfgs, seq_len, paths, nbytes)
    return {"table": table, "lengths": lengths, "ranking": diag, "first_error": fe,
            "prm_names": prm_names, "info": info}


def main(argv=None):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description="Implicit PRM on the arithmetic testbed")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    a = p.parse_args(argv)
    elapsed = stopwatch()
    exp = PRESETS[a.preset].copy_and_resolve_references()  # a copy: the run never edits PRESETS
    os.makedirs(a.workdir, exist_ok=True)
    seeds = [int(s) for s in exp.get("seeds", (exp.seed,))]
    runs, timing = {}, {}
    for seed in seeds:  # one seed: its stages in DIR; several: in DIR/seed_<s>
        e = exp.copy_and_resolve_references()
        e.seed = seed
        wd = a.workdir if len(seeds) == 1 else os.path.join(a.workdir, f"seed_{seed}")
        os.makedirs(wd, exist_ok=True)
        t = timing if len(seeds) == 1 else timing.setdefault(f"seed_{seed}", {})
        runs[seed] = run(e, wd, t)
    seconds = elapsed()
    timing["total"] = seconds
    info = runs[seeds[0]]["info"] if len(seeds) == 1 else {
        f"seed_{s}": r["info"] for s, r in runs.items()}
    # "experiment": the preset as config.json has always held it (flat train.* keys, its order)
    write_json(os.path.join(a.workdir, "config.json"),
               {"preset": a.preset, "experiment": record(exp), "info": info, "timing": timing})
    write_outputs(a.workdir, exp, a.preset, argv, runs, seconds)
    stages.log(f"done in {seconds:.1f} s; results in {a.workdir}/results.md")
    table = means(per_seed(runs, "table"))
    fe = means(per_seed(runs, "first_error"))
    prm_names = runs[seeds[0]]["prm_names"]
    ns = sorted(table["random pick"])
    for s, res in table.items():
        stages.log(f"  {s:45s} " + " ".join(f"{res[n]:.3f}" for n in ns))
    for n in prm_names:
        stages.log(f"  first-error F1 {n}: {fe[n]['f1']:.3f}")
    return {"table": table, "first_error": fe, "prm_names": prm_names, "info": info,
            "runs": runs}


if __name__ == "__main__":
    main(sys.argv[1:])
