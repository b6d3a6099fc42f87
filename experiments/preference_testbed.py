"""The shared preference testbed: an SFT policy on Shakespeare and gold-scored sample groups.

    python -m experiments.preference_testbed --workdir=runs/testbed [--preset=tiny|default]

Used by ``experiments/bsr_robustness`` and ``experiments/tgdpo_vs_dpo`` through
``build_testbed(workdir, preset)``; not an experiment itself (it writes no results table).

What it builds (gold = VADER compound sentiment of the continuation,
``icml_jax.data.sentiment_testbed.gold_reward``; no model sees it):

1. ``WORKDIR/sft``: the SFT policy, a small byte-level LM (``configs/lm.py`` with the preset's
   ``sft`` overrides) trained with ``train_and_evaluate`` on the corpus ``train`` works.
2. ``WORKDIR/groups/<part>.json``: gold-scored sample groups of the policy (one per prompt):

   ==================  =================================  ==================  ======================
   part                prompts                            temperature         responses per prompt
   ==================  =================================  ==================  ======================
   train               in-domain, train blocks            ``temperature``     ``responses.train``
   val_in              in-domain, held-out blocks  (A)    ``temperature``     ``responses.val``
   val_response_ood    the same prompts (A)               ``ood_temperature`` ``responses.val``
   val_prompt_ood      OOD works (``test`` split)  (B)    ``temperature``     ``responses.val``
   val_both_ood        the same prompts (B)               ``ood_temperature`` ``responses.val``
   bon                 in-domain, held-out blocks         ``temperature``     ``responses.bon`` (64)
   tgdpo_train         in-domain, train blocks            ``tgdpo_temperature`` 5
   tgdpo_eval          in-domain, held-out blocks         ``tgdpo_temperature`` SFT reference samples
   ==================  =================================  ==================  ======================

   In-domain works are the corpus ``train`` split (what the SFT policy was trained on); OOD works
   the ``test`` split (never trained on). "Train"/"held-out blocks" is the fixed 80/20 partition
   of each work's lines of ``sentiment_testbed.prompt_pool``: the prompt sets of different parts
   are disjoint except where the table says "the same prompts". The response shift is a lower
   temperature, 0.7 against 1.0: sharper, more fluent samples, like those of an optimised policy,
   that still contain real words (a higher temperature would mostly add misspelt non-words that
   VADER scores 0, i.e. more ties, not a different kind of response).

Measured (DEFAULT, 2026-12-01, on 2 CPU cores shared with other jobs, load average 7-9, so an
upper bound): SFT 304 s; sampling the eight parts (8,768 responses of 128 bytes) 729 s in all,
train 242 s, bon 134 s, tgdpo_train 138 s; a rerun loads the JSON in ~5 s. Gold statistics of the
DEFAULT parts (fraction of responses exactly 0 / of within-prompt pairs tied): train 0.45 / 0.20,
val_in 0.43 / 0.19, val_response_ood 0.30 / 0.10, val_prompt_ood 0.47 / 0.22, val_both_ood
0.31 / 0.11, bon 0.46 / 0.21, tgdpo_train 0.36 / 0.13; mean gold +0.08 to +0.15, std 0.33-0.42.
Gold is VADER alone (no extra programmatic term): lengthening the responses from 64 to 128 bytes
took the zero fraction from 0.64 to 0.45 and the tied pairs from 0.41 to 0.20.

Every part is cached in its file with a key of everything it depends on (the SFT config, the
prompts, the sampling settings, the gold function); the SFT run is cached in
``WORKDIR/sft_result.json``. A rerun with the same preset loads the files and computes nothing
(not even the policy is loaded); a changed setting recomputes only the parts it affects. A
changed SFT config is refused in a workdir that holds another SFT run (use a new workdir).
``WORKDIR/testbed.json`` lists the parts, their files, settings, gold statistics and timings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

from experiments.common import cached, digest, flatten_overrides, train_run, write_json
from icml_jax import xla_env

# Parts: name -> (prompt pool, slice of the pool, temperature key, responses key). Parts sharing
# (pool, slice) share their prompts.
PARTS = {
    "train": ("in_train", "train", "temperature", "train"),
    "val_in": ("in_heldout", "val", "temperature", "val"),
    "val_response_ood": ("in_heldout", "val", "ood_temperature", "val"),
    "val_prompt_ood": ("ood", "val", "temperature", "val"),
    "val_both_ood": ("ood", "val", "ood_temperature", "val"),
    "bon": ("in_heldout", "bon", "temperature", "bon"),
    "tgdpo_train": ("in_train", "tgdpo_train", "tgdpo_temperature", "tgdpo_train"),
    "tgdpo_eval": ("in_heldout", "tgdpo_eval", "tgdpo_temperature", "tgdpo_eval"),
}
# Pools: name -> (corpus split, line part, slices in order). A pool is drawn once and cut into its
# slices in this order, so the slices are disjoint.
POOLS = {
    "in_train": ("train", "train", ("train", "tgdpo_train")),
    "in_heldout": ("train", "heldout", ("val", "bon", "tgdpo_eval")),
    "ood": ("test", "all", ("val",)),
}

_QUIET = {"train.samples": 0, "train.progress": False}

TINY = dict(
    seed=0,
    # a 1-layer d=32 byte LM, 100 steps: babble (84% of its samples score gold 0), but every
    # piece is the real one; prompt_chars = 16k - 1 keeps one decode shape (see build_testbed)
    sft={"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2,
         "model.num_kv_heads": 2, "model.head_dim": 16, "model.ffn_dim": 64,
         "model.max_seq_len": 128, "data.seq_len": 64, "train.steps": 100, "train.batch_size": 8,
         "train.lr": 1e-2, "train.warmup_steps": 10, "train.log_every": 25,
         "train.eval_every": 100, "train.eval_batches": 1, "train.checkpoint_every": 100,
         "train.async_checkpoint": False},
    prompt_chars=31, max_new_tokens=48, batch_size=32,
    temperature=1.0, ood_temperature=0.7, tgdpo_temperature=0.8,
    prompts=dict(train=16, tgdpo_train=12, val=6, bon=2, tgdpo_eval=4),
    responses=dict(train=4, val=4, bon=64, tgdpo_train=5, tgdpo_eval=2),
)

DEFAULT = dict(
    seed=0,
    # 4 layers, d=128, MHA (4 heads of 32), swiglu 384: 0.9M params, eval loss 1.90 nats/byte.
    # Responses are 128 new bytes: at 64 bytes 64% of its samples scored gold exactly 0 (no VADER
    # word), at 128 bytes 45% (T=1.0) and 30% (T=0.7); see the module docstring
    sft={"model.d_model": 128, "model.num_layers": 4, "model.num_heads": 4,
         "model.num_kv_heads": 4, "model.head_dim": 32, "model.ffn_dim": 384,
         "model.max_seq_len": 256, "data.seq_len": 128, "train.steps": 800,
         "train.batch_size": 16, "train.lr": 3e-3, "train.warmup_steps": 50,
         "train.log_every": 20, "train.eval_every": 200, "train.eval_batches": 4,
         "train.checkpoint_every": 200},
    prompt_chars=63, max_new_tokens=128, batch_size=128,
    temperature=1.0, ood_temperature=0.7, tgdpo_temperature=0.8,
    prompts=dict(train=600, tgdpo_train=400, val=120, bon=32, tgdpo_eval=100),
    responses=dict(train=4, val=4, bon=64, tgdpo_train=5, tgdpo_eval=4),
)

PRESETS = {"tiny": TINY, "default": DEFAULT}


def preset_dict(name: str) -> dict:
    """Testbed preset ``name`` as a JSON copy (lists for tuples): what ``build_testbed`` is given
    and config.json records (a plain dict: its ``sft`` section has dotted override keys, which a
    ConfigDict cannot hold)."""
    return json.loads(json.dumps(PRESETS[name]))


def sft_config(preset: dict):
    """``configs/lm.py:small`` with the preset's SFT overrides (byte tokenizer, Shakespeare)."""
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**preset["sft"], **_QUIET})
    cfg.seed = int(preset["seed"])
    if cfg.data.name != "shakespeare" or cfg.data.tokenizer.type != "byte":
        raise ValueError("the testbed's SFT policy is a byte-level LM on the Shakespeare corpus; "
                         f"got data.name={cfg.data.name!r}, tokenizer={cfg.data.tokenizer.type!r}")
    return cfg


