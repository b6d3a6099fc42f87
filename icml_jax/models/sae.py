"""A sparse autoencoder over a decoder's activations (task ``sae``; docs/methods/feature_flow.md).

  pre = W_enc (x - b_dec·[pre_bias]) + b_enc        W_enc [D, M], b_enc [M]
  z   = σ(pre)                                     latents [..., M]
  x̂   = z Ŵ_dec + b_dec                            W_dec [M, D] (row j: feature j), b_dec [D]

The spec's equation (feature_flow.md §2) has no b_dec inside the encoder, so ``pre_bias`` is off
by default; with it on, b_dec is subtracted first (the common TopK-SAE form). The two describe the
same functions (b_enc absorbs -W_enc b_dec) and differ only in how they train.

**Unit decoder rows, parametrised.** The stored ``W_dec`` is free; the decoder used everywhere is
Ŵ_dec = W_dec / ||W_dec||_row, so every feature's direction has norm 1 after every update with no
step hook in the train loop (the spec's matching reads these unit rows: ``unit_decoder``). A row's
scale carries no information and the gradient is projected off it by the chain rule.

σ (``activation``):
  topk      keep the k largest of ReLU(pre) per token, zero the rest (at most k non-zeros;
            exactly k wherever k pre-activations are positive). The gradient reaches the kept ones.
  jumprelu  z = pre · 1[pre > θ], θ = exp(log_threshold) per latent (Rajamanoharan et al. 2024).
            The step has no useful derivative in θ, so its backward pass uses the paper's
            straight-through estimator with the rectangle kernel K(u) = 1[|u| < 1/2] and bandwidth
            ε: ∂z/∂pre = 1[pre > θ], ∂z/∂θ = -(θ/ε) K((pre - θ)/ε). The L0 count ``step`` has
            ∂/∂θ = -(1/ε) K((pre - θ)/ε) and no gradient in pre, as in the paper.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

ACTIVATIONS = ("topk", "jumprelu")


def _rectangle(u):
    return (jnp.abs(u) < 0.5).astype(u.dtype)


def _sum_to(g, shape):
    """``g`` summed over its leading axes down to ``shape`` (a per-latent parameter's gradient)."""
    return g.reshape((-1,) + tuple(shape)).sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def jumprelu(pre, threshold, bandwidth: float):
    """pre · 1[pre > threshold] with the rectangle-kernel pseudo-derivative in ``threshold``."""
    return pre * (pre > threshold).astype(pre.dtype)


def _jumprelu_fwd(pre, threshold, bandwidth):
    return jumprelu(pre, threshold, bandwidth), (pre, threshold)


def _jumprelu_bwd(bandwidth, res, g):
    pre, threshold = res
    on = (pre > threshold).astype(pre.dtype)
    d_threshold = -(threshold / bandwidth) * _rectangle((pre - threshold) / bandwidth) * g
    return g * on, _sum_to(d_threshold, threshold.shape)


jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def step(pre, threshold, bandwidth: float):
    """1[pre > threshold] (the L0 count's terms) with ∂/∂θ = -(1/ε) K((pre - θ)/ε), ∂/∂pre = 0."""
    return (pre > threshold).astype(pre.dtype)


def _step_fwd(pre, threshold, bandwidth):
    return step(pre, threshold, bandwidth), (pre, threshold)


def _step_bwd(bandwidth, res, g):
    pre, threshold = res
    d_threshold = -(1.0 / bandwidth) * _rectangle((pre - threshold) / bandwidth) * g
    return jnp.zeros_like(pre), _sum_to(d_threshold, threshold.shape)


step.defvjp(_step_fwd, _step_bwd)


def topk_relu(pre, k: int):
    """ReLU of the k largest entries of ``pre`` along its last axis, zeros elsewhere."""
    m = pre.shape[-1]
    flat = pre.reshape(-1, m)
    vals, idx = jax.lax.top_k(flat, k)
    z = jnp.zeros_like(flat).at[jnp.arange(flat.shape[0])[:, None], idx].set(jax.nn.relu(vals))
    return z.reshape(pre.shape)


def unit_rows(w, eps: float = 1e-12):
    """``w`` [M, D] with every row scaled to norm 1."""
    return w / jnp.maximum(jnp.linalg.norm(w, axis=-1, keepdims=True), eps)


def unit_decoder(params):
    """Ŵ_dec [M, D] of an SAE's params: feature j's unit direction in the model's space (row j)."""
    return unit_rows(params["W_dec"])


class SAE(nn.Module):
    """``SAE(d_model, latents, ...)(x [..., D])`` -> (x̂ [..., D], z [..., M]); with
    ``details=True`` a third output {"pre": [..., M], "l0": [...] (active latents per token; for
    jumprelu differentiable in θ through ``step``), "decoder": Ŵ_dec [M, D]}."""

    d_model: int
    latents: int
    activation: str = "topk"
    k: int = 32
    pre_bias: bool = False
    bandwidth: float = 1e-3  # jumprelu's ε
    init_threshold: float = 1e-3  # jumprelu's initial θ

    @nn.compact
    def __call__(self, x, details: bool = False):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"SAE activation {self.activation!r}: choose one of {ACTIVATIONS}")
        if self.activation == "topk" and not 0 < self.k <= self.latents:
            raise ValueError(f"SAE k={self.k} must be in [1, latents={self.latents}]")
        D, M = self.d_model, self.latents
        x = x.astype(jnp.float32)
        # rows of norm ~1: the unit-row parametrisation divides a row's gradient by its norm, so
        # rows of norm sqrt(D) (a N(0, 1) init) would turn ~sqrt(D) times slower
        w_dec = self.param("W_dec", nn.initializers.normal(D ** -0.5), (M, D))
        # the encoder starts as the decoder's transpose (Gao et al. 2024)
        w_enc = self.param("W_enc", lambda _, shape: unit_rows(w_dec).T, (D, M))
        b_enc = self.param("b_enc", nn.initializers.zeros, (M,))
        b_dec = self.param("b_dec", nn.initializers.zeros, (D,))
        dec = unit_rows(w_dec)
        pre = (x - b_dec if self.pre_bias else x) @ w_enc + b_enc
        if self.activation == "topk":
            z = topk_relu(pre, self.k)
            l0 = (z > 0).astype(jnp.float32).sum(-1)
        else:
            log_t = self.param("log_threshold",
                               lambda _, shape: jnp.full(shape, jnp.log(self.init_threshold)), (M,))
            theta = jnp.exp(log_t)
            z = jumprelu(pre, theta, self.bandwidth)
            l0 = step(pre, theta, self.bandwidth).sum(-1)
        x_hat = z @ dec + b_dec
        if details:
            return x_hat, z, {"pre": pre, "l0": l0, "decoder": dec}
        return x_hat, z
