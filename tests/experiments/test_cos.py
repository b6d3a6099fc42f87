"""experiments/cos at its tiny preset: trains two models, runs the three drivers, writes the outputs."""
import csv
import json
import os

from experiments.cos.__main__ import METHODS, PRESETS, main


def test_cos_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "cost.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    # 2 combiners x (T=0 one seed + T=1 each seed) x prompts x methods
    assert len(rows) == 2 * (1 + len(exp.seeds)) * exp.prompts * len(METHODS)
    for r in rows:
        n, ca, cb = int(r["tokens"]), int(r["calls_a"]), int(r["calls_b"])
        assert n == exp.new_tokens
        if r["method"] == "standard":  # both models once per token after the prefill's
            assert ca == cb == n - 1
        else:  # at most one verifier call per token; at T = 1 the drafts of these tiny models pass
            assert cb <= n and int(r["drafted"]) >= int(r["accepted"])
            if float(r["temperature"]) == 1:
                assert cb < n - 1 and int(r["accepted"]) > 0
        if float(r["temperature"]) == 0:
            assert r["same_as_standard"] == "True"
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert set(cfg["gates"]) == {"b's dev loss below a's", "T = 0: every driver gives standard's tokens"}
    assert cfg["gates"]["T = 0: every driver gives standard's tokens"] is True
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "| cd | 0 | cos |" in md
