"""The computing stages of experiments/tgdpo_vs_dpo: training pairs, run configs, training,
evaluation (gold win rates, Monte-Carlo KL) and the per-token analysis; each run cached."""
import json
import os

import numpy as np

from experiments import preference_testbed
from experiments.common import (FrozenPolicy, cached, digest, flatten_overrides, round_up,
                                run_overrides, stopwatch)
from experiments.common import train_run as common_train_run

QUIET = {"train.samples": 0, "train.progress": False, "train.min_lr_ratio": 0.0,
         "train.weight_decay": 0.0}
CURVE_KEYS = ("loss", "rewards/margins", "rewards/accuracies", "rewards/chosen", "rewards/rejected")
N_BUCKETS = 5


# ----------------------------------------------------------------------------- data

def make_pairs(tb, workdir, guidance_part=None):
    """Writes the train/validation pair files; returns their paths and counts. With
    ``guidance_part`` (a part of ``tb["groups"]``, e.g. ``guidance_train``), also the guidance
    policy's own training pairs, from those groups by the same rule (``paths["guidance"]``)."""
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.data.sentiment_testbed import pairs_from_groups
    train_groups, eval_groups = tb["groups"]["tgdpo_train"], tb["groups"]["tgdpo_eval"]
    # the additive world's SFT samples can be empty (eos first), which a pair cannot hold
    keep = _nonempty if guidance_part else (lambda gs: gs)
    train = pairs_from_groups(keep(train_groups), rule="best_worst")
    val = pairs_from_groups(keep(eval_groups), rule="best_worst")
    if not train:
        raise RuntimeError("every tgdpo_train group is tied under the gold reward: no pairs")
    paths = {"train": os.path.join(workdir, "pairs_train.jsonl"),
             "eval": os.path.join(workdir, "pairs_eval.jsonl")}
    write_preference_jsonl(paths["train"], train)
    if val:
        write_preference_jsonl(paths["eval"], val)
    else:
        paths["eval"] = ""
    guide = []
    if guidance_part:
        guide = pairs_from_groups(keep(tb["groups"][guidance_part]), rule="best_worst")
        if not guide:
            raise RuntimeError(f"every {guidance_part} group is tied under the gold: no pairs")
        paths["guidance"] = os.path.join(workdir, "pairs_guidance.jsonl")
        write_preference_jsonl(paths["guidance"], guide)
    gap = [r["score_chosen"] - r["score_rejected"] for r in train]
    # data.seq_len: bos + the longest prompt + the longer response + eos, rounded up to 8
    import ml_collections

    from icml_jax.data.tokenizers import build_tokenizer
    tok = build_tokenizer(ml_collections.ConfigDict(tb["sft_config"]["data"]["tokenizer"]))
    n = lambda x: len(tok.encode(x))  # noqa: E731
    longest = max(2 + n(r["prompt"]) + max(n(r["chosen"]), n(r["rejected"]))
                  for r in train + val + guide)
    out = {"seq_len": round_up(longest, 8), "paths": paths,
           "n_train_groups": len(train_groups), "n_train": len(train),
           "n_tied_train": len(train_groups) - len(train), "n_eval_groups": len(eval_groups),
           "n_eval": len(val), "mean_gap": float(sum(gap) / len(gap)),
           "digest": digest([train, val])}
    if guidance_part:
        train_prompts = {r["prompt"] for r in train}
        out.update({"guidance_part": guidance_part,
                    "n_guidance_groups": len(tb["groups"][guidance_part]),
                    "n_guidance": len(guide), "guidance_digest": digest(guide),
                    "guidance_prompts_in_train": sum(r["prompt"] in train_prompts for r in guide)})
    return out


def _nonempty(groups):
    """The groups without their empty responses (and those responses' gold)."""
    out = []
    for g in groups:
        idx = [i for i, r in enumerate(g["responses"]) if r]
        out.append({**g, "responses": [g["responses"][i] for i in idx],
                    "gold": [g["gold"][i] for i in idx]})
    return out


# ----------------------------------------------------------------------------- configs

