"""Implicit PRM on the arithmetic testbed: best-of-N and first-error detection (docs/methods/implicit_prm.md).

  python -m experiments.implicit_prm --workdir=DIR [--preset=tiny|default]

Steps (every stage is cached under DIR with a key of everything it depends on, so a rerun with the
same settings recomputes nothing and a killed run resumes):

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
   beta = 0.05) on the pairs of all ``responses`` samples, in ``DIR/prm_<name>``.
4. **Evaluation samples.** ``eval_samples`` samples (T = 1.0) per held-out problem; the checker
   gives the answer, its correctness and the true first error (evaluation only).
5. **Scoring.** Per response and PRM: token log-ratios l_t = log pi_PRM - log pi_gen from the first
   response token (``first_response_index``), step ends ``step_end_token_indices`` (steps tile
   the response, so sum_k r_k = q_K), and with ``icml_jax.losses.implicit_prm``: ``min r_k``
   (the reference's default: single/min), ``min q_k`` and ``sum q_k`` (accumulative),
   ``q_K = sum r_k`` (outcome only: the implicit ORM's reward), and weighted majority voting
   with sigma(kappa * min r_k) for kappa = beta (the training scale) and the reference's 0.001.
   Baselines: random pick (the expected accuracy of a uniform pick = mean correctness of the n),
   majority vote over the answers, the generator's own log-prob, and pass@n (an oracle, an upper
   bound). Best-of-N over each problem's first n samples (``best_of_n``), averaged over
   ``orders`` random orders of the 32 samples (the same orders for every selector).
6. **First-error detection** (ProcessBench rule, ``predict_first_error``): first k with
   sigma(beta * q_k) < tau; tau chosen (grid of 1001 values) on the eval responses of the
   even-indexed test problems, F1 (harmonic mean of the accuracy on erroneous and on error-free
   responses) reported on the odd-indexed ones. kappa = beta, not the reference's 0.001: at 0.001
   every sigma is within 0.01 of 0.5 for these short responses and the 0.01 tau grid cannot
   separate them.

Writes DIR/config.json, DIR/results.csv (one row per selector and N), DIR/results.md, DIR/best_of_n.png,
DIR/first_error_f1.png.
"""
import argparse
import json
import os
import sys
import time

from experiments.common import train_run as common_train_run
from experiments.common import (FrozenPolicy, save_figure, cached, digest, flatten_overrides, git_commit,
                                markdown_table, write_atomic, write_csv, write_json)
from icml_jax import xla_env

_QUIET = {"train.samples": 0, "train.progress": False, "train.async_checkpoint": False}
_MODEL_TINY = {"model.d_model": 32, "model.num_layers": 2, "model.num_heads": 4,
               "model.num_kv_heads": 2, "model.head_dim": 8, "model.ffn_dim": 64,
               "model.max_seq_len": 128}
_MODEL_DEFAULT = {"model.d_model": 128, "model.num_layers": 4, "model.num_heads": 4,
                  "model.num_kv_heads": 4, "model.head_dim": 32, "model.ffn_dim": 384,
                  "model.max_seq_len": 256}

PRESETS = {
    "tiny": dict(
        seed=0, knobs=dict(num_steps=2, digits=1, operators="+"), gen_problems=400, error_rate=0.3,
        prm_problems=12, responses=4, ce_responses=(2, 4), test_problems=6, eval_samples=8,
        ns=(1, 2, 4, 8), orders=8, max_new_tokens=48, sample_batch=32, temperature=1.0, beta=0.05,
        # 400 steps: ~4% of its samples are right (120 steps: none), enough for a few DPO pairs
        generator={**_MODEL_TINY, "data.seq_len": 64, "train.steps": 400, "train.batch_size": 16,
                   "train.lr": 1e-2, "train.warmup_steps": 10, "train.log_every": 100,
                   "train.eval_every": 400, "train.eval_batches": 1,
                   "train.checkpoint_every": 400},
        prm={"train.steps": 8, "train.batch_size": 8, "train.lr": 1e-3, "train.warmup_steps": 1,
             "train.log_every": 4, "train.eval_every": 8, "train.eval_batches": 1,
             "train.checkpoint_every": 8},
        dpo_steps=8,
    ),
    "default": dict(
        seed=0, knobs=dict(num_steps=3, digits=2, operators="+-"), gen_problems=6000,
        error_rate=0.3, prm_problems=128, responses=8, ce_responses=(2, 8), test_problems=48,
        eval_samples=32, ns=(1, 2, 4, 8, 16, 32), orders=32, max_new_tokens=96, sample_batch=128,
        temperature=1.0, beta=0.05,
        generator={**_MODEL_DEFAULT, "data.seq_len": 128, "train.steps": 400,
                   "train.batch_size": 16, "train.lr": 3e-3, "train.warmup_steps": 40,
                   "train.log_every": 50, "train.eval_every": 400, "train.eval_batches": 4,
                   "train.checkpoint_every": 200},
        # the 400-step generator's T = 1 samples were 0.7% correct (it miscopies operands):
        # continue it from its params for 800 more steps (a fresh cosine schedule)
        # and 1000 more (1200 steps: 3.8% correct, operands still miscopied)
        generator_continue=[{"train.steps": 800, "train.warmup_steps": 20, "train.lr": 2e-3,
                             "train.eval_every": 800, "train.checkpoint_every": 400},
                            {"train.steps": 1000, "train.warmup_steps": 20, "train.lr": 2e-3,
                             "train.eval_every": 1000, "train.checkpoint_every": 500}],
        prm={"train.steps": 100, "train.batch_size": 16, "train.lr": 3e-4,
             "train.warmup_steps": 10, "train.log_every": 10, "train.eval_every": 100,
             "train.eval_batches": 2, "train.checkpoint_every": 100},
        dpo_steps=60,
    ),
}


