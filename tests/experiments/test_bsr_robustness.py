"""experiments/bsr_robustness at its tiny preset: runs end to end, writes well-formed outputs, resumes."""
import csv
import json
import math
import os
import shutil
import time

import numpy as np
import pytest

from experiments import preference_testbed
from experiments.bsr_robustness.__main__ import main
from experiments.bsr_robustness.presets import presets, saved_experiment, seeds_of
from experiments.bsr_robustness.stages import NS, OOD_SPLITS, SPLITS, pair_accuracy


@pytest.mark.xdist_group("preference_testbed_tiny")
def test_bsr_robustness_tiny_outputs_and_resume(tmp_path, monkeypatch, preference_testbed_tiny):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    # the tiny testbed (SFT policy + gold-scored groups) is built once per session by
    # build_testbed (tests/conftest.py); main finds the copy in its default place, complete
    shutil.copytree(preference_testbed_tiny, os.path.join(wd, "testbed"), symlinks=True)
    out = main([f"--workdir={wd}", "--preset=tiny"])
    assert os.path.getmtime(os.path.join(wd, "testbed", "sft_result.json")) == os.path.getmtime(
        os.path.join(preference_testbed_tiny, "sft_result.json"))  # the SFT run was not redone
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert sorted(cfg["runs"]) == ["bsr_s0", "bt_s0"]
    assert cfg["runs"]["bt_s0"]["loss"]["bsr_lambda"] == 0.0
    assert cfg["runs"]["bsr_s0"]["loss"]["bsr_lambda"] == pytest.approx(1e-3)
    assert cfg["runs"]["bsr_s0"]["loss"]["bsr_scale_by_batch"] is True
    # same data, steps and optimiser for both arms: only the loss differs
    strip = lambda c: {k: v for k, v in c.items() if k != "loss"}
    assert strip(cfg["runs"]["bt_s0"]) == strip(cfg["runs"]["bsr_s0"])
    assert cfg["runs"]["bt_s0"]["train"]["init_from"].endswith(os.path.join("testbed", "sft"))
    assert cfg["pairs"]["train"] > 0 and cfg["pairs"]["val_in"] > 0
    for name in ("pairs_train.jsonl", "pairs_val_in.jsonl"):
        assert sum(1 for _ in open(os.path.join(wd, name))) == cfg["pairs"][name[6:-6]]

    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == ["run", "bsr_lambda", "seed", "metric", "value"]
    val = {(r["run"], r["metric"]): float(r["value"]) for r in rows}
    gold = {p: [g["gold"] for g in json.load(open(os.path.join(wd, "testbed", "groups",
                                                               f"{p}.json")))["groups"]]
            for p in SPLITS}
    for arm in ("bt", "bsr"):
        assert 0.0 <= val[(arm, "accuracy")] <= 1.0
        for sp in SPLITS:
            tau = val[(arm, f"tau_{sp}")]
            if math.isnan(tau):  # only when tau is undefined in every group of the split
                assert all(len(set(g)) == 1 for g in gold[sp]), (arm, sp)
            else:
                assert -1.0 <= tau <= 1.0, (arm, sp, tau)
        for m in ("reward_std", "hidden_norm_std", "hidden_norm_mean", "reward_std_all_val"):
            assert math.isfinite(val[(arm, m)]) and val[(arm, m)] >= 0, (arm, m)
        assert val[(arm, "hidden_norm_mean")] > 0
        for n in NS:
            assert math.isfinite(val[(arm, f"bon_gold_N{n}")])
            assert -1.0 <= val[(arm, f"bon_gold_N{n}")] <= 1.0  # VADER compound range
    # the oracle is an upper bound on any proxy's best-of-N pick, and N = 1 is a random pick
    for n in NS:
        assert val[("oracle", f"bon_gold_N{n}")] >= val[("bt", f"bon_gold_N{n}")] - 1e-9
    assert val[("oracle", "bon_gold_N1")] == pytest.approx(val[("random", "bon_gold_N1")])
    bon = json.load(open(os.path.join(wd, "testbed", "groups", "bon.json")))["groups"]
    assert all(len(g["gold"]) == 64 for g in bon)  # N = 64 takes the whole pool: the gold-best
    assert val[("oracle", "bon_gold_N64")] == pytest.approx(np.mean([max(g["gold"]) for g in bon]))
    assert len(out["results"][("bt", 0)]["scores"]["bon"]["reward"]) == len(bon)

    md = open(os.path.join(wd, "results.md")).read()
    assert "python -m experiments.bsr_robustness" in md and "seeds [0]" in md and "commit" in md
    assert "## Main table" in md and "## Best-of-N" in md and "## Reading" in md
    assert "| BT |" in md and "| BT+BSR (λ=1e-3, paper) |" in md
    assert md.count("\n| 64 |") == 1 and "oracle" in md
    for name in ("best_of_n.png", "kendall_tau.png", "dispersion.png"):
        with open(os.path.join(wd, name), "rb") as f:
            head = f.read()
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and len(head) > 1000, name

    # a rerun recomputes nothing: no model is trained again, the tables come out the same
    runs = sorted(os.listdir(os.path.join(wd, "runs")))
    stamps = {r: os.path.getmtime(os.path.join(wd, "runs", r, "result.json")) for r in runs}
    csv_before = open(os.path.join(wd, "results.csv")).read()
    t0 = time.time()
    main([f"--workdir={wd}", "--preset=tiny"])
    assert time.time() - t0 < 30
    assert sorted(os.listdir(os.path.join(wd, "runs"))) == runs
    assert {r: os.path.getmtime(os.path.join(wd, "runs", r, "result.json")) for r in runs} == stamps
    assert open(os.path.join(wd, "results.csv")).read() == csv_before


