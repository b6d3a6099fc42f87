"""analysis/sparsity: CETT, the reference threshold search (parity), CETT-PPL-p%, baselines, laws (docs/methods/sparsity_cett.md)."""
import logging
import os

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import sparsity as S
from icml_jax.config_utils import load_config
from icml_jax.models import build_model

REF = os.path.join(os.path.dirname(__file__), "data", "cett_reference.npz")


def _aligned(N=64, F=32, D=8, seed=0):
    """Inputs whose neuron outputs a_j W_down[j] all point along one direction (CETT monotone)."""
    r = np.random.RandomState(seed)
    u = r.randn(D).astype(np.float32)
    w = (np.exp(r.randn(F, 1)) * u).astype(np.float32)
    a = np.abs(r.randn(N, F)).astype(np.float32) * (r.rand(N, F) < 0.7)
    a[:, 0] += 0.1  # no all-zero token
    return a, w


def _random(N=128, F=48, D=16, seed=1, silu=True):
    r = np.random.RandomState(seed)
    g, up = r.randn(2, N, F).astype(np.float32)
    a = (g / (1 + np.exp(-g)) if silu else np.maximum(g - 0.3, 0)) * up
    return a.astype(np.float32), (r.randn(F, D) * 0.2).astype(np.float32)


# ----------------------------------------------------------------------------- CETT and search


def test_neuron_norms_formula():
    a, w = _random()
    n = S.neuron_output_norms(a, w)
    chex.assert_shape(n, a.shape)
    chex.assert_type(n, jnp.float32)
    np.testing.assert_allclose(n, np.abs(a) * np.linalg.norm(w, axis=1), rtol=1e-6)


@pytest.mark.parametrize("maker", [_aligned, _random])
def test_cett_ends(maker):
    """CETT is 0 below the smallest neuron norm and 1 at (and above) the largest."""
    a, w = maker()
    n = np.asarray(S.neuron_output_norms(a, w))
    below = np.nextafter(np.float32(n.min()), np.float32(-1))
    assert S.cett(a, w, float(below)) == 0.0
    assert S.cett(a, w, float(n.max())) == pytest.approx(1.0, abs=1e-6)
    assert S.cett(a, w, float(n.max()) * 2) == pytest.approx(1.0, abs=1e-6)


def test_cett_monotone_on_aligned_inputs():
    """with aligned neuron outputs CETT is non-decreasing in t (and equals a norm share)."""
    a, w = _aligned()
    n = np.asarray(S.neuron_output_norms(a, w))
    ts = np.quantile(n, np.linspace(0, 1, 41))
    vals = [S.cett(a, w, float(t)) for t in ts]
    assert np.all(np.diff(vals) >= -1e-6), vals
    t = float(np.median(n))
    share = np.mean((n * (n <= t)).sum(1) / n.sum(1))  # aligned: norms add
    assert S.cett(a, w, t) == pytest.approx(share, rel=1e-5)


def test_cett_need_not_be_monotone():
    """Opposing neuron outputs: adding a neuron to the tail can shrink the tail norm (CETT may
    even exceed 1 before the last neuron joins)."""
    a = np.array([[1.0, 1.0, 0.5]], np.float32)
    w = np.array([[1.0, 0.0], [-1.5, 0.0], [0.0, 1.0]], np.float32)  # n = 1, 1.5, 0.5
    assert S.cett(a, w, 1.0) == pytest.approx(np.sqrt(1.25) / np.sqrt(0.5), rel=1e-6)
    assert S.cett(a, w, 1.0) > S.cett(a, w, 1.5) == pytest.approx(1.0)


@pytest.mark.parametrize("maker", [_aligned, _random])
@pytest.mark.parametrize("target", [0.05, 0.2, 0.5])
def test_threshold_brackets_target(maker, target):
    """The issue's 'tail ratio does not exceed the target': CETT(t*) <= c < CETT(next)."""
    a, w = maker()
    t = S.threshold_for_cett(a, w, target)
    grid = S.LayerStats([(a, w)]).grid_np[0]
    i = int(np.searchsorted(grid, np.float32(t)))
    assert grid[i] == np.float32(t)
    assert S.cett(a, w, t) <= target
    assert S.cett(a, w, float(grid[i + 1])) > target
    t_next = S.threshold_for_cett(a, w, target, index_rule="first_exceed")
    assert t_next == float(grid[i + 1])