def _log(*m):
    print("[implicit_prm]", *m, flush=True)


# ----------------------------------------------------------------------------- problems + generator

def problems(exp):
    from icml_jax.data import arithmetic as ar
    train, test = ar.make_splits(int(exp["seed"]), int(exp["gen_problems"]),
                                 int(exp["test_problems"]), **exp["knobs"])
    return train, test


def generator_config(exp, corpus_path):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**exp["generator"], **_QUIET, "data.name": "jsonl",
                                    "data.path": corpus_path, "data.text_key": "text",
                                    "data.tokenizer.type": "byte"})
    cfg.seed = int(exp["seed"])
    return cfg


def train_run(cfg, workdir):
    """Trains (or resumes) one run (``experiments.common.train_run``); returns a digest."""
    summary, rows, seconds = common_train_run(cfg, workdir)
    curve = [{k: r[k] for k in r if isinstance(r[k], (int, float))} for r in rows]
    ev = {k: float(v) for k, v in summary.items() if k.startswith("eval_")}
    return {"curve": curve, "eval": ev, "step": int(summary["step"]), "train_seconds": seconds}


def build_generator(exp, workdir, train_problems):
    from icml_jax.data import arithmetic as ar
    corpus_path = os.path.join(workdir, "corpus.jsonl")
    docs = ar.sft_corpus(train_problems, error_rate=float(exp["error_rate"]), seed=int(exp["seed"]))
    text = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    if not os.path.exists(corpus_path) or open(corpus_path).read() != text:
        write_atomic(corpus_path, text)
    cfg = generator_config(exp, corpus_path)
    gen_dir = os.path.join(workdir, "generator")
    key = {"config": json.loads(cfg.to_json_best_effort()), "corpus": digest(docs)}
    res = cached(os.path.join(workdir, "generator_result.json"), key,
                 lambda: train_run(cfg, gen_dir))
    # further runs, each initialised from the previous one's params (fresh optimizer/schedule)
    prev, prev_key = gen_dir, digest(res["key"])
    seconds, steps = res["train_seconds"], res["step"]
    for i, more in enumerate(exp.get("generator_continue") or []):
        cfg2 = generator_config(exp, corpus_path)
        cfg2.update_from_flattened_dict({**more, "train.init_from": prev})
        suffix = "" if i == 0 else f"_{i + 1}"
        gen2 = os.path.join(workdir, f"generator_continued{suffix}")
        key2 = {"config": json.loads(cfg2.to_json_best_effort()), "corpus": digest(docs),
                "first": prev_key}
        res = cached(os.path.join(workdir, f"generator_continued{suffix}_result.json"), key2,
                     lambda: train_run(cfg2, gen2))
        prev, prev_key = gen2, digest(res["key"])
        seconds, steps = seconds + res["train_seconds"], steps + res["step"]
    return prev, {**res, "train_seconds": seconds, "steps_total": steps}


# ----------------------------------------------------------------------------- sampling

