"""Position embeddings, chosen by `config.model.position`.

A position module is built once per attention layer and called as
``q, k, bias = pos(q_BTGRK, k_BSGK, q_pos_BT, k_pos_BS)``: it may rotate q/k (RoPE-like) and/or
return an additive attention bias of shape [B, G, R, T, S] (ALiBi-like) or None.
Positions are per token, so packed rows (positions restarting per document) and decoding at an
offset need nothing special.
"""
import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.registry import Registry

POSITIONS = Registry("position embedding", "config.model.position")


def rope_inv_freq(head_dim: int, theta: float) -> jnp.ndarray:
    """Inverse frequencies theta^(-2i/K) for i < K/2, float32 [K/2]."""
    return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rotary(x, pos, inv_freq):
    """Half-split rotation (the layout HF Llama checkpoints use) of x [B, T, ..., K] at pos [B, T].

    Computed in float32, returned in x's dtype."""
    ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, K/2]
    ang = ang.reshape(ang.shape[:2] + (1,) * (x.ndim - 3) + ang.shape[-1:])
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@POSITIONS.register("rope")
class RoPE(nn.Module):
    cfg: ml_collections.ConfigDict

    def __call__(self, q, k, q_pos, k_pos):
        inv_freq = rope_inv_freq(q.shape[-1], self.cfg.rope_theta)
        return apply_rotary(q, q_pos, inv_freq), apply_rotary(k, k_pos, inv_freq), None


@POSITIONS.register("nope")
class NoPE(nn.Module):
    cfg: ml_collections.ConfigDict

    def __call__(self, q, k, q_pos, k_pos):
        return q, k, None
