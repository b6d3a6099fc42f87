"""MedXpertQA answerers (docs/methods/medxpertqa.md): the official zero-shot chain of thought with
answer extraction (``cot_extract``), the log-likelihood-over-letters scorer for models too small
to follow a chain of thought (``letter_loglik``), and the harness checks' oracle and uniform-random
answerers (``data.medxpertqa``, which need no JAX). Each returns one predicted letter (or None) per question; accuracy is
``data.medxpertqa.accuracy_report``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from icml_jax.analysis.lm_scoring import Progress, TextLM
from icml_jax.data import medxpertqa as mx

MODES = ("cot_extract", "letter_loglik")
oracle_answers, random_answers = mx.oracle_answers, mx.random_answers  # no model: data layer


def letter_candidates(q: mx.Question) -> list[tuple[str, str]]:
    """(context, continuation) for each letter L: the answer-only prompt and " (L)"."""
    ctx = mx.answer_only_prompt(q)
    return [(ctx, f" ({letter})") for letter in q.letters]


def letter_loglik_answers(lm: TextLM, questions: Sequence[mx.Question],
                          progress: Progress = None) -> tuple[list[str], list[list[float]]]:
    """(argmax_L log p(" (L)" | prompt) per question, the log-probs per letter). Ties go to the
    earliest letter."""
    pairs, spans = [], []
    for q in questions:
        cands = letter_candidates(q)
        spans.append((len(pairs), len(cands)))
        pairs += cands
    scores = lm.loglikelihood(pairs, progress=progress)
    preds, table = [], []
    for q, (lo, n) in zip(questions, spans):
        lps = [s for s, _ in scores[lo:lo + n]]
        table.append(lps)
        preds.append(q.letters[int(np.argmax(lps))])
    return preds, table


def render_turns(system: str, turns: Sequence[tuple[str, str]], next_user: str | None) -> str:
    """A plain-text rendering of the conversation for a model without a chat template: the
    system line, then each (user, assistant) turn, then the next user turn, blank-line separated;
    the model continues the last user turn."""
    parts = [system]
    for user, assistant in turns:
        parts.append(user + " " + assistant.strip())
    if next_user is not None:
        parts.append(next_user)
    return "\n\n".join(parts)


def cot_answers(lm: TextLM, questions: Sequence[mx.Question], *, rationale_tokens: int = 256,
                answer_tokens: int = 32, progress: Progress = None
                ) -> tuple[list[str | None], list[dict]]:
    """The official two-turn zero-shot CoT at temperature 0: turn 1 "Q: ...\\nA: Let's think step
    by step." -> rationale; turn 2 "Therefore, among A through J (E), the answer is" -> answer;
    the letter is ``extract_answer`` of the turn-2 output. Returns (letters, per-question records
    with the rationale and the answer text); ``progress`` counts generated rows, two per question."""
    firsts, seconds = [], []
    for q in questions:
        system, turn1, _ = mx.cot_turns(q)
        firsts.append(render_turns(system, [], turn1))
    rationales = lm.generate(firsts, rationale_tokens, progress=progress)
    for q, r in zip(questions, rationales):
        system, turn1, turn2 = mx.cot_turns(q)
        seconds.append(render_turns(system, [(turn1, r)], turn2))
    answers = lm.generate(seconds, answer_tokens, progress=progress)
    preds = [mx.extract_answer(a, len(q.options)) for q, a in zip(questions, answers)]
    records = [{"rationale": r, "answer_text": a} for r, a in zip(rationales, answers)]
    return preds, records
