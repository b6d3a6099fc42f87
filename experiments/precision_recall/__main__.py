"""NLL + temperature scaling vs precision-recall losses, with exact precision and recall.

  python -m experiments.precision_recall --workdir=runs/pr [--preset=tiny|default|markov] [--steps=N]

Source (docs/methods/precision_recall.md), chosen by the preset's ``source.kind``:

* ``zipf`` (``tiny``, ``default``): N distinct random strings with Zipf probabilities
  (``icml_jax.data.zipf_source``), so the corpus sees the head often and the tail a few times or
  never, and nothing about a string can be inferred from the others.
* ``markov`` (preset ``markov``, the previous default): a random mixture of sparse Markov chains
  (``icml_jax.data.markov_source``); NLL covers ~99% of its mass at T=1, leaving no headroom.

Both have a distribution P over strings that is known exactly, with a support small enough to
enumerate. ``n_train`` samples of it are the training corpus (``DIR/corpus/train.jsonl``, one
string per row, read by the data layer as ``jsonl``), shared by every training seed.

Runs (``configs/precision_recall.py``, task ``pr_lm``, byte tokens), each through
``train_and_evaluate`` in ``DIR/seed<k>/<run>/`` for every training seed k in ``seeds`` (model
initialisation and data order):

* ``nll``                    NLL from scratch; evaluated at every sampling temperature T.
* ``pr_l<λ>``                the spec's candidate loss L_λ = min(λ,1) - min(λ, q_y) from scratch
                             (unverified: the paper's exact loss is unknown).
* ``pr_l<λ>_mix<μ>``         L_λ + μ·NLL from scratch.
* ``ft_pr_l<λ>[_mix<μ>]``    warm start from the same seed's ``nll`` params, then L_λ (+ μ·NLL).
* ``ft_nll``                 the control for the warm starts: as many more NLL steps; their
                             matched-precision reference (``reference``) instead of ``nll``.

Evaluation, exact by enumeration: every string x of supp P is scored by the model, giving
Q_T(x) = prod_t softmax(logits_t / T)[x_t] over [bos] + x + [eos]; Q's remaining mass (invalid
strings, other tokens, strings that never end) is one extra outcome with P = 0
(``icml_jax.analysis.precision_recall.align``). Then

* precision = Q_T(supp P) (= alpha_inf);
* recall = P({x : Q_T(x) >= eps·P(x)}) with eps = ``recall_eps`` (a softmax model has full
  support, so beta_0 = P(supp Q) = 1 always; this is the P-mass of the modes generated at no less
  than eps times their data frequency, 1 for Q = P); head / tail recall: the same within P's head
  (the most likely strings holding half of its mass) / the rest, normalised; Q_T's mass on the
  head, the tail and off the support;
* PRD points (alpha_λ, beta_λ) at λ ∈ {0.1, 1, 10} and a full PRD curve for the plot.

Gate (``gate``): every seed's NLL model at T=1 must reach the given precision and head recall
(it learnt the head), or results.md says the comparison is no evidence. The comparison at matched
precision interpolates the same seed's NLL (precision, recall) over ``frontier_temperatures``
linearly between neighbouring temperatures; results.md gives mean ± s.e. over the seeds. Each
run's digest (training summary + every metric at every T) is cached in
``DIR/seed<k>/<run>/result.json``, keyed by its config and the source / evaluation settings, so a
rerun recomputes nothing.

Writes DIR/config.json, DIR/results.csv (one row per seed, run and temperature), DIR/results.md,
DIR/pr_points.png and DIR/prd_curves.png.
"""
import argparse
import collections
import copy
import json
import os
import sys

from experiments.common import (cached, git_commit, preset, record, run_overrides, stopwatch, write_atomic,
                                write_csv, write_json)
from experiments.precision_recall.report import CSV_FIELDS, at, csv_rows, markdown, plots
from icml_jax import xla_env

PRD_LAMBDAS = (0.1, 1.0, 10.0)

# the zipf source (icml_jax.data.zipf_source): 3000 random strings of 4-8 letters over 8 letters,
# P(rank i) ~ 1/i; 6000 samples see 1391 of them: 57% of P's mass >= 10 times, 29% 1-9 times,
# 13% never
ZIPF = dict(kind="zipf", seed=0, num_strings=3000, num_letters=8, min_len=4, max_len=8, exponent=1.0)
GATE = dict(precision=0.5, head_recall=0.9)  # the NLL model at T=1, every seed
SCRATCH_STEPS = dict(train=dict(steps=500, eval_every=250, checkpoint_every=250))

