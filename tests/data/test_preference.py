"""Preference data: TRL-format JSONL reading (and its errors), pair encoding, grain batching."""
import collections
import json
import os

import grain
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from icml_jax.data import preference as pref
from icml_jax.data.tokenizers import build_tokenizer

TOK = build_tokenizer(ml_collections.ConfigDict(dict(type="byte", model_path="")))


def _ids(text):
    return [b + 3 for b in text.encode("utf-8")]  # the byte tokenizer's encoding


def _write(tmp_path, lines, name="prefs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(l + "\n" for l in lines), encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------------ reading


def test_read_explicit_and_implicit_rows_keep_scalar_fields(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5", "score_chosen": 9,
                    "score_rejected": 1.5, "source": "math", "tags": ["a"]}),
        "",
        "   ",
        json.dumps({"chosen": "The sky is blue.", "rejected": "The sky is green.", "id": 7}),
    ])
    rows = pref.read_preference_jsonl(path)
    assert rows == [
        {"prompt": "Q: 2+2?", "chosen": " 4", "rejected": " 5", "score_chosen": 9,
         "score_rejected": 1.5, "source": "math"},  # the non-scalar 'tags' is dropped
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "id": 7},
    ]


@pytest.mark.parametrize("chosen,rejected,expected", [
    ("The sky is blue.", "The sky is green.", ("The sky is", " blue.", " green.")),
    ("The sky is blue", "The sky is black", ("The sky is", " blue", " black")),  # not "bl"+"ue"
    ("The sky is blue", "The sky isn't", ("The sky", " is blue", " isn't")),
    ("Q:\nyes", "Q:\nno", ("Q:", "\nyes", "\nno")),
    ("Answer: A", "Answer: A, because", ("Answer:", " A", " A, because")),  # prefix of the other
    ("yes", "no", ("", "yes", "no")),
])
def test_implicit_prompt_is_cut_back_to_whitespace(chosen, rejected, expected):
    assert pref.extract_implicit_prompt(chosen, rejected) == expected
    prompt, c, r = expected
    assert prompt + c == chosen and prompt + r == rejected


GOOD = json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"})


@pytest.mark.parametrize("bad,match", [
    ('{"prompt": "p", "chosen": "a",', r"prefs\.jsonl:4: not valid JSON"),
    ('["p", "a", "b"]', r"prefs\.jsonl:4: expected a JSON object .* got a list"),
    ('{"prompt": "p", "rejected": "b"}', r"prefs\.jsonl:4: missing field 'chosen'"),
    ('{"prompt": "p", "chosen": "a"}', r"prefs\.jsonl:4: missing field 'rejected'"),
    ('{"prompt": "p", "completion": "a", "label": true}',
     r"prefs\.jsonl:4: missing field 'chosen'.*unpaired format"),
    ('{"prompt": 3, "chosen": "a", "rejected": "b"}',
     r"prefs\.jsonl:4: field 'prompt' must be a string, got int"),
    ('{"chosen": "a", "rejected": null}', r"prefs\.jsonl:4: field 'rejected' must be a string"),
    ('{"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"}',
     r"prefs\.jsonl:4: field 'prompt' is conversational.*chat template.*Render"),
    ('{"chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}',
     r"prefs\.jsonl:4: field 'chosen' is conversational"),
    ('{"prompt": "p", "chosen": "same", "rejected": "same"}',
     r"prefs\.jsonl:4: fields 'chosen' and 'rejected' are identical"),
    ('{"prompt": "p", "chosen": "", "rejected": "b"}',
     r"prefs\.jsonl:4: field 'chosen' is an empty response"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "score_chosen": "high"}',
     r"prefs\.jsonl:4: field 'score_chosen' must be a finite number"),
])
def test_bad_rows_name_file_line_and_field(tmp_path, bad, match):
    path = _write(tmp_path, [GOOD, "", GOOD, bad, GOOD])  # blank lines count towards line numbers
    with pytest.raises(pref.PreferenceDataError, match=match):
        pref.read_preference_jsonl(path)


def test_bad_utf8_names_the_line(tmp_path):
    path = tmp_path / "prefs.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"chosen": "\xff", "rejected": "b"}\n')
    with pytest.raises(pref.PreferenceDataError, match=r"prefs\.jsonl:2: not valid UTF-8"):
        pref.read_preference_jsonl(str(path))


@pytest.mark.parametrize("lines", [[], ["", "  "]])
def test_empty_file_is_refused(tmp_path, lines):
    with pytest.raises(pref.PreferenceDataError, match=r"prefs\.jsonl: no preference rows"):
        pref.read_preference_jsonl(_write(tmp_path, lines))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl.*does not exist"):
        pref.read_preference_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(pref.PreferenceDataError, match="is a directory"):
        pref.read_preference_jsonl(str(tmp_path))


