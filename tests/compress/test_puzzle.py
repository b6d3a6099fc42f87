"""Puzzle's library (compress/puzzle.py): identity variants cost nothing in L_BLD and KL, BLD lowers
every trained variant's block error, a child of the parent's own blocks is the parent, children of
chosen variants run as heterogeneous decoders, and the searched child meets its budgets."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from icml_jax.compress import puzzle as P
from icml_jax.compress import puzzle_mip
from icml_jax.config_utils import load_config
from icml_jax.models import build_model
from icml_jax.models.residual import standard_param_count


def _model():
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # 2 layers, d 32, 4 heads, 2 KV, F 64
    return m


def _batch(seed, B=4, T=16):
    r = np.random.RandomState(seed)
    x = r.randint(3, 250, (B, T + 1)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[0, -4:] = 0
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    return {"inputs": jnp.asarray(x[:, :-1]), "targets": jnp.asarray(x[:, 1:]),
            "segment_ids": jnp.asarray(seg), "positions": jnp.asarray(pos)}


def _logits(model_config, params, b):
    """The model's logits on batch ``b``, jitted (one compile beats op-by-op dispatch)."""
    return jax.jit(build_model(model_config).apply)({"params": params}, b["inputs"], b["positions"],
                                                    b["segment_ids"])


def _batches(seed=1):
    for i in itertools.count():
        yield _batch(seed * 1000 + i)


@pytest.fixture(scope="module")
def parent():
    m = _model()
    params = meta.unbox(build_model(m).init(jax.random.key(0), _batch(0)["inputs"])["params"])
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim > 1 else x, params)  # a less trivial parent
    library = P.variants(m, attention=(1, "linear", "noop"), ffn=(32, 16, "linear", "noop"))
    vparams = P.init_library(m, params, library, _batch(99, B=8))
    return m, params, library, vparams


@pytest.fixture(scope="module")
def trained(parent):
    m, params, library, vparams = parent
    losses = jax.jit(lambda p, v, b: P.bld_losses(m, p, library, v, b))
    before = losses(params, vparams, _batch(7))
    out, history = P.train_bld(m, params, library, vparams, _batches(), steps=40, lr=3e-3, warmup=5,
                               log_every=0)
    after = losses(params, out, _batch(7))
    return out, before, after


def test_identity_variants_have_zero_bld_loss(parent, trained):
    m, _, library, _ = parent
    _, before, _ = trained
    for v in library:
        if v.is_parent(m):
            np.testing.assert_allclose(np.asarray(before[v.name]), 0.0, atol=1e-12)
        if v.kind == "noop":  # predicting zero: exactly the parent output's own energy, ratio 1
            np.testing.assert_allclose(np.asarray(before[v.name]), 1.0, rtol=1e-6)


def test_bld_lowers_every_trained_variants_block_error(parent, trained):
    m, _, library, _ = parent
    _, before, after = trained
    names = [v.name for v in P.trainable(m, library)]
    assert set(names) == {"kv1", "attn_linear", "ffn32", "ffn16", "ffn_linear"}
    for n in names:
        b, a = np.asarray(before[n]), np.asarray(after[n])
        assert np.all(a < b), (n, b, a)



def test_the_linear_ffn_starts_at_the_least_squares_optimum_of_its_calibration_rows(parent):
    m, params, library, vparams = parent
    calib = _batch(99, B=8)
    loss = jax.jit(lambda v: P.bld_losses(m, params, library, v, calib)["ffn_linear"])
    at = lambda v: np.asarray(loss(v))  # noqa: E731
    base = at(vparams)
    assert np.all(base < 1.0)  # better than predicting zero (the no-op)
    for eps in (1e-2, -1e-2):  # and a local minimum: any nudge of the kernel is worse
        nudged = {**vparams, "ffn_linear": {**vparams["ffn_linear"], "mlp": {
            "kernel": vparams["ffn_linear"]["mlp"]["kernel"] * (1 + eps)}}}
        assert np.all(at(nudged) > base)


def test_replacing_a_block_by_the_parents_own_scores_zero(parent):
    m, params, library, vparams = parent
    A0, F0 = P.Variant(P.ATTN, 2), P.Variant(P.FFN, 64)
    s = P.score_pairs(m, params, vparams, [(A0, F0), (P.Variant(P.ATTN, "noop"), F0)], _batch(5))
    for layer in range(2):
        assert abs(s[(layer, "kv2", "ffn64")]) < 1e-6
        assert s[(layer, "attn_noop", "ffn64")] > 1e-4


