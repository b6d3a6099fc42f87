"""The synthetic Zipf source: exact probabilities, enumeration is the support, sampling."""
import collections

import numpy as np
import pytest

from icml_jax.data.zipf_source import random_zipf_strings


@pytest.fixture(scope="module")
def source():
    return random_zipf_strings(3, num_strings=300, num_letters=6, min_len=3, max_len=6,
                               exponent=1.2)


def test_probabilities_are_zipf_and_sum_to_one(source):
    xs, p = source.enumerate_support()
    assert len(xs) == len(set(xs)) == 300 and np.all(p > 0)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    ranks = np.arange(1, 301)
    np.testing.assert_allclose(p, ranks ** -1.2 / (ranks ** -1.2).sum(), rtol=1e-12)
    assert p[0] / p[-1] == pytest.approx(300 ** 1.2)  # the long tail
    for i in range(0, 300, 7):
        assert source.prob(xs[i]) == p[i]
    assert all(3 <= len(x) <= 6 and set(x) <= set("abcdef") for x in xs)
    assert {len(x) for x in xs} == {3, 4, 5, 6}  # every length is drawn


def test_enumeration_is_the_support(source):
    xs, _ = source.enumerate_support()
    support = set(xs)
    # every other string of those lengths (and the empty, too long, foreign ones) has P = 0
    rng = np.random.default_rng(0)
    others = ["".join("abcdef"[i] for i in rng.integers(0, 6, size=n)) for n in rng.integers(3, 7, 400)]
    others = [x for x in others if x not in support]
    assert len(others) > 300
    assert all(source.prob(x) == 0.0 for x in others + ["", "ab", "abcdefa", "zzz", xs[0] + "a"])
    assert source.describe() == {"kind": "zipf", "strings": 300, "exponent": 1.2, "letters": 6,
                                 "min_len": 3, "max_len": 6}


def test_sampler_frequencies_match_p(source):
    xs, p = source.enumerate_support()
    s = source.sample(20000, np.random.default_rng(0))
    counts = collections.Counter(s)
    assert set(counts) <= set(xs)
    emp = np.array([counts[x] for x in xs]) / len(s)
    assert 0.5 * np.abs(emp - p).sum() < 0.04  # total variation of 20,000 samples (~0.03 expected)
    # the head exactly: rank 1 within 4 standard errors
    assert abs(emp[0] - p[0]) < 4 * np.sqrt(p[0] * (1 - p[0]) / len(s))
    assert s[:50] == source.sample(50, np.random.default_rng(0))


def test_deterministic_in_the_seed_and_random_strings():
    a = random_zipf_strings(1, num_strings=200)
    assert a.strings == random_zipf_strings(1, num_strings=200).strings
    assert a.strings != random_zipf_strings(2, num_strings=200).strings
    # random strings: letters near uniform over the support (no structure to generalise from)
    letters = collections.Counter("".join(a.strings))
    share = np.array([letters[c] for c in a.alphabet]) / sum(letters.values())
    assert np.all(np.abs(share - 1 / 8) < 0.03)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="num_letters"):
        random_zipf_strings(num_letters=30)
    with pytest.raises(ValueError, match="min_len"):
        random_zipf_strings(min_len=5, max_len=4)
    with pytest.raises(ValueError, match="too many"):
        random_zipf_strings(num_strings=100, num_letters=2, min_len=2, max_len=3)
