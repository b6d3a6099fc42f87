"""icml_jax: JAX/Flax implementations of a set of ICML 2025 methods on one sharded decoder stack."""
import os

__version__ = "0.1.0"

# XLA CPU: with jax 0.10.2's defaults, dots in our train step go through YNNPACK fusions, which ran
# single-threaded when the cores were shared (the flag then made the train step 1.9x faster); an
# empty fusion list sends them to XLA's multi-threaded matmuls. On an idle 2-core machine the gain
# is small (+4% train tokens/s; decoding at batch 8 was ~20% slower with it in one run), see
# benchmarks/results/train_throughput.md and decode_speed.md. Losses are identical. Set before
# the backend starts (the first jax computation), appended to any XLA_FLAGS the user set; opt out
# with ICML_JAX_DEFAULT_XLA_FLAGS=1. GPU/TPU backends ignore xla_cpu_* flags.
_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
if os.environ.get("ICML_JAX_DEFAULT_XLA_FLAGS") != "1" and \
        "xla_cpu_experimental_ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_FLAG}".strip()
