"""``step_prm``: a process reward model trained on step labels, as TRL's ``PRMTrainer`` does (the
explicit counterpart of ``implicit_prm``, which needs outcome labels only).

Data: ``config.data.path`` / ``eval_path`` in TRL's stepwise-supervision JSONL, one ``{"prompt":
str, "completions": [step, ...], "labels": [bool, ...]}`` per line
(``icml_jax.data.preference.read_stepwise_jsonl``), tokenised as ``[bos] + prompt + (step +
separator) + ...`` with each step's label on the last token of ``step + separator``
(``encode_steps``; ``config.steps.separator``, ``config.steps.max_steps``). Model:
``icml_jax.models.reward.StepClassifier`` (two-class head on the decoder; ``backbone`` params, so
``config.train.init_from`` loads an LM there). Loss: cross-entropy over the labelled steps of a
batch, their mean as TRL takes it; metrics ``accuracy`` (steps) and ``rewards/correct`` /
``rewards/incorrect`` (mean logit margin on correct / wrong steps).
"""
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.data import preference as pref_data
from icml_jax.losses import weighted_mean
from icml_jax.models.reward import build_step_classifier
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import PairTask, as_sums


@TASKS.register("step_prm")
class StepPRMTask(PairTask):
    example_shape = ()
    loss_unit = "responses"
    pretrained_key = "backbone"
    can_sample = False

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.tokens_per_unit = config.data.seq_len
        self.model = build_step_classifier(config.model)

    def load(self, path: str):
        d = self.config.data
        arrays, stats = pref_data.encode_steps(
            pref_data.read_stepwise_jsonl(path), self.tokenizer, d.seq_len,
            max_steps=self.config.steps.max_steps, max_prompt_len=d.max_prompt_len,
            separator=self.config.steps.separator)
        return arrays, {**stats, "truncated_response": stats["dropped_steps"]}

    def extra_dummies(self, batch_size: int):
        K = self.config.steps.max_steps
        return {"step_end": jnp.zeros((batch_size, K), jnp.int32),
                "step_mask": jnp.ones((batch_size, K), jnp.int32),
                "step_label": jnp.zeros((batch_size, K), jnp.float32)}

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["tokens"], batch["positions"], batch["segment_ids"],
                               batch["step_end"])["params"]

    def step_logits(self, params, batch):
        """[B, K, 2] float32 logits at every step's labelled slot."""
        return self.model.apply({"params": params}, batch["tokens"], batch["positions"],
                                batch["segment_ids"], batch["step_end"])

    def loss(self, params, batch):
        logits = self.step_logits(params, batch)
        y = batch["step_label"].astype(jnp.int32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), y[..., None], axis=-1)[..., 0]
        w = batch["step_mask"].astype(jnp.float32) * batch["weight"][:, None]
        margin = logits[..., 1] - logits[..., 0]
        metrics = {"accuracy": weighted_mean((jnp.argmax(logits, -1) == y).astype(jnp.float32), w),
                   "rewards/correct": weighted_mean(margin, w * (y == 1)),
                   "rewards/incorrect": weighted_mean(margin, w * (y == 0))}
        return as_sums(weighted_mean(ce, w), metrics, batch["weight"])
