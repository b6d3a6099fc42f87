"""What the train loop asks of a model config, answered by its registry entries: the residual
stream of ``config.model.residual`` (``models/residual.py``'s ``Stream``) and, for streams that
read it, the position embedding of ``config.model.position`` (``models/positions.py``). The
trainer and the optimizer call these two functions and never name a method.
"""
from typing import Callable, NamedTuple

import jax
import ml_collections

from icml_jax.models import hetero, lowrank
from icml_jax.models import rmt as _rmt  # noqa: F401  registers residual="rmt"
from icml_jax.models.positions import POSITIONS, frozen_param_mask
from icml_jax.models.residual import RESIDUALS


class OptimizerSpec(NamedTuple):
    """Functions of the param pytree. ``frozen_mask``: True where a leaf must never change (no
    update, no weight decay); ``lr_multipliers``: per-leaf lr multipliers or None (plain AdamW);
    ``decay_mask``: True where weight decay applies, or None (matrices only)."""
    frozen_mask: Callable
    lr_multipliers: Callable | None
    decay_mask: Callable | None


def validate(m: ml_collections.ConfigDict) -> None:
    """One-line ValueErrors, naming the config key, for a model config its parts cannot run."""
    stream = RESIDUALS.get(m.residual)
    if stream.validate is not None:
        stream.validate(m)
    rank = lowrank.rank_of(m)
    if rank < 0:
        raise ValueError(f"config.model.lowrank must be >= 0 (0 = off), got {rank}")
    if rank and m.residual != "standard":
        raise ValueError(f"config.model.lowrank={rank} needs config.model.residual='standard' "
                         f"(got {m.residual!r}); set lowrank=0")
    if rank and m.mlp.get("sparse_capacity", 0):
        raise ValueError(f"config.model.lowrank={rank} cannot run with the gathered sparse FFN "
                         "(config.model.mlp.sparse_capacity > 0); set one of them to 0")
    hetero.validate(m)
    if stream.reads_position:
        POSITIONS.get(m.position).validate(m)


def optimizer_spec(m: ml_collections.ConfigDict) -> OptimizerSpec:
    """The frozen leaves (the position embedding's) and optimizer groups (the stream's)."""
    stream = RESIDUALS.get(m.residual)
    groups = stream.optimizer_groups(m) if stream.optimizer_groups is not None else None
    if stream.reads_position:
        frozen = lambda params: frozen_param_mask(m, params)  # noqa: E731
    else:  # the stream owns its positions: nothing of config.model.position is in its params
        frozen = lambda params: jax.tree.map(lambda _: False, params)  # noqa: E731
    return OptimizerSpec(frozen_mask=frozen,
                         lr_multipliers=groups.lr_multipliers if groups is not None else None,
                         decay_mask=groups.decay_mask if groups is not None else None)
