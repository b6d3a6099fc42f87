"""TGDPO vs DPO from one SFT start, judged by a gold reward (docs/methods/tgdpo.md).

  python -m experiments.tgdpo_vs_dpo --workdir=DIR [--preset=tiny|default] [--testbed=TESTBED_DIR]

``--testbed`` (default ``DIR/testbed``) is the shared preference testbed
(``experiments/preference_testbed.py``, the preset's testbed dict): a byte-level SFT policy on
Shakespeare and gold-scored sample groups, gold = VADER compound sentiment of the continuation.

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
"""
import argparse
import json
import os
import sys
import time

from experiments import preference_testbed
from experiments.common import train_run as common_train_run
from experiments.common import (FrozenPolicy, save_figure, cached, digest, flatten_overrides, git_commit,
                                markdown_table, write_atomic, write_csv, write_json)
from icml_jax import xla_env

PRESETS = {
    "tiny": dict(
        testbed=preference_testbed.TINY, seeds=(0,), alphas=(0.5,), guidance_seed=1000,
        beta=0.1, eval_samples=2, eval_temperature=0.8, eval_seed=4242, eval_batch_size=32,
        train={"train.steps": 10, "train.batch_size": 4, "train.lr": 1e-3,
               "train.warmup_steps": 1, "train.log_every": 2, "train.eval_every": 10,
               "train.checkpoint_every": 10, "train.async_checkpoint": False},
    ),
    "default": dict(
        testbed=preference_testbed.DEFAULT, seeds=(0, 1), alphas=(0.5,), guidance_seed=1000,
        beta=0.1, eval_samples=4, eval_temperature=0.8, eval_seed=4242, eval_batch_size=64,
        # lr / steps from a probe (DPO, seed 0, not rerun by the experiment): at 3e-4 x 120 steps
        # the policy won 0.73 against SFT at a KL of 33 nats (train acc 1.0, val pair acc 0.60),
        # already overfit; 60 steps (2.6 epochs of the pairs) halves the cost
        train={"train.steps": 60, "train.batch_size": 16,
               "train.lr": 3e-4, "train.warmup_steps": 6, "train.log_every": 5,
               "train.eval_every": 30, "train.checkpoint_every": 30},
    ),
}
QUIET = {"train.samples": 0, "train.progress": False, "train.min_lr_ratio": 0.0,
         "train.weight_decay": 0.0}


# ----------------------------------------------------------------------------- data

