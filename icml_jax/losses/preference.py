"""DPO-family losses and TGDPO (docs/methods/tgdpo.md), with TRL's metric names.

Axis letters: B pairs, T token slots (aligned with the tokens, see ``icml_jax/losses/logps.py``).

``dpo_loss`` takes sequence log-probs [B] (sums over the response; TRL's IPO uses their mean
over the response tokens: ``sequence_logps(..., average=True)``). With
h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l)) (the reference terms are 0 with
``reference_free``) and label smoothing eps:

  sigmoid  -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)             (DPO; cDPO with eps)
  robust   (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)   (rDPO)
  hinge    relu(1 - beta h)                                                   (SLiC)
  ipo      (h - 1 / (2 beta))^2

``tgdpo_loss`` takes per-token log-probs [B, T] of the policy, the frozen reference and the frozen
guidance policy pi_r (a DPO-trained policy; same reference). With rho_t = log pi - log ref and the
token reward r_t = beta (log pi_r - log ref) (both frozen, stop-gradient), as the reference's
``dpo_loss`` computes it (dvlab-research/TGDPO ``src/llamafactory/train/tgdpo/trainer.py``):

  -log sigma( sum_t beta (1 + alpha r_t^w) rho_t^w  -  sum_t beta (1 - alpha r_t^l) rho_t^l )

masked to the response tokens and summed (not averaged). The guidance factor is unclipped, as in
the reference; ``weight_clip=(lo, hi)`` clips it (a stability flag, not in the reference).
alpha = 0 is the sigmoid DPO loss.

Metrics (batch means): ``rewards/chosen`` = beta (log pi(y_w) - log ref(y_w)), ``rewards/rejected``,
``rewards/accuracies`` (chosen reward > rejected), ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` (policy sequence log-probs), as TRL's DPOTrainer names them.
"""
import jax
import jax.numpy as jnp

from icml_jax.losses.logps import weighted_mean

PREFERENCE_LOSSES = ("sigmoid", "robust", "hinge", "ipo", "tgdpo")


def _check(beta: float, label_smoothing: float = 0.0):
    if not beta > 0:
        raise ValueError(f"config.loss.beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"config.loss.label_smoothing must be in [0, 0.5), got {label_smoothing}")


def _metrics(pc, pr, rc, rr, beta, w_B):
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return {"rewards/chosen": weighted_mean(chosen, w_B),
            "rewards/rejected": weighted_mean(rejected, w_B),
            "rewards/accuracies": weighted_mean((chosen > rejected).astype(jnp.float32), w_B),
            "rewards/margins": weighted_mean(chosen - rejected, w_B),
            "logps/chosen": weighted_mean(pc, w_B), "logps/rejected": weighted_mean(pr, w_B)}


def dpo_loss(policy_chosen_B, policy_rejected_B, ref_chosen_B, ref_rejected_B, *,
             beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             reference_free: bool = False, weights_B=None):
    """(mean loss over the pairs, metrics); see the module docstring. The reference log-probs
    are constants (stop-gradient)."""
    _check(beta, label_smoothing)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    pc, pr = f32(policy_chosen_B), f32(policy_rejected_B)
    rc, rr = (jax.lax.stop_gradient(f32(ref_chosen_B)), jax.lax.stop_gradient(f32(ref_rejected_B)))
    if reference_free:
        rc, rr = jnp.zeros_like(rc), jnp.zeros_like(rr)
    h = (pc - pr) - (rc - rr)
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * jax.nn.log_sigmoid(beta * h) - eps * jax.nn.log_sigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * jax.nn.log_sigmoid(beta * h)
                  + eps * jax.nn.log_sigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1.0 - beta * h)
    elif loss_type == "ipo":
        losses = jnp.square(h - 1.0 / (2.0 * beta))
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}: choose one of "
                         f"{PREFERENCE_LOSSES[:-1]} (config.loss.type; 'tgdpo' uses tgdpo_loss)")
    return weighted_mean(losses, weights_B), _metrics(pc, pr, rc, rr, beta, weights_B)


def tgdpo_token_weights(ref_BT, guide_BT, *, beta: float, alpha: float, chosen: bool,
                        weight_clip=None):
    """float32 [B, T]: beta (1 + alpha r_t) on chosen tokens, beta (1 - alpha r_t) on rejected
    ones, r_t = beta (log pi_r - log ref); ``weight_clip=(lo, hi)`` clips the guidance factor."""
    r = beta * (jax.lax.stop_gradient(guide_BT.astype(jnp.float32))
                - jax.lax.stop_gradient(ref_BT.astype(jnp.float32)))
    f = 1.0 + alpha * r if chosen else 1.0 - alpha * r
    if weight_clip is not None:
        f = jnp.clip(f, weight_clip[0], weight_clip[1])
    return beta * f