PRESETS = {
    "tiny": preset(
        source=dict(ZIPF, num_strings=200), n_train=1500, data_seed=1, seeds=[0, 1],
        config="tiny", temperatures=(0.5, 1.0, 2.0), recall_eps=0.1, gate=GATE,
        frontier_temperatures=[0.5, 0.75, 1.0, 1.5, 2.0],
        # two runs keep the test short: NLL, and the PR loss warm-started from it
        runs=[dict(name="nll", type="nll"),
              dict(name="ft_pr_l0.1_mix0.1", type="pr_hinge", pr_lambda=0.1, pr_mix_nll=0.1,
                   init="nll", steps=10)],
        train=dict(train=dict(steps=40, eval_every=40, checkpoint_every=40)),
    ),
    "default": preset(
        source=ZIPF, n_train=6000, data_seed=1, seeds=[0, 1, 2], config="default",
        temperatures=(0.5, 0.7, 1.0, 1.5, 2.0), recall_eps=0.1, gate=GATE,
        # the NLL model's frontier for the matched-precision comparison, T = 0.3, 0.35, ..., 2.5
        frontier_temperatures=[round(0.3 + 0.05 * i, 2) for i in range(45)],
        runs=[dict(name="nll", type="nll"),
              dict(name="pr_l0.1_mix0.1", type="pr_hinge", pr_lambda=0.1, pr_mix_nll=0.1),
              # the control: as many more steps of NLL from the same start (more NLL training
              # alone raises recall at matched precision by ~0.03), the warm start's reference
              dict(name="ft_nll", type="nll", init="nll", steps=150),
              dict(name="ft_pr_l0.1_mix0.1", type="pr_hinge", pr_lambda=0.1, pr_mix_nll=0.1,
                   init="nll", steps=150, reference="ft_nll")],
        train=SCRATCH_STEPS,
    ),
    # the previous default: a mixture of sparse Markov chains (icml_jax.data.markov_source), one
    # seed; NLL covers 98.6% of its mass at T=1 (results of commit 30cf327)
    "markov": preset(
        source=dict(kind="markov", seed=0, num_chains=8, num_letters=10, branching=3, max_len=7),
        n_train=20000, data_seed=1, seeds=[0], config="default",
        temperatures=(0.5, 0.7, 1.0, 1.5, 2.0), recall_eps=0.1, gate=GATE,
        frontier_temperatures=[round(0.3 + 0.05 * i, 2) for i in range(45)],
        runs=[dict(name="nll", type="nll"),
              dict(name="pr_l0.1", type="pr_hinge", pr_lambda=0.1),
              dict(name="pr_l0.5", type="pr_hinge", pr_lambda=0.5),
              dict(name="pr_l0.1_mix0.1", type="pr_hinge", pr_lambda=0.1, pr_mix_nll=0.1),
              dict(name="ft_pr_l0.1_mix0.1", type="pr_hinge", pr_lambda=0.1, pr_mix_nll=0.1,
                   init="nll", steps=150)],
        # 500 steps x 32 rows x 64 tokens: the NLL run's held-out NLL is within ~0.015 nats of a
        # 1500-step run's (1.417 vs 1.404, measured once)
        train=SCRATCH_STEPS,
    ),
}
QUIET = {"train.samples": 0, "train.progress": False}
# P's mass by how often the corpus holds a string (results.md's source line)
SEEN_BUCKETS = {"1-2": (1, 2), "3-9": (3, 9), ">=10": (10, float("inf"))}


def build_source(exp):
    """The preset's source: ``kind`` "zipf" (``random_zipf_strings``) or "markov"
    (``random_markov_mixture``), the other keys its arguments."""
    args = exp.source.to_dict()
    kind = args.pop("kind")
    if kind == "zipf":
        from icml_jax.data.zipf_source import random_zipf_strings
        return random_zipf_strings(**args)
    if kind == "markov":
        from icml_jax.data.markov_source import random_markov_mixture
        return random_markov_mixture(**args)
    raise ValueError(f"source.kind={kind!r}; choose 'zipf' or 'markov'")


def write_training_corpus(source, exp, workdir):
    """DIR/corpus/train.jsonl (n_train samples), rewritten only when its settings change (the data
    layer's TFDS copy is keyed by the file's mtime)."""
    import numpy as np
    from icml_jax.data.markov_source import write_corpus
    path = os.path.join(workdir, "corpus", "train.jsonl")
    key = {"source": exp.source.to_dict(), "n_train": exp.n_train, "data_seed": exp.data_seed}
    meta = os.path.join(workdir, "corpus", "meta.json")
    if not os.path.exists(path) and os.path.exists(meta):
        os.remove(meta)

    def make():
        texts = source.sample(exp["n_train"], np.random.default_rng(exp["data_seed"]))
        write_corpus(path, texts)
        counts = collections.Counter(texts)
        seen = {b: sum(source.prob(x) for x, c in counts.items() if lo <= c <= hi)
                for b, (lo, hi) in SEEN_BUCKETS.items()}
        return {"documents": len(texts), "distinct": len(counts),
                "p_mass_seen": {"0": 1.0 - sum(seen.values()), **seen}}
    return path, cached(meta, key, make)


