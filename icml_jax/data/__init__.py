"""Data layer: TFDS builders (array_record, no TensorFlow), tokenizers and grain pipelines.

  tok = build_tokenizer(config.data.tokenizer)
  it = make_train_iterator(config.data, tok, seq_len=config.data.seq_len,
                           global_batch_size=config.train.batch_size, seed=config.seed)
  batch = next(it)  # {'inputs', 'targets', 'segment_ids', 'positions'}: int32 [B, T]
  evals = make_eval_batches(config.data, tok, split="validation", seq_len=config.data.seq_len,
                            batch_size=config.train.batch_size, max_batches=config.train.eval_batches)

The names below are imported on first use (PEP 562), so ``from icml_jax.data import
build_tokenizer`` does not load JAX, grain and TFDS: a CLI can check its inputs and fail in a
fraction of a second.
"""
import importlib

_EXPORTS = {
    "describe": "pipeline", "make_eval_batches": "pipeline", "make_train_iterator": "pipeline",
    "get_split_source": "sources",
    "ByteTokenizer": "tokenizers", "SentencePieceTokenizer": "tokenizers",
    "build_tokenizer": "tokenizers", "train_sentencepiece": "tokenizers",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
