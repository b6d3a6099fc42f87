"""Device mesh and logical-axis rules from `config.mesh`."""
from typing import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from icml_jax.config_utils import MESH_AXES, mesh_shape  # noqa: F401  (re-exported)


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices: Sequence = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over ``devices`` (default: every device of every process).

    Devices are laid out in ``jax.devices()`` order (process by process), so each process's devices are one block of the
    outer axes (with ``tensor`` within a host); on TPU, jax's ``mesh_utils`` orders them along
    the chip interconnect instead."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mesh_cfg, len(devices))
    if devices[0].platform == "tpu" and len(devices) > 1:
        from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
        try:
            return Mesh(mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True),
                        MESH_AXES)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # an unusual topology: plain order
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_rules(mesh_cfg: ml_collections.ConfigDict) -> tuple:
    """`config.mesh.rules` as a tuple of (logical axis, mesh axes or None)."""
    return tuple((name, tuple(ax) if isinstance(ax, list) else ax) for name, ax in mesh_cfg.rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over data and fsdp; every other axis (length, pair, ...) is
    replicated, so one sharding serves batch leaves of any rank."""
    return NamedSharding(mesh, P(("data", "fsdp")))
