"""The train loop, checkpoints, metrics and multi-process set-up."""
import os


def missing_checkpoints(workdir: str) -> str | None:
    """The one-line error for a workdir with no ``checkpoints/`` folder, else None. Needs no JAX,
    so a CLI can check it before loading anything (``icml_jax/sample.py``)."""
    if os.path.isdir(os.path.join(workdir, "checkpoints")):
        return None
    return (f"{workdir}: no checkpoints/ folder; train there first (e.g. "
            f"`python -m icml_jax.main --config=configs/lm.py:tiny --workdir={workdir}`)")
