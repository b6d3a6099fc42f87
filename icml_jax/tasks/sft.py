"""``sft``: supervised fine-tuning on prompt-completion pairs (TRL's prompt-completion format,
completion-only loss), and the task EVIC selects samples for (``config.evic``,
docs/methods/evic.md).

Data: ``config.data.path`` (and ``eval_path``) in TRL's prompt-completion JSONL, ``{"prompt",
"completion"}`` per line (``icml_jax.data.preference.read_completion_jsonl``), tokenised as single
sequences ``[bos] prompt completion [eos]``. The loss is the NLL of the completion tokens (eos
included), averaged over the tokens of the batch as TRL's SFTTrainer does. Training batches come
from ``SubsetIterator``: uniform shuffled epochs over all examples, or over the rows the EVIC
refresh selected. ``example_loss`` (one example's mean completion NLL) is what EVIC
differentiates per example.
"""
import jax.numpy as jnp
import ml_collections

from icml_jax.data import preference as pref_data
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask


@TASKS.register("sft")
class SFTTask(PairTask):
    example_shape = ()
    loss_unit = "tokens"
    reports_perplexity = True
    data_format = "prompt/completion per line, TRL's prompt-completion format"

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.tokens_per_unit = 1
        self.model = build_model(config.model)

    def load(self, path: str):
        d = self.config.data
        rows = pref_data.read_completion_jsonl(path)
        return pref_data.encode_responses(
            [r["prompt"] for r in rows], [r["completion"] for r in rows], self.tokenizer,
            d.seq_len, max_prompt_len=d.max_prompt_len, add_eos=d.add_eos)

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"])["params"]

    def loss(self, params, batch):
        """(completion-token NLL sum, completion tokens, {}) over the batch's weighted rows."""
        lp = self.token_logps(params, batch)
        m = (batch["response_mask"] > 0) * batch["weight"][:, None]
        return -jnp.sum(lp * m), jnp.sum(m), {}

    def example_loss(self, params, example):
        """One example's mean completion NLL (arrays without the batch axis)."""
        batch = {k: v[None] for k, v in example.items()}
        m = (batch["response_mask"] > 0).astype(jnp.float32)
        lp = self.token_logps(params, batch)
        return -jnp.sum(lp * m) / jnp.maximum(m.sum(), 1.0)

    def train_iterator(self, seed: int, shard=None):
        index, count = shard if shard is not None else (None, None)
        return pref_data.SubsetIterator(self.train_arrays, self.config.train.batch_size, seed,
                                        process_index=index, process_count=count)
