"""Precision-recall token losses for next-token prediction (docs/methods/precision_recall.md).

Axis letters: B rows, T token slots, V vocabulary.

**The paper's exact training loss is unverified.** "When Temperature Fails, Change the Loss"
(Verine et al., ICML 2025) has no reference code and its body was not available; only the abstract
and a snippet were. What is implemented here is the spec's *candidate* token-level loss,
reconstructed from the same group's PR-divergence (Verine et al., NeurIPS 2023):

  D_lambda(P||Q) = min(lambda, 1) - sum_x min(lambda P(x), Q(x))

applied per token with the one-hot data target P = delta_y and the model q = softmax(logits) at
that context:

  pr_hinge   L_lambda(q, y) = min(lambda, 1) - min(lambda, q_y)
             = max(lambda - q_y, 0)  for lambda <= 1   (a hinge: stops pushing q_y once q_y >= lambda)
             = 1 - q_y               for lambda >= 1
  nll        -log q_y

Why this form: it is the only member of the PR family that needs nothing but the observed token
(the conditional-distribution version min(lambda,1) - sum_y min(lambda P_y, q_y) needs the unknown
P(.|context)); it is the spec's candidate, and it is behind an explicit flag so that it cannot be
mistaken for the paper's loss. Averaged over the data, E_y[L_lambda] is NOT D_lambda of the
conditional distributions (docs/methods/precision_recall.md, caveat).

Training notes (the measurements are in docs/methods/precision_recall.md):

* The gradient with respect to the logits is -q_y (e_y - q) where q_y < lambda and exactly 0 where
  q_y >= lambda (the ``where`` below makes the tie q_y = lambda zero too). From a near-uniform start
  q_y ~ 1/V, so the signal is ~V times weaker than NLL's -(e_y - q); Adam rescales it, but pure
  ``pr_hinge`` still learns slowly and leaves the mass it does not need (beyond lambda per target)
  wherever the initialisation put it. A small NLL term (``pr_mix_nll``, e.g. 0.1) or a warm start
  from an NLL run (``config.train.init_from``) fixes both; ``experiments/precision_recall`` runs
  both.
* lambda >= 1 gives 1 - q_y (the total-variation-like member), precision-oriented; lambda < 1 is
  recall-oriented: up to 1/lambda next tokens can each reach q = lambda at zero loss.

``pr_token_losses`` returns the per-token terms; ``pr_loss`` weights, reduces and adds the metrics.
"""
import math

import jax
import jax.numpy as jnp

from icml_jax.losses.logps import token_logprobs

LOSS_TYPES = ("nll", "pr_hinge")


def check_pr_args(loss_type: str = "nll", pr_lambda: float = 1.0, pr_mix_nll: float = 0.0) -> None:
    """Raises a ValueError naming the config key for an unknown type, lambda <= 0 or mix < 0."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"config.loss.type={loss_type!r} is unknown; choose one of {LOSS_TYPES}")
    try:
        lam = float(pr_lambda)
    except (TypeError, ValueError):
        raise ValueError(f"config.loss.pr_lambda must be a number > 0, got {pr_lambda!r}") from None
    if not (lam > 0 and math.isfinite(lam)):
        raise ValueError(f"config.loss.pr_lambda must be a finite number > 0 (lambda < 1 is "
                         f"recall-oriented, lambda >= 1 precision-oriented), got {pr_lambda!r}")
    mix = float(pr_mix_nll)
    if not (mix >= 0 and math.isfinite(mix)):
        raise ValueError(f"config.loss.pr_mix_nll (weight of the added NLL term) must be a finite "
                         f"number >= 0, got {pr_mix_nll!r}")


def pr_hinge_from_q(q_y, pr_lambda: float):
    """min(lambda, 1) - min(lambda, q_y) elementwise, with zero value and gradient where q_y >= lambda."""
    lam = float(pr_lambda)
    cap = min(lam, 1.0)
    return jnp.where(q_y < lam, cap - q_y, cap - lam)


def pr_token_losses(logits_BTV, targets_BT, *, pr_lambda: float = 1.0):
    """(pr_hinge [B, T], nll [B, T], q_y [B, T]), float32, for the targets under softmax(logits)."""
    check_pr_args("pr_hinge", pr_lambda)
    logq_y = token_logprobs(logits_BTV, targets_BT)
    q_y = jnp.exp(logq_y)
    return pr_hinge_from_q(q_y, pr_lambda), -logq_y, q_y


def pr_loss(logits_BTV, targets_BT, weights_BT=None, *, loss_type: str = "nll",
            pr_lambda: float = 1.0, pr_mix_nll: float = 0.0, reduction: str = "mean"):
    """(loss, metrics) of next-token prediction with the objective ``loss_type``.

    ``nll``: -log q_y. ``pr_hinge``: L_lambda(q, y) + pr_mix_nll * (-log q_y) (module docstring).
    ``weights_BT`` (0/1, default all ones) masks padding. ``reduction="mean"`` returns weighted
    means over the tokens; ``"sum"`` returns weighted sums (what ``task.loss`` hands the trainer,
    which divides by the token count). Metrics, reduced the same way: ``token_nll``, ``pr_hinge``
    (L_lambda even when training NLL, so runs are comparable), ``q_target`` (q_y) and
    ``saturated`` (the share of tokens with q_y >= lambda: zero pr_hinge gradient).
    """
    check_pr_args(loss_type, pr_lambda, pr_mix_nll)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    hinge, nll, q_y = pr_token_losses(logits_BTV, targets_BT, pr_lambda=pr_lambda)
    w = jnp.ones_like(nll) if weights_BT is None else weights_BT.astype(jnp.float32)
    per_token = nll if loss_type == "nll" else hinge + float(pr_mix_nll) * nll
    denom = jnp.maximum(w.sum(), 1.0) if reduction == "mean" else 1.0
    red = lambda x: jnp.sum(x * w) / denom  # noqa: E731
    metrics = {"token_nll": red(nll), "pr_hinge": red(hinge), "q_target": red(q_y),
               "saturated": red((q_y >= float(pr_lambda)).astype(jnp.float32))}
    return red(per_token), metrics
