"""Tasks: how a batch becomes a loss. Chosen by `config.task`."""
from icml_jax.registry import Registry

TASKS = Registry("task", "config.task")

from icml_jax.tasks import lm  # noqa: E402,F401  (registers "lm")
from icml_jax.tasks import implicit_prm, preference, reward_model  # noqa: E402,F401  (register theirs)
from icml_jax.tasks import pr_lm  # noqa: E402,F401  (registers "pr_lm")
