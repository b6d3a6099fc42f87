"""Tokenizers: a byte-level tokenizer and a SentencePiece wrapper with one interface.

Both expose ``vocab_size``, ``pad_id``, ``bos_id``, ``eos_id``, ``encode(str) -> list[int]`` and
``decode(list[int]) -> str``; ``encode_np(str) -> np.ndarray[int32]`` is the fast path the pipeline
uses. Specials are never produced by ``encode``; the pipeline adds bos/eos around each document.

Train a SentencePiece model on the Shakespeare train split with one command:

    python -m icml_jax.data.tokenizers --train --out=/tmp/spm/spm --vocab_size=1000

which writes ``/tmp/spm/spm.model`` (point ``config.data.tokenizer.model_path`` at it and set
``config.data.tokenizer.type = "sentencepiece"``).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_np(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes offset by 3: pad=0, bos=1, eos=2, byte b -> b + 3; vocab_size = 259.

    ``extra_ids=N`` adds N single-token symbols after the bytes (like ByT5's extra ids): the
    Unicode private-use characters U+E000 ... U+E000+N-1 encode to ids 259 ... 258+N (one token
    each, not their three UTF-8 bytes) and decode back; vocab_size = 259 + N. Synthetic tasks use
    them for symbols no text contains (e.g. one token per key/value pair)."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    first_extra = 0xE000  # U+E000: the start of the Basic Multilingual Plane's private-use area

    def __init__(self, extra_ids: int = 0):
        if isinstance(extra_ids, bool) or int(extra_ids) != extra_ids or not 0 <= extra_ids <= 6400:
            raise ValueError(f"config.data.tokenizer.extra_ids={extra_ids!r}: expected an integer 0 ... 6400 "
                             "(the private-use area U+E000 ... U+F8FF)")
        self.extra_ids = int(extra_ids)
        self.vocab_size = 256 + self.offset + self.extra_ids

    def _extra_layout(self, text: str):
        """None when ``text`` holds no extra symbol; else (utf-8 bytes, keep mask over them, the
        extra ids at the kept first bytes of extra symbols (0 elsewhere))."""
        if not self.extra_ids:
            return None
        cp = np.frombuffer(text.encode("utf-32-le"), "<u4").astype(np.int64)
        extra = (cp >= self.first_extra) & (cp < self.first_extra + self.extra_ids)
        if not extra.any():
            return None
        nbytes = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
        char = np.repeat(np.arange(len(cp)), nbytes)
        first = np.r_[True, char[1:] != char[:-1]]
        keep = ~extra[char] | first
        ids = np.where(extra[char] & first, 256 + self.offset + cp[char] - self.first_extra, 0)
        return np.frombuffer(text.encode("utf-8"), np.uint8), keep, ids

    def encode_np(self, text: str) -> np.ndarray:
        """Returns int32 ids of shape [num_utf8_bytes] (an extra symbol counts as one)."""
        layout = self._extra_layout(text)
        if layout is None:
            data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            return data.astype(np.int32) + self.offset
        data, keep, extra = layout
        return np.where(extra > 0, extra, data.astype(np.int64) + self.offset)[keep].astype(np.int32)

    def encode(self, text: str) -> list[int]:
        return self.encode_np(text).tolist()

    def encode_with_spans(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids [N], character spans [N, 2]): every byte of a multi-byte character covers that
        whole character (for token alignment across tokenizers, ``data/alignment.py``)."""
        from icml_jax.data.alignment import byte_char_spans  # pylint: disable=g-import-not-at-top
        spans = byte_char_spans(text)
        layout = self._extra_layout(text)
        return self.encode_np(text), (spans if layout is None else spans[layout[1]])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Drops specials and out-of-range ids; invalid UTF-8 becomes U+FFFD (never raises)."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        arr = arr[(arr >= self.offset) & (arr < self.vocab_size)]
        utf8 = lambda a: (a - self.offset).astype(np.uint8).tobytes().decode("utf-8", errors="replace")  # noqa: E731
        byte_end = 256 + self.offset
        out, start = [], 0  # byte runs decoded as UTF-8, each extra id as its own character
        for i in np.flatnonzero(arr >= byte_end):
            out += [utf8(arr[start:i]), chr(self.first_extra + int(arr[i]) - byte_end)]
            start = i + 1
        return "".join(out) + utf8(arr[start:])

    def extra_symbol(self, i: int) -> str:
        """The character that encodes to extra id ``i`` (token id 259 + i)."""
        if not 0 <= i < self.extra_ids:
            raise ValueError(f"extra symbol {i} out of range: this tokenizer has extra_ids={self.extra_ids}")
        return chr(self.first_extra + i)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def prompt_ids(tok, text: str) -> list[int]:
    """A prompt's ids: an HF tokenizer's own template (``encode_prompt``, as ``transformers``
    encodes it), else BOS + the text (our tokenizers)."""
    if hasattr(tok, "encode_prompt"):
        return list(tok.encode_prompt(text))
    return [tok.bos_id] + list(tok.encode(text))


