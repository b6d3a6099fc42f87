"""The implicit PRM experiment's stages: problems, the generator LM, sampling and outcome labels,
the PRM data sets and training runs, and the per-response log-ratio scores (each cached)."""
import json
import os

from experiments.common import (FrozenPolicy, cached, digest, flatten_overrides, round_up,
                                run_overrides, write_atomic)
from experiments.common import train_run as common_train_run

_QUIET = {"train.samples": 0, "train.progress": False, "train.async_checkpoint": False}


def log(*m):
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
    cfg.update_from_flattened_dict({**run_overrides(exp["generator"]), **_QUIET,
                                    "data.name": "jsonl", "data.path": corpus_path,
                                    "data.text_key": "text", "data.tokenizer.type": "byte"})
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
        cfg2.update_from_flattened_dict({**run_overrides(more), "train.init_from": prev})
        suffix = "" if i == 0 else f"_{i + 1}"
        gen2 = os.path.join(workdir, f"generator_continued{suffix}")
        key2 = {"config": json.loads(cfg2.to_json_best_effort()), "corpus": digest(docs),
                "first": prev_key}
        res = cached(os.path.join(workdir, f"generator_continued{suffix}_result.json"), key2,
                     lambda: train_run(cfg2, gen2))
        prev, prev_key = gen2, digest(res["key"])
        seconds, steps = seconds + res["train_seconds"], steps + res["step"]
    return prev, {**res, "train_seconds": seconds, "steps_total": steps}


class LazyPolicy:
    """The generator as a ``FrozenPolicy``, loaded on the first ``get()`` (a fully cached rerun
    never loads it)."""

    def __init__(self, gen_dir):
        self.gen_dir, self._policy = gen_dir, None

    def get(self):
        if self._policy is None:
            self._policy = FrozenPolicy(self.gen_dir)
        return self._policy


# ----------------------------------------------------------------------------- sampling

def sample(models, prompts, n, exp, seed):
    """n responses per prompt at the preset temperature (eos stripped), in prompt order
    (``sample_batched``: fixed batch and prompt width, so decoding compiles once for every call)."""
    from icml_jax.inference.sampling import sample_batched
    texts = sample_batched(models.model_cfg, models.ref_params, models.tok, prompts, n,
                           float(exp["temperature"]), int(exp["max_new_tokens"]), seed,
                           int(exp["sample_batch"]))
    return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]


def sample_key(exp, gen_key):
    """What every sampling stage's cache key holds besides its prompts and n."""
    return {"gen": gen_key, "temperature": exp["temperature"], "mnt": exp["max_new_tokens"],
            "batch": exp["sample_batch"], "version": 1}


def sample_stage(exp, workdir, policy, gen_key, prompts, n, seed, name):
    """``DIR/samples_<name>.json``: n samples per prompt (cached)."""
    return cached(os.path.join(workdir, f"samples_{name}.json"),
                  {**sample_key(exp, gen_key), "prompts": digest(prompts), "n": n},
                  lambda: {"groups": sample(policy.get(), prompts, int(n), exp, seed)})["groups"]


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


def response_steps(response):
    """The response's step texts (``step_char_spans``: they tile it, so their concatenation is the
    response and a step's last token is where ``step_end_token_indices`` puts it)."""
    from icml_jax.data import arithmetic as ar
    return [response[a:b] for a, b in ar.step_char_spans(response)]


def step_labels(problem, response):
    """The checker's per-step labels of a response, the last step also needing the right answer
    (its ``Answer:`` line is in the last step): the supervision only the step-label PRM gets."""
    from icml_jax.data import arithmetic as ar
    c = ar.check_solution(problem, response)
    labels = list(c.step_labels)
    if labels:
        labels[-1] = labels[-1] and bool(c.answer_correct)
    return labels


def step_dataset(workdir, problems_, prompts, groups):
    """``DIR/steps.jsonl`` for the step-label PRM (the upper bound): every sampled training
    response, in TRL's stepwise format with the checker's step labels (``step_labels``)."""
    from icml_jax.data.preference import write_stepwise_jsonl
    rows = [{"prompt": p, "completions": response_steps(r), "labels": step_labels(pb, r)}
            for pb, p, g in zip(problems_, prompts, groups) for r in g if r]
    path = os.path.join(workdir, "steps.jsonl")
    write_stepwise_jsonl(path, rows)
    return path


def seq_len_for(exp, tok, prompts):
    longest = 1 + max(len(tok.encode(p)) for p in prompts) + int(exp["max_new_tokens"]) + 1
    return round_up(longest, 8)


def prm_config(exp, name, path, gen_dir, gen_cfg, seq_len, n_rows):
    from icml_jax.config_utils import load_config
    is_dpo = name == "dpo"
    base = {"dpo": "configs/dpo.py", "steps": "configs/step_prm.py"}.get(name,
                                                                        "configs/implicit_prm.py")
    cfg = load_config(base + ":default", unlocked=True)
    t = run_overrides(exp["prm"])
    if name == "steps" and exp.get("step_prm"):
        t.update(run_overrides(exp["step_prm"]))
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
            "train.init_from": gen_dir}
    if name == "steps":  # steps tile the response: no separator, the label on a step's last token
        over.update({"steps.separator": "", "steps.max_steps": STEP_PRM_MAX_STEPS})
    else:
        over["loss.beta"] = float(exp["beta"])
    if is_dpo:
        over["loss.type"] = "sigmoid"
    cfg.update_from_flattened_dict(over)
    cfg.seed = int(exp["seed"])
    return cfg