def test_write_read_round_trip_is_atomic(tmp_path):
    rows = [{"prompt": "héllo ∑", "chosen": " a\nb", "rejected": " c", "score_chosen": 1.0,
             "score_rejected": np.float32(-2.5)},
            {"prompt": "", "chosen": "x", "rejected": "y", "id": 3}]
    path = str(tmp_path / "out" / "prefs.jsonl")
    pref.write_preference_jsonl(path, rows)
    pref.write_preference_jsonl(path, rows)  # overwrites in place
    back = pref.read_preference_jsonl(path)
    assert back == [dict(rows[0], score_rejected=-2.5), rows[1]]
    assert os.listdir(tmp_path / "out") == ["prefs.jsonl"]  # no temp file left behind
    with pytest.raises(pref.PreferenceDataError, match="row 1: field 'chosen' must be a string"):
        pref.write_preference_jsonl(path, [rows[0], {"prompt": "p", "rejected": "r"}])
    assert pref.read_preference_jsonl(path) == back  # a failed write leaves the old file intact


# ----------------------------------------------------------------------------------------- encoding


class _PadSevenTokenizer:
    """Byte ids with a non-zero pad id, to check that padding uses pad_id."""

    pad_id, bos_id, eos_id, vocab_size = 7, 1, 2, 259

    def encode(self, text):
        return _ids(text)


