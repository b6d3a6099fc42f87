"""ECON's training signals and rewards as pure array functions (docs/methods/econ.md).

Ported from the authors' learner (``tmlr-group/ECON``: ``LLMQMixer.calculate_mix_loss``,
``ECONLearner._calculate_belief_network_loss`` / ``_calculate_encoder_loss`` /
``_perform_bne_coordination``, the environment's reward). Shapes: B transitions, N agents.

Mixer loss (the three signals)::

    y      = r + γ · Q_target · (1 - terminated)                        (see td_target_in)
    L_TD   = Σ_b m_b (Q_tot_b - sg(y_b))² / max(Σ_b m_b, 1e-6)
    L_SD   = mean_b Σ_i (1 - cos(F_i^sd, E(commitment)))²
    L_Q    = mean_b Σ_i (Q_i - sg(Q_tot))²
    L_mix  = L_TD + λ_sd · L_SD + λ_m · L_Q                       (λ_sd = λ_m = 0.1)

Reference quirks, reproduced and documented:

* ``Q_target`` handed to the mixer loss is already r + γ(1 - t)·Q'_tot(next) (``td_target_in``),
  and the loss adds r + γ(1 - t)· to it again, so a non-terminal step's target counts the reward
  twice. For ECON's single-turn tasks (terminated = 1) both reduce to y = r.
* The reference's ``Q_tot`` is [B] and its target [B, 1]: their difference broadcasts to
  [B, B], so every Q_tot is regressed to every transition's target. ``reference_broadcast=True``
  reproduces that; the default is the elementwise loss its comments describe.
* L_SD compares the *mixer's* per-agent features (projected to the embedding width) with the
  commitment's embedding, not the executors' answer embeddings (those are frozen texts).
* L_Q stops the gradient through Q_tot: it moves the local Q's toward the mixed one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

AL_TS_CC_ENV_WEIGHTS = (0.3, 0.5, 0.2)   # the environment's fixed weights (what training used)
AL_TS_CC_INIT = (0.4, 0.4, 0.2)          # the RewardController's initial weights (paper)


def cosine(x, y, eps: float = 1e-8):
    """Cosine similarity over the last axis, each norm clamped at ``eps`` (torch's rule)."""
    nx = jnp.maximum(jnp.linalg.norm(x, axis=-1), eps)
    ny = jnp.maximum(jnp.linalg.norm(y, axis=-1), eps)
    return jnp.sum(x * y, -1) / (nx * ny)


def td_target_in(rewards, q_target_next, gamma: float, terminated):
    """The learner's target r + γ(1 - t)·Q'_tot(next) [B], handed to ``mix_loss`` as
    ``q_target``."""
    return rewards + gamma * (1.0 - terminated) * q_target_next


def td_loss(q_tot, target, mask, reference_broadcast: bool = False):
    """Masked mean squared TD error; ``reference_broadcast`` pairs every Q_tot with every target
    (the reference's [B] - [B, 1] broadcast): Σ_{j,k} m_j (Q_tot_k - y_j)² / Σ m."""
    target = jax.lax.stop_gradient(target)
    denom = jnp.maximum(mask.sum(), 1e-6)
    if reference_broadcast:
        err = q_tot[None, :] - target[:, None]
        return jnp.sum(err ** 2 * mask[:, None]) / denom
    return jnp.sum((q_tot - target) ** 2 * mask) / denom


def consistency_loss(features_sd, commit_emb):
    """L_SD = mean_b Σ_i (1 - cos(F_i, C))²; features [B, N, C], commitment embedding [B, C]."""
    return jnp.mean(jnp.sum((1.0 - cosine(features_sd, commit_emb[:, None])) ** 2, axis=1))


def alignment_loss(local_q, q_tot):
    """L_Q = mean_b Σ_i (Q_i - sg(Q_tot))²; local_q [B, N], q_tot [B]."""
    return jnp.mean(jnp.sum((local_q - jax.lax.stop_gradient(q_tot)[:, None]) ** 2, axis=1))


def mix_loss(q_tot, local_q, features_sd, commit_emb, q_target, rewards, terminated, mask, *,
             gamma: float = 0.99, lambda_sd: float = 0.1, lambda_m: float = 0.1,
             reference_broadcast: bool = False):
    """(L_mix, metrics) as the reference's ``calculate_mix_loss`` (module docstring).
    ``q_target`` is ``td_target_in``'s output; y = r + γ·q_target·(1 - terminated)."""
    y = rewards + gamma * q_target * (1.0 - terminated)
    l_td = td_loss(q_tot, y, mask, reference_broadcast)
    l_sd = consistency_loss(features_sd, commit_emb)
    l_q = alignment_loss(local_q, q_tot)
    total = l_td + lambda_sd * l_sd + lambda_m * l_q
    return total, dict(mix_loss=total, td_loss=l_td, sd_loss=l_sd, q_align_loss=l_q)


def bne_refine(beliefs, encode, *, max_iters: int = 5, tol: float = 0.01, rate: float = 0.1):
    """Stage 2 ("BNE coordination"): repeat b_i <- b_i + rate · Σ_{j≠i} a_ij b_j with
    a = softmax_j(cos(b_i, b_j)) (the softmax includes j = i; the update skips it), until the
    Frobenius norm of one sweep's change is < ``tol`` or ``max_iters`` sweeps. ``encode`` maps
    beliefs [B, N, D] to the group representation; returns (beliefs, group, sweeps run). The
    reference recomputes Q_i and (T_i, p_i) from the observation tokens, not from the refined
    beliefs, so only the beliefs and the group representation change in stage 2."""
    n = beliefs.shape[1]
    off = 1.0 - jnp.eye(n)

    def sweep(b):
        u = b / jnp.maximum(jnp.linalg.norm(b, axis=-1, keepdims=True), 1e-12)
        a = jax.nn.softmax(jnp.einsum("bid,bjd->bij", u, u), axis=-1) * off
        return b + rate * jnp.einsum("bij,bjd->bid", a, b)

    def body(c, _):  # a scan (differentiable) with a done flag: sweeps after convergence are no-ops
        b, done, iters = c
        nb = sweep(b)
        change = jnp.linalg.norm(nb - b)
        b = jnp.where(done, b, nb)
        return (b, done | (change < tol), iters + (~done).astype(jnp.int32)), None

    (out, _, iters), _ = jax.lax.scan(body, (beliefs, jnp.bool_(False), jnp.int32(0)), None,
                                      length=max_iters)
    return out, encode(out), iters


def belief_loss(b1, b2, q1, q2, q_target, mask, *, stage2_weight: float = 0.3,
                evolution_target: float = 0.1):
    """The belief networks' loss (``_calculate_belief_network_loss``); b [B, N, D], q [B, N],
    q_target [B] (``td_target_in``), mask [B]:
    Σ m (Q1_i - sg(y))² / Σm + w2 · Σ m (Q2_i - mean_j Q2_j)² / Σm
    + 0.1 · Σ m (||b2_i - b1_i|| - 0.1)² / Σm + 0.01 (mean ||b1|| + mean ||b2||)."""
    denom = jnp.maximum(mask.sum(), 1e-6)
    m = mask[:, None]
    td = jnp.sum(((q1 - jax.lax.stop_gradient(q_target)[:, None]) * m) ** 2) / denom
    cons = jnp.sum(((q2 - q2.mean(-1, keepdims=True)) * m) ** 2) / denom
    evo = jnp.sum((jnp.linalg.norm(b2 - b1, axis=-1) - evolution_target) ** 2 * m) / denom
    reg = jnp.linalg.norm(b1, axis=-1).mean() + jnp.linalg.norm(b2, axis=-1).mean()
    total = td + stage2_weight * cons + 0.1 * evo + 0.01 * reg
    return total, dict(belief_loss=total, belief_td=td, belief_stage2=cons, belief_evolution=evo)


def encoder_loss(g1_re, g2_re, g1, g2):
    """The belief encoder's loss (``_calculate_encoder_loss``): MSE(E(b1), g1) + MSE(E(b2), g2)
    + 0.1 · MSE(g2, g1) + 0.01 · mean |Ĝ2 Ĝ2ᵀ - I| with Ĝ2 the row-normalised stage-2 groups.
    ``g*_re`` are the encoder recomputed on the same beliefs: with a deterministic encoder the
    first two terms are 0, as in the reference (its belief encoder has no dropout)."""
    u = g2 / jnp.maximum(jnp.linalg.norm(g2, axis=-1, keepdims=True), 1e-12)
    div = jnp.mean(jnp.abs(u @ u.T - jnp.eye(g2.shape[0])))
    total = (jnp.mean((g1_re - g1) ** 2) + jnp.mean((g2_re - g2) ** 2) + 0.1 * jnp.mean((g2 - g1) ** 2)
             + 0.01 * div)
    return total, dict(encoder_loss=total, encoder_diversity=div)


def reward(al, ts, cc, weights=AL_TS_CC_ENV_WEIGHTS):
    """R = w_AL·AL + w_TS·TS + w_CC·CC (linear in the three components)."""
    return weights[0] * al + weights[1] * ts + weights[2] * cc


def init_reward_weights(initial=AL_TS_CC_INIT):
    """The RewardController's starting weights: softmax of ``initial`` (the reference normalises
    by a softmax, so (0.4, 0.4, 0.2) becomes (0.35, 0.35, 0.30)); they sum to 1."""
    return jax.nn.softmax(jnp.asarray(initial, jnp.float32))


def reward_weight_loss(weights, components):
    """L_dr = Σ_rows Σ_k (r_k - w_k)² for reward components [n, 3] (AL, TS, CC)."""
    return jnp.sum((components - weights[None]) ** 2)


def update_reward_weights(weights, components, lr: float = 1e-3):
    """One gradient step on ``reward_weight_loss`` followed by the reference's softmax
    re-normalisation. (In the reference the Adam optimizer holds a Parameter that is replaced
    right after, so only the softmax acts; this is the intended update.)"""
    g = jax.grad(reward_weight_loss)(weights, components)
    return jax.nn.softmax(weights - lr * g)
