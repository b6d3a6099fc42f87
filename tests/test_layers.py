"""The package's layering (docs/architecture.md, "Layering"), checked on the import graph.

Every ``import icml_jax...`` of every module counts, function-local ones included. A module may
import its own layer and the layers listed for it; anything else is an upward edge and fails here
unless it is one of the known edges below, each still to be removed.
"""
import ast
import os

from icml_jax.config_utils import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "icml_jax")
BASE = {"registry", "config_utils", "sharding", "atomic"}
# layer -> the layers it may import (besides itself and BASE)
ALLOWED = {
    "losses": set(),
    "models": set(),
    "data": set(),
    "inference": {"models", "xla_env"},  # decode_jit
    "analysis": {"models", "losses", "data", "inference"},
    "tasks": {"models", "losses", "data"},
    "interop": {"models", "data"},
    "compress": {"models", "data", "losses", "analysis", "inference"},
    "train": {"tasks", "models", "losses", "data", "analysis", "inference", "xla_env"},  # release_host_memory
}
ENTRY_POINTS = {"main", "sample", "toedit", "launch_local", "evaluate", "lm_eval_adapter",
                "__init__"}  # may import anything
# upward edges that remain: (importing module, imported module)
KNOWN = set()


def _imports(path):
    """The ``icml_jax`` modules a file imports, as dotted names."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("icml_jax"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("icml_jax"):
            if node.module == "icml_jax":  # from icml_jax import data, ...
                yield from (f"icml_jax.{a.name}" for a in node.names)
            else:
                yield node.module


def _layer(dotted):
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _edges():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO_ROOT)
            parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
            layer = parts[0]
            for dotted in _imports(path):
                yield rel, layer, dotted


def test_no_upward_imports():
    bad, used_known = [], set()
    for rel, layer, dotted in _edges():
        target = _layer(dotted)
        if layer in ENTRY_POINTS or target in BASE or target == layer:
            continue
        if target in ALLOWED.get(layer, set()):
            continue
        key = (rel, ".".join(dotted.split(".")[:2]))
        if key in KNOWN:
            used_known.add(key)
            continue
        bad.append(f"{rel} imports {dotted} ({layer} may import "
                   f"{sorted(ALLOWED.get(layer, set()) | BASE) or 'only itself'})")
    assert not bad, "upward imports:\n  " + "\n  ".join(sorted(set(bad)))
    assert used_known == KNOWN, f"known edges gone, drop them from KNOWN: {KNOWN - used_known}"


def test_the_checker_sees_function_local_imports(tmp_path):
    """The graph above would be vacuous if lazy imports were missed."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from icml_jax.train import mesh\n    import icml_jax.tasks.lm\n"
                   "from icml_jax import data, losses\n")
    assert sorted(_imports(str(src))) == ["icml_jax.data", "icml_jax.losses", "icml_jax.tasks.lm",
                                          "icml_jax.train"]