def test_wrap_at_zero_edge(caplog):
    """when even G[0] exceeds c the reference's index -1 wraps to the top of the grid."""
    a, w = _random(silu=True)  # SiLU: no exact zeros, so CETT(min n) > 0
    grid = S.LayerStats([(a, w)]).grid_np[0]
    with caplog.at_level(logging.WARNING):
        t = S.threshold_for_cett(a, w, 0.0)
    assert t == float(grid[-1])
    assert "wraps" in caplog.text
    assert S.threshold_for_cett(a, w, 0.0, wrap_at_zero="clamp") == float(grid[0])


def test_activation_ratio_non_increasing_in_c():
    """On monotone inputs; with clamp and c -> 0 the ratio -> 1."""
    a, w = _aligned(N=128, F=64)
    n = np.asarray(S.neuron_output_norms(a, w))
    nz = n > 0
    ratios = []
    for c in (0.0, 1e-4, 0.01, 0.05, 0.1, 0.3, 0.6, 0.9):
        t = S.threshold_for_cett(a, w, c, wrap_at_zero="clamp")
        ratios.append(np.mean(n[nz] >= t))
    assert np.all(np.diff(ratios) <= 0), ratios
    assert ratios[0] == pytest.approx(1.0, abs=2.0 / nz.sum())


def test_kept_neurons_rule_and_ratio_from_arrays():
    """|a_j| < t/||w_j|| <=> n_j < t; "le" also zeroes the ties; the ratio is the kept share."""
    a, w = _aligned(N=64, F=32)
    n = np.asarray(S.neuron_output_norms(a, w))
    t = float(np.quantile(n, 0.7))
    keep = S.kept_neurons(a, w, t)
    assert keep.shape == a.shape and keep.dtype == bool
    assert np.mean(keep != (n >= t)) < 0.01  # same rule up to float rounding at the boundary
    assert S.activation_ratio_at(a, w, t) == pytest.approx(keep.mean())
    assert S.activation_ratio_at(a, w, 0.0) == 1.0
    assert S.activation_ratio_at(a, w, 0.0, compare="le") == pytest.approx(np.mean(np.abs(a) > 0))
    with pytest.raises(ValueError, match="compare='ge'"):
        S.kept_neurons(a, w, t, compare="ge")


def test_grid_matches_torch_linspace_formula():
    g = np.asarray(S.torch_linspace(0.1, 2.3, 9))
    step = np.float32((np.float32(2.3) - np.float32(0.1)) / np.float32(8))
    expect = [np.float32(0.1) + step * i if i < 4 else np.float32(2.3) - step * (8 - i) for i in range(9)]
    np.testing.assert_array_equal(g, np.array(expect, np.float32))
    assert g[0] == np.float32(0.1) and g[-1] == np.float32(2.3)


# ----------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def ref():
    return np.load(REF)


@pytest.mark.parametrize("c", [0.0, 0.05, 0.2, 0.5])
def test_threshold_parity_with_reference(ref, c):
    """The port reproduces calc_thresholds_given_cett (ReLU-style and SiLU-style layers) within one
    grid step, and the reference's activation ratio through mlp.py's zeroing rule."""
    layers = list(zip(ref["acts"], ref["w_down"]))
    stats = S.LayerStats(layers)
    ours = stats.thresholds(c)
    for lid, (a, w) in enumerate(layers):
        step = (stats.grid_np[lid][-1] - stats.grid_np[lid][0]) / 65535
        assert abs(ours[lid] - ref[f"thresholds_c{c}"][lid]) <= step, (lid, ours[lid])
        keep = ~(np.abs(a) < np.float32(ours[lid]) / np.linalg.norm(w, axis=1))
        assert keep.mean() == pytest.approx(ref[f"ratio_c{c}"][lid], abs=2.0 / a.size)


