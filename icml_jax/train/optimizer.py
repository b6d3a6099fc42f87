"""AdamW with warmup + cosine decay and global-norm clipping, from `config.train`.

With ``config.model``, the model's registry entries supply an ``OptimizerSpec``
(``icml_jax.models.contract.optimizer_spec``): leaves that must never change (e.g. fixed FoPE
coefficients) and a residual stream's optimizer groups (e.g. ``icml_jax.models.rmt``). With
``lr_multipliers`` the chain is the RMT reference's muP AdamW:
  clip -> Adam -> × (peak lr · multiplier per leaf) -> + weight_decay·θ (masked) -> × unit schedule,
so the effective decay is schedule(t)·weight_decay·θ, independent of the peak lr. Without groups
(the standard stream) it is optax.adamw, unchanged.
"""
import jax
import ml_collections
import optax

from icml_jax.models.contract import optimizer_spec


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


def _decay_mask(params):
    """Weight decay on matrices only (not on norm gains or other vectors)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(t: ml_collections.ConfigDict, *,
                   model_cfg: ml_collections.ConfigDict = None) -> optax.GradientTransformation:
    """The optimizer of ``t`` (``config.train``); ``model_cfg`` (``config.model``) adds the
    model's frozen leaves and optimizer groups. Without it: AdamW, decay on matrices, nothing
    frozen."""
    spec = optimizer_spec(model_cfg) if model_cfg is not None else None
    decay_mask = spec.decay_mask if spec is not None and spec.decay_mask is not None else _decay_mask
    clip = optax.clip_by_global_norm(t.clip_norm) if t.clip_norm > 0 else optax.identity()
    if spec is not None and spec.lr_multipliers is not None:
        mults = spec.lr_multipliers
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
    if spec is not None:
        parts.append(optax.masked(optax.set_to_zero(), spec.frozen_mask))
    return optax.chain(*parts)