def test_pair_accuracy_counts_untied_pairs_and_half_ties():
    gold = [[0.5, 0.0, 0.0, -0.5], [0.1, 0.1]]
    # group 0 has 5 gold-untied pairs; the proxy gets (0,1), (0,2), (0,3) right, (1,3) tied, (2,3) wrong
    proxy = [[3.0, 1.0, -2.0, 1.0], [5.0, 0.0]]
    acc, n = pair_accuracy(proxy, gold)
    assert n == 5
    assert acc == pytest.approx((3 + 0.5) / 5)


def test_presets_compare_like_with_like():
    for name, exp in presets().items():
        assert {"bt", "bsr"} <= set(exp["arms"]), name
        assert exp["pair_rule"] in ("all", "best_worst")
    assert OOD_SPLITS == ("val_prompt_ood", "val_response_ood", "val_both_ood")


def test_saved_experiment_is_the_plain_dict_the_presets_were_saved_as():
    # config.json's "experiment" section holds what the plain-dict presets wrote before they
    # became ConfigDicts (the testbed dict in full, flat train.* keys, lists)
    tiny = {"testbed": preference_testbed.TINY, "seeds": [0], "arms": ["bt", "bsr"],
            "pair_rule": "all", "min_gap": 0.0, "bon_draws": 16,
            "train": {"train.steps": 15, "train.batch_size": 8, "train.lr": 1e-3,
                      "train.warmup_steps": 2}}
    assert saved_experiment(presets()["tiny"]) == json.loads(json.dumps(tiny))
    default = {"testbed": preference_testbed.DEFAULT, "seeds": [0, 1], "arms": ["bt", "bsr"],
               "pair_rule": "all", "min_gap": 0.0, "bon_draws": 64, "arm_seeds": {"bsr_1e-2": [0]},
               "train": {"train.steps": 150, "train.batch_size": 16, "train.lr": 3e-3,
                         "train.warmup_steps": 10,
                         # the reward read where the SFT backbone has looked (issue 17)
                         "loss.reward_position": "last_response_token"}}
    assert saved_experiment(presets()["default"]) == json.loads(json.dumps(default))
    exp = presets()["tiny"]  # --seeds empties arm_seeds
    exp.seeds, exp.arm_seeds, exp.train.train.steps = (3, 4), {}, 7
    saved = saved_experiment(exp)
    assert saved["arm_seeds"] == {} and saved["seeds"] == [3, 4]
    assert saved["train"] == {**tiny["train"], "train.steps": 7}
    assert seeds_of(presets()["default"], "bsr_1e-2") == (0,)
    assert seeds_of(presets()["default"], "bsr") == (0, 1)


def test_additive_world_preset_trains_from_scratch_above_the_gate(tmp_path):
    """The token-additive gold world (issue 17's testbed): no SFT testbed is built, the reward
    models start from scratch, both arms clear the 0.75 in-domain gate, best-of-N runs to the
    preset's own largest N, and a rerun recomputes nothing."""
    wd = str(tmp_path / "exp")
    out = main([f"--workdir={wd}", "--preset=additive_tiny"])
    assert not os.path.exists(os.path.join(wd, "testbed"))
    exp = presets()["additive_tiny"]
    for arm in ("bt", "bsr"):
        assert out["metrics"][(arm, 0)]["accuracy"] > 0.75, out["metrics"][(arm, 0)]  # gate
        assert f"bon_gold_N{exp.ns[-1]}" in out["metrics"][(arm, 0)]
    assert out["refs"]["oracle"]["n"] == list(exp.ns)
    with open(os.path.join(wd, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["experiment"]["world"]["n_bon"] == 4 and "testbed" not in cfg["experiment"]
    assert set(cfg["gold_stats"]) == {"train", "bon", *SPLITS}
    assert all(c["train"]["init_from"] == "" for c in cfg["runs"].values())
    result = os.path.join(wd, "runs", os.listdir(os.path.join(wd, "runs"))[0], "result.json")
    mtime = os.path.getmtime(result)
    assert main([f"--workdir={wd}", "--preset=additive_tiny"])["metrics"] == out["metrics"]
    assert os.path.getmtime(result) == mtime
    with open(os.path.join(wd, "results.md")) as f:
        assert "token-additive gold world" in f.read()
