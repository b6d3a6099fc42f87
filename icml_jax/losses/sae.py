"""Sparse-autoencoder losses and metrics over arrays (task ``sae``; docs/methods/feature_flow.md).

Every function takes the flattened or batched activations ``x`` [..., D], the SAE's outputs and
the valid-token weights ``w`` [...] (0 at padding). ``sae_loss`` returns the trainer's triple
(loss sum, token count, metric sums): the trainer divides every sum by the count, so

  loss         Σ_D (x - x̂)² per token (+ l0_coef · L0 for jumprelu, + aux_coef · AuxK for topk)
  mse          the reconstruction term alone (squared error summed over D, mean over tokens)
  l0           active latents per token
  fvu          fraction of variance unexplained, Σ (x - x̂)² / Σ (x - x̄)² with x̄ the batch's mean
               token (a per-batch ratio, reported as its token-weighted mean over batches)
  dead         the fraction of latents active on no valid token of the batch (per batch, no
               running state: a latent is "dead" here if it did not fire in the batch's B·T
               tokens; with gradient accumulation, per micro-batch)
  auxk         the AuxK term (Gao et al. 2024), when on: the dead latents' top-k_aux
               reconstruction of the main residual, Σ_D (sg(x - x̂) - ê)²
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _weighted(v, w):
    return (v * w).sum()


def dead_latents(z, w):
    """bool [M]: latents that are zero on every token with weight > 0 (no gradient)."""
    z = jax.lax.stop_gradient(z)
    fired = ((z != 0) & (w[..., None] > 0)).reshape(-1, z.shape[-1])
    return ~jnp.any(fired, axis=0)


def fraction_of_variance_unexplained(x, x_hat, w):
    """Σ_tokens ||x - x̂||² / Σ_tokens ||x - x̄||² over the tokens of weight w (x̄ their mean)."""
    x, x_hat = x.astype(jnp.float32), x_hat.astype(jnp.float32)
    n = jnp.maximum(w.sum(), 1.0)
    mean = (x * w[..., None]).reshape(-1, x.shape[-1]).sum(0) / n
    err = _weighted(((x - x_hat) ** 2).sum(-1), w)
    var = _weighted(((x - mean) ** 2).sum(-1), w)
    return err / jnp.maximum(var, 1e-30)


def sae_loss(x, x_hat, z, w, *, l0=None, l0_coef: float = 0.0, aux_hat=None,
             aux_coef: float = 0.0, dead=None):
    """(loss sum, valid tokens, metric sums) of one batch; ``l0`` [...] the per-token active
    count (differentiable in the thresholds for jumprelu), ``aux_hat`` [..., D] the AuxK
    reconstruction of the residual (None: no AuxK term), ``dead`` [M] ``dead_latents(z, w)`` if
    the caller has it already."""
    x, x_hat = x.astype(jnp.float32), x_hat.astype(jnp.float32)
    w = w.astype(jnp.float32)
    n = w.sum()
    mse = _weighted(((x - x_hat) ** 2).sum(-1), w)
    if l0 is None:
        l0 = (z != 0).astype(jnp.float32).sum(-1)
    l0_sum = _weighted(l0, w)
    total = mse + l0_coef * l0_sum if l0_coef else mse
    metrics = {
        "mse": mse,
        "l0": jax.lax.stop_gradient(l0_sum),
        "fvu": jax.lax.stop_gradient(fraction_of_variance_unexplained(x, x_hat, w)) * n,
        "dead": (dead_latents(z, w) if dead is None else dead).astype(jnp.float32).mean() * n,
    }
    if aux_hat is not None:
        residual = jax.lax.stop_gradient(x - x_hat)
        aux = _weighted(((residual - aux_hat.astype(jnp.float32)) ** 2).sum(-1), w)
        total = total + aux_coef * aux
        metrics["auxk"] = aux
    return total, n, metrics
