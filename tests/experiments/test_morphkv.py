"""experiments/morphkv: the recall testbed's sequences are what they claim, and the tiny preset
trains, evaluates every policy through the cached decode and writes the outputs."""
import csv
import json
import os

import numpy as np

from icml_jax.data.tokenizers import ByteTokenizer

from experiments.morphkv.__main__ import (CLOSE, KEYS, OPEN, PRESETS, QUERY, VALUES, corpus_key, late_half, main,
                                         make_sequence, policies, topic_batch, topic_sequence, write_corpus)

POOL = "the quick brown fox jumps over the lazy dog.\n" * 400


def test_sequences_answer_from_the_block():
    rng = np.random.default_rng(0)
    for repeat, gap in ((False, (5, 12)), (True, (5, 12)), (True, (0, 0))):
        text, blen, answers = make_sequence(rng, POOL, 300, 8, gap, repeat=repeat, keys=10, values=5)
        assert len(text) == 300 and text[0] == OPEN and text[blen - 1] == CLOSE and blen == 10
        codes = [ord(ch) - ByteTokenizer.first_extra for ch in text[1:blen - 1]]  # one token per pair: key * values + value
        assert all(0 <= c < 50 for c in codes)
        table = {KEYS[c // 5]: VALUES[c % 5] for c in codes}
        assert len(table) == 8
        ids = ByteTokenizer(extra_ids=50).encode_np(text)  # every character is one token
        assert len(ids) == 300 and ids[1:blen - 1].tolist() == [259 + c for c in codes]
        keys = []
        for idx, key in answers:
            assert text[idx - 2] == QUERY and text[idx - 1] == key and text[idx] == table[key]
            keys.append(key)
        filler = "".join(ch for i, ch in enumerate(text[blen:], blen)
                         if not any(idx - 2 <= i <= idx for idx, _ in answers))
        assert not set(filler) & set(KEYS + OPEN + CLOSE + QUERY)
        if gap == (0, 0):  # queries only
            assert len(filler) <= 2 and len(keys) >= 90
        if repeat:  # queries go on past the eighth, in fresh orders
            assert len(keys) > 8 and set(keys) == set(table)
        else:  # every key at most once: the answer is only in the block
            assert len(keys) == len(set(keys)) == 8


def test_topic_sequences_define_each_pair_before_its_queries():
    exp = PRESETS["default"]
    rng = np.random.default_rng(1)
    for _ in range(5):
        text, answers = topic_sequence(rng, POOL, 255, exp)
        assert len(text) == 255 and answers and {q for _, q in answers} == {0, 1, 2}
        pairs = [(i, ord(ch) - ByteTokenizer.first_extra) for i, ch in enumerate(text)
                 if ord(ch) >= ByteTokenizer.first_extra]
        assert len({c // exp.num_values for _, c in pairs}) == len(pairs)  # distinct keys
        for idx, qi in answers:
            assert text[idx - 2] == QUERY
            i, c = max(p for p in pairs if p[0] < idx)  # the latest definition before the query
            assert text[idx - 1] == KEYS[c // exp.num_values] and text[idx] == VALUES[c % exp.num_values]
            lo, hi = exp.topic_first if qi == 0 else exp.topic_gap
            gap = idx - 2 - (i + 1) if qi == 0 else idx - 2 - (prev + 1)
            assert lo <= gap <= hi
            prev = idx
        n_queries = text.count(QUERY)  # no query is cut by the end: each one has its answer
        assert n_queries == len(answers)
    toks, P, qidx, nat = topic_batch(rng, POOL, exp, ByteTokenizer(exp.num_keys * exp.num_values))
    assert toks.shape == (exp.eval_docs, exp.seq_len) and P == exp.topic_prompt
    marker = ByteTokenizer().encode(QUERY)[0]
    assert not nat[qidx >= 0].any() and not nat[toks[:, 1:] >= 259].any() and not nat[:, :P - 1].any()
    assert not nat[toks[:, 1:] == marker].any() and not nat[:, 1:][toks[:, 1:-1] == marker].any()  # marker, key
    assert (toks[:, 1:P] < 259).all() and nat.mean() > 0.5  # the prompt is text only


def test_pair_embeddings_start_as_key_plus_value():
    from icml_jax.config_utils import load_config
    from experiments.morphkv.__main__ import initial_params, pair_symbol
    exp = PRESETS["tiny"]
    cfg = load_config("configs/lm.py:tiny", unlocked=True)
    tok = ByteTokenizer(exp.num_keys * exp.num_values)
    emb = np.asarray(initial_params(cfg, exp, tok, 0)["io"]["embedding"])
    for k in range(exp.num_keys):
        for v in range(exp.num_values):
            pid = tok.encode(pair_symbol(k, v, exp.num_values))[0]
            assert pid == 259 + k * exp.num_values + v
            np.testing.assert_array_equal(emb[pid], emb[tok.encode(KEYS[k])[0]] + emb[tok.encode(VALUES[v])[0]])


def test_morphkv_tiny_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "recall.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert len(rows) == 2 * len(policies(exp)) * len(exp.seeds)
    assert {r["testbed"] for r in rows} == {"block", "topic"}
    for r in rows:
        slots, peak = int(r["slots"]), int(r["peak_slots"])
        assert peak == (exp.seq_len if r["policy"] in ("full", "snapkv") else slots)
        assert 0 <= float(r["recall"]) <= 1 and int(r["answers"]) > 0 and float(r["tokens_per_s"]) > 0
        if r["policy"] == "full":
            assert float(r["nll_gap"]) == 0
        if r["policy"] == "snapkv":  # the prompt fits its budget: nothing is ever evicted
            assert abs(float(r["nll_gap"])) < 1e-4
    assert any(abs(float(r["nll_gap"])) > 1e-4 for r in rows if r["policy"] == "streaming")
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert len(cfg["gates"]) == 2
    for r in rows:  # a half without answers is NaN
        assert all(np.isnan(float(r[k])) or 0 <= float(r[k]) <= 1 for k in ("recall_early", "recall_late"))
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "| morphkv-max |" in md and "window ablation" in md and "## Topic testbed" in md
    assert "## As the response grows" in md and "| block: 1st half |" in md
    # the halves' reading rests on causal scoring under eviction: the first half of a sequence scores
    # the same alone as inside the whole one (every evicting policy, N < the half's length)
    from experiments.morphkv.__main__ import eval_batch, run_config, text_pool
    from icml_jax.inference.decode import scored_decode
    from icml_jax.models.kv_policies import KVPolicy
    from icml_jax.train.checkpoint import restore_model_params
    cfg = run_config(exp, "unused.jsonl", 0)
    params = restore_model_params(os.path.join(wd, "model_seed0"), cfg.model)[0]
    toks, P, _, _ = eval_batch(np.random.default_rng(5), text_pool("validation"), exp,
                               ByteTokenizer(exp.num_keys * exp.num_values))
    half = P + (toks.shape[1] - P) // 2
    assert not late_half(toks.shape[1], P)[:half - 1].any() and late_half(toks.shape[1], P)[half - 1:].all()
    N = exp.budgets[0]
    assert half > N
    for pol in (KVPolicy("morphkv", slots=N, window=exp.window, fuse="max"), KVPolicy("h2o", slots=N, window=exp.window),
                KVPolicy("streaming", slots=N, sinks=exp.sinks)):
        whole = scored_decode(cfg.model, params, toks, prompt_len=P, kv_policy=pol)
        first = scored_decode(cfg.model, params, toks[:, :half], prompt_len=P, kv_policy=pol)
        np.testing.assert_allclose(whole[:, :half - 1], first, rtol=1e-5, atol=1e-5, err_msg=pol.name)


def test_late_half_splits_the_response_targets():
    # T = 10 tokens, prompt P = 4: the response is tokens 4..9 = targets 3..8; its first half 3..5
    np.testing.assert_array_equal(late_half(10, 4), [False] * 6 + [True] * 3)
    np.testing.assert_array_equal(late_half(11, 4), [False] * 6 + [True] * 4)  # 7 tokens: 3 + 4


def test_corpus_topic_share(tmp_path):
    """``topic_train`` mixes topic sequences into the training corpus (none before a pair is
    defined inline); at 0 the corpus and its key are what the presets without it always had."""
    import copy
    exp = copy.deepcopy(PRESETS["tiny"])
    exp.update(dict(seq_len=120))
    plain = str(tmp_path / "plain.jsonl")
    write_corpus(plain, np.random.default_rng(3), POOL, 40, exp)
    rng = np.random.default_rng(3)  # the generator before topic_train existed
    want = [make_sequence(rng, POOL, 119, exp.pairs, (0, 0) if rng.uniform() < exp.pure else exp.gap, True,
                          exp.num_keys, exp.num_values)[0] for _ in range(40)]
    assert [json.loads(x)["text"] for x in open(plain)] == want
    key = corpus_key(exp)
    exp.topic_train = 0.5
    assert corpus_key(exp) != key
    mixed = str(tmp_path / "mixed.jsonl")
    write_corpus(mixed, np.random.default_rng(3), POOL, 40, exp)
    texts = [json.loads(x)["text"] for x in open(mixed)]
    topics = [t for t in texts if t[0] != OPEN]
    assert all(len(t) == 119 for t in texts) and 8 <= len(topics) <= 32
    pair_chars = {chr(ByteTokenizer.first_extra + c) for c in range(exp.num_keys * exp.num_values)}
    for t in topics:  # a topic sequence: pairs inline, each key's queries after its pair
        assert OPEN not in t and any(ch in pair_chars for ch in t)
        for i, ch in enumerate(t):
            if ch == QUERY and i + 2 < len(t):
                code = [ord(c) - ByteTokenizer.first_extra for c in t[:i] if c in pair_chars]
                assert KEYS.index(t[i + 1]) in {c // exp.num_values for c in code}
