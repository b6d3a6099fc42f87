"""icml_jax: JAX/Flax implementations of a set of ICML 2025 methods on one sharded decoder stack.

Importing the package changes no environment variable; the entry points choose XLA's flags with
:func:`icml_jax.xla_env.use_default_flags`.
"""

__version__ = "0.1.0"
