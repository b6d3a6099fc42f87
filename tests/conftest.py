"""Shared fixtures."""
import pytest

from icml_jax.config_utils import load_config


@pytest.fixture
def tiny_config():
    return load_config("configs/lm.py:tiny", unlocked=True)
