"""A verifiable multi-step reasoning testbed: K-step integer arithmetic with checkable steps.

The implicit-PRM reproduction (``docs/methods/implicit_prm.md``) needs problems whose solutions are
written step by step and whose every step can be judged exactly. A small SFT policy is trained on
``sft_corpus`` (solutions with ~30% injected arithmetic slips, so that its samples are sometimes
wrong), samples N responses per problem, and each response is labelled by ``check_solution``'s
``answer_correct`` only (outcome labels). The per-step labels (``StepCheck.correct``,
``CheckResult.first_error``) are ground truth for *evaluation only*, never for training.

Pure Python + numpy; everything random goes through an explicit ``np.random.Generator`` or an
integer seed, so every function is deterministic.

Problems
--------
A problem with K steps is a *left-nested chain* of K + 1 numbers n_0 ... n_K and K operators:
step k (1-based) computes r_k = r_{k-1} op_k n_k with r_0 = n_0, and the answer is r_K. The
expression is written with the parentheses that make the evaluation order explicit and no
spaces, e.g. (K = 3)::

    ((23+45)*3)-17          steps (23,'+',45,68), (68,'*',3,204), (204,'-',17,187); answer 187

K = 1 writes no parentheses (``23+45``). Number rules (``digits`` = d, ``max_factor`` = m,
``max_value`` = M):

* n_0 and every operand of ``+`` / ``-`` is a d-digit number, uniform in [10^(d-1), 10^d - 1]
  (d = 1 gives 1..9).
* the operand of ``*`` is uniform in [2, m]; the operand of ``/`` is uniform among the divisors
  of r_{k-1} in [2, m]: division is exact integer division, never a remainder.
* every intermediate result satisfies 0 <= r_k <= M (no negative numbers in a problem; ``-``
  may reach 0). At each step the operator is uniform over those of ``operators`` that can
  keep this rule (``-`` needs r_{k-1} >= 10^(d-1), ``*`` needs 1 <= r_{k-1} <= M // 2, ``/``
  needs a divisor, ``+`` needs r_{k-1} + 10^(d-1) <= M); a chain with no such operator is
  redrawn from scratch. ``max_value=None`` means M = 10^(d+2) - 1.

Texts
-----
``prompt_text``   ``"Problem: ((23+45)*3)-17\\n"``
``solution_text`` ``"Step 1: 23+45=68\\nStep 2: 68*3=204\\nStep 3: 204-17=187\\nAnswer: 187\\n"``

An SFT document is prompt + solution. Error injection (``error_rate``): with that probability a
solution gets exactly one slip: step j's result is r_j + delta with delta in ``ERROR_DELTAS``
(off by 1, 2 or a carry of 10), and every later step recomputes correctly from the wrong value
(the slip propagates, the answer is wrong). j is uniform over the steps where some delta keeps
the whole chain valid (results >= 0, exact divisions, final answer != the true answer), then
delta is uniform over the valid ones; the last step always qualifies.

Checking
--------
``check_solution(problem, text)`` never raises. The text is segmented into steps (below); the
i-th segment (1-based, in order of appearance) is judged against the true step i. From its
header line ``Step <number>: a op b = r`` (spaces optional, integers may carry a minus sign, the
line must contain nothing else) it reads ``number`` and ``parsed = (a, op, b, r)``; text on later
lines of a segment and text before the first header are ignored by the judgement (but scored by
the PRM, since they lie in the spans). Per step:

* ``arithmetic_ok`` parsed and r == a op b (``/``: b != 0 and a == r * b exactly).
* ``consistent``    parsed, i <= K, op == op_i, b == n_i, and a == n_0 (i = 1) or a == the parsed
  result of the written step i - 1 (False when step i - 1 is unparseable).
* ``correct``       **step i is correct iff number == i and parsed == the true step i**, i.e. the
  same a, op, b and r as (r_{i-1}, op_i, n_i, r_i), whatever the steps before it say (a step that
  writes the true values after a wrong step is correct but not consistent). If steps 1..i-1 are
  correct, step i is correct iff it is consistent, arithmetic_ok and numbered i. Steps past K are
  never correct.

``first_error`` is the smallest i such that written step i is not correct, or i <= K is missing
(fewer than i steps were written); None iff exactly K steps were written and all are correct.
So first_error lies in 1..max(K, number of written steps). The answer is the integer on the first
line that starts with ``Answer:`` (``Answer: <int>`` and nothing else on the line; otherwise, or
when there is no such line, ``answer`` is None). ``answer_correct`` = answer == r_K; it is the
outcome label, independent of the steps (a right answer after a wrong step is answer_correct).

Step segmentation (for the PRM's step-end positions)
----------------------------------------------------
Like the reference code, steps are split on the pattern ``Step <number>:`` (found anywhere, not
only at a line start). ``step_char_spans(response)`` returns half-open character spans
[start_k, end_k) that *tile the whole response*: start_1 = 0, start_k = the position of the k-th
header, end_k = start_{k+1}, end_last = len(response). So a well-formed step's span ends just
after its newline, the ``Answer:`` line (and anything after it) belongs to the last step, and the
step rewards sum to the outcome reward (Σ_k r_k = q_K). A non-empty response without any header
is one step; the empty response has no steps.

Token positions: the sequence is ``[bos] + encode(prompt) + encode(response)`` and index t names
the token at position t of that sequence. ``first_response_index(prompt, tok)`` = 1 +
len(encode(prompt)); ``step_end_token_indices`` gives, per step, the position of its *last*
token: first_response_index + len(encode(response[:end_k])) - 1 (requires each prefix encoding
to be a prefix of the response encoding, which holds for the byte tokenizer, where char spans
map 1:1 onto token positions for ASCII text). In the reference's *shifted* log-prob space
(entry i = log-prob of token i + 1) the same token is at index t - 1.

Splits
------
``make_splits(seed, n_train, n_test, **knobs)`` draws distinct problems (by expression); the test
split comes from its own seeded stream (it depends on seed, n_test and the knobs, not on n_train),
the train split from another stream that skips every test expression, so no expression is in both
and a larger n_train extends a smaller one. It raises ValueError when the knobs' problem space
is too small (``MAX_DUPLICATE_DRAWS`` duplicate draws in a row).

Letters: K steps per problem, N samples per problem, d digits.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

OPERATORS = "+-*/"
ERROR_DELTAS = (-10, -2, -1, 1, 2, 10)
MAX_REDRAWS = 1000  # chains redrawn before generate_problem gives up on the knobs
MAX_DUPLICATE_DRAWS = 2000  # duplicates in a row before make_splits declares the space exhausted

Step = tuple[int, str, int, int]  # (a, op, b, result)

_HEADER = re.compile(r"Step\s*(\d+)\s*:", re.ASCII)
_EQUATION = re.compile(r"\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)\s*", re.ASCII)
_ANSWER_LINE = re.compile(r"Answer\s*:(.*)", re.ASCII)
_INT = re.compile(r"\s*(-?\d+)\s*", re.ASCII)
_MAX_INT_CHARS = 64  # longer digit strings are not numbers a step could mean (and are slow)


# ----------------------------------------------------------------------------- problems

@dataclasses.dataclass(frozen=True)
class Problem:
    """A K-step left-nested chain: ``steps[k-1] = (r_{k-1}, op_k, n_k, r_k)``, ``answer = r_K``."""

    expression: str
    steps: tuple[Step, ...]
    answer: int

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def numbers(self) -> tuple[int, ...]:
        """(n_0, n_1, ..., n_K): the K + 1 numbers of the expression, left to right."""
        return (self.steps[0][0],) + tuple(s[2] for s in self.steps)

    @property
    def operators(self) -> str:
        return "".join(s[1] for s in self.steps)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"expression", "steps": [[a, op, b, r], ...], "answer"}``."""
        return {"expression": self.expression, "steps": [list(s) for s in self.steps],
                "answer": self.answer}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Problem":
        p = problem_from_expression(d["expression"])
        if [list(s) for s in p.steps] != [list(s) for s in d["steps"]] or p.answer != d["answer"]:
            raise ValueError(f"problem dict {d!r} disagrees with its own expression")
        return p