def run_config(exp, spec, workdir, seed):
    """The run ``spec``'s config for training seed ``seed`` (its runs live in ``workdir``)."""
    from icml_jax.config_utils import load_config
    cfg = load_config(f"configs/precision_recall.py:{exp['config']}", unlocked=True)
    over = {**run_overrides(exp.train), **QUIET, "seed": int(seed),
            "data.path": os.path.abspath(os.path.join(workdir, "..", "corpus", "train.jsonl")),
            "data.data_dir": os.path.abspath(os.path.join(workdir, "..", "tfds")),
            "loss.type": spec["type"], "loss.pr_lambda": float(spec.get("pr_lambda", 1.0)),
            "loss.pr_mix_nll": float(spec.get("pr_mix_nll", 0.0))}
    if spec.get("steps"):
        over["train.steps"] = over["train.eval_every"] = over["train.checkpoint_every"] = spec["steps"]
    if spec.get("init"):
        over["train.init_from"] = os.path.abspath(os.path.join(workdir, spec["init"]))
    cfg.update_from_flattened_dict(over)
    return cfg


def head_mask(p_support):
    """True for the most likely strings that together hold half of P's mass (the head)."""
    import numpy as np
    order = np.argsort(-p_support, kind="stable")
    n = int(np.searchsorted(np.cumsum(p_support[order]), 0.5) + 1)
    mask = np.zeros(len(p_support), bool)
    mask[order[:n]] = True
    return mask


def pr_metrics(p_support, logq_T, temperatures, eps):
    """Per temperature: precision, recall (all of P, its head and its tail: the recall of P
    restricted to those strings), off-support mass, PRD points and a PRD curve."""
    import numpy as np
    from icml_jax.analysis import precision_recall as prm
    out = []
    lam_curve = np.tan(np.linspace(0.01, np.pi / 2 - 0.01, 61))
    head = head_mask(p_support)
    for t, lq in zip(temperatures, logq_T):
        p, q = prm.align(p_support, np.exp(lq))
        a, b = prm.prd_curve(p, q, np.array(PRD_LAMBDAS))
        ca, cb = prm.prd_curve(p, q, lam_curve)
        hit = np.exp(lq) >= eps * p_support
        out.append({"temperature": float(t), "precision": prm.precision_limit(p, q),
                    "recall": prm.threshold_recall(p, q, eps),
                    "head_recall": float(p_support[head & hit].sum() / p_support[head].sum()),
                    "tail_recall": (float(p_support[~head & hit].sum() / p_support[~head].sum())
                                    if (~head).any() else float("nan")),
                    "recall_eps0.01": prm.threshold_recall(p, q, 0.01),
                    "q_head": float(np.exp(lq)[head].sum()), "q_tail": float(np.exp(lq)[~head].sum()),
                    "off_support": float(q[-1]),
                    "prd": {f"{lam:g}": [float(x), float(y)] for lam, x, y in zip(PRD_LAMBDAS, a, b)},
                    "d_lambda": {f"{lam:g}": prm.pr_divergence(p, q, lam) for lam in PRD_LAMBDAS},
                    "curve": [[float(x), float(y)] for x, y in zip(ca, cb)]})
    return out


def train_and_score(cfg, workdir, strings, p_support, exp):
    """Trains (or resumes) one run and scores supp P exactly at every temperature."""
    from icml_jax.tasks import TASKS
    from icml_jax.analysis.sequence_logprobs import sequence_logprobs
    from icml_jax.train.trainer import train
    elapsed = stopwatch()
    state, summary = train(cfg, workdir)
    train_s = elapsed()
    timing = os.path.join(workdir, "timing.json")
    if summary["start_step"] < summary["step"]:
        write_json(timing, {"train_seconds": train_s, "steps": int(summary["step"])})
    elif os.path.exists(timing):  # finished before: only re-evaluated, keep the measured time
        with open(timing) as f:
            train_s = json.load(f)["train_seconds"]
    else:
        train_s = None
    task = TASKS.get("pr_lm")(cfg)
    score_elapsed = stopwatch()
    fine = list(exp["frontier_temperatures"]) if cfg.loss.type == "nll" else []
    temps = list(exp["temperatures"]) + fine
    logq = sequence_logprobs(task.model, state.params, task.tokenizer, strings, temps,
                             batch_size=2048)
    frontier = [{k: m[k] for k in ("temperature", "precision", "recall", "tail_recall")}
                for m in pr_metrics(p_support, logq[len(exp["temperatures"]):], fine,
                                    exp["recall_eps"])]
    logq = logq[:len(exp["temperatures"])]
    return {"frontier": frontier, "params": int(summary["params"]), "steps": int(summary["step"]),
            "train_seconds": train_s,
            "score_seconds": score_elapsed(),
            "eval_token_nll": float(summary.get("eval_token_nll", float("nan"))),
            "eval_saturated": float(summary.get("eval_saturated", float("nan"))),
            "by_temperature": pr_metrics(p_support, logq, exp["temperatures"], exp["recall_eps"])}



