"""experiments/precision_recall at its tiny preset, and the pr_lm task it trains through."""
import csv
import json
import math
import os
import time

import jax
import numpy as np
import pytest

from experiments.precision_recall.__main__ import PRESETS, build_source, head_mask, main
from experiments.precision_recall.report import CSV_FIELDS, gains, gate, reading
from icml_jax.config_utils import load_config
from icml_jax.tasks import TASKS
from icml_jax.analysis.sequence_logprobs import encode_strings, sequence_logprobs


def _task(**loss):
    c = load_config("configs/precision_recall.py:tiny", unlocked=True)
    c.loss.update(loss)
    return TASKS.get("pr_lm")(c)


@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_pr_lm_rejects_bad_lambda(bad):
    with pytest.raises(ValueError, match="config.loss.pr_lambda"):
        _task(type="pr_hinge", pr_lambda=bad)
    with pytest.raises(ValueError, match="config.loss.type"):
        _task(type="hinge")


def test_sequence_logprobs_are_exact_with_temperature():
    task = _task(type="pr_hinge", pr_lambda=0.5)
    strings = ["ab", "cd"]  # one length: one compilation of the reference apply
    toks, lengths = encode_strings(task.tokenizer, strings)
    params = jax.jit(task.init_params)(jax.random.key(0), task.dummy_batch(1, 8))  # eager init is slow
    params = jax.tree.map(lambda x: x * 20.0, params)  # peaked logits: T matters
    got = sequence_logprobs(task.model, params, task.tokenizer, strings, (0.5, 1.0))
    apply = jax.jit(task.model.apply)
    for i, (row, n) in enumerate(zip(toks, lengths)):
        x = row[None, :n]
        logits = np.asarray(apply({"params": params}, x, np.arange(n)[None],
                                             np.ones_like(x)), np.float64)[0]
        for j, t in enumerate((0.5, 1.0)):
            z = logits / t
            logp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
            want = logp[np.arange(n), row[1:n + 1]].sum()
            assert got[j, i] == pytest.approx(want, abs=1e-3)
    assert row[n] == task.tokenizer.eos_id  # the eos is scored
    assert not np.allclose(got[0], got[1])