def run_config(exp, tb, pairs, seed, loss_type, alpha=0.0, guidance="", beta=None,
               data_path=None, steps=None):
    """``configs/dpo.py`` with the SFT policy's model and tokenizer and the preset's training;
    ``beta`` (default ``exp.beta``), ``data_path`` (default the train pairs) and ``steps``
    (default the preset's) for the additive presets' beta grid, the guidance policy's own pairs
    and the DPO runs of the KL sweep."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/dpo.py:default", unlocked=True)
    sft = tb["sft_config"]
    t = run_overrides(exp.train)
    n_eval = pairs["n_eval"] or min(pairs["n_train"], 4 * t["train.batch_size"])
    over = {**flatten_overrides({"model": sft["model"]}),
            **flatten_overrides({"data": {"tokenizer": sft["data"]["tokenizer"]}}),
            **t, **QUIET,
            "train.eval_batches": -(-n_eval // t["train.batch_size"]),  # ceil division
            "data.seq_len": min(int(pairs["seq_len"]), int(sft["model"]["max_seq_len"])),
            "train.init_from": tb["sft_workdir"],
            "data.path": data_path or pairs["paths"]["train"],
            "data.eval_path": pairs["paths"]["eval"], "loss.type": loss_type,
            "loss.beta": float(exp.beta if beta is None else beta),
            "loss.tgdpo_alpha": float(alpha),
            "loss.guidance": guidance}
    if steps is not None:  # the same schedule shape, stretched: trained and saved at its end
        over.update({"train.steps": int(steps), "train.eval_every": int(steps),
                     "train.checkpoint_every": int(steps)})
    cfg.update_from_flattened_dict(over)
    cfg.seed = int(seed)
    return cfg


def plan(exp):
    """[(run name, arm, alpha, seed, beta, steps)]: the guidance run first, then DPO and TGDPO per
    seed (the additive presets: per seed and beta of ``betas``, alpha = 0 being the DPO run, and
    DPO again for every step count of ``dpo_steps``: the KL sweep that extends DPO's frontier to
    the KL the TGDPO runs reach); steps None = the preset's ``train.steps``."""
    b0 = float(exp.beta)
    runs = [("guidance", "guidance", 0.0, int(exp.guidance_seed), b0, None)]
    if "betas" in exp:
        for s in exp.seeds:
            for b in exp.betas:
                for a in exp.alphas:
                    if float(a) == 0.0:
                        runs.append((f"dpo_b{b:g}_s{s}", "DPO", 0.0, int(s), float(b), None))
                    else:
                        runs.append((f"tgdpo_a{a:g}_b{b:g}_s{s}", f"TGDPO α={a:g}", float(a),
                                     int(s), float(b), None))
                for n in exp.get("dpo_steps", ()):
                    runs.append((f"dpo_b{b:g}_n{n}_s{s}", "DPO", 0.0, int(s), float(b), int(n)))
        return runs
    for s in exp.seeds:
        runs.append((f"dpo_s{s}", "DPO", 0.0, int(s), b0, None))
        for a in exp.alphas:
            runs.append((f"tgdpo_a{a:g}_s{s}", f"TGDPO α={a:g}", float(a), int(s), b0, None))
    return runs


def _config_of(exp, tb, pairs, workdir, name, arm, alpha, seed, beta, steps):
    """The run config of one entry of ``plan``."""
    loss_type = loss_of(arm)
    guidance = os.path.join(workdir, "guidance") if loss_type == "tgdpo" else ""
    data_path = pairs["paths"].get("guidance") if name == "guidance" else None
    return run_config(exp, tb, pairs, seed, loss_type, alpha, guidance, beta, data_path, steps)


def loss_of(arm):
    """The ``config.loss.type`` of an arm of ``plan``."""
    return "tgdpo" if arm.startswith("TGDPO") else "sigmoid"


def planned_configs(exp, tb, pairs, workdir):
    """{run: {arm, alpha, seed, config (JSON dict)}} of every planned run (config.json)."""
    out = {}
    for name, arm, alpha, seed, beta, steps in plan(exp):
        cfg = _config_of(exp, tb, pairs, workdir, name, arm, alpha, seed, beta, steps)
        out[name] = {"arm": arm, "alpha": alpha, "seed": seed,
                     "config": json.loads(cfg.to_json_best_effort())}
        if "betas" in exp:
            out[name]["beta"] = beta
    return out


# ----------------------------------------------------------------------------- evaluation

def win_rate(a, b) -> float:
    """Pairwise gold win rate of sample set ``a`` over ``b`` (win 1, tie 0.5, loss 0)."""
    a, b = np.asarray(a, np.float64)[:, None], np.asarray(b, np.float64)[None, :]
    return float(np.mean((a > b) + 0.5 * (a == b)))


def per_prompt_win(gold_a, gold_b):
    return [win_rate(a, b) for a, b in zip(gold_a, gold_b)]


def seq_kl(models, params, groups, max_new_tokens, batch_size):
    """Per sample: sum over response tokens of log pi - log pi_ref on the sampled sequence."""
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


def pop_se(x) -> float:
    """std / sqrt(n) with the population std (ddof = 0), as these s.e. columns always were
    (``common.mean_spread``'s se uses ddof = 1)."""
    return float(np.std(x) / np.sqrt(len(x)))


