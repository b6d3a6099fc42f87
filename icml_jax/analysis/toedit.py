"""ToEdit (Zhu et al., ICML 2025; ``docs/methods/toedit.md``): token-level editing of human text.

A prior LM reads each human document once, teacher-forced on the *original* tokens. Every token the
prior finds very predictable, P(x_i | x_<i) >= p, is replaced by a draw from the prior's top-k at
that position, renormalised as softmax(top-k log-probs / beta); every other token is kept. Nothing
is regenerated autoregressively, so an edit at position i never changes the candidates at i + 1.

  python -m icml_jax.toedit --checkpoint=WORKDIR --out=edited.jsonl [--split=train]
      [--p=0.99] [--k=8] [--beta=1.0] [--compare=ge] [--drop_below=0] [--seed=0]

reads the split of the checkpoint's own corpus (``config.data``; ``--data_name`` / ``--data_path``
point it at another corpus the pipeline reads), edits it with the checkpoint's model as the prior,
and writes the edited documents as JSONL (``{"text": ...}`` per line; train on it with
``config.data.name=jsonl config.data.path=edited.jsonl``) plus ``edited.jsonl.stats.json`` (the edit
rate and the settings). Both are written atomically: a failed run leaves neither behind.

Documents are scored in the training pipeline's chunks (``pipeline.tokenize_source``: pieces of at
most ``seq_len`` + 1 tokens overlapping by one), so every token after the document's BOS is scored
exactly once, with the same context a model trained on the corpus saw (the document's EOS is never
edited). The draws depend on the key and on ``batch_size`` (each batch of chunks draws with
``fold_in(key, first chunk index)``): keep both to reproduce an edit. Candidates never include
the tokenizer's special ids or ids outside its vocabulary (the prior's vocabulary is padded to a
multiple of 128); the reference draws from the raw top-k, specials included, and its decode with
``skip_special_tokens`` then deletes a drawn special token.

Flags as in the reference (spec §4): ``compare`` "ge" resamples when P >= p (paper), "gt" when P > p
(the authors' code); ``beta`` 1 is plain top-k sampling (Alg. 1), 1.5 the code's ``up_revise``;
``drop_below`` > 0 also deletes tokens with P < drop_below (the code's ``low_drop_up_revise``; it
changes the document's length). The edit rate is the fraction of scored tokens that were resampled
(a resample draws the original token again with probability >= p at beta = 1, so at most a share
1 - p of them change; ``changed_rate`` counts the tokens that differ).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

COMPARES = ("ge", "gt")


@dataclasses.dataclass(frozen=True)
class ToEditConfig:
    p: float = 0.99  # resample tokens with prior probability >= p (> p with compare="gt")
    k: int = 8  # top-k candidates
    beta: float = 1.0  # candidates ~ softmax(top-k log-probs / beta)
    compare: str = "ge"  # ge (paper) | gt (reference code)
    drop_below: float = 0.0  # > 0: delete tokens with probability < drop_below (code's drop variant)

    def check(self, vocab_size: int | None = None) -> None:
        """One-line errors naming the setting, before any compute."""
        if not self.p >= 0:
            raise ValueError(f"toedit p={self.p} must be >= 0 (p > 1 edits nothing)")
        if self.k < 1 or (vocab_size is not None and self.k > vocab_size):
            raise ValueError(f"toedit k={self.k} must be in [1, {vocab_size or 'vocab size'}]")
        if not self.beta > 0:
            raise ValueError(f"toedit beta={self.beta} must be > 0 (1 = plain top-k sampling)")
        if self.compare not in COMPARES:
            raise ValueError(f"toedit compare={self.compare!r}; choose one of {list(COMPARES)}")
        if not 0 <= self.drop_below < 1:
            raise ValueError(f"toedit drop_below={self.drop_below} must be in [0, 1) (0 = off)")


def edit_targets(logits_BTV, targets_BT, key, cfg: ToEditConfig, banned_ids=()):
    """The ToEdit rule on teacher-forced logits (``logits[:, i]`` scores ``targets[:, i]``).

    Returns (new targets [B, T] int32, resampled [B, T] bool, prior probability of the original
    token [B, T] float32). ``banned_ids`` are never candidates. One key draws every position."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    prob = jnp.exp(jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0])
    hit = prob >= cfg.p if cfg.compare == "ge" else prob > cfg.p
    cand = logp
    if len(banned_ids):
        cand = cand.at[..., jnp.asarray(banned_ids, jnp.int32)].set(-jnp.inf)
    top_v, top_i = jax.lax.top_k(cand, cfg.k)
    j = jax.random.categorical(key, top_v / cfg.beta, axis=-1)
    drawn = jnp.take_along_axis(top_i, j[..., None], axis=-1)[..., 0]
    return jnp.where(hit, drawn, targets_BT).astype(jnp.int32), hit, prob


@functools.lru_cache(maxsize=8)
def _editor(model_cfg, cfg: ToEditConfig, banned_ids: tuple):
    from icml_jax.models.decoder import build_model  # pylint: disable=g-import-not-at-top
    return make_editor(build_model(model_cfg), cfg, banned_ids)


