"""The test suite's own machinery (tests/README.md): xdist groups, the subprocess environment."""
import os

import pytest

from tests import jax_env


@pytest.mark.xdist_group("suite_setup_check")
def test_xdist_groups_are_honoured(request):
    """`make test` relies on --dist loadgroup keeping a group on one worker (a group's shared
    fixture is built once); pytest-xdist does that by suffixing the test id with the group."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("only meaningful under pytest-xdist (make test runs -n 2 --dist loadgroup)")
    if not request.config.getoption("loadgroup", default=False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@suite_setup_check"), (
        f"{request.node.nodeid}: xdist_group marks are ignored by this pytest/pytest-xdist pair; "
        "see the pins in setup.py")


def test_subprocess_env_keeps_the_suite_settings_and_sets_devices(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_foo=1")
    env = jax_env.subprocess_env(4, EXTRA="x")
    flags = env["XLA_FLAGS"].split()
    assert flags.count("--xla_force_host_platform_device_count=4") == 1
    assert "--xla_force_host_platform_device_count=8" not in flags and "--xla_foo=1" in flags
    fast = os.environ.get(jax_env.OPT_ENV, "0") != "default"
    assert all((f in flags) == fast for f in jax_env.OPT_FLAGS)
    assert env["JAX_PLATFORMS"] == "cpu" and env["EXTRA"] == "x"
    assert env["JAX_COMPILATION_CACHE_DIR"] == os.environ[jax_env.CACHE_ENV]
    assert float(env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]) == jax_env.MIN_COMPILE_SECS
    one = jax_env.subprocess_env(1)["XLA_FLAGS"].split()
    assert not [f for f in one if f.startswith(jax_env.DEVICES_FLAG)]
    monkeypatch.setenv(jax_env.OPT_ENV, "default")
    assert not set(jax_env.OPT_FLAGS) & set(jax_env.subprocess_env(1)["XLA_FLAGS"].split())