def make_pairs(tb, workdir):
    """Writes the train/validation pair files; returns their paths and counts."""
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.data.sentiment_testbed import pairs_from_groups
    train_groups, eval_groups = tb["groups"]["tgdpo_train"], tb["groups"]["tgdpo_eval"]
    train = pairs_from_groups(train_groups, rule="best_worst")
    val = pairs_from_groups(eval_groups, rule="best_worst")
    if not train:
        raise RuntimeError("every tgdpo_train group is tied under the gold reward: no pairs")
    paths = {"train": os.path.join(workdir, "pairs_train.jsonl"),
             "eval": os.path.join(workdir, "pairs_eval.jsonl")}
    write_preference_jsonl(paths["train"], train)
    if val:
        write_preference_jsonl(paths["eval"], val)
    else:
        paths["eval"] = ""
    gap = [r["score_chosen"] - r["score_rejected"] for r in train]
    # data.seq_len: bos + the longest prompt + the longer response + eos, rounded up to 8
    import ml_collections

    from icml_jax.data.tokenizers import build_tokenizer
    tok = build_tokenizer(ml_collections.ConfigDict(tb["sft_config"]["data"]["tokenizer"]))
    n = lambda x: len(tok.encode(x))  # noqa: E731
    longest = max(2 + n(r["prompt"]) + max(n(r["chosen"]), n(r["rejected"])) for r in train + val)
    return {"seq_len": -(-longest // 8) * 8, "paths": paths,
            "n_train_groups": len(train_groups), "n_train": len(train),
            "n_tied_train": len(train_groups) - len(train), "n_eval_groups": len(eval_groups),
            "n_eval": len(val), "mean_gap": float(sum(gap) / len(gap)),
            "digest": digest([train, val])}


# ----------------------------------------------------------------------------- configs

def run_config(exp, tb, pairs, seed, loss_type, alpha=0.0, guidance=""):
    """``configs/dpo.py`` with the SFT policy's model and tokenizer and the preset's training."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/dpo.py:default", unlocked=True)
    sft = tb["sft_config"]
    t = dict(exp["train"])
    n_eval = pairs["n_eval"] or min(pairs["n_train"], 4 * t["train.batch_size"])
    over = {**flatten_overrides({"model": sft["model"]}), **flatten_overrides({"data": {"tokenizer": sft["data"]["tokenizer"]}}),
            **t, **QUIET,
            "train.eval_batches": -(-n_eval // t["train.batch_size"]),
            "data.seq_len": min(int(pairs["seq_len"]), int(sft["model"]["max_seq_len"])),
            "train.init_from": tb["sft_workdir"],
            "data.path": pairs["paths"]["train"],
            "data.eval_path": pairs["paths"]["eval"], "loss.type": loss_type,
            "loss.beta": float(exp["beta"]), "loss.tgdpo_alpha": float(alpha),
            "loss.guidance": guidance}
    cfg.update_from_flattened_dict(over)
    cfg.seed = int(seed)
    return cfg


def plan(exp):
    """[(run name, arm, alpha, seed)]: the guidance run first, then DPO and TGDPO per seed."""
    runs = [("guidance", "guidance", 0.0, int(exp["guidance_seed"]))]
    for s in exp["seeds"]:
        runs.append((f"dpo_s{s}", "DPO", 0.0, int(s)))
        for a in exp["alphas"]:
            runs.append((f"tgdpo_a{a:g}_s{s}", f"TGDPO α={a:g}", float(a), int(s)))
    return runs


# ----------------------------------------------------------------------------- evaluation

def win_rate(a, b) -> float:
    """Pairwise gold win rate of sample set ``a`` over ``b`` (win 1, tie 0.5, loss 0)."""
    import numpy as np
    a, b = np.asarray(a, np.float64)[:, None], np.asarray(b, np.float64)[None, :]
    return float(np.mean((a > b) + 0.5 * (a == b)))


def per_prompt_win(gold_a, gold_b):
    return [win_rate(a, b) for a, b in zip(gold_a, gold_b)]


def seq_kl(models, params, groups, max_new_tokens, batch_size):
    """Per sample: sum over response tokens of log pi - log pi_ref on the sampled sequence."""
    import numpy as np

    from icml_jax.data.preference import encode_responses
    from icml_jax.tasks.pairs import batched_apply
    prompts = [g["prompt"] for g in groups for _ in g["responses"]]
    resp = [r for g in groups for r in g["responses"]]
    tok = models.tok
    seq_len = 1 + max(len(tok.encode(p)) for p in prompts) + max_new_tokens + 1
    seq_len = max(seq_len, 1 + max(len(tok.encode(p)) + len(tok.encode(r)) for p, r in
                                   zip(prompts, resp)) + 1)
    arrays, _ = encode_responses(prompts, resp, tok, seq_len, add_eos=True)
    # a sample that ran to max_new_tokens did not emit eos: leave the appended eos out
    for i, r in enumerate(resp):
        if len(tok.encode(r)) >= max_new_tokens:
            arrays["response_mask"][i, arrays["lengths"][i] - 1] = 0
    rows = {k: arrays[k] for k in ("inputs", "positions", "segment_ids", "response_mask")}
    lp = batched_apply(lambda b: models.token_logps(params, b), rows, batch_size)
    ref = batched_apply(lambda b: models.token_logps(models.ref_params, b), rows, batch_size)
    return np.sum((lp - ref) * (arrays["response_mask"] > 0), axis=1)


def evaluate_policy(models, params, tb, exp):
    import numpy as np

    t0 = time.time()
    prompts = tb["prompts"]["tgdpo_eval"]
    ref_groups = tb["groups"]["tgdpo_eval"]
    mnt = int(tb["preset"]["max_new_tokens"])
    prompt_tokens = 1 + max(len(models.tok.encode(p)) for p in prompts)
    groups = preference_testbed.sample_groups(models.model, params, models.tok, prompts, int(exp["eval_samples"]),
                           float(exp["eval_temperature"]), mnt, int(exp["eval_seed"]),
                           int(exp["eval_batch_size"]), prompt_tokens=prompt_tokens)
    kl = seq_kl(models, params, groups, mnt, int(exp["eval_batch_size"]))
    gold = [g["gold"] for g in groups]
    wins = per_prompt_win(gold, [g["gold"] for g in ref_groups])
    lens = [len(r) for g in groups for r in g["responses"]]
    return {"win_vs_sft": float(np.mean(wins)), "win_vs_sft_se": float(np.std(wins) / np.sqrt(len(wins))),
            "mean_gold": float(np.mean(gold)), "kl": float(np.mean(kl)),
            "kl_se": float(np.std(kl) / np.sqrt(len(kl))), "mean_len": float(np.mean(lens)),
            "frac_zero_gold": float(np.mean(np.asarray(gold) == 0)),
            "groups": groups, "eval_seconds": time.time() - t0}


# ----------------------------------------------------------------------------- runs

CURVE_KEYS = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")


def train_run(cfg, workdir):
    """Trains (or resumes) one run (``experiments.common.train_run``); its training curve and
    final train/eval metrics."""
    summary, rows, seconds = common_train_run(cfg, workdir)
    curve = [{"step": r["step"], **{k: r[k] for k in CURVE_KEYS if k in r}} for r in rows]
    ev = {k: float(v) for k, v in summary.items() if k.startswith("eval_")}
    tail = curve[-max(1, len(curve) // 5):]
    final = {k: float(sum(c[k] for c in tail) / len(tail)) for k in CURVE_KEYS if k in tail[0]}
    return {"curve": curve, "final_train": final, "eval_pairs": ev, "step": int(summary["step"]),
            "train_seconds": seconds}


def run_all(exp, tb, pairs, workdir, log=print):
    """Every run's digest, cached in DIR/<run>/result.json; plus the SFT calibration row."""
    models = None

    def get_models():
        nonlocal models
        if models is None:
            models = FrozenPolicy(tb["sft_workdir"])
        return models

    eval_key = {k: exp[k] for k in ("eval_samples", "eval_temperature", "eval_seed",
                                     "eval_batch_size")}
    base_key = {"sft": digest(tb["sft_config"]), "eval_ref": digest(tb["groups"]["tgdpo_eval"]),
                "pairs": pairs["digest"], "eval": eval_key, "version": 1}
    results = {}
    sft_res = cached(os.path.join(workdir, "sft_eval.json"), base_key,
                     lambda: evaluate_policy(get_models(), get_models().ref_params, tb, exp))
    results["sft"] = {"arm": "SFT", "alpha": float("nan"), "seed": "", **sft_res}
    guidance_dir = os.path.join(workdir, "guidance")
    guidance_key = None
    for name, arm, alpha, seed in plan(exp):
        run_dir = os.path.join(workdir, name)
        loss_type = "tgdpo" if arm.startswith("TGDPO") else "sigmoid"
        cfg = run_config(exp, tb, pairs, seed, loss_type, alpha,
                         guidance_dir if loss_type == "tgdpo" else "")
        key = {**base_key, "config": json.loads(cfg.to_json_best_effort()),
               "guidance": guidance_key if loss_type == "tgdpo" else None}

        def compute(cfg=cfg, run_dir=run_dir, name=name):
            log(f"[tgdpo_vs_dpo] training {name}")
            tr = train_run(cfg, run_dir)
            log(f"[tgdpo_vs_dpo] evaluating {name}")
            m = get_models()
            ev = evaluate_policy(m, m.params_of(run_dir), tb, exp)
            return {**tr, **ev}

        res = cached(os.path.join(run_dir, "result.json"), key, compute)
        if name == "guidance":
            guidance_key = digest(res["key"])
        results[name] = {"arm": arm, "alpha": alpha, "seed": seed,
                         **{k: v for k, v in res.items() if k != "key"}}
        log(f"[tgdpo_vs_dpo] {name}: win vs SFT {res['win_vs_sft']:.3f}, gold "
            f"{res['mean_gold']:+.3f}, KL {res['kl']:.2f}, train acc "
            f"{res['final_train'].get('rewards/accuracies', float('nan')):.2f}")
    return results


# ----------------------------------------------------------------------------- per-token analysis

N_BUCKETS = 5


def token_analysis(exp, tb, pairs, workdir, results):
    """On the training pairs: the token rewards r̂_t = beta (log pi_r - log pi_ref) of pi_r, the
    guidance factors TGDPO applies (1 + alpha r̂ on chosen, 1 - alpha r̂ on rejected tokens), and
    each final policy's chosen-token log-ratio rho_t = log pi - log pi_ref by r̂ quintile."""
    import numpy as np

    from icml_jax.data.preference import encode_pairs, read_preference_jsonl
    from icml_jax.tasks.pairs import batched_apply, flat
    m = FrozenPolicy(tb["sft_workdir"])
    arrays, _ = encode_pairs(read_preference_jsonl(pairs["paths"]["train"]), m.tok,
                             int(pairs["seq_len"]))
    rows = {k: flat(arrays[k]) for k in ("inputs", "positions", "segment_ids", "response_mask")}
    mask = rows["response_mask"] > 0
    bs = int(exp["eval_batch_size"])
    lp = lambda params: batched_apply(lambda b: m.token_logps(params, b), rows, bs)  # noqa: E731
    ref = lp(m.ref_params)
    beta = float(exp["beta"])
    r_hat = beta * (lp(m.params_of(os.path.join(workdir, "guidance"))) - ref)
    chosen = np.zeros_like(mask)
    chosen[0::2] = True  # flat() interleaves chosen (even rows) and rejected (odd rows)
    rc, rr = r_hat[mask & chosen], r_hat[mask & ~chosen]
    out = {"n_chosen_tokens": int(rc.size), "n_rejected_tokens": int(rr.size),
           "r_hat": {"chosen": _dist(rc), "rejected": _dist(rr)}, "factors": {}, "buckets": {}}
    for a in exp["alphas"]:
        out["factors"][f"{a:g}"] = {"chosen": _dist(1 + a * rc), "rejected": _dist(1 - a * rr),
                                    "frac_nonpositive": float(np.mean(np.concatenate(
                                        [1 + a * rc, 1 - a * rr]) <= 0))}
    edges = np.quantile(rc, np.linspace(0, 1, N_BUCKETS + 1))
    which = np.clip(np.searchsorted(edges, rc, side="right") - 1, 0, N_BUCKETS - 1)
    out["bucket_edges"] = [float(e) for e in edges]
    for name, r in results.items():
        if name in ("sft", "guidance"):
            continue
        rho = (lp(m.params_of(os.path.join(workdir, name))) - ref)[mask & chosen]
        out["buckets"][name] = [float(rho[which == b].mean()) for b in range(N_BUCKETS)]
    return out


def _dist(x):
    import numpy as np
    return {"mean": float(np.mean(x)), "std": float(np.std(x)), "p05": float(np.quantile(x, 0.05)),
            "p95": float(np.quantile(x, 0.95)), "min": float(np.min(x)), "max": float(np.max(x))}


def token_lines(ta, results):
    """results.md lines of the per-token analysis."""
    import numpy as np
    d = ta["r_hat"]
    lines = [f"Token rewards of pi_r on the {ta['n_chosen_tokens']} chosen / "
             f"{ta['n_rejected_tokens']} rejected training tokens: r̂ = β(log π_r − log π_ref) has "
             f"mean {d['chosen']['mean']:+.4f} (5–95%: {d['chosen']['p05']:+.3f} … "
             f"{d['chosen']['p95']:+.3f}) on chosen and {d['rejected']['mean']:+.4f} "
             f"({d['rejected']['p05']:+.3f} … {d['rejected']['p95']:+.3f}) on rejected tokens."]
    for a, f in ta["factors"].items():
        lines.append(f"With α = {a} TGDPO's guidance factors are 1 + αr̂ ∈ [{f['chosen']['p05']:.3f}, "
                     f"{f['chosen']['p95']:.3f}] (5–95%) on chosen and 1 − αr̂ ∈ "
                     f"[{f['rejected']['p05']:.3f}, {f['rejected']['p95']:.3f}] on rejected tokens "
                     f"({f['frac_nonpositive']:.1%} ≤ 0).")
    lines += ["", "Mean chosen-token log-ratio ρ = log π − log π_ref of the final policies, by "
              "quintile of r̂ (low → high; the spec expects TGDPO's ρ to grow more for high-r̂ "
              "tokens):", ""]
    arms = {}
    for name, b in ta["buckets"].items():
        arms.setdefault(results[name]["arm"], []).append(b)
    e = ta["bucket_edges"]
    header = ["arm"] + [f"r̂ ∈ [{e[i]:+.3f}, {e[i + 1]:+.3f}]" for i in range(N_BUCKETS)]
    body = [[arm] + [f"{v:+.3f}" for v in np.mean(bs, axis=0)] for arm, bs in arms.items()]
    return lines + [markdown_table(header, body)]


# ----------------------------------------------------------------------------- summaries

CSV_FIELDS = ("run", "arm", "alpha", "seed", "steps", "win_vs_sft", "win_vs_sft_se", "mean_gold",
              "kl", "kl_se", "h2h_vs_dpo", "mean_len", "frac_zero_gold", "train_loss",
              "train_accuracy", "train_margin", "eval_accuracy", "eval_margin", "train_seconds",
              "eval_seconds")


def head_to_head(results, exp):
    """TGDPO run -> (win rate vs the DPO run of its seed, per-prompt values)."""
    out = {}
    for name, r in results.items():
        if r["arm"].startswith("TGDPO"):
            dpo = results[f"dpo_s{r['seed']}"]
            out[name] = per_prompt_win([g["gold"] for g in r["groups"]],
                                       [g["gold"] for g in dpo["groups"]])
    return out


def csv_rows(results, h2h):
    import numpy as np
    rows = []
    for name, r in results.items():
        ft, ev = r.get("final_train", {}), r.get("eval_pairs", {})
        rows.append(dict(
            run=name, arm=r["arm"], alpha="" if name == "sft" else r["alpha"], seed=r["seed"],
            steps=r.get("step", 0), win_vs_sft=round(r["win_vs_sft"], 5),
            win_vs_sft_se=round(r["win_vs_sft_se"], 5), mean_gold=round(r["mean_gold"], 5),
            kl=round(r["kl"], 5), kl_se=round(r["kl_se"], 5),
            h2h_vs_dpo=round(float(np.mean(h2h[name])), 5) if name in h2h else "",
            mean_len=round(r["mean_len"], 2), frac_zero_gold=round(r["frac_zero_gold"], 4),
            train_loss=_r(ft.get("loss")), train_accuracy=_r(ft.get("rewards/accuracies")),
            train_margin=_r(ft.get("rewards/margins")),
            eval_accuracy=_r(ev.get("eval_rewards/accuracies")),
            eval_margin=_r(ev.get("eval_rewards/margins")),
            train_seconds=_r(r.get("train_seconds"), 1), eval_seconds=_r(r.get("eval_seconds"), 1)))
    return rows


def _r(x, nd=5):
    return "" if x is None else round(float(x), nd)


def arm_stats(results, h2h):
    """arm -> {metric: (mean, std over seeds, n)} over the main runs (guidance, SFT excluded)."""
    import numpy as np
    arms = {}
    for name, r in results.items():
        if name in ("sft", "guidance"):
            continue
        arms.setdefault(r["arm"], []).append(name)
    out = {}
    for arm, names in arms.items():
        def ms(vals):
            v = np.asarray(vals, np.float64)
            return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0, len(v)
        rs = [results[n] for n in names]
        out[arm] = {"win_vs_sft": ms([r["win_vs_sft"] for r in rs]),
                    "mean_gold": ms([r["mean_gold"] for r in rs]),
                    "kl": ms([r["kl"] for r in rs]),
                    "train_accuracy": ms([r["final_train"].get("rewards/accuracies", np.nan) for r in rs]),
                    "eval_accuracy": ms([r["eval_pairs"].get("eval_rewards/accuracies", np.nan) for r in rs]),
                    "runs": names}
        if names[0] in h2h:
            pooled = np.concatenate([h2h[n] for n in names])
            out[arm]["h2h"] = ms([np.mean(h2h[n]) for n in names])
            out[arm]["h2h_se"] = float(pooled.std() / np.sqrt(len(pooled)))
    return out


def _pm(t, nd=3):
    return f"{t[0]:.{nd}f} ± {t[1]:.{nd}f}"


def reading(stats, results):
    """A plain statement of whether the paper's direction shows (generated from the numbers)."""
    dpo = stats["DPO"]
    lines = []
    for arm, s in stats.items():
        if arm == "DPO":
            continue
        d_win = s["win_vs_sft"][0] - dpo["win_vs_sft"][0]
        noise = s["win_vs_sft"][1] + dpo["win_vs_sft"][1]
        h, hse = s["h2h"][0], s["h2h_se"]
        kl_ratio = s["kl"][0] / dpo["kl"][0] if dpo["kl"][0] > 0 else float("nan")
        similar_kl = 0.75 <= kl_ratio <= 1.33
        resolved_h2h = abs(h - 0.5) > 2 * hse
        resolved_win = s["win_vs_sft"][2] > 1 and abs(d_win) > noise
        if d_win > 0 and h > 0.5 and similar_kl and resolved_h2h:
            verdict = "shows here: TGDPO wins more often at a similar KL"
        elif d_win > 0 and h > 0.5:
            verdict = ("points the paper's way but is not resolved" +
                       ("" if similar_kl else " (and the KLs differ by more than a third)"))
        else:
            verdict = "does not show here"
        lines.append(
            f"* **{arm} vs DPO.** Win rate against the SFT policy {_pm(s['win_vs_sft'])} vs "
            f"{_pm(dpo['win_vs_sft'])} (Δ = {d_win:+.3f}; the seed stds sum to {noise:.3f}"
            f"{'' if resolved_win else ', so the difference is within seed noise'}); mean gold "
            f"{s['mean_gold'][0]:+.3f} vs {dpo['mean_gold'][0]:+.3f}; KL {s['kl'][0]:.2f} vs "
            f"{dpo['kl'][0]:.2f} nats ({kl_ratio:.2f}×). Head-to-head against the DPO policy of the "
            f"same seed: {h:.3f} (± {hse:.3f} s.e. over prompts; 0.5 = even"
            f"{'' if resolved_h2h else ', within 2 s.e. of even'}). The paper's direction "
            f"(TGDPO beats DPO at a similar KL) {verdict}.")
    sft = results["sft"]
    lines.append(f"* **Calibration.** Fresh SFT samples win {sft['win_vs_sft']:.3f} against the SFT "
                 f"reference samples (0.5 expected) at mean gold {sft['mean_gold']:+.3f}; "
                 f"{sft['frac_zero_gold']:.0%} of SFT samples have gold exactly 0 (no VADER word), "
                 "so many comparisons are ties.")
    return lines


# ----------------------------------------------------------------------------- plots

def _colors(arms):
    base = {"DPO": "tab:blue", "SFT": "black", "guidance": "tab:gray"}
    extra = iter(["tab:orange", "tab:red", "tab:green", "tab:purple"])
    return {a: base.get(a) or next(extra) for a in arms}


def plot_win_vs_kl(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = list(dict.fromkeys(r["arm"] for r in results.values()))
    col = _colors(arms)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    seen = set()
    for name, r in results.items():
        ax.errorbar(r["kl"], r["win_vs_sft"], xerr=r["kl_se"], yerr=r["win_vs_sft_se"], 
                    fmt="s" if name in ("sft", "guidance") else "o", color=col[r["arm"]],
                    label=None if r["arm"] in seen else r["arm"], capsize=2)
        seen.add(r["arm"])
    ax.axhline(0.5, color="gray", lw=0.8, ls=":")
    ax.set_xlabel("KL to reference (MC, nats per sequence)")
    ax.set_ylabel("gold win rate vs SFT samples")
    ax.set_title("TGDPO vs DPO (held-out prompts; bars: ±1 s.e.)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def plot_curves(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {n: r for n, r in results.items() if n != "sft"}
    col = _colors(list(dict.fromkeys(r["arm"] for r in runs.values())))
    keys = ("loss", "rewards/margins", "rewards/accuracies")
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    seen = set()
    for name, r in runs.items():
        steps = [c["step"] for c in r["curve"]]
        for ax, k in zip(axes, keys):
            ax.plot(steps, [c.get(k, float("nan")) for c in r["curve"]], color=col[r["arm"]],
                    alpha=0.8, lw=1.2, label=None if r["arm"] in seen else r["arm"])
        seen.add(r["arm"])
    for ax, k in zip(axes, keys):
        ax.set_xlabel("step")
        ax.set_title(f"train {k}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ----------------------------------------------------------------------------- driver

def write_outputs(workdir, exp, preset, argv, tb, pairs, results, seconds, ta):
    h2h = head_to_head(results, exp)
    rows = csv_rows(results, h2h)
    write_csv(os.path.join(workdir, "results.csv"), rows, CSV_FIELDS)
    stats = arm_stats(results, h2h)
    cmd = "python -m experiments.tgdpo_vs_dpo " + " ".join(argv)
    t = exp["train"]
    md = [f"# TGDPO vs DPO on the sentiment testbed ({preset} preset)", "",
          f"Command: `{cmd}` | seeds {list(exp['seeds'])} (data order; guidance pi_r seed "
          f"{exp['guidance_seed']}) | commit {git_commit()} | wall time {seconds[0]:.0f} s this "
          f"invocation ({seconds[1]:.0f} s for the longest one in this workdir, the one that "
          "computed the runs; the testbed's own build time is in its testbed.json).", "",
          f"SFT policy: {tb['sft_config']['model']['num_layers']} layers, d = "
          f"{tb['sft_config']['model']['d_model']}, byte tokens (testbed "
          f"`{tb['workdir']}`). Gold: VADER compound sentiment of the continuation. Pairs: best vs "
          f"worst of 5 SFT samples (T = 0.8) for {pairs['n_train_groups']} prompts → "
          f"{pairs['n_train']} pairs ({pairs['n_tied_train']} tied group(s) skipped; mean gold gap "
          f"{pairs['mean_gap']:.3f}); validation pairs: {pairs['n_eval']} from the SFT reference "
          f"samples of {pairs['n_eval_groups']} held-out prompts. Every run: {t['train.steps']} steps "
          f"× {t['train.batch_size']} pairs, lr {t['train.lr']:g} (warmup "
          f"{t['train.warmup_steps']}, cosine to 0), beta {exp['beta']}, from the SFT start; TGDPO is "
          "guided by the DPO policy pi_r trained on the same pairs (seed "
          f"{exp['guidance_seed']}). Evaluation: {exp['eval_samples']} samples per held-out prompt "
          f"at T = {exp['eval_temperature']} against the {tb['preset']['responses']['tgdpo_eval']} "
          "SFT reference samples of each prompt.", "",
          "## Main table (mean ± std over seeds)", ""]
    header = ["arm", "runs", "win rate vs SFT", "mean gold", "KL (nats)", "h2h vs DPO",
              "train acc", "val pair acc"]
    body = []
    for arm, s in stats.items():
        body.append([arm, s["win_vs_sft"][2], _pm(s["win_vs_sft"]), _pm(s["mean_gold"]),
                     _pm(s["kl"], 2), _pm(s["h2h"]) if "h2h" in s else "—",
                     _pm(s["train_accuracy"], 2), _pm(s["eval_accuracy"], 2)])
    sft = results["sft"]
    body.append(["SFT (fresh samples)", 1, f"{sft['win_vs_sft']:.3f}", f"{sft['mean_gold']:+.3f}",
                 f"{sft['kl']:.2f}", "—", "—", "—"])
    md.append(markdown_table(header, body))
    md += ["Win rate: per prompt, all (policy sample, SFT sample) pairs, 1 win / 0.5 tie / 0 loss "
           "under gold, averaged. KL: Monte-Carlo sequence-level estimate on the policy's own "
           "samples, mean over samples of Σ_t (log π − log π_ref) over the response tokens (at "
           "temperature 1; the samples are drawn at T = 0.8, so it is the log-ratio expected under "
           "the sampling distribution). h2h: TGDPO vs the DPO policy of the same seed, same rule. "
           "train acc: `rewards/accuracies` over the last fifth of training; val pair acc: "
           "`eval_rewards/accuracies` on the validation pairs at the end.", "",
           "## Reading", ""] + reading(stats, results) + [
               "", "## Per-token analysis (training pairs)", ""] + token_lines(ta, results) + [
               "## Per run", ""]
    md.append(markdown_table(
        ["run", "arm", "seed", "win vs SFT", "mean gold", "KL", "h2h vs DPO", "train acc",
         "train margin", "val acc", "train s", "eval s"],
        [[r["run"], r["arm"], r["seed"], r["win_vs_sft"], r["mean_gold"], r["kl"], r["h2h_vs_dpo"],
          r["train_accuracy"], r["train_margin"], r["eval_accuracy"], r["train_seconds"],
          r["eval_seconds"]] for r in rows]))
    md += ["Plots: `win_rate_vs_kl.png` (one point per run), `training_curves.png` (train loss, "
           "rewards/margins, rewards/accuracies per logged step)."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_win_vs_kl(results, os.path.join(workdir, "win_rate_vs_kl.png"))
    plot_curves(results, os.path.join(workdir, "training_curves.png"))
    return stats


def main(argv=None):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description="TGDPO vs DPO on the sentiment testbed")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--testbed", default="", help="testbed folder (default: WORKDIR/testbed)")
    a = p.parse_args(argv)
    t0 = time.time()
    exp = json.loads(json.dumps(PRESETS[a.preset]))
    os.makedirs(a.workdir, exist_ok=True)
    tb_dir = a.testbed or os.path.join(a.workdir, "testbed")
    tb = preference_testbed.build_testbed(tb_dir, exp["testbed"])
    t_tb = time.time() - t0
    pairs = make_pairs(tb, a.workdir)
    print(f"[tgdpo_vs_dpo] {pairs['n_train']} train pairs ({pairs['n_tied_train']} tied groups "
          f"skipped), {pairs['n_eval']} validation pairs", flush=True)
    write_json(os.path.join(a.workdir, "config.json"), {
        "preset": a.preset, "experiment": exp, "testbed": tb_dir,
        "pairs": {k: v for k, v in pairs.items()},
        "runs": {name: {"arm": arm, "alpha": alpha, "seed": seed,
                        "config": json.loads(run_config(
                            exp, tb, pairs, seed, "tgdpo" if arm.startswith("TGDPO") else "sigmoid",
                            alpha, os.path.join(a.workdir, "guidance")
                            if arm.startswith("TGDPO") else "").to_json_best_effort())}
                 for name, arm, alpha, seed in plan(exp)}})
    results = run_all(exp, tb, pairs, a.workdir, log=lambda *m: print(*m, flush=True))
    ta = cached(os.path.join(a.workdir, "token_analysis.json"),
                {"runs": {n: digest(r.get("curve", [])) + digest(r["groups"]) for n, r in results.items()},
                 "pairs": pairs["digest"], "version": 1},
                lambda: token_analysis(exp, tb, pairs, a.workdir, results))
    seconds = time.time() - t0
    timing_path = os.path.join(a.workdir, "timing.json")
    old = json.load(open(timing_path)) if os.path.exists(timing_path) else {}
    longest = max(seconds, old.get("longest_invocation_seconds",
                                   old.get("seconds_this_invocation", 0.0)))
    stats = write_outputs(a.workdir, exp, a.preset, argv, tb, pairs, results,
                          (seconds, longest), ta)
    write_json(timing_path, {"seconds_this_invocation": seconds,
                             "longest_invocation_seconds": longest,
                             "testbed_seconds_this_invocation": t_tb,
                             "testbed_measured": tb["seconds"]})
    print(f"[tgdpo_vs_dpo] done in {seconds:.1f} s; results in {a.workdir}/results.md")
    for arm, s in stats.items():
        print(f"  {arm:14s} win vs SFT {_pm(s['win_vs_sft'])}  gold {_pm(s['mean_gold'])}  "
              f"KL {_pm(s['kl'], 2)}" + (f"  h2h {_pm(s['h2h'])}" if "h2h" in s else ""))
    return results


if __name__ == "__main__":
    main()
