"""A preference testbed on the token-additive gold world: an SFT policy that imitates the world's
Markov chain, and gold-scored sample groups of it on disjoint prompt sets.

``build_additive_testbed(workdir, preset)`` returns the structure ``experiments.
preference_testbed.build_testbed`` returns (``workdir``, ``sft_workdir``, ``sft_config``, ``sft``,
``paths``, ``groups``, ``prompts``, ``stats``, ``seconds``, ``preset``) plus ``world`` (the
``icml_jax.data.additive_gold.AdditiveWorld``, to score new samples) and ``gold`` (a function
texts -> gold), so a consumer of the sentiment testbed can run on it. Used by
``experiments/tgdpo_vs_dpo`` (presets ``additive_tiny``/``additive``).

Steps (gold(y) = sum_t w[y_t] over the letters of the response; a sampled byte outside the
world's alphabet contributes 0; the prompt never enters the gold):

1. **World**: ``additive_gold.make_world(world_seed, num_letters=...)``.
2. **Corpus**: ``corpus_docs`` chain strings of ``prompt_len + response_len`` letters (seed
   ``corpus_seed``), one JSONL row each, ``WORKDIR/corpus.jsonl`` (rewritten only when its content
   changes, so the TFDS ``text_files`` build under ``$TFDS_DATA_DIR`` is reused).
3. **SFT policy** ``WORKDIR/sft``: ``configs/lm.py:tiny`` with the preset's ``sft`` overrides
   (nested, e.g. ``{"model": {"d_model": 32}, "train": {"steps": 150}}``), ``data.name=jsonl``
   on that corpus, byte tokens, trained with ``experiments.common.train_run``. Every document is
   ``[bos] + letters + [eos]``, so the policy learns the chain and to stop after the chain's
   length.
4. **Prompts**: one draw of distinct ``prompt_len``-letter chain strings (seed ``prompt_seed``)
   cut, in this order, into the ``prompts`` slices (e.g. ``tgdpo_train``, ``guidance_train``,
   ``tgdpo_eval``): the slices are disjoint.
5. **Groups**: per part, ``responses[part]`` SFT samples per prompt at ``temperature``, at most
   ``max_new_tokens`` bytes (``icml_jax.inference.sampling.sample_batched``), scored by the gold.

Everything is cached under ``WORKDIR`` (``sft_result.json``, ``groups/<part>.json``) with
``experiments.common.cached`` under a key of everything it depends on: a rerun with the same
preset computes nothing (the policy is not even loaded). The SFT key holds the corpus's absolute
path (``data.path``): reuse a testbed in place, a moved copy retrains its SFT policy. ``WORKDIR/testbed.json`` lists the parts,
settings, gold statistics and timings.
"""
from __future__ import annotations

import json
import os

from experiments.common import cached, digest, run_overrides, stopwatch, write_atomic, write_json
from experiments.preference_testbed import sample_groups, seed_for, train_sft

GOLD_NAME = "additive_gold.sum_w(unknown=zero)"
_QUIET = {"train.samples": 0, "train.progress": False}
REQUIRED = ("world_seed", "num_letters", "prompt_len", "response_len", "corpus_docs",
            "corpus_seed", "prompt_seed", "prompts", "responses", "temperature", "max_new_tokens",
            "batch_size", "sft")


def world_of(preset: dict):
    from icml_jax.data import additive_gold as ag
    return ag.make_world(int(preset["world_seed"]), num_letters=int(preset["num_letters"]))


