"""Residual streams, chosen by `config.model.residual`.

A residual stream is a pair of module classes:
  ``IO``    owns the token embedding, the final norm and the output projection:
            ``io(tokens_BT, positions_BT) -> h`` and ``io.unembed(h) -> logits_BTV``;
  ``Block`` is one layer: ``block(h, positions_BT, segment_ids_BT) -> (h, None)``
            (the ``(carry, None)`` form lets the decoder scan over layers); it takes
            ``Block(cfg, decode=...)`` and keeps its KV cache in the ``cache`` collection.
The state ``h`` is any array pytree (a [B, T, D] vector for the standard stream; RMT keeps a
per-token matrix). The decoder only loops, scans and remats; it never looks inside ``h``.

The registry entry (``Stream``) also answers what the train loop and the FLOP counter ask of a
stream (parameter and FLOP counts, optimizer groups, config checks), so neither names a stream.
The FLOP conventions are stated in ``icml_jax.analysis.flops``.
"""
from typing import Callable, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.models import hetero, hooks
from icml_jax.models.attention import Attention
from icml_jax.models.layers import RMSNorm, constrain, get_dtype, matmul, param, upcast
from icml_jax.models.mlp import ACTIVATIONS, is_gated
from icml_jax.models.positions import position_param_count
from icml_jax.registry import Registry


class OptimizerGroups(NamedTuple):
    """Per-parameter optimizer data (functions of the param pytree, any nesting / layer stacking).

    ``lr_multipliers``: pytree of python floats (the lr of a leaf is peak_lr · multiplier), or
    None for plain AdamW; ``decay_mask``: pytree of bools (True = weight decay)."""
    lr_multipliers: Callable | None
    decay_mask: Callable


class Stream(NamedTuple):
    """A residual stream's registry entry. The functions take ``config.model``."""
    IO: type
    Block: type
    param_count: Callable  # m -> exact number of parameters of Decoder(m)
    train_flops_per_token: Callable  # (m, seq_len) -> training FLOPs per token, exact convention
    paper_forward_flops: Callable  # (m, seq_len, vocab_term) -> the RMT paper's forward FLOPs per sequence
    optimizer_groups: Callable | None = None  # m -> OptimizerGroups; None: AdamW, decay on matrices
    validate: Callable | None = None  # m -> None; raises ValueError naming the config key
    reads_position: bool = True  # whether config.model.position selects this stream's positions


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
        logits = matmul(x, w_DV.astype(x.dtype))
        return constrain(upcast(logits), ("batch", "length", "act_vocab"))


class StandardBlock(nn.Module):
    """Pre-norm block: h += attn(norm(h)); h += mlp(norm(h)). Sows the MLP activations; its hook
    points (``models/hooks.py``) are captured / edited as ``edits`` says."""
    cfg: ml_collections.ConfigDict
    decode: bool = False
    edits: tuple = ()

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT):
        c, e = self.cfg, self.edits
        h_BTD = hooks.point(self, "resid_pre", h_BTD, e)
        y_BTD = Attention(c, self.decode, edits=e, name="attn")(_norm(c, "attn_norm")(h_BTD), positions_BT,
                                                              segment_ids_BT)
        h_BTD = h_BTD + hooks.point(self, "attn_out", y_BTD, e)
        y_BTD, acts_BTF = ACTIVATIONS.get(c.mlp.activation)(c, edits=e, name="mlp")(_norm(c, "mlp_norm")(h_BTD))
        self.sow("intermediates", "mlp_acts", acts_BTF)
        h_BTD = constrain(h_BTD + hooks.point(self, "mlp_out", y_BTD, e), ("batch", "length", "act_embed"))
        return hooks.point(self, "resid_post", h_BTD, e), None


# ----------------------------------------------------------------------------- accounting

def mlp_matrices(m) -> int:
    """3 kernels [D, F] for gated MLPs (gate, up, down), 2 for plain ones."""
    return 3 if is_gated(m.mlp.activation) else 2


def standard_param_count(m: ml_collections.ConfigDict) -> int:
    """Exact number of parameters of ``Decoder(m)`` with the standard residual stream (per layer
    for a ``config.model.blocks`` layout)."""
    D, V = m.d_model, m.vocab_size
    io = V * D + D + (0 if m.tie_embeddings else D * V)
    if hetero.is_hetero(m):
        pos = [position_param_count(hetero.layer_config(m, i)) if isinstance(a, int) else 0
               for i, (a, _) in enumerate(hetero.layout(m))]
        return sum(w + n + p for (w, n), p in zip(hetero.layer_params(m), pos)) + io
    per_layer = position_param_count(m)
    L, H, G, K, F = m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_dim
    attn = D * (H + 2 * G) * K + H * K * D + ((H + 2 * G) * K if m.get("qkv_bias", False) else 0)
    return L * (attn + mlp_matrices(m) * D * F + 2 * D + per_layer) + io


def matmul_params(m: ml_collections.ConfigDict) -> int:
    """Parameters that take part in a matmul per token (excludes the embedding lookup and norms;
    includes the output projection, tied or not)."""
    if hetero.is_hetero(m):
        return sum(w for w, _ in hetero.layer_params(m)) + m.d_model * m.vocab_size
    D, L, H, G, K, F, V = (m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                           m.ffn_dim, m.vocab_size)
    return L * (D * (H + 2 * G) * K + H * K * D + mlp_matrices(m) * D * F) + D * V


def standard_train_flops_per_token(m: ml_collections.ConfigDict, seq_len: int) -> float:
    """Exact convention: 6 x matmul params + QK^T and PV (2 matmuls x 2 FLOPs x T x K per head
    per token, x3 for training, x0.5 causal; only layers with softmax attention)."""
    layers = hetero.attention_layers(m) if hetero.is_hetero(m) else m.num_layers
    attn = 3.0 * 2 * 2 * layers * m.num_heads * m.head_dim * seq_len * 0.5
    return 6.0 * matmul_params(m) + attn


def transformer_paper_forward_flops(N: int, L: int, D: int, H: int, D_h: int, D_FF: int, V: int) -> float:
    """RMT paper Table 7, transformer forward FLOPs per sequence of N tokens."""
    return 4.0 * N * (V + L * D * (2 * D_h * H + D_FF) + L * (N * D_h * H + 0.75 * N * H))


def _standard_paper_forward_flops(m: ml_collections.ConfigDict, seq_len: int,
                                  vocab_term: str = "RV") -> float:
    del vocab_term  # the RMT's printed-formula ambiguity; the transformer formula has one form
    return transformer_paper_forward_flops(seq_len, m.num_layers, m.d_model, m.num_heads,
                                           m.head_dim, m.ffn_dim, m.vocab_size)


RESIDUALS.register("standard")(Stream(
    StandardIO, StandardBlock, param_count=standard_param_count,
    train_flops_per_token=standard_train_flops_per_token,
    paper_forward_flops=_standard_paper_forward_flops))
