"""The MASS study's stages: the corpora, the embedder, the selections, the arms' training and the
exact-match evaluation (driver: ``experiments/mass/__main__.py``)."""
from __future__ import annotations

import json
import os

import numpy as np

from experiments.common import cached, digest, round_up, run_overrides, train_run, write_atomic
from icml_jax.data import arithmetic
from icml_jax.data import mass

QUIET = {"train.samples": 0, "train.progress": False}
ARMS = ("full", "random", "mass", "filter", "full_more")


def corpora(exp):
    """(pool rows, reference rows, test rows): the target pool (mixed quality), a clean skill-tagged
    reference set of the target distribution and held-out test problems (prompts in neither)."""
    pool = mass.pool_rows(exp.pool_n, dict(exp.shares), seed=exp.data_seed)
    ref = mass.target_rows(exp.ref_n, seed=exp.data_seed + 1, exclude={r.prompt for r in pool})
    test = mass.target_rows(exp.test_n, seed=exp.data_seed + 2,
                            exclude={r.prompt for r in pool} | {r.prompt for r in ref})
    return pool, ref, test


def write_jsonl(path: str, texts) -> None:
    write_atomic(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))


def run_config(exp, corpus: str, seed: int, steps: int | None = None, scores: str = "",
               ratio: float = 1.0):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**run_overrides(exp.run), **QUIET, "seed": seed, "data.name": "jsonl",
                                    "data.path": corpus, "data.select_scores": scores,
                                    "data.select_ratio": ratio})
    if steps is not None:
        cfg.train.steps = int(steps)
        cfg.train.eval_every = cfg.train.checkpoint_every = int(steps)
    return cfg


def train_split(cfg):
    """The train split's texts of a run config (the documents the selection scores)."""
    from icml_jax.data.sources import get_split_source
    src = get_split_source(cfg.data, "train")
    return [src[i]["text"] for i in range(len(src))]


def load_params(cfg, workdir):
    from icml_jax.train.checkpoint import restore_model_params
    return restore_model_params(workdir, cfg.model)[0]


def selection_scores(exp, wd, corpus, texts, ref_texts):
    """{arm: scores .npy path} for the selected arms' selections (random: one per seed), and the
    MASS skill graph. The embedder is a tiny LM trained on the whole pool (no labels)."""
    from icml_jax.analysis import mass as amass
    from icml_jax.data.tokenizers import ByteTokenizer
    cfg = run_config(exp, corpus, exp.embedder_seed, steps=max(1, exp.embedder_steps))
    if exp.embedder_steps:
        ewd = os.path.join(wd, "runs", f"embedder_{digest(cfg.to_dict(), 8)}")
        train_run(cfg, ewd)
        params = load_params(cfg, ewd)
    else:  # an untrained embedder (the tiny preset: tests)
        import jax
        import jax.numpy as jnp

        from icml_jax.models import build_model
        params = jax.jit(build_model(cfg.model).init)(jax.random.key(exp.embedder_seed),
                                                      jnp.zeros((1, 8), jnp.int32))["params"]

    def compute():
        kw = dict(seq_len=exp.embed_len)
        ref_e = amass.embed_texts(cfg.model, params, ByteTokenizer(), ref_texts, **kw)
        pool_e = amass.embed_texts(cfg.model, params, ByteTokenizer(), texts, **kw)
        tags = [mass.tag_skills(t) for t in ref_texts]
        s, graph = amass.score_embeddings(ref_e, tags, pool_e, node_weight=exp.node_weight,
                                          agg=exp.score_agg, damping=exp.damping)
        # variants for the selection tables only (not trained): other weights / aggregation
        variants = {name: amass.score_embeddings(ref_e, tags, pool_e, node_weight=nw, agg=agg,
                                                 damping=exp.damping)[0].tolist()
                    for name, nw, agg in (("frequency", "frequency", exp.score_agg),
                                          ("weighted_max", exp.node_weight, "weighted_max"))}
        e_k = mass.skill_embeddings(ref_e, mass.tag_matrix(tags, graph.skills))
        k = len(graph.skills)
        variants["uniform"] = mass.mass_scores(pool_e, e_k, np.full(k, 1 / k), exp.score_agg).tolist()
        return dict(scores=s.tolist(), graph=graph.as_dict(), variants=variants)
    key = {k: exp.to_dict()[k] for k in ("pool_n", "ref_n", "shares", "data_seed", "node_weight",
                                         "score_agg", "damping", "embed_len")}
    got = cached(os.path.join(wd, "mass_scores.json"),
                 dict(cfg=cfg.to_dict(), n=len(texts), variants=3, **key), compute)
    paths = {"mass": os.path.join(wd, "scores_mass.npy")}
    amass.write_scores(paths["mass"], np.asarray(got["scores"]))
    for name, v in got["variants"].items():  # not trained: composition and overlap only
        paths[f"mass_{name}"] = os.path.join(wd, f"scores_mass_{name}.npy")
        amass.write_scores(paths[f"mass_{name}"], np.asarray(v))
    # control: the rule filter (any skill tag), ties broken at random
    rng = np.random.default_rng(exp.data_seed + 7)
    rule = np.array([1.0 if mass.tag_skills(t) else 0.0 for t in texts]) + 0.5 * rng.random(len(texts))
    paths["filter"] = os.path.join(wd, "scores_filter.npy")
    amass.write_scores(paths["filter"], rule)
    for seed in exp.seeds:
        paths[f"random_{seed}"] = os.path.join(wd, f"scores_random_{seed}.npy")
        amass.write_scores(paths[f"random_{seed}"], np.random.default_rng(1000 + seed).random(len(texts)))
    return paths, got["graph"]


