"""experiments/fope_length at its tiny preset: runs end to end, writes well-formed outputs, resumes."""
import csv
import json
import os

import pytest

from experiments.fope_length.__main__ import FACTORS, METHODS as ALL_METHODS, PRESETS, main, method_config

METHODS = tuple(PRESETS["tiny"].methods)


@pytest.mark.xdist_group("fope_tiny_run")
def test_fope_length_tiny_outputs(fope_tiny_run, session_tfds_dir, monkeypatch):
    # the run is main([--workdir, --preset=tiny]) in a session fixture (tests/conftest.py), which
    # the FoPE notebook's test reuses as well
    monkeypatch.setenv("TFDS_DATA_DIR", session_tfds_dir)
    wd = fope_tiny_run
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert cfg["methods"] == list(METHODS) and len(cfg["seeds"]) >= 2
    # each run trained the config method_config gives it
    for m in METHODS:
        for s in cfg["seeds"]:
            key = json.load(open(os.path.join(wd, f"{m}_s{s}", "eval.json")))["key"]["config"]
            want = json.loads(method_config("tiny", m, s, cfg["base_config"]["train"]["steps"])
                              .to_json_best_effort())
            assert key["model"] == want["model"] and key["seed"] == s
    L = cfg["base_config"]["data"]["seq_len"]
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    ppl = [r for r in rows if r["metric"] == "perplexity"]
    assert len(ppl) == len(METHODS) * len(cfg["seeds"]) * len(FACTORS)
    assert {int(r["length"]) for r in ppl} == {f * L for f in FACTORS}
    for r in ppl:
        assert 1.0 < float(r["value"]) < 384.0, r  # finite, better than nothing absurd
    pk = [r for r in rows if r["metric"].startswith("passkey_")]
    assert pk and all(0.0 <= float(r["value"]) <= 1.0 for r in pk)
    assert {r["metric"] for r in pk} == {"passkey_teacher_forced", "passkey_greedy", "passkey_exact"}
    assert {int(r["length"]) for r in pk} == {f * L for f in PRESETS["tiny"].passkey_factors}
    md = open(os.path.join(wd, "results.md")).read()
    for m in METHODS:
        assert f"| {m} | " in md
    assert "seeds [0, 1]" in md and "Command:" in md and "## Gate" in md
    for name in ["perplexity_vs_length.png", "retrieval_vs_length.png"] + \
            [f"passkey_{m}.png" for m in METHODS]:
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    # a rerun resumes: nothing is retrained or re-evaluated
    ev = os.path.join(wd, "rope_s0", "eval.json")
    before = os.path.getmtime(ev)
    main([f"--workdir={wd}", "--preset=tiny"])
    assert os.path.getmtime(ev) == before


def test_control_arms_differ_from_their_bases_only_in_their_flag():
    """rope_clip is RoPE with floor clipping and fope_pad0 is FoPE with pad_sin_value 0: every
    other setting of the two configs is the same (the default preset runs all four arms)."""
    assert set(PRESETS["default"].methods) == {"rope", "rope_clip", "fope", "fope_pad0"}
    cfgs = {m: json.loads(method_config("default", m, 1, 600).to_json_best_effort())
            for m in ALL_METHODS}
    clip = json.loads(json.dumps(cfgs["rope"]))
    clip["model"]["rope_floor_clip"] = True
    assert cfgs["rope_clip"] == clip and cfgs["rope"]["model"]["rope_floor_clip"] is False
    pad0 = json.loads(json.dumps(cfgs["fope"]))
    pad0["model"]["fope"]["pad_sin_value"] = 0.0
    assert cfgs["fope_pad0"] == pad0 and cfgs["fope"]["model"]["fope"]["pad_sin_value"] != 0.0
    assert {m: c["model"]["position"] for m, c in cfgs.items()} == {
        "rope": "rope", "rope_clip": "rope", "fope": "fope", "fope_pad0": "fope", "alibi": "alibi",
        "nope": "nope"}
    assert all(c["seed"] == 1 and c["train"]["steps"] == 600 for c in cfgs.values())