def evaluate_policy(models, params, tb, exp):
    elapsed = stopwatch()
    prompts = tb["prompts"]["tgdpo_eval"]
    ref_groups = tb["groups"]["tgdpo_eval"]
    mnt = int(tb["preset"]["max_new_tokens"])
    prompt_tokens = 1 + max(len(models.tok.encode(p)) for p in prompts)
    groups = preference_testbed.sample_groups(  # tb["gold"]: the additive world's, if it is one
        models.model, params, models.tok, prompts, int(exp.eval_samples),
        float(exp.eval_temperature), mnt, int(exp.eval_seed), int(exp.eval_batch_size),
        prompt_tokens=prompt_tokens, gold=tb.get("gold"))
    kl = seq_kl(models, params, groups, mnt, int(exp.eval_batch_size))
    gold = [g["gold"] for g in groups]
    wins = per_prompt_win(gold, [g["gold"] for g in ref_groups])
    lens = [len(r) for g in groups for r in g["responses"]]
    return {"win_vs_sft": float(np.mean(wins)), "win_vs_sft_se": pop_se(wins),
            "mean_gold": float(np.mean(gold)), "kl": float(np.mean(kl)),
            "kl_se": pop_se(kl), "mean_len": float(np.mean(lens)),
            "frac_zero_gold": float(np.mean(np.asarray(gold) == 0)),
            "groups": groups, "eval_seconds": elapsed()}


# ----------------------------------------------------------------------------- runs

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
    if tb.get("world") is not None:
        base_key["world"] = tb["world_key"]
    results = {}
    sft_res = cached(os.path.join(workdir, "sft_eval.json"), base_key,
                     lambda: evaluate_policy(get_models(), get_models().ref_params, tb, exp))
    results["sft"] = {"arm": "SFT", "alpha": float("nan"), "seed": "", **sft_res}
    guidance_key = None
    for name, arm, alpha, seed, beta, steps in plan(exp):
        run_dir = os.path.join(workdir, name)
        loss_type = loss_of(arm)
        cfg = _config_of(exp, tb, pairs, workdir, name, arm, alpha, seed, beta, steps)
        key = {**base_key, "config": json.loads(cfg.to_json_best_effort()),
               "guidance": guidance_key if loss_type == "tgdpo" else None}
        if name == "guidance" and "guidance" in pairs["paths"]:
            key["guidance_pairs"] = pairs["guidance_digest"]

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
                         **({"beta": beta, "steps": int(cfg.train.steps)} if "betas" in exp
                            else {}),
                         **{k: v for k, v in res.items() if k != "key"}}
        log(f"[tgdpo_vs_dpo] {name}: win vs SFT {res['win_vs_sft']:.3f}, gold "
            f"{res['mean_gold']:+.3f}, KL {res['kl']:.2f}, train acc "
            f"{res['final_train'].get('rewards/accuracies', float('nan')):.2f}")
    return results


# ----------------------------------------------------------------------------- per-token analysis

def cached_token_analysis(exp, tb, pairs, workdir, results):
    """``token_analysis``, cached in DIR/token_analysis.json under the runs' digests."""
    key = {"runs": {n: digest(r.get("curve", [])) + digest(r["groups"]) for n, r in results.items()},
           "pairs": pairs["digest"], "version": 1}
    return cached(os.path.join(workdir, "token_analysis.json"), key,
                  lambda: token_analysis(exp, tb, pairs, workdir, results))


def token_analysis(exp, tb, pairs, workdir, results):
    """On the training pairs: the token rewards r̂_t = beta (log pi_r - log pi_ref) of pi_r, the
    guidance factors TGDPO applies (1 + alpha r̂ on chosen, 1 - alpha r̂ on rejected tokens), and
    each final policy's chosen-token log-ratio rho_t = log pi - log pi_ref by r̂ quintile."""
    from icml_jax.data.preference import encode_pairs, read_preference_jsonl
    from icml_jax.tasks.pairs import batched_apply, flat
    m = FrozenPolicy(tb["sft_workdir"])
    arrays, _ = encode_pairs(read_preference_jsonl(pairs["paths"]["train"]), m.tok,
                             int(pairs["seq_len"]))
    rows = {k: flat(arrays[k]) for k in ("inputs", "positions", "segment_ids", "response_mask")}
    mask = rows["response_mask"] > 0
    bs = int(exp.eval_batch_size)
    lp = lambda params: batched_apply(lambda b: m.token_logps(params, b), rows, bs)  # noqa: E731
    ref = lp(m.ref_params)
    beta = float(exp.beta)
    r_hat = beta * (lp(m.params_of(os.path.join(workdir, "guidance"))) - ref)
    chosen = np.zeros_like(mask)
    chosen[0::2] = True  # flat() interleaves chosen (even rows) and rejected (odd rows)
    rc, rr = r_hat[mask & chosen], r_hat[mask & ~chosen]
    out = {"n_chosen_tokens": int(rc.size), "n_rejected_tokens": int(rr.size),
           "r_hat": {"chosen": _dist(rc), "rejected": _dist(rr)}, "factors": {}, "buckets": {}}
    for a in exp.alphas:
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
    return {"mean": float(np.mean(x)), "std": float(np.std(x)), "p05": float(np.quantile(x, 0.05)),
            "p95": float(np.quantile(x, 0.95)), "min": float(np.min(x)), "max": float(np.max(x))}


