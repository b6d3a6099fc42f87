"""``icml_jax.xla_env``: importing the package leaves the environment alone; entry points opt in."""
import os
import subprocess
import sys

import pytest

from icml_jax import xla_env
from icml_jax.config_utils import REPO_ROOT


@pytest.mark.parametrize("avx512", [False, True])
def test_use_default_flags_appends_keeps_and_opts_out(monkeypatch, avx512):
    flags = (xla_env.CPU_FLAGS[0],) + ((xla_env.VECTOR_FLAG,) if avx512 else ())
    monkeypatch.setattr(xla_env, "CPU_FLAGS", flags)  # both hosts' flag sets, whatever this CPU is
    env = {"XLA_FLAGS": "--xla_foo=1"}
    assert xla_env.use_default_flags(env)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", *flags]
    assert not xla_env.use_default_flags(env)  # already there: unchanged
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", *flags]
    mine = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}  # the user's own value wins
    assert xla_env.use_default_flags(mine) is avx512  # only the vector flag is left to append
    assert mine["XLA_FLAGS"].split() == ["--xla_cpu_experimental_ynn_fusion_type=dot", *flags[1:]]
    off = {xla_env.OPT_OUT_ENV: "1"}
    assert not xla_env.use_default_flags(off) and "XLA_FLAGS" not in off
    empty = {}
    assert xla_env.use_default_flags(empty) and empty["XLA_FLAGS"] == " ".join(flags)
    # what it appended is recorded (for decode_compiler_options, in this process and its children)
    names = sorted(f.split("=", 1)[0] for f in flags)
    assert empty[xla_env.ADDED_ENV].split() == names and env[xla_env.ADDED_ENV].split() == names
    assert mine.get(xla_env.ADDED_ENV, "").split() == ([xla_env.VECTOR_FLAG.split("=")[0]] if avx512 else [])
    assert xla_env.ADDED_ENV not in off
    # decode programs: jax's YNN dots when the YNN flag is ours, with or without the vector flag
    assert xla_env.decode_compiler_options(empty) == {
        "xla_cpu_experimental_ynn_fusion_type": xla_env.JAX_DEFAULT_YNN_FUSIONS}
    assert xla_env.decode_compiler_options(mine) is None


@pytest.mark.parametrize("flags,want", [("fpu sse avx2 avx512f avx512bw", True), ("fpu sse avx2 fma", False),
                                        ("avx512_bf16 avx512vl", False), (None, False)])
def test_vector_width_flag_follows_avx512(tmp_path, flags, want):
    """512-bit vectors for XLA's own kernels only where the CPU has AVX-512 (avx512f)."""
    info = tmp_path / "cpuinfo"
    if flags is not None:
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert xla_env.cpu_has_avx512(str(info)) is want


def test_decode_programs_get_jax_default_ynn_dots_only_when_the_flag_is_ours():
    ours = {}
    xla_env.use_default_flags(ours)
    assert xla_env.decode_compiler_options(ours) == {
        "xla_cpu_experimental_ynn_fusion_type": xla_env.JAX_DEFAULT_YNN_FUSIONS}
    assert xla_env.decode_compiler_options({}) is None  # no flag: jax's defaults already
    mine = {"XLA_FLAGS": f"{xla_env.YNN_FLAG}="}  # the user turned YNN off: it stays off
    xla_env.use_default_flags(mine)
    assert xla_env.decode_compiler_options(mine) is None
    later = dict(ours, XLA_FLAGS=f"{xla_env.YNN_FLAG}=LIBRARY_FUSION_TYPE_DOT")  # changed afterwards
    assert xla_env.decode_compiler_options(later) is None
    assert xla_env.decode_compiler_options({xla_env.OPT_OUT_ENV: "1"}) is None
    twice = dict(ours, XLA_FLAGS=f"{ours['XLA_FLAGS']} {xla_env.YNN_FLAG}=LIBRARY_FUSION_TYPE_DOT")
    assert xla_env.decode_compiler_options(twice) is None  # XLA takes the last value


def _ynn_fusions(jitted, *args):
    return jitted.lower(*args).compile().as_text().count("__ynn_fusion")


