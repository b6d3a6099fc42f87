"""``step_prm``: a process reward model trained on step labels, as TRL's ``PRMTrainer`` does (the
explicit counterpart of ``implicit_prm``, which needs outcome labels only).

Data: ``config.data.path`` / ``eval_path`` in TRL's stepwise-supervision JSONL, one ``{"prompt":
str, "completions": [step, ...], "labels": [bool, ...]}`` per line
(``icml_jax.data.preference.read_stepwise_jsonl``), tokenised as ``[bos] + prompt + (step +
separator) + ...`` with each step's label on the last token of ``step + separator``
(``encode_steps``; ``config.steps.separator``, ``config.steps.max_steps``). Model:
``icml_jax.models.reward.StepClassifier`` (two-class head on the decoder; ``backbone`` params, so
``config.train.init_from`` loads an LM there). Loss: cross-entropy over the labelled steps, their
mean as TRL takes it (the count is steps: ``loss_unit="steps"``); metrics ``accuracy`` (of the
steps) and ``positive_rate`` (the share of steps labelled correct: accuracy's chance level).
"""
import jax.numpy as jnp
import ml_collections

from icml_jax.data import preference as pref_data
from icml_jax.losses import token_logprobs
from icml_jax.models.reward import build_step_classifier
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask


@TASKS.register("step_prm")
class StepPRMTask(PairTask):
    example_shape = ()
    loss_unit = "steps"
    data_format = "prompt/completions/labels per line, TRL's stepwise supervision"
    pretrained_key = "backbone"
    can_sample = False

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        # throughput per labelled step: the padded tokens per step of the training set
        steps = max(int(self.train_arrays["step_mask"].sum()), 1)
        self.tokens_per_unit = self.train_arrays["inputs"].size / steps
        self.model = build_step_classifier(config.model)

    def load(self, path: str):
        d = self.config.data
        arrays, stats = pref_data.encode_steps(
            pref_data.read_stepwise_jsonl(path), self.tokenizer, d.seq_len,
            max_steps=self.config.steps.max_steps, max_prompt_len=d.max_prompt_len,
            separator=self.config.steps.separator)
        return arrays, {**stats, "truncated_response": stats["rows_with_dropped_steps"]}

    def extra_dummies(self, batch_size: int):
        K = self.config.steps.max_steps
        return {"step_end": jnp.zeros((batch_size, K), jnp.int32),
                "step_mask": jnp.ones((batch_size, K), jnp.int32),
                "step_label": jnp.zeros((batch_size, K), jnp.float32)}

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"],
                               batch["step_end"])["params"]

    def step_logits(self, params, batch):
        """[B, K, 2] float32 logits at every step's labelled slot."""
        return self.model.apply({"params": params}, batch["inputs"], batch["positions"],
                                batch["segment_ids"], batch["step_end"])

    def loss(self, params, batch):
        logits = self.step_logits(params, batch)
        y = batch["step_label"].astype(jnp.int32)
        ce = -token_logprobs(logits, y)
        w = batch["step_mask"].astype(jnp.float32) * batch["weight"][:, None]
        right = (jnp.argmax(logits, -1) == y).astype(jnp.float32)
        # sums over the labelled steps and their count: the trainer's means are over all steps
        # of all (micro-)batches, TRL's mean over labelled tokens
        return jnp.sum(ce * w), jnp.sum(w), {"accuracy": jnp.sum(right * w),
                                             "positive_rate": jnp.sum(y * w)}
