"""experiments/rmt at its tiny preset: runs end to end (lr stage included), writes well-formed
outputs, resumes; the lr pick, the paired gaps and their standard errors on made-up results."""
import csv
import json
import math
import os

import numpy as np
import pytest

from experiments.common import run_overrides
from experiments.rmt.__main__ import main
from experiments.rmt.presets import PRESETS, as_dict
from experiments.rmt.report import (CSV_FIELDS, gap_change, paired_gap, sweep_step,
                                    tokens_to_reach)
from experiments.rmt.stages import grid_plan, pick_lrs, train_one, transformer_config


def test_rmt_tiny_outputs_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    exp = PRESETS["tiny"]
    main([f"--workdir={wd}", "--preset=tiny"])
    cfg = json.load(open(os.path.join(wd, "config.json")))
    names = ["transformer", "rmt_matched"] + [f"rmt_dk{k}" for k in exp["key_dims"]]
    assert sorted(cfg["runs"]) == sorted(names)
    runs = cfg["runs"]
    assert runs["transformer"]["config"]["model"]["residual"] == "standard"
    assert all(runs[n]["config"]["model"]["residual"] == "rmt" for n in names[1:])
    assert [runs[f"rmt_dk{k}"]["config"]["model"]["rmt"]["key_dim"] for k in exp["key_dims"]] == \
        list(exp["key_dims"])

    # the lr stage: each grid lr trained grid_steps steps; the pick is the argmin of their final
    # dev losses (read back from the grid runs' own digests) and the main runs use it
    grid_lrs = list(exp.lr_grid.transformer)
    dev = {}
    for lr in grid_lrs:
        res = json.load(open(os.path.join(wd, "lr_grid", f"transformer_lr{lr:g}_s0", "result.json")))
        assert res["curve"][-1]["step"] == exp.grid_steps
        assert res["key"]["config"]["train"]["lr"] == lr
        dev[lr] = res["final_eval_loss"]
    assert len(set(dev.values())) == len(grid_lrs)  # distinct losses: the argmin is meaningful
    best = min(dev, key=dev.get)
    assert cfg["lr_grid"] == {"transformer": {"picked": best,
                                              "dev_loss": {f"{k:g}": v for k, v in dev.items()}}}
    assert runs["transformer"]["config"]["train"]["lr"] == best == cfg["exp"]["lr"]["transformer"]
    assert runs["rmt_matched"]["config"]["train"]["lr"] == exp.lr.rmt_matched  # not tuned: fixed
    assert all(runs[f"rmt_dk{k}"]["config"]["train"]["lr"] == exp.lr.rmt_spec
               for k in exp["key_dims"])

    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    by_run = {}
    for r in rows:
        by_run.setdefault(r["run"], []).append(r)
    assert sorted(by_run) == sorted(names)
    t = run_overrides(exp.train)
    t_steps = t["train.steps"]
    per_step = t["train.batch_size"] * t["data.seq_len"]
    n_evals = t["train.steps"] // t["train.eval_every"]
    V = runs["transformer"]["config"]["model"]["vocab_size"]
    for name, rs in by_run.items():
        assert len(rs) == n_evals, name
        # tokens are the trainer's counted target tokens: at most batch x seq per step, same for all
        for r in rs:
            assert 0.9 * int(r["step"]) * per_step <= int(r["tokens"]) <= int(r["step"]) * per_step
            assert math.isclose(float(r["train_flops"]), int(r["tokens"]) * float(r["flops_per_token"]),
                                rel_tol=1e-6)
            assert float(r["step_ms"]) > 0
        losses = [float(r["eval_loss"]) for r in rs]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0] < math.log(V) + 0.5, (name, losses)  # it learns
        assert losses[-1] < math.log(V) - 0.5, (name, losses)
    tokens = {n: by_run[n][-1]["tokens"] for n in names}
    assert len(set(tokens.values())) == 1, tokens  # equal tokens for every model
    params = {n: int(by_run[n][0]["params"]) for n in names}
    assert abs(params["rmt_matched"] / params["transformer"] - 1) < 0.03, params
    assert params[f"rmt_dk{exp['main_key_dim']}"] < params["transformer"]
    fpt = [float(by_run[f"rmt_dk{k}"][0]["flops_per_token"]) for k in exp["key_dims"]]
    assert fpt[0] < fpt[-1] < 1.5 * fpt[0]  # Dk grows the residual, not the FLOPs, much

    md = open(os.path.join(wd, "results.md")).read()
    for n in names:
        assert f"| {n} |" in md or f"| {runs[n]['config']['model']['rmt']['key_dim']} |" in md
    assert "Command:" in md and "seeds [0]" in md and "## Reading" in md
    assert f"| transformer | {best:g} | {dev[best]:.4f} | **picked** |" in md
    assert md.count("**picked**") == 1
    assert "python -m experiments.rmt" in md
    for name in ("loss_vs_tokens.png", "loss_vs_flops.png", "gap_vs_tokens.png",
                 "dev_loss_vs_residual.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    for n in names:
        s0 = os.path.join(wd, f"{n}_s0")
        assert os.path.exists(os.path.join(s0, "metrics.jsonl"))
        assert os.path.exists(os.path.join(s0, "result.json"))

    # a rerun resumes: no run is retrained, the tables are rebuilt from the cached results
    stamps = {n: os.path.getmtime(os.path.join(wd, f"{n}_s0", "metrics.jsonl")) for n in names}
    results = main([f"--workdir={wd}", "--preset=tiny"])
    assert {n: os.path.getmtime(os.path.join(wd, f"{n}_s0", "metrics.jsonl")) for n in names} == stamps
    assert results[("transformer", 0)]["final_eval_loss"] == pytest.approx(
        float(by_run["transformer"][-1]["eval_loss"]), abs=1e-5)
    # a changed cache key (e.g. a new base-config key) makes the trainer resume from the final
    # checkpoint: it only re-evaluates, and the measured training time is kept
    first = results[("transformer", 0)]
    cfg = transformer_config(exp, best)
    again = train_one(cfg, os.path.join(wd, "transformer_s0"))
    assert again["wall_seconds"] == pytest.approx(first["wall_seconds"])
    assert again["final_eval_loss"] == pytest.approx(first["final_eval_loss"], abs=1e-5)
    timing = [json.loads(x) for x in open(os.path.join(wd, "transformer_s0", "timing.jsonl"))]
    assert [(t["start_step"], t["end_step"]) for t in timing] == [(0, t_steps), (t_steps, t_steps)]


def test_tokens_to_reach_interpolates():
    curve = lambda losses: [{"tokens": 100.0 * (i + 1), "flops": 1e3 * (i + 1), "eval_loss": x}
                            for i, x in enumerate(losses)]
    res = {("a", 0): {"curve": curve([3.0, 2.0, 1.0])}, ("a", 1): {"curve": curve([3.0, 2.0, 1.0])}}
    assert tokens_to_reach(res, "a", 1.5) == pytest.approx((250.0, 2500.0))
    assert tokens_to_reach(res, "a", 0.5) is None


def test_bad_arguments_stop_with_a_message(tmp_path):
    with pytest.raises(SystemExit, match="--seeds"):
        main([f"--workdir={tmp_path}", "--preset=tiny", "--seeds=a,b"])
    for bad, msg in (("rmt=1e-2", "unknown shape"), ("transformer=x", "not a number"),
                     ("transformer=0", "positive")):
        with pytest.raises(SystemExit, match=msg):
            main([f"--workdir={tmp_path}", "--preset=tiny", f"--lr={bad}"])


def _curves(losses_by_seed):
    return {seed: [{"step": 10 * (i + 1), "tokens": 100.0 * (i + 1), "flops": 0.0, "eval_loss": x}
                   for i, x in enumerate(losses)] for seed, losses in losses_by_seed.items()}


def test_paired_gaps_and_their_standard_errors():
    """Gaps are per seed (a seed's offset shared by both runs cancels), then mean ± s.e. (sample
    std / sqrt n) over the seeds; the change is from the halfway eval point to the last."""
    offset = {0: 0.0, 1: 0.5, 2: -0.3}  # seed noise common to both runs of a seed
    gap = {0: [0.3, 0.2, 0.1], 1: [0.5, 0.2, 0.3], 2: [0.4, 0.2, 0.2]}
    b = _curves({sd: [3.0 + offset[sd], 2.0 + offset[sd], 1.0 + offset[sd]] for sd in offset})
    a = _curves({sd: [x + g for x, g in zip([3.0, 2.0, 1.0], gap[sd])] for sd in offset})
    a = {sd: [dict(p, eval_loss=p["eval_loss"] + offset[sd]) for p in c] for sd, c in a.items()}
    res = {**{("a", sd): {"curve": c} for sd, c in a.items()},
           **{("b", sd): {"curve": c} for sd, c in b.items()}}
    tokens, gaps = paired_gap(res, "a", "b", [0, 1, 2])
    assert tokens == [100.0, 200.0, 300.0]
    for i, (m, se, n) in enumerate(gaps):
        col = [gap[sd][i] for sd in (0, 1, 2)]
        mean = sum(col) / 3
        assert n == 3 and m == pytest.approx(mean)
        assert se == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in col) / 2 / 3))
    assert gaps[1][1] == pytest.approx(0.0, abs=1e-12)  # the seed offsets cancel
    (m, se, n), t_half, t_end = gap_change(res, "a", "b", [0, 1, 2])
    ch = [gap[sd][2] - gap[sd][1] for sd in (0, 1, 2)]
    assert (t_half, t_end, n) == (200.0, 300.0, 3) and m == pytest.approx(sum(ch) / 3)
    assert se == pytest.approx(float(np.std(ch, ddof=1) / math.sqrt(3)))
    # the Dk sweep's step: the same pairing on final dev losses
    sweep = {("rmt_dk4", sd): {"final_eval_loss": 2.0 + offset[sd]} for sd in offset}
    sweep.update({("rmt_dk8", sd): {"final_eval_loss": 1.9 + offset[sd] + 0.01 * sd} for sd in offset})
    m, se, n = sweep_step(sweep, {"sweep_seeds": (0, 1, 2)}, 4, 8)
    assert m == pytest.approx(-0.09) and se == pytest.approx(0.01 / math.sqrt(3))


