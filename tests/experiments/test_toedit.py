"""experiments/toedit at its tiny preset: prior, synthetic and edited corpora, students, outputs."""
import csv
import json
import os

import numpy as np

from experiments.toedit.__main__ import PRESETS, arms, bigram_stats, main


def test_toedit_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "nll.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    chain = [r for r in rows if r["arm"].endswith("chain")]
    assert len(rows) - len(chain) == len(arms(exp)) * len(exp.seeds)
    assert len(chain) == 2 * (exp.generations - 1) * len(exp.chain_seeds)
    assert {int(r["generation"]) for r in chain} == set(range(2, exp.generations + 1))
    assert all(float(r["nll"]) > 0 for r in rows)
    # the corpora: the mix replaces exactly its share of pieces, synthetic pieces keep the human
    # prefix and the length, ToEdit keeps the length and changes some pieces
    read = lambda name: [json.loads(line)["text"] for line in open(os.path.join(wd, name))]  # noqa: E731
    human, synth, mix = read("corpus_human.jsonl"), read("corpus_synthetic.jsonl"), read("corpus_mix_50pct.jsonl")
    assert len(human) == len(synth) == len(mix) == exp.docs
    assert all(s[:exp.prefix] == h[:exp.prefix] and s != h for h, s in zip(human, synth))
    cfg = json.load(open(os.path.join(wd, "config.json")))
    mismatch = np.mean([len(s.encode()) != len(h) for h, s in zip(human, synth)])
    assert cfg["meta"]["synthetic_length_mismatch"] == mismatch
    assert sum(m == s for m, s in zip(mix, synth)) == exp.docs // 2
    assert sum(m == h for m, h in zip(mix, human)) == exp.docs // 2
    edited = read("corpus_toedit_p0.9.jsonl")
    arm = next(r for r in rows if r["arm"] == "toedit p=0.9")
    rate, changed = float(arm["edit_rate"]), float(arm["changed_rate"])
    assert 0 <= changed <= rate <= 1 and (changed > 0) == (edited != human)
    assert len(cfg["gates"]) == 3
    assert "Gates:" in open(os.path.join(wd, "results.md")).read()


def test_bigram_stats():
    d2, kl, counts = bigram_stats(["abab", "ab"])
    assert counts[ord("a"), ord("b")] == 3 and counts[ord("b"), ord("a")] == 1 and d2 == 2 / 4
    assert bigram_stats(["abab", "ab"], counts)[1] == 0.0
    assert bigram_stats(["aaaa"], counts)[1] > 0
