"""Position embeddings, chosen by `config.model.position`.

A position module is built once per attention layer (so it may own per-layer params) and has two
methods, both optional to override (see ``PositionEmbedding``):
  ``q, k = pos(q_BTGRK, k_BSGK, q_pos_BT, k_pos_BS)``   rotate/transform queries and keys;
  ``bias = pos.bias(q_pos_BT, k_pos_BS)``               an additive float32 logit bias that
                                                         broadcasts to [B, G, R, T, S], or None.
Positions are per token, so packed rows (positions restarting per document) and decoding at an
offset (keys come from the KV cache with their own positions) need nothing special.
"""
import math

import flax.linen as nn
import jax.numpy as jnp
import ml_collections

from icml_jax.registry import Registry

POSITIONS = Registry("position embedding", "config.model.position")


def rope_inv_freq(head_dim: int, theta: float, scaling=None) -> jnp.ndarray:
    """Inverse frequencies theta^(-2i/K) for i < K/2, float32 [K/2], optionally rescaled.

    ``scaling`` is ``config.model.rope_scaling``: ``linear`` divides every frequency by ``factor``;
    ``llama3`` divides the low frequencies (wavelength above original_max_position /
    low_freq_factor) by ``factor``, keeps the high ones (wavelength below original_max_position /
    high_freq_factor) and interpolates smoothly in between (HF's ``rope_type="llama3"``)."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return inv
    if kind == "linear":
        return inv / scaling.factor
    if kind == "llama3":
        lo, hi, old = scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > old / lo, inv / scaling.factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"unknown config.model.rope_scaling.type {kind!r}; choose none, linear or llama3")


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


class PositionEmbedding(nn.Module):
    """Base: no rotation, no bias (NoPE)."""
    cfg: ml_collections.ConfigDict

    def __call__(self, q, k, q_pos, k_pos):
        return q, k

    def bias(self, q_pos, k_pos):
        return None


@POSITIONS.register("rope")
class RoPE(PositionEmbedding):
    def __call__(self, q, k, q_pos, k_pos):
        inv_freq = rope_inv_freq(q.shape[-1], self.cfg.rope_theta, self.cfg.rope_scaling)
        return apply_rotary(q, q_pos, inv_freq), apply_rotary(k, k_pos, inv_freq)


POSITIONS.register("nope")(PositionEmbedding)
