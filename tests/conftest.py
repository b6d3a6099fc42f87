"""Shared fixtures, and two things that keep ``make test`` (``pytest -n 2``) short:

* A persistent JAX compilation cache for the whole session, shared by the xdist workers: many tests
  build the same tiny models (same HLO), and on a 2-core CPU compiling a tiny train step takes
  longer than training it. The compiled executables are the same ones XLA would build again, so no
  test sees a difference. The folder is created by the first pytest process that loads this file
  (the xdist controller, whose environment the workers inherit) and removed when it exits; set
  ``JAX_COMPILATION_CACHE_DIR`` to use (and keep) a folder of your own. Subprocesses a test starts
  are left as they were (they do not read the private variable below), except the notebook kernels
  (tests/notebooks, ``jax_cache_env``).
* Session fixtures holding the tiny experiment runs that several tests consume (the FoPE and
  implicit-PRM experiments, the preference testbed): each is built once per worker by the
  experiment's own code and reused, instead of being retrained by every test and notebook that
  needs it. The consumers of one artifact carry the same ``xdist_group`` mark so that
  ``--dist loadgroup`` (the Makefile) runs them on one worker, which then builds it once.
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


# ------------------------------------------------------------- shared tiny runs (session scope)
# Consumers carry pytest.mark.xdist_group("<fixture name>") and never change the files of a run
# in place (they copy it first, file times kept: shutil.copytree), except by rerunning the
# experiment on it with the same settings, which recomputes nothing.


@pytest.fixture(scope="session")
def session_tfds_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _build(tmp_path_factory, tfds_dir, name, fn):
    folder = str(tmp_path_factory.mktemp(name))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TFDS_DATA_DIR", tfds_dir)
        fn(folder)
    return folder


@pytest.fixture(scope="session")
def fope_tiny_run(tmp_path_factory, session_tfds_dir):
    """The workdir of ``python -m experiments.fope_length --preset=tiny`` (default seeds)."""
    from experiments.fope_length.__main__ import main
    base = _build(tmp_path_factory, session_tfds_dir, "fope_length",
                  lambda d: main([f"--workdir={os.path.join(d, 'exp')}", "--preset=tiny"]))
    return os.path.join(base, "exp")


@pytest.fixture(scope="session")
def implicit_prm_tiny_run(tmp_path_factory, session_tfds_dir):
    """(base, workdir, main's return) of ``python -m experiments.implicit_prm --preset=tiny``
    with workdir ``base/exp`` (its cache keys hold absolute paths: reuse it in place)."""
    from experiments.implicit_prm.__main__ import main
    out = {}
    base = _build(tmp_path_factory, session_tfds_dir, "implicit_prm",
                  lambda d: out.update(main([f"--workdir={os.path.join(d, 'exp')}",
                                             "--preset=tiny"])))
    return base, os.path.join(base, "exp"), out


@pytest.fixture(scope="session")
def preference_testbed_tiny(tmp_path_factory, session_tfds_dir):
    """A folder holding ``build_testbed(folder, preference_testbed.TINY)`` (the SFT policy and its
    gold-scored groups; its cache keys hold no paths, so a copy of it loads as built)."""
    from experiments import preference_testbed
    return _build(tmp_path_factory, session_tfds_dir, "testbed",
                  lambda d: preference_testbed.build_testbed(d, preference_testbed.TINY))