def composition(texts, keep, kind_of, reference=None):
    """Shares of the kept documents by kind (clean / noisy / string / prose) and by tokens;
    ``overlap_mass``: |keep ∩ reference| / |keep| (the MASS selection's indices)."""
    kept = [texts[i] for i in keep]
    n_tok = sum(len(t) + 2 for t in kept)
    out = {f"share_{k}": float(np.mean([kind_of[t] == k for t in kept])) for k in mass.KINDS}
    out["token_share_clean"] = sum(len(t) + 2 for t in kept if kind_of[t] == "clean") / n_tok
    out["token_share_arith"] = sum(len(t) + 2 for t in kept if kind_of[t] in ("clean", "noisy")) / n_tok
    out["docs"] = len(kept)
    out["overlap_mass"] = (len(np.intersect1d(keep, reference)) / len(keep)) if reference is not None \
        else float("nan")
    out["tokens"] = n_tok
    tags = [mass.tag_skills(t) for t in kept]
    for s in mass.SKILLS:
        out[f"skill_{s}"] = float(np.mean([s in t for t in tags]))
    return out


def exact_match(exp, cfg, params, test):
    """Per test problem: 1 if the greedy solution's ``Answer:`` equals the true answer."""
    from icml_jax.data.tokenizers import ByteTokenizer
    from icml_jax.inference.sampling import sample_batched
    tok = ByteTokenizer()
    width = round_up(max(len(tok.encode(r.prompt)) for r in test) + 1, 16)  # one compiled shape
    outs = sample_batched(cfg.model, params, tok, [r.prompt for r in test], 1, 0.0,
                          exp.new_tokens, seed=0, batch_size=exp.eval_batch, prompt_tokens=width)
    return [int(arithmetic.parse_answer(o) == r.problem.answer) for o, r in zip(outs, test)], outs[:3]


def arm_runs(exp):
    """(arm, seed, steps, scores key, ratio) of every run."""
    s = exp.run.train.steps
    more = int(round(s / exp.keep_ratio))
    unknown = sorted(set(exp.arms) - set(ARMS))
    if unknown or "full" not in exp.arms:
        raise ValueError(f"arms={tuple(exp.arms)}: choose from {ARMS}, including 'full' (the gate's arm)")
    out = []
    for seed in exp.seeds:
        out += [("full", seed, s, "", 1.0), ("random", seed, s, f"random_{seed}", exp.keep_ratio),
                ("mass", seed, s, "mass", exp.keep_ratio), ("filter", seed, s, "filter", exp.keep_ratio),
                ("full_more", seed, more, "", 1.0)]
    return [r for r in out if r[0] in exp.arms]


def train_and_score(exp, wd, corpus, paths, test):
    """One row per run: exact match overall and by test skill, with its training's tokens."""
    rows, samples = [], {}
    test_tags = [mass.tag_skills(r.text) for r in test]
    for arm, seed, steps, key, ratio in arm_runs(exp):
        cfg = run_config(exp, corpus, seed, steps=steps, scores=paths.get(key, ""), ratio=ratio)
        rwd = os.path.join(wd, "runs", f"{arm}_seed{seed}")

        def compute():
            summary, _, secs = train_run(cfg, rwd)
            em, outs = exact_match(exp, cfg, load_params(cfg, rwd), test)
            return dict(em=em, outs=outs, train_s=secs,
                        eval_loss=float(summary.get("eval_loss", float("nan")))
                        if isinstance(summary, dict) else float("nan"))
        got = cached(os.path.join(rwd + "_result.json"), dict(cfg=cfg.to_dict(), test=digest(
            [r.text for r in test], 8), new_tokens=exp.new_tokens), compute)
        em = np.asarray(got["em"], np.float64)
        row = dict(arm=arm, seed=seed, steps=steps, ratio=ratio,
                   tokens=steps * cfg.train.batch_size * cfg.data.seq_len, em=float(em.mean()),
                   train_s=got["train_s"])
        for s in mass.SKILLS:
            m = np.array([s in t for t in test_tags])
            row[f"em_{s}"] = float(em[m].mean()) if m.any() else float("nan")
        rows.append(row)
        samples[f"{arm} seed {seed}"] = got["outs"]
        print(f"{arm} seed={seed} steps={steps}: exact match {row['em']:.3f} "
              f"(train {got['train_s']:.0f}s)", flush=True)
    return rows, samples
