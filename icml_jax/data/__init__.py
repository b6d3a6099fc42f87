"""Data layer: TFDS builders (array_record, no TensorFlow), tokenizers and grain pipelines.

  tok = build_tokenizer(config.data.tokenizer)
  it = make_train_iterator(config.data, tok, seq_len=config.data.seq_len,
                           global_batch_size=config.train.batch_size, seed=config.seed)
  batch = next(it)  # {'inputs', 'targets', 'segment_ids', 'positions'}: int32 [B, T]
  evals = make_eval_batches(config.data, tok, split="validation", seq_len=config.data.seq_len,
                            batch_size=config.train.batch_size, max_batches=config.train.eval_batches)
"""
from icml_jax.data.pipeline import describe, make_eval_batches, make_train_iterator
from icml_jax.data.sources import get_split_source
from icml_jax.data.tokenizers import (ByteTokenizer, SentencePieceTokenizer, build_tokenizer,
                                      train_sentencepiece)

__all__ = ["build_tokenizer", "make_train_iterator", "make_eval_batches", "get_split_source",
           "describe", "ByteTokenizer", "SentencePieceTokenizer", "train_sentencepiece"]
