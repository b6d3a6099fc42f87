"""One logging style. Library modules report through absl (``from absl import logging``):
warnings for what a user should act on (an unreadable checkpoint set aside, a changed schedule,
truncated examples), info for the rest. A run's progress lines (steps, evaluations, samples) are
its output and go to stdout. The CLIs call :func:`show_own_logs`, so that icml_jax's own lines
reach stderr while other libraries (orbax, jax) stay quiet below ``others``.
"""
import logging
import os

from absl import logging as absl_logging

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _OwnOrAbove(logging.Filter):
    """Passes every record of icml_jax's modules and other records at ``level`` or above."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or os.path.abspath(record.pathname).startswith(_PACKAGE)


def show_own_logs(others: int = logging.WARNING) -> None:
    """absl at INFO for icml_jax's modules; other libraries' records below ``others`` dropped."""
    absl_logging.set_verbosity(absl_logging.INFO)
    handler = absl_logging.get_absl_handler()
    for f in [f for f in handler.filters if isinstance(f, _OwnOrAbove)]:
        handler.removeFilter(f)
    handler.addFilter(_OwnOrAbove(others))
