"""experiments/vocagnolm at its tiny preset (teacher, student, arms, outputs) and its corpus."""
import csv
import json
import os

import numpy as np

from experiments.vocagnolm.__main__ import PRESETS, corrupt, main, math_docs, problems, question, solution_lines


def test_vocagnolm_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "results.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert [r["arm"] for r in rows] == [a for a in exp.arms for _ in exp.seeds]
    assert all(0 <= float(r["exact_match"]) <= 1 and float(r["clean_nll"]) > 0 for r in rows)
    share = {r["arm"]: float(r["selected_share"]) for r in rows}
    assert share["ce"] == 1.0 and 0.4 <= share["vocagnolm"] < 0.6  # 40% of the mapped + each EOS
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert len(cfg["gates"]) == 2 and set(cfg["meta"]["pilot"]) == {"spm", "student_pretrained"}
    sel = cfg["meta"]["selection"]
    assert 0 < sel["base"] < 0.5 and sel["multi"] == 0.0  # ASCII bytes: each inside one teacher piece
    assert set(sel["vocagnolm"]) == {"pretrained student", "CE student (seed 0, end)"}
    assert all(0 <= v <= 1 for v in sel["vocagnolm"].values())
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "Reading: clean-solution NLL against CE: VocAgnoLM" in md
    noisy = [json.loads(line)["text"] for line in open(os.path.join(wd, "corpus_noisy.jsonl"))]
    assert len(noisy) == exp.student_docs


def test_noisy_corpus_marks_exactly_the_corrupted_lines():
    train, test = problems(0, 200, 20)
    assert not {p.expression for p in train} & {p.expression for p in test}
    texts, bad, good = math_docs(train, 4, 0.3)
    lines = sum(len(b) + len(g) for b, g in zip(bad, good))
    assert 0.2 < sum(map(len, bad)) / lines < 0.4
    for t, p, b, g in zip(texts, train, bad, good):
        true = solution_lines(p)
        assert len(b) + len(g) == len(true) and t.endswith("".join(t[lo:hi] for lo, hi in sorted(b + g)))
        assert t.index("A: ") + 3 == min(b + g)[0]  # the spans cover the solution, nothing else
        assert all(t[lo:hi] in true for lo, hi in g)  # clean lines are the true ones
        assert all(t[lo:hi].endswith("\n") and t[lo:hi] not in true for lo, hi in b)
    assert question(train[0], np.random.default_rng(0)).endswith("How many now?\nA: ")


def test_corrupt_makes_wrong_arithmetic_or_junk():
    rng = np.random.default_rng(0)
    outs = [corrupt("34+25=59\n", rng) for _ in range(200)]
    wrong = [o for o in outs if o.startswith("34+25=")]
    assert 50 < len(wrong) < 150 and all(o != "34+25=59\n" and int(o[6:]) >= 0 for o in wrong)
    assert all(len(o) == 9 for o in outs if o not in wrong)
    assert all(corrupt("Answer: 1\n", rng) != "Answer: 1\n" for _ in range(50))
