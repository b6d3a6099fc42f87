"""A synthetic language with a known, long-tailed distribution: Zipf-weighted random strings.

Axis letters: N strings of the support.

The support is N distinct random strings over ``alphabet`` (lower-case letters, one byte each), of
lengths drawn uniformly from ``min_len..max_len`` with every letter uniform and independent, so no
string says anything about another beyond shared random prefixes: a model can learn a string only
by seeing it. The i-th string drawn (rank i = 1..N, in draw order, hence independent of length and
letters) has probability

  P(x_i) = i^-s / sum_j j^-s          (s = ``exponent``)

so a corpus of n samples sees string i about n·P(x_i) times: the head many times, the tail a few
times or never. The strings a model could put mass on instead (all strings up to ``max_len``) far
outnumber the support, so mass spread uniformly (a high sampling temperature) lands mostly off it.

Exact quantities, as ``icml_jax.data.markov_source``: ``prob(x)`` (0 off the support),
``enumerate_support()`` (the N strings in rank order and their probabilities, summing to 1),
``sample(n, rng)`` and ``describe()``; ``markov_source.write_corpus`` writes the samples as JSONL.
Everything is a deterministic function of the constructor's seed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from icml_jax.data.markov_source import ALPHABET


@dataclasses.dataclass(frozen=True)
class ZipfStrings:
    """strings (rank order), probs [N] (P of each, decreasing), exponent, alphabet."""

    strings: tuple[str, ...]
    probs: np.ndarray
    exponent: float
    alphabet: str

    def __post_init__(self):
        object.__setattr__(self, "_index", {x: i for i, x in enumerate(self.strings)})

    def prob(self, x: str) -> float:
        """Exact P(x); 0 for strings off the support."""
        i = self._index.get(x)
        return 0.0 if i is None else float(self.probs[i])

    def enumerate_support(self) -> tuple[list[str], np.ndarray]:
        """(strings, P [N] float64) of every string with P(x) > 0, in rank order."""
        return list(self.strings), self.probs.copy()

    def sample(self, n: int, rng: np.random.Generator) -> list[str]:
        """``n`` independent strings from P."""
        return [self.strings[i] for i in rng.choice(len(self.strings), size=n, p=self.probs)]

    def describe(self) -> dict:
        lengths = [len(x) for x in self.strings]
        return {"kind": "zipf", "strings": len(self.strings), "exponent": self.exponent,
                "letters": len(self.alphabet), "min_len": min(lengths), "max_len": max(lengths)}


def random_zipf_strings(seed: int = 0, *, num_strings: int = 5000, num_letters: int = 8,
                        min_len: int = 4, max_len: int = 8, exponent: float = 1.0) -> ZipfStrings:
    """``num_strings`` distinct random strings with Zipf(``exponent``) probabilities (module
    docstring). The strings of each length may fill at most half of that length's
    num_letters**length possible strings, so the support stays a sparse subset."""
    if not 1 <= num_letters <= len(ALPHABET):
        raise ValueError(f"num_letters must be in [1, {len(ALPHABET)}], got {num_letters}")
    if not 1 <= min_len <= max_len or num_strings < 1 or not exponent >= 0:
        raise ValueError(f"need 1 <= min_len <= max_len, num_strings >= 1 and exponent >= 0; got "
                         f"min_len={min_len}, max_len={max_len}, num_strings={num_strings}, "
                         f"exponent={exponent}")
    span = max_len - min_len + 1
    if num_strings > 0.5 * num_letters ** min_len * span:
        raise ValueError(f"num_strings={num_strings} is too many for a sparse support of strings of "
                         f"{min_len}..{max_len} letters over {num_letters} (at most "
                         f"{int(0.5 * num_letters ** min_len * span)}); raise min_len or num_letters")
    rng = np.random.default_rng(seed)
    alphabet = ALPHABET[:num_letters]
    seen, out = set(), []
    while len(out) < num_strings:
        n = int(rng.integers(min_len, max_len + 1))
        x = "".join(alphabet[i] for i in rng.integers(0, num_letters, size=n))
        if x not in seen:
            seen.add(x)
            out.append(x)
    w = np.arange(1, num_strings + 1, dtype=np.float64) ** -float(exponent)
    return ZipfStrings(strings=tuple(out), probs=w / w.sum(), exponent=float(exponent),
                       alphabet=alphabet)
