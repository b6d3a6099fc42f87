"""experiments/common: the shared stage helpers (caching with timing, presets, rounding, spreads)."""
import json
import math

import ml_collections
import numpy as np
import pytest

from experiments import common


def test_cached_reuses_a_matching_key_and_recomputes_a_changed_one(tmp_path):
    path = str(tmp_path / "r.json")
    calls = []

    def compute():
        calls.append(1)
        return {"value": len(calls)}
    key = common.preset(seeds=(0, 1), train=dict(train=dict(steps=3)))
    first = common.cached(path, key, compute, seconds_key="seconds")
    assert first["value"] == 1 and first["seconds"] >= 0
    assert first["key"] == {"seeds": [0, 1], "train": {"train": {"steps": 3}}}  # ConfigDict as dict
    again = common.cached(path, key.to_dict(), compute, seconds_key="seconds")
    assert again == first and len(calls) == 1
    key.seeds = (0, 2)
    changed = common.cached(path, key, compute)
    assert changed["value"] == 2 and "seconds" not in changed
    with open(path) as f:
        assert json.load(f)["value"] == 2


def test_preset_and_run_overrides():
    exp = common.preset(steps=4, train=dict(train=dict(steps=15, lr=1e-3), data=dict(seq_len=64)))
    assert common.run_overrides(exp.train) == {"train.steps": 15, "train.lr": 1e-3, "data.seq_len": 64}
    with pytest.raises(AttributeError):
        exp.step  # pylint: disable=pointless-statement
    cfg = ml_collections.ConfigDict({"train": {"steps": 1, "lr": 0.1}, "data": {"seq_len": 8}})
    cfg.update_from_flattened_dict(common.run_overrides(exp.train))
    assert (cfg.train.steps, cfg.data.seq_len) == (15, 64)


def test_round_up():
    assert [common.round_up(n) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert common.round_up(5, 4) == 8


def test_mean_spread_and_pm():
    xs = [0.5, 0.7, float("nan"), 0.9]
    m, s, n = common.mean_spread(xs, "std")
    assert n == 3 and m == pytest.approx(0.7) and s == pytest.approx(np.std([0.5, 0.7, 0.9], ddof=1))
    assert common.mean_spread(xs, "se")[1] == pytest.approx(s / math.sqrt(3))
    assert common.mean_spread(xs, "half_range")[1] == pytest.approx(0.2)
    assert common.mean_spread([2.0]) == (2.0, 0.0, 1)
    m, s, n = common.mean_spread([float("nan")])
    assert n == 0 and m != m
    assert common.pm(0.71234, 0.05, 2) == "0.71 ± 0.05" and common.pm(m, s) == "n/a"
    with pytest.raises(ValueError, match="spread"):
        common.mean_spread(xs, "iqr")
