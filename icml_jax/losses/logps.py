"""Per-token log-probs from logits: of given targets, of a response aligned with its tokens,
the log-normaliser and the z-loss. The one log-softmax-and-gather of the package.

Axis letters: B sequences, T slots, V vocabulary.

Alignment (the batch contract of ``icml_jax/data/preference.py``): ``logp[b, t]`` is
log p(tokens[b, t] | tokens[b, :t]), read from the logits at slot t-1, so a ``response_mask``
over the tokens masks the log-probs directly. Slot 0 (bos) has no prediction and is always 0;
masked slots (prompt, padding) are exactly 0 and carry no gradient, whatever the logits hold
there. Everything is float32 whatever the compute dtype (DESIGN.md).
"""
import jax
import jax.numpy as jnp


def token_logprobs(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """float32 [B, T] (float64 for float64 logits): log softmax(logits)[target] per slot
    (next-token targets already aligned with the logits)."""
    logp = jax.nn.log_softmax(_at_least_f32(logits_BTV), axis=-1)
    return jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]


def log_normalizer(logits_BTV: jax.Array) -> jax.Array:
    """float32 [B, T] (float64 for float64 logits): log Z = logsumexp over the vocabulary."""
    return jax.nn.logsumexp(_at_least_f32(logits_BTV), axis=-1)


def _at_least_f32(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def with_z_loss(nll_sum, logits_BTV, w_BT, coef: float):
    """(objective sum, z-loss sum): the z-loss sum is coef·Σ_t w_t·(log Z_t)²; the objective has
    the value of ``nll_sum`` (so the reported loss stays plain CE) and the gradient of
    nll_sum + z-loss sum (the z-loss enters through a zero-valued x - stop_gradient(x))."""
    z_sum = coef * jnp.sum(jnp.square(log_normalizer(logits_BTV)) * w_BT)
    return nll_sum + (z_sum - jax.lax.stop_gradient(z_sum)), z_sum


def response_token_logps(logits_BTV: jax.Array, tokens_BT: jax.Array,
                         mask_BT: jax.Array) -> jax.Array:
    """float32 [B, T]: log p(tokens[t] | tokens[:t]) where ``mask_BT`` is set, else 0."""
    lp = token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:])
    lp_BT = jnp.pad(lp, ((0, 0), (1, 0)))
    return jnp.where(mask_BT > 0, lp_BT, 0.0)


def sequence_logps(token_logps_BT: jax.Array, mask_BT: jax.Array,
                   average: bool = False) -> jax.Array:
    """float32 [B]: the sum of the masked per-token log-probs, or their mean over the masked
    tokens with ``average`` (TRL's IPO convention)."""
    m = (mask_BT > 0).astype(jnp.float32)
    s = jnp.sum(token_logps_BT * m, axis=-1)
    return s / jnp.maximum(m.sum(-1), 1.0) if average else s


def weighted_mean(x, w=None):
    """sum(x * w) / max(sum(w), 1): the mean over rows of weight w (0 = padding; None = all 1),
    and 0, not NaN, when every weight is 0."""
    w = jnp.ones_like(x) if w is None else jnp.asarray(w).astype(jnp.float32)
    return jnp.sum(x * w) / jnp.maximum(w.sum(), 1.0)
