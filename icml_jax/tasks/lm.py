"""Next-token language modelling on packed rows."""
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax import data as data_lib
from icml_jax.losses.logps import token_logprobs, with_z_loss
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.base import Task


@TASKS.register("lm")
class LMTask(Task):
    """Batches are dicts of int32 [B, T]: inputs, targets, segment_ids (0 = padding), positions."""

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.model = build_model(config.model)

    def dummy_batch(self, batch_size: int, seq_len: int):
        z = jnp.zeros((batch_size, seq_len), jnp.int32)
        return dict(inputs=z, targets=z, segment_ids=z + 1, positions=z)

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"])["params"]

    def loss(self, params, batch):
        """Returns (sum of token NLL, number of target tokens, metric sums).

        With ``config.train.z_loss`` = c > 0 the sum's gradient also includes c·Σ(log Z)²
        (its value stays the NLL) and ``z_loss`` (that term's sum) is a metric."""
        logits = self.model.apply({"params": params}, batch["inputs"], batch["positions"],
                                  batch["segment_ids"])
        w = (batch["segment_ids"] > 0).astype(jnp.float32)
        nll = -token_logprobs(logits, batch["targets"]) * w
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * w
        n = w.sum()
        metrics = {"accuracy": correct.sum()}
        lsum = nll.sum()
        z = float(self.config.train.z_loss)
        if z:  # PaLM-style z-loss (the RMT reference: 1e-4); logged as its own metric
            lsum, metrics["z_loss"] = with_z_loss(lsum, logits, w, z)
        return lsum, n, metrics

    def train_iterator(self, seed: int, shard=None):
        """``shard`` = (index, count): feed rows [index*B/count, (index+1)*B/count) of every
        global batch (``distributed.process_rows``); None: by jax.process_index()/count()."""
        c = self.config
        index, count = shard if shard is not None else (None, None)
        return data_lib.make_train_iterator(c.data, self.tokenizer, seq_len=c.data.seq_len,
                                            global_batch_size=c.train.batch_size, seed=seed,
                                            process_index=index, process_count=count,
                                            streams=c.data.streams)

    def eval_batches(self, split: str = "validation", shard=None):
        c = self.config
        index, count = shard if shard is not None else (None, None)
        return data_lib.make_eval_batches(c.data, self.tokenizer, split=split, seq_len=c.data.seq_len,
                                          batch_size=c.train.batch_size, max_batches=c.train.eval_batches,
                                          process_index=index, process_count=count)
