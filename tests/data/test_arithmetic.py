"""The arithmetic reasoning testbed: generator knobs, splits, texts, checker, error injection,
step segmentation and step-end token indices."""
import numpy as np
import pytest

from icml_jax.data import arithmetic as ar
from icml_jax.data.tokenizers import ByteTokenizer

HAND = "((23+45)*3)-17"
HAND_SOLUTION = "Step 1: 23+45=68\nStep 2: 68*3=204\nStep 3: 204-17=187\nAnswer: 187\n"


@pytest.fixture
def hand():
    return ar.problem_from_expression(HAND)


# ----------------------------------------------------------------------------- generator

@pytest.mark.parametrize("num_steps,digits,operators,max_factor", [
    (1, 1, "+", 9), (3, 2, "+-*", 9), (5, 2, "+-*/", 5), (4, 3, "-*", 7), (2, 1, "*", 3)])
def test_generate_problem_respects_knobs(num_steps, digits, operators, max_factor):
    rng = np.random.default_rng(0)
    lo, hi, max_value = 10 ** (digits - 1), 10 ** digits - 1, 10 ** (digits + 2) - 1
    used = set()
    for _ in range(40):
        p = ar.generate_problem(rng, num_steps=num_steps, digits=digits, operators=operators,
                                max_factor=max_factor)
        assert p.num_steps == len(p.steps) == num_steps
        assert lo <= p.numbers[0] <= hi
        prev = p.numbers[0]
        for a, op, b, r in p.steps:
            assert op in operators and a == prev and ar.apply_op(a, op, b) == r
            assert (2 <= b <= max_factor) if op in "*/" else (lo <= b <= hi)
            assert 0 <= r <= max_value
            used.add(op)
            prev = r
        python_value = eval(p.expression.replace("/", "//"))  # pylint: disable=eval-used
        assert p.answer == prev == python_value
        assert ar.problem_from_expression(p.expression) == p
        assert ar.Problem.from_dict(p.to_dict()) == p
    assert used == set(operators)


def test_generate_problem_max_value_deterministic_and_bad_knobs():
    a = [ar.generate_problem(np.random.default_rng(5), num_steps=6, max_value=500)
         for _ in range(2)]
    assert a[0] == a[1]
    rng = np.random.default_rng(1)
    for _ in range(30):
        assert all(0 <= s[3] <= 500 for s in ar.generate_problem(rng, num_steps=6,
                                                                  max_value=500).steps)
    for bad in (dict(num_steps=0), dict(digits=0), dict(operators="+%"), dict(operators=""),
                dict(operators="++"), dict(max_factor=1), dict(max_value=5)):
        with pytest.raises(ValueError):
            ar.generate_problem(rng, **bad)


def test_problem_from_expression_hand_and_rejects_noncanonical(hand):
    assert hand.steps == ((23, "+", 45, 68), (68, "*", 3, 204), (204, "-", 17, 187))
    assert hand.answer == 187 and hand.numbers == (23, 45, 3, 17) and hand.operators == "+*-"
    assert ar.problem_from_expression("23+45").expression == "23+45"
    for bad in ("23+45*3", "(23+45)", "7/2+1", "abc"):
        with pytest.raises(ValueError):
            ar.problem_from_expression(bad)


def test_make_splits_disjoint_deterministic_and_stable():
    knobs = dict(num_steps=2, digits=1, operators="+-")  # small space: collisions happen
    train, test = ar.make_splits(3, 60, 30, **knobs)
    assert len(train) == 60 and len(test) == 30
    tr, te = {p.expression for p in train}, {p.expression for p in test}
    assert len(tr) == 60 and len(te) == 30 and not tr & te
    assert (train, test) == ar.make_splits(3, 60, 30, **knobs)
    assert ar.make_splits(4, 60, 30, **knobs)[1] != test
    train2, test2 = ar.make_splits(3, 20, 30, **knobs)
    assert test2 == test and train2 == train[:20]
    assert all(p.num_steps == 2 for p in train + test)
    with pytest.raises(ValueError, match="too small"):
        ar.make_splits(0, 10_000, 10, num_steps=1, digits=1, operators="+")


# ----------------------------------------------------------------------------- texts

def test_texts_exact_on_hand_example(hand):
    assert ar.prompt_text(hand) == "Problem: ((23+45)*3)-17\n"
    assert ar.solution_text(hand) == HAND_SOLUTION
    docs = ar.sft_corpus([hand] * 50, error_rate=0.3, seed=1)
    assert docs == ar.sft_corpus([hand] * 50, error_rate=0.3, seed=1)
    assert all(d.startswith("Problem: ((23+45)*3)-17\nStep 1: ") for d in docs)
    assert HAND_SOLUTION in set(d[len(ar.prompt_text(hand)):] for d in docs)
    assert any(not d.endswith(HAND_SOLUTION) for d in docs)
    with pytest.raises(ValueError, match="rng"):
        ar.solution_text(hand, error_rate=0.5)


