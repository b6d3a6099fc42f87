"""MASS's model-dependent half: document embeddings from a tiny LM's hidden states and the
graph-weighted scores of a target pool (docs/methods/mass.md). The graph, the score formula and
the top-x% rule are numpy in ``icml_jax/data/mass.py``.

phi(x) = the mean over x's real tokens ([bos] + bytes, cut to ``seq_len``) of a hook point's
value (default: the last layer's ``resid_post``), captured with ``models.hooks.capture``.

  emb = embed_texts(model_cfg, params, tok, texts)                  # [N, E]
  scores, graph = score_pool(model_cfg, params, tok, reference_texts, pool_texts)
  write_scores("scores.npy", scores)   # then config.data.select_scores / select_ratio
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from icml_jax.atomic import atomic_path
from icml_jax.data import mass


def default_point(model_cfg) -> str:
    return f"layer_{int(model_cfg.num_layers) - 1}/resid_post"


@functools.lru_cache(maxsize=4)
def _pooled_fn(model_cfg, point: str):
    import jax
    import jax.numpy as jnp

    from icml_jax.models import build_model, hooks
    model = build_model(model_cfg)

    @jax.jit
    def pooled(params, tokens_BT, seg_BT):
        pos = jnp.maximum(jnp.cumsum(seg_BT, axis=1) - 1, 0)
        h = hooks.capture(model, params, tokens_BT, pos, seg_BT, points=[point])[point]
        w = seg_BT.astype(jnp.float32)[..., None]
        return (h.astype(jnp.float32) * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
    return pooled


def embed_texts(model_cfg, params, tokenizer, texts: Sequence[str], *, point: str | None = None,
                seq_len: int = 128, batch_size: int = 64) -> np.ndarray:
    """[N, E] float32: mean-pooled hook-point values of ``[bos] + encode(text)`` (cut to
    ``seq_len`` tokens), in fixed [batch_size, seq_len] batches (one compile)."""
    import ml_collections
    if not texts:
        raise ValueError("embed_texts got no texts")
    cfg = model_cfg if isinstance(model_cfg, ml_collections.FrozenConfigDict) \
        else ml_collections.FrozenConfigDict(model_cfg)
    fn = _pooled_fn(cfg, point or default_point(model_cfg))
    out = []
    for lo in range(0, len(texts), batch_size):
        chunk = texts[lo:lo + batch_size]
        toks = np.full((batch_size, seq_len), tokenizer.pad_id, np.int32)
        seg = np.zeros((batch_size, seq_len), np.int32)
        for i, t in enumerate(chunk):
            ids = ([tokenizer.bos_id] + list(tokenizer.encode(t)))[:seq_len]
            toks[i, :len(ids)], seg[i, :len(ids)] = ids, 1
        out.append(np.asarray(fn(params, toks, seg))[:len(chunk)])
    return np.concatenate(out)


def score_embeddings(ref_emb_RE: np.ndarray, ref_tags: Sequence[frozenset[str]],
                     pool_emb_NE: np.ndarray, *, node_weight: str = "pagerank",
                     agg: str = "weighted_sum", damping: float = 0.85):
    """(scores [N], SkillGraph): the graph of the reference tags, skill embeddings e_k from the
    reference embeddings, and each pool document's graph-weighted similarity."""
    graph = mass.skill_graph(ref_tags, node_weight, damping)
    tags = mass.tag_matrix(ref_tags, graph.skills)
    e_KE = mass.skill_embeddings(ref_emb_RE, tags)
    return mass.mass_scores(pool_emb_NE, e_KE, graph.weights, agg), graph


def score_pool(model_cfg, params, tokenizer, reference_texts: Sequence[str],
               pool_texts: Sequence[str], *, node_weight: str = "pagerank",
               agg: str = "weighted_sum", damping: float = 0.85, point: str | None = None,
               seq_len: int = 128, batch_size: int = 64):
    """MASS scores of ``pool_texts``: rule tags of the reference texts (``mass.tag_skills``),
    their graph, and embeddings of both sets with the given LM. Returns (scores, graph)."""
    if node_weight not in mass.NODE_WEIGHTS:  # fail before any compile
        raise ValueError(f"mass_node_weight={node_weight!r}: choose one of {mass.NODE_WEIGHTS}")
    if agg not in mass.SCORE_AGGS:
        raise ValueError(f"mass_score_agg={agg!r}: choose one of {mass.SCORE_AGGS}")
    tags = [mass.tag_skills(t) for t in reference_texts]
    kw = dict(point=point, seq_len=seq_len, batch_size=batch_size)
    ref = embed_texts(model_cfg, params, tokenizer, reference_texts, **kw)
    pool = embed_texts(model_cfg, params, tokenizer, pool_texts, **kw)
    return score_embeddings(ref, tags, pool, node_weight=node_weight, agg=agg, damping=damping)


def write_scores(path: str, scores: np.ndarray) -> None:
    """Writes the scores atomically as a .npy (what ``config.data.select_scores`` reads)."""
    s = np.asarray(scores, np.float64)
    if s.ndim != 1 or not np.isfinite(s).all():
        raise ValueError("scores must be a 1-D array of finite numbers")
    if not path.endswith(".npy"):
        raise ValueError(f"{path!r}: the scores file must end in .npy")
    with atomic_path(path, suffix=".tmp.npy") as tmp:
        np.save(tmp, s)