def test_a_child_of_the_parents_blocks_is_the_parent_and_others_run(parent, trained):
    m, params, library, _ = parent
    vparams, _, _ = trained
    b = _batch(3)
    want = _logits(m, params, b)
    choice = P.uniform_choice(m, 2, 64)
    cm = P.child_config(m, choice)
    got = _logits(cm, P.child_params(m, params, vparams, choice), b)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    choice = [(1, "linear"), ("noop", 16)]
    cm = P.child_config(m, choice)
    cp = P.child_params(m, params, vparams, choice)
    assert sum(x.size for x in jax.tree.leaves(cp)) == standard_param_count(cm)
    # the joint replace-1-block score of a layer's pair is the KL of the one-swap model, either layer
    s = P.score_pairs(m, params, vparams, [(P.Variant(P.ATTN, 1), P.Variant(P.FFN, "linear"))], b)
    for layer in range(2):
        one = [(2, 64)] * 2
        one[layer] = (1, "linear")
        lg = _logits(P.child_config(m, one), P.child_params(m, params, vparams, one), b)
        lp, lq = jax.nn.log_softmax(want, -1), jax.nn.log_softmax(lg, -1)
        w = np.asarray(b["segment_ids"] > 0)
        kl = float((np.asarray(jnp.sum(jnp.exp(lp) * (lp - lq), -1)) * w).sum() / w.sum())
        np.testing.assert_allclose(s[(layer, "kv1", "ffn_linear")], kl, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("scoring", ["joint", "summed"])
def test_the_searched_child_meets_its_budgets(parent, trained, scoring):
    m, params, library, _ = parent
    vparams, _, _ = trained
    # a sub-library (3 attention x 4 FFN variants: each scored pair is its own compile)
    library = [v for v in library if v.name not in ("attn_linear", "ffn16")]
    scores = P.score_pairs(m, params, vparams, P.pairs_for(library, scoring, m), _batch(11))
    lib = P.build_library(m, library, scores, scoring=scoring)
    full = P.choice_costs(m, P.uniform_choice(m, 2, 64))
    budget = {"stats.params": 0.5 * full["params"], "stats.kv_bytes": 0.5 * full["kv_bytes"]}
    chosen, value, _ = puzzle_mip.solve(lib, "metrics.kl_div", budget)
    choice = [lib[layer][chosen[layer]]["choice"] for layer in range(2)]
    costs = P.choice_costs(m, choice)
    assert costs["params"] <= budget["stats.params"] and costs["kv_bytes"] <= budget["stats.kv_bytes"]
    # the MIP's optimum is the brute-force one over the library's pairs
    best = min((sum(lib[layer][n]["metrics"]["kl_div"] for layer, n in enumerate(names)), names)
               for names in itertools.product(*[list(lib[layer]) for layer in range(2)])
               if all(sum(lib[layer][n]["stats"][k] for layer, n in enumerate(names)) <= budget[f"stats.{k}"]
                      for k in ("params", "kv_bytes")))
    np.testing.assert_allclose(value, best[0], rtol=1e-9)
    _logits(P.child_config(m, choice), P.child_params(m, params, vparams, choice), _batch(2))


def test_bad_variants_and_parents_fail_clearly():
    m = _model()
    with pytest.raises(ValueError, match="must divide"):
        P.variants(m, attention=(3,))
    with pytest.raises(ValueError, match="exceeds"):
        P.variants(m, ffn=(128,))
    m.scan_layers = True
    with pytest.raises(ValueError, match="homogeneous parent"):
        P.check_parent(m)


def test_an_imported_hf_checkpoint_is_a_parent(parent, tmp_path):
    """A Llama folder read by load_hf (here: our parent written by save_hf) runs the whole library
    path: its params initialise the variants and its own blocks score 0."""
    from icml_jax.interop.hf import load_hf, save_hf
    m, params, _, _ = parent
    save_hf(str(tmp_path / "llama"), m, params, "LlamaForCausalLM")
    hm, hp = load_hf(str(tmp_path / "llama"))
    hp = jax.tree.map(np.asarray, meta.unbox(hp))
    lib = P.variants(hm, attention=(1,), ffn=(32,))
    vp = P.init_library(hm, hp, lib, _batch(99, B=4))
    s = P.score_pairs(hm, hp, vp, P.pairs_for(lib, "summed", hm), _batch(5), layers=[1])
    assert abs(s[(1, f"kv{hm.num_kv_heads}", f"ffn{hm.ffn_dim}")]) < 1e-6 and s[(1, "kv1", f"ffn{hm.ffn_dim}")] > 0


@pytest.mark.parametrize("attention,ffn,msg", [((0,), (), "positive integer"), ((-1,), (), "positive integer"),
                                               ((), (0,), "positive integer"), ((), (2.5,), "positive integer"),
                                               ((), ("wide",), "positive integer")])
def test_variant_entries_are_checked_before_any_work(attention, ffn, msg):
    with pytest.raises(ValueError, match=msg):
        P.variants(_model(), attention=attention, ffn=ffn)
    got = P.variants(_model(), attention=("1",), ffn=("32", "linear"))  # command-line strings
    assert [v.name for v in got] == ["kv2", "ffn64", "kv1", "ffn32", "ffn_linear"]


def test_fope_parents_and_configs_without_blocks_are_handled():
    m = _model()
    m.position = "fope"
    with pytest.raises(ValueError, match="per-layer position params"):
        P.check_parent(m)
    m = _model()
    del m["blocks"]
    assert P.child_config(m, P.uniform_choice(m, 1, 32)).blocks.ffn == "32,32"