def main(argv=None):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="NLL + temperature vs PR losses (docs/methods/precision_recall.md)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=0, help="override train.steps of the scratch runs")
    a = p.parse_args(argv)
    if a.steps < 0:
        raise SystemExit(f"--steps must be positive, got {a.steps}")
    elapsed = stopwatch()
    exp = copy.deepcopy(PRESETS[a.preset])
    if a.steps:
        t = exp.train.train
        t.steps = t.eval_every = t.checkpoint_every = a.steps
    names = [s["name"] for s in exp["runs"]]
    if names[0] != "nll" or len(set(names)) != len(names):
        raise ValueError(f"the first run must be 'nll' and names unique, got {names}")
    for s in exp["runs"]:
        ref = s.get("reference", "nll")
        if ref not in names or next(r for r in exp["runs"] if r["name"] == ref)["type"] != "nll":
            raise ValueError(f"run {s['name']}: reference={ref!r} must name an NLL run")
    seeds = [int(s) for s in exp["seeds"]]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds}")
    os.makedirs(a.workdir, exist_ok=True)
    import numpy as np
    source = build_source(exp)
    strings, p_support = source.enumerate_support()
    _, corpus = write_training_corpus(source, exp, a.workdir)
    configs = {seed: {s["name"]: run_config(exp, s, os.path.join(a.workdir, f"seed{seed}"), seed)
                      for s in exp["runs"]} for seed in seeds}
    write_json(os.path.join(a.workdir, "config.json"),
               {"preset": a.preset, "exp": record(exp, flat=("train",)), "source": source.describe(),
                "runs": {f"seed{seed}/{n}": json.loads(c.to_json_best_effort())
                         for seed, cs in configs.items() for n, c in cs.items()}})
    results = {}
    eval_key = {"source": exp.source.to_dict(), "temperatures": exp["temperatures"],
                "frontier_temperatures": exp["frontier_temperatures"],
                "recall_eps": exp["recall_eps"], "prd_lambdas": PRD_LAMBDAS, "corpus": corpus,
                "metrics": 2}  # 2: head and tail recall
    for seed in seeds:
        results[seed] = res = {}
        for spec in exp["runs"]:
            name, cfg = spec["name"], configs[seed][spec["name"]]
            wd = os.path.join(a.workdir, f"seed{seed}", name)
            print(f"=== seed {seed} {name}: loss {cfg.loss.type} λ={cfg.loss.pr_lambda} "
                  f"mix={cfg.loss.pr_mix_nll} init={spec.get('init', 'scratch')} ===", flush=True)
            key = {"config": json.loads(cfg.to_json_best_effort()), **eval_key,
                   "init_digest": res[spec["init"]]["key"] if spec.get("init") else None}
            res[name] = r = cached(os.path.join(wd, "result.json"), key,
                                   lambda: train_and_score(cfg, wd, strings, p_support, exp))
            m = at(r, 1.0)
            print(f"seed {seed} {name}: T=1 precision {m['precision']:.4f} recall {m['recall']:.4f} "
                  f"(head {m['head_recall']:.4f}, tail {m['tail_recall']:.4f}; eval NLL "
                  f"{r['eval_token_nll']:.4f})", flush=True)
    write_csv(os.path.join(a.workdir, "results.csv"), csv_rows(exp, results), CSV_FIELDS)
    ps = np.sort(p_support)[::-1]
    cum = np.cumsum(ps)
    head = head_mask(p_support)
    meta = {"command": "python -m experiments.precision_recall "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "preset": a.preset, "wall_seconds": elapsed(),
            "cpus": os.cpu_count(), "load": os.getloadavg()[0], "source": source.describe(),
            "support": len(strings), "entropy": float(-(p_support * np.log(p_support)).sum()),
            "head50": int(head.sum()), "head99": int(np.searchsorted(cum, 0.99) + 1)}
    md = markdown(exp, results, meta, corpus)
    write_atomic(os.path.join(a.workdir, "results.md"), md)
    plots(exp, results, a.workdir)
    print(md)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