@pytest.mark.parametrize("name", ["0.1b_relu", "0.4b_relu", "0.1b_silu", "0.4b_silu"])
def test_fit_parity_with_released_curves(ref, name):
    """On their released data our fit is at least as good as the paper's (hand-tuned) curve, and
    on their curve sampled at their D it recovers the paper's parameters."""
    D, A = ref[f"fit_{name}_data"]
    alpha, b, c, A0 = ref[f"fit_{name}_params"]
    if "relu" in name:
        fit, clean = S.fit_relu_law(D, A), S.fit_relu_law(D, S.relu_law(D, alpha, b, c, A0))
        expect = dict(alpha=alpha, b=b, c=c, A0=A0)
    else:
        fit, clean = S.fit_silu_law(D, A), S.fit_silu_law(D, S.silu_law(D, alpha, c, A0))
        expect = dict(alpha=alpha, c=c, A0=A0)
    assert fit["mae"] <= float(ref[f"fit_{name}_mae"]) * 1.001
    for k, v in expect.items():
        assert clean[k] == pytest.approx(v, rel=1e-3, abs=1e-6), (k, clean)


# ----------------------------------------------------------------------------- laws


def test_laws_monotone_and_limit():
    D = np.geomspace(0.1, 1e4, 50)
    r = S.relu_law(D, 0.5, -3.0, 0.3, 0.07)
    s = S.silu_law(D, 0.5, 0.1, 0.4)
    assert np.all(np.diff(r) < 0) and np.all(np.diff(s) > 0)
    assert S.relu_law(1e12, 0.5, -3.0, 0.3, 0.07) == pytest.approx(0.07, abs=1e-9)
    assert S.silu_law(1e12, 0.5, 0.1, 0.4) == pytest.approx(0.4, abs=1e-6)


@pytest.mark.parametrize("true", [(0.5, -3.0, 0.3, 0.07), (1.0, -3.5, 0.01, 0.072), (0.101, -0.0151, 3.2, 0.0614)])
def test_relu_fit_recovers_synthetic(true):
    D = np.geomspace(0.8, 200, 25)
    A = S.relu_law(D, *true) * (1 + 1e-6 * np.random.RandomState(0).randn(D.size))
    fit = S.fit_relu_law(D, A)
    assert fit["valid"]
    for k, v in zip(("alpha", "b", "c", "A0"), true):
        assert fit[k] == pytest.approx(v, rel=2e-2, abs=2e-3), (k, fit)


@pytest.mark.parametrize("true", [(0.5, 0.1, 0.4), (1.0, 0.4, 0.385), (0.3, 0.05, 0.39)])
def test_silu_fit_recovers_synthetic(true):
    D = np.geomspace(0.8, 200, 25)
    A = S.silu_law(D, *true) * (1 + 1e-6 * np.random.RandomState(0).randn(D.size))
    fit = S.fit_silu_law(D, A)
    assert fit["valid"]
    for k, v in zip(("alpha", "c", "A0"), true):
        assert fit[k] == pytest.approx(v, rel=2e-2), (k, fit)


def test_fits_flag_data_against_the_law():
    """A rising ratio is not the ReLU law's form (nor a falling one SiLU's): the line fit's free
    slope sign must come back flagged, not as a 'valid' decreasing/increasing law."""
    D = np.geomspace(0.8, 200, 12)
    rising = 0.4 - 0.1 * D ** -0.5
    relu = S.fit_relu_law(D, rising)
    assert not relu["valid"] and not (relu["alpha"] > 0 and relu["c"] > 0)
    falling = np.exp(-0.3 * D ** 0.5 - 3.0) + 0.07
    silu = S.fit_silu_law(D, falling)
    assert not silu["valid"] and not (silu["alpha"] > 0 and silu["c"] > 0)


# ----------------------------------------------------------------------------- model level


