"""experiments/tgdpo_vs_dpo at its tiny preset: runs end to end, writes well-formed outputs, and a
rerun recomputes nothing."""
import csv
import json
import math
import os
import shutil
import time

import numpy as np
import pytest

from experiments import preference_testbed
from experiments.tgdpo_vs_dpo.__main__ import main
from experiments.tgdpo_vs_dpo.presets import PRESETS, saved_experiment
from experiments.tgdpo_vs_dpo.report import CSV_FIELDS
from experiments.tgdpo_vs_dpo.stages import per_prompt_win, win_rate


def test_win_rate_counts_ties_as_half():
    assert win_rate([1.0, 0.0], [0.0]) == pytest.approx(0.75)
    assert win_rate([0.0], [0.0, 0.5]) == pytest.approx(0.25)
    assert per_prompt_win([[1.0], [-1.0]], [[0.0], [0.0]]) == [1.0, 0.0]


def test_saved_experiment_is_the_preset_dict_of_before():
    # config.json's "experiment" section holds what it held when the presets were plain dicts:
    # the testbed dict in full, lists, flat train.* keys
    exp = saved_experiment(PRESETS["tiny"])
    assert set(exp) == {"testbed", "seeds", "alphas", "guidance_seed", "beta", "eval_samples",
                        "eval_temperature", "eval_seed", "eval_batch_size", "train"}
    assert exp["testbed"] == json.loads(json.dumps(preference_testbed.TINY))
    assert exp["seeds"] == [0] and exp["alphas"] == [0.5]
    assert exp["train"] == {
        "train.steps": 10, "train.batch_size": 4, "train.lr": 1e-3, "train.warmup_steps": 1,
        "train.log_every": 2, "train.eval_every": 10, "train.checkpoint_every": 10,
        "train.async_checkpoint": False}
    default = saved_experiment(PRESETS["default"])
    assert default["testbed"] == json.loads(json.dumps(preference_testbed.DEFAULT))
    assert default["train"]["train.checkpoint_every"] == 30 and default["seeds"] == [0, 1]


