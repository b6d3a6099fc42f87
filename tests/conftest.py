"""Shared fixtures, and what keeps ``make test`` (``pytest -n 2``) inside its budget (tests/README.md):

* ``tests/jax_env.py`` is configured before anything imports JAX: XLA optimisation level 0 for
  tests, and one persistent compilation cache for the session (JAX's 1 s threshold; 0 s inside
  ``jax_env.caching_every_compilation``, which the session runs below use), shared by the xdist
  workers and every subprocess a test starts (they inherit the environment; those that need
  fake devices build it with ``jax_env.subprocess_env``). The cache folder is created by the first
  pytest process that loads this file (the xdist controller, whose environment the workers
  inherit) and removed when it exits; set ``JAX_COMPILATION_CACHE_DIR`` to use (and keep) a folder
  of your own.
* Session fixtures holding the tiny experiment runs that several tests consume (the FoPE and
  implicit-PRM experiments, the preference testbed): each is built once per worker by the
  experiment's own code and reused, instead of being retrained by every test and notebook that
  needs it. The consumers of one artifact carry the same ``xdist_group`` mark so that
  ``--dist loadgroup`` (the Makefile) runs them on one worker, which then builds it once.
"""
import os
import shutil
import time

import pytest

from tests import jax_env

COMPILATION_CACHE, _OWN_CACHE = jax_env.configure()

from icml_jax.config_utils import load_config  # noqa: E402  (after the XLA/cache environment)


BUDGET_SECONDS = 12 * 60  # `make test` on 2 cores (tests/README.md)
_STARTED = time.time()


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):
        return
    took = time.time() - _STARTED
    terminalreporter.write_line(
        f"test session: {took:.0f} s of the {BUDGET_SECONDS} s budget of `make test` on 2 cores"
        + ("" if took <= BUDGET_SECONDS else " -- OVER BUDGET: see tests/README.md"),
        red=took > BUDGET_SECONDS, green=took <= BUDGET_SECONDS)


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
    with pytest.MonkeyPatch.context() as mp, jax_env.caching_every_compilation():  # its runs share shapes
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