def test_error_injection_rate_and_checker_flags():
    rng = np.random.default_rng(0)
    problems = [ar.generate_problem(rng, num_steps=4, operators="+-*/") for _ in range(200)]
    n_err, positions = 0, set()
    for i in range(2000):
        p = problems[i % len(problems)]
        steps, j = ar.solution_steps(p, error_rate=0.3, rng=rng)
        res = ar.check_solution(p, ar.format_solution(steps))
        if j is None:
            assert res.first_error is None and res.answer_correct and res.answer_consistent
            continue
        n_err += 1
        positions.add(j)
        assert res.first_error == j and not res.answer_correct and res.answer_consistent
        slip = res.steps[j - 1]
        assert not slip.arithmetic_ok and slip.consistent and 1 <= abs(
            slip.parsed[3] - p.steps[j - 1][3]) <= 10
        assert all(s.arithmetic_ok and s.consistent and not s.correct for s in res.steps[j:])
        assert all(s.correct for s in res.steps[: j - 1])
    assert abs(n_err / 2000 - 0.3) < 0.04
    assert positions == {1, 2, 3, 4}


# ----------------------------------------------------------------------------- checker

def test_check_correct_solution(hand):
    res = ar.check_solution(hand, HAND_SOLUTION)
    assert res.first_error is None and res.all_steps_correct
    assert res.answer == 187 and res.answer_correct and res.num_steps_expected == 3
    assert res.step_labels == [True, True, True]
    assert [s.number for s in res.steps] == [1, 2, 3]
    assert res.steps[1].parsed == (68, "*", 3, 204) and res.steps[1].text == "Step 2: 68*3=204\n"
    spaced = "Step 1:  23 + 45 = 68\nStep 2: 68 * 3 = 204\nStep 3:204-17=187\nAnswer:187\n"
    assert ar.check_solution(hand, spaced).first_error is None


def test_check_arithmetic_slip_at_step_2(hand):
    text = "Step 1: 23+45=68\nStep 2: 68*3=194\nStep 3: 194-17=177\nAnswer: 177\n"
    res = ar.check_solution(hand, text)
    assert res.first_error == 2 and res.answer == 177 and not res.answer_correct
    assert res.step_labels == [True, False, False]
    s2, s3 = res.steps[1], res.steps[2]
    assert not s2.arithmetic_ok and s2.consistent
    assert s3.arithmetic_ok and s3.consistent and not s3.correct  # carried forward


def test_check_wrong_operand_with_right_arithmetic(hand):
    text = "Step 1: 23+45=68\nStep 2: 68*4=272\nStep 3: 272-17=255\nAnswer: 255\n"
    res = ar.check_solution(hand, text)
    s2 = res.steps[1]
    assert res.first_error == 2 and s2.arithmetic_ok and not s2.consistent and not s2.correct
    res = ar.check_solution(hand, "Step 1: 23-45=-22\n" + HAND_SOLUTION[17:])
    assert res.first_error == 1 and res.steps[0].parsed == (23, "-", 45, -22)
    assert res.steps[0].arithmetic_ok and not res.steps[0].consistent
    assert not res.steps[1].consistent  # its a (68) is not step 1's written result (-22)


def test_check_missing_and_extra_steps(hand):
    res = ar.check_solution(hand, "Step 1: 23+45=68\nStep 2: 68*3=204\nAnswer: 204\n")
    assert len(res.steps) == 2 and res.step_labels == [True, True]
    assert res.first_error == 3 and not res.answer_correct and res.answer_consistent
    res = ar.check_solution(hand, "Step 1: 23+45=68\nStep 3: 68*3=204\nAnswer: 204\n")
    assert res.first_error == 2 and res.steps[1].number == 3 and res.steps[1].consistent
    extra = HAND_SOLUTION.replace("Answer", "Step 4: 187+1=188\nAnswer")
    res = ar.check_solution(hand, extra)
    assert res.first_error == 4 and res.steps[3].arithmetic_ok and not res.steps[3].consistent
    assert res.answer_correct


