"""The task contract: what ``train_and_evaluate`` asks of a task, and nothing else.

A task turns batches into a loss. It is built as ``TASKS.get(config.task)(config, context)``
with a ``TaskContext`` from the loop, and provides:

  model, tokenizer                      the Flax module it trains and the tokenizer of its data
  dummy_batch(batch_size, seq_len)      a batch of the right shapes and dtypes (for init / tracing)
  init_params(rng, batch)               fresh params
  loss(params, batch)                   (loss sum, count, metric sums): the trainer divides the
                                        sums by the count (tokens, pairs or responses) summed over
                                        micro-batches and devices, so any mean is exact
  train_iterator(seed, shard)           an endless iterator of global-batch shards; it has
                                        ``get_state``/``set_state`` for exact resume
  eval_batches(split, shard)            a finite list of batches (padding rows weigh 0)

and these attributes, whose defaults are an LM's:

  loss_unit = "tokens"          what the count counts (logged as ``<unit>_per_sec``)
  tokens_per_unit = 1           tokens in one unit (throughput and FLOPs per unit)
  reports_perplexity = True     whether exp(eval_loss) means something
  can_sample = True             whether ``model`` is a decoder the loop may sample text from
  pretrained_key = None         where ``config.train.init_from``'s decoder params go (a reward
                                model's ``backbone``; None: the params root)

Batch keys, one vocabulary for every task. ``inputs`` (the token ids the model reads),
``positions`` and ``segment_ids`` (0 = padding) are int32 [..., T] in every batch and go to the
model as they are. Packed LM rows (``lm``, ``pr_lm``) add ``targets``, the next token at each
position. Example rows (``pairs.PairTask``: pairs [B, 2, T], single responses [B, T]) predict
their own next tokens, so they have no ``targets``; they add ``response_mask``, ``lengths`` and
``weight`` (``tasks/pairs.py``), per-token caches aligned with ``inputs`` (``ref_logps``,
``guide_logps``) and a task's labels (``label``, ``step_end``, ``step_mask``, ``step_label``).

Metric names follow TRL where it has one: ``rewards/chosen``, ``rewards/rejected``,
``rewards/margins``, ``rewards/accuracies``, ``logps/chosen`` ...; ``accuracy`` is the fraction of
correct predictions (tokens, pairs or labels).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import ml_collections

from icml_jax import data as data_lib


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """``num_shards``: devices holding distinct batch rows (mesh data * fsdp; None = work it out
    from ``config.mesh`` and the device count). ``restore_params(workdir, model_cfg)``: the params
    of the newest readable step of a training workdir, raising ValueError with a one-line reason
    (None: tasks that read other runs refuse to build)."""
    num_shards: int | None = None
    restore_params: Callable[[str, Any], Any] | None = None


class Task:
    """Base of every task: builds the tokenizer, checks it against the model's vocabulary and
    keeps the config and context. Subclasses set ``self.model`` and implement the methods."""

    loss_unit = "tokens"
    tokens_per_unit = 1
    reports_perplexity = True
    can_sample = True
    pretrained_key: str | None = None

    def __init__(self, config: ml_collections.ConfigDict, context: TaskContext | None = None):
        self.config = config
        self.context = context or TaskContext()
        self.tokenizer = data_lib.build_tokenizer(config.data.tokenizer)
        if self.tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(
                f"config.model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({self.tokenizer.vocab_size}); raise config.model.vocab_size")
        self.model = None

    def dummy_batch(self, batch_size: int, seq_len: int) -> dict:
        raise NotImplementedError

    def init_params(self, rng, batch: dict):
        raise NotImplementedError

    def loss(self, params, batch: dict):
        raise NotImplementedError

    def train_iterator(self, seed: int, shard: tuple[int, int] | None = None):
        raise NotImplementedError

    def eval_batches(self, split: str = "validation", shard: tuple[int, int] | None = None):
        raise NotImplementedError
