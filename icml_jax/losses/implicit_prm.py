"""Implicit process rewards (docs/methods/implicit_prm.md): outcome losses on a log-ratio reward, and step
rewards read off the same log-ratios.

Axis letters: B responses, T token slots, K steps, G problems, N responses per problem.

Index convention. Per-token arrays are aligned with the tokens (``icml_jax/losses/logps.py``):
slot t holds the log-ratio of token t given tokens[:t]. ``first_index`` [B] is the first slot that
counts (the first response token, or earlier to include template tokens, as the reference's
``reference`` boundary mode does) and ``step_end_indices`` [B, K] the slot of the LAST token of
each step; ``step_mask`` [B, K] marks the real steps (responses have different step counts). The
reference (PRIME-RL/ImplicitPRM ``eval/prm_eval_utils.py``) works in the shifted space whose entry
i is token i+1's log-prob: its indices are ours minus 1, and the values are the same.

  l_t  = log pi(y_t | .) - log ref(y_t | .)                   (0 before first_index / masked)
  r    = beta * sum_t l_t                                     outcome reward (``outcome_reward``)
  q_k  = beta * sum_{first_index <= t <= e_k} l_t, q_0 = 0    prefix values (``prefix_values``)
  r_k  = q_k - q_{k-1}                                        step rewards (``step_rewards``)

so sum_k r_k = q_K = r when the last step ends at the last response token. Training losses: CE
(``ce_loss``: binary cross-entropy of sigma(r) against the outcome label, logs clamped at -100 as
torch's BCELoss does) and DPO on (correct, incorrect) pairs (``icml_jax.losses.dpo_loss`` with the
sigmoid loss: the same function the preference task uses). Scoring: ``aggregate`` (min / sum /
last over the step scores, padding steps ignored). The host-side evaluations of a PRM's scores
(best-of-N, weighted majority voting, ProcessBench first-error detection) are in
``icml_jax/analysis/prm_eval.py``.
"""
import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.losses.logps import weighted_mean

AGGREGATIONS = ("min", "sum", "last")
SCORE_TYPES = ("single", "accumulative")


def _check_beta(beta):
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (config.loss.beta), got {beta}")


def check_steps(first_index_B, step_end_BK, step_mask_BK, num_slots: int) -> None:
    """Host-side validation of step boundaries (numpy inputs): every real step end lies in
    [first_index, T) and the real ends are strictly increasing."""
    fi, ends, m = (np.asarray(x) for x in (first_index_B, step_end_BK, step_mask_BK))
    if ends.ndim != 2 or m.shape != ends.shape or fi.shape != ends.shape[:1]:
        raise ValueError(f"step boundaries need first_index [B], step_end_indices [B, K] and "
                         f"step_mask [B, K]; got {fi.shape}, {ends.shape}, {m.shape}")
    for b in range(ends.shape[0]):
        e = ends[b][m[b] > 0]
        if not (0 <= fi[b] < num_slots):
            raise ValueError(f"response {b}: first_index {fi[b]} is outside [0, {num_slots})")
        if e.size and (e.min() < fi[b] or e.max() >= num_slots):
            raise ValueError(f"response {b}: step end indices {e.tolist()} must lie in "
                             f"[first_index={fi[b]}, {num_slots}) (token-aligned slots)")
        if np.any(np.diff(e) <= 0):
            raise ValueError(f"response {b}: step end indices {e.tolist()} are not strictly "
                             "increasing; give them in step order")


def token_log_ratios(policy_BT, ref_BT, first_index_B, mask_BT=None):
    """float32 [B, T]: log pi - log ref from ``first_index`` on (and under ``mask_BT``), else 0;
    the reference is frozen (stop-gradient)."""
    T = policy_BT.shape[-1]
    keep = jnp.arange(T)[None, :] >= first_index_B[:, None]
    if mask_BT is not None:
        keep = keep & (mask_BT > 0)
    lr = policy_BT.astype(jnp.float32) - jax.lax.stop_gradient(ref_BT.astype(jnp.float32))
    return jnp.where(keep, lr, 0.0)


