"""experiments/sparsity_law at its tiny preset: end to end, well-formed and consistent outputs, resume."""
import csv
import json
import math
import os

import pytest

from experiments.sparsity_law.__main__ import eval_steps, load_params, main
from experiments.sparsity_law.report import ACTIVATIONS, FIELDS, FIT_KEYS, mean_rows


def test_eval_steps_are_log_spaced_checkpoints():
    assert eval_steps(40, 5, 5) == [5, 10, 15, 25, 40]
    s = eval_steps(2000, 20, 10)
    assert s[0] == 20 and s[-1] == 2000 and all(x % 20 == 0 for x in s) and s == sorted(set(s))
    gaps = [b / a for a, b in zip(s, s[1:])]
    assert max(gaps) < 2.5 and len(s) >= 8  # roughly geometric, ~10 points
    with pytest.raises(ValueError, match="evaluation grain"):
        eval_steps(4, 5, 3)


def test_sparsity_law_tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    out = main([f"--workdir={wd}", "--preset=tiny"])
    cfg = json.load(open(os.path.join(wd, "config.json")))
    steps, exp = cfg["eval_steps"], cfg["exp"]
    assert cfg["preset"] == "tiny" and cfg["activations"] == list(ACTIVATIONS) and len(steps) == 5
    assert exp["protocol"] == "fixed" and exp["seeds"] == [0] and exp["control_seeds"] == [0]
    base = cfg["base_config"]
    # the trainer checkpointed the log-spaced steps (train.checkpoint_steps) and its own multiples
    every = base["train"]["checkpoint_every"]
    for a in ACTIVATIONS:
        have = sorted(int(d) for d in os.listdir(os.path.join(wd, a, "seed_0", "checkpoints")) if d.isdigit())
        assert have == sorted(set(steps) | set(range(every, steps[-1] + 1, every))), have
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert list(rows[0]) == list(FIELDS)
    assert [(r["activation"], int(r["step"]), r["protocol"]) for r in rows] == [
        (a, s, p) for a in ACTIVATIONS for s in steps for p in ("fixed", "per_checkpoint")]
    cett = {c["activation"]: c for c in csv.DictReader(open(os.path.join(wd, "cett.csv")))}
    assert set(cett) == set(ACTIVATIONS)
    for r in rows:
        ratio = float(r["activation_ratio"])
        assert int(r["tokens"]) == int(r["step"]) * base["train"]["batch_size"] * base["data"]["seq_len"]
        assert 0.0 < ratio <= 1.0 and math.isclose(float(r["sparsity"]), 1 - ratio, abs_tol=1e-9)
        assert 0.0 <= float(r["cett"]) <= 1.0
        if r["protocol"] == "per_checkpoint":
            assert float(r["ppl_ratio"]) < 1.02  # the search's target is < 1.01 (final midpoint may pass it)
        else:  # one CETT per model, on every checkpoint
            assert float(r["cett"]) == float(cett[r["activation"]]["cett_full"])
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
    for a, c in cett.items():
        # the search bounded the mean PPL ratio of the last checkpoints, as the fixed rows measure it
        last = [int(x) for x in c["search_steps"].split()]
        assert last == steps[-exp["last_checkpoints"]:]
        fixed = [float(r["ppl_ratio"]) for r in rows if r["activation"] == a and r["protocol"] == "fixed"
                 and int(r["step"]) in last]
        assert float(c["mean_ppl_ratio"]) == pytest.approx(sum(fixed) / len(fixed), rel=1e-6)
        assert float(c["search_upper"]) < 1.0 and float(c["cett_full"]) == round(float(c["cett_full"]), 4)
        assert c["cett_half_a"] != "" and c["cett_half_b"] != ""
        ppl = [float(r["dense_ppl"]) for r in rows if r["activation"] == a]
        assert ppl[-1] < 0.8 * ppl[0], (a, ppl)  # training works: the last checkpoint beats the first
    # the recorded thresholds reproduce the recorded ratio on the recorded checkpoint
    from icml_jax.analysis import sparsity as sp
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, make_eval_batches
    from icml_jax.models import build_model
    c = load_config("configs/sparsity.py:tiny")
    batches = make_eval_batches(c.data, build_tokenizer(c.data.tokenizer), split="validation",
                                seq_len=c.data.seq_len, batch_size=exp["cett_batch_size"],
                                max_batches=exp["cett_batches"])
    params = load_params(os.path.join(wd, "relu_glu", "seed_0", "checkpoints"), steps[0])
    for r in [r for r in rows if r["activation"] == "relu_glu" and int(r["step"]) == steps[0]]:
        got = sp.activation_ratio(build_model(c.model), params, [float(x) for x in r["thresholds"].split()],
                                  batches)
        assert got == pytest.approx(float(r["activation_ratio"]), abs=1e-6)
    # report, fits and plots
    md = open(os.path.join(wd, "results.md")).read()
    for s in ("Command:", "seeds [0]", "commit `", "## Gate", "## Reading", "ReLU-GLU", "SiLU-GLU", "A₀",
              "## The one CETT per model", "## Control"):
        assert s in md, s
    # main table, the CETT table, the control table
    assert md.count("| relu_glu |") == 2 * len(steps) + 1 and md.count("| swiglu |") == 2 * len(steps) + 1
    fits = json.load(open(os.path.join(wd, "fits.json")))
    assert set(ACTIVATIONS) <= set(fits) <= set(FIT_KEYS) and fits == json.loads(json.dumps(out["fits"]))
    silu = [r for r in mean_rows([r for r in out["rows"] if r["protocol"] == "fixed"]) if r["activation"] == "swiglu"]
    low = min(range(len(silu)), key=lambda i: silu[i]["activation_ratio"])
    assert ("swiglu_rising" in fits) == (0 < low <= len(silu) - 4)  # fitted from the minimum on
    if "swiglu_rising" in fits:
        assert fits["swiglu_rising"]["from_step"] == silu[low]["step"]
    for name in ("activation_ratio_vs_tokens.png", "dense_ppl_vs_tokens.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun resumes: nothing is retrained or re-evaluated, the table is the same
    run = lambda a: os.path.join(wd, a, "seed_0")  # noqa: E731
    cache = [os.path.join(run(a), f) for a in ACTIVATIONS for f in ("train.json", "cett.json")] + [
        os.path.join(run(a), "eval", f"{k}_{s:06d}.json") for a in ACTIVATIONS for s in steps
        for k in ("checks", "fixed", "search")]
    before = {p: os.path.getmtime(p) for p in cache}
    main([f"--workdir={wd}", "--preset=tiny"])
    assert {p: os.path.getmtime(p) for p in cache} == before
    assert list(csv.DictReader(open(os.path.join(wd, "results.csv")))) == rows
    # another preset in the same workdir is refused in one line
    with pytest.raises(SystemExit, match="holds results from preset 'tiny'"):
        main([f"--workdir={wd}", "--preset=default"])
