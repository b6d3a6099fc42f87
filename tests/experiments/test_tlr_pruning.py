"""experiments/tlr_pruning at its tiny preset: the dense run, every arm of the grid, the outputs;
the parameter-matched control's sparsities."""
import csv
import os

import pytest

from experiments.tlr_pruning.__main__ import PRESETS, control_sparsity, main
from icml_jax.config_utils import load_config


def test_tlr_pruning_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "ppl.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    per_setting = 1 + (3 + bool(exp.long_iters)) * len(exp.ranks)  # + TLR at the scripts' T
    n_runs = sum(len(exp.calib_seeds) if m == "wanda" else 1 for m in exp.methods) * len(exp.settings)
    assert len(rows) == 1 + per_setting * n_runs
    dense = float(rows[0]["kept_params"])
    for r in rows[1:]:
        kept = float(r["kept_params"]) / dense
        if r["arm"] == "prune only":
            assert kept == pytest.approx(1 - float(r["sparsity"]), abs=1e-3)
        else:  # refinements and the control keep about the same budget
            assert kept > 1 - float(r["sparsity"])
    tlr = [float(r["kept_params"]) for r in rows if r["arm"] == "TLR"]
    ctl = [float(r["kept_params"]) for r in rows if r["arm"] == "param-matched control"]
    assert max(abs(a - b) / dense for a, b in zip(tlr, ctl)) < 0.01
    assert "Gates:" in open(os.path.join(wd, "results.md")).read()


def test_control_sparsity_matches_the_budget():
    m = load_config("configs/lm.py:tiny").model
    per = control_sparsity(m, 0.5, 4)
    D, F = m.d_model, m.ffn_dim
    assert per["down"] == pytest.approx(0.5 - 4 * (D + F) / (D * F))
    assert (1 - per["up"]) * D * F == pytest.approx(0.5 * D * F + 4 * (D + F))