def outcome_reward(log_ratio_BT, beta: float):
    """[B]: beta * sum_t l_t."""
    _check_beta(beta)
    return beta * jnp.sum(log_ratio_BT, axis=-1)


def prefix_values(log_ratio_BT, step_end_BK, step_mask_BK, beta: float):
    """[B, K]: q_k = beta * cumsum(l)[e_k] at the real steps, 0 at padding steps."""
    _check_beta(beta)
    cum = jnp.cumsum(log_ratio_BT, axis=-1)
    q = beta * jnp.take_along_axis(cum, jnp.clip(step_end_BK, 0, cum.shape[-1] - 1), axis=-1)
    return jnp.where(step_mask_BK > 0, q, 0.0)


def step_rewards(q_BK, step_mask_BK):
    """[B, K]: r_k = q_k - q_{k-1} (q_0 = 0), 0 at padding steps."""
    prev = jnp.pad(q_BK[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(step_mask_BK > 0, q_BK - prev, 0.0)


def aggregate(scores_BK, step_mask_BK, how: str = "min"):
    """[B]: ``min`` or ``sum`` over the real steps, or the ``last`` real step's score (with
    accumulative scores, q_K: the outcome reward)."""
    m = step_mask_BK > 0
    if how == "min":
        return jnp.min(jnp.where(m, scores_BK, jnp.inf), axis=-1)
    if how == "sum":
        return jnp.sum(jnp.where(m, scores_BK, 0.0), axis=-1)
    if how == "last":
        last = jnp.maximum(jnp.sum(m, axis=-1) - 1, 0)
        return jnp.take_along_axis(scores_BK, last[:, None], axis=-1)[:, 0]
    raise ValueError(f"unknown step aggregation {how!r}: choose one of {AGGREGATIONS}")


def score(log_ratio_BT, step_end_BK, step_mask_BK, *, kappa: float = 0.001,
          score_type: str = "single", how: str = "min"):
    """[B]: a response's PRM score, ``how`` over its step rewards r_k (``single``) or prefix
    values q_k (``accumulative``), with the scoring coefficient kappa (the reference's 0.001;
    min/sum rankings do not depend on it, weighted majority voting does)."""
    if score_type not in SCORE_TYPES:
        raise ValueError(f"unknown score type {score_type!r}: choose one of {SCORE_TYPES}")
    q = prefix_values(log_ratio_BT, step_end_BK, step_mask_BK, kappa)
    s = step_rewards(q, step_mask_BK) if score_type == "single" else q
    return aggregate(s, step_mask_BK, how)


def ce_loss(reward_B, label_B, *, log_clamp: float | None = -100.0, weights_B=None):
    """(mean BCE(sigma(r), label), metrics). With ``log_clamp`` (the reference: torch BCELoss on
    sigma(r), whose logs are clamped at -100) the logs are taken of the float32 probabilities;
    ``None`` uses log-sigmoid (no saturation). Metrics: ``accuracy`` ((r > 0) == label),
    ``rewards/correct`` and ``rewards/incorrect`` (TRL-style names) (mean r over each label)."""
    r = reward_B.astype(jnp.float32)
    y = label_B.astype(jnp.float32)
    if log_clamp is None:
        lp, lq = jax.nn.log_sigmoid(r), jax.nn.log_sigmoid(-r)
    else:
        p = jax.nn.sigmoid(r)
        lp, lq = jnp.maximum(jnp.log(p), log_clamp), jnp.maximum(jnp.log1p(-p), log_clamp)
    losses = -(y * lp + (1 - y) * lq)
    w = jnp.ones_like(r) if weights_B is None else weights_B.astype(jnp.float32)
    metrics = {"accuracy": weighted_mean(((r > 0) == (y > 0.5)).astype(jnp.float32), w),
               "rewards/correct": weighted_mean(r, w * y),
               "rewards/incorrect": weighted_mean(r, w * (1 - y))}
    return weighted_mean(losses, w), metrics
