"""Text in, text out: a thin wrapper over KV-cache decoding (``icml_jax.inference.decode``).

Used by the trainer's end-of-run samples and the quickstart notebook.
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
    encoded = [[tokenizer.bos_id] + list(tokenizer.encode(p)) for p in prompts]
    stops = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    out = decode.generate(model.cfg, params, encoded, key=key, max_new_tokens=max_new,
                          temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stops,
                          pad_id=tokenizer.pad_id, max_len=max_len)
    texts = []
    for row, n in zip(out.tokens, out.lengths):
        ids = row[:n].tolist()
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids))
    return texts