def _model(tiny_config, activation="relu_glu", scan=False, init_std=0.02):
    tiny_config.model.mlp.activation = activation
    tiny_config.model.scan_layers = scan
    tiny_config.model.init_std = init_std
    m = build_model(tiny_config.model)
    B, T = 4, 32
    toks = jax.random.randint(jax.random.key(0), (B, T), 0, 256)
    seg = jnp.ones((B, T), jnp.int32).at[0, 20:].set(0).at[1, 10:].set(2)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = nn.meta.unbox(jax.jit(m.init)(jax.random.key(1), toks)["params"])
    batch = dict(inputs=toks, targets=jnp.roll(toks, -1, 1), positions=pos, segment_ids=seg)
    return m, params, batch


@pytest.fixture(scope="module")
def tiny_model():
    """``tiny_model(activation, scan, init_std)`` -> ``_model``'s (model, params, batch), built once
    per setting for the module (each build compiles an init); the batch is a new dict each call."""
    built = {}

    def get(activation="relu_glu", scan=False, init_std=0.02):
        key = (activation, scan, init_std)
        if key not in built:
            built[key] = _model(load_config("configs/lm.py:tiny", unlocked=True), *key)
        m, params, batch = built[key]
        return m, params, dict(batch)
    return get


def _dense_logits(m, params, batch):
    """The model's logits on ``batch``, compiled (one program, not one per op)."""
    return jax.jit(lambda p, *args: m.apply({"params": p}, *args))(
        params, batch["inputs"], batch["positions"], batch["segment_ids"])


def _stack_layers(params, L):
    return {"io": params["io"], "layers": jax.tree.map(lambda *x: jnp.stack(x), *[params[f"layer_{i}"] for i in range(L)])}


def test_collect_mlp_scan_and_loop_agree(tiny_config, tiny_model):
    m, params, batch = tiny_model()
    layers = S.collect_mlp(m, params, batch)
    L = tiny_config.model.num_layers
    assert len(layers) == L
    n_valid = int((np.asarray(batch["segment_ids"]) > 0).sum())
    for i, (a, w) in enumerate(layers):
        chex.assert_shape(a, (n_valid, tiny_config.model.ffn_dim))
        np.testing.assert_array_equal(w, params[f"layer_{i}"]["mlp"]["wo"])
    m2, _, _ = tiny_model(scan=True)
    layers2, sites = S.collect_mlp(m2, _stack_layers(params, L), batch, with_sites=True)
    assert sites.scanned and sites.paths == [("layers", "mlp")]
    for (a, w), (a2, w2) in zip(layers, layers2):
        np.testing.assert_allclose(a, a2, atol=1e-6)
        np.testing.assert_array_equal(w, w2)


@pytest.mark.parametrize("scan", [False, True])
def test_thresholds_tree_layout(tiny_config, scan):
    tiny_config.model.scan_layers = scan
    tree = S.thresholds_tree(tiny_config.model, [0.1, 0.2])
    if scan:
        np.testing.assert_allclose(tree["layers"]["mlp"]["threshold"], [0.1, 0.2])
    else:
        assert float(tree["layer_1"]["mlp"]["threshold"]) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="per-layer values"):
        S.thresholds_tree(tiny_config.model, [0.1])


@pytest.mark.parametrize("scan", [False, True])
def test_sparse_pass_at_zero_is_dense(tiny_model, scan):
    """all thresholds 0 => bit-identical logits; the kept ratio is 1 for SiLU."""
    m, params, batch = tiny_model("swiglu", scan)
    args = batch["inputs"], batch["positions"], batch["segment_ids"]
    dense = _dense_logits(m, params, batch)
    sparse = jax.jit(S.sparse_logits, static_argnums=0)(m, params, [0.0, 0.0], *args)
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(sparse))
    assert S.activation_ratio(m, params, [0.0, 0.0], [batch]) == 1.0


