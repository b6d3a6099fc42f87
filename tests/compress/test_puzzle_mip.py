"""Puzzle's search (icml_jax/compress/puzzle_mip.py): the MIP equals brute force on small
libraries and meets every bound; the single-constraint DP equals the MIP; diversity; errors."""
import itertools

import numpy as np
import pytest

from icml_jax.compress import puzzle_mip as pm


def _library(rng, layers=4, variants=4):
    return {f"layer_{l}": {f"v{j}": {"metrics": {"kl": float(rng.random()), "acc": float(rng.random())},
                                     "stats": {"params": int(rng.integers(1, 20)),
                                               "kv": int(rng.integers(0, 5))}}
                           for j in range(variants)} for l in range(layers)}


def _brute(lib, objective, constraints, bigger=False):
    best = None
    for combo in itertools.product(*[list(lib[l]) for l in lib]):
        chosen = dict(zip(lib, combo))
        value, costs = pm.totals(lib, chosen, objective, constraints)
        if pm.feasible(costs, constraints) and (best is None or (value > best[1] if bigger else value < best[1])):
            best = (chosen, value, costs)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_mip_equals_brute_force_and_meets_bounds(seed):
    rng = np.random.default_rng(seed)
    lib = _library(rng)
    cons = {"stats.params": (20, 45), "stats.kv": 9}
    bigger = seed % 2 == 1
    objective = "metrics.acc" if bigger else "metrics.kl"
    want = _brute(lib, objective, cons, bigger)
    if want is None:
        with pytest.raises(pm.InfeasibleError):
            pm.solve(lib, objective, cons, bigger_is_better=bigger)
        return
    chosen, value, costs = pm.solve(lib, objective, cons, bigger_is_better=bigger)
    assert value == pytest.approx(want[1], abs=1e-9)
    assert 20 <= costs["stats.params"] <= 45 and costs["stats.kv"] <= 9
    assert set(chosen) == set(lib)


@pytest.mark.parametrize("seed", range(4))
def test_dp_matches_mip_with_one_constraint(seed):
    rng = np.random.default_rng(100 + seed)
    lib = _library(rng, layers=5, variants=3)
    _, v_mip, c_mip = pm.solve(lib, "metrics.kl", {"stats.params": 40})
    chosen, v_dp, c_dp = pm.solve_dp(lib, "metrics.kl", "stats.params", 40)
    assert v_dp == pytest.approx(v_mip, abs=1e-9) and c_dp <= 40
    assert pm.totals(lib, chosen, "metrics.kl", {})[0] == pytest.approx(v_dp)


def test_diversity_and_running_out():
    rng = np.random.default_rng(7)
    lib = _library(rng, layers=3, variants=2)  # 8 choices in all
    sols = pm.solve_many(lib, "metrics.kl", {"stats.params": 1000}, num_solutions=10, min_diversity=2)
    for i, a in enumerate(sols):
        for b in sols[:i]:
            assert sum(a["chosen"][l] != b["chosen"][l] for l in lib) >= 2
    assert 1 <= len(sols) < 10  # at most 4 choices pairwise 2 apart among 8
    values = [s["value"] for s in sols]
    assert values == sorted(values)  # each later solution is the best of what is left


def test_each_later_solution_is_the_best_under_the_exclusion_rule_and_open_budgets():
    """solve_many's k-th solution is the brute-force optimum among choices at least d layers away
    from every earlier one (the reference's multi_solution_mip_nas); a None budget is no bound,
    an infinite one too (as the reference reads them)."""
    rng = np.random.default_rng(11)
    lib = _library(rng, layers=3, variants=3)
    cons = {"stats.params": (10, None), "stats.kv": float("inf")}
    sols = pm.solve_many(lib, "metrics.kl", cons, num_solutions=4, min_diversity=2)
    assert len(sols) == 4
    combos = [dict(zip(lib, c)) for c in itertools.product(*[list(lib[l]) for l in lib])]
    for k, sol in enumerate(sols):
        allowed = [c for c in combos if pm.feasible(pm.totals(lib, c, "metrics.kl", cons)[1], cons)
                   and all(sum(c[l] != s["chosen"][l] for l in lib) >= 2 for s in sols[:k])]
        best = min(pm.totals(lib, c, "metrics.kl", cons)[0] for c in allowed)
        assert sol["value"] == pytest.approx(best, abs=1e-9), k
    unbounded = pm.solve(lib, "metrics.kl", {"stats.params": None})
    assert unbounded[1] == pytest.approx(_brute(lib, "metrics.kl", {})[1], abs=1e-9)


def test_a_solver_answer_that_breaks_a_bound_is_named_and_stops_solve_many_with_a_warning(monkeypatch):
    """HiGHS accepts a choice within its own feasibility tolerance; our check is tighter. A bound
    the cheapest choice misses by a hair (relative 1e-8, inside HiGHS's 1e-7 but outside our 1e-9)
    makes ``solve`` raise ToleranceError naming the budget, and ``solve_many`` warn and stop."""
    lib = {f"l{i}": {"a": {"m": {"kl": 1.0}, "s": {"p": 1.0 + 1e-8}}, "b": {"m": {"kl": 0.0}, "s": {"p": 5.0}}}
           for i in range(3)}
    with pytest.raises(pm.ToleranceError, match="s.p: total .* loosen that budget"):
        pm.solve(lib, "m.kl", {"s.p": 3.0})
    with pytest.warns(UserWarning, match="stopped after 0 solution"):
        assert pm.solve_many(lib, "m.kl", {"s.p": 3.0}, num_solutions=2) == []
