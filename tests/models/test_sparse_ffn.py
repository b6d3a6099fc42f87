"""The decode-time sparse FFN equals the masked dense MLP of models/mlp.py (sparsity collection)."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl.testing import parameterized

from icml_jax.config_utils import load_config
from icml_jax.models import sparse_ffn as sf
from icml_jax.models.mlp import ACTIVATIONS

D, F = 48, 256


def _mlp(activation, compare="lt"):
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model  # every key the modules read
    cfg.update(d_model=D, ffn_dim=F, dtype="float32", param_dtype="float32", init_std=0.2)
    cfg.mlp.update(activation=activation, sparse_compare=compare)
    module = ACTIVATIONS.get(activation)(ml_collections.FrozenConfigDict(cfg))
    x = jax.random.normal(jax.random.key(1), (1, 1, D))
    params = nn.meta.unbox(jax.jit(module.init)(jax.random.key(0), x)["params"])
    return module, params, x


def _reference(module, params, x, t, gate_threshold=None):
    sp = {"threshold": jnp.float32(t)}
    if gate_threshold is not None:
        sp["gate_threshold"] = jnp.float32(gate_threshold)
    return _masked_dense(module, params, sp, x)


@functools.partial(jax.jit, static_argnums=0)
def _masked_dense(module, params, sparsity, x):
    """The masked dense MLP (thresholds traced: one compile per module and tree structure)."""
    (y, acts), mut = module.apply({"params": params, "sparsity": sparsity}, x, mutable=["intermediates"])
    return y[0, 0], acts[0, 0], mut["intermediates"]["mlp_keep"][0][0, 0] > 0


@functools.partial(jax.jit, static_argnums=0)
def _dense(module, params, x):
    return module.apply({"params": params}, x)[0][0, 0]


def _threshold_keeping(acts_F, w_FD, frac):
    """A CETT threshold t that keeps about ``frac`` of the neurons (n_j = |a_j| ||W_down[j]||)."""
    n = np.abs(np.asarray(acts_F)) * np.linalg.norm(np.asarray(w_FD), axis=1)
    return float(np.quantile(n, 1 - frac))


class SparseFFNTest(parameterized.TestCase):

    # eagerly sparse_ffn runs the same code (its branch is a lax.cond either way), compiling every primitive
    @chex.variants(with_jit=True)
    @parameterized.parameters(("relu_glu", 0.05, "lt"), ("relu_glu", 0.3, "le"), ("swiglu", 0.05, "lt"),
                              ("swiglu", 0.3, "le"))
    def test_equals_masked_dense_sparse_and_overflow(self, activation, frac, compare):
        module, params, x = _mlp(activation, compare)
        w = sf.prepare(params)
        _, acts, _ = _reference(module, params, x, 0.0)
        t = _threshold_keeping(acts, params["wo"], frac)
        y_ref, _, keep_ref = _reference(module, params, x, t)
        y_dense = _dense(module, params, x)
        assert float(jnp.abs(y_ref - y_dense).max()) > 1e-3  # the mask matters: the test has teeth
        g = sf._gate_fn(activation)(w.w_gate_FD @ x[0, 0])
        n_cand = int(sf.candidates(w, x[0, 0], g, t, compare=compare).sum())
        assert n_cand < F  # the bound rules some neurons out at this threshold
        for capacity, expect_sparse in ((n_cand, True), (max(n_cand - 1, 1), False), (F, True)):
            fn = self.variant(functools.partial(sf.sparse_ffn, activation=activation, capacity=capacity,
                                                compare=compare, return_stats=True))
            y, stats = fn(w, x, t)
            chex.assert_shape(y, x.shape)
            assert bool(stats["sparse"]) == expect_sparse, (capacity, n_cand)
            assert int(stats["candidates"]) == n_cand
            assert int(stats["kept"]) == int(keep_ref.sum()) <= n_cand
            chex.assert_trees_all_close(y[0, 0], y_ref, atol=2e-5, rtol=2e-5)

    @parameterized.parameters("relu_glu", "swiglu")
    def test_every_kept_neuron_is_a_candidate(self, activation):
        """The Cauchy-Schwarz pre-filter never drops a neuron the threshold rule keeps."""
        module, params, _ = _mlp(activation)
        w = sf.prepare(params)
        xs = jax.random.normal(jax.random.key(7), (64, D)) * jnp.linspace(0.1, 3, 64)[:, None]
        ts = jnp.tile(jnp.geomspace(1e-4, 0.5, 8), 8)

        def violations(x, t):
            g = sf._gate_fn(activation)(w.w_gate_FD @ x)
            a = g * (w.w_up_FD @ x)
            kept = ~(jnp.abs(a) < t / w.down_norm_F)
            return (kept & ~sf.candidates(w, x, g, t) & (a != 0)).sum(), (kept & (a != 0)).sum()

        bad, kept = jax.vmap(violations)(xs, ts)
        assert int(bad.sum()) == 0 and int(kept.sum()) > 0

    def test_zero_threshold_is_dense_and_relu_skips_inactive(self):
        module, params, x = _mlp("relu_glu")
        w = sf.prepare(params)
        y_dense = _dense(module, params, x)
        g = jax.nn.relu(w.w_gate_FD @ x[0, 0])
        active = int((g > 0).sum())
        assert active < F
        y, stats = jax.jit(functools.partial(sf.sparse_ffn, activation="relu_glu", capacity=active,
                                             return_stats=True))(w, x[0, 0], 0.0)
        assert bool(stats["sparse"]) and int(stats["candidates"]) == active
        chex.assert_trees_all_close(y, y_dense, atol=2e-5, rtol=2e-5)

    def test_gate_threshold_rule(self):
        module, params, x = _mlp("relu_glu")
        w = sf.prepare(params)
        _, acts, _ = _reference(module, params, x, 0.0)
        t = _threshold_keeping(acts, params["wo"], 0.5)
        e = float(np.quantile(np.asarray(jax.nn.relu(w.w_gate_FD @ x[0, 0])), 0.8))
        y_ref, _, _ = _reference(module, params, x, t, gate_threshold=e)
        y, stats = sf.sparse_ffn(w, x, t, activation="relu_glu", capacity=F // 4, gate_threshold=e,
                                 return_stats=True)
        assert bool(stats["sparse"])
        chex.assert_trees_all_close(y[0, 0], y_ref, atol=2e-5, rtol=2e-5)

    def test_predicted_ffn_with_the_true_active_set_is_exact(self):
        module, params, x = _mlp("relu_glu")
        w = sf.prepare(params)
        _, acts, _ = _reference(module, params, x, 0.0)
        t = _threshold_keeping(acts, params["wo"], 0.1)
        y_ref, _, keep = _reference(module, params, x, t)
        (idx,) = np.nonzero(np.asarray(keep))
        cap = len(idx) + 3
        idx_C = jnp.asarray(np.concatenate([idx, np.zeros(3, int)]))
        y = sf.predicted_ffn(w, x[0, 0], idx_C, jnp.arange(cap) < len(idx), t, activation="relu_glu")
        chex.assert_trees_all_close(y, y_ref, atol=2e-5, rtol=2e-5)

    def test_bad_input_is_a_clear_error(self):
        _, params, x = _mlp("relu_glu")
        w = sf.prepare(params)
        with pytest.raises(ValueError, match="gated activations"):
            sf.sparse_ffn(w, x, 0.1, activation="gelu", capacity=8)
        with pytest.raises(ValueError, match="batch 1"):
            sf.sparse_ffn(w, jnp.zeros((2, D)), 0.1, activation="relu_glu", capacity=8)
        with pytest.raises(ValueError, match="capacity"):
            sf.sparse_ffn(w, x, 0.1, activation="relu_glu", capacity=0)
        with pytest.raises(ValueError, match="gated MLP"):
            sf.prepare({"wi": jnp.zeros((D, F)), "wo": jnp.zeros((F, D))})

    def test_capacity_for(self):
        assert sf.capacity_for(0.065, 4096) == 336
        assert sf.capacity_for(1.0, 512) == 512
        assert sf.capacity_for(0.0, 512) == 8

    def test_capacity_from_counts_covers_the_quantile(self):
        rng = np.random.default_rng(0)
        counts = np.minimum(rng.pareto(1.5, size=(200, 4)) * 60 + 40, 4096).astype(int)  # heavy tail
        cap = sf.capacity_from_counts(counts, 4096, quantile=0.95)
        assert cap % 8 == 0 and np.mean(counts > cap) <= 0.05 and np.mean(counts > cap - 8) > 0.0
        mean_cap = sf.capacity_for(counts.mean() / 4096, 4096)
        assert np.mean(counts > mean_cap) > 0.05  # the mean-sized capacity overflows more often
        assert sf.capacity_from_counts([5000], 4096) == 4096 and sf.capacity_from_counts([0], 512) == 8
        with pytest.raises(ValueError, match="quantile"):
            sf.capacity_from_counts(counts, 4096, quantile=0)


# ----------------------------------------------------------------------------- as a decoding path

PROMPT = [1, 40, 51, 62, 73, 84, 95]
N_NEW = 10


def _lm(scan_layers, activation="relu_glu", scale=4.0):
    """A tiny decoder (configs/lm.py:tiny) with larger-than-init weights (peaked logits); the
    params are built once per setting, the config is a fresh copy every call."""
    cfg, params = _built_lm(scan_layers, activation, scale)
    return ml_collections.ConfigDict(cfg.to_dict()), params


@functools.cache
def _built_lm(scan_layers, activation, scale):
    from icml_jax.config_utils import load_config
    from icml_jax.models.decoder import build_model
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    cfg.mlp.activation, cfg.scan_layers = activation, scan_layers
    model = build_model(cfg)
    init = jax.jit(lambda key: jax.tree.map(lambda x: x * scale,
                                            model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]))
    return cfg, init(jax.random.key(0))


def _searched_thresholds(cfg, params):
    """Per-layer thresholds from a real (short) CETT-PPL-5% search on random text."""
    from icml_jax.analysis.sparsity import cett_ppl_search
    from icml_jax.models.decoder import build_model
    model = build_model(cfg)
    inputs = jax.random.randint(jax.random.key(3), (2, 32), 1, cfg.vocab_size)
    batch = dict(inputs=inputs, positions=jnp.broadcast_to(jnp.arange(32), (2, 32)),
                 segment_ids=jnp.ones((2, 32), jnp.int32))
    batch["targets"] = jax.jit(lambda p, t: jnp.argmax(model.apply({"params": p}, t), -1))(params, inputs)
    res = cett_ppl_search(model, params, [batch], p=5.0, tol=1e-3)
    assert 0 < res["activation_ratio"] < 1
    return res["thresholds"]


def _gen(cfg, params, **kw):
    from icml_jax.inference.decode import generate
    return generate(cfg, params, [PROMPT], key=jax.random.key(0), max_new_tokens=N_NEW, temperature=0,
                    return_logits=True, **kw)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_sparse_generate_equals_masked_dense_generate(scan_layers):
    """Gathered decode steps give the masked dense path's greedy tokens and per-step logits, with
    the capacity sufficing (every step gathered) and overflowing (every step falls back)."""
    from icml_jax.analysis.sparsity import thresholds_tree
    cfg, params = _lm(scan_layers)
    thresholds = _searched_thresholds(cfg, params) if not scan_layers else [0.05, 0.08]
    assert min(thresholds) > 0
    tree = thresholds_tree(cfg, thresholds)
    masked = _gen(cfg, params, sparsity=tree)
    dense = _gen(cfg, params)
    assert np.abs(masked.logits - dense.logits).max() > 1e-3  # the thresholds matter: the test has teeth
    F, L = cfg.ffn_dim, cfg.num_layers
    for capacity, gathered in ((48, True), (8, False)):
        out = _gen(cfg, params, sparsity=tree, sparse_capacity=capacity, return_sparse_stats=True)
        st = out.sparse_stats
        assert st["sparse"].shape == (N_NEW - 1, L)  # one entry per decode step and layer: sown by the gathered path
        assert bool(st["sparse"].all()) if gathered else not st["sparse"].any(), (capacity, st["candidates"])
        assert (st["kept"] <= st["candidates"]).all() and (st["candidates"] < F).all()
        np.testing.assert_array_equal(out.tokens, masked.tokens)
        np.testing.assert_allclose(out.logits, masked.logits, atol=1e-4, rtol=1e-5)
    assert masked.sparse_stats is None


@pytest.mark.parametrize("scan_layers", [False, True])
def test_zero_thresholds_sparse_generate_equals_dense(scan_layers):
    from icml_jax.analysis.sparsity import thresholds_tree
    cfg, params = _lm(scan_layers)
    dense = _gen(cfg, params)
    out = _gen(cfg, params, sparsity=thresholds_tree(cfg, [0.0] * cfg.num_layers), sparse_capacity=48,
               return_sparse_stats=True)
    assert bool(out.sparse_stats["sparse"].all())  # ReLU's zero gates alone leave < 48 candidates
    np.testing.assert_array_equal(out.tokens, dense.tokens)
    np.testing.assert_allclose(out.logits, dense.logits, atol=1e-4, rtol=1e-5)


def test_gather_rows_are_prepared_outside_the_decode_loop():
    """The transposed rows enter the while loop as loop invariants: its body has no transpose of
    an [F, D] / [D, F] weight (only the gathers, inside a cond)."""
    from icml_jax.analysis.sparsity import thresholds_tree
    from icml_jax.inference import decode
    from icml_jax.inference.decode import _with_capacity
    from icml_jax.models.decoder import build_model
    cfg, params = _lm(False)
    cfg = _with_capacity(cfg, 48, True, 1)
    tokens, positions, segments = decode.pad_prompts([PROMPT], 16)
    jaxpr = jax.make_jaxpr(functools.partial(
        decode._generate.__wrapped__, build_model(cfg, decode=True), max_new=4,
        mode=decode.SamplerMode(True, False, False), return_logits=False))(
        params, thresholds_tree(cfg, [0.05, 0.05]), tokens, positions, segments, jax.random.key(0),
        1.0, 0, 1.0, jnp.asarray([-1]), 0, None)
    (loop,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "while"]
    body = str(loop.params["body_jaxpr"])
    F, D = cfg.ffn_dim, cfg.d_model
    assert "cond[" in body and "gather" in body
    is_row_transpose = lambda e: e.primitive.name == "transpose" and set(e.outvars[0].aval.shape) == {F, D}  # noqa: E731
    assert sum(map(is_row_transpose, jaxpr.jaxpr.eqns)) == 2 * cfg.num_layers  # gate + up rows, once
    assert not any(map(is_row_transpose, loop.params["body_jaxpr"].jaxpr.eqns))


def test_sparse_generate_bad_input_is_a_clear_error():
    from icml_jax.analysis.sparsity import thresholds_tree
    from icml_jax.inference.decode import generate
    cfg, params = _lm(False)
    tree = thresholds_tree(cfg, [0.05, 0.05])
    kw = dict(key=jax.random.key(0), max_new_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="needs a sparsity tree"):
        generate(cfg, params, [PROMPT], sparse_capacity=8, **kw)
    with pytest.raises(ValueError, match="batch-1"):
        generate(cfg, params, [PROMPT, PROMPT], sparsity=tree, sparse_capacity=8, **kw)
    with pytest.raises(ValueError, match="must lie in"):
        generate(cfg, params, [PROMPT], sparsity=tree, sparse_capacity=cfg.ffn_dim + 1, **kw)
    from icml_jax.models.decoder import build_model
    gcfg = ml_collections.ConfigDict(cfg.to_dict())
    gcfg.mlp.activation = "gelu"
    # the errors come before any computation: abstract params, and the module traced abstractly
    gparams = jax.eval_shape(build_model(gcfg).init, jax.random.key(0),
                             jnp.zeros((1, 8), jnp.int32))["params"]
    with pytest.raises(ValueError, match="gated MLP"):
        generate(gcfg, gparams, [PROMPT], sparsity=tree, sparse_capacity=8, **kw)
    gcfg.mlp.sparse_capacity = 8  # the module itself refuses it too
    with pytest.raises(ValueError, match="gated MLP"):
        jax.eval_shape(build_model(gcfg).apply, {"params": gparams}, jnp.zeros((1, 4), jnp.int32))


# ----------------------------------------------------------------------------- activation predictor

def _predictor_setup(n_tokens=256, frac=0.1, seed=0):
    """A relu_glu FFN, N random inputs, a threshold keeping ~frac of the neurons, the keep labels."""
    module, params, _ = _mlp("relu_glu")
    w = sf.prepare(params)
    x_ND = jax.random.normal(jax.random.key(seed), (n_tokens, D))
    a_NF = jax.nn.relu(x_ND @ w.w_gate_FD.T) * (x_ND @ w.w_up_FD.T)
    n_NF = np.abs(np.asarray(a_NF)) * np.asarray(w.down_norm_F)
    t = float(np.quantile(n_NF, 1 - frac))
    return w, np.asarray(x_ND), n_NF >= t, t


def test_predicted_ffn_is_the_masked_ffn_on_the_predicted_set():
    """For any predictor, predicted_sparse_ffn = the masked dense FFN restricted to its top-C
    neurons (NumPy reference); with C = F it is the masked dense FFN itself."""
    w, x_ND, keep_NF, t = _predictor_setup(n_tokens=4)
    rng = np.random.default_rng(0)
    pred = {"pred_in": jnp.asarray(rng.normal(size=(D, 8)), jnp.float32),
            "pred_out": jnp.asarray(rng.normal(size=(8, F)), jnp.float32),
            "pred_bias": jnp.zeros((F,), jnp.float32)}
    run = jax.jit(lambda x, C: sf.predicted_sparse_ffn(w, x, pred, t, activation="relu_glu", capacity=C,
                                                       return_acts=True, return_stats=True),
                  static_argnums=1)
    wg, wu, wd = (np.asarray(a, np.float64) for a in (w.w_gate_FD, w.w_up_FD, w.w_down_FD))
    for x in x_ND:
        a = np.maximum(wg @ x, 0) * (wu @ x)
        kept = np.abs(a) >= t / np.linalg.norm(wd, axis=1)
        for C in (32, F):
            top = np.argsort(-np.asarray(sf.predictor_scores(pred, x)), kind="stable")[:C]
            chosen = np.zeros(F, bool)
            chosen[top] = True
            ref_a = np.where(kept & chosen, a, 0)
            y, acts, st = run(jnp.asarray(x), C)
            np.testing.assert_allclose(acts, ref_a, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(y, ref_a @ wd, rtol=1e-5, atol=1e-4)
            assert int(st["kept"]) == int((kept & chosen).sum()) and int(st["candidates"]) == C
    y_full = run(jnp.asarray(x_ND[0]), F)[0]
    np.testing.assert_allclose(y_full, sf.dense_masked_ffn(w, jnp.asarray(x_ND[0]), t, activation="relu_glu"),
                               rtol=1e-5, atol=1e-5)


def test_fit_predictor_recalls_kept_neurons_and_capacity_meets_its_target():
    """A fitted predictor finds the kept neurons far better than chance on held-out tokens, and
    predictor_capacity is the smallest multiple of 8 reaching the requested recall."""
    w, x_ND, keep_NF, _ = _predictor_setup(n_tokens=768)
    tr, te = slice(0, 512), slice(512, None)
    pred = sf.fit_predictor(x_ND[tr], keep_NF[tr], rank=16, steps=200, lr=3e-2)
    C = 64  # 25% of F, ~2.5x the kept count
    got = sf.predictor_recall(pred, x_ND[te], keep_NF[te], C)
    untrained = sf.predictor_recall(jax.tree.map(jnp.zeros_like, pred) | {"pred_bias": jnp.asarray(
        np.random.default_rng(1).normal(size=F), jnp.float32)}, x_ND[te], keep_NF[te], C)
    # chance = C / F = 25%; the kept set (top |a_j| ||W_down[j]||) is not linear in x, so a linear
    # scorer is imperfect here (0.60 measured), but far above chance
    assert got["recall"] > 0.5 and untrained["recall"] < 0.35, (got, untrained)
    cap = sf.predictor_capacity(pred, x_ND[tr], keep_NF[tr], recall=0.99)
    assert cap % 8 == 0
    assert sf.predictor_recall(pred, x_ND[tr], keep_NF[tr], cap)["recall"] >= 0.99
    assert cap == 8 or sf.predictor_recall(pred, x_ND[tr], keep_NF[tr], cap - 8)["recall"] < 0.99
    with pytest.raises(ValueError, match="rank must be"):
        sf.fit_predictor(x_ND, keep_NF, rank=D + 1)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_predictor_generate_with_full_capacity_equals_masked_dense(scan_layers):
    """generate with the predictor leaves in the sparsity tree (analysis.sparsity.predictor_data /
    predictor_tree) takes the predicted path; at capacity F every neuron is computed, so tokens
    and logits equal the masked dense path, and a small capacity changes the logits."""
    from icml_jax.analysis.sparsity import predictor_data, predictor_tree, thresholds_tree
    from icml_jax.models.decoder import build_model
    cfg, params = _lm(scan_layers)
    thresholds = [0.05, 0.08]
    tree = thresholds_tree(cfg, thresholds)
    inputs = jax.random.randint(jax.random.key(5), (2, 32), 1, cfg.vocab_size)
    batch = dict(inputs=inputs, positions=jnp.broadcast_to(jnp.arange(32), (2, 32)),
                 segment_ids=jnp.ones((2, 32), jnp.int32))
    data, sites = predictor_data(build_model(cfg), params, thresholds, [batch])
    assert len(data) == cfg.num_layers and data[0][0].shape == (64, cfg.d_model)
    assert 0 < data[0][1].mean() < 1
    preds = [sf.fit_predictor(x, k, rank=8, steps=20) for x, k in data]
    ptree = predictor_tree(sites, preds, base=tree)
    masked = _gen(cfg, params, sparsity=tree)
    full = _gen(cfg, params, sparsity=ptree, sparse_capacity=cfg.ffn_dim, return_sparse_stats=True)
    assert int(full.sparse_stats["candidates"].min()) == cfg.ffn_dim  # the predicted path ran
    np.testing.assert_array_equal(full.tokens, masked.tokens)
    np.testing.assert_allclose(full.logits, masked.logits, atol=1e-4, rtol=1e-5)
    small = _gen(cfg, params, sparsity=ptree, sparse_capacity=8)
    assert np.abs(small.logits - masked.logits).max() > 1e-4
