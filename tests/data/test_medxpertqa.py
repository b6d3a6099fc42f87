"""MedXpertQA loader, prompts, answer extraction and accuracy (the spec's property tests 1-5) on
synthetic files in the official layout; no JAX."""
import json
import math

import numpy as np
import pytest

from icml_jax.data import medxpertqa as mx
from tests.data.medxpertqa_synth import synthetic_rows, write_rows, write_synthetic


def test_extract_first_valid_letter_after_trigger():
    """Property 1: the first valid letter after the trigger; the fallback split; out-of-range
    letters ignored; the authors' removed phrases ("I understand", "A through J") never match."""
    t = mx.COT_TRIGGER.format(end="J")
    assert mx.extract_answer(f"C is tempting. {t} (D), not B.", 10) == "D"
    assert mx.extract_answer(f"{t} K, then F and G", 10) == "F"  # K is outside A-J
    assert mx.extract_answer("So the answer is B; earlier I said A", 10) == "B"  # fallback split
    assert mx.extract_answer("Option G seems right, maybe H", 10) == "G"  # neither: whole text
    assert mx.extract_answer("I understand. A through J: the pick is E", 10) == "E"
    assert mx.extract_answer("I think it is C", 10) == "I"  # only "I understand" is removed
    t5 = mx.COT_TRIGGER.format(end="E")
    assert mx.extract_answer(f"{t5} F or G, so C", 5) == "C"  # F is outside A-E for MM
    assert mx.extract_answer(f"{t5} (C). {t5} B", 5) == "C"  # text between the first two triggers
    assert mx.extract_answer(f"{t} H", 10, trigger=t) == "H"
    # the response is stripped first, as the reference's main.py does: generated text often
    # starts with a space, which would otherwise move the fallback split
    assert mx.extract_answer(" answer is B, so the answer is C", 10) == "C"
    assert mx.extract_answer("C answer is \n", 10) == "C"


def test_extract_no_answer():
    """Property 2: no standalone valid letter -> None; letters inside words never match."""
    for text in ("", "Cardiac Arrest Because Diet", "ABC and DEF", "the answer is unclear",
                 "Answer: K"):
        assert mx.extract_answer(text, 10) is None, text
    assert mx.extract_answer("answer is F", 5) is None


def test_prompt_templates():
    """Property 3: the two-turn template, "J" for Text and "E" for MM, the question stripped."""
    text_q = mx.parse_row(synthetic_rows(1, "text")[0])
    mm_q = mx.parse_row(synthetic_rows(1, "mm")[0])
    system, turn1, turn2 = mx.cot_turns(text_q)
    assert system == "You are a helpful medical assistant."
    assert turn1 == f"Q: {text_q.question}\nA: Let's think step by step."
    assert turn2 == "Therefore, among A through J, the answer is"
    assert mx.cot_turns(mm_q)[2] == "Therefore, among A through E, the answer is"
    assert mx.cot_turns("  padded question \n", 5)[1] == "Q: padded question\nA: Let's think step by step."
    assert mx.answer_only_prompt(mm_q).endswith("\nA: Among A through E, the answer is")


def test_loader_parses_both_subsets(tmp_path):
    """Property 4 on synthetic files: every row parsed, options equal to the Answer Choices block,
    subsets told apart by their option counts, image references kept."""
    qs = mx.load_jsonl(write_synthetic(tmp_path / "t.jsonl", 30, "text"))
    mm = mx.load_jsonl(write_synthetic(tmp_path / "m.jsonl", 20, "mm"), "mm")
    assert len(qs) == 30 and len(mm) == 20
    assert {q.subset for q in qs} == {"text"} and {q.subset for q in mm} == {"mm"}
    assert all(q.letters == "ABCDEFGHIJ" for q in qs) and all(q.letters == "ABCDE" for q in mm)
    rows = synthetic_rows(30, "text")
    for q, r in zip(qs, rows):
        assert q.label == r["label"][0] and q.question == r["question"]
        block = q.question.split("Answer Choices: ")[1]
        assert block == " ".join(f"({a}) {c}" for a, c in q.options)
    assert mm[3].images == ("MM-3-a.jpeg",) and qs[0].images == ()
    assert len(mx.load_jsonl(tmp_path / "t.jsonl", limit=7)) == 7


def _bad(rows_fn):
    rows = synthetic_rows(3, "text")
    rows_fn(rows)
    return rows


@pytest.mark.parametrize("edit, field", [
    (lambda r: r.__setitem__(1, "{not json"), "<json>"),
    (lambda r: r[1].pop("label"), "label"),
    (lambda r: r[1].__setitem__("label", ["K"]), "label"),
    (lambda r: r[1].__setitem__("label", ["A", "B"]), "label"),
    (lambda r: r[1].pop("question_type"), "question_type"),
    (lambda r: r[1].__setitem__("question_type", "Recall"), "question_type"),
    (lambda r: r[1]["options"][2].__setitem__("letter", "Z"), "options[2].letter"),
    (lambda r: r[1]["options"].pop(), "options"),  # 9 options, and the block no longer matches
    (lambda r: r[1]["options"][0].__setitem__("content", "other"), "options"),
    (lambda r: r[1].__setitem__("question", "no choices here"), "question"),
    (lambda r: r[1].__setitem__("id", "Text-0"), "id"),  # repeats line 1
    (lambda r: r[1].__setitem__("images", "x.png"), "images"),
])
def test_malformed_row_names_file_line_field(tmp_path, edit, field):
    path = write_rows(tmp_path / "bad.jsonl", _bad(edit))
    with pytest.raises(mx.MedXpertQAError) as e:
        mx.load_jsonl(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: field '{field}':"), msg
    assert "\n" not in msg


def test_wrong_subset_and_empty_file(tmp_path):
    path = write_synthetic(tmp_path / "m.jsonl", 3, "mm")
    with pytest.raises(mx.MedXpertQAError, match=r"m.jsonl:1: field 'options': has 5 options; this "
                       r"subset has 10; pass the file as the right subset"):
        mx.load_jsonl(path, "text")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(mx.MedXpertQAError, match="no rows"):
        mx.load_jsonl(tmp_path / "e.jsonl")


def test_oracle_random_and_breakdowns(tmp_path):
    """Property 5 and the harness check's counts: the oracle scores 100%; a uniform-random
    answerer lands within 3 binomial standard errors of 10% (Text) / 20% (MM); every breakdown's
    counts add up to the totals; a missing answer counts as wrong."""
    for subset, n in (("text", 1500), ("mm", 1000)):
        qs = [mx.parse_row(r) for r in synthetic_rows(n, subset, seed=1)]
        oracle = mx.accuracy_report(qs, [q.label for q in qs])
        assert oracle["accuracy"] == 1.0 and oracle["correct"] == n
        rng = np.random.default_rng(5)
        preds = [q.letters[rng.integers(len(q.letters))] for q in qs]
        rep = mx.accuracy_report(qs, preds)
        p = mx.chance(subset)
        assert abs(rep["accuracy"] - p) < 3 * math.sqrt(p * (1 - p) / n), rep["accuracy"]
        for key in mx.BREAKDOWNS:
            cells = rep[f"by_{key}"].values()
            assert sum(c["n"] for c in cells) == n and sum(c["correct"] for c in cells) == rep["correct"]
        assert set(rep["by_question_type"]) == {"Reasoning", "Understanding"}
    none = mx.accuracy_report(qs[:4], [None, qs[1].label, None, "z"])
    assert (none["correct"], none["no_answer"]) == (1, 2)
    json.dumps(none)  # JSON-able
