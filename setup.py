"""icml_jax: faithful, composable JAX/Flax implementations of ICML 2025 methods.

Pins are a set tested together on Python 3.11 (CPU). For accelerators install the matching
jax build first, e.g. ``pip install "jax[cuda12]==0.10.2"`` (NVIDIA GPU) or
``pip install "jax[tpu]==0.10.2"`` (Cloud TPU VM), then ``pip install -e .``.
"""
from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "tensorflow-datasets==4.9.10",
    "array-record==0.8.6",
    "grain==0.2.18",
    "chex==0.1.92",
    "ml-collections==1.1.0",
    "absl-py==2.5.1",
    "tqdm==4.70.1",
    "matplotlib==3.11.2",
    "sentencepiece==0.2.3",
    "tensorboardX==2.6.5",
    "numpy==2.4.6",
    "scipy==1.17.1",  # power-law fits of the sparsity analysis (already required by jax)
    "etils==1.15.0",
    "vaderSentiment==3.3.2",  # gold reward of the preference testbed (data/sentiment_testbed.py)
]

EXTRAS = {
    # pytest 8: under pytest 9.2, pytest-xdist 3.8's xdist_group marks are silently ignored (it
    # renames item._nodeid, which pytest 9 no longer reads), and `make test` relies on them
    "test": ["pytest==8.4.2", "pytest-xdist==3.8.0", "nbclient==0.11.0", "nbformat==5.11.1",
             "ipykernel==7.4.0",
             "filelock==4.3.1"],  # lock of the test suite's compilation cache (tests/jax_env.py)
    # HF interop, parity tests and the PyTorch baseline of `make bench`. torch is pinned to the
    # CPU wheel that ships on the development machine; an unpinned torch pulls a CUDA build.
    "interop": ["torch==2.13.0", "transformers==5.23.0", "safetensors==0.8.0", "tokenizers==0.23.3"],
}

setup(
    name="icml_jax",
    version="0.1.0",
    description="JAX/Flax research codebase for a set of ICML 2025 methods",
    packages=find_packages(include=["icml_jax", "icml_jax.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