def make_editor(model, cfg: ToEditConfig, banned_ids=()):
    """A jitted ``edit(params, inputs [B, T], targets [B, T], real [B, T] bool, valid [B, T] bool,
    key)`` -> (new targets, resampled, dropped) for the decoder ``model``. ``real`` marks the input
    tokens (the rest is padding, segment 0); ``valid`` the targets that may be edited: the others
    keep their token and are never resampled or dropped."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    banned = tuple(int(i) for i in banned_ids)

    @jax.jit
    def edit(params, inputs_BT, targets_BT, real_BT, valid_BT, key):
        B, T = inputs_BT.shape
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        logits = model.apply({"params": params}, inputs_BT, pos, real_BT.astype(jnp.int32))
        new, hit, prob = edit_targets(logits, targets_BT, key, cfg, banned)
        hit = hit & valid_BT
        drop = (prob < cfg.drop_below) & valid_BT & ~hit
        return jnp.where(hit, new, targets_BT), hit, drop
    return edit


def banned_for(tokenizer, vocab_size: int) -> list[int]:
    """The ids a resample may not produce: the tokenizer's specials and the padded vocabulary."""
    specials = {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id}
    return sorted(specials | set(range(tokenizer.vocab_size, vocab_size)))


def edit_corpus(model_cfg, params, corpus, key, cfg: ToEditConfig, banned_ids=(), batch_size: int = 16):
    """Edits every chunk of a ``pipeline.TokenizedCorpus`` in fixed-shape batches (one compiled
    program). Returns (tokens [N] with the edits, resampled [N] bool, dropped [N] bool) aligned with
    ``corpus.tokens``; each document's BOS and EOS are never scored (``scored_mask``)."""
    import jax  # pylint: disable=g-import-not-at-top

    import ml_collections  # pylint: disable=g-import-not-at-top
    cfg.check(model_cfg.vocab_size)
    edit = _editor(ml_collections.FrozenConfigDict(model_cfg), cfg, tuple(int(i) for i in banned_ids))
    T = int((corpus.chunk_ends - corpus.chunk_starts).max()) - 1
    scored_N = scored_mask(corpus)
    out = corpus.tokens.copy()
    hit_N = np.zeros(len(out), bool)
    drop_N = np.zeros(len(out), bool)
    C = corpus.num_chunks
    for b0 in range(0, C, batch_size):
        idx = list(range(b0, min(b0 + batch_size, C)))
        inp = np.zeros((batch_size, T), np.int32)
        tgt = np.zeros((batch_size, T), np.int32)
        real = np.zeros((batch_size, T), bool)
        valid = np.zeros((batch_size, T), bool)
        for r, c in enumerate(idx):
            piece = corpus.tokens[corpus.chunk_starts[c]:corpus.chunk_ends[c]]
            n = len(piece) - 1
            inp[r, :n], tgt[r, :n], real[r, :n] = piece[:-1], piece[1:], True
            valid[r, :n] = scored_N[corpus.chunk_starts[c] + 1:corpus.chunk_ends[c]]
        new, hit, drop = (np.asarray(x) for x in edit(params, inp, tgt, real, valid, jax.random.fold_in(key, b0)))
        for r, c in enumerate(idx):  # targets are the tokens after each chunk's first
            s, e = corpus.chunk_starts[c] + 1, corpus.chunk_ends[c]
            out[s:e], hit_N[s:e], drop_N[s:e] = new[r, :e - s], hit[r, :e - s], drop[r, :e - s]
    return out, hit_N, drop_N


def scored_mask(corpus) -> np.ndarray:
    """[N] bool: the tokens ToEdit scores, every token but each document's BOS and EOS (the
    end of a document is structure, not text: it is never resampled or dropped)."""
    scored = np.ones(len(corpus.tokens), bool)
    scored[corpus.doc_starts[:-1]] = False
    scored[corpus.doc_starts[1:] - 1] = False
    return scored


def edited_texts(tokenizer, corpus, tokens, dropped) -> list[str]:
    """Each document's edited text (BOS and EOS removed, dropped tokens deleted)."""
    texts = []
    for d in range(corpus.num_documents):
        s, e = corpus.doc_starts[d] + 1, corpus.doc_starts[d + 1] - 1
        ids = tokens[s:e][~dropped[s:e]]
        texts.append(tokenizer.decode(ids))
    return texts


def edit_stats(corpus, original, tokens, hit, dropped, cfg: ToEditConfig) -> dict:
    """Counts over the scored tokens (``scored_mask``)."""
    scored = scored_mask(corpus)
    n = int(scored.sum())
    return dict(documents=int(corpus.num_documents), scored_tokens=n, resampled=int(hit.sum()),
                edit_rate=float(hit.sum() / n), changed_rate=float((tokens != original)[scored].mean()),
                dropped=int(dropped.sum()), drop_rate=float(dropped.sum() / n),
                settings=dataclasses.asdict(cfg))


def write_edited(path: str, texts: list[str], stats: dict) -> None:
    """``path.stats.json`` then ``path`` (JSONL, one ``{"text"}`` per document), each atomically;
    if the corpus cannot be written the stats file is removed again, so neither is left behind."""
    from icml_jax.atomic import write_atomic  # pylint: disable=g-import-not-at-top
    stats_path = path + ".stats.json"
    write_atomic(stats_path, json.dumps(stats, indent=2) + "\n")
    try:
        write_atomic(path, "".join(json.dumps({"text": t}) + "\n" for t in texts))
    except BaseException:
        os.remove(stats_path)
        raise
