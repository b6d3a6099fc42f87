"""How the test suite runs JAX: XLA's optimisation level, the compilation cache, subprocesses.

``tests/conftest.py`` calls :func:`configure` before anything imports JAX, so the settings reach
the pytest process, its xdist workers and, through the environment, every subprocess a test starts
(CLI runs, multi-process runs, notebook kernels). Subprocesses that need fake devices build their
environment with :func:`subprocess_env`, which keeps these settings and only sets the device count.

* **XLA's fast-compiling CPU settings.** Tests compile thousands of tiny programs and run each a
  few times, so compiling dominates. Two flags make XLA compile faster: backend optimisation
  level 0 (roughly halves the CPU compile time; the compiled programs run about 3x slower, which
  tiny tests do not notice), and ``--xla_cpu_use_fusion_emitters=false``, which emits fusions
  through XLA's older LLVM-IR emitters instead of its MLIR fusion emitters (measured on
  ``tests/models/test_decoder.py`` in one process: 40.7 s at level 0, 26.0 s with both flags).
  The suite passes with them; ``ICML_JAX_TEST_XLA_OPT=default`` runs it with XLA's defaults
  instead (do that when a numeric test fails with one setting only). Benchmarks and experiments
  run outside pytest never see these flags.
* **A persistent compilation cache shared by the whole session** (workers and subprocesses), with
  JAX's own threshold: only executables that took at least 1 s to compile are written. Smaller
  ones are cheaper to compile again than to store: each write runs the cache's eviction scan over
  the whole folder under a file lock shared by all processes. The size bound is what turns that
  lock on (two processes never read an entry the other is still writing), and the lock needs the
  ``filelock`` package (the ``test`` extra), so a missing one is an error here, not a cache that
  silently does nothing.
"""
import contextlib
import os
import tempfile

from icml_jax import xla_env

OPT_ENV = "ICML_JAX_TEST_XLA_OPT"
CACHE_ENV = "ICML_JAX_TEST_COMPILATION_CACHE"
# the fast-compile flags (see the module docstring), all added or none
OPT_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
DEVICES_FLAG = "--xla_force_host_platform_device_count"
MIN_COMPILE_SECS = 1.0


def _with_opt_level(flags: list[str]) -> str:
    if os.environ.get(OPT_ENV, "0") != "default":
        flags = flags + [f for f in OPT_FLAGS if f not in flags]
    return " ".join(flags)


def configure() -> tuple[str, bool]:
    """Sets this process's environment (inherited by every child); returns (cache folder, whether
    this process created it and should remove it at exit)."""
    try:
        import filelock  # noqa: F401  (JAX's cache lock; see the module docstring)
    except ImportError as e:
        raise RuntimeError("the test suite's compilation cache needs `filelock`: "
                           "pip install -e '.[test]'") from e
    own = False
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        os.environ.setdefault(CACHE_ENV, os.environ["JAX_COMPILATION_CACHE_DIR"])
    elif not os.environ.get(CACHE_ENV):
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="icml_jax_test_jit_cache_")
        own = True
    cache = os.environ[CACHE_ENV]
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", str(MIN_COMPILE_SECS))
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 << 30))
    os.environ["XLA_FLAGS"] = _with_opt_level(os.environ.get("XLA_FLAGS", "").split())
    xla_env.use_default_flags()  # the flags icml_jax's entry points set
    return cache, own


@contextlib.contextmanager
def caching_every_compilation():
    """While it is open, the session's compilation cache keeps every program this process
    compiles, not only those that took 1 s. For code that trains several models of one shape
    (seeds, arms, students: the experiments, the session fixtures' runs): each trainer run builds
    new jitted functions, so without it the second run's XLA compiles all run again; with it they
    are reads (tracing and lowering still run). Measured on the FoPE and implicit-PRM tests: 72 ->
    60 CPU-s. Not session-wide: there every tiny test's write would pay the eviction scan."""
    import jax
    key = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, key)
    jax.config.update(key, 0.0)
    try:
        yield
    finally:
        jax.config.update(key, old)


def subprocess_env(devices: int = 1, **extra: str) -> dict:
    """This process's environment for a child JAX process on the CPU with ``devices`` fake
    devices; ``extra`` adds or replaces variables."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICES_FLAG)]
    env["XLA_FLAGS"] = _with_opt_level(flags + ([f"{DEVICES_FLAG}={devices}"] if devices > 1 else []))
    env["JAX_PLATFORMS"] = "cpu"
    env.update(extra)
    return env


def entry_computation(hlo_text: str) -> str:
    """The ENTRY computation of a compiled module's HLO text: the top-level instructions, i.e. the
    buffers a step writes (fused computations' internals left out)."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return entry[:entry.index("\n}")]