def sample(models, prompts, n, exp, seed):
    """n responses per prompt at the preset temperature (eos stripped), in prompt order.
    Fixed batch and prompt width, so decoding compiles once for every call."""
    import jax

    from icml_jax.inference import decode
    tok = models.tok
    enc = [[tok.bos_id] + list(tok.encode(p)) for p in prompts]
    width = decode.bucket_length(max(len(e) for e in enc))
    bs, mnt = int(exp["sample_batch"]), int(exp["max_new_tokens"])
    rows = [e for e in enc for _ in range(n)]
    stops = (tok.eos_id,)
    texts = []
    base = jax.random.key(seed)
    for b, lo in enumerate(range(0, len(rows), bs)):
        chunk = rows[lo: lo + bs]
        real = len(chunk)
        chunk = chunk + [chunk[0]] * (bs - real)
        out = decode.generate(models.model_cfg, models.ref_params, chunk,
                              key=jax.random.fold_in(base, b), max_new_tokens=mnt,
                              temperature=float(exp["temperature"]), stop_tokens=stops,
                              pad_id=tok.pad_id, max_len=width + mnt)
        for row, ln in zip(out.tokens[:real], out.lengths[:real]):
            ids = row[:ln].tolist()
            if ids and ids[-1] in stops:
                ids = ids[:-1]
            texts.append(tok.decode(ids))
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def label_train(problems_, groups):
    """Outcome labels only: answer_correct per response (no step labels are kept)."""
    from icml_jax.data import arithmetic as ar
    return [[bool(ar.check_solution(p, r).answer_correct) for r in g]
            for p, g in zip(problems_, groups)]


def label_eval(problems_, groups):
    from icml_jax.data import arithmetic as ar
    out = []
    for p, g in zip(problems_, groups):
        cs = [ar.check_solution(p, r) for r in g]
        out.append({"answers": [c.answer for c in cs],
                    "correct": [bool(c.answer_correct) for c in cs],
                    "first_error": [int(c.first_error or 0) for c in cs],
                    "all_steps_correct": [bool(c.all_steps_correct) for c in cs]})
    return out


# ----------------------------------------------------------------------------- PRM data + training

def prm_datasets(exp, workdir, prompts, groups, labels):
    """Writes the CE files (first M samples per problem, each M) and the DPO pairs."""
    from icml_jax.data.preference import write_preference_jsonl, write_unpaired_jsonl
    paths = {}
    for m in exp["ce_responses"]:
        rows = [{"prompt": p, "completion": r, "label": lab}
                for p, g, ls in zip(prompts, groups, labels)
                for r, lab in list(zip(g, ls))[:int(m)] if r]
        paths[f"ce_m{m}"] = os.path.join(workdir, f"ce_m{m}.jsonl")
        write_unpaired_jsonl(paths[f"ce_m{m}"], rows)
    pairs = []
    for p, g, ls in zip(prompts, groups, labels):
        good = [r for r, lab in zip(g, ls) if lab and r]
        bad = [r for r, lab in zip(g, ls) if not lab and r]
        pairs += [{"prompt": p, "chosen": c, "rejected": b} for c, b in zip(good, bad)]
    if pairs:
        paths["dpo"] = os.path.join(workdir, "dpo_pairs.jsonl")
        write_preference_jsonl(paths["dpo"], pairs)
    return paths, len(pairs)


