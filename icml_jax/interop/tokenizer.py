"""``load_hf_tokenizer``: an HF ``tokenizer.json`` in our Tokenizer protocol
(``vocab_size, pad_id, bos_id, eos_id, encode, encode_np, decode``; see icml_jax/data/tokenizers.py).

Special ids are taken, in order of precedence, from explicit arguments, ``tokenizer_config.json``
(token strings looked up in the vocabulary), ``generation_config.json`` and ``config.json``. A
missing bos or pad falls back to eos (as Qwen2 does); a missing eos is an error.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


class HFTokenizer:
    """Wraps ``tokenizers.Tokenizer``; ``encode`` never adds special tokens, ``decode`` drops them."""

    def __init__(self, tokenizer, *, bos_id: int, eos_id: int, pad_id: int, eos_ids=(), path=""):
        self._tok = tokenizer
        self.path = path
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_id, self.eos_id, self.pad_id = int(bos_id), int(eos_id), int(pad_id)
        self.eos_ids = tuple(int(i) for i in eos_ids) or (self.eos_id,)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """``text`` as ``transformers`` encodes a prompt (``add_special_tokens=True``): the
        tokenizer's own template (its post-processor) adds whatever special tokens it adds, e.g.
        BOS for Llama and nothing for Qwen2."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        clean = [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(clean, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_id(tok, value) -> int | None:
    """A token given as a string or an AddedToken dict -> its id (None if absent)."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    return tok.token_to_id(value)


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def load_hf_tokenizer(path: str, *, bos_id: int | None = None, eos_id: int | None = None,
                      pad_id: int | None = None, require_eos: bool = True) -> HFTokenizer:
    """Loads ``path/tokenizer.json`` (``path`` may also be the file itself). Without any eos id a
    ValueError, or with ``require_eos=False`` a warning and ``eos_ids = ()``, ``eos_id = -1``
    (generation then runs to its token limit; bos and pad fall back to id 0)."""
    from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

    folder = path if os.path.isdir(path) else os.path.dirname(path)
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"{file} not found; load_hf_tokenizer needs a fast-tokenizer "
                                "tokenizer.json (save one with `AutoTokenizer...save_pretrained`)")
    tok = Tokenizer.from_file(file)
    tcfg = _json(os.path.join(folder, "tokenizer_config.json"))
    gen = _json(os.path.join(folder, "generation_config.json"))
    mcfg = _json(os.path.join(folder, "config.json"))

    def pick(explicit, key):
        found = [_ids(explicit)]
        tid = _token_id(tok, tcfg.get(f"{key}_token"))
        found.append([tid] if tid is not None else [])
        found += [_ids(gen.get(f"{key}_token_id")), _ids(mcfg.get(f"{key}_token_id"))]
        return next((f for f in found if f), [])

    eos = pick(eos_id, "eos")
    missing = f"{folder}: no eos token found in tokenizer_config.json, generation_config.json or config.json"
    if not eos and require_eos:
        raise ValueError(f"{missing}; pass eos_id= explicitly")
    if not eos:
        import warnings
        warnings.warn(f"{missing}: generation runs to its token limit", stacklevel=2)
    fallback = eos[:1] or [0]
    bos, pad = pick(bos_id, "bos") or fallback, pick(pad_id, "pad") or fallback
    out = HFTokenizer(tok, bos_id=bos[0], eos_id=eos[0] if eos else -1, pad_id=pad[0], eos_ids=eos,
                      path=file)
    if not eos:
        out.eos_ids = ()
    checks = (("bos", out.bos_id), ("pad", out.pad_id)) + ((("eos", out.eos_id),) if eos else ())
    for name, i in checks:
        if not 0 <= i < out.vocab_size:
            raise ValueError(f"{folder}: {name} id {i} is outside the vocabulary [0, {out.vocab_size})")
    return out