def test_decode_jit_compiles_with_the_options(monkeypatch):
    """The test process runs with the entry points' flags (tests/jax_env.py), so a decode_jit
    program gets YNN fusions and a plain one none; both give the same values."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    if xla_env.decode_compiler_options() is None:
        pytest.skip("the suite runs without the entry points' flags (ICML_JAX_DEFAULT_XLA_FLAGS=1)")
    fn = lambda x, w: jnp.tanh(x @ w).sum(-1)  # a dot and a reduce
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(64, 96)), jnp.float32)
    f = xla_env.decode_jit(fn)
    fast = f(x, w)
    key = ((xla_env.YNN_FLAG[2:], xla_env.JAX_DEFAULT_YNN_FUSIONS),)
    assert list(f.variants) == [key] and f._cache_size() == 1 and f.__wrapped__ is fn
    assert _ynn_fusions(f.variants[key], x, w) > 0
    monkeypatch.delenv(xla_env.ADDED_ENV, raising=False)  # as if the user had set the flag
    plain = f(x, w)
    assert list(f.variants) == [key, ()] and f._cache_size() == 2
    assert _ynn_fusions(f.variants[()], x, w) == 0
    np.testing.assert_allclose(np.asarray(fast), np.asarray(plain), rtol=1e-5, atol=1e-6)


def test_jax_default_ynn_list_is_current():
    """JAX_DEFAULT_YNN_FUSIONS is what this jax does when XLA_FLAGS names no YNN flag (checked in
    a child without it): the same YNN fusions on a program with a dot and a reduce."""
    code = ("import jax, jax.numpy as jnp\n"
            "from icml_jax import xla_env\n"
            "fn = lambda x, w: jnp.tanh(x @ w).sum(-1)\n"
            "x, w = jnp.ones((8, 64)), jnp.ones((64, 96))\n"
            "n = lambda o: jax.jit(fn, compiler_options=o).lower(x, w).compile().as_text().count('__ynn_fusion')\n"
            "print(n(None), n({xla_env.YNN_FLAG[2:]: xla_env.JAX_DEFAULT_YNN_FUSIONS}))\n")
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ["XLA_FLAGS"].split()
                                                if not f.startswith(xla_env.YNN_FLAG)))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    default, ours = map(int, out.stdout.split())
    assert default == ours > 0


def test_importing_the_package_changes_no_environment_variable():
    """Every library layer is imported in a clean child; its environment must come out as it went
    in (the CLI modules define absl flags but change nothing either until main runs). JAX's own
    import sets TF_CPP_MIN_LOG_LEVEL and TPU_SKIP_MDS_QUERY, so the snapshot is taken after it."""
    code = ("import os, jax; before = dict(os.environ)\n"
            "import icml_jax, icml_jax.models, icml_jax.losses, icml_jax.data, icml_jax.tasks\n"
            "import icml_jax.train.trainer, icml_jax.inference.decode, icml_jax.analysis.sparsity\n"
            "import icml_jax.interop.hf, icml_jax.main, icml_jax.sample\n"
            "changed = {k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)}\n"
            "assert not changed, sorted(changed)\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


def test_entry_points_turn_on_the_compilation_cache_unless_configured(tmp_path):
    """``use_defaults`` stores compiled executables in ``$ICML_JAX_COMPILATION_CACHE`` (a second
    run loads them); ``off`` and a cache configured for JAX itself are respected; a bad threshold
    is a one-line error."""
    with pytest.raises(ValueError, match="ICML_JAX_CACHE_MIN_COMPILE_SECS='-1' is not a number"):
        xla_env.use_compilation_cache({xla_env.CACHE_MIN_SECS_ENV: "-1"})
    assert xla_env.default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/icml_jax/jax_cache"
    mine = str(tmp_path / "jax_own")  # a cache configured for JAX itself
    code = ("import os, sys, jax, jax.numpy as jnp\n"
            "from icml_jax import xla_env\n"
            "got = xla_env.use_defaults()\n"
            "print(got)\n"
            "jax.jit(lambda x: jnp.tanh(x @ x.T).sum())(jnp.ones((64, 64))).block_until_ready()\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                                      "JAX_PERSISTENT_CACHE"))}
    cache = tmp_path / "cache"
    runs = {}
    for name, extra in (("on", {xla_env.CACHE_ENV: str(cache), xla_env.CACHE_MIN_SECS_ENV: "0"}),
                        ("off", {xla_env.CACHE_ENV: "off", "XDG_CACHE_HOME": str(tmp_path / "xdg")}),
                        ("jax", {"JAX_COMPILATION_CACHE_DIR": mine, xla_env.CACHE_ENV: str(cache) + "_no"})):
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env={**base, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        runs[name] = out.stdout.split()[-1]
    assert runs["on"] == str(cache) and any(cache.iterdir())  # executables were written
    assert runs["off"] == "None" and not (tmp_path / "xdg").exists()
    assert runs["jax"] == mine and not os.path.exists(str(cache) + "_no")


def test_release_host_memory_returns_freed_heap_pages():
    """Freed small malloc blocks below a live one stay resident until the trim returns them."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss_mib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    blocks = []
    for _ in range(100_000):  # 100 MiB of 1 KiB blocks: heap memory, not separate mappings
        p = libc.malloc(1024)
        ctypes.memset(p, 1, 1024)
        blocks.append(p)
    keep = libc.malloc(1024)  # a live block above them keeps the heap from shrinking on free
    for p in blocks:
        libc.free(p)
    before = rss_mib()
    assert xla_env.release_host_memory()
    after = rss_mib()
    libc.free(keep)
    assert before - after > 50, (before, after)


