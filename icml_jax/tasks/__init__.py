"""Tasks: how a batch becomes a loss. Chosen by `config.task`.

A task is built as ``TASKS.get(config.task)(config, context)``. ``TaskContext`` is what the loop
hands it, so that no task imports ``train/``: the number of devices holding distinct batch rows
(BSR's per-device statistics) and a function reading another run's params (frozen reference and
guidance policies).
"""
import dataclasses
from collections.abc import Callable
from typing import Any

from icml_jax.registry import Registry

TASKS = Registry("task", "config.task")


@dataclasses.dataclass(frozen=True)
class TaskContext:
    """``num_shards``: devices holding distinct batch rows (mesh data * fsdp; None = work it out
    from ``config.mesh`` and the device count). ``restore_params(workdir, model_cfg)``: the params
    of the newest readable step of a training workdir, raising ValueError with a one-line reason
    (None: tasks that read other runs refuse to build)."""
    num_shards: int | None = None
    restore_params: Callable[[str, Any], Any] | None = None


from icml_jax.tasks import lm  # noqa: E402,F401  (registers "lm")
from icml_jax.tasks import implicit_prm, preference, reward_model  # noqa: E402,F401  (register theirs)
from icml_jax.tasks import pr_lm  # noqa: E402,F401  (registers "pr_lm")
