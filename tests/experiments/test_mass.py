"""experiments/mass at its tiny preset: every arm trains through config.data.select_scores, one row per
run, equal tokens for the selected arms, the selections' composition and the report's sections."""
import csv
import json
import os

import ml_collections

from experiments.mass import stages
from experiments.mass.__main__ import PRESETS, main
from icml_jax.data import pipeline
from icml_jax.data.tokenizers import ByteTokenizer


def test_mass_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "selections.csv", "results.md", "exact_match.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert [(r["arm"], int(r["seed"])) for r in rows] == [(a, s) for a, s, *_ in stages.arm_runs(exp)]
    tokens = {r["arm"]: int(r["tokens"]) for r in rows}
    assert tokens["full"] == tokens["mass"] == exp.run.train.steps * exp.run.train.batch_size * exp.run.data.seq_len
    more = {a: (steps, ratio) for a, _, steps, _, ratio in stages.arm_runs(PRESETS["default"])}
    assert more["full_more"] == (2 * more["random"][0], 1.0) and more["random"][1] == more["mass"][1] == 0.5
    for r in rows:
        assert 0.0 <= float(r["em"]) <= 1.0
    sel = {s["selection"]: s for s in csv.DictReader(open(os.path.join(wd, "selections.csv")))}
    n = int(sel["full"]["docs"])
    for k in ("mass", "random_0"):
        assert int(sel[k]["docs"]) == -(-n // 2)
        assert abs(sum(float(sel[k][f"share_{c}"]) for c in ("clean", "noisy", "string", "prose")) - 1) < 1e-9
    # the MASS run read the MASS scores through the pipeline option: its train split is the top half
    log = json.load(open(os.path.join(wd, "config.json")))
    assert log["meta"]["train_docs"] == n and log["gates"]
    run = json.load(open(os.path.join(wd, "runs", "mass_seed0", "train_key.json")))
    assert run["data"]["select_scores"] == os.path.join(wd, "scores_mass.npy")
    assert run["data"]["select_ratio"] == exp.keep_ratio
    data = ml_collections.ConfigDict(run["data"])
    kept = pipeline.load_corpus(data, ByteTokenizer(), "train", data.seq_len)
    assert kept.num_documents == int(sel["mass"]["docs"])
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "Clean-row control" in md and "Skill graph" in md
