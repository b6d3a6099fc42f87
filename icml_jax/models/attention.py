"""Grouped-query attention with causal + segment (+ optional sliding-window) masking and a KV cache.

Projections are stored grouped by kv head so that tensor parallelism shards whole groups:
  qkv kernel [D, G, R + 2, K]  (R query heads, then k, then v, per kv head g; query head h = g*R + r)
  qkv bias   [G, R + 2, K]     (only with ``config.model.qkv_bias``, Qwen2 style)
  out kernel [G, R, K, D]

Decoding (``decode=True``): the layer keeps a ``cache`` collection sized by the input it was
initialised with ([B, S]): keys/values [B, S, G, K] (already position-encoded), per-slot positions
and segment ids [B, S], and the next write index. Each call writes its T new tokens at the index
and attends over the whole cache; empty slots are never visible (causality by slot index).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models.layers import constrain, get_dtype, param, upcast
from icml_jax.models.positions import POSITIONS

NEG_INF = -1e30
# config.model.attention_impl -> jax.nn.dot_product_attention's ``implementation`` (None: ours)
ATTENTION_IMPLS = {"einsum": None, "xla": "xla", "cudnn": "cudnn"}


def attention_mask(q_seg_BT, k_seg_BS, q_idx_BT, k_idx_BS, q_pos_BT=None, k_pos_BS=None,
                   window: int = 0):
    """Boolean [B, T, S]: key s is visible to query t.

    Same segment, not in the future (``*_idx`` are slot indices in the row or cache) and, with a
    sliding window, q_pos - k_pos < window (``*_pos`` are per-document positions)."""
    mask = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    mask &= k_idx_BS[:, None, :] <= q_idx_BT[:, :, None]
    if window:
        mask &= (q_pos_BT[:, :, None] - k_pos_BS[:, None, :]) < window
    return mask


class KVCache(nn.Module):
    """Decode-time key/value store (collection ``cache``), sized by the input it is initialised with."""

    @nn.compact
    def __call__(self, k_BTGK, v_BTGK, positions_BT, segment_ids_BT):
        """Writes the T new tokens at the write index; returns the whole cache (k, v, positions,
        segment ids) and the slot indices of the queries [B, T] and keys [B, S]."""
        B, T = positions_BT.shape
        ready = self.has_variable("cache", "k")
        ck = self.variable("cache", "k", jnp.zeros, k_BTGK.shape, k_BTGK.dtype)
        cv = self.variable("cache", "v", jnp.zeros, v_BTGK.shape, v_BTGK.dtype)
        cpos = self.variable("cache", "positions", jnp.zeros, (B, T), jnp.int32)
        cseg = self.variable("cache", "segment_ids", jnp.zeros, (B, T), jnp.int32)
        cidx = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if not ready:  # initialisation: allocate only, attend within the input as usual
            idx = jnp.broadcast_to(jnp.arange(T), (B, T))
            return k_BTGK, v_BTGK, positions_BT, segment_ids_BT, idx, idx
        i = cidx.value
        ck.value = jax.lax.dynamic_update_slice(ck.value, k_BTGK.astype(ck.value.dtype), (0, i, 0, 0))
        cv.value = jax.lax.dynamic_update_slice(cv.value, v_BTGK.astype(cv.value.dtype), (0, i, 0, 0))
        cpos.value = jax.lax.dynamic_update_slice(cpos.value, positions_BT.astype(jnp.int32), (0, i))
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, segment_ids_BT.astype(jnp.int32), (0, i))
        cidx.value = i + T
        S = ck.value.shape[1]
        q_idx = jnp.broadcast_to(i + jnp.arange(T), (B, T))
        k_idx = jnp.broadcast_to(jnp.arange(S), (B, S))
        return ck.value, cv.value, cpos.value, cseg.value, q_idx, k_idx


class Attention(nn.Module):
    cfg: ml_collections.ConfigDict
    decode: bool = False

    def setup(self):
        c = self.cfg
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"config.model.num_heads={c.num_heads} must be a multiple of "
                             f"config.model.num_kv_heads={c.num_kv_heads}")
        G, R, K = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        impl = c.get("attention_impl", "einsum")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"config.model.attention_impl={impl!r}; choose one of {sorted(ATTENTION_IMPLS)}")
        self.impl = ATTENTION_IMPLS[impl]
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        init = nn.initializers.normal(c.init_std)
        self.dtype = get_dtype(c.dtype)
        self.position = POSITIONS.get(c.position)(c)
        self.w_qkv = param(self, "qkv", init, (c.d_model, G, R + 2, K),
                           ("embed", "kv_heads", None, "head_dim"), pdt)
        if c.qkv_bias:
            self.b_qkv = param(self, "qkv_bias", nn.initializers.zeros, (G, R + 2, K),
                               ("kv_heads", None, "head_dim"), pdt)
        self.w_out = param(self, "out", init, (G, R, K, c.d_model),
                           ("kv_heads", None, "head_dim", "embed"), pdt)
        if self.decode:
            self.kv_cache = KVCache()

    def project_qkv(self, x_BTD):
        """x [B, T, D] -> q [B, T, G, R, K], k [B, T, G, K], v [B, T, G, K]."""
        R = self.cfg.num_heads // self.cfg.num_kv_heads
        qkv_BTGCK = jnp.einsum("BTD,DGCK->BTGCK", x_BTD.astype(self.dtype),
                               self.w_qkv.astype(self.dtype))
        if self.cfg.qkv_bias:
            qkv_BTGCK = qkv_BTGCK + self.b_qkv.astype(self.dtype)
        q_BTGRK = constrain(qkv_BTGCK[:, :, :, :R], ("batch", "length", "act_kv_heads", None, None))
        return q_BTGRK, qkv_BTGCK[:, :, :, R], qkv_BTGCK[:, :, :, R + 1]

    def attend(self, q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None):
        """Softmax attention in float32 logits; returns [B, T, G, R, K] in the compute dtype.
        With ``attention_impl`` "xla" / "cudnn", ``jax.nn.dot_product_attention`` computes it
        (query head g*R + r uses kv head g there too; the mask and bias are passed as [B, 1, T, S]
        and [B, G*R, T, S]; cuDNN turns the mask into an additive bias, so packed documents and
        sliding windows work there too, at the cost of reading a [B, 1, T, S] bias)."""
        B, T, G, R, K = q_BTGRK.shape
        if self.impl is not None:
            S = k_BSGK.shape[1]
            b = None if bias is None else jnp.broadcast_to(bias, (B, G, R, T, S)).reshape(B, G * R, T, S)
            if b is not None and self.impl == "cudnn":  # cuDNN takes the bias in the input dtype
                b = b.astype(q_BTGRK.dtype)
            o = jax.nn.dot_product_attention(q_BTGRK.reshape(B, T, G * R, K), k_BSGK, v_BSGK, bias=b,
                                             mask=mask_BTS[:, None], implementation=self.impl)
            return o.reshape(B, T, G, R, K)
        logits = upcast(jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK))
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
        q, k = self.position(q, k, positions_BT, positions_BT)
        if self.decode:
            k, v, k_pos, k_seg, q_idx, k_idx = self.kv_cache(k, v, positions_BT, segment_ids_BT)
        else:
            k_pos, k_seg = positions_BT, segment_ids_BT
            q_idx = k_idx = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), positions_BT.shape)
        mask = attention_mask(segment_ids_BT, k_seg, q_idx, k_idx, positions_BT, k_pos,
                              self.cfg.sliding_window)
        bias = self.position.bias(positions_BT, k_pos)
        return self.project_out(self.attend(q, k, v, mask, bias))
