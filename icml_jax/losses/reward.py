"""Bradley-Terry reward-model losses and batch-wise sum-to-zero regularisation (docs/methods/bsr.md).

Axis letters: B pairs in the (micro-)batch, S data shards (devices holding rows of the batch).

``reward_loss`` follows the reference trainer (LinkedIn-XFACT/RM-Robustness
``modules/trainers/reward_trainer.py::compute_loss``) term by term:

  pair term, by ``variant``:
    bt          -log sigma(r_w - r_l - margin)                (margin 0 = plain BT; a [B] margin
                                                                 is TRL's per-example margin)
    hinge       relu(margin - (r_w - r_l))
    normalized  -log sigma((r_w - r_l) / sqrt(r_w^2 + r_l^2))
    eurus       BT - log sigma(r_w) - log sigma(-r_l)
  + center_coef * (r_w + r_l)^2       (Eisenstein et al.; the reference's line for this raises to
                                       a power without an exponent and cannot run: this is the
                                       intended squared penalty, docs/methods/bsr.md)
  + BSR: lambda_eff * mean(rewards)^2 (``bsr_penalty``)

all averaged over the pairs. The reference allows one of eurus / BSR / centring per run; here they
add, and each is off at 0. Rewards are cast to float32.

BSR. lambda_eff = lambda * B_dev with ``scale_by_batch`` (the reference multiplies ``bsr_lambda``
by the per-device batch once, at trainer construction), else lambda. The mean is over all 2*B_dev
rewards (chosen and rejected) of ONE device's micro-batch, with no all-reduce (``reduce="local"``):
under data parallelism each device adds lambda_eff * m_s^2 to its own loss and the gradients are
averaged, so the global objective is lambda_eff * mean_s(m_s^2). Under ``jit`` over a global batch
the shards are explicit: the B rows are S contiguous blocks of B/S (the row layout of
``icml_jax.sharding.batch_sharding``), so pass ``num_shards`` = S. ``reduce="global"`` uses the
mean over the whole batch instead (a flag; not the reference). The gradient of the penalty with
respect to each of the 2*B_dev rewards of a shard is lambda_eff * m_s / B_dev (docs/methods/bsr.md).
"""
import jax
import jax.numpy as jnp

REWARD_VARIANTS = ("bt", "hinge", "normalized", "eurus")
BSR_REDUCE = ("local", "global")


def _weights(w_B, like_B):
    return jnp.ones_like(like_B) if w_B is None else w_B.astype(jnp.float32)


def bsr_penalty(r_chosen_B, r_rejected_B, *, bsr_lambda: float, scale_by_batch: bool = True,
                reduce: str = "local", num_shards: int = 1, per_device_batch: int | None = None,
                weights_B=None) -> jax.Array:
    """lambda_eff * (mean of the 2B rewards)^2, averaged over ``num_shards`` contiguous row blocks
    (``local``) or over the whole batch (``global``). ``per_device_batch`` (B_dev of the scaling)
    defaults to B / num_shards. ``weights_B`` (0/1 per pair) drop padding pairs from the means."""
    if reduce not in BSR_REDUCE:
        raise ValueError(f"unknown BSR reduction {reduce!r}: choose one of {BSR_REDUCE} "
                         "(config.loss.bsr_reduce)")
    B = r_chosen_B.shape[0]
    if B % num_shards:
        raise ValueError(f"the batch of {B} pairs does not split into {num_shards} data shards; "
                         "config.train.batch_size must be divisible by data*fsdp*grad_accum")
    b_dev = B // num_shards if per_device_batch is None else per_device_batch
    lam = bsr_lambda * b_dev if scale_by_batch else bsr_lambda
    w = _weights(weights_B, r_chosen_B)
    s = (r_chosen_B.astype(jnp.float32) + r_rejected_B.astype(jnp.float32)) * w
    shards = 1 if reduce == "global" else num_shards
    s_SB, w_SB = s.reshape(shards, -1), w.reshape(shards, -1)
    mean_S = s_SB.sum(-1) / jnp.maximum(2.0 * w_SB.sum(-1), 1.0)
    return lam * jnp.mean(jnp.square(mean_S))


def reward_loss(r_chosen_B, r_rejected_B, *, variant: str = "bt", margin=0.0,
                center_coef: float = 0.0, bsr_lambda: float = 0.0, bsr_scale_by_batch: bool = True,
                bsr_reduce: str = "local", num_shards: int = 1, per_device_batch: int | None = None,
                weights_B=None):
    """(loss, metrics) of a reward model on B (chosen, rejected) reward pairs; see the module
    docstring. Metrics are (weighted) batch means: ``accuracy`` (r_w > r_l), ``margin``,
    ``rewards/chosen``, ``rewards/rejected``, ``rewards/mean`` and ``rewards/std`` over all 2B
    rewards, and the loss parts ``loss/pair``, ``loss/center``, ``loss/bsr``."""
    if variant not in REWARD_VARIANTS:
        raise ValueError(f"unknown reward-loss variant {variant!r}: choose one of {REWARD_VARIANTS} "
                         "(config.loss.variant)")
    rw, rl = r_chosen_B.astype(jnp.float32), r_rejected_B.astype(jnp.float32)
    w = _weights(weights_B, rw)
    n = jnp.maximum(w.sum(), 1.0)
    mean = lambda x: jnp.sum(x * w) / n  # noqa: E731
    d = rw - rl
    if variant == "bt":
        pair = -jax.nn.log_sigmoid(d - margin)
    elif variant == "hinge":
        pair = jax.nn.relu(margin - d)
    elif variant == "normalized":
        pair = -jax.nn.log_sigmoid(d / jnp.sqrt(jnp.maximum(rw * rw + rl * rl, 1e-30)))
    else:  # eurus
        pair = -jax.nn.log_sigmoid(d) - jax.nn.log_sigmoid(rw) - jax.nn.log_sigmoid(-rl)
    pair_loss = mean(pair)
    center = center_coef * mean(jnp.square(rw + rl)) if center_coef else jnp.zeros(())
    bsr = (bsr_penalty(rw, rl, bsr_lambda=bsr_lambda, scale_by_batch=bsr_scale_by_batch,
                       reduce=bsr_reduce, num_shards=num_shards, per_device_batch=per_device_batch,
                       weights_B=w) if bsr_lambda else jnp.zeros(()))
    r_mean = (jnp.sum(rw * w) + jnp.sum(rl * w)) / (2.0 * n)
    r_var = (jnp.sum(jnp.square(rw - r_mean) * w) + jnp.sum(jnp.square(rl - r_mean) * w)) / (2.0 * n)
    metrics = {"accuracy": mean((d > 0).astype(jnp.float32)), "margin": mean(d),
               "rewards/chosen": mean(rw), "rewards/rejected": mean(rl), "rewards/mean": r_mean,
               "rewards/std": jnp.sqrt(r_var), "loss/pair": pair_loss, "loss/center": center,
               "loss/bsr": bsr}
    return pair_loss + center + bsr, metrics
