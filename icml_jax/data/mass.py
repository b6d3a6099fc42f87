"""MASS (Li et al., ICML 2025) at tiny scale: rule-based skill tags on a synthetic arithmetic
corpus, the skill graph, graph-weighted similarity scores and top-x% selection
(docs/methods/mass.md).

Pure Python + numpy. The embeddings the scores need come from a model, so they are computed in
``icml_jax/analysis/mass.py``; everything here takes them as arrays.

Letters: N documents (target pool), R reference documents, K skills, E embedding width.

Skills (``SKILLS``), read from a document's text by ``tag_skills`` (rules, no model):

  add / sub / mul / div  a written step ``Step k: a op b=r`` uses that operator
  carry                  a ``+`` step carries in some digit column, or a ``-`` step borrows
  multi_step             two or more written steps
  parentheses            the ``Problem:`` line has a parenthesis
  word_problem           the ``Problem:`` line is prose (letters), not an expression

A document without any parseable step has no skill (prose, string puzzles). The tags describe
what is *written*, so a solution with a slip is tagged like a correct one.

Graph and scores (the spec's reconstruction, unverified against the paper):

  A_kl = #{r : k, l in T(r)} (k != l), A_kk = 0
  w    = frequency  (w_k proportional to #{r : k in T(r)})  or  PageRank(A), damping d, sum 1
  e_k  = mean of phi(r) over the reference documents tagged k
  score(x) = sum_k w_k cos(phi(x), e_k)   (``weighted_sum``)   or  max_k w_k cos(...)  (``weighted_max``)
  keep the ceil(x N) highest scores (ties: lower index first).
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import numpy as np

from icml_jax.data import arithmetic

SKILLS = ("add", "sub", "mul", "div", "carry", "multi_step", "parentheses", "word_problem")
NODE_WEIGHTS = ("pagerank", "frequency")
SCORE_AGGS = ("weighted_sum", "weighted_max")
TAGGERS = ("rules",)  # the paper's LLM tagger is out of scope here
KINDS = ("clean", "noisy", "string", "prose")
STYLES = ("expression", "flat", "word")

_OP_SKILL = {"+": "add", "-": "sub", "*": "mul", "/": "div"}


# ----------------------------------------------------------------------------- tagging

def _carries(a: int, b: int) -> bool:
    """Some digit column of a + b (a, b >= 0) sums to 10 or more."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def _borrows(a: int, b: int) -> bool:
    """Some digit column of a - b (a >= b >= 0) needs a borrow."""
    while a or b:
        if a % 10 < b % 10:
            return True
        a, b = a // 10, b // 10
    return False


def tag_skills(text: str) -> frozenset[str]:
    """The skills (``SKILLS``) a document uses, by the rules of the module docstring."""
    lines = text.split("\n")
    problem = next((ln[len("Problem:"):] for ln in lines if ln.startswith("Problem:")), "")
    steps = []
    for ln in lines:
        head, sep, rest = ln.partition(":")
        if sep and head.startswith("Step"):
            parsed = arithmetic.parse_step_line(rest)
            if parsed is not None:
                steps.append(parsed)
    if not steps:
        return frozenset()
    tags = {_OP_SKILL[op] for _, op, _, _ in steps}
    for a, op, b, _ in steps:
        if (op == "+" and a >= 0 and b >= 0 and _carries(a, b)) or \
                (op == "-" and a >= b >= 0 and _borrows(a, b)):
            tags.add("carry")
    if len(steps) >= 2:
        tags.add("multi_step")
    if "(" in problem or ")" in problem:
        tags.add("parentheses")
    if sum(c.isalpha() for c in problem) >= 3:
        tags.add("word_problem")
    return frozenset(tags)