def test_tiny_experiment_outputs_and_rerun(tmp_path):
    wd = str(tmp_path / "exp")
    exp = PRESETS["tiny"]
    main([f"--workdir={wd}", "--preset=tiny"])
    cfg = json.load(open(os.path.join(wd, "config.json")))
    names = [r["name"] for r in exp["runs"]]
    seeds = list(exp["seeds"])
    assert len(seeds) >= 2 and cfg["source"]["kind"] == "zipf"
    assert sorted(cfg["runs"]) == sorted(f"seed{s}/{n}" for s in seeds for n in names)
    for s in seeds:
        ft = cfg["runs"][f"seed{s}/ft_pr_l0.1_mix0.1"]
        assert ft["loss"] == {"type": "pr_hinge", "pr_lambda": 0.1, "pr_mix_nll": 0.1}
        assert ft["seed"] == s and ft["train"]["init_from"].endswith(f"seed{s}/nll")
        assert cfg["runs"][f"seed{s}/nll"]["loss"]["type"] == "nll"
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    assert len(rows) == len(seeds) * len(names) * len(exp["temperatures"])
    assert {int(r["seed"]) for r in rows} == set(seeds)
    # head / tail recall split the recall by P's mass: recall = P(head) h + P(tail) t
    _, p = build_source(exp).enumerate_support()
    p_head = p[head_mask(p)].sum()
    assert 0 < p_head < 1 and head_mask(p).sum() < len(p) / 4  # a Zipf head: few strings
    for r in rows:
        for k in ("precision", "recall", "head_recall", "tail_recall", "alpha_0.1", "beta_0.1",
                  "alpha_1", "alpha_10", "beta_10", "q_head", "q_tail", "off_support"):
            assert 0.0 <= float(r[k]) <= 1.0 + 1e-9, (k, r)
        assert float(r["alpha_0.1"]) <= 0.1 + 1e-9 and float(r["d_1"]) >= -1e-9
        assert math.isfinite(float(r["eval_token_nll"]))
        assert float(r["recall"]) == pytest.approx(
            p_head * float(r["head_recall"]) + (1 - p_head) * float(r["tail_recall"]), abs=1e-5)
        assert float(r["q_head"]) + float(r["q_tail"]) + float(r["off_support"]) == pytest.approx(1, abs=1e-5)
        assert float(r["precision"]) == pytest.approx(float(r["q_head"]) + float(r["q_tail"]), abs=1e-5)
        if r["run"] == "nll":
            assert r["recall_gain"] == ""
        elif r["recall_gain"] != "":
            assert float(r["recall_gain"]) == pytest.approx(
                float(r["recall"]) - float(r["nll_t_recall_at_precision"]), abs=1e-5)
    for s in seeds:
        nll = {float(r["temperature"]): r for r in rows if r["run"] == "nll" and int(r["seed"]) == s}
        # temperature lowers the mass off the support: precision rises as T falls
        assert float(nll[0.5]["precision"]) > float(nll[1.0]["precision"]) > float(nll[2.0]["precision"])
    md = open(os.path.join(wd, "results.md")).read()
    assert "Command:" in md and "python -m experiments.precision_recall" in md and "## Reading" in md
    assert "Paper's direction" in md and "unverified" in md and "random strings" in md
    gates = gate(exp, {s: {"nll": json.load(open(os.path.join(wd, f"seed{s}", "nll", "result.json")))}
                       for s in seeds})
    for s, (ok, prec, head) in gates.items():
        assert f"seed {s} {'passes' if ok else 'FAILS'} (precision {prec:.3f}" in md
    assert ("The gate fails" in md) == (not all(ok for ok, _, _ in gates.values()))
    for name in ("pr_points.png", "prd_curves.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun recomputes nothing: the cached digests are reused and no run trains again
    stamps = {(s, n): os.path.getmtime(os.path.join(wd, f"seed{s}", n, "result.json"))
              for s in seeds for n in names}
    t0 = time.time()
    main([f"--workdir={wd}", "--preset=tiny"])
    assert time.time() - t0 < 20
    assert {(s, n): os.path.getmtime(os.path.join(wd, f"seed{s}", n, "result.json"))
            for s in seeds for n in names} == stamps


def _fake_run(points, name_frontier=False):
    """A run's digest from [(T, precision, recall)] (the other metrics derived or fixed)."""
    ms = [{"temperature": t, "precision": p, "recall": r, "head_recall": 1.0, "tail_recall": r,
           "off_support": 1 - p, "q_tail": p / 2, "q_head": p / 2} for t, p, r in points]
    out = {"by_temperature": ms, "params": 1000, "eval_token_nll": 1.0, "eval_saturated": 0.0,
           "steps": 1, "train_seconds": 1.0}
    if name_frontier:
        out["frontier"] = [{k: m[k] for k in ("temperature", "precision", "recall", "tail_recall")}
                           for m in ms]
    return out


def test_reading_verdict_follows_the_seeds():
    """The matched-precision comparison, gate and verdict on made-up digests: an NLL model whose
    recall falls as T rises above 1, and a PR run above (or on) its frontier on every seed."""
    exp = {"temperatures": (0.5, 1.0, 2.0), "gate": {"precision": 0.5, "head_recall": 0.9},
           "runs": [{"name": "nll", "type": "nll"},
                    {"name": "pr", "type": "pr_hinge", "pr_lambda": 0.1, "pr_mix_nll": 0.1},
                    {"name": "ctl", "type": "nll", "init": "nll"}]}
    nll = [(0.5, 0.99, 0.5), (1.0, 0.9, 0.6), (2.0, 0.5, 0.55)]

    def results(offsets):
        # the NLL control (more NLL steps) beats the frontier but is no PR-loss win
        return {s: {"nll": _fake_run(nll, True),
                    "pr": _fake_run([(t, p, r + d) for t, p, r in nll]),
                    "ctl": _fake_run([(t, p, r + 0.1) for t, p, r in nll], True)}
                for s, d in enumerate(offsets)}
    above = results([0.05, 0.06, 0.07])
    g = gains(exp, above, exp["runs"][1])
    assert g[1.0][0] == pytest.approx(0.06) and g[1.0][1] == pytest.approx(0.01 / math.sqrt(3))
    assert g[1.0][2] == 3
    text = "\n".join(reading(exp, above))
    assert "it shows: temperature fails to raise recall, and `pr` reach" in text
    assert "`ctl`: at T=1" in text and "a control: more NLL training" in text
    assert "`pr` reach" in text and "`ctl` reach" not in text
    # compared with the control's frontier (0.1 more recall everywhere), `pr` gains nothing
    exp["runs"][1]["reference"] = "ctl"
    assert gains(exp, above, exp["runs"][1])[1.0][0] == pytest.approx(-0.04)
    assert "shows only in part" in "\n".join(reading(exp, above))
    del exp["runs"][1]["reference"]
    assert "seed 2 passes" in text and "The gate fails" not in text
    # on the frontier (within noise): no claim
    on = results([0.01, -0.01, 0.0])
    assert "shows only in part" in "\n".join(reading(exp, on))
    # a seed whose NLL model misses the head: the gate says so and the verdict is withheld
    on[1]["nll"]["by_temperature"][1]["head_recall"] = 0.5
    text = "\n".join(reading(exp, on))
    assert "seed 1 FAILS" in text and "The gate fails for seed(s) 1" in text and "cannot say" in text
    assert gate(exp, on) == {0: (True, 0.9, 1.0), 1: (False, 0.9, 0.5), 2: (True, 0.9, 1.0)}


def test_sources_are_selectable():
    from icml_jax.data.markov_source import MarkovMixture
    from icml_jax.data.zipf_source import ZipfStrings
    assert isinstance(build_source(PRESETS["default"]), ZipfStrings)
    assert isinstance(build_source(PRESETS["markov"]), MarkovMixture)
    bad = PRESETS["tiny"].copy_and_resolve_references()
    bad.source.kind = "uniform"
    with pytest.raises(ValueError, match="source.kind"):
        build_source(bad)
