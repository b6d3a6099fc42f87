"""Small synthetic SFT domains with injected conflicting samples (EVIC's testbed,
docs/methods/evic.md): multi-digit addition, string reversal, key-value lookup and a formatting
task, written as prompt-completion rows for the ``sft`` task.

  add   "add 37+85="          -> "122"
  rev   "rev kqzta="          -> "atzqk"
  kv    "kv a3 f8 m1 ?f="     -> "8"
  up    "up kqzta="           -> "KQZTA"

A corrupted row keeps its prompt and gets a conflicting completion: addition a wrong sum (off by
1..9), reversal the string copied unreversed, lookup the value of another key, formatting the
string copied in lower case (both copies: the format of another task). Rows carry ``domain`` and
``corrupt`` fields.
"""
from __future__ import annotations

import string

import numpy as np

DOMAINS = ("add", "rev", "kv", "up")
_LETTERS = np.array(list(string.ascii_lowercase))


def _add(rng, corrupt: bool, digits: int) -> tuple[str, str]:
    a, b = (int(rng.integers(10 ** (digits - 1), 10 ** digits)) for _ in range(2))
    ans = a + b
    if corrupt:
        ans = ans + int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
    return f"add {a}+{b}=", str(ans)


def _rev(rng, corrupt: bool, length: int) -> tuple[str, str]:
    s = "".join(rng.choice(_LETTERS, length))
    while s == s[::-1]:
        s = "".join(rng.choice(_LETTERS, length))
    return f"rev {s}=", s if corrupt else s[::-1]


def _kv(rng, corrupt: bool, pairs: int) -> tuple[str, str]:
    keys = rng.choice(_LETTERS, pairs, replace=False)
    vals = rng.integers(0, 10, pairs)
    while corrupt and len(set(vals.tolist())) == 1:
        vals = rng.integers(0, 10, pairs)
    q = int(rng.integers(pairs))
    ans = int(vals[q])
    if corrupt:
        ans = int(rng.choice([v for v in vals if v != vals[q]]))
    body = " ".join(f"{k}{v}" for k, v in zip(keys, vals))
    return f"kv {body} ?{keys[q]}=", str(ans)


def _up(rng, corrupt: bool, length: int) -> tuple[str, str]:
    s = "".join(rng.choice(_LETTERS, length))
    return f"up {s}=", s if corrupt else s.upper()


_MAKERS = {"add": _add, "rev": _rev, "kv": _kv, "up": _up}
_SIZE = {"add": 2, "rev": 5, "kv": 3, "up": 5}


def make_rows(n_per_domain: int, seed: int, *, corrupt_frac: float = 0.0,
              domains=("add", "rev", "kv"), sizes: dict | None = None) -> list[dict]:
    """``n_per_domain`` rows of each domain (interleaved), a ``corrupt_frac`` share of each
    domain's rows (exactly round(frac * n)) corrupted; ``sizes``: digits / string length /
    pairs / string length per domain. Rows: prompt, completion, domain, corrupt."""
    if not 0 <= corrupt_frac < 1:
        raise ValueError(f"corrupt_frac must be in [0, 1), got {corrupt_frac}")
    unknown = set(domains) - set(_MAKERS)
    if unknown:
        raise ValueError(f"unknown domains {sorted(unknown)}; choose from {DOMAINS}")
    size = {**_SIZE, **(sizes or {})}
    rng = np.random.default_rng(seed)
    per = {}
    for d in domains:
        bad = np.zeros(n_per_domain, bool)
        bad[rng.permutation(n_per_domain)[:round(corrupt_frac * n_per_domain)]] = True
        per[d] = []
        for c in bad:
            prompt, completion = _MAKERS[d](rng, bool(c), size[d])
            per[d].append({"prompt": prompt, "completion": completion, "domain": d,
                           "corrupt": bool(c)})
    return [per[d][i] for i in range(n_per_domain) for d in domains]


def is_correct(row: dict, completion: str) -> bool:
    """Whether ``completion`` is the right answer to ``row``'s prompt (recomputed from it)."""
    p = row["prompt"]
    if row["domain"] == "add":
        a, b = p[4:-1].split("+")
        return completion == str(int(a) + int(b))
    if row["domain"] == "rev":
        return completion == p[4:-1][::-1]
    if row["domain"] == "up":
        return completion == p[3:-1].upper()
    body, q = p[3:-1].split(" ?")
    table = {item[0]: item[1:] for item in body.split()}
    return completion == table[q]
