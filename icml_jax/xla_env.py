"""The XLA settings icml_jax's entry points choose. Importing icml_jax changes nothing; the CLI
(``icml_jax.main``, ``icml_jax.sample``) and the experiments call :func:`use_defaults` (the flags
and a persistent compilation cache) before their first JAX computation, the benchmarks
:func:`use_default_flags` only (they measure compile time). A library user opts in the same way.

The flags are for the CPU backend (GPU/TPU backends ignore ``xla_cpu_*`` flags). The first: with
jax 0.10.2's defaults, the dots of our train step go through YNNPACK fusions, which ran
single-threaded when the cores were shared (the flag then made the train step 1.9x faster); an
empty fusion list sends them to XLA's multi-threaded matmuls. Without shared cores the effect is
within run-to-run noise: two back-to-back runs of ``benchmarks.train_throughput`` on 2026-12-02
(2-core AMD EPYC) gave jax's defaults 0.78x and 1.12x the flag's tokens/s on the ``small`` preset
and 0.97x and 1.08x on ``20m``. (Before this module, ``import icml_jax`` set the flag, so that
benchmark's "default flags" arm had it too.) Losses are identical.

On a CPU with AVX-512 a second flag lets XLA's own (non-matmul) kernels use 512-bit vectors
(XLA prefers 256 by default, for older Intel parts that slow their clock on 512-bit
instructions): in-process A/B of the train step on a 2-core Intel Xeon with AVX-512 (2026-12-06,
both programs compiled in one process and timed alternately) ``small`` 540 -> 501 ms median
(528 -> 492 min), ``20m`` 1181 -> 1124 ms (1141 -> 1079 min); batch-8 decode within noise. On
CPUs without AVX-512 it is not added.

The decode loops are the exception: their matmuls have as many rows as the batch, where YNNPACK's
dots beat XLA's matmul, so :func:`decode_jit` compiles them with jax's own YNN list again when the
YNN flag is ours (:func:`decode_compiler_options`: batch-8 decode of the 20m model 8.0-8.6 -> 6.1
ms/token).

Outside XLA's flags, the entry points also restart once with glibc's malloc asking for transparent
huge pages (:func:`restart_with_hugepages`, ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``): XLA:CPU
allocates a program's temporary buffer afresh at each execution, and glibc maps a block that
large anew each time, so the kernel faulted the whole buffer in page by page at every train step
(95k faults and ~16% of the step's CPU time on ``small``). With huge pages: 0.6k-1.4k faults per
step and 6-14% more tokens/s in ``benchmarks.train_throughput`` (``ours_no_hugepages`` rows).
``python -m icml_jax.xla_env`` prints what the entry points choose on this machine.
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

OPT_OUT_ENV = "ICML_JAX_DEFAULT_XLA_FLAGS"  # =1: leave XLA_FLAGS as the user set it
VECTOR_FLAG = "--xla_cpu_prefer_vector_width=512"


def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the host CPU has AVX-512 (the ``avx512f`` flag of Linux's ``/proc/cpuinfo``;
    False where that file cannot be read)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512f" in line.split(":", 1)[-1].split()
    except OSError:
        pass
    return False


CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=",) + ((VECTOR_FLAG,) if cpu_has_avx512() else ())
# the flag names use_default_flags appended to XLA_FLAGS, space-separated (child processes inherit
# both variables, so they know which flags were ours and not the user's)
ADDED_ENV = "ICML_JAX_ADDED_XLA_FLAGS"
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
# jax 0.10.2's own YNNPACK fusion list on the CPU (what XLA uses when XLA_FLAGS does not name the
# flag; read from the compiled HLO: with this list and with no flag the decode loop holds the same
# 112 YNN fusions, with our empty list none)
JAX_DEFAULT_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE"


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without that helper: assume not started
        return False


def use_default_flags(environ=None) -> bool:
    """Appends :data:`CPU_FLAGS` to ``XLA_FLAGS`` in ``environ`` (default ``os.environ``), keeping
    what the user set: a flag already named there is left alone, and ``ICML_JAX_DEFAULT_XLA_FLAGS=1``
    turns this off. Returns whether it changed anything. XLA reads the variable once, when the
    backend starts, so call this before the first JAX computation (a warning says when it is late).
    With the default ``environ`` it first calls :func:`restart_with_hugepages` (which restarts
    only a ``python -m`` program of ours).
    """
    if environ is None:
        restart_with_hugepages()
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT_ENV) == "1":
        return False
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    new = [f for f in CPU_FLAGS if f.split("=", 1)[0] not in names]
    if not new:
        return False
    environ["XLA_FLAGS"] = " ".join(flags + new)
    environ[ADDED_ENV] = " ".join(sorted(set(environ.get(ADDED_ENV, "").split())
                                         | {f.split("=", 1)[0] for f in new}))
    if environ is os.environ and _backend_started():
        warnings.warn("icml_jax.xla_env.use_default_flags() ran after JAX's backend started; "
                      "XLA_FLAGS takes effect in the next process", stacklevel=2)
    return True


# ----------------------------------------------------------------------------- decode programs

def decode_compiler_options(environ=None) -> dict | None:
    """Per-program XLA options for the decode loops (``inference.decode``'s ``generate`` and
    ``scored_decode``, ``collab.FlaxLM``'s cached step), or None for none.

    Our YNN flag (the first of :data:`CPU_FLAGS`) turns XLA's YNNPACK dots off process-wide for the
    train step's sake. Decode steps are the opposite case: their matmuls have few rows (the batch), where XLA's
    own matmul streams the weights at about half the speed of a matrix-vector product, and YNNPACK's
    dots are faster (``benchmarks.decode_speed``'s 20m model at batch 8: 8.0-8.6 -> 6.1 ms/token on
    2 idle cores, 15.6-16.3 -> 10.2-11.5 with a third process busy on a core; batch 1 within
    noise; same tokens). So when the YNN flag in ``XLA_FLAGS`` is the one :func:`use_default_flags`
    appended (recorded in ``$ICML_JAX_ADDED_XLA_FLAGS``), the decode programs compile with jax's own
    default list instead (:data:`JAX_DEFAULT_YNN_FUSIONS`). A value the user set is left to rule, and
    other backends get no options."""
    return dict(_decode_options_key(os.environ if environ is None else environ)) or None


def _decode_options_key(environ) -> tuple:
    """:func:`decode_compiler_options` as a sorted tuple of items (``()`` for none), the key of
    :func:`decode_jit`'s variants."""
    return _options_key(environ.get(ADDED_ENV, ""), environ.get("XLA_FLAGS", ""))


@functools.lru_cache(maxsize=8)
def _options_key(added: str, xla_flags: str) -> tuple:
    """From the two variables' values (cached: it runs on every decode call, once per token in CoS)."""
    if YNN_FLAG not in added.split():
        return ()
    values = [f.split("=", 1)[1] for f in xla_flags.split() if f.split("=", 1)[0] == YNN_FLAG and "=" in f]
    if not values or values[-1] != "":  # XLA reads the last one; changed since use_default_flags
        return ()
    import jax
    if jax.default_backend() != "cpu":
        return ()
    return ((YNN_FLAG[2:], JAX_DEFAULT_YNN_FUSIONS),)


def decode_jit(fun=None, **jit_kwargs):
    """``jax.jit(fun, **jit_kwargs)`` compiled with :func:`decode_compiler_options` as they are at
    call time (one jitted variant per distinct options, in ``.variants``; usable as a decorator,
    with or without keyword arguments). ``_cache_size()`` counts the compiled programs of every
    variant and ``__wrapped__`` is ``fun``, as for a plain ``jax.jit``; the other attributes of a
    jitted function (``lower``, ``trace``, ``eval_shape``) are not forwarded: call them on a
    ``.variants`` entry. The options follow the environment at call time, while XLA read
    ``XLA_FLAGS`` once at start-up, so change neither variable after the first JAX computation."""
    if fun is None:
        return functools.partial(decode_jit, **jit_kwargs)
    import jax
    variants: dict = {}

    @functools.wraps(fun)
    def call(*args, **kwargs):
        key = _decode_options_key(os.environ)
        jitted = variants.get(key)
        if jitted is None:
            jitted = variants[key] = jax.jit(fun, compiler_options=dict(key) or None, **jit_kwargs)
        return jitted(*args, **kwargs)

    call._cache_size = lambda: sum(j._cache_size() for j in variants.values())
    call.variants = variants
    return call


# ----------------------------------------------------------------------------- compilation cache

CACHE_ENV = "ICML_JAX_COMPILATION_CACHE"  # a folder, or "off"
CACHE_MIN_SECS_ENV = "ICML_JAX_CACHE_MIN_COMPILE_SECS"
# JAX writes only executables that took at least this long to compile (its own default is 1 s,
# which on this 2-core CPU skips almost every program of a small model; see docs/architecture.md)
CACHE_MIN_COMPILE_SECS = 0.1


def default_cache_dir(environ=None) -> str:
    """``$XDG_CACHE_HOME/icml_jax/jax_cache`` (``~/.cache/...`` when XDG_CACHE_HOME is unset)."""
    environ = os.environ if environ is None else environ
    root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "icml_jax", "jax_cache")