STEP_PRM = "step-label PRM"
STEP_PRM_MAX_STEPS = 8  # labelled steps per training response (a sample may write extra steps)


def prm_names_and_files(exp, paths):
    """The PRMs to train (``CE M=<m>`` per M, ``DPO`` when there are pairs, the step-label PRM
    when the step data was written) -> data file stem."""
    names = {f"CE M={m}": f"ce_m{m}" for m in exp["ce_responses"]}
    if "dpo" in paths:
        names["DPO"] = "dpo"
    if "steps" in paths:
        names[STEP_PRM] = "steps"
    return names


def train_prms(exp, workdir, gen_dir, gen, paths, seq_len):
    """Trains every PRM from the generator (cached per PRM); returns (names, info, configs,
    workdirs), each but names keyed by PRM name."""
    gen_key, gen_cfg = digest(gen["key"]), gen["key"]["config"]
    names = prm_names_and_files(exp, paths)
    info, cfgs, dirs = {}, {}, {}
    for name, f in names.items():
        with open(paths[f]) as fh:
            n_rows = sum(1 for _ in fh)
        cfg = prm_config(exp, f, paths[f], gen_dir, gen_cfg, seq_len, n_rows)
        cfgs[name] = json.loads(cfg.to_json_best_effort())
        dirs[name] = os.path.join(workdir, f"prm_{f}")
        res = cached(os.path.join(workdir, f"prm_{f}_result.json"),
                     {"config": cfgs[name], "gen": gen_key, "data": digest(open(paths[f]).read())},
                     lambda: train_run(cfg, dirs[name]))
        last = res["curve"][-1] if res["curve"] else {}
        acc_key = "rewards/accuracies" if name == "DPO" else "accuracy"
        info[name] = {"rows": n_rows, "loss": last.get("loss"), "acc": last.get(acc_key),
                      "eval_loss": res["eval"].get("eval_loss"), "seconds": res["train_seconds"],
                      "digest": digest(res["key"])}
        log(f"{name}: {n_rows} rows, final loss {last.get('loss')}, {res['train_seconds']:.0f} s")
    return list(names), info, cfgs, dirs


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


def step_logits(model_cfg, tok, workdir, prompts, responses, seq_len, K, batch_size):
    """[B, K] the step-label PRM's logit of "this step is correct" (class 1 minus class 0, so
    sigma of it is the step's probability) at every step end; 0 at padding steps."""
    import jax
    import numpy as np

    from icml_jax.data.preference import encode_steps
    from icml_jax.models.reward import build_step_classifier
    from icml_jax.tasks.pairs import batched_apply
    from icml_jax.train.checkpoint import restore_module_params
    model = build_step_classifier(model_cfg)
    z = np.zeros((1, 8), np.int32)
    params, _ = restore_module_params(workdir, model, z, z, z + 1, np.zeros((1, K), np.int32))
    rows = []
    for p, r in zip(prompts, responses):
        steps = response_steps(r)
        rows.append({"prompt": p, "completions": steps, "labels": [False] * len(steps)})
    arrays, _ = encode_steps(rows, tok, seq_len, max_steps=K, separator="")

    @jax.jit
    def fn(b):
        lg = model.apply({"params": params}, b["inputs"], b["positions"], b["segment_ids"],
                         b["step_end"])
        return lg[..., 1] - lg[..., 0]
    keys = ("inputs", "positions", "segment_ids", "step_end")
    out = batched_apply(fn, {k: arrays[k] for k in keys}, batch_size)
    return out * arrays["step_mask"], arrays["step_end"], arrays["step_mask"]


def score_stage(exp, workdir, policy, eval_prompts, groups, seq_len, prm_names, prm_info,
                prm_dirs):
    """``DIR/scores_eval.json`` (cached): per eval response its generator log-prob
    (``ref_sum``), step mask, per implicit PRM the raw prefix sums q_k / kappa
    (``q_raw``) and, for the step-label PRM, its per-step logits (``step_logit``)."""
    import numpy as np
    flat_p = [p for p, g in zip(eval_prompts, groups) for _ in g]
    flat_r = [r for g in groups for r in g]
    key = {"samples": digest(groups), "seq_len": seq_len, "version": 2,
           "prms": {n: prm_info[n]["digest"] for n in prm_names}}

    def compute():
        mdl = policy.get()
        rows, fi, E, M = step_arrays(mdl, flat_p, flat_r, seq_len)
        bs = int(exp["sample_batch"])
        ref = logps(mdl, mdl.ref_params, rows, bs)
        out = {"ref_sum": np.sum(ref * (rows["response_mask"] > 0), 1).tolist(),
               "step_mask": M.tolist(), "q_raw": {}, "step_logit": {}}
        for n in prm_names:
            if n == STEP_PRM:
                lg, ends, mask = step_logits(mdl.model_cfg, mdl.tok, prm_dirs[n], flat_p, flat_r,
                                             seq_len, E.shape[1], bs)
                if not (np.array_equal(mask, M) and np.array_equal(ends * mask, E * M)):
                    raise RuntimeError("the step-label PRM's step ends differ from "
                                       "step_end_token_indices'")
                out["step_logit"][n] = lg.tolist()
                continue
            lp = logps(mdl, mdl.params_of(prm_dirs[n]), rows, bs)
            out["q_raw"][n] = raw_prefix_sums(lp, ref, rows, fi, E, M).tolist()
        return out
    return cached(os.path.join(workdir, "scores_eval.json"), key, compute)
