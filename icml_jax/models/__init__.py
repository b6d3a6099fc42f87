"""Pure Flax linen model code.

Axis letters used throughout (shapes in names, e.g. ``q_BTGRK``; the table of all letters is in
docs/architecture.md):
  B batch, T query length, S key length, D model width, H query heads, G kv heads,
  R query heads per kv head (H = G * R), K head dim, F ffn hidden, V vocab, L layers.
"""
from icml_jax.models.decoder import Decoder, build_model  # noqa: F401
from icml_jax.models import rmt as _rmt  # noqa: F401,E402  registers residual="rmt"
