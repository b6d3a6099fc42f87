"""The XLA flags icml_jax's entry points choose. Importing icml_jax changes nothing; the CLI
(``icml_jax.main``, ``icml_jax.sample``), the experiments and the benchmarks call
:func:`use_default_flags` before their first JAX computation. A library user opts in the same way.

The one flag today is for the CPU backend (GPU/TPU backends ignore ``xla_cpu_*`` flags): with
jax 0.10.2's defaults, the dots of our train step go through YNNPACK fusions, which ran
single-threaded when the cores were shared (the flag then made the train step 1.9x faster); an
empty fusion list sends them to XLA's multi-threaded matmuls. Without shared cores the effect is
within run-to-run noise: two back-to-back runs of ``benchmarks.train_throughput`` on 2026-12-02
(2-core AMD EPYC) gave jax's defaults 0.78x and 1.12x the flag's tokens/s on the ``small`` preset
and 0.97x and 1.08x on ``20m``. (Before this module, ``import icml_jax`` set the flag, so that
benchmark's "default flags" arm had it too.) Losses are identical.
"""
from __future__ import annotations

import os
import sys
import warnings

OPT_OUT_ENV = "ICML_JAX_DEFAULT_XLA_FLAGS"  # =1: leave XLA_FLAGS as the user set it
CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=",)


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
    """
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT_ENV) == "1":
        return False
    flags = environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in flags}
    new = [f for f in CPU_FLAGS if f.split("=", 1)[0] not in names]
    if not new:
        return False
    environ["XLA_FLAGS"] = " ".join(flags + new)
    if environ is os.environ and _backend_started():
        warnings.warn("icml_jax.xla_env.use_default_flags() ran after JAX's backend started; "
                      "XLA_FLAGS takes effect in the next process", stacklevel=2)
    return True
