"""Parity of our MedXpertQA harness (``icml_jax/data/medxpertqa.py``) with the authors' own code,
executed once and stored in ``data/medxpertqa_reference.json``; no reference code is imported here.

How the fixture was made (by hand, once): the authors' repository github.com/TsinghuaC3I/MedXpertQA
at commit f21247d3ccf3b14826ff2aa7fa06e1a46d64058c (``eval/main.py``, ``eval/utils.py``,
``eval/config/prompt_templates.py``) was run with ``PromptTemplates().load_templates("medxpertqa",
"gpt-4o")``, calling ``main.zero_shot_cot`` and ``main.zero_shot_ao`` themselves: they build the
prompts, take the agent's response, ``response.strip()`` it and call ``utils.answer_cleansing(
"zero_shot", <CoT or answer-only trigger>, response, "medxpertqa", task, input_sample)``, with a
10-option Text row and a 5-option MM row as ``input_sample``. Stubbed: ``nltk`` (used only by the
open-ended datasets), the ``setup`` module ``main.py`` star-imports (model agents and paths, unused
by those two functions) and the LLM agent (a fake returning the scripted response).

Inputs: 53 hand-picked responses (whitespace, both triggers, several letters, letters inside
words, "I understand", "A through J", lower case, no letter, out-of-range letters, newlines) and
300 random ones joined from a fragment vocabulary (``random.Random(0)``); each row of
``extraction`` is ``[response, text_cot, text_ao, mm_cot, mm_ao]``, the reference's letter (or
null for its empty prediction) per mode. ``prompts`` holds 10 synthetic rows made with
``tests/data/medxpertqa_synth.synthetic_rows`` (two with surrounding whitespace in the question,
two with braces in an option) and the reference's system prompt, turn 1, turn 2 and answer-only
prompt. ``ao_system_role`` ("Please answer only.") is recorded but not compared: our answer-only
path scores letter log-likelihoods after ``answer_only_prompt`` with no system turn.

The generator lives outside the repository (make_fixture.py beside the audit's scratch files)
because the project does not copy reference code; no real benchmark row is in the fixture.
"""
import json
import os

import pytest

from icml_jax.data import medxpertqa as mx

REF = os.path.join(os.path.dirname(__file__), "data", "medxpertqa_reference.json")
MODES = {"text_cot": (10, mx.COT_TRIGGER), "text_ao": (10, mx.AO_TRIGGER),
         "mm_cot": (5, mx.COT_TRIGGER), "mm_ao": (5, mx.AO_TRIGGER)}


@pytest.fixture(scope="module")
def ref():
    with open(REF, encoding="utf-8") as f:
        return json.load(f)


def test_fixture_shape(ref):
    assert ref["reference"]["commit"].startswith("f21247d")
    assert ref["extraction_columns"] == ["response", *MODES]
    assert len(ref["extraction"]) >= 300 and len(ref["prompts"]) >= 10
    assert {len(r["row"]["options"]) for r in ref["prompts"]} == {5, 10}


@pytest.mark.parametrize("mode", list(MODES))
def test_extract_answer_matches_reference(ref, mode):
    n, trigger = MODES[mode]
    col = ref["extraction_columns"].index(mode)
    bad = []
    for case in ref["extraction"]:
        ours = mx.extract_answer(case[0], n, trigger=trigger.format(end=mx.last_letter(n)))
        if ours != case[col]:
            bad.append((case[0], case[col], ours))
    assert not bad, f"{len(bad)} mismatches (response, reference, ours): {bad[:10]}"


def test_default_trigger_is_the_cot_trigger(ref):
    for case in ref["extraction"]:
        assert mx.extract_answer(case[0], 10) == case[1] and mx.extract_answer(case[0], 5) == case[3]


def test_prompts_match_reference(ref):
    for p in ref["prompts"]:
        q = mx.parse_row(p["row"])
        assert mx.cot_turns(q) == (p["system"], p["turn1"], p["turn2"]), q.id
        assert mx.answer_only_prompt(q) == p["ao_prompt"], q.id
