"""experiments/fope_length at its tiny preset: runs end to end, writes well-formed outputs, resumes."""
import csv
import json
import os

import pytest

from experiments.fope_length.__main__ import FACTORS, METHODS, main


@pytest.mark.xdist_group("fope_tiny_run")
def test_fope_length_tiny_outputs(fope_tiny_run, session_tfds_dir, monkeypatch):
    # the run is main([--workdir, --preset=tiny]) in a session fixture (tests/conftest.py), which
    # the FoPE notebook's test reuses as well
    monkeypatch.setenv("TFDS_DATA_DIR", session_tfds_dir)
    wd = fope_tiny_run
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert cfg["methods"] == list(METHODS) and len(cfg["seeds"]) >= 2
    L = cfg["base_config"]["data"]["seq_len"]
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    ppl = [r for r in rows if r["metric"] == "perplexity"]
    assert len(ppl) == len(METHODS) * len(cfg["seeds"]) * len(FACTORS)
    assert {int(r["length"]) for r in ppl} == {f * L for f in FACTORS}
    for r in ppl:
        assert 1.0 < float(r["value"]) < 384.0, r  # finite, better than nothing absurd
    pk = [r for r in rows if r["metric"].startswith("passkey_")]
    assert pk and all(0.0 <= float(r["value"]) <= 1.0 for r in pk)
    assert {r["metric"] for r in pk} == {"passkey_teacher_forced", "passkey_greedy"}
    md = open(os.path.join(wd, "results.md")).read()
    for m in METHODS:
        assert f"| {m} | " in md
    assert "seeds [0, 1]" in md and "Command:" in md
    for name in ["perplexity_vs_length.png"] + [f"passkey_{m}.png" for m in METHODS]:
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun resumes: nothing is retrained or re-evaluated
    ev = os.path.join(wd, "rope_s0", "eval.json")
    before = os.path.getmtime(ev)
    main([f"--workdir={wd}", "--preset=tiny"])
    assert os.path.getmtime(ev) == before


def test_passkey_mix_corpus(tmp_path, monkeypatch):
    """The passkey training mix: eval-format documents within L, works all in 'train', deterministic."""
    import re

    from experiments.fope_length.__main__ import passkey_mix_corpus
    from icml_jax.analysis import length_eval
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, get_split_source
    from icml_jax.data.text_files import assign_splits
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    cfg = load_config("configs/fope.py:default")
    tok = build_tokenizer(cfg.data.tokenizer)
    L = cfg.data.seq_len
    paths = [passkey_mix_corpus(str(tmp_path / d), cfg.data, tok, L, 0.002, 0) for d in ("a", "b")]
    assert open(paths[0]).read() == open(paths[1]).read()  # deterministic in the seed
    rows = [json.loads(line) for line in open(paths[0])]
    works = [r["text"] for r in rows if r["kind"] == "shakespeare"]
    assert len(works) == len(get_split_source(cfg.data, "train"))
    splits = assign_splits([str(i) for i in range(1, len(rows) + 1)])
    assert all(splits[str(i + 1)] == "train" for i, r in enumerate(rows) if r["kind"] == "shakespeare")
    pk = [r["text"] for r in rows if r["kind"] == "passkey"]
    assert len(pk) > 10
    q = re.escape(length_eval.QUESTION)
    for text in pk:
        assert length_eval.passkey_min_length(tok) <= len(tok.encode(text)) + 1 <= L  # + bos
        key = re.search(q + r"(\d{5})$", text).group(1)
        assert length_eval.NEEDLE.format(key=key) in text
