"""EpiCoder's feature trees (Wang et al., ICML 2025), the algorithmic core only (docs/methods/epicoder.md).

A feature tree is a hierarchy of named features ("algorithm" > "sorting" > "quick sort") with a
frequency per node. The paper extracts the features from seed code with an LLM, evolves the tree
with an LLM and has an LLM write code from sampled subtrees; all three LLM steps are out of scope
here. What is here works on *given* features:

``FeatureTree.from_samples``  the tree of many samples' feature sets (nested dict / list / str, the
                              layout the authors' JSON files use); a node's frequency is the number of
                              samples that contain its path.
``FeatureTree.from_nested``   one nested structure, with optional frequencies per path; a missing
                              leaf frequency is 1, a missing inner one the sum of its children's.
``sample_subtree``            depth- and breadth-controlled sampling: at depth t (the root's
                              children are depth 1) keep min(breadth[t-1], #children) children drawn
                              without replacement (one at a time, each with probability
                              proportional to its weight among those left), weight = w^(1/T) with
                              w the node's frequency, its number of descendants or 1 (uniform); the
                              depth budget is len(breadth). ``fixed`` depth-1 features are always kept.
``subtree_distribution``      every subtree ``sample_subtree`` can return, with its exact probability.
``evolve``                    one evolution step: sample a subtree (weighted by descendants, as the
                              authors' evolution script does), let ``expand`` (an LLM in the paper,
                              any callable here) return an expanded copy, merge it into the tree; a
                              new node's frequency is the mean frequency of its old siblings in the
                              sampled subtree, or, without any, its parent's mean child frequency
                              (1 for a new depth-1 feature or a parent without children).
``kcenter_greedy``            seed selection: repeatedly add the point farthest from the chosen set.

Reference quirk behind a flag: the authors' sampler returns the *whole* remaining subtree below the
depth budget (``reference_tail=True``); by default a sampled subtree stops at the budget.
Paths are tuples of names. Pure Python + numpy; randomness through an explicit np.random.Generator.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

WEIGHTS = ("frequency", "descendants", "uniform")


@dataclasses.dataclass
class Node:
    name: str
    frequency: float = 1.0
    children: dict = dataclasses.field(default_factory=dict)  # name -> Node, in insertion order

    def copy(self) -> "Node":
        return Node(self.name, self.frequency, {k: c.copy() for k, c in self.children.items()})

    def size(self) -> int:
        """Nodes in this subtree, itself included (the authors' descendant count)."""
        return 1 + sum(c.size() for c in self.children.values())

    def depth(self) -> int:
        """Levels below this node (a leaf: 0)."""
        return 1 + max((c.depth() for c in self.children.values()), default=-1) if self.children else 0


def _walk_nested(obj, where: str):
    """(name, sub-structure) pairs of a nested feature structure: dict name -> sub, list of names or
    dicts, a bare name; None / [] / {} under a name = a leaf."""
    if obj is None:
        return []
    if isinstance(obj, str):
        return [(obj, None)]
    if isinstance(obj, Mapping):
        out = []
        for k, v in obj.items():
            if not isinstance(k, str) or not k:
                raise ValueError(f"feature tree: key {k!r} at {where or 'the top'} must be a non-empty string")
            out.append((k, v))
        return out
    if isinstance(obj, (list, tuple)):
        return [pair for item in obj for pair in _walk_nested(item, where)]
    raise ValueError(f"feature tree: {type(obj).__name__} at {where or 'the top'} is not a dict, list or "
                     "string of feature names")


def _merge_into(node: Node, obj, where: str = "") -> list[tuple]:
    """Adds the paths of ``obj`` under ``node``; returns the new nodes' paths (relative to node)."""
    new = []
    for name, sub in _walk_nested(obj, where):
        if name not in node.children:
            node.children[name] = Node(name)
            new.append((name,))
        new += [(name,) + p for p in _merge_into(node.children[name], sub, f"{where}/{name}")]
    return new


class FeatureTree:
    """A rooted tree of features; the root is unnamed and its children are the depth-1 features."""

    def __init__(self, root: Node | None = None):
        self.root = root or Node("")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_nested(cls, obj, frequencies: Mapping[tuple, float] | None = None) -> "FeatureTree":
        tree = cls()
        _merge_into(tree.root, obj)
        freq = dict(frequencies or {})
        for path in freq:
            tree.node(path)  # a KeyError names a path that is not in the tree

        def fill(node, path):
            for name, child in node.children.items():
                fill(child, path + (name,))
            if path:
                node.frequency = float(freq[path]) if path in freq else (
                    sum(c.frequency for c in node.children.values()) if node.children else 1.0)
        fill(tree.root, ())
        return tree

    @classmethod
    def from_samples(cls, samples: Iterable) -> "FeatureTree":
        """Each sample is one seed's nested features; frequency = samples containing the path."""
        counts: dict[tuple, int] = {}
        tree = cls()
        for i, s in enumerate(samples):
            one = cls()
            _merge_into(one.root, s, f"sample {i}")
            for path in one.paths():
                counts[path] = counts.get(path, 0) + 1
            _merge_into(tree.root, s, f"sample {i}")
        for path, n in counts.items():
            tree.node(path).frequency = float(n)
        return tree

    # ------------------------------------------------------------------ reading
    def node(self, path: Sequence[str]) -> Node:
        n = self.root
        for i, name in enumerate(path):
            if name not in n.children:
                raise KeyError(f"feature tree: no node {tuple(path[:i + 1])!r}")
            n = n.children[name]
        return n

    def paths(self) -> list[tuple]:
        """Every node's path, parents before children."""
        out = []

        def walk(node, path):
            for name, child in node.children.items():
                out.append(path + (name,))
                walk(child, path + (name,))
        walk(self.root, ())
        return out

    def depth(self) -> int:
        return self.root.depth()

    def max_breadth(self) -> list[int]:
        """Most children of any node at each depth (index 0: the root)."""
        out: list[int] = []

        def walk(node, t):
            if node.children:
                if len(out) <= t:
                    out.append(0)
                out[t] = max(out[t], len(node.children))
                for c in node.children.values():
                    walk(c, t + 1)
        walk(self.root, 0)
        return out

    def to_nested(self):
        """The authors' JSON layout: a dict for nodes with children, [] for leaves."""
        def conv(node):
            return {k: conv(c) for k, c in node.children.items()} if node.children else []
        return conv(self.root)

    def frequencies(self) -> dict[tuple, float]:
        return {p: self.node(p).frequency for p in self.paths()}

    def key(self) -> tuple:
        """A canonical, hashable form (children sorted): equal keys = the same subtree."""
        def k(node):
            return tuple(sorted((name, k(c)) for name, c in node.children.items()))
        return k(self.root)

    def copy(self) -> "FeatureTree":
        return FeatureTree(self.root.copy())


# ---------------------------------------------------------------------- sampling

def _budgets(breadth, depth):
    if isinstance(breadth, (int, np.integer)):
        if depth is None:
            raise ValueError("feature tree sampling: an int tree_breadth needs tree_depth")
        breadth = [int(breadth)] * int(depth)
    elif depth is not None and int(depth) != len(breadth):
        raise ValueError(f"feature tree sampling: tree_depth={depth} but {len(breadth)} per-level breadths given")
    breadth = [int(b) for b in breadth]
    if not breadth or any(b < 1 for b in breadth):
        raise ValueError(f"feature tree sampling: tree_breadth {breadth} must be >= 1 at each of >= 1 levels")
    return breadth


def _weights(children: Sequence[Node], weight: str, temperature: float) -> np.ndarray:
    """Selection probabilities of one node's children: w^(1/T) normalised (T >= 100: uniform)."""
    if weight not in WEIGHTS:
        raise ValueError(f"feature tree sampling: weight={weight!r}; choose one of {WEIGHTS}")
    if temperature <= 0:
        raise ValueError(f"feature tree sampling: temperature={temperature} must be > 0")
    w = np.array([c.frequency if weight == "frequency" else c.size() if weight == "descendants" else 1.0
                  for c in children], np.float64)
    if np.any(w <= 0):
        raise ValueError("feature tree sampling: node weights must be > 0")
    if temperature >= 100:
        w = np.ones_like(w)
    logw = np.log(w / w.sum()) / temperature
    p = np.exp(logw - logw.max())
    return p / p.sum()


def _fixed_first(children, fixed, depth_t):
    names = list(children)
    keep = [n for n in fixed if n in children] if depth_t == 1 else []
    return keep, [n for n in names if n not in keep]


def sample_subtree(tree: FeatureTree, rng: np.random.Generator, breadth, depth: int | None = None, *,
                   temperature: float = 1.0, weight: str = "frequency", fixed: Sequence[str] = (),
                   reference_tail: bool = False) -> FeatureTree:
    """One depth/breadth-controlled subtree (see the module docstring); frequencies are copied."""
    budget = _budgets(breadth, depth)

    def sample(node: Node, t: int) -> Node:
        out = Node(node.name, node.frequency)
        if t > len(budget):
            return node.copy() if reference_tail else out
        keep, rest = _fixed_first(node.children, fixed, t)
        k = min(max(budget[t - 1] - len(keep), 0), len(rest))
        chosen = list(keep)
        if k:
            p = _weights([node.children[n] for n in rest], weight, temperature)
            left = list(range(len(rest)))
            for _ in range(k):  # successive sampling: renormalise over what is left
                q = p[left] / p[left].sum()
                chosen.append(rest[left.pop(int(rng.choice(len(left), p=q)))])
        for name in chosen:
            out.children[name] = sample(node.children[name], t + 1)
        return out
    return FeatureTree(sample(tree.root, 1))


def _ordered_draw_prob(p: np.ndarray, order: Sequence[int]) -> float:
    prob, left = 1.0, 1.0
    for i in order:
        prob *= p[i] / left
        left -= p[i]
    return prob


def subtree_distribution(tree: FeatureTree, breadth, depth: int | None = None, *, temperature: float = 1.0,
                         weight: str = "frequency", fixed: Sequence[str] = (),
                         reference_tail: bool = False) -> dict[tuple, float]:
    """{subtree key: exact probability} over every subtree ``sample_subtree`` can return with these
    settings (enumerates all child sets: small trees only)."""
    budget = _budgets(breadth, depth)

    def dist(node: Node, t: int) -> list[tuple[tuple, float]]:
        """[(key of the sampled copy of node, probability)]"""
        if t > len(budget):
            return [(FeatureTree(node).key() if reference_tail else (), 1.0)]
        keep, rest = _fixed_first(node.children, fixed, t)
        k = min(max(budget[t - 1] - len(keep), 0), len(rest))
        p = _weights([node.children[n] for n in rest], weight, temperature) if rest else np.zeros(0)
        out: dict[tuple, float] = {}
        for subset in itertools.combinations(range(len(rest)), k):
            p_set = sum(_ordered_draw_prob(p, order) for order in itertools.permutations(subset))
            names = keep + [rest[i] for i in subset]
            for combo in itertools.product(*(dist(node.children[n], t + 1) for n in names)):
                key = tuple(sorted((n, ck) for n, (ck, _) in zip(names, combo)))
                out[key] = out.get(key, 0.0) + p_set * float(np.prod([cp for _, cp in combo]))
        return list(out.items())
    return dict(dist(tree.root, 1))


# ---------------------------------------------------------------------- evolution

def merge(tree: FeatureTree, expansion, sampled: FeatureTree | None = None) -> tuple[FeatureTree, list[tuple]]:
    """A copy of ``tree`` with the nested ``expansion`` merged in, and the new nodes' paths. New
    nodes' frequency: mean of their old siblings' in ``sampled`` (default: in ``tree``), else the
    parent's mean child frequency in ``tree``, else 1 (always 1 at depth 1, as in the authors'
    code, which gives new depth-1 features no frequency and samples them with weight 1)."""
    out = tree.copy()
    new = _merge_into(out.root, expansion)
    ref = sampled if sampled is not None else tree
    for path in new:
        parent = path[:-1]
        f = 1.0  # a new depth-1 feature, or one under a new parent / a former leaf
        if parent:
            sibs = [c.frequency for c in _children(ref, parent).values()]
            old = _children(tree, parent)
            if sibs:
                f = float(np.mean(sibs))
            elif old:
                f = float(np.mean([c.frequency for c in old.values()]))
        out.node(path).frequency = f
    return out, new


def _children(tree: FeatureTree, path) -> dict:
    try:
        return tree.node(path).children
    except KeyError:
        return {}


def evolve(tree: FeatureTree, expand: Callable, rng: np.random.Generator, breadth, depth: int | None = None, *,
           temperature: float = 1.0, weight: str = "descendants") -> tuple[FeatureTree, FeatureTree, list[tuple]]:
    """One evolution step: (evolved tree, the sampled subtree, new paths). ``expand`` takes the
    sampled subtree's nested form and returns an expanded nested tree (deeper and broader)."""
    sampled = sample_subtree(tree, rng, breadth, depth, temperature=temperature, weight=weight)
    evolved, new = merge(tree, expand(sampled.to_nested()), sampled)
    return evolved, sampled, new


# ---------------------------------------------------------------------- seed selection

def kcenter_greedy(X: np.ndarray, k: int, first: int = 0) -> tuple[np.ndarray, float]:
    """Indices of k points chosen by farthest-first traversal from ``first``, and the covering
    radius (the largest distance of any point to its nearest chosen point)."""
    X = np.asarray(X, np.float64)
    if not 1 <= k <= len(X):
        raise ValueError(f"kcenter_greedy: k={k} must be in [1, {len(X)}] (the number of points)")
    chosen = [int(first)]
    dist = np.linalg.norm(X - X[first], axis=1)
    for _ in range(k - 1):
        i = int(np.argmax(dist))
        if dist[i] == 0:  # every point is covered (duplicates): any unchosen one
            i = next(j for j in range(len(X)) if j not in chosen)
        chosen.append(i)
        dist = np.minimum(dist, np.linalg.norm(X - X[i], axis=1))
    return np.asarray(chosen), float(dist.max())


def select_seeds(X: np.ndarray, k: int, method: str = "kcenter", rng: np.random.Generator | None = None):
    """``seed_selection``: ``kcenter`` (farthest-first from a random start) or ``random``."""
    rng = rng or np.random.default_rng(0)
    if method == "kcenter":
        return kcenter_greedy(X, k, int(rng.integers(len(X))))[0]
    if method == "random":
        return rng.choice(len(X), k, replace=False)
    raise ValueError(f"seed_selection={method!r}; choose kcenter or random")