def apply_op(a: int, op: str, b: int) -> int | None:
    """a op b for op in "+-*/"; ``/`` is exact integer division (None if b == 0 or b ∤ a)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a // b if b != 0 and a % b == 0 else None
    raise ValueError(f"unknown operator {op!r}; use one of {OPERATORS!r}")


def _format_expression(numbers: Sequence[int], ops: Sequence[str]) -> str:
    expr = str(numbers[0])
    for k, (op, n) in enumerate(zip(ops, numbers[1:])):
        expr = (f"({expr})" if k > 0 else expr) + f"{op}{n}"
    return expr


def _make_problem(numbers: Sequence[int], ops: Sequence[str]) -> Problem:
    steps, r = [], int(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        out = apply_op(r, op, int(n))
        if out is None:
            raise ValueError(f"{r}{op}{n} is not an exact integer division")
        steps.append((r, op, int(n), out))
        r = out
    return Problem(_format_expression(numbers, ops), tuple(steps), r)


def problem_from_expression(expression: str) -> Problem:
    """Parses a left-nested chain as ``generate_problem`` writes it, e.g. "((23+45)*3)-17"."""
    flat = expression.replace("(", "").replace(")", "")
    tokens = re.fullmatch(r"\d+(?:[-+*/]\d+)+", flat)
    if tokens is None:
        raise ValueError(f"{expression!r} is not a chain like '((23+45)*3)-17'")
    numbers = [int(x) for x in re.findall(r"\d+", flat)]
    ops = re.findall(r"[-+*/]", flat)
    problem = _make_problem(numbers, ops)
    if problem.expression != expression:
        raise ValueError(f"{expression!r} is not written in the canonical left-nested form "
                         f"{problem.expression!r}")
    return problem


def _check_knobs(num_steps: int, digits: int, operators: str, max_factor: int,
                 max_value: int | None) -> int:
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if not operators or set(operators) - set(OPERATORS) or len(set(operators)) != len(operators):
        raise ValueError(
            f"operators must be distinct characters of {OPERATORS!r}, got {operators!r}")
    if max_factor < 2:
        raise ValueError(f"max_factor (largest * or / operand) must be >= 2, got {max_factor}")
    hi = 10 ** digits - 1
    max_value = 10 ** (digits + 2) - 1 if max_value is None else max_value
    if max_value < hi:
        raise ValueError(f"max_value={max_value} is below the largest {digits}-digit number {hi}")
    return max_value


def _draw_operand(rng: np.random.Generator, r: int, op: str, lo: int, hi: int, max_factor: int,
                  max_value: int) -> int | None:
    """A valid operand for ``r op ?`` under the number rules, or None if there is none."""
    if op == "+":
        top = min(hi, max_value - r)
        return int(rng.integers(lo, top + 1)) if top >= lo else None
    if op == "-":
        top = min(hi, r)
        return int(rng.integers(lo, top + 1)) if top >= lo else None
    if op == "*":
        top = min(max_factor, max_value // r) if r >= 1 else 0
        return int(rng.integers(2, top + 1)) if top >= 2 else None
    divisors = [b for b in range(2, max_factor + 1) if r > 0 and r % b == 0]
    return int(divisors[rng.integers(len(divisors))]) if divisors else None


def _feasible(r: int, op: str, lo: int, hi: int, max_factor: int, max_value: int) -> bool:
    if op == "+":
        return r + lo <= max_value
    if op == "-":
        return r >= lo
    if op == "*":
        return 1 <= r and 2 * r <= max_value
    return r > 0 and any(r % b == 0 for b in range(2, max_factor + 1))


def generate_problem(rng: np.random.Generator, *, num_steps: int = 3, digits: int = 2,
                     operators: str = "+-*", max_factor: int = 9,
                     max_value: int | None = None) -> Problem:
    """One random K-step problem (K = ``num_steps``) under the number rules of the module docstring.

    Args:
        rng: a numpy Generator (``np.random.default_rng(seed)``); the only source of randomness.
        num_steps: K >= 1, the number of operations (K + 1 numbers).
        digits: d, the digit count of n_0 and of every ``+``/``-`` operand.
        operators: the allowed operators, distinct characters of "+-*/".
        max_factor: the largest ``*`` / ``/`` operand (>= 2).
        max_value: bound M on every intermediate result (None: 10^(d+2) - 1).
    """
    max_value = _check_knobs(num_steps, digits, operators, max_factor, max_value)
    lo, hi = 10 ** (digits - 1), 10 ** digits - 1
    for _ in range(MAX_REDRAWS):
        numbers, ops = [int(rng.integers(lo, hi + 1))], []
        r = numbers[0]
        for _ in range(num_steps):
            allowed = [op for op in operators if _feasible(r, op, lo, hi, max_factor, max_value)]
            if not allowed:
                break
            op = allowed[int(rng.integers(len(allowed)))]
            b = _draw_operand(rng, r, op, lo, hi, max_factor, max_value)
            ops.append(op)
            numbers.append(b)
            r = apply_op(r, op, b)
        else:
            return _make_problem(numbers, ops)
    raise ValueError(f"no valid {num_steps}-step chain found in {MAX_REDRAWS} draws with "
                     f"digits={digits}, operators={operators!r}, max_factor={max_factor}, "
                     f"max_value={max_value}; allow more operators or raise max_value")


def _distinct_problems(rng: np.random.Generator, n: int, exclude: set[str],
                       knobs: dict[str, Any]) -> list[Problem]:
    out, seen, misses = [], set(exclude), 0
    while len(out) < n:
        p = generate_problem(rng, **knobs)
        if p.expression in seen:
            misses += 1
            if misses > MAX_DUPLICATE_DRAWS:
                raise ValueError(
                    f"could not draw {n} distinct problems with knobs {knobs}: {len(out)} drawn, "
                    f"then {MAX_DUPLICATE_DRAWS} duplicates in a row (the problem space is too "
                    "small); raise digits or num_steps, or allow more operators")
            continue
        misses = 0
        seen.add(p.expression)
        out.append(p)
    return out


def make_splits(seed: int, n_train: int, n_test: int,
                **knobs: Any) -> tuple[list[Problem], list[Problem]]:
    """Seeded (train, test) lists of distinct problems; no expression is in both.

    ``knobs`` are ``generate_problem``'s keyword arguments. The test split depends only on
    (seed, n_test, knobs); the train split skips every test expression and a larger n_train
    extends a smaller one (same n_test).
    """
    train_ss, test_ss = np.random.SeedSequence(seed).spawn(2)
    test = _distinct_problems(np.random.default_rng(test_ss), n_test, set(), knobs)
    train = _distinct_problems(np.random.default_rng(train_ss), n_train,
                               {p.expression for p in test}, knobs)
    return train, test


# ----------------------------------------------------------------------------- texts

def prompt_text(problem: Problem) -> str:
    """``"Problem: <expression>\\n"``."""
    return f"Problem: {problem.expression}\n"


def format_solution(steps: Sequence[Step]) -> str:
    """``"Step k: a op b=r\\n"`` per step, then ``"Answer: r_K\\n"`` (r of the last step)."""
    lines = [f"Step {k}: {a}{op}{b}={r}\n" for k, (a, op, b, r) in enumerate(steps, start=1)]
    return "".join(lines) + f"Answer: {steps[-1][3]}\n"


def _carry(problem: Problem, j: int, delta: int) -> list[Step] | None:
    """The steps with r_j shifted by delta and propagated, or None if the chain breaks."""
    steps = list(problem.steps[: j - 1])
    a, op, b, r = problem.steps[j - 1]
    r = r + delta
    if r < 0:
        return None
    steps.append((a, op, b, r))
    for _, op, b, _ in problem.steps[j:]:
        a, r = r, apply_op(r, op, b)
        if r is None or r < 0:
            return None
        steps.append((a, op, b, r))
    return steps if r != problem.answer else None


def inject_error(problem: Problem, rng: np.random.Generator,
                 deltas: Sequence[int] = ERROR_DELTAS) -> tuple[list[Step], int]:
    """Written steps with one arithmetic slip, and the (1-based) step j where it happens.

    Step j's result is off by a delta in ``deltas``; later steps compute correctly from the wrong
    value. j is uniform over the steps that admit a valid delta, delta uniform over those.
    """
    options = {j: [d for d in deltas if _carry(problem, j, d) is not None]
               for j in range(1, problem.num_steps + 1)}
    options = {j: ds for j, ds in options.items() if ds}
    if not options:
        raise ValueError(f"no delta in {tuple(deltas)} gives a valid wrong chain for "
                         f"{problem.expression!r}; use positive deltas")
    js = sorted(options)
    j = js[int(rng.integers(len(js)))]
    delta = options[j][int(rng.integers(len(options[j])))]
    return _carry(problem, j, delta), j


def solution_steps(problem: Problem, *, error_rate: float = 0.0,
                   rng: np.random.Generator | None = None) -> tuple[list[Step], int | None]:
    """(written steps, injected error step or None): with probability ``error_rate`` one slip."""
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")
    if error_rate > 0.0:
        if rng is None:
            raise ValueError("error_rate > 0 needs an rng (np.random.default_rng(seed))")
        if rng.random() < error_rate:
            return inject_error(problem, rng)
    return list(problem.steps), None


def solution_text(problem: Problem, *, error_rate: float = 0.0,
                  rng: np.random.Generator | None = None) -> str:
    """The solution text (``format_solution``), with one slip with probability ``error_rate``."""
    return format_solution(solution_steps(problem, error_rate=error_rate, rng=rng)[0])


def sft_corpus(problems: Sequence[Problem], error_rate: float = 0.3, seed: int = 0) -> list[str]:
    """One document per problem: ``prompt_text + solution_text`` (slips at ``error_rate``)."""
    rng = np.random.default_rng(seed)
    return [prompt_text(p) + solution_text(p, error_rate=error_rate, rng=rng) for p in problems]


# ----------------------------------------------------------------------------- segmentation

def step_char_spans(response: str) -> list[tuple[int, int]]:
    """Half-open [start, end) character spans of the steps; they tile the whole response.

    start_1 = 0, start_k = the k-th ``Step <number>:`` match, end_k = start_{k+1}, the last
    end = len(response) (so the ``Answer:`` line is in the last step). No header: one span
    (0, len) if the response is non-empty, else [].
    """
    if not response:
        return []
    starts = [m.start() for m in _HEADER.finditer(response)]
    starts = [0] + starts[1:] if starts else [0]
    return list(zip(starts, starts[1:] + [len(response)]))


def first_response_index(prompt: str, tokenizer: Any) -> int:
    """Position of the first response token in ``[bos] + encode(prompt) + encode(response)``."""
    return 1 + len(tokenizer.encode(prompt))


def step_end_token_indices(prompt: str, response: str, tokenizer: Any) -> list[int]:
    """Per step (``step_char_spans``), the position of its last token in
    ``[bos] + encode(prompt) + encode(response)``; strictly increasing, the last one is the last
    response token. Raises ValueError if a prefix's encoding is not a prefix of the response's
    encoding (then character steps do not map onto tokens; use the byte tokenizer)."""
    base = first_response_index(prompt, tokenizer)
    full = list(tokenizer.encode(response))
    out = []
    for k, (_, end) in enumerate(step_char_spans(response), start=1):
        prefix = list(tokenizer.encode(response[:end]))
        if full[: len(prefix)] != prefix:
            raise ValueError(
                f"{tokenizer!r}: the encoding of the response up to the end of step {k} (char "
                f"{end}) is not a prefix of the response's encoding, so step ends are not token "
                "boundaries; use the byte tokenizer (data.tokenizer.type='byte')")
        if out and base + len(prefix) - 1 <= out[-1]:
            raise ValueError(f"{tokenizer!r}: step {k} adds no token of its own (char {end})")
        out.append(base + len(prefix) - 1)
    return out


# ----------------------------------------------------------------------------- checking

@dataclasses.dataclass(frozen=True)
class StepCheck:
    """The judgement of one written step (see the module docstring for the definitions)."""

    index: int                 # 1-based position among the written steps
    number: int | None         # the number written in its header (None: no header)
    text: str                  # response[char_start:char_end]
    char_start: int
    char_end: int
    parsed: Step | None        # (a, op, b, r) from the header line, None if unparseable
    arithmetic_ok: bool
    consistent: bool
    correct: bool


@dataclasses.dataclass(frozen=True)
class CheckResult:
    steps: tuple[StepCheck, ...]
    first_error: int | None    # 1-based; None iff exactly K steps, all correct
    answer: int | None
    answer_correct: bool       # the outcome label
    answer_consistent: bool    # answer == the last written step's parsed result
    num_steps_expected: int

    @property
    def step_labels(self) -> list[bool]:
        """``correct`` of each written step (evaluation only)."""
        return [s.correct for s in self.steps]

    @property
    def all_steps_correct(self) -> bool:
        return self.first_error is None


def _to_int(s: str) -> int | None:
    return int(s) if len(s) <= _MAX_INT_CHARS else None


def parse_step_line(line: str) -> Step | None:
    """(a, op, b, r) from ``"a op b = r"`` (the text after ``Step k:``), None if malformed."""
    m = _EQUATION.fullmatch(line)
    if m is None:
        return None
    a, b, r = (_to_int(m.group(i)) for i in (1, 3, 4))
    return None if a is None or b is None or r is None else (a, m.group(2), b, r)


def parse_answer(text: str) -> int | None:
    """The integer of the first line that starts with ``Answer:`` (None if absent or malformed)."""
    for line in text.split("\n"):
        m = _ANSWER_LINE.match(line)
        if m:
            n = _INT.fullmatch(m.group(1))
            return _to_int(n.group(1)) if n else None
    return None


def _judge(problem: Problem, i: int, number: int | None, parsed: Step | None,
           prev: StepCheck | None) -> tuple[bool, bool, bool]:
    if parsed is None:
        return False, False, False
    a, op, b, r = parsed
    arithmetic_ok = apply_op(a, op, b) == r  # None (inexact or by-zero division) != r
    if i > problem.num_steps:
        return arithmetic_ok, False, False
    true = problem.steps[i - 1]
    if i == 1:
        a_ok = a == true[0]
    else:
        a_ok = prev is not None and prev.parsed is not None and a == prev.parsed[3]
    consistent = a_ok and op == true[1] and b == true[2]
    return arithmetic_ok, consistent, number == i and parsed == true


def check_solution(problem: Problem, text: str) -> CheckResult:
    """Judges every written step and the answer of a solution text; never raises on bad text."""
    if not isinstance(text, str):
        text = str(text)
    headers = list(_HEADER.finditer(text))
    steps: list[StepCheck] = []
    for i, (start, end) in enumerate(step_char_spans(text), start=1):
        number, parsed = None, None
        if headers:
            h = headers[i - 1]
            number = _to_int(h.group(1))
            rest = text[h.end(): end]
            parsed = parse_step_line(rest.split("\n", 1)[0])
        ok, cons, correct = _judge(problem, i, number, parsed, steps[-1] if steps else None)
        steps.append(StepCheck(i, number, text[start:end], start, end, parsed, ok, cons, correct))
    K = problem.num_steps
    wrong = [s.index for s in steps if not s.correct]
    if len(steps) < K:
        wrong.append(len(steps) + 1)
    answer = parse_answer(text)
    last = steps[-1].parsed if steps else None
    return CheckResult(
        steps=tuple(steps), first_error=min(wrong) if wrong else None, answer=answer,
        answer_correct=answer is not None and answer == problem.answer,
        answer_consistent=answer is not None and last is not None and answer == last[3],
        num_steps_expected=K)
