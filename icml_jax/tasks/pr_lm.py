"""``pr_lm``: next-token LM training with a precision-recall loss (docs/methods/precision_recall.md).

The ``lm`` task (same data, model and batches) with the objective picked by ``config.loss``:

  type        nll | pr_hinge   (icml_jax/losses/precision_recall.py; pr_hinge is the spec's
                                *unverified* candidate L_lambda = min(lambda,1) - min(lambda, q_y))
  pr_lambda   lambda > 0 (< 1 recall-oriented)
  pr_mix_nll  weight of an added NLL term (pr_hinge only)

The trainer's ``loss`` / ``eval_loss`` are the objective per token; the metrics ``token_nll``,
``pr_hinge`` (at ``pr_lambda``, also for NLL runs), ``q_target`` and ``saturated`` are logged for
every type (``eval_token_nll`` is the held-out NLL). ``config.train.z_loss`` is not supported here.
The evaluation of a trained model's whole-string probabilities is
``icml_jax/analysis/sequence_logprobs.py``.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_collections

from icml_jax.losses.precision_recall import check_pr_args, pr_loss
from icml_jax.tasks import TASKS
from icml_jax.tasks.lm import LMTask


def loss_settings(config: ml_collections.ConfigDict) -> dict:
    """``config.loss`` as pr_loss keywords, checked (ValueError names the bad key)."""
    if "loss" not in config:
        raise ValueError("task 'pr_lm' needs a config.loss section (type, pr_lambda, pr_mix_nll); "
                         "use configs/precision_recall.py")
    L = config.loss
    out = dict(loss_type=str(L.get("type", "nll")), pr_lambda=L.get("pr_lambda", 1.0),
               pr_mix_nll=L.get("pr_mix_nll", 0.0))
    check_pr_args(**out)
    out["pr_lambda"], out["pr_mix_nll"] = float(out["pr_lambda"]), float(out["pr_mix_nll"])
    return out


@TASKS.register("pr_lm")
class PRLMTask(LMTask):
    """Batches as for ``lm``; the loss is ``pr_loss`` summed over the target tokens."""

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self.loss_kw = loss_settings(config)
        if float(config.train.z_loss):
            raise ValueError("task 'pr_lm' does not support config.train.z_loss; set it to 0")
        # eval_loss is the objective; a perplexity of it only means something for NLL
        self.reports_perplexity = self.loss_kw["loss_type"] == "nll"

    def loss(self, params, batch):
        """(objective sum, number of target tokens, metric sums)."""
        logits = self.model.apply({"params": params}, batch["inputs"], batch["positions"],
                                  batch["segment_ids"])
        w = (batch["segment_ids"] > 0).astype(jnp.float32)
        lsum, msums = pr_loss(logits, batch["targets"], w, reduction="sum", **self.loss_kw)
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * w
        msums["accuracy"] = correct.sum()
        return lsum, w.sum(), msums
