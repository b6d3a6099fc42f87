"""A synthetic language with a known distribution: a random mixture of sparse Markov chains.

Axis letters: K chains, A alphabet letters (A + 1 columns = the letters then the end symbol).

Strings are words over ``alphabet`` (lower-case letters, one byte each, so the byte tokenizer maps
letter i to token ``ord(letter) + 3``) of length 1..``max_len``. Chain k generates a string by

  x_1 ~ init[k],  then after letter c: next letter or end ~ trans[k, c]   (end = column A)

and stops for sure at ``max_len`` letters. The source is the mixture P(x) = sum_k w_k P_k(x).
Every chain is sparse: ``branching`` first letters and ``branching`` successors per letter, with
Dirichlet(``concentration``) weights (small concentration = skewed rows), and the chain weights w
fall as k^-``zipf`` — so P has a few heavy modes and a long tail of low-probability ones.

Exact quantities: ``prob(x)`` (P of any string, 0 off the support), ``enumerate_support()``
(every string with P > 0 and its probability, summing to 1 up to float error), ``sample(n, rng)``
and ``write_corpus`` (one string per JSONL row, ``{"text": ...}``, readable by the data layer with
``config.data.name="jsonl"``). Everything is a deterministic function of the constructor's seed.
"""
from __future__ import annotations

import dataclasses
import json
import string

import numpy as np

from icml_jax.atomic import write_atomic

ALPHABET = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class MarkovMixture:
    """weights [K], init [K, A], trans [K, A, A + 1] (last column: end), max_len, alphabet."""

    weights: np.ndarray
    init: np.ndarray
    trans: np.ndarray
    max_len: int
    alphabet: str

    @property
    def num_letters(self) -> int:
        return len(self.alphabet)

    def prob(self, x: str) -> float:
        """Exact P(x); 0 for strings off the support (unknown letters, empty, too long)."""
        if not x or len(x) > self.max_len or any(c not in self.alphabet for c in x):
            return 0.0
        ids = [self.alphabet.index(c) for c in x]
        a_K = self.init[:, ids[0]].copy()
        for prev, nxt in zip(ids[:-1], ids[1:]):
            a_K *= self.trans[:, prev, nxt]
        if len(x) < self.max_len:
            a_K *= self.trans[:, ids[-1], self.num_letters]
        return float(self.weights @ a_K)

    def enumerate_support(self, max_size: int = 1_000_000) -> tuple[list[str], np.ndarray]:
        """(strings, P [N] float64) of every string with P(x) > 0, in length-then-prefix order.

        Raises a ValueError if the support has more than ``max_size`` strings."""
        A = self.num_letters
        out_x, out_p = [], []
        # frontier: prefixes with their per-chain prefix probabilities a[k] = P_k(prefix, no end yet)
        prefixes = [self.alphabet[i] for i in range(A) if self.init[:, i].any()]
        a_NK = np.stack([self.init[:, i] for i in range(A) if self.init[:, i].any()])
        last = np.array([i for i in range(A) if self.init[:, i].any()])
        for length in range(1, self.max_len + 1):
            end_NK = (self.trans[:, last, A].T if length < self.max_len
                      else np.ones_like(a_NK))
            p_N = (a_NK * end_NK) @ self.weights
            keep = p_N > 0
            out_x += [s for s, k in zip(prefixes, keep) if k]
            out_p.append(p_N[keep])
            if len(out_x) > max_size:
                raise ValueError(f"the support has more than max_size={max_size} strings; lower "
                                 "branching or max_len")
            if length == self.max_len:
                break
            step_NKC = a_NK[:, :, None] * self.trans[:, last, :A].transpose(1, 0, 2)
            n_idx, c_idx = np.nonzero(step_NKC.sum(1) > 0)
            prefixes = [prefixes[n] + self.alphabet[c] for n, c in zip(n_idx, c_idx)]
            a_NK = step_NKC[n_idx, :, c_idx]
            last = c_idx
        return out_x, np.concatenate(out_p)

    def sample(self, n: int, rng: np.random.Generator) -> list[str]:
        """``n`` independent strings from P."""
        A = self.num_letters
        ks = rng.choice(len(self.weights), size=n, p=self.weights)
        out = []
        for k in ks:
            c = rng.choice(A, p=self.init[k])
            s = [c]
            while len(s) < self.max_len:
                c = rng.choice(A + 1, p=self.trans[k, c])
                if c == A:
                    break
                s.append(c)
            out.append("".join(self.alphabet[i] for i in s))
        return out

    def describe(self) -> dict:
        return {"chains": len(self.weights), "letters": self.num_letters, "max_len": self.max_len,
                "weights": [round(float(w), 6) for w in self.weights]}


def _sparse_row(rng, n: int, k: int, concentration: float) -> np.ndarray:
    row = np.zeros(n)
    idx = rng.choice(n, size=min(k, n), replace=False)
    # a floor keeps every chosen entry >= ~floor: no near-zero "support" from the Dirichlet
    floor = 0.02
    row[idx] = (rng.dirichlet(np.full(len(idx), concentration)) + floor) / (1 + len(idx) * floor)
    return row


def random_markov_mixture(seed: int = 0, *, num_chains: int = 8, num_letters: int = 10,
                          branching: int = 3, max_len: int = 7, concentration: float = 0.5,
                          end_prob: tuple[float, float] = (0.1, 0.4),
                          zipf: float = 1.0) -> MarkovMixture:
    """A random sparse mixture (module docstring); ``end_prob`` = the range of each letter's
    probability of ending the string (uniform per chain and letter)."""
    if not 1 <= num_letters <= len(ALPHABET):
        raise ValueError(f"num_letters must be in [1, {len(ALPHABET)}], got {num_letters}")
    if num_chains < 1 or branching < 1 or max_len < 1:
        raise ValueError(f"num_chains, branching and max_len must be >= 1, got {num_chains}, "
                         f"{branching}, {max_len}")
    if not (concentration > 0 and 0 <= end_prob[0] <= end_prob[1] <= 1 and zipf >= 0):
        raise ValueError(f"need concentration > 0, 0 <= end_prob lo <= hi <= 1 and zipf >= 0; got "
                         f"{concentration}, {end_prob}, {zipf}")
    rng = np.random.default_rng(seed)
    K, A = num_chains, num_letters
    w = np.arange(1, K + 1, dtype=np.float64) ** -float(zipf)
    init = np.stack([_sparse_row(rng, A, branching, concentration) for _ in range(K)])
    trans = np.zeros((K, A, A + 1))
    for k in range(K):
        for c in range(A):
            e = rng.uniform(*end_prob)
            trans[k, c, :A] = (1 - e) * _sparse_row(rng, A, branching, concentration)
            trans[k, c, A] = e
    return MarkovMixture(weights=w / w.sum(), init=init, trans=trans, max_len=int(max_len),
                         alphabet=ALPHABET[:A])


def write_corpus(path: str, texts: list[str]) -> None:
    """One ``{"text": x}`` JSON row per string, written atomically (temp file + rename)."""
    write_atomic(path, "".join(json.dumps({"text": x}) + "\n" for x in texts))
