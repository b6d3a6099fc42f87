"""Every notebook under notebooks/ runs end to end (tiny presets), as Colab users will run it."""
import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

from icml_jax.config_utils import REPO_ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path, tmp_path, monkeypatch, jax_cache_env):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    for k, v in jax_cache_env.items():  # the session's compilation cache (tests/conftest.py)
        monkeypatch.setenv(k, v)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": REPO_ROOT}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the loss plot was not shown"


def test_there_is_a_notebook():
    assert NOTEBOOKS