def tag_matrix(tag_sets: Sequence[frozenset[str]], skills: Sequence[str] = SKILLS) -> np.ndarray:
    """[R, K] 0/1 float64: row r marks the skills of document r."""
    index = {s: k for k, s in enumerate(skills)}
    m = np.zeros((len(tag_sets), len(skills)))
    for r, tags in enumerate(tag_sets):
        for t in tags:
            if t in index:
                m[r, index[t]] = 1.0
    return m


# ----------------------------------------------------------------------------- the graph

@dataclasses.dataclass(frozen=True)
class SkillGraph:
    """Skills present in the reference set, their counts, co-occurrence and node weights."""

    skills: tuple[str, ...]   # K skill names (those tagged on at least one reference document)
    counts: np.ndarray        # [K] reference documents per skill
    cooc: np.ndarray          # [K, K] A_kl, zero diagonal
    weights: np.ndarray       # [K] w_k >= 0, sum 1

    def as_dict(self) -> dict:
        return {"skills": list(self.skills), "counts": self.counts.tolist(),
                "cooc": self.cooc.tolist(), "weights": self.weights.tolist()}


def cooccurrence(tags_RK: np.ndarray) -> np.ndarray:
    """A_kl = #{r : k, l in T(r)} for k != l, A_kk = 0."""
    a = tags_RK.T @ tags_RK
    np.fill_diagonal(a, 0.0)
    return a


