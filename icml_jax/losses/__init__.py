"""Losses: pure functions over arrays (log-probs, rewards) that return ``(loss, metrics)``.

No model is called in here; tasks (``icml_jax/tasks``) run the models and hand the arrays over.

  logps       per-token log-probs under a model's logits (of targets, of a response with the
              prompt/padding masked), the log-normaliser and the z-loss
  reward      Bradley-Terry reward-model losses and the BSR regulariser (docs/methods/bsr.md)
  preference  DPO (sigmoid / robust / hinge / IPO) and TGDPO (docs/methods/tgdpo.md)
  implicit_prm  outcome (CE) loss on a log-ratio reward, prefix values and step rewards, scoring
              (docs/methods/implicit_prm.md)
  distill     Puzzle's global distillation: per-layer cosine + KL(parent || child) (+ CE)
              (docs/methods/puzzle.md)
"""
from icml_jax.losses import implicit_prm
from icml_jax.losses.logps import (log_normalizer, response_token_logps, sequence_logps,
                                   token_logprobs, weighted_mean, with_z_loss)
from icml_jax.losses.preference import (PREFERENCE_LOSSES, dpo_loss, tgdpo_logit, tgdpo_loss,
                                       tgdpo_token_weights)
from icml_jax.losses.reward import bsr_penalty, reward_loss

__all__ = ["token_logprobs", "log_normalizer", "with_z_loss", "response_token_logps",
           "sequence_logps", "weighted_mean", "reward_loss", "bsr_penalty", "dpo_loss",
           "tgdpo_loss", "tgdpo_logit", "tgdpo_token_weights", "PREFERENCE_LOSSES", "implicit_prm"]