def sft_config(preset: dict, corpus_path: str):
    """``configs/lm.py:tiny`` with the preset's ``sft`` overrides, trained on the chain corpus."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:tiny", unlocked=True)
    over = {**run_overrides(preset["sft"]), **_QUIET, "data.name": "jsonl",
            "data.path": os.path.abspath(corpus_path), "data.text_key": "text",
            "data.tokenizer.type": "byte"}
    cfg.update_from_flattened_dict(over)
    cfg.seed = int(preset["world_seed"])
    need = 1 + int(preset["prompt_len"]) + int(preset["max_new_tokens"]) + 1
    if need > cfg.model.max_seq_len:
        raise ValueError(f"prompt + response need {need} tokens > model.max_seq_len "
                         f"{cfg.model.max_seq_len}")
    return cfg


def prompt_sets(world, preset: dict) -> dict[str, list[str]]:
    """part -> prompts: consecutive, disjoint cuts of one draw of distinct chain strings."""
    import numpy as np
    sizes = {k: int(v) for k, v in preset["prompts"].items()}
    total = sum(sizes.values())
    rng = np.random.default_rng(seed_for(preset["prompt_seed"], "prompts"))
    pool = list(dict.fromkeys(world.sample(4 * total, int(preset["prompt_len"]), rng)))
    if len(pool) < total:
        raise ValueError(f"only {len(pool)} distinct prompts of {preset['prompt_len']} letters for "
                         f"{total}; raise prompt_len or lower the prompt counts")
    out, lo = {}, 0
    for part, n in sizes.items():
        out[part] = pool[lo: lo + n]
        lo += n
    return out


def write_corpus(world, preset: dict, path: str) -> str:
    """The SFT corpus as JSONL (one chain string per row); left untouched when unchanged (its
    mtime is part of the TFDS fingerprint). Returns the content digest."""
    import numpy as np
    rng = np.random.default_rng(seed_for(preset["corpus_seed"], "corpus"))
    docs = world.sample(int(preset["corpus_docs"]),
                        int(preset["prompt_len"]) + int(preset["response_len"]), rng)
    text = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    if not (os.path.exists(path) and open(path).read() == text):
        write_atomic(path, text)
    return digest(text)


def build_additive_testbed(workdir: str, preset: dict) -> dict:
    """Builds (or loads) the testbed in ``workdir``; see the module docstring for the steps and
    the returned structure."""
    from icml_jax.data import sentiment_testbed as tb
    from icml_jax.inference.decode import bucket_length
    preset = json.loads(json.dumps(preset))
    missing = sorted(set(REQUIRED) - set(preset))
    if missing:
        raise ValueError(f"additive testbed preset lacks {missing}")
    if set(preset["prompts"]) != set(preset["responses"]):
        raise ValueError(f"prompts {sorted(preset['prompts'])} and responses "
                         f"{sorted(preset['responses'])} must name the same parts")
    os.makedirs(workdir, exist_ok=True)
    world = world_of(preset)

    def gold(texts):  # sampled text may hold bytes outside the alphabet: they score 0
        return world.gold_reward(texts, unknown="zero")
    corpus = os.path.join(workdir, "corpus.jsonl")
    corpus_digest = write_corpus(world, preset, corpus)
    cfg = sft_config(preset, corpus)
    cfg_dict = json.loads(cfg.to_json_best_effort())
    sft_dir = os.path.join(workdir, "sft")
    sft = cached(os.path.join(workdir, "sft_result.json"), {"config": cfg_dict,
                                                            "corpus": corpus_digest},
                 lambda: train_sft(cfg, sft_dir))
    sft_key = digest(sft["key"])
    prompts = prompt_sets(world, preset)
    prompt_tokens = bucket_length(1 + max(len(p.encode()) for ps in prompts.values() for p in ps))
    loaded = {}

    def policy():
        if not loaded:
            from icml_jax.models.decoder import build_model
            from icml_jax.train.workdir import load_workdir
            model_cfg, params, tok, _ = load_workdir(sft_dir)
            loaded["v"] = (build_model(model_cfg), params, tok)
        return loaded["v"]

    world_key = {"alphabet": world.alphabet, "weights": world.weights.tolist(),
                 "trans": digest(world.trans.tolist())}
    out = {"workdir": os.path.abspath(workdir), "sft_workdir": os.path.abspath(sft_dir),
           "sft_config": cfg_dict, "sft": {k: v for k, v in sft.items() if k != "key"},
           "paths": {}, "groups": {}, "prompts": {}, "stats": {}, "seconds": {}, "preset": preset,
           "world_key": world_key, "gold_name": GOLD_NAME}
    for part in preset["prompts"]:
        settings = {"gold": GOLD_NAME, "world": world_key, "sft": sft_key,
                    "prompts": digest(prompts[part]), "n_prompts": len(prompts[part]),
                    "n_per_prompt": int(preset["responses"][part]),
                    "temperature": float(preset["temperature"]),
                    "max_new_tokens": int(preset["max_new_tokens"]),
                    "batch_size": int(preset["batch_size"]), "prompt_tokens": prompt_tokens,
                    "seed": seed_for(preset["world_seed"], "sample/" + part)}

        def compute(ps=prompts[part], s=settings):
            model, params, tok = policy()
            elapsed = stopwatch()
            groups = sample_groups(model, params, tok, ps, s["n_per_prompt"], s["temperature"],
                                   s["max_new_tokens"], s["seed"], s["batch_size"],
                                   prompt_tokens=s["prompt_tokens"], gold=gold)
            return {"seconds": elapsed(), "groups": groups}

        path = os.path.join(workdir, "groups", f"{part}.json")
        res = cached(path, settings, compute)
        out["paths"][part] = os.path.abspath(path)
        out["groups"][part] = res["groups"]
        out["prompts"][part] = prompts[part]
        out["stats"][part] = tb.gold_stats(res["groups"])
        out["seconds"][part] = res["seconds"]
    out["seconds"]["sft"] = sft["seconds"]
    write_json(os.path.join(workdir, "testbed.json"),
               {k: v for k, v in out.items() if k not in ("groups", "prompts")})
    out["world"], out["gold"] = world, gold
    return out
