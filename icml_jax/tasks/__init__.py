"""Tasks: how a batch becomes a loss. Chosen by `config.task`.

A task is built as ``TASKS.get(config.task)(config, context)``; the contract it follows is
written in ``tasks/base.py`` (``Task``). ``TaskContext`` is what the loop hands it, so that no
task imports ``train/``: the number of devices holding distinct batch rows (BSR's per-device
statistics) and a function reading another run's params (frozen reference and guidance policies).
"""
from icml_jax.registry import Registry
from icml_jax.tasks.base import Task, TaskContext  # noqa: F401  (the contract)

TASKS = Registry("task", "config.task")


from icml_jax.tasks import lm  # noqa: E402,F401  (registers "lm")
from icml_jax.tasks import implicit_prm, preference, reward_model  # noqa: E402,F401  (register theirs)
from icml_jax.tasks import pr_lm  # noqa: E402,F401  (registers "pr_lm")
from icml_jax.tasks import step_prm  # noqa: E402,F401  (registers "step_prm")
from icml_jax.tasks import sft  # noqa: E402,F401  (registers "sft")
from icml_jax.tasks import vocagnolm  # noqa: E402,F401  (registers "vocagnolm")
from icml_jax.tasks import gkd  # noqa: E402,F401  (registers "gkd")
from icml_jax.tasks import sae  # noqa: E402,F401  (registers "sae")