def seq_len_for(exp, tok, prompts):
    longest = 1 + max(len(tok.encode(p)) for p in prompts) + int(exp["max_new_tokens"]) + 1
    return -(-longest // 8) * 8


def prm_config(exp, name, path, gen_dir, gen_cfg, seq_len, n_rows):
    from icml_jax.config_utils import load_config
    is_dpo = name == "dpo"
    cfg = load_config("configs/dpo.py:default" if is_dpo else "configs/implicit_prm.py:default",
                      unlocked=True)
    t = dict(exp["prm"])
    if is_dpo:
        t["train.steps"] = int(exp["dpo_steps"])
        t["train.eval_every"] = int(exp["dpo_steps"])
        t["train.checkpoint_every"] = int(exp["dpo_steps"])
    bs = int(t["train.batch_size"])
    over = {**flatten_overrides({"model": gen_cfg["model"]}),
            **flatten_overrides({"data": {"tokenizer": gen_cfg["data"]["tokenizer"]}}), **t, **_QUIET,
            "train.min_lr_ratio": 0.0, "train.weight_decay": 0.0,
            "train.eval_batches": max(1, min(int(t["train.eval_batches"]), -(-n_rows // bs))),
            "data.seq_len": int(seq_len), "data.path": path, "data.eval_path": "",
            "train.init_from": gen_dir, "loss.beta": float(exp["beta"])}
    if is_dpo:
        over["loss.type"] = "sigmoid"
    cfg.update_from_flattened_dict(over)
    cfg.seed = int(exp["seed"])
    return cfg


# ----------------------------------------------------------------------------- scoring

def step_arrays(models, prompts, responses, seq_len):
    """Encoded rows plus first_index [B], step ends [B, K], step mask [B, K]."""
    import numpy as np

    from icml_jax.data import arithmetic as ar
    from icml_jax.data.preference import encode_responses
    tok = models.tok
    arrays, _ = encode_responses(prompts, responses, tok, seq_len, add_eos=True)
    ends = [ar.step_end_token_indices(p, r, tok) for p, r in zip(prompts, responses)]
    K = max(1, max(len(e) for e in ends))
    E = np.zeros((len(ends), K), np.int32)
    M = np.zeros((len(ends), K), np.int32)
    for i, e in enumerate(ends):
        E[i, :len(e)], M[i, :len(e)] = e, 1
    fi = np.array([ar.first_response_index(p, tok) for p in prompts], np.int32)
    rows = {k: arrays[k] for k in ("inputs", "positions", "segment_ids", "response_mask")}
    return rows, fi, E, M


def logps(models, params, rows, batch_size):
    from icml_jax.tasks.pairs import batched_apply
    return batched_apply(lambda b: models.token_logps(params, b), rows, batch_size)


def raw_prefix_sums(lp, ref, rows, fi, E, M):
    """[B, K] sum of log-ratios up to each step end (q_k / kappa), 0 at padding steps."""
    import numpy as np

    from icml_jax.losses import implicit_prm as ip
    lr = ip.token_log_ratios(lp, ref, fi, rows["response_mask"])
    return np.asarray(ip.prefix_values(lr, E, M, 1.0))


# ----------------------------------------------------------------------------- metrics

def selector_scores(q_raw, M, kappa):
    """Per-response scores [B] of every PRM selector from the raw prefix sums [B, K]."""
    import numpy as np

    from icml_jax.losses import implicit_prm as ip
    q = kappa * np.asarray(q_raw, np.float64)
    r = np.asarray(ip.step_rewards(q, M))
    has = M.sum(1) > 0
    low = -1e30

    def agg(s, how):
        return np.where(has, np.asarray(ip.aggregate(s, M, how), np.float64), low)
    return {"min r_k": agg(r, "min"), "min q_k": agg(q, "min"), "sum q_k": agg(q, "sum"),
            "q_K = sum r_k (outcome only)": agg(q, "last")}


def bon_over_orders(scores_GN, correct_GN, ns, perms):
    import numpy as np

    from icml_jax.analysis import prm_eval
    out = {int(n): [] for n in ns}
    for perm in perms:
        res = prm_eval.best_of_n(scores_GN[:, perm], correct_GN[:, perm], ns)
        for n in ns:
            out[int(n)].append(res[int(n)])
    return {n: float(np.mean(v)) for n, v in out.items()}


def wmv_over_orders(answers_GN, scores_GN, ref_G, ns, perms, sigmoid=True):
    import numpy as np

    from icml_jax.analysis import prm_eval
    out = {int(n): [] for n in ns}
    for perm in perms:
        a = [[row[j] for j in perm] for row in answers_GN]
        res = prm_eval.weighted_majority(a, scores_GN[:, perm], ref_G, ns, sigmoid=sigmoid)
        for n in ns:
            out[int(n)].append(res[int(n)])
    return {n: float(np.mean(v)) for n, v in out.items()}


def best_of_n_table(exp, test, ev, prm_scores, ref_sum):
    """{selector: {n: accuracy}} (the selectors of the module docstring)."""
    import numpy as np
    G, N = len(ev), int(exp["eval_samples"])
    ns = [int(n) for n in exp["ns"] if n <= N]
    rng = np.random.default_rng(int(exp["seed"]) + 7)
    perms = [np.arange(N)] + [rng.permutation(N) for _ in range(int(exp["orders"]) - 1)]
    correct = np.array([e["correct"] for e in ev], bool)
    answers = [e["answers"] for e in ev]
    ref = [p.answer for p in test]
    table = {}
    table["random pick"] = {n: float(np.mean([correct[:, perm[:n]].mean() for perm in perms]))
                            for n in ns}
    table["pass@n (oracle)"] = {n: float(np.mean([correct[:, perm[:n]].any(1).mean()
                                                  for perm in perms])) for n in ns}
    table["majority vote"] = wmv_over_orders(answers, np.ones((G, N)), ref, ns, perms, sigmoid=False)
    table["generator log-prob"] = bon_over_orders(ref_sum.reshape(G, N), correct, ns, perms)
    beta = float(exp["beta"])
    for name, q_raw, M in prm_scores:
        for sel, s in selector_scores(q_raw, M, 1.0).items():
            table[f"{name}: {sel}"] = bon_over_orders(s.reshape(G, N), correct, ns, perms)
        for kappa, lab in ((beta, "β"), (0.001, "0.001")):
            s = selector_scores(q_raw, M, kappa)["min r_k"].reshape(G, N)
            table[f"{name}: weighted MV σ({lab}·min r_k)"] = wmv_over_orders(
                answers, s, ref, ns, perms)
    return table


def first_error_table(exp, ev, prm_scores):
    """{prm: {tau, f1, acc_erroneous, acc_correct, tune_f1}} (τ on even problems, F1 on odd)."""
    import numpy as np

    from icml_jax.analysis import prm_eval
    G, N = len(ev), int(exp["eval_samples"])
    true = np.array([e["first_error"] for e in ev]).reshape(-1)
    prob = np.repeat(np.arange(G), N)
    tune, test = prob % 2 == 0, prob % 2 == 1
    grid = np.linspace(0.0, 1.0, 1001)
    out = {}
    for name, q_raw, M in prm_scores:
        q = float(exp["beta"]) * np.asarray(q_raw, np.float64)
        tau, tuned = prm_eval.choose_threshold(q[tune], M[tune], true[tune], grid)
        res = prm_eval.first_error_scores(prm_eval.predict_first_error(q[test], M[test], tau), true[test])
        if res["acc_erroneous"] != res["acc_erroneous"] or res["acc_correct"] != res["acc_correct"]:
            res["f1"] = float("nan")  # one subset is empty: the harmonic mean is undefined
        out[name] = {"tau": tau, "tune_f1": tuned["f1"], **res}
    out["_counts"] = {"test_erroneous": int((true[test] > 0).sum()),
                      "test_error_free": int((true[test] == 0).sum())}
    return out


# ----------------------------------------------------------------------------- outputs

def _fmt(x):
    return "—" if x is None or x != x else f"{x:.3f}"


def reading(exp, table, fe, prm_names):
    import numpy as np
    ns = sorted(table["random pick"])
    big = [n for n in ns if n >= 8] or [ns[-1]]
    lines = []
    rnd = np.mean([table["random pick"][n] for n in big])
    for name in prm_names:
        mn = np.mean([table[f"{name}: min r_k"][n] for n in big])
        orm = np.mean([table[f"{name}: q_K = sum r_k (outcome only)"][n] for n in big])
        maj = np.mean([table["majority vote"][n] for n in big])
        wmv = np.mean([table[f"{name}: weighted MV σ(β·min r_k)"][n] for n in big])
        verdict = ("shows" if mn > rnd and mn > orm else
                   "partly shows (beats random, not outcome-only)" if mn > rnd else "does not show")
        p_ = max(mn, rnd, orm, 1.0 / (2 * int(exp["test_problems"])))
        se = np.sqrt(2 * p_ * (1 - p_) / int(exp["test_problems"]))
        if mn > rnd and abs(mn - max(rnd, orm if mn > orm else rnd)) < 2 * se:
            verdict += f" nominally, but within ~2 s.e. ({2 * se:.3f}) of sampling noise"
        lines.append(f"* **{name}** at N ∈ {big} (mean): min r_k {mn:.3f} vs random {rnd:.3f}, "
                     f"outcome-only {orm:.3f}, majority vote {maj:.3f}, weighted MV {wmv:.3f}. "
                     f"The paper's direction (min-step PRM beats random and outcome-only as N grows) "
                     f"{verdict} here.")
    if "DPO" in prm_names:
        best = max(prm_names, key=lambda n: np.mean([table[f"{n}: min r_k"][k] for k in big]))
        lines.append(f"* Best PRM by min r_k at N ≥ 8: **{best}** (paper: DPO best overall).")
    f1s = {n: fe[n]["f1"] for n in prm_names}
    c = fe["_counts"]
    if c["test_error_free"] == 0 or c["test_erroneous"] == 0:
        lines.append(f"* First-error F1 is **undefined** here: the held-out half has "
                     f"{c['test_erroneous']} erroneous and {c['test_error_free']} error-free "
                     "responses, so one of the two accuracies has no data (the accuracy on the "
                     "other subset is in the table).")
    else:
        lines.append("* First-error F1 (held-out half): "
                     + ", ".join(f"{n} {_fmt(v)}" for n, v in f1s.items())
                     + ". Always predicting \"no error\" scores F1 0; no PRM ever saw a step label.")
    lines.append(f"* Per-sample accuracy of the generator on the held-out problems: "
                 f"{info_acc(table):.3f} (random pick at N = 1); pass@{ns[-1]} = "
                 f"{table['pass@n (oracle)'][ns[-1]]:.3f} bounds every selector.")
    lines.append(f"* Sampling noise: {exp['test_problems']} test problems, so one problem is "
                 f"{1 / int(exp['test_problems']):.3f} of accuracy; differences below ~2 s.e. "
                 f"(≈ {2 * 0.5 / np.sqrt(int(exp['test_problems'])):.2f} at 50% accuracy, less for "
                 "paired comparisons on the same samples) are not resolved.")
    return lines


def info_acc(table):
    return table["random pick"][min(table["random pick"])]


def plot_bon(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    base = {"random pick": ("k", "--"), "pass@n (oracle)": ("gray", ":"),
            "majority vote": ("tab:brown", "-."), "generator log-prob": ("tab:olive", "--")}
    kinds = {"min r_k": "-", "q_K = sum r_k (outcome only)": "--", "weighted MV σ(β·min r_k)": ":"}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan"]
    prms = list(dict.fromkeys(s.split(": ")[0] for s in table if ": " in s))
    for sel, res in table.items():
        if ": " in sel:
            prm, kind = sel.split(": ", 1)
            if kind not in kinds:
                continue
            c, ls = palette[prms.index(prm) % len(palette)], kinds[kind]
        else:
            c, ls = base.get(sel, ("k", "-"))
        ns = sorted(res)
        ax.plot(ns, [res[n] for n in ns], color=c, ls=ls, marker="o", ms=3, label=sel)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (responses per problem)")
    ax.set_ylabel("accuracy of the selected response")
    ax.set_title("Best-of-N on held-out problems")
    ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_f1(fe, prm_names, ce_ms, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(prm_names)
    axes[0].bar(range(len(names)), [fe[n]["f1"] for n in names], color="tab:blue")
    axes[0].set_xticks(range(len(names)), names, fontsize=8)
    axes[0].set_ylabel("first-error F1 (held-out half)")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("ProcessBench rule on σ(β q_k)")
    ce = [f"CE M={m}" for m in ce_ms]
    axes[1].plot(list(ce_ms), [fe[n]["f1"] for n in ce], marker="o", label="F1")
    axes[1].plot(list(ce_ms), [fe[n]["acc_erroneous"] for n in ce], marker="s", ls="--",
                 label="acc (erroneous)")
    axes[1].plot(list(ce_ms), [fe[n]["acc_correct"] for n in ce], marker="^", ls=":",
                 label="acc (error-free)")
    axes[1].set_xlabel("responses per training problem (CE)")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    axes[1].set_title("CE PRM vs responses per problem")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


CSV_FIELDS = ("kind", "selector", "n", "value")


def write_outputs(workdir, exp, preset, argv, info, table, fe, prm_names, seconds):
    rows = [{"kind": "best_of_n", "selector": s, "n": n, "value": round(v, 5)}
            for s, res in table.items() for n, v in sorted(res.items())]
    for name in prm_names:
        for k in ("f1", "acc_erroneous", "acc_correct", "tau", "tune_f1"):
            rows.append({"kind": "first_error", "selector": name, "n": k,
                         "value": round(float(fe[name][k]), 5)})
    write_csv(os.path.join(workdir, "results.csv"), rows, CSV_FIELDS)
    ns = sorted(table["random pick"])
    cmd = "python -m experiments.implicit_prm " + " ".join(argv)
    g = info["generator"]
    md = [f"# Implicit PRM on the arithmetic testbed ({preset} preset)", "",
          f"Command: `{cmd}` | seed {exp['seed']} (problems, generator, sampling, PRM data order) | "
          f"commit {git_commit()} | wall time {seconds:.0f} s this invocation (stage times in "
          "config.json → timing).", "",
          f"Problems: {exp['knobs']}. Generator: byte LM, {exp['generator']['model.num_layers']} layers, "
          f"d = {exp['generator']['model.d_model']}, {g['steps_total']} steps on "
          f"sft_corpus of {exp['gen_problems']} problems with {exp['error_rate']:.0%} injected slips "
          f"(eval loss {g['eval_loss']:.3f} nats/byte). PRM data: {exp['responses']} samples "
          f"(T = {exp['temperature']}) for each of {exp['prm_problems']} training problems, "
          f"labelled by final-answer correctness only ({info['train_accuracy']:.1%} correct); "
          f"{info['n_pairs']} DPO pairs. PRMs from the generator (= frozen reference), beta = "
          f"{exp['beta']}: CE with the first M ∈ {list(exp['ce_responses'])} samples per problem "
          f"({exp['prm']['train.steps']} steps × {exp['prm']['train.batch_size']}, lr "
          f"{exp['prm']['train.lr']:g}); DPO on the pairs ({exp['dpo_steps']} steps × "
          f"{exp['prm']['train.batch_size']} pairs). Evaluation: {exp['eval_samples']} samples per "
          f"held-out problem for {exp['test_problems']} problems; per-sample accuracy "
          f"{info['eval_accuracy']:.1%}, all steps correct {info['eval_all_steps_correct']:.1%}. "
          f"Best-of-N is averaged over {exp['orders']} random orders of the samples (first n of "
          "each order).", "",
          "## Best-of-N accuracy", ""]
    md.append(markdown_table(["selector"] + [f"N={n}" for n in ns],
                             [[s] + [f"{res[n]:.3f}" for n in ns] for s, res in table.items()]))
    md += ["`min r_k`: the reference's default (single score, min over steps). `q_K = sum r_k`: the "
           "implicit ORM reward (outcome only; steps tile the response so these are the same "
           "number). `min q_k`, `sum q_k`: the accumulative score type. Weighted MV: each answer "
           "gets Σ σ(κ·score); at κ = 0.001 every σ ≈ 0.5 and it reduces to majority vote. Random "
           "pick: the expected accuracy of a uniformly random choice among the n. pass@n: an "
           "oracle, the upper bound of any selector.", "",
           "## First-error detection (ProcessBench rule)", "",
           f"τ chosen on the even-indexed test problems' responses, scores on the odd-indexed ones "
           f"({fe['_counts']['test_erroneous']} erroneous / {fe['_counts']['test_error_free']} "
           "error-free responses; a response's true first error comes from the checker, used only "
           "here). Predicted first error = first step with σ(β·q_k) < τ.", ""]
    md.append(markdown_table(
        ["PRM", "F1", "acc erroneous", "acc error-free", "τ", "F1 on the tuning half"],
        [[n, _fmt(fe[n]["f1"]), _fmt(fe[n]["acc_erroneous"]), _fmt(fe[n]["acc_correct"]),
          f"{fe[n]['tau']:.3f}", _fmt(fe[n]["tune_f1"])] for n in prm_names]))
    md += ["CE M = responses per training problem (same problems, same steps).", "",
           "## PRM training", ""]
    md.append(markdown_table(
        ["PRM", "rows", "final train loss", "train accuracy", "eval loss", "train s"],
        [[n, info["prm"][n]["rows"], _fmt(info["prm"][n]["loss"]), _fmt(info["prm"][n]["acc"]),
          _fmt(info["prm"][n]["eval_loss"]), f"{info['prm'][n]['seconds']:.0f}"]
         for n in prm_names]))
    md += ["## Reading", ""] + reading(exp, table, fe, prm_names) + [
        "", "Plots: `best_of_n.png`, `first_error_f1.png`."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_bon(table, os.path.join(workdir, "best_of_n.png"))
    plot_f1(fe, prm_names, exp["ce_responses"], os.path.join(workdir, "first_error_f1.png"))


# ----------------------------------------------------------------------------- driver

def run(exp, workdir, timing):
    import numpy as np

    from icml_jax.data import arithmetic as ar
    t = time.time()
    train, test = problems(exp)
    gen_dir, gen = build_generator(exp, workdir, train)
    timing["generator"] = time.time() - t
    gen_key = digest(gen["key"])
    models = None

    def get_models():
        nonlocal models
        if models is None:
            models = FrozenPolicy(gen_dir)
        return models

    prm_problems = train[: int(exp["prm_problems"])]
    prompts = [ar.prompt_text(p) for p in prm_problems]
    samp_key = {"gen": gen_key, "temperature": exp["temperature"], "mnt": exp["max_new_tokens"],
                "batch": exp["sample_batch"], "version": 1}
    t = time.time()
    tr = cached(os.path.join(workdir, "samples_train.json"),
                {**samp_key, "prompts": digest(prompts), "n": exp["responses"]},
                lambda: {"groups": sample(get_models(), prompts, int(exp["responses"]), exp,
                                          int(exp["seed"]) * 1000 + 1)})
    labels = label_train(prm_problems, tr["groups"])
    timing["sample_train"] = time.time() - t
    paths, n_pairs = prm_datasets(exp, workdir, prompts, tr["groups"], labels)
    from icml_jax.data.tokenizers import build_tokenizer
    import ml_collections
    tok = build_tokenizer(ml_collections.ConfigDict(gen["key"]["config"]["data"]["tokenizer"]))
    seq_len = seq_len_for(exp, tok, prompts + [ar.prompt_text(p) for p in test])
    gen_cfg = gen["key"]["config"]
    prm_names, prm_info, prm_cfgs = [], {}, {}
    t = time.time()
    for m in exp["ce_responses"]:
        prm_names.append(f"CE M={m}")
    if "dpo" in paths:
        prm_names.append("DPO")
    name_to_file = {f"CE M={m}": f"ce_m{m}" for m in exp["ce_responses"]}
    name_to_file["DPO"] = "dpo"
    prm_dirs = {}
    for name in prm_names:
        f = name_to_file[name]
        with open(paths[f]) as fh:
            n_rows = sum(1 for _ in fh)
        cfg = prm_config(exp, f, paths[f], gen_dir, gen_cfg, seq_len, n_rows)
        prm_cfgs[name] = json.loads(cfg.to_json_best_effort())
        prm_dirs[name] = os.path.join(workdir, f"prm_{f}")
        res = cached(os.path.join(workdir, f"prm_{f}_result.json"),
                     {"config": prm_cfgs[name], "gen": gen_key,
                      "data": digest(open(paths[f]).read())},
                     lambda: train_run(cfg, prm_dirs[name]))
        last = res["curve"][-1] if res["curve"] else {}
        acc_key = "rewards/accuracies" if name == "DPO" else "accuracy"
        prm_info[name] = {"rows": n_rows, "loss": last.get("loss"), "acc": last.get(acc_key),
                          "eval_loss": res["eval"].get("eval_loss"), "seconds": res["train_seconds"],
                          "digest": digest(res["key"])}
        _log(f"{name}: {n_rows} rows, final loss {last.get('loss')}, {res['train_seconds']:.0f} s")
    timing["prm_train"] = time.time() - t

    t = time.time()
    eval_prompts = [ar.prompt_text(p) for p in test]
    es = cached(os.path.join(workdir, "samples_eval.json"),
                {**samp_key, "prompts": digest(eval_prompts), "n": exp["eval_samples"]},
                lambda: {"groups": sample(get_models(), eval_prompts, int(exp["eval_samples"]),
                                          exp, int(exp["seed"]) * 1000 + 2)})
    ev = label_eval(test, es["groups"])
    timing["sample_eval"] = time.time() - t

    t = time.time()
    flat_p = [p for p, g in zip(eval_prompts, es["groups"]) for _ in g]
    flat_r = [r for g in es["groups"] for r in g]
    score_key = {"samples": digest(es["groups"]), "seq_len": seq_len, "version": 1,
                 "prms": {n: prm_info[n]["digest"] for n in prm_names}}

    def compute_scores():
        mdl = get_models()
        rows, fi, E, M = step_arrays(mdl, flat_p, flat_r, seq_len)
        bs = int(exp["sample_batch"])
        ref = logps(mdl, mdl.ref_params, rows, bs)
        out = {"ref_sum": np.sum(ref * (rows["response_mask"] > 0), 1).tolist(),
               "step_mask": M.tolist(), "q_raw": {}}
        for n in prm_names:
            lp = logps(mdl, mdl.params_of(prm_dirs[n]), rows, bs)
            out["q_raw"][n] = raw_prefix_sums(lp, ref, rows, fi, E, M).tolist()
        return out
    sc = cached(os.path.join(workdir, "scores_eval.json"), score_key, compute_scores)
    timing["score"] = time.time() - t
    M = np.array(sc["step_mask"], np.int32)
    prm_scores = [(n, np.array(sc["q_raw"][n]), M) for n in prm_names]
    table = best_of_n_table(exp, test, ev, prm_scores, np.array(sc["ref_sum"]))
    fe = first_error_table(exp, ev, prm_scores)
    info = {"generator": {"eval_loss": gen["eval"].get("eval_loss", float("nan")),
                          "seconds": gen["train_seconds"], "steps_total": gen["steps_total"],
                          "workdir": gen_dir},
            "train_accuracy": float(np.mean(labels)), "n_pairs": n_pairs,
            "eval_accuracy": float(np.mean([e["correct"] for e in ev])),
            "eval_all_steps_correct": float(np.mean([e["all_steps_correct"] for e in ev])),
            "prm": prm_info, "prm_configs": prm_cfgs, "seq_len": seq_len, "paths": paths}
    return table, fe, prm_names, info


def main(argv=None):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description="Implicit PRM on the arithmetic testbed")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    a = p.parse_args(argv)
    t0 = time.time()
    exp = json.loads(json.dumps(PRESETS[a.preset]))
    os.makedirs(a.workdir, exist_ok=True)
    timing = {}
    table, fe, prm_names, info = run(exp, a.workdir, timing)
    seconds = time.time() - t0
    timing["total"] = seconds
    write_json(os.path.join(a.workdir, "config.json"),
               {"preset": a.preset, "experiment": exp, "info": info, "timing": timing})
    write_outputs(a.workdir, exp, a.preset, argv, info, table, fe, prm_names, seconds)
    _log(f"done in {seconds:.1f} s ({', '.join(f'{k} {v:.0f}s' for k, v in timing.items())}); "
         f"results in {a.workdir}/results.md")
    ns = sorted(table["random pick"])
    for s, res in table.items():
        _log(f"  {s:45s} " + " ".join(f"{res[n]:.3f}" for n in ns))
    for n in prm_names:
        _log(f"  first-error F1 {n}: {fe[n]['f1']:.3f}")
    return {"table": table, "first_error": fe, "prm_names": prm_names, "info": info}


if __name__ == "__main__":
    main()
