"""experiments/econ at its tiny preset (untrained LMs: the plumbing, not the result): outputs, one
row per (arm, seed), accuracies and actions in range, the failed pilot gate reported; the answer
format by hand."""
import csv
import os

import pytest

from experiments.econ import lms
from experiments.econ.__main__ import ARMS, PRESETS, main


@pytest.mark.xdist_group("econ_harness")  # with tests/analysis/test_econ_harness.py (shared compiles)
def test_econ_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    rows, curves, gates = main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "econ.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    got = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert len(got) == len(ARMS) * len(exp.seeds)
    for r in got:
        assert 0.0 <= float(r["accuracy"]) <= 1.0
        assert 0.1 <= float(r["mean_T"]) <= 2.0 and 0.1 <= float(r["mean_p"]) <= 1.0
    rounds = exp.harness_questions // exp.batch
    assert len(curves[exp.seeds[0]]) == exp.epochs * rounds * exp.updates
    assert not all(gates.values())          # untrained LMs are never right: the gate must say so
    assert "FAIL" in open(os.path.join(wd, "results.md")).read()


def test_answer_format():
    train, test = lms.problems(PRESETS["tiny"])
    p = test[0]
    assert lms.document(p) == lms.prompt(p) + str(p.answer)
    assert lms.parse(f"{p.answer}\nrest") == p.answer
    assert lms.parse("x1") is None and lms.parse("") is None
    assert not {q.expression for q in train} & {q.expression for q in test}