def test_lr_stage_picks_the_argmin_and_skips_fixed_shapes():
    exp = PRESETS["default"]
    runs = grid_plan(exp)
    shapes = {shape for _, shape, _, _, _ in runs}
    assert shapes == {"transformer", "rmt_matched", "rmt_spec"}
    for name, shape, group, cfg, seeds in runs:
        assert group == "grid" and seeds == (exp.grid_seed,)
        assert cfg.train.steps == exp.grid_steps and cfg.train.lr in exp.lr_grid[shape]
    ffn = {shape: cfg.model.ffn_dim for _, shape, _, cfg, _ in runs}
    assert ffn["rmt_matched"] > ffn["rmt_spec"] == 512
    assert {shape for _, shape, _, _, _ in grid_plan(exp, fixed={"transformer"})} == \
        {"rmt_matched", "rmt_spec"}
    losses = {"transformer": [2.9, 2.7, 2.8], "rmt_matched": [3.1, 3.0, 2.95],
              "rmt_spec": [2.6, 2.8, 3.2]}
    fake, seen = {}, {}
    for name, shape, _, cfg, seeds in runs:
        i = seen[shape] = seen.get(shape, -1) + 1
        fake[(name, seeds[0])] = {"final_eval_loss": losses[shape][i]}
    picked = pick_lrs(runs, fake)
    for shape, grid in exp.lr_grid.items():
        best = min(range(3), key=lambda i: losses[shape][i])
        assert picked[shape] == (grid[best], dict(zip(grid, losses[shape])))