@pytest.mark.xdist_group("preference_testbed_tiny")
def test_tgdpo_vs_dpo_tiny_outputs_and_rerun(tmp_path, monkeypatch, preference_testbed_tiny):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    # the tiny testbed (SFT policy + gold-scored groups) is built once per session by
    # build_testbed (tests/conftest.py); main finds the copy in its default place, complete
    shutil.copytree(preference_testbed_tiny, os.path.join(wd, "testbed"), symlinks=True)
    exp = PRESETS["tiny"]
    main([f"--workdir={wd}", "--preset=tiny"])
    assert os.path.getmtime(os.path.join(wd, "testbed", "sft_result.json")) == os.path.getmtime(
        os.path.join(preference_testbed_tiny, "sft_result.json"))  # the SFT run was not redone

    cfg = json.load(open(os.path.join(wd, "config.json")))
    runs = cfg["runs"]
    assert runs["guidance"]["config"]["loss"]["type"] == "sigmoid"
    assert runs["dpo_s0"]["config"]["loss"]["type"] == "sigmoid"
    tg = runs["tgdpo_a0.5_s0"]["config"]
    assert tg["loss"]["type"] == "tgdpo" and tg["loss"]["tgdpo_alpha"] == 0.5
    assert tg["loss"]["guidance"] == os.path.join(wd, "guidance")
    # same SFT start, data and schedule for both arms; the policy is the SFT's model
    d = runs["dpo_s0"]["config"]
    for k in ("init_from", "steps", "lr", "batch_size"):
        assert d["train"][k] == tg["train"][k], k
    assert d["data"]["path"] == tg["data"]["path"] and d["seed"] == tg["seed"] == 0
    assert runs["guidance"]["seed"] == exp["guidance_seed"]
    sft_cfg = json.load(open(os.path.join(wd, "testbed", "sft", "config.json")))
    assert d["model"] == sft_cfg["model"]
    assert cfg["pairs"]["n_train"] >= 1
    assert cfg["pairs"]["n_train"] + cfg["pairs"]["n_tied_train"] == cfg["pairs"]["n_train_groups"]
    with open(os.path.join(wd, "pairs_train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == cfg["pairs"]["n_train"]
    assert all(r["score_chosen"] > r["score_rejected"] for r in rows)

    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    by = {r["run"]: r for r in rows}
    assert set(by) == {"sft", "guidance", "dpo_s0", "tgdpo_a0.5_s0"}
    assert by["dpo_s0"]["arm"] == "DPO" and by["tgdpo_a0.5_s0"]["arm"] == "TGDPO α=0.5"
    for name, r in by.items():
        for k in ("win_vs_sft", "mean_gold", "kl"):
            assert math.isfinite(float(r[k])), (name, k)
        assert 0.0 <= float(r["win_vs_sft"]) <= 1.0
        assert -1.0 <= float(r["mean_gold"]) <= 1.0
    assert float(by["sft"]["kl"]) == pytest.approx(0.0, abs=1e-4)  # the SFT policy is the reference
    for name in ("dpo_s0", "tgdpo_a0.5_s0"):
        assert int(by[name]["steps"]) == exp.train.train.steps
        assert 0.0 <= float(by[name]["train_accuracy"]) <= 1.0
        assert math.isfinite(float(by[name]["train_loss"]))
        assert abs(float(by[name]["kl"])) > 1e-5  # training moved the policy off the reference
    assert 0.0 <= float(by["tgdpo_a0.5_s0"]["h2h_vs_dpo"]) <= 1.0
    assert by["dpo_s0"]["h2h_vs_dpo"] == ""
    # eval samples: eval_samples per held-out prompt, the same sampling seed for every policy
    res = json.load(open(os.path.join(wd, "dpo_s0", "result.json")))
    assert all(len(g["responses"]) == exp["eval_samples"] for g in res["groups"])
    assert len(res["groups"]) == preference_testbed.PRESETS[exp.testbed]["prompts"]["tgdpo_eval"]
    assert [c["step"] for c in res["curve"]][-1] == exp.train.train.steps

    md = open(os.path.join(wd, "results.md")).read()
    assert "Command: `python -m experiments.tgdpo_vs_dpo" in md and "seeds [0]" in md
    assert "| DPO | 1 |" in md and "| TGDPO α=0.5 | 1 |" in md and "## Reading" in md
    assert "paper's direction" in md and "Monte-Carlo" in md
    for name in ("win_rate_vs_kl.png", "training_curves.png"):
        with open(os.path.join(wd, name), "rb") as f:
            head = f.read()
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) > 1000, name

    # a rerun with the same settings recomputes nothing: no run retrains or resamples
    stamps = {n: os.path.getmtime(os.path.join(wd, n, "result.json"))
              for n in ("guidance", "dpo_s0", "tgdpo_a0.5_s0")}
    metrics = {n: os.path.getmtime(os.path.join(wd, n, "metrics.jsonl")) for n in stamps}
    t0 = time.time()
    results = main([f"--workdir={wd}", "--preset=tiny"])
    assert time.time() - t0 < 30
    assert {n: os.path.getmtime(os.path.join(wd, n, "result.json")) for n in stamps} == stamps
    assert {n: os.path.getmtime(os.path.join(wd, n, "metrics.jsonl")) for n in stamps} == metrics
    assert results["dpo_s0"]["kl"] == pytest.approx(float(by["dpo_s0"]["kl"]), abs=1e-4)
    assert np.isfinite(results["tgdpo_a0.5_s0"]["win_vs_sft"])


def test_tgdpo_vs_dpo_additive_tiny_end_to_end(tmp_path, monkeypatch):
    # the token-additive gold world (experiments/additive_testbed.py): its own SFT policy, a
    # guidance policy trained on prompts disjoint from the policies', alpha x beta arms, frontiers
    # and r̂ against the true token rewards
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    exp = PRESETS["additive_tiny"]
    main([f"--workdir={wd}", "--preset=additive_tiny"])

    tb = json.load(open(os.path.join(wd, "testbed", "testbed.json")))
    assert tb["gold_name"].startswith("additive_gold")
    groups = {p: json.load(open(tb["paths"][p]))["groups"]
              for p in ("tgdpo_train", "guidance_train", "tgdpo_eval")}
    prompts = {p: {g["prompt"] for g in gs} for p, gs in groups.items()}
    for p, n in exp.world.prompts.items():
        assert len(prompts[p]) == n, p
    # the three prompt sets are disjoint
    assert not prompts["tgdpo_train"] & prompts["guidance_train"]
    assert not prompts["tgdpo_eval"] & (prompts["tgdpo_train"] | prompts["guidance_train"])
    # gold = the sum of the world's letter weights (other bytes 0)
    from experiments.additive_testbed import world_of
    world = world_of(exp.world.to_dict())
    g = groups["tgdpo_eval"][0]
    np.testing.assert_allclose(g["gold"], world.gold_reward(g["responses"], unknown="zero"))

    def read_pairs(name):
        with open(os.path.join(wd, name)) as f:
            return [json.loads(line) for line in f]
    guide, train = read_pairs("pairs_guidance.jsonl"), read_pairs("pairs_train.jsonl")
    assert guide and train
    assert {r["prompt"] for r in guide} <= prompts["guidance_train"]
    assert {r["prompt"] for r in train} <= prompts["tgdpo_train"]
    cfg = json.load(open(os.path.join(wd, "config.json")))
    runs = cfg["runs"]
    assert runs["guidance"]["config"]["data"]["path"] == os.path.join(wd, "pairs_guidance.jsonl")
    assert runs["dpo_b0.1_s0"]["config"]["data"]["path"] == os.path.join(wd, "pairs_train.jsonl")
    tg = runs["tgdpo_a1_b0.1_s0"]["config"]
    assert tg["loss"]["type"] == "tgdpo" and tg["loss"]["tgdpo_alpha"] == 1.0
    assert tg["loss"]["beta"] == 0.1 and tg["loss"]["guidance"] == os.path.join(wd, "guidance")
    assert runs["dpo_b0.1_s0"]["config"]["loss"]["type"] == "sigmoid"
    assert cfg["pairs"]["guidance_prompts_in_train"] == 0

    rows = {r["run"]: r for r in csv.DictReader(open(os.path.join(wd, "results.csv")))}
    assert set(rows) == {"sft", "guidance", "dpo_b0.1_s0", "tgdpo_a1_b0.1_s0", "dpo_b0.1_n16_s0"}
    # the KL sweep: DPO again at dpo_steps, the same run otherwise
    sweep = runs["dpo_b0.1_n16_s0"]["config"]
    assert sweep["train"]["steps"] == 16 and sweep["train"]["checkpoint_every"] == 16
    assert {k: v for k, v in sweep["train"].items() if k not in ("steps", "eval_every",
                                                                   "checkpoint_every")} == {
        k: v for k, v in runs["dpo_b0.1_s0"]["config"]["train"].items()
        if k not in ("steps", "eval_every", "checkpoint_every")}
    for name, r in rows.items():
        assert 0.0 <= float(r["win_vs_sft"]) <= 1.0 and math.isfinite(float(r["kl"])), name
    assert float(rows["sft"]["kl"]) == pytest.approx(0.0, abs=1e-4)
    assert 0.0 <= float(rows["tgdpo_a1_b0.1_s0"]["h2h_vs_dpo"]) <= 1.0
    assert rows["tgdpo_a1_b0.1_s0"]["beta"] == "0.1"
    rr = json.load(open(os.path.join(wd, "reward_recovery.json")))
    assert rr["token"]["n"] > 0
    assert math.isfinite(rr["token"]["pearson"]) and math.isfinite(rr["token"]["spearman"])
    assert -1.0 <= rr["token"]["pearson"] <= 1.0
    # the token alignment: each letter's count is its count in the held-out SFT samples' bytes,
    # its w the world's, and r-hat is not identically zero (the guidance moved off the reference)
    text = "".join(r for g in groups["tgdpo_eval"] for r in g["responses"])
    assert {x["letter"]: x["count"] for x in rr["per_letter"]} == {
        c: text.count(c) for c in world.alphabet}
    assert [x["w"] for x in rr["per_letter"]] == pytest.approx(world.weights.tolist())
    assert rr["n_tokens"] == len(text.encode()) and rr["r_hat"]["max"] > rr["r_hat"]["min"]
    md = open(os.path.join(wd, "results.md")).read()
    for s in ("## Reading", "Pilot gate", "## TGDPO vs DPO at matched KL", "Spearman",
              "DISJOINT", "| TGDPO α=1 | 0.1 |", "| DPO | 0.1 | 16 |", "gold status"):
        assert s in md, s
    for name in ("win_rate_vs_kl.png", "training_curves.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name

    # a rerun recomputes nothing: no SFT, sampling, training or analysis is redone
    watched = [os.path.join(wd, "testbed", "sft_result.json"), os.path.join(wd, "sft_eval.json"),
               os.path.join(wd, "reward_recovery.json"), os.path.join(wd, "token_analysis.json")]
    watched += [tb["paths"][p] for p in groups]
    watched += [os.path.join(wd, n, f) for n in ("guidance", "dpo_b0.1_s0", "tgdpo_a1_b0.1_s0")
                for f in ("result.json", "metrics.jsonl")]
    stamps = {p: os.path.getmtime(p) for p in watched}
    results = main([f"--workdir={wd}", "--preset=additive_tiny"])
    assert {p: os.path.getmtime(p) for p in watched} == stamps
    assert results["dpo_b0.1_s0"]["kl"] == pytest.approx(float(rows["dpo_b0.1_s0"]["kl"]),
                                                         abs=1e-4)


def test_matched_kl_uses_every_dpo_cell_and_gold():
    # DPO at (KL 8, win 0.8, gold 9) and, from the step sweep, (KL 14, 0.9, 12) and a degraded
    # (KL 12, 0.5, 3) that is not on DPO's frontier; TGDPO at KL 11 is interpolated on the
    # frontier (win 0.85, gold 10.5), TGDPO at KL 16 lies beyond it
    from experiments.tgdpo_vs_dpo.report_additive import matched_kl
    c = lambda kl, win, gold: {"kl": (kl, 0.1, 3), "win_vs_sft": (win, 0.01, 3),
                               "mean_gold": (gold, 0.2, 3)}
    cells = {(0.0, 0.1, 60): c(8.0, 0.8, 9.0), (0.0, 0.1, 120): c(14.0, 0.9, 12.0),
             (0.0, 0.05, 240): c(12.0, 0.5, 3.0),
             (1.0, 0.1, 60): c(11.0, 0.9, 12.0), (1.0, 0.3, 60): c(16.0, 0.85, 13.0)}
    mk = matched_kl(cells)
    assert set(mk) == {(1.0, 0.1), (1.0, 0.3)}
    m = mk[(1.0, 0.1)]
    assert m["interpolated"] and m["dpo_win"] == pytest.approx(0.85) and m["status"] == "above"
    assert m["dpo_gold"] == pytest.approx(10.5) and m["gold_status"] == "above"
    far = mk[(1.0, 0.3)]
    assert not far["interpolated"] and far["kl_gap"] == pytest.approx(2.0)
    assert far["status"] == "dominated" and far["dpo_best_kl"] == 14.0  # DPO won 0.9 at KL 14
    assert far["gold_status"] == "unmatched" and far["dpo_best_gold"] == 12.0