def seed_for(base: int, name: str) -> int:
    """A sampling seed of a named stage from a preset's base seed (stable across processes)."""
    return int(base) * 1_000_003 + zlib.crc32(name.encode())


def _prompt_sets(preset: dict) -> dict[tuple[str, str], list[str]]:
    """(pool, slice) -> prompts; slices of a pool are consecutive, disjoint cuts of one draw."""
    from icml_jax.data import sentiment_testbed as tb
    sizes = preset["prompts"]
    out = {}
    for pool, (split, part, slices) in POOLS.items():
        counts = [int(sizes[s]) for s in slices]
        prompts = tb.prompt_pool(split, sum(counts), preset["prompt_chars"],
                                 seed_for(preset["seed"], "prompts/" + pool), part=part)
        lo = 0
        for s, c in zip(slices, counts):
            out[(pool, s)] = prompts[lo: lo + c]
            lo += c
    return out


def train_sft(cfg, sft_dir: str) -> dict:
    """Trains (or resumes) an SFT policy with ``common.train_run`` (a folder trained with another
    config is wiped first); returns its summary for the testbed's cache."""
    summary, _, seconds = train_run(cfg, sft_dir)
    return {"step": int(summary["step"]), "params": int(summary["params"]),
            "eval_loss": float(summary.get("eval_loss", float("nan"))), "seconds": seconds}