@pytest.mark.parametrize("environ,mode,glibc,want", [
    ({}, "madvise", (2, 36), "glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 35),
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),  # the user's tunables are kept
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), None),  # the user's value rules
    ({}, "always", (2, 36), None),  # malloc's large blocks get huge pages anyway
    ({}, "never", (2, 36), None),
    ({}, None, (2, 36), None),  # no THP setting to read
    ({}, "madvise", (2, 34), None),  # glibc without the tunable
    ({}, "madvise", None, None),  # not glibc
    ({"ICML_JAX_HUGEPAGES": "0"}, "madvise", (2, 36), None),
    ({"ICML_JAX_HUGEPAGES": "1"}, "never", (2, 36), "glibc.malloc.hugetlb=1"),  # forced
    ({"ICML_JAX_HUGEPAGES": "1"}, "madvise", (2, 31), None),  # glibc still has to know it
])
def test_hugepage_environ_rule(environ, mode, glibc, want):
    before = dict(environ)
    env = xla_env.hugepage_environ(environ, mode=mode, glibc=glibc)
    assert environ == before  # a copy; the caller's mapping is not changed
    if want is None:
        assert env is None
    else:
        assert env == {**environ, "GLIBC_TUNABLES": want}


def test_thp_mode_and_launched_program(tmp_path):
    import types
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert xla_env.thp_mode(str(path)) == "madvise"
    assert xla_env.thp_mode(str(tmp_path / "missing")) is None
    spec = lambda name: types.SimpleNamespace(__spec__=types.SimpleNamespace(name=name))  # noqa: E731
    assert xla_env.launched_program(spec("experiments.rmt.__main__")) == "experiments.rmt"
    assert xla_env.launched_program(spec("icml_jax.main")) == "icml_jax.main"
    assert xla_env.launched_program(types.SimpleNamespace(__spec__=None)) is None  # a script, -c
    cm = xla_env.command_line_module
    assert cm(["py", "-m", "icml_jax.main", "--x"]) == "icml_jax.main"
    assert cm(["py", "-X", "utf8", "-W", "error", "-u", "-mexperiments.rmt"]) == "experiments.rmt"
    assert cm(["py", "-m", "pdb", "-m", "icml_jax.main"]) == "pdb"
    assert cm(["py", "script.py", "-m", "icml_jax.main"]) is None
    assert cm(["py", "-c", "code", "-m", "x"]) is None and cm(["py"]) is None
    # clustered short options, as CPython parses them
    assert cm(["py", "-um", "icml_jax.main"]) == "icml_jax.main"
    assert cm(["py", "-Bmicml_jax.sample"]) == "icml_jax.sample"
    assert cm(["py", "-uW", "error", "-m", "icml_jax.main"]) == "icml_jax.main"
    assert cm(["py", "-uWerror", "-m", "icml_jax.main"]) == "icml_jax.main"
    assert cm(["py", "-uW", "-m", "icml_jax.main"]) is None  # "-m" is -W's value here
    assert cm(["py", "-Ic", "code", "-m", "x"]) is None
    assert cm(["py", "--check-hash-based-pycs", "never", "-m", "experiments.rmt.__main__"]) == "experiments.rmt"
    assert cm(["py", "-", "-m", "x"]) is None and cm(["py", "-m"]) is None


def _fake_program(monkeypatch, name="icml_jax.main", file=None, argv=None, env=None):
    """This process dressed as ``python -m name``; returns the list os.execve calls are recorded in."""
    import types
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=name)
    main.__file__ = file or os.path.join(REPO_ROOT, *name.split(".")) + ".py"
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "orig_argv", argv or ["python3", "-m", name, "--flag=1"])
    monkeypatch.setattr(xla_env, "_backend_started", lambda: False)
    monkeypatch.setattr(xla_env, "hugepage_environ", lambda *a, **k: {"GLIBC_TUNABLES": "t"} if env is None else env)
    monkeypatch.delenv(xla_env.RESTARTED_ENV, raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda path, args, environ: calls.append((path, args, environ)))
    return calls


def test_restart_a_python_m_program_of_ours_once(monkeypatch):
    calls = _fake_program(monkeypatch)
    assert xla_env.restart_with_hugepages() is False and len(calls) == 1
    path, args, env = calls[0]
    assert path == sys.executable and args == [sys.executable, "-m", "icml_jax.main", "--flag=1"]
    assert env == {"GLIBC_TUNABLES": "t", xla_env.RESTARTED_ENV: str(os.getpid())}


