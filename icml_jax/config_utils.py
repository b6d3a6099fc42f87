"""Loading configs outside absl (tests, notebooks): ``load_config("configs/lm.py:tiny")``."""
import importlib.util
import json
import math
import os

import ml_collections

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(spec: str, unlocked: bool = False) -> ml_collections.ConfigDict:
    """``PATH[:PRESET]`` -> ``get_config(PRESET)`` of that file (a relative PATH is tried against the
    current directory, then the repository root)."""
    path, _, preset = spec.partition(":")
    if not os.path.exists(path) and os.path.exists(os.path.join(REPO_ROOT, path)):
        path = os.path.join(REPO_ROOT, path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} not found (from {spec!r})")
    mod = load_module(path)
    cfg = mod.get_config(preset) if preset else mod.get_config()
    if unlocked:
        cfg.unlock()
    return cfg


def load_module(path: str):
    """A Python file loaded by path as a fresh module (``configs/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "config_" + os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sibling_config(this_file: str, name: str = "lm.py"):
    """The config file ``name`` next to ``this_file`` as a module: how a config composes another
    (``lm = sibling_config(__file__)``; then ``lm.base_config()``, ``lm.preset_config(...)``)."""
    return load_module(os.path.join(os.path.dirname(os.path.abspath(this_file)), name))


def _overlay(base: dict, saved: dict) -> dict:
    out = dict(base)
    for k, v in saved.items():
        out[k] = _overlay(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def complete_config(saved: dict) -> dict:
    """A config saved by an earlier version (a workdir's ``config.json`` or a checkpoint's),
    completed once, at load time, with the keys added since: every key of ``configs/lm.py``'s
    ``base_config()`` that ``saved`` lacks gets its base value (what the code then assumed);
    everything ``saved`` holds is kept. Without the repository's ``configs/`` it is returned as is."""
    path = os.path.join(REPO_ROOT, "configs", "lm.py")
    if not isinstance(saved, dict) or not os.path.exists(path):
        return saved
    return _overlay(json.loads(load_module(path).base_config().to_json_best_effort()), saved)


MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> tuple:
    """Resolves the (data, fsdp, tensor) sizes of ``config.mesh`` for ``num_devices`` devices;
    at most one may be -1 (inferred). Pure arithmetic: ``icml_jax/sharding.py`` builds the mesh."""
    sizes = [int(mesh_cfg[a]) for a in MESH_AXES]
    bad = [f"config.mesh.{a}={s}" for a, s in zip(MESH_AXES, sizes) if s == 0 or s < -1]
    if bad:
        raise ValueError(f"invalid mesh size(s) {', '.join(bad)}: use a positive size or -1 (infer)")
    if sizes.count(-1) > 1:
        raise ValueError("at most one of config.mesh.data/fsdp/tensor may be -1 (inferred)")
    known = math.prod(s for s in sizes if s != -1)
    if num_devices % known:
        raise ValueError(
            f"mesh sizes {dict(zip(MESH_AXES, sizes))} do not divide the {num_devices} available "
            f"device(s): the product of config.mesh.data, .fsdp and .tensor must equal the device count")
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} uses {math.prod(sizes)} devices but "
            f"{num_devices} are available; set one of config.mesh.data/fsdp/tensor to -1 or fix the sizes")
    return tuple(sizes)
