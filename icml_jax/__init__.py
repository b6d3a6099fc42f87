"""icml_jax: JAX/Flax implementations of a set of ICML 2025 methods on one sharded decoder stack."""
__version__ = "0.1.0"
