"""Grouped-query attention with causal + segment masking.

Projections are stored grouped by kv head so that tensor parallelism shards whole groups:
  qkv kernel [D, G, R + 2, K]  (R query heads, then k, then v, per kv head g; query head h = g*R + r)
  out kernel [G, R, K, D]
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models.layers import constrain, get_dtype, param
from icml_jax.models.positions import POSITIONS

NEG_INF = -1e30


def attention_mask(q_seg_BT, k_seg_BS, q_pos_idx_BT, k_pos_idx_BS):
    """Boolean [B, T, S]: key s is visible to query t (same segment and not in the future).

    ``*_pos_idx`` are absolute slot indices in the row (not the per-document positions)."""
    same = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    causal = k_pos_idx_BS[:, None, :] <= q_pos_idx_BT[:, :, None]
    return same & causal


class Attention(nn.Module):
    cfg: ml_collections.ConfigDict

    def setup(self):
        c = self.cfg
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"config.model.num_heads={c.num_heads} must be a multiple of "
                             f"config.model.num_kv_heads={c.num_kv_heads}")
        G, R, K = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        init = nn.initializers.normal(c.init_std)
        self.dtype = get_dtype(c.dtype)
        self.position = POSITIONS.get(c.position)(c)
        self.w_qkv = param(self, "qkv", init, (c.d_model, G, R + 2, K),
                           ("embed", "kv_heads", None, "head_dim"), pdt)
        self.w_out = param(self, "out", init, (G, R, K, c.d_model),
                           ("kv_heads", None, "head_dim", "embed"), pdt)

    def project_qkv(self, x_BTD):
        """x [B, T, D] -> q [B, T, G, R, K], k [B, T, G, K], v [B, T, G, K]."""
        R = self.cfg.num_heads // self.cfg.num_kv_heads
        qkv_BTGCK = jnp.einsum("BTD,DGCK->BTGCK", x_BTD.astype(self.dtype),
                               self.w_qkv.astype(self.dtype))
        q_BTGRK = constrain(qkv_BTGCK[:, :, :, :R], ("batch", "length", "act_kv_heads", None, None))
        return q_BTGRK, qkv_BTGCK[:, :, :, R], qkv_BTGCK[:, :, :, R + 1]

    def attend(self, q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None):
        """Softmax attention in float32 logits; returns [B, T, G, R, K] in the compute dtype."""
        K = q_BTGRK.shape[-1]
        logits = jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK).astype(jnp.float32)
        logits = logits * (K ** -0.5)
        if bias is not None:
            logits = logits + bias
        logits = jnp.where(mask_BTS[:, None, None], logits, NEG_INF)
        probs = jax.nn.softmax(logits, axis=-1).astype(v_BSGK.dtype)
        return jnp.einsum("BGRTS,BSGK->BTGRK", probs, v_BSGK)

    def project_out(self, o_BTGRK):
        return jnp.einsum("BTGRK,GRKD->BTD", o_BTGRK, self.w_out.astype(o_BTGRK.dtype))

    def __call__(self, x_BTD, positions_BT, segment_ids_BT):
        q, k, v = self.project_qkv(x_BTD)
        q, k, bias = self.position(q, k, positions_BT, positions_BT)
        idx_BT = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), positions_BT.shape)
        mask = attention_mask(segment_ids_BT, segment_ids_BT, idx_BT, idx_BT)
        return self.project_out(self.attend(q, k, v, mask, bias))