def _check_sft_unchanged(result_path: str, cfg_dict: dict, sft_dir: str) -> None:
    """Refuses to resume an SFT run of another config in the same folder (the trainer would
    restore its checkpoints into the new config)."""
    if not os.path.exists(result_path):
        return
    with open(result_path) as f:
        old = json.load(f).get("key")
    if old != cfg_dict and os.path.isdir(sft_dir):
        changed = sorted(k for k in set(flatten_overrides(old or {})) | set(flatten_overrides(cfg_dict))
                         if flatten_overrides(old or {}).get(k) != flatten_overrides(cfg_dict).get(k))
        raise ValueError(f"{sft_dir} holds an SFT run of another config (changed: {changed[:8]}); "
                         "build into a new workdir, or delete that folder and "
                         f"{result_path} to retrain")


class _Policy:
    """The SFT policy, loaded on first use (a fully cached rerun never loads it)."""

    def __init__(self, sft_dir: str):
        self.sft_dir, self._loaded = sft_dir, None

    def get(self):
        if self._loaded is None:
            from icml_jax.models.decoder import build_model
            from icml_jax.train.workdir import load_workdir
            model_cfg, params, tok, _ = load_workdir(self.sft_dir)
            self._loaded = (build_model(model_cfg), params, tok)
        return self._loaded


def build_testbed(workdir: str, preset_cfg: dict) -> dict:
    """Builds (or loads) the testbed in ``workdir`` for a preset dict (``TINY``, ``DEFAULT`` or
    one shaped like them); see the module docstring.

    Returns ``{"workdir", "sft_workdir", "sft_config" (dict), "sft" (training digest),
    "works": {"in_domain", "ood"}, "paths": {part: file}, "groups": {part: [group]},
    "prompts": {part: [str]}, "stats": {part: gold_stats}, "seconds": {part: compute seconds,
    as first measured}, "preset"}``. Load the policy with
    ``icml_jax.train.workdir.load_workdir(result["sft_workdir"])``.
    """
    from icml_jax.data import sentiment_testbed as tb
    from icml_jax.inference.decode import bucket_length
    preset = json.loads(json.dumps(preset_cfg))
    missing = {"temperature", "ood_temperature", "tgdpo_temperature", "prompts", "responses",
               "sft", "seed", "prompt_chars", "max_new_tokens", "batch_size"} - set(preset)
    if missing:
        raise ValueError(f"preset lacks {sorted(missing)}; see experiments/preference_testbed.TINY")
    os.makedirs(workdir, exist_ok=True)
    cfg = sft_config(preset)
    cfg_dict = json.loads(cfg.to_json_best_effort())
    sft_dir = os.path.join(workdir, "sft")
    _check_sft_unchanged(os.path.join(workdir, "sft_result.json"), cfg_dict, sft_dir)
    sft = cached(os.path.join(workdir, "sft_result.json"), cfg_dict,
                 lambda: train_sft(cfg, sft_dir))
    sft_key = digest(cfg_dict)

    prompt_sets = _prompt_sets(preset)
    # one decode shape for every part: with prompt_chars = 16k - 1 (ASCII), [bos] + prompt fits
    # 16k tokens and (nearly) every batch pads to 16k (see sample_groups)
    prompt_tokens = bucket_length(
        1 + max(len(p.encode("utf-8")) for ps in prompt_sets.values() for p in ps))
    policy = _Policy(sft_dir)
    out = {"workdir": os.path.abspath(workdir), "sft_workdir": os.path.abspath(sft_dir),
           "sft_config": cfg_dict, "sft": {k: v for k, v in sft.items() if k != "key"},
           "works": {"in_domain": tb.works_of(tb.IN_DOMAIN_SPLIT), "ood": tb.works_of(tb.OOD_SPLIT)},
           "paths": {}, "groups": {}, "prompts": {}, "stats": {}, "seconds": {}, "preset": preset}
    for name, (pool, slice_name, temp_key, resp_key) in PARTS.items():
        prompts = prompt_sets[(pool, slice_name)]
        settings = {"gold": tb.GOLD_NAME, "sft": sft_key, "prompts": digest(prompts),
                    "n_prompts": len(prompts), "n_per_prompt": int(preset["responses"][resp_key]),
                    "temperature": float(preset[temp_key]),
                    "max_new_tokens": int(preset["max_new_tokens"]),
                    "batch_size": int(preset["batch_size"]), "prompt_tokens": prompt_tokens,
                    "seed": seed_for(preset["seed"], "sample/" + name)}

        def compute(prompts=prompts, s=settings):
            model, params, tok = policy.get()
            t0 = time.time()
            groups = sample_groups(model, params, tok, prompts, s["n_per_prompt"],
                                      s["temperature"], s["max_new_tokens"], s["seed"],
                                      s["batch_size"], prompt_tokens=s["prompt_tokens"])
            return {"seconds": time.time() - t0, "groups": groups}

        path = os.path.join(workdir, "groups", f"{name}.json")
        res = cached(path, settings, compute)
        out["paths"][name] = os.path.abspath(path)
        out["groups"][name] = res["groups"]
        out["prompts"][name] = prompts
        out["stats"][name] = tb.gold_stats(res["groups"])
        out["seconds"][name] = res["seconds"]
    out["seconds"]["sft"] = sft["seconds"]
    write_json(os.path.join(workdir, "testbed.json"),
               {k: v for k, v in out.items() if k not in ("groups", "prompts")})
    return out