@pytest.mark.parametrize("scan", [False, True])
def test_sparse_ratio_matches_threshold_rule(tiny_model, scan):
    """The model's kept fraction equals the zeroing rule applied to the collected dense acts for
    layer 0 (later layers see sparsified inputs)."""
    m, params, batch = tiny_model("swiglu", scan)
    (a0, w0), _ = S.collect_mlp(m, params, batch)
    t0 = float(np.quantile(S.neuron_output_norms(a0, w0), 0.6))
    logits, keeps = jax.jit(S.sparse_apply, static_argnums=0)(
        m, params, [t0, 0.0], batch["inputs"], batch["positions"], batch["segment_ids"])
    keep0 = np.asarray(keeps[0][0] if scan else keeps[0]).reshape(-1, a0.shape[1])[np.asarray(batch["segment_ids"]).reshape(-1) > 0]
    np.testing.assert_array_equal(keep0, ~(np.abs(a0) < np.float32(t0) / np.linalg.norm(w0, axis=1)))
    np.testing.assert_array_equal(keep0, S.kept_neurons(a0, w0, t0))  # the array-level API
    assert S.activation_ratio_at(a0, w0, t0) == pytest.approx(keep0.mean(), abs=1e-12)


def test_cett_ppl_search_properties(tiny_config, tiny_model):
    """terminates with upper - lower <= tol; rho(lower) < 1 + p/100 <= rho(upper)."""
    m, params, batch = tiny_model("relu_glu", init_std=0.3)
    logits = _dense_logits(m, params, batch)
    batch["targets"] = jnp.argmax(logits, -1)  # the dense model is right: sparsity must cost PPL
    p = 1.0
    res = S.cett_ppl_search(m, params, [batch], p=p)
    assert res["upper"] - res["lower"] <= 1e-6 and res["iterations"] <= 21
    assert res["upper"] < 1.0, "the search never moved upper; the test model is too insensitive"
    rho = {c: r for c, r, _ in res["history"]}
    assert rho[res["upper"]] >= 1 + p / 100
    if res["lower"] > 0:
        assert rho[res["lower"]] < 1 + p / 100
    assert res["cett"] == pytest.approx((res["lower"] + res["upper"]) / 2)
    assert res["sparsity"] == pytest.approx(1 - res["activation_ratio"])
    assert 0 < res["activation_ratio"] < 1 and len(res["thresholds"]) == tiny_config.model.num_layers
    assert res["ppl_sparse"] / res["ppl_dense"] == pytest.approx(res["ppl_ratio"])
    loose = S.cett_ppl_search(m, params, [batch], p=20.0, tol=1e-3)
    assert loose["activation_ratio"] <= res["activation_ratio"]  # more PPL allowed -> sparser


def test_cett_search_over_checkpoints_is_one_cett_on_the_mean_ppl_ratio(tiny_model):
    """The authors' protocol: bisection on the mean PPL ratio of several checkpoints, the result
    rounded to 4 decimals and applied to each checkpoint with that checkpoint's own thresholds."""
    m, params, batch = tiny_model("relu_glu", init_std=0.3)
    batch["targets"] = jnp.argmax(_dense_logits(m, params, batch), -1)
    other = jax.tree_util.tree_map(lambda x: x * 1.3, params)  # a second, different "checkpoint"
    one = S.cett_ppl_search_checkpoints(m, [params], [batch], digits=None)
    ref = S.cett_ppl_search(m, params, [batch], tol=1e-3)  # one checkpoint: the plain search
    assert one["cett"] == pytest.approx(ref["cett"], abs=1e-12) and one["iterations"] == ref["iterations"]
    res = S.cett_ppl_search_checkpoints(m, [params, other], [batch], p=1.0)
    assert res["upper"] - res["lower"] <= 1e-3 and res["upper"] < 1.0
    assert res["cett"] == round(res["cett_unrounded"], 4) and res["cett"] != res["cett_unrounded"]
    mean = dict(res["history"])
    assert mean[res["upper"]] >= 1.01 and (res["lower"] == 0 or mean[res["lower"]] < 1.01)
    singles = [S.cett_ppl_search(m, pr, [batch], tol=1e-3)["cett"] for pr in (params, other)]
    assert min(singles) - 2e-3 <= res["cett_unrounded"] <= max(singles) + 2e-3  # between the two
    for pr, rho in zip((params, other), res["ppl_ratios"]):
        at = S.sparsity_at_cett(m, pr, [batch], res["cett"])
        assert at["ppl_ratio"] == pytest.approx(rho, rel=1e-9)
        assert at["thresholds"] == S.LayerStats(S.collect_mlp(m, pr, batch)).thresholds(res["cett"])
        assert at["activation_ratio"] == pytest.approx(S.activation_ratio(m, pr, at["thresholds"], [batch]))
    assert res["mean_ppl_ratio"] == pytest.approx(np.mean(res["ppl_ratios"]))
    with pytest.raises(ValueError, match="at least one checkpoint"):
        S.cett_ppl_search_checkpoints(m, [], [batch])


