"""The ECON study's frozen LMs: 3 executors and a coordinator, byte-level decoders trained briefly
with the normal trainer on one-step arithmetic written as ``"<expression>=<answer>"`` documents."""
import functools
import json
import os

from experiments.common import cached, digest, run_overrides, write_atomic
from experiments.common import train_run as common_train_run

QUIET = {"train.samples": 0, "train.progress": False, "train.async_checkpoint": False}


def problems(exp):
    """(train, test) problem lists of ``icml_jax.data.arithmetic`` (distinct expressions)."""
    from icml_jax.data import arithmetic as ar
    return ar.make_splits(int(exp.data_seed), int(exp.train_problems), int(exp.test_problems),
                          **exp.knobs.to_dict())


def prompt(problem) -> str:
    return f"{problem.expression}="


def document(problem) -> str:
    return f"{problem.expression}={problem.answer}"


def parse(text: str):
    """The integer an LM wrote (up to the first newline), or None."""
    head = text.split("\n")[0].strip()
    try:
        return int(head)
    except ValueError:
        return None


def lm_config(exp, corpus: str, seed: int, steps: int):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:tiny", unlocked=True)
    cfg.update_from_flattened_dict({**run_overrides(exp.lm), **QUIET, "seed": int(seed),
                                    "train.steps": int(steps), "train.eval_every": int(steps),
                                    "train.checkpoint_every": int(steps),
                                    "data.name": "jsonl", "data.path": corpus, "data.text_key": "text",
                                    "data.tokenizer.type": "byte"})
    return cfg


def train_lms(exp, workdir, train_problems):
    """Trains (cached) the executors (seeds 1..N, ``exp.executor_steps`` each) and the coordinator
    (seed 0, ``exp.coordinator_steps``) on the same corpus; returns [(name, cfg, params, info)].
    0 steps: the model's initial parameters, no training run (the ``tiny`` preset's plumbing test)."""
    from icml_jax.train.checkpoint import restore_model_params
    corpus = os.path.join(workdir, "corpus.jsonl")
    docs = [document(p) for p in train_problems]
    text = "".join(json.dumps({"text": d}) + "\n" for d in docs)
    if not os.path.exists(corpus) or open(corpus).read() != text:
        write_atomic(corpus, text)
    specs = [(f"executor{i}", i + 1, exp.executor_steps) for i in range(exp.n_agents)]
    specs.append(("coordinator", 0, exp.coordinator_steps))
    out = []
    for name, seed, steps in specs:
        cfg = lm_config(exp, corpus, seed, max(int(steps), 1))
        if int(steps) == 0:
            out.append((name, cfg, _init_params(cfg, seed), {"final_loss": float("nan"), "seconds": 0.0}))
            continue
        run_dir = os.path.join(workdir, "lms", name)
        key = {"config": json.loads(cfg.to_json_best_effort()), "corpus": digest(docs)}

        def go(cfg=cfg, run_dir=run_dir):
            summary, rows, seconds = common_train_run(cfg, run_dir)
            return {"final_loss": float(rows[-1]["loss"]) if rows else float("nan"), "seconds": seconds}
        info = cached(os.path.join(workdir, "lms", f"{name}_result.json"), key, go)
        params = restore_model_params(run_dir, cfg.model)[0]
        out.append((name, cfg, params, info))
        print(f"[econ] {name}: loss {info['final_loss']:.3f}, {info['seconds']:.0f} s", flush=True)
    return out


def _init_params(cfg, seed: int):
    import jax
    return _initializer(cfg.model.to_json_best_effort(sort_keys=True))(jax.random.key(seed))


@functools.lru_cache(maxsize=4)
def _initializer(model_json: str):
    """One jitted decoder init per model config (the four LMs share one compiled program)."""
    import jax
    import jax.numpy as jnp
    import ml_collections

    from icml_jax.models.decoder import build_model
    model = build_model(ml_collections.ConfigDict(json.loads(model_json)))
    return jax.jit(lambda key: model.init(key, jnp.ones((1, 8), jnp.int32))["params"])
