"""AdamW with warmup + cosine decay and global-norm clipping, from `config.train`.

A residual stream may declare per-parameter optimizer groups (``IO.optimizer_groups(model_cfg)``
-> ``OptimizerGroups(lr_multipliers, decay_mask)``, e.g. ``icml_jax.models.rmt``). With
``lr_multipliers`` the chain is the RMT reference's muP AdamW:
  clip -> Adam -> × (peak lr · multiplier per leaf) -> + weight_decay·θ (masked) -> × unit schedule,
so the effective decay is schedule(t)·weight_decay·θ, independent of the peak lr. Without groups
(the standard stream) it is optax.adamw, unchanged.
"""
import jax
import ml_collections
import optax


def _warmup_cosine(t: ml_collections.ConfigDict, peak: float) -> optax.Schedule:
    warmup = min(int(t.warmup_steps), max(int(t.steps) - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup, decay_steps=max(int(t.steps), warmup + 1),
        end_value=peak * t.min_lr_ratio)


def lr_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup from 0 to ``t.lr``, then cosine decay to ``t.lr * t.min_lr_ratio``."""
    return _warmup_cosine(t, t.lr)


def unit_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
    """``lr_schedule`` divided by the peak lr: warmup 0 -> 1, cosine to ``min_lr_ratio``."""
    return _warmup_cosine(t, 1.0)


def scale_per_leaf(multipliers) -> optax.GradientTransformation:
    """Multiplies each update leaf by a constant: ``multipliers(updates)`` -> pytree of floats."""
    def update(updates, state, params=None):
        return jax.tree.map(lambda u, m: u * m, updates, multipliers(updates)), state
    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def stream_groups(model_cfg):
    """The residual stream's ``OptimizerGroups`` for ``config.model``, or None."""
    if model_cfg is None:
        return None
    from icml_jax.models.residual import RESIDUALS
    hook = getattr(RESIDUALS.get(model_cfg.residual).IO, "optimizer_groups", None)
    return hook(model_cfg) if hook is not None else None


def _decay_mask(params):
    """Weight decay on matrices only (not on norm gains or other vectors)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(t: ml_collections.ConfigDict, frozen_mask=None,
                   model_cfg: ml_collections.ConfigDict = None) -> optax.GradientTransformation:
    """``frozen_mask(params) -> pytree of bools``: leaves that must never change (no update, no
    weight decay), e.g. fixed FoPE coefficients (``icml_jax.models.positions.frozen_param_mask``).
    ``model_cfg`` (``config.model``) selects the stream's optimizer groups, if it has any."""
    groups = stream_groups(model_cfg)
    decay_mask = groups.decay_mask if groups is not None else _decay_mask
    clip = optax.clip_by_global_norm(t.clip_norm) if t.clip_norm > 0 else optax.identity()
    if groups is not None and groups.lr_multipliers is not None:
        mults = groups.lr_multipliers
        parts = [
            clip,
            optax.scale_by_adam(b1=t.b1, b2=t.b2, eps=t.eps),
            scale_per_leaf(lambda u: jax.tree.map(lambda m: t.lr * m, mults(u))),
            optax.add_decayed_weights(t.weight_decay, mask=decay_mask),
            optax.scale_by_learning_rate(unit_schedule(t), flip_sign=True),
        ]
    else:
        parts = [clip, optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                                   weight_decay=t.weight_decay, mask=decay_mask)]
    if frozen_mask is not None:
        parts.append(optax.masked(optax.set_to_zero(), frozen_mask))
    return optax.chain(*parts)