def pagerank(adj_KK: np.ndarray, damping: float = 0.85, tol: float = 1e-12,
             max_iter: int = 10_000) -> np.ndarray:
    """PageRank of a weighted graph (edge k -> l with weight A_kl): power iteration on
    w = (1 - d)/K + d (P^T w + dangling mass / K), P the row-normalised A; returns w >= 0,
    sum 1. A node without edges spreads its mass uniformly (the usual dangling rule)."""
    if not 0.0 <= damping < 1.0:
        raise ValueError(f"mass_pagerank_damping={damping}: use a value in [0, 1)")
    a = np.asarray(adj_KK, np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or (a < 0).any():
        raise ValueError(f"pagerank needs a square non-negative matrix, got shape {a.shape}")
    k = a.shape[0]
    out = a.sum(1)
    p = np.divide(a, out[:, None], out=np.zeros_like(a), where=out[:, None] > 0)
    dangling = out == 0
    w = np.full(k, 1.0 / k)
    for _ in range(max_iter):
        new = (1 - damping) / k + damping * (p.T @ w + w[dangling].sum() / k)
        new /= new.sum()
        if np.abs(new - w).sum() < tol:
            return new
        w = new
    return w


def node_weights(counts_K: np.ndarray, cooc_KK: np.ndarray, method: str = "pagerank",
                 damping: float = 0.85) -> np.ndarray:
    """w_K (sum 1): ``frequency`` (proportional to the counts) or ``pagerank`` of the graph."""
    if method == "frequency":
        c = np.asarray(counts_K, np.float64)
        return c / c.sum()
    if method == "pagerank":
        return pagerank(cooc_KK, damping)
    raise ValueError(f"mass_node_weight={method!r}: choose one of {NODE_WEIGHTS}")


def skill_graph(tag_sets: Sequence[frozenset[str]], method: str = "pagerank",
                damping: float = 0.85, skills: Sequence[str] = SKILLS) -> SkillGraph:
    """The graph of the reference documents' tags, over the skills that occur in them."""
    full = tag_matrix(tag_sets, skills)
    present = full.sum(0) > 0
    if not present.any():
        raise ValueError("no reference document has a skill tag; the reference set must hold "
                         "tagged arithmetic documents")
    tags = full[:, present]
    counts = tags.sum(0)
    cooc = cooccurrence(tags)
    return SkillGraph(tuple(s for s, p in zip(skills, present) if p), counts, cooc,
                      node_weights(counts, cooc, method, damping))


# ----------------------------------------------------------------------------- scores

def skill_embeddings(emb_RE: np.ndarray, tags_RK: np.ndarray) -> np.ndarray:
    """e_K,E: the mean embedding of the reference documents tagged with each skill."""
    counts = tags_RK.sum(0)
    if (counts == 0).any():
        raise ValueError("a skill has no reference document; build the graph with skill_graph, "
                         "which keeps only the skills present")
    return (tags_RK.T @ np.asarray(emb_RE, np.float64)) / counts[:, None]


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.maximum(n, 1e-12)


def mass_scores(emb_NE: np.ndarray, skill_emb_KE: np.ndarray, weights_K: np.ndarray,
                agg: str = "weighted_sum") -> np.ndarray:
    """score_N: sum_k (or max_k) of w_k cos(phi(x), e_k)."""
    cos = _unit(np.asarray(emb_NE, np.float64)) @ _unit(np.asarray(skill_emb_KE, np.float64)).T
    weighted = cos * np.asarray(weights_K, np.float64)[None, :]
    if agg == "weighted_sum":
        return weighted.sum(1)
    if agg == "weighted_max":
        return weighted.max(1)
    raise ValueError(f"mass_score_agg={agg!r}: choose one of {SCORE_AGGS}")


def keep_count(n: int, ratio: float) -> int:
    """ceil(ratio * n), at least 1 (with a tolerance for ratios like 0.3 whose product is
    a hair above an integer in floating point)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"keep ratio {ratio}: use a value in (0, 1]")
    return max(1, min(n, math.ceil(ratio * n - 1e-9)))


def top_fraction(scores_N: np.ndarray, ratio: float) -> np.ndarray:
    """Indices (sorted ascending) of the ceil(ratio N) highest scores; ties keep lower indices."""
    s = np.asarray(scores_N, np.float64)
    if s.ndim != 1 or not np.isfinite(s).all():
        raise ValueError("selection scores must be a 1-D array of finite numbers")
    order = np.lexsort((np.arange(len(s)), -s))  # by score descending, then index
    return np.sort(order[:keep_count(len(s), ratio)])


# ----------------------------------------------------------------------------- the corpus

@dataclasses.dataclass(frozen=True)
class Row:
    """One synthetic document with what built it (for controls; the selection never reads it)."""

    text: str
    kind: str                     # clean | noisy | string | prose
    problem: arithmetic.Problem | None = None
    style: str = ""

    @property
    def prompt(self) -> str:
        return self.text.split("\n", 1)[0] + "\n"


_NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Ivy")
_THINGS = ("apples", "coins", "stamps", "shells", "cards", "beads")
_WORD_STEP = {"+": "gets {b} more", "-": "loses {b}", "*": "has {b} times that", "/": "keeps 1 of {b} parts"}


def problem_line(problem: arithmetic.Problem, style: str, rng: np.random.Generator) -> str:
    """``Problem: ...`` (no newline) in a style: ``expression`` (arithmetic.py's parentheses),
    ``flat`` (no parentheses; only for +/- chains, read left to right) or ``word``."""
    if style == "expression":
        return f"Problem: {problem.expression}"
    if style == "flat":
        if set(problem.operators) - set("+-"):
            raise ValueError("the flat style needs a +/- chain")
        return "Problem: " + str(problem.numbers[0]) + "".join(
            f"{op}{b}" for _, op, b, _ in problem.steps)
    if style == "word":
        who = _NAMES[int(rng.integers(len(_NAMES)))]
        thing = _THINGS[int(rng.integers(len(_THINGS)))]
        steps = ", then ".join(_WORD_STEP[op].format(b=b) for _, op, b, _ in problem.steps)
        return f"Problem: {who} has {problem.numbers[0]} {thing}, {steps}. How many?"
    raise ValueError(f"style={style!r}: choose one of {STYLES}")


def arithmetic_row(rng: np.random.Generator, *, num_steps: int, style: str, operators: str,
                   noisy: bool = False, digits: int = 1, max_factor: int = 9,
                   max_value: int | None = 99) -> Row:
    """A problem and its step-by-step solution; ``noisy``: one slip (arithmetic.inject_error)."""
    ops = "+-" if style == "flat" else operators
    p = arithmetic.generate_problem(rng, num_steps=num_steps, digits=digits, operators=ops,
                                    max_factor=max_factor, max_value=max_value)
    steps = arithmetic.inject_error(p, rng)[0] if noisy else list(p.steps)
    text = problem_line(p, style, rng) + "\n" + arithmetic.format_solution(steps)
    return Row(text, "noisy" if noisy else "clean", p, style)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PROSE = ("the", "ship", "sailed", "past", "a", "quiet", "harbour", "while", "old", "bells", "rang",
          "over", "grey", "water", "and", "gulls", "called", "from", "stone", "walls", "at", "dusk")


def string_row(rng: np.random.Generator) -> Row:
    """Off-skill, same layout: a string puzzle (reverse / sort / upper-case a short word)."""
    word = "".join(_LETTERS[int(i)] for i in rng.integers(0, 26, int(rng.integers(4, 9))))
    task = ("reverse", "sort", "upper")[int(rng.integers(3))]
    ans = word[::-1] if task == "reverse" else "".join(sorted(word)) if task == "sort" else word.upper()
    return Row(f"Problem: {task} {word}\nAnswer: {ans}\n", "string")


def prose_row(rng: np.random.Generator) -> Row:
    """Off-skill text: a few sentences from a small vocabulary."""
    out = []
    for _ in range(int(rng.integers(2, 4))):
        w = [_PROSE[int(i)] for i in rng.integers(0, len(_PROSE), int(rng.integers(6, 11)))]
        out.append(" ".join(w).capitalize() + ".")
    return Row(" ".join(out) + "\n", "prose")


@dataclasses.dataclass(frozen=True)
class Mix:
    """How arithmetic rows are drawn: probabilities of (steps, style, operator set) cells, and
    ``arithmetic.generate_problem``'s number knobs."""

    cells: tuple[tuple[int, str, str], ...]
    probs: tuple[float, ...]
    digits: int = 1
    max_value: int = 99

    def draw(self, rng: np.random.Generator, noisy: bool = False) -> Row:
        k, style, ops = self.cells[int(rng.choice(len(self.cells), p=np.asarray(self.probs)))]
        return arithmetic_row(rng, num_steps=k, style=style, operators=ops, noisy=noisy,
                              digits=self.digits, max_value=self.max_value)


# the reference / test distribution: every skill well represented (no one-step expressions: the
# pool holds nearly all of them, so none would be held out)
TARGET_MIX = Mix(cells=((2, "expression", "+-*/"), (3, "expression", "+-*/"), (2, "flat", "+-"),
                        (3, "flat", "+-"), (1, "word", "+-*/"), (2, "word", "+-*/")),
                 probs=(0.25, 0.15, 0.1, 0.1, 0.15, 0.25))
# the pool's arithmetic: mostly one-step + / - expressions
POOL_MIX = Mix(cells=((1, "expression", "+-"), (1, "expression", "*/"), (2, "expression", "+-*/"),
                      (3, "expression", "+-*/"), (2, "flat", "+-"), (1, "word", "+-*/"), (2, "word", "+-*/")),
               probs=(0.45, 0.1, 0.1, 0.05, 0.1, 0.1, 0.1))


def pool_rows(n: int, shares: dict[str, float], seed: int, mix: Mix = POOL_MIX) -> list[Row]:
    """``n`` documents of the mixed-quality target pool: round(share n) of each kind in ``KINDS``
    (shares sum to 1; the rest goes to ``clean``), shuffled."""
    unknown = sorted(set(shares) - set(KINDS))
    if unknown:
        raise ValueError(f"pool shares {unknown}: kinds are {KINDS}")
    if any(v < 0 for v in shares.values()) or sum(shares.values()) > 1 + 1e-9:
        raise ValueError(f"pool shares {shares} must be >= 0 and sum to at most 1")
    rng = np.random.default_rng(seed)
    counts = {k: int(round(shares.get(k, 0.0) * n)) for k in KINDS if k != "clean"}
    counts["clean"] = n - sum(counts.values())
    make = {"clean": lambda: mix.draw(rng), "noisy": lambda: mix.draw(rng, noisy=True),
            "string": lambda: string_row(rng), "prose": lambda: prose_row(rng)}
    rows = [make[k]() for k in KINDS for _ in range(counts[k])]
    return [rows[i] for i in rng.permutation(len(rows))]


def target_rows(n: int, seed: int, exclude: set[str] = frozenset(), mix: Mix = TARGET_MIX) -> list[Row]:
    """``n`` clean documents of the target distribution whose problem lines are not in ``exclude``
    (the reference set, the held-out test set)."""
    rng = np.random.default_rng(seed)
    out, seen = [], set(exclude)
    for _ in range(100 * n + 10_000):
        if len(out) == n:
            return out
        r = mix.draw(rng)
        if r.prompt not in seen:
            seen.add(r.prompt)
            out.append(r)
    if len(out) == n:
        return out
    raise ValueError(f"could not draw {n} distinct held-out problems ({len(out)} found); the mix's "
                     "problem space is too small: lower n or allow more steps / digits")


# ----------------------------------------------------------------------------- the pipeline option

class SelectedSource(Sequence):
    """The documents ``indices`` (ascending) of a source, in the source's order."""

    def __init__(self, source, indices: np.ndarray, description: str):
        self._source, self.indices, self.description = source, np.asarray(indices), description

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self._source[int(self.indices[i])]

    def __repr__(self) -> str:
        return f"SelectedSource({self.description}, {len(self)} documents)"


def read_scores(path: str) -> np.ndarray:
    """The per-document scores of a ``.npy`` file (one float per train document)."""
    if not path.endswith(".npy"):
        raise ValueError(f"config.data.select_scores={path!r}: expected a .npy file of one score "
                         "per train document (icml_jax.analysis.mass.write_scores writes one)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"config.data.select_scores={path!r} does not exist; write it with "
                                "icml_jax.analysis.mass.write_scores or set it to ''")
    try:
        s = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"config.data.select_scores={path!r} is not a readable .npy file ({e})") from e
    if s.ndim != 1 or not np.issubdtype(s.dtype, np.number) or not np.isfinite(s).all():
        raise ValueError(f"config.data.select_scores={path!r}: need a 1-D array of finite numbers, "
                         f"got shape {s.shape} dtype {s.dtype}")
    return s.astype(np.float64)


def check_select_config(data_cfg) -> tuple[str, float]:
    """(scores path, keep ratio) of ``config.data.select_scores`` / ``select_ratio``, checked."""
    path = str(getattr(data_cfg, "select_scores", "") or "")
    ratio = getattr(data_cfg, "select_ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise ValueError(f"config.data.select_ratio={ratio!r}: use a number in (0, 1] "
                         "(the share of train documents kept; 1 = all)")
    if ratio < 1.0 and not path:
        raise ValueError(f"config.data.select_ratio={ratio} needs config.data.select_scores (a .npy "
                         "of per-document scores, e.g. from icml_jax.analysis.mass.write_scores)")
    return path, float(ratio)


def select_source(source, data_cfg):
    """``source`` itself, or its top ``select_ratio`` documents by ``select_scores``."""
    path, ratio = check_select_config(data_cfg)
    if not path:
        return source
    scores = read_scores(path)
    if len(scores) != len(source):
        raise ValueError(f"config.data.select_scores={path!r} holds {len(scores)} scores but the "
                         f"train split ({source!r}) has {len(source)} documents; score this "
                         "config.data's train split")
    keep = top_fraction(scores, ratio)
    return SelectedSource(source, keep, f"top {ratio:g} of {source!r} by {path}")
