"""MedXpertQA (Zuo et al., ICML 2025): the official JSONL layout, the zero-shot chain-of-thought
prompt, the official answer-extraction rule and accuracy breakdowns (docs/methods/medxpertqa.md).

No JAX here: the model-side scoring is ``icml_jax/analysis/medxpertqa.py`` and the CLI is
``python -m icml_jax.evaluate``.

Layout (one JSON object per line; the authors' ``eval/data/medxpertqa*/input/*.jsonl``):
``id``, ``question`` (ends with ``"\\nAnswer Choices: (A) ... (J) ..."``), ``options`` (a list of
``{"letter", "content"}``), ``label`` (a one-element list such as ``["C"]``), ``medical_task``,
``body_system``, ``question_type`` (``Reasoning`` / ``Understanding``) and, for the MM subset,
``images`` (a list of ``{"image_path"}``). Text has 10 options (A-J), MM 5 (A-E).

``extract_answer`` follows the authors' ``eval/utils.py::answer_cleansing`` (zero-shot branch):
the text after the first trigger phrase (else after the first " answer is ", else the whole text),
with the phrases "I understand" / "A through J|E|D" removed, then the **first** standalone capital
letter of the valid range.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence

SUBSETS = {"text": 10, "mm": 5}  # subset -> number of options
QUESTION_TYPES = ("Reasoning", "Understanding")
SYSTEM_PROMPT = "You are a helpful medical assistant."
COT_PROMPT = "Q: {question}\nA: Let's think step by step."
COT_TRIGGER = "Therefore, among A through {end}, the answer is"
AO_TRIGGER = "Among A through {end}, the answer is"  # the authors' answer-only trigger
FALLBACK_SPLIT = " answer is "
# removed before the letter search (answer_cleansing): "I" and the range's own letters would match
UNWANTED_PHRASES = ("I understand", "A through J", "A through E", "A through D")
CHOICES_MARK = "\nAnswer Choices: "
BREAKDOWNS = ("question_type", "medical_task", "body_system")


class MedXpertQAError(ValueError):
    """A malformed data file: the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    question: str
    options: tuple[tuple[str, str], ...]  # (letter, content), letters A, B, ... in order
    label: str
    medical_task: str
    body_system: str
    question_type: str
    images: tuple[str, ...] = ()

    @property
    def letters(self) -> str:
        return "".join(letter for letter, _ in self.options)

    @property
    def subset(self) -> str:
        return "text" if len(self.options) == SUBSETS["text"] else "mm"


def last_letter(n_options: int) -> str:
    return chr(ord("A") + n_options - 1)


def cot_turns(question: Question | str, n_options: int | None = None) -> tuple[str, str, str]:
    """(system, user turn 1, user turn 2) of the official zero-shot CoT protocol: the question is
    stripped as the authors do; turn 2 names the range "A through J" (Text) or "A through E" (MM)."""
    if isinstance(question, Question):
        n_options, question = len(question.options), question.question
    return (SYSTEM_PROMPT, COT_PROMPT.format(question=question.strip()),
            COT_TRIGGER.format(end=last_letter(n_options)))


def answer_only_prompt(q: Question) -> str:
    """``Q: {question}\\nA: Among A through J, the answer is`` (the authors' answer-only prompt):
    the context the letter log-likelihood scorer continues with " (L)"."""
    return f"Q: {q.question.strip()}\nA: " + AO_TRIGGER.format(end=last_letter(len(q.options)))


def extract_answer(text: str, n_options: int, trigger: str | None = None,
                   fallback: str = FALLBACK_SPLIT) -> str | None:
    """The official rule (module docstring): the first standalone letter in A..(A + n_options - 1)
    after the trigger (default: the CoT trigger for ``n_options``), or None. The response is
    stripped first, as the reference's ``main.py`` strips it before ``answer_cleansing`` (a leading
    space changes which piece the split keeps: " answer is B, so the answer is C" gives C)."""
    trigger = COT_TRIGGER.format(end=last_letter(n_options)) if trigger is None else trigger
    text = text.strip()
    for sep in (trigger, fallback):
        parts = text.split(sep)
        if len(parts) > 1:
            text = parts[1].strip()  # the text between the first and a second occurrence
            break
    for phrase in UNWANTED_PHRASES:
        text = text.replace(phrase, "")
    letters = "|".join(chr(ord("A") + i) for i in range(n_options))
    found = re.findall(rf"\b({letters})\b", text)
    return found[0] if found else None


# ----------------------------------------------------------------------------- loading

def _fail(path, line, field, problem, fix="fix the row or remove it"):
    raise MedXpertQAError(f"{path}:{line}: field '{field}': {problem}; {fix}")


def _string(row, key, path, line) -> str:
    if key not in row:
        _fail(path, line, key, "missing")
    v = row[key]
    if not isinstance(v, str) or not v.strip():
        _fail(path, line, key, f"must be a non-empty string, got {v!r:.60}")
    return v


def _options(row, path, line, n_expected) -> tuple[tuple[str, str], ...]:
    opts = row.get("options")
    if opts is None:
        _fail(path, line, "options", "missing")
    if isinstance(opts, dict):  # {"A": "...", ...} as some converted copies store it
        opts = [{"letter": k, "content": v} for k, v in opts.items()]
    if not isinstance(opts, list) or not opts:
        _fail(path, line, "options", f"must be a list of {{letter, content}}, got {opts!r:.60}")
    out = []
    for i, o in enumerate(opts):
        want = chr(ord("A") + i)
        if not isinstance(o, dict) or set(o) != {"letter", "content"}:
            _fail(path, line, f"options[{i}]", f"must be {{\"letter\", \"content\"}}, got {o!r:.60}")
        if o["letter"] != want:
            _fail(path, line, f"options[{i}].letter", f"is {o['letter']!r}, expected {want!r} "
                  "(letters run A, B, C, ... in order)")
        if not isinstance(o["content"], str):
            _fail(path, line, f"options[{i}].content", f"must be a string, got {o['content']!r:.60}")
        out.append((o["letter"], o["content"]))
    if n_expected is not None and len(out) != n_expected:
        _fail(path, line, "options", f"has {len(out)} options; this subset has {n_expected}",
              "pass the file as the right subset (Text: 10 options, MM: 5)")
    if len(out) not in SUBSETS.values():
        _fail(path, line, "options", f"has {len(out)} options; MedXpertQA has 10 (Text) or 5 (MM)")
    return tuple(out)


