"""benchmarks/compile_time without its child processes (the benchmark runs in ``make bench``): the
children start with the environment the CLI's huge-page restart gives, and the report says so."""
import json
import subprocess

from benchmarks import compile_time as ct
from icml_jax import xla_env


def test_children_get_the_restart_environment_and_the_report_names_it(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, cwd, env, capture_output, text):
        seen.append(env)
        with open(cmd[cmd.index("--child") + 2], "w") as f:
            json.dump({"compile": {"jit(step_fn)": 1.0}, "trace": 0.1, "lower": 0.1, "cache_hits": 0,
                       "cache_dir": "c", "glibc_tunables": env.get("GLIBC_TUNABLES", "")}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(ct.subprocess, "run", fake_run)
    monkeypatch.setattr(xla_env, "hugepage_environ", lambda env: {**env, "GLIBC_TUNABLES": "tun"})
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")
    out = ct.measure("small", 1, 1, None, str(tmp_path))
    assert len(seen) == 6 and all(e["GLIBC_TUNABLES"] == "tun" for e in seen)
    assert all("JAX_COMPILATION_CACHE_DIR" not in e for e in seen)
    assert [e["ICML_JAX_COMPILATION_CACHE"] == "off" for e in seen] == [True, True] + [False] * 4
    res = {"date": "d", "machine": "m", "loadavg": 0.0, "jax": "j", "command": "c",
           "min_compile_secs": 0.1, "presets": {"small": out}, "glibc_tunables": ["tun"]}
    assert "run with the `GLIBC_TUNABLES` the CLI's huge-page restart gives ('tun')" in ct.markdown(res)
