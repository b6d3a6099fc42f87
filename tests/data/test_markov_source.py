"""The synthetic Markov-mixture source: exact probabilities, enumeration, sampling, corpus."""
import json

import numpy as np
import pytest

from icml_jax.analysis import precision_recall as prm
from icml_jax.data.markov_source import random_markov_mixture, write_corpus


@pytest.fixture(scope="module")
def source():
    return random_markov_mixture(3, num_chains=3, num_letters=6, branching=2, max_len=4)


def test_support_is_exact_and_normalised(source):
    xs, p = source.enumerate_support()
    assert len(xs) == len(set(xs)) and np.all(p > 0)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    for i in range(0, len(xs), 7):
        assert source.prob(xs[i]) == pytest.approx(p[i], rel=1e-12)
    assert all(1 <= len(x) <= source.max_len and set(x) <= set(source.alphabet) for x in xs)
    assert source.prob("") == 0 and source.prob("z") == 0 and source.prob("a" * 9) == 0
    # a sparse chain: far fewer strings than all of the alphabet's strings up to max_len
    assert len(xs) < sum(6 ** n for n in range(1, 5)) / 4
    assert p.max() / p.min() > 100  # a long tail


def test_samples_follow_p(source):
    xs, p = source.enumerate_support()
    s = source.sample(4000, np.random.default_rng(0))
    assert all(source.prob(x) > 0 for x in s)
    freq = {x: 0 for x in xs}
    for x in s:
        freq[x] += 1
    emp = np.array([freq[x] for x in xs]) / len(s)
    assert 0.5 * np.abs(emp - p).sum() < 0.08  # total variation of 4000 samples


def test_metrics_are_one_for_p_and_fall_for_a_perturbed_model(source):
    _, p = source.enumerate_support()
    P, Q = prm.align(p, p)
    assert prm.precision_limit(P, Q) == pytest.approx(1.0)
    assert prm.threshold_recall(P, Q, 0.1) == pytest.approx(1.0)
    np.testing.assert_allclose(prm.alpha(P, Q, [0.1, 1.0, 10.0]), [0.1, 1.0, 1.0])
    # a model that sharpens P (T = 0.5 on the whole-string distribution) and leaks 10% off-support
    sharp = p ** 2 / (p ** 2).sum() * 0.9
    P, Q = prm.align(p, sharp)
    assert prm.precision_limit(P, Q) == pytest.approx(0.9)
    assert prm.threshold_recall(P, Q, 0.1) < 0.95
    assert prm.alpha(P, Q, 1.0) < 0.9


def test_corpus_rows_and_determinism(tmp_path, source):
    a = source.sample(50, np.random.default_rng(5))
    assert a == source.sample(50, np.random.default_rng(5))
    again = random_markov_mixture(3, num_chains=3, num_letters=6, branching=2, max_len=4)
    np.testing.assert_array_equal(again.trans, source.trans)
    path = tmp_path / "c" / "train.jsonl"
    write_corpus(str(path), a)
    assert [json.loads(line)["text"] for line in open(path)] == a


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="num_letters"):
        random_markov_mixture(num_letters=40)
    with pytest.raises(ValueError, match="max_size"):
        random_markov_mixture(0, branching=4, max_len=6).enumerate_support(max_size=100)
