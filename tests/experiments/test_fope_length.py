"""experiments/fope_length at its tiny preset: runs end to end, writes well-formed outputs, resumes."""
import csv
import json
import os

from experiments.fope_length.__main__ import FACTORS, METHODS, main


def test_fope_length_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert cfg["methods"] == list(METHODS) and len(cfg["seeds"]) >= 2
    L = cfg["base_config"]["data"]["seq_len"]
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    ppl = [r for r in rows if r["metric"] == "perplexity"]
    assert len(ppl) == len(METHODS) * len(cfg["seeds"]) * len(FACTORS)
    assert {int(r["length"]) for r in ppl} == {f * L for f in FACTORS}
    for r in ppl:
        assert 1.0 < float(r["value"]) < 384.0, r  # finite, better than nothing absurd
    pk = [r for r in rows if r["metric"].startswith("passkey_")]
    assert pk and all(0.0 <= float(r["value"]) <= 1.0 for r in pk)
    assert {r["metric"] for r in pk} == {"passkey_teacher_forced", "passkey_greedy"}
    md = open(os.path.join(wd, "results.md")).read()
    for m in METHODS:
        assert f"| {m} | " in md
    assert "seeds [0, 1]" in md and "Command:" in md
    for name in ["perplexity_vs_length.png"] + [f"passkey_{m}.png" for m in METHODS]:
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun resumes: nothing is retrained or re-evaluated
    ev = os.path.join(wd, "rope_s0", "eval.json")
    before = os.path.getmtime(ev)
    main([f"--workdir={wd}", "--preset=tiny"])
    assert os.path.getmtime(ev) == before
