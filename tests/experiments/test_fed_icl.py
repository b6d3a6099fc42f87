"""experiments/fed_icl at its tiny preset: outputs, one row per (seed, learner, method, round), MSEs
positive, the report's sections."""
import csv
import os

from experiments.fed_icl.__main__ import FEDS, PRESETS, main


def test_fed_icl_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "rounds.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    per_learner = len(FEDS) * exp.rounds + 3  # local_only, centralised, trivial
    assert len(rows) == len(exp.seeds) * 2 * per_learner
    assert all(float(r["mse"]) > 0 for r in rows)
    bayes = {(r["method"], r["round"]): float(r["mse"]) for r in rows if r["learner"] == "bayes"}
    assert bayes[("centralised", "0")] < bayes[("trivial", "0")]
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "server MSE by round" in md and "local-only" in md