def continuation_text(tok, prompt: str, prompt_ids_: list, new_ids: list) -> str:
    """The prompt followed by the continuation with the spacing the tokenizer's decoder gives to
    the whole sequence (decoding the new ids alone drops e.g. SentencePiece's leading space)."""
    whole, head = tok.decode(list(prompt_ids_) + list(new_ids)), tok.decode(list(prompt_ids_))
    return prompt + (whole[len(head):] if whole.startswith(head) else tok.decode(new_ids))


class SentencePieceTokenizer:
    """Wraps a trained SentencePiece ``.model`` (see ``train_sentencepiece``)."""

    def __init__(self, model_path: str):
        import sentencepiece as spm  # pylint: disable=g-import-not-at-top

        if not model_path:
            raise ValueError(
                "SentencePiece tokenizer needs a model file: set config.data.tokenizer.model_path "
                "(train one with `python -m icml_jax.data.tokenizers --train --out=DIR/spm`).")
        if not os.path.exists(model_path):
            raise FileNotFoundError(
                f"SentencePiece model {model_path!r} (config.data.tokenizer.model_path) does not exist; "
                "train one with `python -m icml_jax.data.tokenizers --train --out=DIR/spm`.")
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = int(self._sp.get_piece_size())
        self.pad_id = int(self._sp.pad_id())
        self.bos_id = int(self._sp.bos_id())
        self.eos_id = int(self._sp.eos_id())
        if min(self.pad_id, self.bos_id, self.eos_id) < 0:
            raise ValueError(
                f"{model_path}: the SentencePiece model must define pad, bos and eos ids (got pad="
                f"{self.pad_id}, bos={self.bos_id}, eos={self.eos_id}); train it with "
                "train_sentencepiece, which sets pad=0, bos=1, eos=2, unk=3.")

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_with_spans(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids [N], character spans [N, 2] into ``text``) from SentencePiece's piece offsets (byte
        offsets of the surface, converted to characters); a piece with no surface (a lone "▁"
        before a word) has an empty span."""
        from icml_jax.data.alignment import char_of_byte  # pylint: disable=g-import-not-at-top
        proto = self._sp.encode(text, return_type="proto")
        ids = np.asarray([p.id for p in proto.pieces], np.int32)
        offsets = np.asarray([(p.begin, p.end) for p in proto.pieces], np.int64).reshape(-1, 2)
        return ids, char_of_byte(text)[offsets]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        specials = {self.pad_id, self.bos_id, self.eos_id}
        clean = [int(i) for i in np.asarray(ids).reshape(-1)
                  if 0 <= int(i) < self.vocab_size and int(i) not in specials]
        return self._sp.decode(clean)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def _iter_texts(texts_or_source: Any) -> Iterable[str]:
    if isinstance(texts_or_source, str):
        yield texts_or_source
        return
    try:
        n = len(texts_or_source)
        items = (texts_or_source[i] for i in range(n))
    except TypeError:
        items = iter(texts_or_source)
    for item in items:
        text = item["text"] if isinstance(item, dict) else item
        yield text.decode("utf-8") if isinstance(text, bytes) else text


def train_sentencepiece(
    texts_or_source: Any, model_prefix: str, vocab_size: int = 1000, *,
    model_type: str = "unigram", character_coverage: float = 1.0,
    max_sentence_length: int = 16384, seed_sentencepiece_size: int = 200_000,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model and writes ``{model_prefix}.model`` / ``.vocab``.

    Args:
        texts_or_source: an iterable of strings, or a random-access source of dicts with 'text'
            (e.g. ``get_split_source(cfg.data, 'train')``). Documents are fed line by line.
        model_prefix: output path without extension; parent folders are created.
        vocab_size: number of pieces including pad=0, bos=1, eos=2, unk=3.

    Returns:
        The trained tokenizer.
    """
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)

    def sentences():
        for text in _iter_texts(texts_or_source):
            for line in text.splitlines():
                line = line.strip()
                if line:
                    yield line

    spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=model_prefix, vocab_size=vocab_size,
            model_type=model_type, character_coverage=character_coverage,
            pad_id=0, bos_id=1, eos_id=2, unk_id=3, hard_vocab_limit=False,
            # Lossless on text: keep newlines (a piece of their own), runs of spaces and a leading
            # space; unseen characters fall back to UTF-8 byte pieces.
            normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, user_defined_symbols=["\n"], byte_fallback=True,
            allow_whitespace_only_pieces=True, split_digits=True,
            max_sentence_length=max_sentence_length, seed_sentencepiece_size=seed_sentencepiece_size,
            num_threads=os.cpu_count() or 1, minloglevel=2)
    return SentencePieceTokenizer(model_prefix + ".model")