def main(argv=None) -> dict:
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="build the shared preference testbed (VADER gold)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    a = p.parse_args(argv)
    t0 = time.time()
    out = build_testbed(a.workdir, PRESETS[a.preset])
    print(f"testbed in {out['workdir']} ({time.time() - t0:.1f} s this run; SFT "
          f"{out['sft']['seconds']:.1f} s to step {out['sft']['step']}, eval loss "
          f"{out['sft']['eval_loss']:.3f})")
    for name, s in out["stats"].items():
        print(f"  {name:17s} {s['groups']:4d} prompts x {s['responses'] // max(s['groups'], 1):2d}"
              f"  gold mean {s['mean']:+.3f} std {s['std']:.3f}  zero {s['frac_zero']:.2f}  "
              f"tied pairs {s['frac_tied_pairs']:.2f}  constant groups "
              f"{s['frac_constant_groups']:.2f}  ({out['seconds'][name]:.1f} s)")
    return out



def sample_groups(model, params, tokenizer, prompts, n_per_prompt: int, temperature: float,
                  max_new_tokens: int, seed: int, batch_size: int = 64, *,
                  prompt_tokens: int | None = None, top_k: int = 0, top_p: float = 1.0,
                  gold=None):
    """``n_per_prompt`` continuations of each prompt (``icml_jax.inference.sampling.
    sample_batched``, whose docstring gives the batching and the keys), each scored by the gold
    reward (``gold``: a function texts -> scores; default the VADER gold of the sentiment
    testbed). Returns one group per prompt, in order: ``{"prompt": str, "responses": [str] * n,
    "gold": [float] * n, "temperature": float}``."""
    from icml_jax.data import sentiment_testbed as tb
    from icml_jax.inference.sampling import sample_batched
    texts = sample_batched(model.cfg, params, tokenizer, prompts, n_per_prompt, temperature,
                           max_new_tokens, seed, batch_size, prompt_tokens=prompt_tokens,
                           top_k=top_k, top_p=top_p)
    gold = (gold or tb.gold_reward)(texts) if texts else []
    k = n_per_prompt
    return [{"prompt": p, "responses": texts[i * k:(i + 1) * k],
             "gold": [float(g) for g in gold[i * k:(i + 1) * k]], "temperature": float(temperature)}
            for i, p in enumerate(prompts)]


if __name__ == "__main__":
    main(sys.argv[1:])
