"""The computing stages of experiments/bsr_robustness: the testbed and the preference pairs, one
reward-model config per (arm, seed), training and scoring each run (cached), and the metrics."""
import json
import os

import numpy as np

from experiments.bsr_robustness.presets import ARMS, seeds_of
from experiments.common import cached, digest, mean_spread, round_up, run_overrides, stopwatch

SPLITS = ("val_in", "val_prompt_ood", "val_response_ood", "val_both_ood")
OOD_SPLITS = SPLITS[1:]
NS = (1, 2, 4, 8, 16, 32, 64)  # best-of-N sizes unless a preset gives its own ``ns``
QUIET = {"train.samples": 0, "train.progress": False, "train.async_checkpoint": False,
         "train.min_lr_ratio": 0.0, "train.weight_decay": 0.0}


def ns_of(exp) -> tuple[int, ...]:
    """The best-of-N sizes of ``exp``: its ``ns`` if given, else ``NS``."""
    return tuple(int(n) for n in exp.ns) if "ns" in exp else NS


def additive_testbed(exp) -> dict:
    """The token-additive gold world's groups (``icml_jax.data.additive_gold``) in the testbed's
    layout: ``val_response_ood`` are the hot responses (``val_temp_ood`` there), no SFT policy
    (``sft_workdir`` empty: the reward model starts from scratch, with ``exp.model``'s decoder)."""
    from icml_jax.config_utils import load_config
    from icml_jax.data import additive_gold as ag
    from icml_jax.data import sentiment_testbed as tb
    w = exp.world
    world = ag.make_world(int(w.seed), num_letters=int(w.num_letters))
    splits = ag.make_splits(world, int(w.split_seed), n_train=int(w.n_train), n_val=int(w.n_val),
                            n_per_prompt=int(w.n_per_prompt), prompt_len=int(w.prompt_len),
                            response_len=int(w.response_len), tilt=float(w.tilt),
                            ood_temperature=float(w.ood_temperature), n_bon=int(w.n_bon),
                            bon_per_prompt=int(w.bon_per_prompt))
    splits["val_response_ood"] = splits.pop("val_temp_ood")
    base = load_config(exp.model)
    return {"groups": splits, "stats": {k: tb.gold_stats(v) for k, v in splits.items()},
            "sft_config": {"model": base.model.to_dict(),
                           "data": {"tokenizer": base.data.tokenizer.to_dict()}},
            "sft_workdir": "", "sft": {"seconds": 0.0}}


def prepare(wd: str, tb_dir: str, exp) -> dict:
    """Builds (or loads) the testbed, writes the train / val_in preference pairs and returns
    ``{"testbed", "testbed_s" (seconds this run), "groups", "train_rows", "val_rows", "paths",
    "seq_len", "data_key" (digest of the pairs and the scored groups)}``."""
    import ml_collections

    from experiments.preference_testbed import build_testbed, preset_dict
    from icml_jax.data import sentiment_testbed as tb
    from icml_jax.data.preference import write_preference_jsonl
    from icml_jax.data.tokenizers import build_tokenizer
    os.makedirs(wd, exist_ok=True)
    elapsed = stopwatch()
    testbed = (additive_testbed(exp) if "world" in exp
               else build_testbed(tb_dir, preset_dict(exp.testbed)))
    testbed_s = elapsed()
    groups = testbed["groups"]

    train_rows = tb.pairs_from_groups(groups["train"], exp.pair_rule, exp.min_gap)
    val_rows = tb.pairs_from_groups(groups["val_in"], exp.pair_rule, exp.min_gap)
    if not train_rows or not val_rows:
        raise RuntimeError(f"no informative pairs ({len(train_rows)} train, {len(val_rows)} val_in)"
                           " : the testbed's gold is constant within every group")
    paths = {"train": os.path.join(wd, "pairs_train.jsonl"),
             "val_in": os.path.join(wd, "pairs_val_in.jsonl")}
    write_preference_jsonl(paths["train"], train_rows)
    write_preference_jsonl(paths["val_in"], val_rows)
    tok = build_tokenizer(ml_collections.ConfigDict(testbed["sft_config"]["data"]["tokenizer"]))
    seq_len = seq_len_for({k: groups[k] for k in ("train",) + SPLITS + ("bon",)}, tok)
    data_key = digest({"train": train_rows, "val": val_rows,
                       "score": {k: groups[k] for k in SPLITS + ("bon",)}}, 12)
    return {"testbed": testbed, "testbed_s": testbed_s, "groups": groups, "train_rows": train_rows,
            "val_rows": val_rows, "paths": paths, "seq_len": seq_len, "data_key": data_key}