def test_fat_baseline(tiny_model):
    """FAT-0 removes exactly ReLU's zero gates (no PPL change); a huge eps removes everything."""
    m, params, batch = tiny_model("relu_glu", init_std=0.3)
    fat0 = S.fat_baseline(m, params, [batch], 0.0)
    assert 0 < fat0["activation_ratio"] < 1
    assert fat0["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    gates = S.collect_gate_up(m, params, batch)
    assert fat0["activation_ratio"] == pytest.approx(np.mean([np.mean(g > 0) for g, _ in gates]), abs=1e-6)
    assert S.fat_baseline(m, params, [batch], 1e9)["activation_ratio"] == 0.0


@pytest.mark.parametrize("scope", ["global", "per_token"])
def test_topk_baseline_keeps_fraction(tiny_config, tiny_model, scope):
    m, params, batch = tiny_model("swiglu")  # no exact zeros in SiLU gates
    k, F = 0.3, tiny_config.model.ffn_dim
    res = S.topk_baseline(m, params, [batch], k, scope)
    n = int((np.asarray(batch["segment_ids"]) > 0).sum())
    kept = (n * F - int(n * F * (1 - k))) / (n * F) if scope == "global" else (F - int(F * (1 - k))) / F
    assert res["activation_ratio"] == pytest.approx(kept, abs=1e-9)


def test_collect_gate_up_products(tiny_model):
    m, params, batch = tiny_model("swiglu")
    acts = S.collect_mlp(m, params, batch)
    for (g, u), (a, _) in zip(S.collect_gate_up(m, params, batch), acts):
        np.testing.assert_allclose(g * u, a, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- errors


def test_errors(tiny_config, tiny_model):
    a, w = _random()
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"target CETT must lie in \[0, 1\]"):
            S.threshold_for_cett(a, w, bad)
    with pytest.raises(ValueError, match="disagree on F"):
        S.cett(a, w[:-1], 0.1)
    with pytest.raises(ValueError, match="N = 0"):
        S.threshold_for_cett(a[:0], w, 0.1)
    with pytest.raises(ValueError, match="cett_threshold_index"):
        S.threshold_for_cett(a, w, 0.1, index_rule="next")
    m, params, batch = tiny_model("relu")
    with pytest.raises(ValueError, match="needs a gated"):
        S.collect_gate_up(m, params, batch)
    g, u = S.collect_gate_up(m, params, batch, require_gate=False)[0]
    assert u is None and g.shape[1] == tiny_config.model.ffn_dim
    with pytest.raises(ValueError, match="p .* must be > 0"):
        S.cett_ppl_search(m, params, [batch], p=0.0)
    empty = dict(batch, segment_ids=jnp.zeros_like(batch["segment_ids"]))
    with pytest.raises(ValueError, match="segment_id > 0"):
        S.collect_mlp(m, params, empty)
    with pytest.raises(ValueError, match="topk_scope"):
        S.topk_baseline(m, params, [batch], 0.5, scope="row")
    with pytest.raises(ValueError, match="at least two distinct|>= 4 points"):
        S.fit_silu_law([1, 2, 3], [0.1, 0.2, 0.3])
