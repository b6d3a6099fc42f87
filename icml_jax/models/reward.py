"""A reward model: the decoder with a scalar head read at one token per sequence.

``RewardModel(cfg)(tokens_BT, positions_BT, segment_ids_BT, index_B) -> (rewards_B, h_BF)``:
the decoder's final-normed hidden state (``Decoder(features=True)``) at slot ``index_B`` (the
last response token, ``lengths - 1``) times a bias-free [F, 1] ``score`` kernel, as
``transformers``' ``*ForSequenceClassification`` heads with ``num_labels=1`` score the last
non-padding token. The decoder's params live under ``backbone`` with the same tree as a language
model's, so an LM checkpoint (the SFT policy) initialises it (``config.train.init_from``).
Rewards and hidden states are float32.
"""
import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.models.decoder import Decoder
from icml_jax.models.layers import get_dtype, param, upcast


class RewardModel(nn.Module):
    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, segment_ids_BT, index_B):
        c = self.cfg
        h_BTF = Decoder(c, name="backbone")(tokens_BT, positions_BT, segment_ids_BT, features=True)
        h_BF = upcast(jnp.take_along_axis(h_BTF, index_B[:, None, None], axis=1)[:, 0])
        w_F1 = param(self, "score", nn.initializers.normal(c.init_std), (h_BF.shape[-1], 1),
                     (None, None), get_dtype(c.param_dtype, "config.model.param_dtype"))
        return (h_BF @ w_F1.astype(h_BF.dtype))[:, 0], h_BF


def build_reward_model(model_cfg: ml_collections.ConfigDict) -> RewardModel:
    return RewardModel(ml_collections.FrozenConfigDict(model_cfg))


class StepClassifier(nn.Module):
    """A step-labelled process reward model, as TRL's ``PRMTrainer`` trains one: the decoder with
    a two-class token head (``score`` [F, 2] and ``score_bias`` [2], as ``*ForTokenClassification``
    with ``num_labels=2``) read at the last token of every step.
    ``(tokens_BT, positions_BT, segment_ids_BT, step_end_BK) -> logits_BK2`` (float32; class 1 =
    the step is correct). The decoder's params live under ``backbone``, as in ``RewardModel``."""
    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, segment_ids_BT, step_end_BK):
        c = self.cfg
        h_BTF = Decoder(c, name="backbone")(tokens_BT, positions_BT, segment_ids_BT, features=True)
        h_BKF = upcast(jnp.take_along_axis(h_BTF, step_end_BK[..., None], axis=1))
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        w_F2 = param(self, "score", nn.initializers.normal(c.init_std), (h_BKF.shape[-1], 2),
                     (None, None), pdt)
        b_2 = param(self, "score_bias", nn.initializers.zeros, (2,), (None,), pdt)
        return h_BKF @ w_F2.astype(h_BKF.dtype) + b_2.astype(h_BKF.dtype)


def build_step_classifier(model_cfg: ml_collections.ConfigDict) -> StepClassifier:
    return StepClassifier(ml_collections.FrozenConfigDict(model_cfg))