def _norm(s: str) -> str:
    return " ".join(s.split())


def parse_row(row, path: str = "<row>", line: int = 0, subset: str | None = None) -> Question:
    """One JSON object -> ``Question``, or ``MedXpertQAError`` naming path:line and the field."""
    if not isinstance(row, dict):
        _fail(path, line, "<row>", f"must be a JSON object, got {type(row).__name__}")
    n_expected = None if subset is None else SUBSETS[subset]
    qid, question = _string(row, "id", path, line), _string(row, "question", path, line)
    options = _options(row, path, line, n_expected)
    head, mark, block = question.rpartition(CHOICES_MARK)
    if not mark:
        _fail(path, line, "question", "has no \"\\nAnswer Choices: (A) ...\" block",
              "the official layout ends every question with its options")
    listed = " ".join(f"({letter}) {content}" for letter, content in options)
    if _norm(block) != _norm(listed):
        _fail(path, line, "options", "do not match the question's \"Answer Choices\" block "
              f"({_norm(block)[:50]!r}... vs {listed[:50]!r}...)")
    label = row.get("label")
    if isinstance(label, str):
        label = [label]
    if (not isinstance(label, list) or len(label) != 1 or not isinstance(label[0], str)
            or label[0] not in [letter for letter, _ in options]):
        _fail(path, line, "label", f"must be one option letter in a list such as [\"C\"], got "
              f"{row.get('label')!r:.60}")
    qtype = _string(row, "question_type", path, line)
    if qtype not in QUESTION_TYPES:
        _fail(path, line, "question_type", f"is {qtype!r}; expected one of {list(QUESTION_TYPES)}")
    images = row.get("images") or []
    if not isinstance(images, list):
        _fail(path, line, "images", f"must be a list, got {images!r:.60}")
    paths = []
    for i, im in enumerate(images):
        p = im.get("image_path") if isinstance(im, dict) else im
        if not isinstance(p, str) or not p:
            _fail(path, line, f"images[{i}]", f"must be {{\"image_path\": ...}} or a string, got {im!r:.60}")
        paths.append(p)
    return Question(qid, question, options, label[0], _string(row, "medical_task", path, line),
                    _string(row, "body_system", path, line), qtype, tuple(paths))


def load_jsonl(path: str, subset: str | None = None, limit: int | None = None) -> list[Question]:
    """Every non-blank line of ``path`` as a ``Question`` (at most ``limit``). ``subset`` ("text" /
    "mm", None = from the first row's option count) fixes the number of options every row must
    have. A malformed row raises ``MedXpertQAError``: "path:line: field 'x': problem; fix"."""
    if subset is not None and subset not in SUBSETS:
        raise MedXpertQAError(f"subset={subset!r}: expected one of {sorted(SUBSETS)}")
    out, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for line_no, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                _fail(path, line_no, "<json>", f"not valid JSON ({e.msg} at column {e.colno})")
            q = parse_row(row, path, line_no, subset)
            subset = subset or q.subset
            if q.id in seen:
                _fail(path, line_no, "id", f"{q.id!r} repeats line {seen[q.id]}", "ids must be unique")
            seen[q.id] = line_no
            out.append(q)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise MedXpertQAError(f"{path}: no rows; expected one JSON object per line")
    return out


# ----------------------------------------------------------------------------- accuracy

def oracle_answers(questions: Sequence[Question]) -> list[str]:
    return [q.label for q in questions]


def random_answers(questions: Sequence[Question], seed: int = 0) -> list[str]:
    """A uniformly random valid letter per question (numpy's generator from ``seed``)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(seed)
    return [q.letters[int(rng.integers(len(q.options)))] for q in questions]


def chance(subset: str) -> float:
    return 1.0 / SUBSETS[subset]


def _cell(correct: Sequence[bool]) -> dict:
    n, c = len(correct), int(sum(correct))
    return {"n": n, "correct": c, "accuracy": c / n if n else float("nan")}


def accuracy_report(questions: Sequence[Question], predictions: Sequence[str | None]) -> dict:
    """Accuracy of ``predictions`` (a letter or None per question: None counts as wrong) overall
    and per ``question_type``, ``medical_task`` and ``body_system``; each breakdown's counts add up
    to the total (``n`` and ``correct``). ``no_answer`` counts the Nones."""
    if len(questions) != len(predictions):
        raise ValueError(f"{len(questions)} questions but {len(predictions)} predictions")
    right = [p is not None and p.lower() == q.label.lower() for q, p in zip(questions, predictions)]
    out = _cell(right) | {"no_answer": sum(p is None for p in predictions)}
    for key in BREAKDOWNS:
        groups: dict[str, list[bool]] = {}
        for q, r in zip(questions, right):
            groups.setdefault(getattr(q, key), []).append(r)
        out[f"by_{key}"] = {k: _cell(v) for k, v in sorted(groups.items())}
    return out


def by_subset(questions: Iterable[Question]) -> dict[str, list[Question]]:
    out: dict[str, list[Question]] = {}
    for q in questions:
        out.setdefault(q.subset, []).append(q)
    return out
