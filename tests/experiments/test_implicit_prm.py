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
from experiments.implicit_prm.report import (CSV_FIELDS, bon_over_orders, selector_scores,
                                             step_selector_scores, write_outputs)
from experiments.implicit_prm.stages import STEP_PRM, response_steps


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
    # the tiny generator is sometimes right (presets.py), so DPO pairs exist and DPO is trained
    assert "DPO" in out["prm_names"]
    with open(os.path.join(wd, "dpo_pairs.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    assert pairs and all(set(r) == {"prompt", "chosen", "rejected"} for r in pairs)
    for r in pairs:
        p = by_prompt[r["prompt"]]
        assert ar.check_solution(p, r["chosen"]).answer_correct
        assert not ar.check_solution(p, r["rejected"]).answer_correct
    samples = json.load(open(os.path.join(wd, "samples_train.json")))
    assert set(samples) == {"key", "groups"}  # no step labels stored with the training samples
    # the step-label PRM (the upper bound, and only it) trains on the checker's step labels of
    # the same samples: steps that concatenate to the response, one label per step
    assert STEP_PRM in out["prm_names"]
    with open(os.path.join(wd, "steps.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    flat = [(p, r) for p, g in zip(by_prompt, samples["groups"]) for r in g if r]
    assert [(r["prompt"], "".join(r["completions"])) for r in steps] == flat
    for r in steps:
        c = ar.check_solution(by_prompt[r["prompt"]], "".join(r["completions"]))
        assert r["labels"] == c.step_labels[:-1] + [c.step_labels[-1] and c.answer_correct]

    cfg = json.load(open(os.path.join(wd, "config.json")))
    # the preset is stored as before it was a ConfigDict: flat run-config keys, JSON lists
    assert cfg["experiment"] == record(exp) and cfg["experiment"]["ce_responses"] == [2, 4]
    assert cfg["experiment"]["prm"]["train.steps"] == exp.prm.train.steps
    prm_cfgs = cfg["info"]["prm_configs"]
    gen_model = json.load(open(os.path.join(wd, "generator", "config.json")))["model"]
    tasks = {"DPO": "preference", STEP_PRM: "step_prm"}
    for name, c in prm_cfgs.items():
        assert c["train"]["init_from"] == os.path.join(wd, "generator")
        assert c["model"] == gen_model
        assert c["task"] == tasks.get(name, "implicit_prm"), name
        if name != STEP_PRM:
            assert c["loss"]["beta"] == exp["beta"]
    assert prm_cfgs[STEP_PRM]["steps"]["separator"] == ""
    if "DPO" in prm_cfgs:
        assert prm_cfgs["DPO"]["loss"]["type"] == "sigmoid"

    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    bon = [r for r in rows if r["kind"] == "best_of_n"]
    sels = {r["selector"] for r in bon}
    assert {"random pick", "majority vote", "pass@n (oracle)"} <= sels
    for name in out["prm_names"]:
        sel = ({"min p_k", "prod p_k"} if name == STEP_PRM else
               {"min r_k", "q_K = sum r_k (outcome only)", "weighted MV σ(β·min r_k)"})
        assert {f"{name}: {k}" for k in sel} <= sels, name
    assert {int(r["n"]) for r in bon} == set(exp["ns"]) and {r["seed"] for r in rows} == {"0"}
    for r in rows:
        if r["n"] != "tau" and r["kind"] != "selected_length":
            v = float(r["value"])
            assert (0.0 <= v <= 1.0) or v != v, r
    tab = out["table"]
    for n in exp["ns"]:  # pass@n bounds every selector; random pick at n=1 equals every selector's
        for s, res in tab.items():
            assert res[n] <= tab["pass@n (oracle)"][n] + 1e-9, (s, n)
        assert tab["random pick"][1] == pytest.approx(tab[f"{out['prm_names'][0]}: min r_k"][1])
    # the selected responses' lengths: at N = 1 every selector takes the first sample; the random
    # pick's is the samples' mean length
    lens = out["runs"][0]["lengths"]
    ev_groups = json.load(open(os.path.join(wd, "samples_eval.json")))["groups"]
    mean_len = np.mean([len(r.encode()) for g in ev_groups for r in g])
    assert lens["random pick"][max(exp["ns"])] == pytest.approx(mean_len)
    assert len({round(res[1], 9) for res in lens.values()}) == 1
    assert {f"{STEP_PRM}: min p_k", "generator log-prob"} <= set(lens)
    # the step-label PRM's logits: one per written step (0 at padding), not a constant
    sc = json.load(open(os.path.join(wd, "scores_eval.json")))
    lg, M = np.array(sc["step_logit"][STEP_PRM]), np.array(sc["step_mask"])
    assert lg.shape == M.shape and np.all(lg[M == 0] == 0) and np.all(lg[M > 0] != 0)
    assert np.ptp(lg[M > 0]) > 1e-4
    fe = [r for r in rows if r["kind"] == "first_error" and r["n"] == "f1"]
    assert {r["selector"] for r in fe} == set(out["prm_names"])
    md = open(os.path.join(wd, "results.md")).read()
    for s in ("## Best-of-N accuracy", "## First-error detection", "## Reading", "commit ",
              "| selector | N=1 |", "| PRM | F1 |", "## Length of the selected response"):
        assert s in md, s
    # the step-label PRM's schedule as that run stored it (its own config.json)
    t = json.load(open(os.path.join(wd, "prm_steps", "config.json")))["train"]
    assert f"from the generator, {t['steps']} steps × {t['batch_size']}, lr {t['lr']:g}." in md
    # the gate's accuracy and the right / wrong samples' lengths, from the checker directly
    test_problems = ar.make_splits(exp["seed"], exp["gen_problems"], exp["test_problems"],
                                   **exp["knobs"])[1]
    right = np.array([ar.check_solution(p, r).answer_correct
                      for p, g in zip(test_problems, ev_groups) for r in g])
    nbytes = np.array([len(r.encode()) for g in ev_groups for r in g])
    length = cfg["info"]["length"]
    assert length["wrong"] == pytest.approx(nbytes[~right].mean())
    assert (length["correct"] == pytest.approx(nbytes[right].mean()) if right.any()
            else length["correct"] != length["correct"])  # NaN when no sample is right
    acc = cfg["info"]["eval_accuracy"]
    assert acc == pytest.approx(right.mean())
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


def test_ranking_diagnostics():
    from experiments.implicit_prm.report import ranking_diagnostics
    correct = np.array([[True, False, False], [False, True, True]])
    answers = [[5, 3, 3], [1, 2, 2]]
    right_first = np.array([[3.0, 1.0, 2.0], [0.0, 2.0, 1.0]])
    d = ranking_diagnostics(right_first, correct, answers)
    assert d["auc"] == 1.0 and d["rare_pick"] == 0.5  # problem 0's top answer 5 is given once
    d = ranking_diagnostics(-right_first, correct, answers)
    assert d["auc"] == 0.0 and d["rare_pick"] == 0.5  # problem 1's top answer 1 is given once
    assert ranking_diagnostics(np.zeros((2, 3)), correct, answers)["auc"] == 0.5  # ties: 1/2


def test_step_label_prm_scores_and_step_ends():
    # sigma is monotone: min p_k is the min logit; prod p_k sums log sigma; no steps never wins
    lg = np.array([[2.0, -1.0], [0.5, 0.5], [3.0, 0.0]])
    M = np.array([[1, 1], [1, 1], [0, 0]], np.int32)
    s = step_selector_scores(lg, M)
    assert s["min p_k"][:2].tolist() == [-1.0, 0.5] and s["min p_k"][2] < -1e20
    log_sig = lambda x: -np.log1p(np.exp(-x))
    np.testing.assert_allclose(s["prod p_k"][:2], [log_sig(2.0) + log_sig(-1.0), 2 * log_sig(0.5)])
    # the step-label PRM reads each step at the token step_end_token_indices names (steps tile
    # the response, no separator), for right, slipped and malformed responses
    from icml_jax.data import ByteTokenizer
    from icml_jax.data import arithmetic as ar
    from icml_jax.data.preference import encode_steps
    tok = ByteTokenizer()
    train, _ = ar.make_splits(0, 6, 1, num_steps=3, digits=2, operators="+-")
    rng = np.random.default_rng(0)
    texts = [(p, ar.solution_text(p, error_rate=0.5, rng=rng)) for p in train]
    texts += [(train[0], "Step 1: 2+"), (train[1], "no header at all\nAnswer: 3\n")]
    for p, r in texts:
        steps = response_steps(r)
        assert "".join(steps) == r
        a, _ = encode_steps([{"prompt": ar.prompt_text(p), "completions": steps,
                              "labels": [False] * len(steps)}], tok, 96, max_steps=6, separator="")
        k = int(a["step_mask"][0].sum())
        assert a["step_end"][0, :k].tolist() == ar.step_end_token_indices(ar.prompt_text(p), r, tok)


@pytest.mark.xdist_group("implicit_prm_tiny_run")
def test_report_over_seeds(implicit_prm_tiny_run, tmp_path):
    # two seeds' runs (the tiny run and a copy with every accuracy lowered by 0.1): cells are
    # mean ± s.e., the per-seed table and the CSV hold both seeds
    import copy
    _, _, out = implicit_prm_tiny_run
    r0 = out["runs"][0]
    r1 = copy.deepcopy(r0)
    r1["table"] = {s: {n: v - 0.1 for n, v in res.items()} for s, res in r0["table"].items()}
    r1["info"]["eval_accuracy"] = 0.45
    write_outputs(str(tmp_path), PRESETS["tiny"], "tiny", ["--preset=tiny"], {0: r0, 7: r1}, 1.0)
    md = open(tmp_path / "results.md").read()
    assert "seeds [0, 7]" in md and "## Per seed" in md
    rp = r0["table"]["random pick"]  # two values 0.1 apart: mean - 0.05, s.e. 0.05
    assert "| random pick | " + " | ".join(f"{rp[n] - 0.05:.3f} ± 0.050" for n in sorted(rp)) \
        + " |" in md
    assert "seed 7 0.450" in md and "Seeds [7] pass" in md
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert {r["seed"] for r in rows} == {"0", "7"}
