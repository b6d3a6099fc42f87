"""Per-token log-probs of a response, aligned with its tokens.

Axis letters: B sequences, T slots, V vocabulary.

Alignment (the batch contract of ``icml_jax/data/preference.py``): ``logp[b, t]`` is
log p(tokens[b, t] | tokens[b, :t]), read from the logits at slot t-1, so a ``response_mask``
over the tokens masks the log-probs directly. Slot 0 (bos) has no prediction and is always 0;
masked slots (prompt, padding) are exactly 0 and carry no gradient, whatever the logits hold
there. Everything is float32 whatever the compute dtype (DESIGN.md).
"""
import jax
import jax.numpy as jnp


def response_token_logps(logits_BTV: jax.Array, tokens_BT: jax.Array,
                         mask_BT: jax.Array) -> jax.Array:
    """float32 [B, T]: log p(tokens[t] | tokens[:t]) where ``mask_BT`` is set, else 0."""
    logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, tokens_BT[:, 1:, None], axis=-1)[..., 0]
    lp_BT = jnp.pad(lp, ((0, 0), (1, 0)))
    return jnp.where(mask_BT > 0, lp_BT, 0.0)


def sequence_logps(token_logps_BT: jax.Array, mask_BT: jax.Array,
                   average: bool = False) -> jax.Array:
    """float32 [B]: the sum of the masked per-token log-probs, or their mean over the masked
    tokens with ``average`` (TRL's IPO convention)."""
    m = (mask_BT > 0).astype(jnp.float32)
    s = jnp.sum(token_logps_BT * m, axis=-1)
    return s / jnp.maximum(m.sum(-1), 1.0) if average else s