def tgdpo_logit(policy_chosen_BT, policy_rejected_BT, ref_chosen_BT, ref_rejected_BT,
                guide_chosen_BT, guide_rejected_BT, mask_chosen_BT, mask_rejected_BT, *,
                beta: float = 0.1, alpha: float = 0.5, weight_clip=None):
    """(logit [B], chosen weights [B, T], rejected weights [B, T]), float32: TGDPO's
    Bradley-Terry logit sum_t w_t^c (log pi - log ref)^c - sum_t w_t^r (log pi - log ref)^r over
    the masked response tokens, with ``tgdpo_token_weights``; the loss is -log sigmoid(logit).
    On arrays: per-token log-probs of the policy, the reference and the guidance policy."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    mc, mr = (mask_chosen_BT > 0).astype(jnp.float32), (mask_rejected_BT > 0).astype(jnp.float32)
    rc_t, rr_t = jax.lax.stop_gradient(f32(ref_chosen_BT)), jax.lax.stop_gradient(f32(ref_rejected_BT))
    pc_t, pr_t = f32(policy_chosen_BT), f32(policy_rejected_BT)
    wc = tgdpo_token_weights(rc_t, guide_chosen_BT, beta=beta, alpha=alpha, chosen=True,
                             weight_clip=weight_clip)
    wr = tgdpo_token_weights(rr_t, guide_rejected_BT, beta=beta, alpha=alpha, chosen=False,
                             weight_clip=weight_clip)
    return jnp.sum(wc * (pc_t - rc_t) * mc, -1) - jnp.sum(wr * (pr_t - rr_t) * mr, -1), wc, wr


def tgdpo_loss(policy_chosen_BT, policy_rejected_BT, ref_chosen_BT, ref_rejected_BT,
               guide_chosen_BT, guide_rejected_BT, mask_chosen_BT, mask_rejected_BT, *,
               beta: float = 0.1, alpha: float = 0.5, weight_clip=None, weights_B=None):
    """(mean loss over the pairs, metrics) of TGDPO on per-token log-probs; see the module
    docstring. Extra metrics: the mean token weight on chosen / rejected response tokens and
    the fraction of response tokens whose weight is <= 0."""
    _check(beta)
    if weight_clip is not None and not weight_clip[0] <= weight_clip[1]:
        raise ValueError(f"config.loss.tgdpo_weight_clip must be (lo, hi) with lo <= hi, got "
                         f"{tuple(weight_clip)}")
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    mc, mr = (mask_chosen_BT > 0).astype(jnp.float32), (mask_rejected_BT > 0).astype(jnp.float32)
    if weights_B is not None:  # padding pairs stay out of the token-weight metrics too
        mc, mr = mc * (weights_B[:, None] > 0), mr * (weights_B[:, None] > 0)
    rc_t, rr_t = jax.lax.stop_gradient(f32(ref_chosen_BT)), jax.lax.stop_gradient(f32(ref_rejected_BT))
    pc_t, pr_t = f32(policy_chosen_BT), f32(policy_rejected_BT)
    logit, wc, wr = tgdpo_logit(policy_chosen_BT, policy_rejected_BT, ref_chosen_BT,
                                ref_rejected_BT, guide_chosen_BT, guide_rejected_BT,
                                mask_chosen_BT, mask_rejected_BT, beta=beta, alpha=alpha,
                                weight_clip=weight_clip)
    loss = weighted_mean(-jax.nn.log_sigmoid(logit), weights_B)
    seq = lambda x, m: jnp.sum(x * m, -1)  # noqa: E731
    metrics = _metrics(seq(pc_t, mc), seq(pr_t, mr), seq(rc_t, mc), seq(rr_t, mr), beta, weights_B)
    n_c, n_r = jnp.maximum(mc.sum(), 1.0), jnp.maximum(mr.sum(), 1.0)
    metrics.update({"tgdpo/weight_chosen": jnp.sum(wc * mc) / n_c,
                    "tgdpo/weight_rejected": jnp.sum(wr * mr) / n_r,
                    "tgdpo/nonpositive_weights": (jnp.sum((wc <= 0) * mc) + jnp.sum((wr <= 0) * mr))
                    / (n_c + n_r)})
    return loss, metrics
