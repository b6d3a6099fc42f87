"""Puzzle's architecture search (docs/methods/puzzle.md): one block variant per layer, chosen by a
mixed-integer program over a block library, as the authors' ``puzzle/mip_nas.py`` poses it, solved
with ``scipy.optimize.milp`` (HiGHS) instead of python-mip; plus an exact dynamic program for a
single cost constraint.

Library format (the reference's ``block_library.json``): ``{layer_id: {variant: stats}}`` where
``stats`` is a nested dict and keys are dotted paths into it, e.g. objective ``"metrics.kl_div"``,
constraint ``"stats.params"``. The program, with binary x[l, j]:

  minimise (or maximise) sum score(l, j) x[l, j]
  s.t.  sum_j x[l, j] = 1                      for every layer
        lo_c <= sum cost_c(l, j) x[l, j] <= hi_c   for every constraint c (a float = hi only)
        sum_{(l, j) in P} x[l, j] <= L - d       for every earlier solution P (diversity d)
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


class InfeasibleError(ValueError):
    """No choice of variants meets the constraints (or none was found within the time limit)."""


class ToleranceError(InfeasibleError):
    """The solver's choice breaks a constraint beyond ``rel_tol`` (HiGHS's feasibility tolerance is
    looser than our check; the reference asserts here)."""


def nested(stats: Mapping, key: str):
    """``stats["a"]["b"]`` for ``key`` "a.b"."""
    value = stats
    for part in key.split("."):
        value = value[part]
    return value


def _bounds(spec) -> tuple[float, float]:
    """(lo, hi) of a constraint: a number is an upper bound, a (lo, hi) pair both (None = open),
    None no bound at all (as the reference's ``mip_nas`` reads None)."""
    if spec is None:
        return -np.inf, np.inf
    if isinstance(spec, (tuple, list)):
        lo, hi = spec
        return (-np.inf if lo is None else float(lo)), (np.inf if hi is None else float(hi))
    return -np.inf, float(spec)


def _flatten(library: Mapping):
    layers = list(library)
    if not layers or any(not library[layer] for layer in layers):
        raise ValueError("the block library needs at least one layer and one variant per layer")
    index = [(layer, variant) for layer in layers for variant in library[layer]]
    return layers, index


def totals(library: Mapping, chosen: Mapping, objective: str, constraints: Mapping) -> tuple[float, dict]:
    """(objective sum, {constraint: cost sum}) of a choice of variants."""
    value = sum(float(nested(library[layer][v], objective)) for layer, v in chosen.items())
    costs = {c: sum(float(nested(library[layer][v], c)) for layer, v in chosen.items()) for c in constraints}
    return value, costs


def feasible(costs: Mapping, constraints: Mapping, rel_tol: float = 1e-9) -> bool:
    for c, spec in constraints.items():
        lo, hi = _bounds(spec)
        v = costs[c]
        if (v > hi and not math.isclose(v, hi, rel_tol=rel_tol)) or (v < lo and not math.isclose(v, lo, rel_tol=rel_tol)):
            return False
    return True


def solve(library: Mapping, objective: str, constraints: Mapping, *, bigger_is_better: bool = False,
          previous: Sequence[Mapping] = (), min_diversity: int = 1,
          time_limit: float | None = 60.0) -> tuple[dict, float, dict]:
    """The best variant per layer -> (chosen {layer: variant}, objective sum, cost sums).
    Raises ``InfeasibleError`` when no choice meets the constraints and the diversity rule."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    layers, index = _flatten(library)
    n = len(index)
    score = np.array([float(nested(library[l][v], objective)) for l, v in index])
    rows, lo, hi = [], [], []
    for layer in layers:  # exactly one variant per layer
        rows.append([1.0 if l == layer else 0.0 for l, _ in index])
        lo.append(1.0)
        hi.append(1.0)
    for c, spec in constraints.items():
        c_lo, c_hi = _bounds(spec)
        rows.append([float(nested(library[l][v], c)) for l, v in index])
        lo.append(c_lo)
        hi.append(c_hi)
    for sol in previous:  # differ from every earlier solution in >= min_diversity layers
        rows.append([1.0 if sol.get(l) == v else 0.0 for l, v in index])
        lo.append(-np.inf)
        hi.append(float(len(layers) - min_diversity))
    options = {} if time_limit is None else {"time_limit": float(time_limit)}
    res = milp(c=-score if bigger_is_better else score, integrality=np.ones(n),
               bounds=Bounds(np.zeros(n), np.ones(n)),
               constraints=LinearConstraint(np.array(rows), np.array(lo), np.array(hi)), options=options)
    if res.x is None:
        raise InfeasibleError(f"no variant choice meets {dict(constraints)} (solver: {res.message})")
    chosen = {l: v for (l, v), x in zip(index, res.x) if x > 0.5}
    if len(chosen) != len(layers):
        raise InfeasibleError(f"the solver returned no complete choice ({res.message})")
    value, costs = totals(library, chosen, objective, constraints)
    if not feasible(costs, constraints):  # a built-in check: HiGHS's tolerances, not ours
        broken = [f"{c}: total {costs[c]!r} outside {_bounds(spec)}" for c, spec in constraints.items()
                  if not feasible({c: costs[c]}, {c: spec})]
        raise ToleranceError(f"the solver's choice breaks a budget beyond its tolerance ({'; '.join(broken)}); "
                             "loosen that budget slightly (a relative 1e-6 is enough)")
    return chosen, value, costs


def solve_many(library: Mapping, objective: str, constraints: Mapping, *, num_solutions: int = 1,
               bigger_is_better: bool = False, min_diversity: int = 1,
               time_limit: float | None = 60.0) -> list[dict]:
    """Up to ``num_solutions`` solutions, each differing from every earlier one in
    >= ``min_diversity`` layers (fewer when the problem runs out of feasible choices; a warning
    says when the search stopped because the solver's answer broke a constraint instead)."""
    import warnings
    found = []
    for _ in range(num_solutions):
        try:
            chosen, value, costs = solve(library, objective, constraints, bigger_is_better=bigger_is_better,
                                         previous=[f["chosen"] for f in found], min_diversity=min_diversity,
                                         time_limit=time_limit)
        except ToleranceError as e:
            warnings.warn(f"puzzle solve_many stopped after {len(found)} solution(s): {e}", stacklevel=2)
            break
        except InfeasibleError:
            break
        found.append({"chosen": chosen, "value": value, "costs": costs})
    return found


def solve_dp(library: Mapping, objective: str, constraint: str, max_cost: float, *,
             bigger_is_better: bool = False) -> tuple[dict, float, float]:
    """Exact optimum under one upper-bounded cost by dynamic programming over the layers, keeping
    only the Pareto front of (cost, value) partial choices -> (chosen, value, cost)."""
    layers, _ = _flatten(library)
    sign = -1.0 if bigger_is_better else 1.0
    front = {0.0: (0.0, {})}  # cost -> (signed value, choice)
    for layer in layers:
        nxt = {}
        for cost, (val, choice) in front.items():
            for v, stats in library[layer].items():
                c = cost + float(nested(stats, constraint))
                if c > max_cost and not math.isclose(c, max_cost, rel_tol=1e-9):
                    continue
                s = val + sign * float(nested(stats, objective))
                if c not in nxt or s < nxt[c][0]:
                    nxt[c] = (s, {**choice, layer: v})
        if not nxt:
            raise InfeasibleError(f"no variant choice keeps {constraint} <= {max_cost}")
        front, best = {}, np.inf
        for c in sorted(nxt):  # drop choices that cost more without scoring better
            if nxt[c][0] < best:
                front[c], best = nxt[c], nxt[c][0]
    cost, (val, choice) = min(front.items(), key=lambda kv: (kv[1][0], kv[0]))
    return choice, sign * val, cost
