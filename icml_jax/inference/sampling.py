"""Text in, text out: a thin wrapper over KV-cache decoding (``icml_jax.inference.decode``).

``generate`` (the trainer's end-of-run samples, the quickstart notebook) decodes prompts in one
batch; ``sample_batched`` draws n continuations per prompt in fixed-shape batches (the preference
testbed's groups).
"""
from __future__ import annotations

from typing import Sequence

import jax

from icml_jax.inference import decode


def generate(model, params, tokenizer, prompts: Sequence[str], key: jax.Array, max_new: int = 64,
             temperature: float = 0.8, max_len: int | None = None, *, top_k: int = 0,
             top_p: float = 1.0) -> list[str]:
    """Continues each prompt string; returns the decoded continuations (prompt excluded).

    ``model`` is a ``Decoder`` (its ``cfg`` is used; train- or decode-mode alike); each prompt is
    encoded as ``[bos] + encode(prompt)``; generation stops at the tokenizer's eos (or, for HF
    tokenizers, any of its ``eos_ids``). ``max_len`` caps prompt + new tokens."""
    encoded = _encode(tokenizer, prompts)
    stops = _stops(tokenizer)
    out = decode.generate(model.cfg, params, encoded, key=key, max_new_tokens=max_new,
                          temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stops,
                          pad_id=tokenizer.pad_id, max_len=max_len)
    return _texts(tokenizer, out, stops, len(encoded))


def _encode(tokenizer, prompts):
    return [[tokenizer.bos_id] + list(tokenizer.encode(p)) for p in prompts]


def _stops(tokenizer) -> tuple:
    """The tokens that end a row: the eos, or all of an HF tokenizer's ``eos_ids``."""
    return tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))


def _texts(tokenizer, out, stops, n_rows: int) -> list[str]:
    """The first ``n_rows`` continuations of ``decode.generate``'s output as text, without the
    stop token (and the padding after it)."""
    texts = []
    for row, n in zip(out.tokens[:n_rows], out.lengths[:n_rows]):
        ids = row[:n].tolist()
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids))
    return texts


def sample_batched(model_cfg, params, tokenizer, prompts: Sequence[str], n_per_prompt: int,
                   temperature: float, max_new_tokens: int, seed: int, batch_size: int = 64, *,
                   prompt_tokens: int | None = None, top_k: int = 0,
                   top_p: float = 1.0) -> list[str]:
    """``n_per_prompt`` continuations of each prompt, prompt by prompt (row i * n + j is sample j
    of prompt i), as text without the prompt.

    Rows (each prompt repeated n_per_prompt times) are decoded ``batch_size`` at a time with
    ``decode.generate`` (the last batch is padded with copies of its first row, dropped
    afterwards, so every call has the same batch shape). Prompt + response tokens are capped at
    ``prompt_tokens + max_new_tokens`` (``prompt_tokens`` default: the longest ``[bos] + prompt``
    rounded up to decode's prompt bucket, a multiple of 16); a batch's prompts are left-padded to
    min(that bucket of its longest prompt, ``prompt_tokens``), so when every prompt is longer than
    ``prompt_tokens - 16`` tokens one compilation serves every batch and every later call with
    the same shapes (choose prompt lengths accordingly, e.g. 31 or 63 characters). Each row is
    encoded as ``[bos] + encode(prompt)``; a row ends at the tokenizer's eos or after
    ``max_new_tokens`` tokens; the eos and the padding after it are dropped. Batch b uses key
    ``fold_in(key(seed), b)``: the result is a function of (params, prompts, settings, seed,
    batch_size)."""
    if n_per_prompt < 1 or batch_size < 1:
        raise ValueError(f"need n_per_prompt >= 1 and batch_size >= 1, got {n_per_prompt}, "
                         f"{batch_size}")
    if not prompts:
        return []
    encoded = _encode(tokenizer, prompts)
    longest = max(len(e) for e in encoded)
    width = decode.bucket_length(longest) if prompt_tokens is None else int(prompt_tokens)
    if width < longest:
        raise ValueError(f"prompt_tokens={width} is below the longest prompt ({longest} tokens "
                         "with bos)")
    stops = _stops(tokenizer)
    rows = [e for e in encoded for _ in range(n_per_prompt)]
    texts: list[str] = []
    base = jax.random.key(seed)
    for b, lo in enumerate(range(0, len(rows), batch_size)):
        chunk = rows[lo: lo + batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[0]] * (batch_size - real)
        out = decode.generate(model_cfg, params, chunk, key=jax.random.fold_in(base, b),
                              max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, stop_tokens=stops, pad_id=tokenizer.pad_id,
                              max_len=width + max_new_tokens)
        texts += _texts(tokenizer, out, stops, real)
    return texts