def test_passkey_mix_corpus(tmp_path, monkeypatch):
    """The retrieval training mix: eval-format documents within L, works all in 'train', deterministic."""
    from experiments.fope_length.__main__ import passkey_mix_corpus
    from icml_jax.analysis import length_eval
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, get_split_source
    from icml_jax.data.text_files import assign_splits
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    cfg = load_config("configs/fope.py:default")
    tok = build_tokenizer(cfg.data.tokenizer)
    L = cfg.data.seq_len
    paths = [passkey_mix_corpus(str(tmp_path / d), cfg.data, tok, L, 0.5, 0, 200) for d in ("a", "b")]
    assert open(paths[0]).read() == open(paths[1]).read()  # deterministic in the seed
    rows = [json.loads(line) for line in open(paths[0])]
    src = get_split_source(cfg.data, "train")
    train_text = "\0".join(src[i]["text"] for i in range(len(src)))
    works = [r["text"] for r in rows if r["kind"] == "shakespeare"]
    assert works and all(w in train_text for w in works)  # passages of the train split
    assert not any(length_eval.CUE in w for w in works)  # the cue is distinct from the text
    splits = assign_splits([str(i) for i in range(1, len(rows) + 1)])
    assert all(splits[str(i + 1)] == "train" for i, r in enumerate(rows) if r["kind"] == "shakespeare")
    pk = [r["text"] for r in rows if r["kind"] == "passkey"]
    assert len(pk) == 200
    n_pk, n_text = (sum(len(tok.encode(t)) + 2 for t in texts) for texts in (pk, works))
    assert n_pk <= n_text < n_pk + max(len(tok.encode(w)) + 2 for w in works)  # fraction 0.5
    n = length_eval.KEY_DIGITS
    for text in pk:
        assert length_eval.passkey_min_length(tok) <= len(tok.encode(text)) + 1 <= L  # + bos
        # exactly two cues: the needle's and the query at the end; digits only in the two keys
        assert text.count(length_eval.CUE) == 2 and text[-n - 1] == length_eval.CUE
        key = text[-n:]
        assert key.isdigit() and length_eval.NEEDLE.format(key=key) in text
        assert sum(c.isdigit() for c in text) == 2 * n
    # repeated queries: every cue is followed by the same key, the document still fits in L
    rep = passkey_mix_corpus(str(tmp_path / "r"), cfg.data, tok, L, 0.5, 0, 200, repeat_prob=0.9)
    pk = [json.loads(line)["text"] for line in open(rep)]
    pk = [t for t in pk if length_eval.CUE + t[-n:] in t and t[-n - 1] == length_eval.CUE]
    assert len(pk) == 200 and max(t.count(length_eval.CUE) for t in pk) > 2
    for text in pk:
        assert len(tok.encode(text)) + 1 <= L  # + bos
        assert text.count(length_eval.CUE) == text.count(length_eval.CUE + text[-n:])


def test_passkey_example_format():
    """``[bos] filler ^KEY filler ^`` + KEY, exactly ``length`` tokens, the needle at ``depth``."""
    import numpy as np

    from icml_jax.analysis import length_eval
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer
    tok = build_tokenizer(load_config("configs/fope.py:tiny").data.tokenizer)
    stream = np.asarray([tok.bos_id] + tok.encode("ab^c1d2 e" * 20) + [tok.eos_id], np.int32)
    filler = length_eval.passkey_filler(tok, stream)
    assert tok.decode(filler.tolist()) == "abcd e" * 20
    cue = tok.encode(length_eval.CUE)
    for depth in (0.0, 0.5, 1.0):
        prompt, answer, key = length_eval.passkey_example(tok, stream, 40, depth,
                                                          np.random.RandomState(0))
        assert len(prompt) + len(answer) == 40 and prompt[0] == tok.bos_id
        assert tok.decode(answer) == key and len(key) == length_eval.KEY_DIGITS
        assert prompt[-len(cue):] == cue
        body = tok.decode(prompt[1:])
        assert body.count(length_eval.CUE) == 2 and sum(c.isdigit() for c in body) == len(key)
        n_fill = 40 - length_eval.passkey_min_length(tok)
        assert body.index(length_eval.CUE + key) == round(depth * n_fill)
