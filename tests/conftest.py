"""Shared fixtures, and what keeps ``make test`` (``pytest -n 2``) short:

* A persistent JAX compilation cache for the whole session, shared by the xdist workers: many tests
  build the same tiny models (same HLO), and on a 2-core CPU compiling a tiny train step takes
  longer than training it. The compiled executables are the same ones XLA would build again, so no
  test sees a difference. The folder is created by the first pytest process that loads this file
  (the xdist controller, whose environment the workers inherit) and removed when it exits; set
  ``JAX_COMPILATION_CACHE_DIR`` to use (and keep) a folder of your own. Subprocesses a test starts
  are left as they were (they do not read the private variable below), except the notebook kernels
  (tests/notebooks, ``jax_cache_env``).
"""
import os
import shutil
import tempfile

import pytest

from icml_jax.config_utils import load_config

_CACHE_ENV = "ICML_JAX_TEST_COMPILATION_CACHE"
_OWN_CACHE = False
if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    os.environ.setdefault(_CACHE_ENV, os.environ["JAX_COMPILATION_CACHE_DIR"])
elif not os.environ.get(_CACHE_ENV):
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="icml_jax_test_jit_cache_")
    _OWN_CACHE = True
COMPILATION_CACHE = os.environ[_CACHE_ENV]
# every compiled executable is kept (the default keeps those that took >= 1 s); a size bound turns
# on JAX's file lock, so that two workers never read an entry the other is still writing
_CACHE_SETTINGS = {"jax_compilation_cache_dir": COMPILATION_CACHE,
                   "jax_persistent_cache_min_compile_time_secs": 0,
                   "jax_compilation_cache_max_size": 16 << 30}


def _configure_compilation_cache():
    import jax
    for k, v in _CACHE_SETTINGS.items():
        jax.config.update(k, v)


_configure_compilation_cache()


@pytest.fixture
def jax_cache_env() -> dict:
    """Environment variables that give a subprocess (a notebook kernel) the same cache."""
    return {k.upper(): str(v) for k, v in _CACHE_SETTINGS.items()}


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture
def tiny_config():
    return load_config("configs/lm.py:tiny", unlocked=True)