def test_encode_responses_hand_checked():
    arrays, stats = pref.encode_responses(["ab", ""], ["c", "de"], TOK, 6)
    a, b, c, d, e = _ids("abcde")
    np.testing.assert_array_equal(arrays["inputs"], [[1, a, b, c, 2, 0], [1, d, e, 2, 0, 0]])
    np.testing.assert_array_equal(arrays["segment_ids"], [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(arrays["positions"], [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 0, 0]])
    np.testing.assert_array_equal(arrays["response_mask"],
                                  [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(arrays["lengths"], [5, 4])
    assert all(v.dtype == np.int32 for v in arrays.values())
    assert stats == {"n": 2, "truncated_prompt": 0, "truncated_response": 0}

    no_eos, _ = pref.encode_responses(["ab"], ["c"], _PadSevenTokenizer(), 5, add_eos=False)
    np.testing.assert_array_equal(no_eos["inputs"], [[1, a, b, c, 7]])
    np.testing.assert_array_equal(no_eos["response_mask"], [[0, 0, 0, 1, 0]])
    np.testing.assert_array_equal(no_eos["lengths"], [4])


def test_response_mask_selects_the_response_tokens():
    prompts = ["Question: why?", "Tell me ∑", "x"]
    responses = [" Because.", " ok", " long answer"]
    arrays, _ = pref.encode_responses(prompts, responses, TOK, 32)
    for i, response in enumerate(responses):
        tokens, mask, n = arrays["inputs"][i], arrays["response_mask"][i], arrays["lengths"][i]
        assert TOK.decode(tokens[mask == 1]) == response
        assert tokens[mask == 1][-1] == TOK.eos_id and tokens[n - 1] == TOK.eos_id
        assert TOK.decode(tokens[1:n][mask[1:n] == 0]) == prompts[i]
        assert mask[0] == 0 and (mask[n:] == 0).all() and (arrays["segment_ids"][i][n:] == 0).all()


def test_truncation_cuts_prompt_left_then_response_right():
    a, b, c, d, e, f, w, x, y, z = _ids("abcdefwxyz")
    # prompt cut to its last token; response (with eos) intact
    arrays, stats = pref.encode_responses(["abcdef"], ["xyz"], TOK, 6)
    np.testing.assert_array_equal(arrays["inputs"], [[1, f, x, y, z, 2]])
    np.testing.assert_array_equal(arrays["response_mask"], [[0, 0, 1, 1, 1, 1]])
    assert stats == {"n": 1, "truncated_prompt": 1, "truncated_response": 0}
    # prompt down to 1 token, then the response cut from the right (eos goes first)
    arrays, stats = pref.encode_responses(["ab", "a"], ["wxyz", "w"], TOK, 4)
    np.testing.assert_array_equal(arrays["inputs"], [[1, b, w, x], [1, a, w, 2]])
    np.testing.assert_array_equal(arrays["response_mask"], [[0, 0, 1, 1], [0, 0, 1, 1]])
    assert stats == {"n": 2, "truncated_prompt": 1, "truncated_response": 1}
    # max_prompt_len keeps the prompt's last tokens even when the sequence would fit
    arrays, stats = pref.encode_responses(["abcdef"], ["x"], TOK, 16, max_prompt_len=2)
    np.testing.assert_array_equal(arrays["inputs"][0, :5], [1, e, f, x, 2])
    assert stats["truncated_prompt"] == 1 and arrays["lengths"][0] == 5
    with pytest.raises(ValueError, match=r"seq_len=2 .* >= 3"):
        pref.encode_responses(["a"], ["b"], TOK, 2)
    with pytest.raises(ValueError, match="1 prompts but 2 responses"):
        pref.encode_responses(["a"], ["b", "c"], TOK, 8)


def test_encode_pairs_shares_the_prompt_and_carries_scores():
    rows = [{"prompt": "abcd", "chosen": "x", "rejected": "xyz", "score_chosen": 2,
             "score_rejected": -1.5},
            {"prompt": "", "chosen": "w", "rejected": "y", "score_chosen": 0.5,
             "score_rejected": 0.25}]
    arrays, stats = pref.encode_pairs(rows, TOK, 7)
    c, d, w, x, y, z = _ids("cdwxyz")
    assert {k: v.shape for k, v in arrays.items()} == {
        "inputs": (2, 2, 7), "segment_ids": (2, 2, 7), "positions": (2, 2, 7),
        "response_mask": (2, 2, 7), "lengths": (2, 2), "scores": (2, 2)}
    # the prompt is cut once, for the longer (rejected) response, so both keep the same context
    np.testing.assert_array_equal(arrays["inputs"][0], [[1, c, d, x, 2, 0, 0],
                                                        [1, c, d, x, y, z, 2]])
    np.testing.assert_array_equal(arrays["response_mask"][0], [[0, 0, 0, 1, 1, 0, 0],
                                                               [0, 0, 0, 1, 1, 1, 1]])
    np.testing.assert_array_equal(arrays["inputs"][1], [[1, w, 2, 0, 0, 0, 0],
                                                        [1, y, 2, 0, 0, 0, 0]])
    np.testing.assert_array_equal(arrays["lengths"], [[5, 7], [3, 3]])
    np.testing.assert_array_equal(arrays["positions"][0, 1], np.arange(7))
    assert arrays["scores"].dtype == np.float32
    np.testing.assert_array_equal(arrays["scores"], [[2, -1.5], [0.5, 0.25]])
    assert stats == {"n": 2, "truncated_prompt": 1, "truncated_response": 0,
                     "truncated_chosen": 0, "truncated_rejected": 0}

    del rows[1]["score_rejected"]
    arrays, _ = pref.encode_pairs(rows, TOK, 7)
    assert "scores" not in arrays  # omitted unless every row has both scores


# ----------------------------------------------------------------------------------------- batching


def _arrays(n=6, seq_len=8):
    rows = [{"prompt": f"p{i}", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(n)]
    arrays, _ = pref.encode_pairs(rows, TOK, seq_len)
    arrays["index"] = np.arange(n, dtype=np.int32)  # tracks which row a batch row came from
    return arrays


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in g:
            np.testing.assert_array_equal(g[k], e[k])


def test_pair_iterator_batches_and_epochs():
    arrays = _arrays(n=6)
    it = pref.pair_train_iterator(arrays, 4, seed=3, process_index=0, process_count=1)
    assert isinstance(it, grain.DatasetIterator)
    batches = _take(it, 3)  # 12 rows = exactly two epochs
    b = batches[0]
    assert {k: (v.shape, v.dtype) for k, v in b.items()} == {
        "inputs": ((4, 2, 8), np.int32), "segment_ids": ((4, 2, 8), np.int32),
        "positions": ((4, 2, 8), np.int32), "response_mask": ((4, 2, 8), np.int32),
        "lengths": ((4, 2), np.int32), "index": ((4,), np.int32), "weight": ((4,), np.float32)}
    np.testing.assert_array_equal(b["weight"], 1.0)
    for row in range(4):  # rows are whole examples
        np.testing.assert_array_equal(b["inputs"][row], arrays["inputs"][b["index"][row]])
    order = np.concatenate([x["index"] for x in batches])
    assert sorted(order[:6]) == list(range(6)) and sorted(order[6:]) == list(range(6))
    assert order[:6].tolist() != order[6:].tolist()  # a new permutation each epoch
    other = pref.pair_train_iterator(arrays, 4, seed=4, process_index=0, process_count=1)
    assert np.concatenate([x["index"] for x in _take(other, 3)]).tolist() != order.tolist()


def test_pair_iterator_state_restores_exactly():
    arrays = _arrays(n=5)
    it = pref.pair_train_iterator(arrays, 2, seed=0, process_index=0, process_count=1)
    _take(it, 4)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 6)  # crosses epoch boundaries
    fresh = pref.pair_train_iterator(arrays, 2, seed=0, process_index=0, process_count=1)
    _take(fresh, 9)
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 6), expected)


def test_pair_iterator_orbax_checkpoint_round_trip(tmp_path):
    arrays = _arrays(n=5)
    make = lambda: pref.pair_train_iterator(arrays, 2, seed=1, process_index=0, process_count=1)
    it = make()
    _take(it, 3)
    handlers = {"data": grain.checkpoint.CheckpointHandler()}
    manager = ocp.CheckpointManager(tmp_path / "ckpt", item_handlers=handlers,
                                    options=ocp.CheckpointManagerOptions(create=True))
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
    expected = _take(it, 3)
    restored = make()
    manager.restore(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    _assert_batches_equal(_take(restored, 3), expected)


def test_process_slices_concatenate_to_the_global_batch():
    arrays = _arrays(n=7)
    whole = _take(pref.pair_train_iterator(arrays, 4, seed=2, process_index=0, process_count=1), 3)
    parts = [_take(pref.pair_train_iterator(arrays, 4, seed=2, process_index=p, process_count=2), 3)
             for p in range(2)]
    for step in range(3):
        assert parts[0][step]["index"].shape == (2,)
        for k in whole[step]:
            np.testing.assert_array_equal(
                np.concatenate([parts[0][step][k], parts[1][step][k]]), whole[step][k])
    with pytest.raises(ValueError, match="multiple of the process count 2"):
        pref.pair_train_iterator(arrays, 3, seed=0, process_index=0, process_count=2)


def test_pair_iterator_serves_single_sequences():
    arrays, _ = pref.encode_responses(["a", "b", "c"], ["x", "y", "z"], TOK, 6)
    batch = next(pref.pair_train_iterator(arrays, 2, seed=0, process_index=0, process_count=1))
    assert batch["inputs"].shape == (2, 6) and batch["lengths"].shape == (2,)
    assert batch["weight"].shape == (2,)


def test_eval_batches_count_every_example_once():
    arrays = _arrays(n=7)
    batches = pref.eval_batches(arrays, 3, process_index=0, process_count=1)
    assert len(batches) == 3 and all(b["inputs"].shape == (3, 2, 8) for b in batches)
    assert sum(float(b["weight"].sum()) for b in batches) == 7
    counts = collections.Counter()
    for b in batches:
        assert b["weight"].dtype == np.float32
        counts.update(b["index"][b["weight"] == 1].tolist())
    assert counts == {i: 1 for i in range(7)}
    assert np.concatenate([b["index"] for b in batches]).tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 0]
    np.testing.assert_array_equal(batches[-1]["weight"], [1, 0, 0])
    np.testing.assert_array_equal(batches[-1]["inputs"][1], arrays["inputs"][0])  # copies of row 0

    capped = pref.eval_batches(arrays, 3, max_batches=2, process_index=0, process_count=1)
    assert [b["index"][0] for b in capped] == [0, 6]  # evenly spaced: first and last batch
    halves = [pref.eval_batches(arrays, 4, process_index=p, process_count=2) for p in range(2)]
    whole = pref.eval_batches(arrays, 4, process_index=0, process_count=1)
    for i, b in enumerate(whole):
        for k in b:
            np.testing.assert_array_equal(np.concatenate([halves[0][i][k], halves[1][i][k]]), b[k])
    assert sum(float(h["weight"].sum()) for part in halves for h in part) == 7


def test_unpaired_round_trip_and_errors(tmp_path):
    from icml_jax.data.preference import read_unpaired_jsonl, write_unpaired_jsonl
    path = str(tmp_path / "labelled.jsonl")
    rows = [{"prompt": "Problem: 1+2\n", "completion": "Answer: 3\n", "label": True, "group": 0},
            {"prompt": "Problem: 1+2\n", "completion": "Answer: 4\n", "label": 0, "group": 0}]
    write_unpaired_jsonl(path, rows)
    back = read_unpaired_jsonl(path)
    assert [r["label"] for r in back] == [True, False] and back[1]["group"] == 0
    assert back[0]["completion"] == "Answer: 3\n"
    bad = {"missing": '{"prompt": "a", "completion": "b"}',
           "label": '{"prompt": "a", "completion": "b", "label": 2}',
           "string": '{"prompt": 1, "completion": "b", "label": true}',
           "empty": '{"prompt": "a", "completion": "", "label": true}'}
    for name, line in bad.items():
        p = tmp_path / f"{name}.jsonl"
        p.write_text('{"prompt": "a", "completion": "b", "label": false}\n\n' + line + "\n")
        with pytest.raises(pref.PreferenceDataError, match=rf"{name}.jsonl:3: "):
            read_unpaired_jsonl(str(p))
    with pytest.raises(FileNotFoundError):
        read_unpaired_jsonl(str(tmp_path / "nope.jsonl"))
