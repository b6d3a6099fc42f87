"""experiments/sparsity_law at its tiny preset: end to end, well-formed and consistent outputs, resume."""
import csv
import json
import math
import os

import pytest

from experiments.sparsity_law.__main__ import eval_steps, load_params, main
from experiments.sparsity_law.report import ACTIVATIONS, FIELDS


def test_eval_steps_are_log_spaced_checkpoints():
    assert eval_steps(40, 5, 5) == [5, 10, 15, 25, 40]
    s = eval_steps(800, 25, 9)
    assert s[0] == 25 and s[-1] == 800 and all(x % 25 == 0 for x in s) and s == sorted(set(s))
    gaps = [b / a for a, b in zip(s, s[1:])]
    assert max(gaps) < 2.5 and len(s) >= 8  # roughly geometric, ~10 points
    with pytest.raises(ValueError, match="checkpoint_every"):
        eval_steps(4, 5, 3)


def test_sparsity_law_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    out = main([f"--workdir={wd}", "--preset=tiny"])
    cfg = json.load(open(os.path.join(wd, "config.json")))
    steps = cfg["eval_steps"]
    assert cfg["preset"] == "tiny" and cfg["activations"] == list(ACTIVATIONS) and len(steps) == 5
    base = cfg["base_config"]
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert list(rows[0]) == list(FIELDS)
    assert [(r["activation"], int(r["step"])) for r in rows] == [(a, s) for a in ACTIVATIONS for s in steps]
    for r in rows:
        ratio = float(r["activation_ratio"])
        assert int(r["tokens"]) == int(r["step"]) * base["train"]["batch_size"] * base["data"]["seq_len"]
        assert 0.0 < ratio <= 1.0 and math.isclose(float(r["sparsity"]), 1 - ratio, abs_tol=1e-9)
        assert 0.0 <= float(r["cett"]) <= 1.0
        assert float(r["ppl_ratio"]) < 1.02  # the search's target is < 1.01 (final midpoint may pass it)
        assert 1.0 < float(r["dense_ppl"]) < 384.0
        th = [float(x) for x in r["thresholds"].split()]
        assert len(th) == base["model"]["num_layers"] and all(x >= 0 for x in th)
        ga = float(r["gate_active"])
        if r["activation"] == "swiglu":
            assert ga > 0.99  # silu is (almost) never exactly 0
        else:
            assert 0.0 < ga < 1.0
            if min(th) > 0:  # a kept ReLU neuron has a nonzero gate
                assert ratio <= ga + 1e-9
    for a in ACTIVATIONS:  # training works: the last checkpoint beats the first
        ppl = [float(r["dense_ppl"]) for r in rows if r["activation"] == a]
        assert ppl[-1] < 0.8 * ppl[0], (a, ppl)
    # the recorded thresholds reproduce the recorded ratio on the recorded checkpoint
    from icml_jax.analysis import sparsity as sp
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, make_eval_batches
    from icml_jax.models import build_model
    c = load_config("configs/sparsity.py:tiny")
    exp = cfg["exp"]
    batches = make_eval_batches(c.data, build_tokenizer(c.data.tokenizer), split="validation",
                                seq_len=c.data.seq_len, batch_size=exp["cett_batch_size"],
                                max_batches=exp["cett_batches"])
    r = next(r for r in rows if r["activation"] == "relu_glu" and int(r["step"]) == steps[-1])
    params = load_params(os.path.join(wd, "relu_glu", "checkpoints"), steps[-1])
    got = sp.activation_ratio(build_model(c.model), params, [float(x) for x in r["thresholds"].split()],
                              batches)
    assert got == pytest.approx(float(r["activation_ratio"]), abs=1e-6)
    # report, fits and plots
    md = open(os.path.join(wd, "results.md")).read()
    for s in ("Command:", "seed 0", "commit `", "## Reading", "ReLU-GLU", "SiLU-GLU", "A₀"):
        assert s in md, s
    assert md.count("| relu_glu |") == len(steps) and md.count("| swiglu |") == len(steps)
    fits = json.load(open(os.path.join(wd, "fits.json")))
    assert set(fits) == set(ACTIVATIONS) and set(out["fits"]) == set(ACTIVATIONS)
    for name in ("activation_ratio_vs_tokens.png", "dense_ppl_vs_tokens.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun resumes: nothing is retrained or re-evaluated, the table is the same
    cache = [os.path.join(wd, a, "train.json") for a in ACTIVATIONS] + [
        os.path.join(wd, a, "eval", f"{k}_{s:06d}.json") for a in ACTIVATIONS for s in steps
        for k in ("step", "gate")]
    before = {p: os.path.getmtime(p) for p in cache}
    main([f"--workdir={wd}", "--preset=tiny"])
    assert {p: os.path.getmtime(p) for p in cache} == before
    assert list(csv.DictReader(open(os.path.join(wd, "results.csv")))) == rows
    # another preset in the same workdir is refused in one line
    with pytest.raises(SystemExit, match="holds results from preset 'tiny'"):
        main([f"--workdir={wd}", "--preset=default"])