def test_presets_are_saved_as_the_former_flat_dicts():
    """config.json's "exp" section keeps the content (flat run-config keys) the presets had as
    plain dicts."""
    saved = as_dict(PRESETS["tiny"])
    assert saved == json.loads(
        '{"seeds": [0], "sweep_seeds": [0], "key_dims": [2, 8], "main_key_dim": 8, '
        '"transformer": {"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, '
        '"model.num_kv_heads": 2, "model.head_dim": 16, "model.ffn_dim": 64, '
        '"model.mlp.activation": "gelu_tanh", "model.tie_embeddings": false, '
        '"model.position": "alibi", "model.max_seq_len": 128}, '
        '"rmt": {"model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 2, '
        '"model.head_dim": 16, "model.ffn_dim": 64, "model.max_seq_len": 128}, '
        '"lr": {"transformer": 0.01, "rmt_matched": 0.01, "rmt_spec": 0.01}, '
        '"lr_grid": {"transformer": [0.003, 0.01]}, "grid_steps": 8, "grid_seed": 0, '
        '"train": {"data.seq_len": 128, "train.steps": 24, "train.batch_size": 4, '
        '"train.warmup_steps": 3, "train.log_every": 4, "train.eval_every": 8, '
        '"train.eval_batches": 2, "train.checkpoint_every": 12}}')
    assert set(as_dict(PRESETS["default"])) == set(saved)
    assert as_dict(PRESETS["default"])["rmt"] == {}