# ----------------------------------------------------------------------------- additive world

def cached_reward_recovery(exp, tb, pairs, workdir, results):
    """``reward_recovery``, cached in DIR/reward_recovery.json under the guidance run's digest
    and the evaluated samples."""
    key = {"guidance": digest(results["guidance"].get("curve", [])),
           "guidance_eval": digest(results["guidance"]["groups"]),
           "eval_ref": digest(tb["groups"]["tgdpo_eval"]), "world": tb["world_key"],
           "beta": float(exp.beta), "version": 1}
    return cached(os.path.join(workdir, "reward_recovery.json"), key,
                  lambda: reward_recovery(exp, tb, workdir))


def _corr(x, y):
    from scipy import stats
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return {"pearson": float("nan"), "spearman": float("nan"), "n": int(len(x))}
    return {"pearson": float(stats.pearsonr(x, y)[0]),
            "spearman": float(stats.spearmanr(x, y)[0]), "n": int(len(x))}


def reward_recovery(exp, tb, workdir):
    """The guidance policy's token rewards r̂_t = beta (log pi_r - log pi_ref)(y_t) (beta =
    ``exp.beta``, the guidance run's) against the world's true token rewards w[y_t], over the
    response tokens (eos excluded) of the SFT reference samples of the held-out ``tgdpo_eval``
    prompts: Pearson / Spearman over tokens; the same per letter (mean r̂ of each letter vs its
    w); and per sequence (sum of r̂ vs gold)."""
    from icml_jax.data.preference import encode_responses
    from icml_jax.tasks.pairs import batched_apply
    world = tb["world"]
    m = FrozenPolicy(tb["sft_workdir"])
    groups = tb["groups"]["tgdpo_eval"]
    prompts = [g["prompt"] for g in groups for r in g["responses"] if r]
    resp = [r for g in groups for r in g["responses"] if r]
    seq_len = round_up(1 + max(len(m.tok.encode(p)) + len(m.tok.encode(r))
                               for p, r in zip(prompts, resp)), 8)
    arrays, _ = encode_responses(prompts, resp, m.tok, seq_len, add_eos=False)
    rows = {k: arrays[k] for k in ("inputs", "positions", "segment_ids", "response_mask")}
    bs = int(exp.eval_batch_size)
    lp = lambda params: batched_apply(lambda b: m.token_logps(params, b), rows, bs)  # noqa: E731
    r_hat_all = float(exp.beta) * (lp(m.params_of(os.path.join(workdir, "guidance")))
                                   - lp(m.ref_params))
    r_hat, true, letter, seq_r, seq_gold = [], [], [], [], []
    for i, r in enumerate(resp):
        pos = np.flatnonzero(arrays["response_mask"][i] > 0)
        chars = r.encode("utf-8").decode("latin-1")  # one character per byte token
        if len(pos) != len(chars):
            raise RuntimeError(f"response {i}: {len(pos)} masked tokens for {len(chars)} bytes")
        rh = r_hat_all[i, pos]
        w = world.token_rewards(chars, unknown="zero")
        r_hat.append(rh)
        true.append(w)
        letter += world.letter_ids(chars, unknown="zero").tolist()
        seq_r.append(float(rh.sum()))
        seq_gold.append(float(w.sum()))
    r_hat, true, letter = np.concatenate(r_hat), np.concatenate(true), np.asarray(letter)
    per_letter = []
    for j, c in enumerate(world.alphabet):
        sel = letter == j
        per_letter.append({"letter": c, "w": float(world.weights[j]), "count": int(sel.sum()),
                           "mean_r_hat": float(r_hat[sel].mean()) if sel.any() else float("nan")})
    seen = [p for p in per_letter if p["count"]]
    return {"n_responses": len(resp), "n_tokens": int(r_hat.size),
            "frac_unknown_tokens": float(np.mean(letter < 0)),
            "token": _corr(r_hat, true),
            "letter": _corr(np.asarray([p["mean_r_hat"] for p in seen]),
                            np.asarray([p["w"] for p in seen])),
            "sequence": _corr(np.asarray(seq_r), np.asarray(seq_gold)),
            "per_letter": per_letter, "r_hat": _dist(r_hat), "beta": float(exp.beta)}
