"""Device mesh and logical-axis rules from `config.mesh`."""
from typing import Sequence

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> tuple:
    """Resolves the (data, fsdp, tensor) sizes; at most one may be -1 (inferred)."""
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
    bad = [f"config.mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes) if s == 0 or s < -1]
    if bad:
        raise ValueError(f"invalid mesh size(s) {', '.join(bad)}: use a positive size or -1 (infer)")
    if sizes.count(-1) > 1:
        raise ValueError("at most one of config.mesh.data/fsdp/tensor may be -1 (inferred)")
    known = int(np.prod([s for s in sizes if s != -1]))
    if num_devices % known:
        raise ValueError(
            f"mesh sizes {dict(zip(MESH_AXES, sizes))} do not divide the {num_devices} available "
            f"device(s): the product of config.mesh.data, .fsdp and .tensor must equal the device count")
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} uses {int(np.prod(sizes))} devices but "
            f"{num_devices} are available; set one of config.mesh.data/fsdp/tensor to -1 or fix the sizes")
    return tuple(sizes)


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