def use_compilation_cache(environ=None) -> str | None:
    """Turns on JAX's persistent compilation cache, so a second run of the same program loads its
    compiled executables from disk instead of compiling them again. Returns the folder, or None
    when it is off. The folder is ``$ICML_JAX_COMPILATION_CACHE`` (``off`` disables the cache), else
    :func:`default_cache_dir`; executables that compiled faster than
    ``$ICML_JAX_CACHE_MIN_COMPILE_SECS`` (default :data:`CACHE_MIN_COMPILE_SECS`) are not stored.
    A cache the user configured for JAX itself (``JAX_COMPILATION_CACHE_DIR``, or
    ``jax.config.jax_compilation_cache_dir``) is left as it is, with JAX's threshold."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CACHE_MIN_SECS_ENV, "").strip() or str(CACHE_MIN_COMPILE_SECS)
    try:
        secs = float(raw)
    except ValueError:
        secs = float("nan")
    if not secs >= 0:
        raise ValueError(f"{CACHE_MIN_SECS_ENV}={raw!r} is not a number of seconds >= 0; e.g. "
                         f"{CACHE_MIN_SECS_ENV}=0.1 (0 stores every executable)")
    import jax  # importing jax starts no backend
    if environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir or environ["JAX_COMPILATION_CACHE_DIR"]
    path = environ.get(CACHE_ENV, "").strip()
    if path.lower() == "off":
        return None
    path = os.path.abspath(os.path.expanduser(path or default_cache_dir(environ)))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache off: cannot create {path} ({e}); set {CACHE_ENV} to a "
                      f"writable folder or to 'off'", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", secs)
    return path


def use_defaults() -> str | None:
    """What the CLI and the experiments set before their first JAX computation:
    :func:`use_default_flags` and :func:`use_compilation_cache` (returns its folder)."""
    use_default_flags()
    return use_compilation_cache()


# ----------------------------------------------------------------------------- huge pages

HUGEPAGES_ENV = "ICML_JAX_HUGEPAGES"  # 0/off: never; 1: skip the THP-mode check; unset: auto
# the PID of the process restarted (execve keeps it): that process never restarts twice, while
# its child processes, which inherit the variable, are judged on their own
RESTARTED_ENV = "ICML_JAX_HUGEPAGES_RESTARTED"
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_SETTING) -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise`` or ``never``: the bracketed
    word of ``path``), or None where that file cannot be read (not Linux)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return (int(version.split(".")[0]), int(version.split(".")[1])) if name == "glibc" else None
    except (AttributeError, ValueError, OSError, IndexError):
        return None


def hugepage_environ(environ=None, *, mode: str | None = "auto", glibc="auto") -> dict | None:
    """A copy of ``environ`` (default ``os.environ``) whose ``GLIBC_TUNABLES`` also holds
    :data:`HUGEPAGE_TUNABLE`, or None when that would change nothing or does not apply.

    Why: XLA:CPU allocates a program's temporary buffer (368 MiB for the ``small`` train step)
    afresh at every execution. glibc serves a block that large with its own ``mmap``, so every
    step page-faulted the whole buffer in again, 4 KiB at a time: 95k faults and ~0.3 cores of
    kernel time per ``small`` step. With ``glibc.malloc.hugetlb=1`` (glibc >= 2.35) malloc asks
    for transparent huge pages on such blocks (``madvise``): 0.6k-1.4k faults per step, 6-14% more
    tokens/s (``benchmarks/train_throughput``'s ``ours_no_hugepages`` rows). What the kernel still
    spends is zeroing the fresh pages. Torch's step, whose tensors glibc mostly reuses (8k-48k
    faults per step), changed 0.97-1.00x with it (``torch_sdpa_hugepages``).

    It applies on Linux with glibc >= 2.35 (``glibc``: (major, minor) or None for another C
    library; :func:`glibc_version` when "auto") where the kernel's THP mode (``mode``; read from
    :data:`THP_SETTING` when "auto") is ``madvise``: in ``always`` mode these blocks get huge pages
    anyway, in ``never`` they cannot (glibc's request only acts in ``madvise`` mode).
    ``$ICML_JAX_HUGEPAGES``: ``0`` (or ``off``/``false``/``no``) never; ``1`` skips our mode check
    (glibc still reads the mode itself and asks for huge pages only in ``madvise``); unset: as
    above. A ``glibc.malloc.hugetlb`` the user set in ``GLIBC_TUNABLES`` is left to rule. ``ICML_JAX_DEFAULT_XLA_FLAGS=1`` (the XLA
    flags' opt-out) does not change this."""
    environ = os.environ if environ is None else environ
    choice = environ.get(HUGEPAGES_ENV, "").strip().lower()
    if choice in ("0", "off", "false", "no") or not sys.platform.startswith("linux"):
        return None
    glibc = glibc_version() if glibc == "auto" else glibc
    if glibc is None or tuple(glibc) < (2, 35):
        return None
    if choice != "1" and (thp_mode() if mode == "auto" else mode) != "madvise":
        return None
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t]
    if any(t.split("=", 1)[0] == HUGEPAGE_TUNABLE.split("=", 1)[0] for t in tunables):
        return None
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ":".join(tunables + [HUGEPAGE_TUNABLE])
    return env


OUR_PACKAGES = ("icml_jax", "experiments", "benchmarks")  # whose ``python -m`` programs restart
# interpreter options that take a value (attached, ``-Werror``, or the next argument)
_SHORT_WITH_VALUE = "WX"
_LONG_WITH_VALUE = ("--check-hash-based-pycs",)


def launched_program(main_module=None) -> str | None:
    """The module ``main_module`` (default ``sys.modules["__main__"]``) was run as by ``python -m``
    or ``runpy`` (its ``__spec__`` name without a trailing ``.__main__``), or None (a script path,
    ``-c``, an interactive session, a test runner's worker)."""
    main_module = sys.modules.get("__main__") if main_module is None else main_module
    spec = getattr(main_module, "__spec__", None)
    name = getattr(spec, "name", None)
    return _strip_main(name) if name else name


def command_line_module(argv=None) -> str | None:
    """The module the interpreter's own ``-m`` names in ``argv`` (default ``sys.orig_argv``), or
    None (a script, ``-c``, stdin, or no ``-m`` before the first non-option). Short options may be
    clustered as CPython accepts them (``-um pkg``, ``-Bmpkg``, ``-uW error -m pkg``): in a cluster,
    ``m`` and ``c`` take the rest of it or the next argument, and so do ``W`` and ``X``. A trailing
    ``.__main__`` is dropped, as :func:`launched_program` does."""
    argv = list(getattr(sys, "orig_argv", []) or []) if argv is None else list(argv)
    i = 1
    while i < len(argv):
        tok = argv[i]
        if tok == "-" or not tok.startswith("-"):
            return None
        if tok.startswith("--"):
            if tok == "--":
                return None
            i += 2 if tok in _LONG_WITH_VALUE else 1
            continue
        skip_next = False
        for j, ch in enumerate(tok[1:], start=2):
            if ch == "c":
                return None
            if ch == "m":
                name = tok[j:] or (argv[i + 1] if i + 1 < len(argv) else None)
                return _strip_main(name) if name else None
            if ch in _SHORT_WITH_VALUE:
                skip_next = j == len(tok)  # no value attached: the next argument is the value
                break
        i += 2 if skip_next else 1
    return None


def _strip_main(name: str) -> str:
    return name[:-len(".__main__")] if name.endswith(".__main__") else name


def _ours(program: str, main_module) -> bool:
    """``program`` is a module of this checkout's packages (``experiments`` and ``benchmarks``
    are generic names: the module's file must sit beside ``icml_jax``)."""
    if program.split(".", 1)[0] not in OUR_PACKAGES:
        return False
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = getattr(main_module, "__file__", None)
    return bool(path) and os.path.abspath(path).startswith(root + os.sep)


def restarted() -> bool:
    """Whether this process is one :func:`restart_with_hugepages` restarted (``$ICML_JAX_HUGEPAGES_RESTARTED``
    holds this PID)."""
    return os.environ.get(RESTARTED_ENV, "").strip() == str(os.getpid())


def restart_with_hugepages() -> bool:
    """Starts this program again in the same process (``os.execve``: same PID, same command line,
    ``sys.orig_argv``) with :func:`hugepage_environ`'s ``GLIBC_TUNABLES``, which glibc reads only
    when a program starts. Returns False when it does not (otherwise it does not return).

    It restarts only a program the interpreter was started on with ``python -m`` naming one of our
    modules (:data:`OUR_PACKAGES`, files of this checkout) that is running as ``__main__`` in the
    main process: never a test runner, a notebook, a script of yours calling our functions or
    ``runpy``, ``python -m pdb``/``cProfile``/``coverage`` around our module, or a
    ``multiprocessing`` worker. It does nothing when :func:`hugepage_environ` returns None, once
    JAX's backend has started, or in the process it already restarted (:func:`restarted`:
    glibc drops the tunable in secure-mode programs, so the variable alone would not stop a loop).
    If ``execve`` fails the program goes on without huge pages (a warning says why). Everything the
    program did before the call runs again, so the entry points call it first
    (:func:`use_defaults` and :func:`use_default_flags` do)."""
    main_module = sys.modules.get("__main__")
    program = launched_program(main_module)
    if (not program or program != command_line_module() or not _ours(program, main_module)
            or restarted() or _backend_started()):
        return False
    import multiprocessing
    if multiprocessing.parent_process() is not None:
        return False
    env = hugepage_environ()
    if env is None or not sys.executable:
        return False
    env[RESTARTED_ENV] = str(os.getpid())
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    try:
        # argv[0] = the interpreter's full path: a bare "python" would be looked up on PATH again
        # to find the installation (its virtual environment), which could be another one
        os.execve(sys.executable, [sys.executable] + list(sys.orig_argv[1:]), env)
    except OSError as e:
        warnings.warn(f"could not restart with malloc huge pages ({e}); going on without them",
                      stacklevel=2)
    return False


def _report(argv) -> None:
    """``python -m icml_jax.xla_env [--probe_mib N]``: restarts like an entry point, then prints
    what our entry points choose here, one ``key: value`` per line; with ``--probe_mib N`` it also
    mallocs and touches one N MiB block and prints the page faults that took (few with huge
    pages, N*256 without)."""
    restart_with_hugepages()
    use_default_flags()
    print(f"pid: {os.getpid()}")
    print(f"restarted: {'yes' if restarted() else 'no'}")
    print(f"GLIBC_TUNABLES: {os.environ.get('GLIBC_TUNABLES', '')}")
    print(f"XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}")
    print(f"THP mode: {thp_mode()}; glibc: {glibc_version()}")
    print(f"argv: {' '.join(sys.argv[1:])}")
    if "--probe_mib" in argv:
        import ctypes
        import resource
        n = int(argv[argv.index("--probe_mib") + 1]) << 20
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(n)
        ctypes.memset(block, 1, n)
        print(f"probe faults: {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}")


def release_host_memory() -> bool:
    """Returns the C heap's free pages to the operating system (glibc ``malloc_trim(0)``): True
    when memory was released, False when none was or where that is not available (not
    Linux/glibc).

    Compiling a program leaves the XLA compiler's freed working memory resident in the process's
    malloc arenas: after compiling the ``small`` train step that was ~200 MiB, which stayed in the
    process's RSS for the whole run. The train loop calls this once after its first step and once
    after its first evaluation (the two compiles); the trim takes milliseconds and changes no
    computation. Measured with ``benchmarks.train_throughput`` (steady RSS)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))


if __name__ == "__main__":
    _report(sys.argv[1:])
