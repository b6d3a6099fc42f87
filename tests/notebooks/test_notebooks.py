"""Every notebook under notebooks/ runs end to end (tiny presets), as Colab users will run it.

A notebook that drives a tiny experiment (or the preference testbed) reads ``ICML_JAX_WORKDIR``, the
folder to work in (a fresh temp folder when unset): here it gets a copy of the run that the
experiment's own test uses (a session fixture of tests/conftest.py, built by the same code with the
same settings), so the notebook's cells run for real on it while nothing is trained twice.
``SHARED`` says, per notebook, which run it gets and how; the test checks that the notebook found
it complete (no cached result file was rewritten).
"""
import glob
import os
import shutil

import nbformat
import pytest
from nbclient import NotebookClient

from experiments.fope_length.__main__ import PRESETS as _FOPE_PRESETS
from icml_jax.config_utils import REPO_ROOT

_FOPE_TINY = _FOPE_PRESETS["tiny"]
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO_ROOT, "notebooks", "*.ipynb")))


def _fope(run, work):
    shutil.copytree(run, os.path.join(work, "exp"), symlinks=True)
    # the experiment test's run is the tiny preset's default seeds (the notebook's default is 0)
    return os.path.join(work, "exp"), {"ICML_JAX_SEEDS": ",".join(map(str, _FOPE_TINY.seeds))}


def _implicit_prm(run, work):
    base, _, _ = run  # its cache keys hold absolute paths: the notebook works in that folder
    return base, {}


def _testbed(run, work):
    shutil.copytree(run, os.path.join(work, "testbed"), symlinks=True)
    return work, {}


# notebook -> (session fixture, prepare(fixture value, empty folder) -> (ICML_JAX_WORKDIR, env),
#              the cached result files, relative to ICML_JAX_WORKDIR, that must not be rewritten)
SHARED = {
    "fope_length_generalization.ipynb": (
        "fope_tiny_run", _fope,
        [f"{m}_s{s}/eval.json" for m in _FOPE_TINY.methods for s in _FOPE_TINY.seeds]),
    "implicit_prm_quickstart.ipynb": (
        "implicit_prm_tiny_run", _implicit_prm,
        [f"exp/{f}" for f in ("generator_result.json", "samples_train.json", "samples_eval.json",
                              "scores_eval.json")]),
    "preference_quickstart.ipynb": (
        "preference_testbed_tiny", _testbed,
        ["testbed/sft_result.json"] + [f"testbed/groups/{p}.json" for p in
                                       ("train", "val_in", "val_response_ood", "val_prompt_ood",
                                        "val_both_ood", "bon", "tgdpo_train", "tgdpo_eval")]),
}


# notebooks that train their own run and check nothing that needs the user-facing step count
# (interpretability: 150 steps; its cells and assertions run the same on a 20-step model)
STEPS = {"interpretability.ipynb": 20}


def _param(path):
    name = os.path.basename(path)
    marks = [pytest.mark.xdist_group(SHARED[name][0])] if name in SHARED else []
    return pytest.param(path, marks=marks, id=name)


@pytest.mark.parametrize("path", [_param(p) for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch, request):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    if os.path.basename(path) in STEPS:
        monkeypatch.setenv("ICML_JAX_STEPS", str(STEPS[os.path.basename(path)]))
    work, stamps = None, {}
    if os.path.basename(path) in SHARED:
        fixture, prepare, cached = SHARED[os.path.basename(path)]
        work, env = prepare(request.getfixturevalue(fixture), str(tmp_path / "work"))
        for k, v in {"ICML_JAX_WORKDIR": work, **env}.items():
            monkeypatch.setenv(k, v)
        stamps = {f: os.path.getmtime(os.path.join(work, f)) for f in cached}
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": REPO_ROOT}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the loss plot was not shown"
    # the shared run was complete: the notebook recomputed none of it (else it has drifted from
    # the experiment test's settings and trains everything again)
    assert {f: os.path.getmtime(os.path.join(work, f)) for f in stamps} == stamps


def test_there_is_a_notebook():
    assert NOTEBOOKS
