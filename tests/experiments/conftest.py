"""Every experiment test trains several runs of one shape (seeds, arms, students): their compiled
programs are shared through the session's compilation cache (``jax_env.caching_every_compilation``)."""
import pytest

from tests import jax_env


@pytest.fixture(autouse=True)
def _cache_every_compilation():
    with jax_env.caching_every_compilation():
        yield
