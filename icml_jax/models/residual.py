"""Residual streams, chosen by `config.model.residual`.

A residual stream is a pair of module classes:
  ``IO``    owns the token embedding, the final norm and the output projection:
            ``io(tokens_BT, positions_BT) -> h`` and ``io.unembed(h) -> logits_BTV``;
  ``Block`` is one layer: ``block(h, positions_BT, segment_ids_BT) -> (h, None)``
            (the ``(carry, None)`` form lets the decoder scan over layers); it takes
            ``Block(cfg, decode=...)`` and keeps its KV cache in the ``cache`` collection.
The state ``h`` is any array pytree (a [B, T, D] vector for the standard stream; RMT keeps a
per-token matrix). The decoder only loops, scans and remats; it never looks inside ``h``.
"""
from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.models.attention import Attention
from icml_jax.models.layers import RMSNorm, constrain, get_dtype, param
from icml_jax.models.mlp import ACTIVATIONS
from icml_jax.registry import Registry


class Stream(NamedTuple):
    IO: type
    Block: type


RESIDUALS = Registry("residual stream", "config.model.residual")


def _norm(c, name=None):
    return RMSNorm(eps=c.norm_eps, dtype=get_dtype(c.dtype),
                   param_dtype=get_dtype(c.param_dtype, "config.model.param_dtype"), name=name)


class StandardIO(nn.Module):
    cfg: ml_collections.ConfigDict

    def setup(self):
        c = self.cfg
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        init = nn.initializers.normal(c.init_std)
        self.embedding = param(self, "embedding", init, (c.vocab_size, c.d_model),
                               ("vocab", "embed"), pdt)
        self.final_norm = _norm(c)
        if not c.tie_embeddings:
            self.lm_head = param(self, "lm_head", init, (c.d_model, c.vocab_size),
                                 ("embed", "vocab"), pdt)

    def __call__(self, tokens_BT, positions_BT=None):
        """Token embedding [B, T, D] (positions enter in attention, not here)."""
        h_BTD = jnp.take(self.embedding, tokens_BT, axis=0).astype(get_dtype(self.cfg.dtype))
        return constrain(h_BTD, ("batch", "length", "act_embed"))

    def features(self, h_BTD):
        """The final-normed hidden state [B, T, D] that the output projection reads."""
        return self.final_norm(h_BTD)

    def unembed(self, h_BTD):
        """Final norm + output projection; logits in float32 [B, T, V]."""
        x = self.features(h_BTD)
        w_DV = self.embedding.T if self.cfg.tie_embeddings else self.lm_head
        logits = jnp.einsum("BTD,DV->BTV", x, w_DV.astype(x.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))


class StandardBlock(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). Sows the MLP activations."""
    cfg: ml_collections.ConfigDict
    decode: bool = False

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT):
        c = self.cfg
        h_BTD = h_BTD + Attention(c, self.decode, name="attn")(_norm(c, "attn_norm")(h_BTD), positions_BT,
                                                  segment_ids_BT)
        y_BTD, acts_BTF = ACTIVATIONS.get(c.mlp.activation)(c, name="mlp")(_norm(c, "mlp_norm")(h_BTD))
        self.sow("intermediates", "mlp_acts", acts_BTF)
        h_BTD = constrain(h_BTD + y_BTD, ("batch", "length", "act_embed"))
        return h_BTD, None


RESIDUALS.register("standard")(Stream(StandardIO, StandardBlock))