@pytest.mark.parametrize("why", ["restarted", "pdb", "runpy from a script", "not ours",
                                 "another 'experiments'", "worker", "backend up", "nothing to add"])
def test_restart_refuses(monkeypatch, tmp_path, why):
    kwargs = {"pdb": {"argv": ["py", "-m", "pdb", "-m", "icml_jax.main"]},
              "runpy from a script": {"argv": ["py", "mine.py"]},
              "not ours": {"name": "pytest"},
              "another 'experiments'": {"name": "experiments.x",
                                        "file": str(tmp_path / "experiments" / "x.py")},
              "nothing to add": {"env": None}}.get(why, {})
    if why == "another 'experiments'":
        kwargs["argv"] = ["py", "-m", "experiments.x"]
    calls = _fake_program(monkeypatch, **kwargs)
    if why == "nothing to add":
        monkeypatch.setattr(xla_env, "hugepage_environ", lambda *a, **k: None)
    if why == "restarted":  # e.g. glibc dropped the tunable (secure mode): no second exec
        monkeypatch.setenv(xla_env.RESTARTED_ENV, str(os.getpid()))
    if why == "worker":
        monkeypatch.setattr("multiprocessing.parent_process", lambda: object())
    if why == "backend up":
        monkeypatch.setattr(xla_env, "_backend_started", lambda: True)
    assert xla_env.restart_with_hugepages() is False and calls == []


def test_a_child_of_a_restarted_process_is_judged_on_its_own(monkeypatch):
    """The marker holds the restarted PID: a child process that inherits it (another PID) may
    restart, the restarted process itself may not."""
    calls = _fake_program(monkeypatch)
    monkeypatch.setenv(xla_env.RESTARTED_ENV, str(os.getpid() + 1))
    assert not xla_env.restarted()
    xla_env.restart_with_hugepages()
    assert len(calls) == 1
    monkeypatch.setenv(xla_env.RESTARTED_ENV, str(os.getpid()))
    assert xla_env.restarted()
    xla_env.restart_with_hugepages()
    assert len(calls) == 1


def test_restart_survives_a_failing_exec_and_use_default_flags_calls_it(monkeypatch):
    _fake_program(monkeypatch)

    def fail(*a):
        raise OSError("exec format error")
    monkeypatch.setattr(os, "execve", fail)
    with pytest.warns(UserWarning, match="could not restart with malloc huge pages"):
        assert xla_env.restart_with_hugepages() is False
    seen = []
    monkeypatch.setattr(xla_env, "restart_with_hugepages", lambda: seen.append(1) or False)
    monkeypatch.setenv(xla_env.OPT_OUT_ENV, "1")  # leave XLA_FLAGS alone
    xla_env.use_default_flags({})  # an explicit environment: no restart
    assert not seen
    xla_env.use_default_flags()
    assert seen == [1]


def test_this_test_runner_is_never_restarted(monkeypatch):
    monkeypatch.delenv(xla_env.RESTARTED_ENV, raising=False)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail(f"restarted the test runner: {a}"))
    assert xla_env.restart_with_hugepages() is False


def test_entry_point_restarts_with_malloc_huge_pages():
    """``python -m icml_jax.xla_env`` restarts like every entry point: in the same process (same
    PID), with its arguments, once; a large block then faults in as huge pages (far fewer faults
    than with ``ICML_JAX_HUGEPAGES=0``) where the kernel's THP mode is ``madvise``."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", xla_env.HUGEPAGES_ENV, xla_env.RESTARTED_ENV)}
    runs = {}
    for name, extra in (("on", {xla_env.HUGEPAGES_ENV: "1"}), ("off", {xla_env.HUGEPAGES_ENV: "0"})):
        proc = subprocess.Popen([sys.executable, "-m", "icml_jax.xla_env", "--probe_mib", "256", "--x=1"],
                                cwd=REPO_ROOT, env={**base, **extra}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
        assert out.count("pid: ") == 1 and int(lines["pid"]) == proc.pid, out  # one report, same process
        assert lines["argv"] == "--probe_mib 256 --x=1", out
        runs[name] = lines
    on, off = runs["on"], runs["off"]
    assert off["restarted"] == "no" and off["GLIBC_TUNABLES"] == ""
    if (xla_env.glibc_version() or (0, 0)) >= (2, 35):
        assert on["restarted"] == "yes" and on["GLIBC_TUNABLES"] == xla_env.HUGEPAGE_TUNABLE
        if xla_env.thp_mode() == "madvise":
            assert int(on["probe faults"]) * 4 < int(off["probe faults"]), (on, off)
    else:
        assert on["restarted"] == "no"