def seq_len_for(groups: dict, tokenizer) -> int:
    """Tokens a prompt + response + bos + eos needs at most over every part used, rounded up to 8."""
    n = max(len(tokenizer.encode(g["prompt"])) + len(tokenizer.encode(r))
            for gs in groups.values() for g in gs for r in g["responses"]) + 2
    return round_up(n, 8)


def rm_config(exp, testbed: dict, arm: str, seed: int, paths: dict, seq_len: int, n_eval: int):
    """``configs/reward_model.py`` with the SFT policy's model and tokenizer, the preset's training
    settings and the arm's BSR lambda."""
    import ml_collections

    from icml_jax.config_utils import load_config
    cfg = load_config("configs/reward_model.py:default", unlocked=True)
    sft = testbed["sft_config"]
    cfg.model = ml_collections.ConfigDict(sft["model"])
    cfg.data.tokenizer = ml_collections.ConfigDict(sft["data"]["tokenizer"])
    if seq_len > cfg.model.max_seq_len:
        raise ValueError(f"prompt + response need {seq_len} tokens but the SFT model's "
                         f"max_seq_len is {cfg.model.max_seq_len}")
    steps, bs = int(exp.train.train.steps), int(exp.train.train.batch_size)
    cfg.update_from_flattened_dict({
        **run_overrides(exp.train), **QUIET, "data.seq_len": seq_len, "data.path": paths["train"],
        "data.eval_path": paths["val_in"], "train.init_from": testbed["sft_workdir"],
        "train.eval_every": steps, "train.checkpoint_every": steps,
        "train.log_every": max(1, steps // 10), "train.eval_batches": max(1, -(-n_eval // bs)),
        "loss.bsr_lambda": float(ARMS[arm]), "loss.bsr_scale_by_batch": True,
        "loss.bsr_reduce": "local"})
    cfg.seed = int(seed)
    return cfg


def score_parts(task, params, groups: dict, parts, seq_len: int) -> dict:
    """{part: {"reward": [[per response] per group], "hidden_norm": [[...]] (after the final
    norm: what the head reads), "residual_norm": [[...]] (before it)}}."""
    from icml_jax.data.preference import encode_responses
    out = {}
    for part in parts:
        gs = groups[part]
        prompts = [g["prompt"] for g in gs for _ in g["responses"]]
        resp = [r for g in gs for r in g["responses"]]
        arrays, _ = encode_responses(prompts, resp, task.tokenizer, seq_len,
                                     add_eos=task.config.data.add_eos)
        r, h, res = task.score(params, arrays, with_residual=True)
        k = [len(g["responses"]) for g in gs]
        cut = lambda x: [[float(v) for v in x[sum(k[:i]): sum(k[:i]) + n]] for i, n in enumerate(k)]
        out[part] = {"reward": cut(r), "hidden_norm": cut(h), "residual_norm": cut(res)}
    return out


def train_and_score(cfg, workdir: str, groups: dict) -> dict:
    """Trains (or resumes) one reward model, then scores every response of the val/bon parts."""
    from icml_jax.tasks import TASKS
    from icml_jax.train.trainer import train
    elapsed = stopwatch()
    state, summary = train(cfg, workdir)
    train_s = elapsed()
    task = TASKS.get("reward_model")(cfg)
    elapsed = stopwatch()
    scores = score_parts(task, state.params, groups, SPLITS + ("bon",), cfg.data.seq_len)
    keep = ("step", "eval_accuracy", "eval_loss", "eval_hidden_norm/std", "eval_rewards/std",
            "eval_margin", "loss")
    return {"train": {k: float(summary[k]) for k in keep if k in summary},
            "train_seconds": train_s, "score_seconds": elapsed(), "scores": scores}


def train_runs(wd: str, exp, data: dict) -> tuple[dict, dict]:
    """Every (arm, seed) of ``exp``, trained and scored in DIR/runs/<arm>_s<seed>_<config hash>/
    (cached in result.json there). Returns ({(arm, seed): result}, {"<arm>_s<seed>": config})."""
    results, configs = {}, {}
    for arm in exp.arms:
        for seed in seeds_of(exp, arm):
            cfg = rm_config(exp, data["testbed"], arm, seed, data["paths"], data["seq_len"],
                            len(data["val_rows"]))
            cfg_dict = json.loads(cfg.to_json_best_effort())
            configs[f"{arm}_s{seed}"] = cfg_dict
            run_dir = os.path.join(wd, "runs", f"{arm}_s{seed}_{digest(cfg_dict, 12)[:8]}")
            key = {"config": cfg_dict, "data": data["data_key"]}
            elapsed = stopwatch()
            results[(arm, seed)] = cached(os.path.join(run_dir, "result.json"), key,
                                          lambda: train_and_score(cfg, run_dir, data["groups"]))
            print(f"{arm} seed {seed}: {elapsed():.1f} s this run "
                  f"(train {results[(arm, seed)]['train_seconds']:.1f} s when trained)", flush=True)
    return results, configs


# --------------------------------------------------------------------------------- metrics

def pair_accuracy(proxy_by_group, gold_by_group) -> tuple[float, int]:
    """Accuracy over every gold-untied pair of each group (the ``rule="all"`` val pairs); a proxy
    tie counts 1/2. Returns (accuracy, pairs)."""
    hit = n = 0.0
    for p, g in zip(proxy_by_group, gold_by_group):
        for i in range(len(g)):
            for j in range(i + 1, len(g)):
                if g[i] == g[j]:
                    continue
                d = np.sign(p[i] - p[j]) * np.sign(g[i] - g[j])
                hit += 1.0 if d > 0 else 0.5 if d == 0 else 0.0
                n += 1
    return (hit / n if n else float("nan")), int(n)


def run_metrics(res: dict, groups: dict, exp) -> tuple[dict, dict]:
    """Flat {metric: value} of one run, and its best-of-N curve."""
    from icml_jax.data import sentiment_testbed as tb
    sc = res["scores"]
    gold = {p: [g["gold"] for g in groups[p]] for p in SPLITS + ("bon",)}
    m = {}
    m["accuracy"], _ = pair_accuracy(sc["val_in"]["reward"], gold["val_in"])
    m["trainer_eval_accuracy"] = res["train"].get("eval_accuracy", float("nan"))
    for p in SPLITS:
        m[f"tau_{p}"] = tb.kendall_tau_per_prompt(sc[p]["reward"], gold[p])
    r_in = np.concatenate([np.asarray(x) for x in sc["val_in"]["reward"]])
    h_in = np.concatenate([np.asarray(x) for x in sc["val_in"]["hidden_norm"]])
    r_all = np.concatenate([np.asarray(x) for p in SPLITS for x in sc[p]["reward"]])
    m.update(reward_mean=float(r_in.mean()), reward_std=float(r_in.std()),
             reward_std_all_val=float(r_all.std()), hidden_norm_mean=float(h_in.mean()),
             hidden_norm_std=float(h_in.std()),
             hidden_norm_cv=float(h_in.std() / max(h_in.mean(), 1e-12)))
    if "residual_norm" in sc["val_in"]:  # results cached before it was scored have none
        z_in = np.concatenate([np.asarray(x) for x in sc["val_in"]["residual_norm"]])
        m.update(residual_norm_mean=float(z_in.mean()), residual_norm_std=float(z_in.std()),
                 residual_norm_cv=float(z_in.std() / max(z_in.mean(), 1e-12)))
    else:
        m.update(residual_norm_mean=float("nan"), residual_norm_std=float("nan"),
                 residual_norm_cv=float("nan"))
    bon = tb.best_of_n_curve(sc["bon"]["reward"], gold["bon"], ns_of(exp),
                             num_draws=exp.bon_draws, seed=0)
    for n, gv, pv in zip(bon["n"], bon["gold"], bon["proxy"]):
        m[f"bon_gold_N{n}"] = gv
        m[f"bon_proxy_N{n}"] = pv
    return m, bon


def reference_bon(groups: dict, exp) -> dict:
    """Oracle (gold as the proxy) and random-pick best-of-N curves on ``bon``."""
    from icml_jax.data import sentiment_testbed as tb
    gold = [g["gold"] for g in groups["bon"]]
    ns = ns_of(exp)
    return {"oracle": tb.best_of_n_curve(gold, gold, ns, num_draws=exp.bon_draws, seed=0),
            "random": tb.best_of_n_curve([[0.0] * len(g) for g in gold], gold, ns,
                                         num_draws=exp.bon_draws, seed=0)}


def aggregate(metrics: dict, exp) -> dict:
    """{arm: {metric: (seed mean, std over seeds, seeds)}} (NaNs dropped, one seed: std 0)."""
    names = list(next(iter(metrics.values())))
    return {arm: {m: mean_spread([metrics[(arm, s)][m] for s in seeds_of(exp, arm)], "std")
                  for m in names}
            for arm in exp.arms}
