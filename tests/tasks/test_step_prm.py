"""The step-labelled PRM task (TRL's PRMTrainer recipe): data encoding, errors, and training."""
import json

import numpy as np
import pytest

from icml_jax.config_utils import load_config
from icml_jax.data import ByteTokenizer
from icml_jax.data.preference import PreferenceDataError, encode_steps, read_stepwise_jsonl
from icml_jax.train.trainer import train


def _rows(n, seed):
    """Steps that are right ("+ ok") or wrong ("- no"), in random order: a learnable step label."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        labels = [bool(x) for x in rng.integers(0, 2, int(rng.integers(1, 5)))]
        rows.append({"prompt": f"Q{int(rng.integers(100))}:",
                     "completions": ["+ ok" if y else "- no" for y in labels], "labels": labels})
    return rows


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_encoding_puts_each_label_on_the_last_token_of_step_plus_separator():
    tok = ByteTokenizer()
    rows = [{"prompt": "Q:", "completions": ["ab", "c", "dddd"], "labels": [True, False, True]}]
    a, stats = encode_steps(rows, tok, seq_len=12, max_steps=4)
    ids = [tok.bos_id] + tok.encode("Q:") + tok.encode("ab\n") + tok.encode("c\n")
    np.testing.assert_array_equal(a["inputs"][0, :len(ids)], ids)  # "dddd\n" did not fit: dropped
    assert a["step_end"][0, :2].tolist() == [5, 7] and a["step_mask"][0].tolist() == [1, 1, 0, 0]
    assert a["step_label"][0, :2].tolist() == [1.0, 0.0] and stats["dropped_steps"] == 1
    assert stats["rows_with_dropped_steps"] == 1
    long = [{"prompt": "x" * 50, "completions": ["ab", "c"], "labels": [True, True]}]
    c, st = encode_steps(long, tok, seq_len=12, max_steps=4)  # the prompt yields room for step 1
    assert c["step_mask"][0].tolist() == [1, 0, 0, 0] and st["truncated_prompt"] == 1
    assert c["inputs"][0, c["step_end"][0, 0]] == tok.encode("\n")[-1]
    assert all(a["inputs"][0, e] == tok.encode("\n")[-1] for e in a["step_end"][0, :2])
    assert a["response_mask"][0].tolist() == [0, 0, 0] + [1] * 5 + [0] * 4
    b, _ = encode_steps(rows, tok, seq_len=40, max_steps=2)  # max_steps cuts the third
    assert b["step_mask"][0].tolist() == [1, 1]


def test_reader_errors_name_file_line_and_field(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"prompt": "q", "completions": ["a", "b"], "labels": [True]}) + "\n")
    with pytest.raises(PreferenceDataError, match=r"s.jsonl:1: field 'labels' must hold one "
                                                  r"true/false \(or 1/0\) per step \(2 steps\)"):
        read_stepwise_jsonl(str(p))
    p.write_text(json.dumps({"prompt": "q", "completions": []}) + "\n")
    with pytest.raises(PreferenceDataError, match=r"s.jsonl:1: missing field 'labels'"):
        read_stepwise_jsonl(str(p))


def test_the_task_learns_step_labels(tmp_path):
    train_path, val_path = str(tmp_path / "train.jsonl"), str(tmp_path / "val.jsonl")
    _write(train_path, _rows(96, 0))
    _write(val_path, _rows(16, 1))
    c = load_config("configs/step_prm.py:tiny", unlocked=True)
    c.data.path, c.data.eval_path = train_path, val_path
    state, summary = train(c, str(tmp_path / "run"))
    pos = summary["eval_positive_rate"]
    assert 0.2 < pos < 0.8  # both labels occur, so the majority label scores < 0.8
    assert summary["eval_accuracy"] > max(pos, 1 - pos) + 0.1, summary  # beats always-majority
    assert set(state.params) == {"backbone", "score", "score_bias"}
