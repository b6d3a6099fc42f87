"""Loading configs outside absl (tests, notebooks): ``load_config("configs/lm.py:tiny")``."""
import importlib.util
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
    mod_spec = importlib.util.spec_from_file_location(
        "config_" + os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    cfg = mod.get_config(preset) if preset else mod.get_config()
    if unlocked:
        cfg.unlock()
    return cfg