def build_tokenizer(tok_cfg: Any) -> ByteTokenizer | SentencePieceTokenizer:
    """Builds the tokenizer named by ``tok_cfg.type`` ('byte' | 'sentencepiece')."""
    kind = getattr(tok_cfg, "type", "byte")
    if kind == "byte":
        return ByteTokenizer(getattr(tok_cfg, "extra_ids", 0))
    if kind == "sentencepiece":
        if getattr(tok_cfg, "extra_ids", 0):
            raise ValueError("config.data.tokenizer.extra_ids is for the byte tokenizer only; set it to 0 "
                             "with type='sentencepiece' (add symbols when training the SentencePiece model)")
        return SentencePieceTokenizer(getattr(tok_cfg, "model_path", ""))
    raise ValueError(
            f"config.data.tokenizer.type={kind!r} is unknown; choose 'byte' or 'sentencepiece'.")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", action="store_true", help="train a SentencePiece model")
    parser.add_argument("--out", required=True, help="model prefix, writes OUT.model / OUT.vocab")
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--dataset", default="shakespeare",
                        help="config.data.name of the corpus (shakespeare | text_files | jsonl | "
                             "tfds:NAME)")
    parser.add_argument("--path", default="", help="config.data.path for text_files / jsonl")
    parser.add_argument("--text_key", default="text")
    parser.add_argument("--data_dir", default="", help="TFDS data dir ('' = default)")
    args = parser.parse_args(argv)
    if not args.train:
        parser.error("nothing to do: pass --train")
    import ml_collections  # pylint: disable=g-import-not-at-top
    from icml_jax.data import sources  # pylint: disable=g-import-not-at-top

    data_cfg = ml_collections.ConfigDict(dict(name=args.dataset, path=args.path,
                                              text_key=args.text_key, data_dir=args.data_dir))
    src = sources.get_split_source(data_cfg, "train")
    tok = train_sentencepiece(src, args.out, args.vocab_size)
    sample = "To be, or not to be, that is the question."
    print(f"wrote {args.out}.model: vocab_size={tok.vocab_size}; "
                f"{sample!r} -> {len(tok.encode(sample))} pieces")


if __name__ == "__main__":
    main()
