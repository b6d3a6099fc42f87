"""AdamW with warmup + cosine decay and global-norm clipping, from `config.train`."""
import jax
import ml_collections
import optax


def lr_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
    warmup = min(int(t.warmup_steps), max(int(t.steps) - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup, decay_steps=max(int(t.steps), warmup + 1),
        end_value=t.lr * t.min_lr_ratio)


def _decay_mask(params):
    """Weight decay on matrices only (not on norm gains or other vectors)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(t: ml_collections.ConfigDict, frozen_mask=None) -> optax.GradientTransformation:
    """``frozen_mask(params) -> pytree of bools``: leaves that must never change (no update, no
    weight decay), e.g. fixed FoPE coefficients (``icml_jax.models.positions.frozen_param_mask``)."""
    parts = [
        optax.clip_by_global_norm(t.clip_norm) if t.clip_norm > 0 else optax.identity(),
        optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                    mask=_decay_mask),
    ]
    if frozen_mask is not None:
        parts.append(optax.masked(optax.set_to_zero(), frozen_mask))
    return optax.chain(*parts)
