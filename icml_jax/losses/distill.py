"""Global knowledge distillation of a Puzzle child from its parent (Puzzle's GKD stage;
``docs/methods/puzzle.md``, "Global distillation (GKD)").

Per valid token (weight w_t > 0):

  L_GKD = cosine_weight * sum_l (1 - cos(h_l^parent, h_l^child))
        + kl_weight * KL(p_parent || p_child)
        + lm_weight * (-log p_child(target))

h_l is the residual stream after layer l (cosine over the hidden dimension), p the next-token
distribution. Everything is computed in float32. Axis letters: B rows, L layers, T tokens,
D model width, V vocabulary. Every function returns sums over the valid tokens (weighted by
``weights_BT``); the caller divides by the token count, as the trainer does for every loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from icml_jax.losses.logps import token_logprobs

_EPS = 1e-12  # floor of |a|^2 |b|^2 in the cosine (an all-zero state gives cos 0, not NaN)


def cosine_distance(h_parent_BLTD, h_child_BLTD, weights_BT):
    """sum_{b,t} w_bt * sum_l (1 - cos(h_parent[b,l,t], h_child[b,l,t])), float32 scalar.

    h_parent_BLTD, h_child_BLTD: [B, L, T, D] (any float dtype); weights_BT: [B, T]."""
    a = h_parent_BLTD.astype(jnp.float32)
    b = h_child_BLTD.astype(jnp.float32)
    dot = jnp.sum(a * b, -1)
    norms = jnp.sum(a * a, -1) * jnp.sum(b * b, -1)
    cos_BLT = dot * jax.lax.rsqrt(jnp.maximum(norms, _EPS))
    return jnp.sum((1.0 - cos_BLT).sum(1) * weights_BT.astype(jnp.float32))


def kl_parent_child(parent_logits_BTV, child_logits_BTV, weights_BT):
    """sum_{b,t} w_bt * KL(p_parent[b,t] || p_child[b,t]), float32 scalar (log-softmax in float32).

    parent_logits_BTV, child_logits_BTV: [B, T, V]; weights_BT: [B, T]."""
    lp = jax.nn.log_softmax(parent_logits_BTV.astype(jnp.float32), -1)
    lq = jax.nn.log_softmax(child_logits_BTV.astype(jnp.float32), -1)
    kl_BT = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
    return jnp.sum(kl_BT * weights_BT.astype(jnp.float32))


def gkd_loss(child_logits_BTV, child_hidden_BLTD, parent_logits_BTV, parent_hidden_BLTD, targets_BT,
             weights_BT, *, cosine_weight: float = 1.0, kl_weight: float = 1.0, lm_weight: float = 0.0):
    """(loss sum, token count, metric sums), the trainer's loss contract.

    child_logits_BTV / parent_logits_BTV [B, T, V]; child_hidden_BLTD / parent_hidden_BLTD
    [B, L, T, D] (the residual stream after each layer); targets_BT int [B, T]; weights_BT [B, T]
    (0 = padding). The loss sum is cosine_weight * cosine + kl_weight * kl + lm_weight * ce; the
    metric sums ``cosine``, ``kl``, ``ce`` (the child's NLL of the targets) and ``accuracy`` (its
    argmax equals the target) are all logged whatever the weights."""
    w = weights_BT.astype(jnp.float32)
    cos = cosine_distance(parent_hidden_BLTD, child_hidden_BLTD, w)
    kl = kl_parent_child(parent_logits_BTV, child_logits_BTV, w)
    ce = jnp.sum(-token_logprobs(child_logits_BTV, targets_BT) * w)
    correct = jnp.sum((jnp.argmax(child_logits_BTV, -1) == targets_BT).astype(jnp.float32) * w)
    total = cosine_weight * cos + kl_weight * kl + lm_weight * ce
    return total, w.sum(), {"cosine": cos, "kl": kl, "ce": ce, "accuracy": correct}