def test_check_missing_answer_and_right_answer_wrong_step(hand):
    res = ar.check_solution(hand, HAND_SOLUTION.replace("Answer: 187\n", ""))
    assert res.first_error is None and res.answer is None and not res.answer_correct
    for bad in ("Answer: 18x7\n", "Answer:\n", "The Answer: 187\n"):
        res = ar.check_solution(hand, HAND_SOLUTION.replace("Answer: 187\n", bad))
        assert res.answer is None and not res.answer_correct
    text = "Step 1: 23+45=68\nStep 2: 68*3=214\nStep 3: 204-17=187\nAnswer: 187\n"
    res = ar.check_solution(hand, text)
    assert res.answer_correct and res.first_error == 2 and res.step_labels == [True, False, True]
    assert not res.steps[2].consistent  # it writes the true values, not step 2's result
    res = ar.check_solution(hand, "Step 1: junk\n" + HAND_SOLUTION[17:])
    assert res.first_error == 1 and res.steps[0].parsed is None and not res.steps[1].consistent
    assert ar.check_solution(hand, HAND_SOLUTION + "Answer: 5\n").answer == 187  # first wins
    res = ar.check_solution(hand, "Answer: 187\n")  # the outcome label ignores the steps
    assert res.answer_correct and res.first_error == 1 and len(res.steps) == 1


@pytest.mark.parametrize("text", [
    "", "\n\n", "Step", "Step 1:", "Step 1: 23+=68", "Answer: 188", "Step x: 1+1=2",
    "Step 1: 23+45=68Step 2: 68*3=204Step 3:", "Step 1: 1/0=0\nAnswer: -0\n",
    "Step 99999999999999999999: 23+45=68\n",
    "Step 1: " + "9" * 5000 + "+1=2\nAnswer: " + "9" * 5000,
    "Step 1: 2٣+45=68\n", "\x00\xff\ufffdStep 1: 23+45=68\n", "Step 1: 23+45=68\n" * 40])
def test_check_never_raises_on_garbage(hand, text):
    res = ar.check_solution(hand, text)
    assert res.first_error is not None and not res.answer_correct
    assert len(res.steps) == len(ar.step_char_spans(text))
    assert [(s.char_start, s.char_end) for s in res.steps] == ar.step_char_spans(text)
    if text:
        assert "".join(s.text for s in res.steps) == text


# ----------------------------------------------------------------------------- segmentation

def test_step_char_spans_tile_the_response():
    assert ar.step_char_spans(HAND_SOLUTION) == [(0, 17), (17, 34), (34, 65)]
    assert HAND_SOLUTION[34:65] == "Step 3: 204-17=187\nAnswer: 187\n"
    assert ar.step_char_spans("") == [] and ar.step_char_spans("12 xx") == [(0, 5)]
    assert ar.step_char_spans("ab Step 1: x Step 2: y") == [(0, 13), (13, 22)]


def test_step_end_token_indices_byte_tokenizer(hand):
    tok = ByteTokenizer()
    prompt = ar.prompt_text(hand)
    first = ar.first_response_index(prompt, tok)
    assert first == 1 + len(prompt)
    seq = [tok.bos_id] + tok.encode(prompt) + tok.encode(HAND_SOLUTION)
    ends = ar.step_end_token_indices(prompt, HAND_SOLUTION, tok)
    assert ends == [first + 16, first + 33, first + 64] and ends[-1] == len(seq) - 1
    assert all(b > a for a, b in zip(ends, ends[1:]))
    for (_, end), t in zip(ar.step_char_spans(HAND_SOLUTION), ends):
        assert tok.decode([seq[t]]) == HAND_SOLUTION[end - 1] == "\n"
        assert tok.decode(seq[first: t + 1]) == HAND_SOLUTION[:end]
    assert ar.step_end_token_indices(prompt, "", tok) == []
    wide = "é " + HAND_SOLUTION  # 2 bytes for é: char spans shift by 2, tokens by 3
    assert ar.step_end_token_indices(prompt, wide, tok) == [first + 19, first + 36, first + 67]


class _MergingTokenizer:
    """Encodes "bS" as one token, so a step that ends between the b and the S of the next
    header does not end on a token boundary."""

    def encode(self, text):
        return [ord(c) for c in text.replace("bS", "\x01")]

    def __repr__(self):
        return "_MergingTokenizer()"


def test_step_end_token_indices_rejects_non_prefix_tokenizer():
    tok = _MergingTokenizer()
    assert ar.step_end_token_indices("P\n", "Step 1: 1+1=2\nStep 2: 2+1=3\n", tok) == [16, 30]
    with pytest.raises(ValueError, match="not a prefix"):
        ar.step_end_token_indices("P\n", "Step 1: 1+1=2 bStep 2: 2+1=3\n", tok)
