"""experiments/implicit_prm at its tiny preset: runs end to end, the PRMs only ever see outcome
labels, the outputs are well formed, and a rerun recomputes nothing."""
import csv
import json
import os
import time

import numpy as np
import pytest

from experiments.implicit_prm.__main__ import main
from experiments.implicit_prm.presets import PRESETS, record
from experiments.implicit_prm.report import CSV_FIELDS, bon_over_orders, selector_scores


def test_selector_scores_and_orders():
    # two responses, two steps: raw prefix sums q = [[1, 3], [2, 1]] -> r = [[1, 2], [2, -1]]
    q = np.array([[1.0, 3.0], [2.0, 1.0]])
    M = np.ones((2, 2), np.int32)
    s = selector_scores(q, M, 1.0)
    assert s["min r_k"].tolist() == [1.0, -1.0]
    assert s["q_K = sum r_k (outcome only)"].tolist() == [3.0, 1.0]
    assert s["min q_k"].tolist() == [1.0, 1.0] and s["sum q_k"].tolist() == [4.0, 3.0]
    # a response without steps is never preferred
    M0 = np.array([[1, 1], [0, 0]], np.int32)
    assert selector_scores(q, M0, 1.0)["min r_k"][1] < -1e20
    # averaging over orders: one correct of two, perfect scorer -> 1.0 at n=2, 0.5 at n=1
    perms = [np.array([0, 1]), np.array([1, 0])]
    res = bon_over_orders(np.array([[1.0, 0.0]]), np.array([[True, False]]), [1, 2], perms)
    assert res == {1: 0.5, 2: 1.0}


def test_presets_record_keeps_the_stored_layout():
    # config.json's "experiment" holds what it held before the ConfigDict presets: flat
    # run-config keys, JSON lists
    rec = record(PRESETS["default"])
    assert rec["knobs"] == {"num_steps": 3, "digits": 2, "operators": "+-"}
    assert rec["generator"]["model.d_model"] == 128 and rec["prm"]["train.steps"] == 100
    assert rec["generator"]["train.steps"] == 400 and rec["ns"] == [1, 2, 4, 8, 16, 32]
    assert rec["generator_continue"][1] == {"train.steps": 1000, "train.warmup_steps": 20,
                                            "train.lr": 2e-3, "train.eval_every": 1000,
                                            "train.checkpoint_every": 500}
    assert "generator_continue" not in record(PRESETS["tiny"])


@pytest.mark.xdist_group("implicit_prm_tiny_run")
def test_implicit_prm_tiny(implicit_prm_tiny_run, session_tfds_dir, monkeypatch):
    # the run is main([--workdir, --preset=tiny]) in a session fixture (tests/conftest.py), which
    # the implicit PRM notebook's test reuses as well
    monkeypatch.setenv("TFDS_DATA_DIR", session_tfds_dir)
    _, wd, out = implicit_prm_tiny_run
    exp = PRESETS["tiny"]
    for f in ("config.json", "results.csv", "results.md", "best_of_n.png", "first_error_f1.png"):
        assert os.path.getsize(os.path.join(wd, f)) > 0, f
    with open(os.path.join(wd, "best_of_n.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # the PRMs are trained on outcome labels only: CE rows are exactly prompt/completion/label,
    # DPO rows prompt/chosen/rejected, and the labels are the checker's answer_correct
    from icml_jax.data import arithmetic as ar
    train, _ = ar.make_splits(exp["seed"], exp["gen_problems"], exp["test_problems"], **exp["knobs"])
    by_prompt = {ar.prompt_text(p): p for p in train[: exp["prm_problems"]]}
    m = max(exp["ce_responses"])
    with open(os.path.join(wd, f"ce_m{m}.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows and all(set(r) == {"prompt", "completion", "label"} for r in rows)
    assert len(rows) <= exp["prm_problems"] * m
    for r in rows:
        assert r["label"] == ar.check_solution(by_prompt[r["prompt"]], r["completion"]).answer_correct
    if "DPO" in out["prm_names"]:
        with open(os.path.join(wd, "dpo_pairs.jsonl")) as f:
            pairs = [json.loads(line) for line in f]
        assert pairs and all(set(r) == {"prompt", "chosen", "rejected"} for r in pairs)
        for r in pairs:
            p = by_prompt[r["prompt"]]
            assert ar.check_solution(p, r["chosen"]).answer_correct
            assert not ar.check_solution(p, r["rejected"]).answer_correct
    samples = json.load(open(os.path.join(wd, "samples_train.json")))
    assert set(samples) == {"key", "groups"}  # no step labels stored with the training samples

    cfg = json.load(open(os.path.join(wd, "config.json")))
    # the preset is stored as before it was a ConfigDict: flat run-config keys, JSON lists
    assert cfg["experiment"] == record(exp) and cfg["experiment"]["ce_responses"] == [2, 4]
    assert cfg["experiment"]["prm"]["train.steps"] == exp.prm.train.steps
    prm_cfgs = cfg["info"]["prm_configs"]
    gen_model = json.load(open(os.path.join(wd, "generator", "config.json")))["model"]
    for name, c in prm_cfgs.items():
        assert c["train"]["init_from"] == os.path.join(wd, "generator")
        assert c["loss"]["beta"] == exp["beta"] and c["model"] == gen_model
        assert c["task"] == ("preference" if name == "DPO" else "implicit_prm"), name
    if "DPO" in prm_cfgs:
        assert prm_cfgs["DPO"]["loss"]["type"] == "sigmoid"

    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    bon = [r for r in rows if r["kind"] == "best_of_n"]
    sels = {r["selector"] for r in bon}
    assert {"random pick", "majority vote", "pass@n (oracle)"} <= sels
    for name in out["prm_names"]:
        assert {f"{name}: min r_k", f"{name}: q_K = sum r_k (outcome only)",
                f"{name}: weighted MV σ(β·min r_k)"} <= sels
    assert {int(r["n"]) for r in bon} == set(exp["ns"])
    for r in rows:
        if r["n"] != "tau":
            v = float(r["value"])
            assert (0.0 <= v <= 1.0) or v != v, r
    tab = out["table"]
    for n in exp["ns"]:  # pass@n bounds every selector; random pick at n=1 equals every selector's
        for s, res in tab.items():
            assert res[n] <= tab["pass@n (oracle)"][n] + 1e-9, (s, n)
        assert tab["random pick"][1] == pytest.approx(tab[f"{out['prm_names'][0]}: min r_k"][1])
    fe = [r for r in rows if r["kind"] == "first_error" and r["n"] == "f1"]
    assert {r["selector"] for r in fe} == set(out["prm_names"])
    md = open(os.path.join(wd, "results.md")).read()
    for s in ("## Best-of-N accuracy", "## First-error detection", "## Reading", "commit ",
              "| selector | N=1 |", "| PRM | F1 |"):
        assert s in md, s
    acc = tab["random pick"][1]  # the gate states the generator's accuracy and its verdict
    gate = "inside [0.30, 0.60]" if 0.3 <= acc <= 0.6 else "outside [0.30, 0.60]: the gate fails"
    assert f"per-sample accuracy on the held-out problems is {acc:.3f}: {gate}" in md

    before = {f: os.path.getmtime(os.path.join(wd, f)) for f in
              ("generator_result.json", "samples_train.json", "samples_eval.json",
               "scores_eval.json")}
    t0 = time.time()
    main([f"--workdir={wd}", "--preset=tiny"])
    assert time.time() - t0 < 30  # everything cached: only the tables and plots are rewritten
    for f, t in before.items():
        assert os.path.getmtime(os.path.join(wd, f)) == t, f
