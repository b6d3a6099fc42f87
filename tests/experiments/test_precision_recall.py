"""experiments/precision_recall at its tiny preset, and the pr_lm task it trains through."""
import csv
import json
import math
import os
import time

import jax
import numpy as np
import pytest

from experiments.precision_recall.__main__ import PRESETS, main
from experiments.precision_recall.report import CSV_FIELDS
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
    assert sorted(cfg["runs"]) == sorted(names)
    ft = cfg["runs"]["ft_pr_l0.1_mix0.1"]
    assert ft["loss"] == {"type": "pr_hinge", "pr_lambda": 0.1, "pr_mix_nll": 0.1}
    assert ft["train"]["init_from"].endswith("nll") and cfg["runs"]["nll"]["loss"]["type"] == "nll"
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert rows and list(rows[0]) == list(CSV_FIELDS)
    assert len(rows) == len(names) * len(exp["temperatures"])
    for r in rows:
        for k in ("precision", "recall", "alpha_0.1", "beta_0.1", "alpha_1", "alpha_10", "beta_10"):
            assert 0.0 <= float(r[k]) <= 1.0 + 1e-9, (k, r)
        assert float(r["alpha_0.1"]) <= 0.1 + 1e-9 and float(r["d_1"]) >= -1e-9
        assert math.isfinite(float(r["eval_token_nll"]))
    nll = {float(r["temperature"]): r for r in rows if r["run"] == "nll"}
    # temperature lowers the mass off the support: precision rises as T falls
    assert float(nll[0.5]["precision"]) > float(nll[1.0]["precision"]) > float(nll[2.0]["precision"])
    md = open(os.path.join(wd, "results.md")).read()
    assert "Command:" in md and "python -m experiments.precision_recall" in md and "## Reading" in md
    assert "Paper's direction" in md and "unverified" in md
    for name in ("pr_points.png", "prd_curves.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun recomputes nothing: the cached digests are reused and no run trains again
    stamps = {n: os.path.getmtime(os.path.join(wd, n, "result.json")) for n in names}
    t0 = time.time()
    main([f"--workdir={wd}", "--preset=tiny"])
    assert time.time() - t0 < 20
    assert {n: os.path.getmtime(os.path.join(wd, n, "result.json")) for n in names} == stamps
