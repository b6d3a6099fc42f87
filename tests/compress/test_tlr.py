"""TLR and the pruning masks (icml_jax/compress): the spec's property tests, the matrix sanity
case, and the pruned model = a dense model of the merged weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.compress import masks, prune, tlr
from icml_jax.config_utils import load_config
from icml_jax.models import build_model


def _matrix(m=64, n=96, rank=4, seed=0):
    """Low-rank structure plus heavy-tailed (Student-t, 3 dof) noise."""
    rng = np.random.default_rng(seed)
    low = rng.normal(size=(m, rank)) @ rng.normal(size=(rank, n))
    return (low + 0.5 * rng.standard_t(3, size=(m, n))).astype(np.float32)


def _svd_r(x, r):
    u, s, vh = np.linalg.svd(x.astype(np.float64), full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]


def test_tlr_identity_mask_and_monotone_error():
    w = _matrix()
    keep = masks.unstructured(np.abs(w), 0.5)
    s, b, a, info = tlr.tlr(w, keep, rank=6, iters=8, early_stop=None, keep_states=True)
    assert info["iterations"] == 8 and info["ranks"] == list(tlr.rank_schedule(6, 8))
    states = info["states"]
    for t, r in enumerate(info["ranks"]):
        want = np.where(keep, w - _svd_r(w - states[t], r), 0.0)
        np.testing.assert_allclose(states[t + 1], want, atol=2e-4)  # S_{t+1} = P (W - SVD_r(W - S_t))
        assert not states[t + 1][~keep].any()
    assert all(e1 <= e0 + 1e-6 for e0, e1 in zip(info["errors"], info["errors"][1:])), info["errors"]
    # the same, recomputed from the states: e_t = ||W - S_t - SVD_r(W - S_t)|| at each step's rank
    errs = [np.linalg.norm(w - states[t + 1] - _svd_r(w - states[t + 1], r)) for t, r in enumerate(info["ranks"])]
    assert all(e1 <= e0 * (1 + 1e-5) for e0, e1 in zip(errs, errs[1:])), errs
    np.testing.assert_allclose(b @ a, _svd_r(w - s, 6), atol=2e-4)


def test_tlr_all_ones_mask_and_full_rank():
    w = _matrix(32, 48)
    s, b, a, _ = tlr.tlr(w, np.ones_like(w, bool), rank=4)
    np.testing.assert_array_equal(s, w)
    assert np.abs(b @ a).max() < 1e-5
    keep = masks.unstructured(np.abs(w), 0.7)
    s, b, a, _ = tlr.tlr(w, keep, rank=32, iters=3, early_stop=None)
    np.testing.assert_allclose(s + b @ a, w, atol=1e-4)


def test_rank_schedule_and_early_stop():
    assert tlr.rank_schedule(128, 10).tolist() == [1, 15, 29, 43, 57, 71, 85, 99, 113, 128]
    assert tlr.rank_schedule(8, 1).tolist() == [1]
    rng = np.random.default_rng(1)
    w = np.outer(rng.normal(size=40), rng.normal(size=40)).astype(np.float32)  # rank 1
    keep = np.zeros_like(w, bool)
    keep[:, :20] = True  # the pruned half is rank 1 too: 100% of the spectrum at r = 1
    _, _, _, info = tlr.tlr(w, keep, rank=8, iters=10)
    assert info["iterations"] == 1
    _, _, _, info = tlr.tlr(w, keep, rank=8, iters=10, early_stop=None)
    assert info["iterations"] == 10


def test_matrix_sanity_ordering():
    """256 x 512, 50% magnitude, k = 8: TLR < magnitude + one-shot SVD < magnitude only."""
    w = _matrix(256, 512, rank=16, seed=3)
    keep = masks.unstructured(np.abs(w), 0.5, scope="matrix")
    prune_only = tlr.relative_error(w, np.where(keep, w, 0))
    one = tlr.relative_error(w, *tlr.one_shot(w, keep, 8))
    s, b, a, _ = tlr.tlr(w, keep, 8, 10, early_stop=None)
    refined = tlr.relative_error(w, s, b, a)
    assert refined < one < prune_only, (refined, one, prune_only)


def test_masks_exact_counts():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(12, 16)).astype(np.float32)
    norms = rng.random(16).astype(np.float32) + 0.1
    sc = masks.scores(w, "wanda", norms)
    keep = masks.unstructured(sc, 0.5)
    assert (keep.sum(1) == 8).all()
    # per row, every kept score >= every pruned score
    assert all(sc[i][keep[i]].min() >= sc[i][~keep[i]].max() for i in range(12))
    keep24 = masks.n_of_m(sc, 2, 4)
    assert (keep24.reshape(12, 4, 4).sum(-1) == 2).all()
    g = sc.reshape(12, 4, 4)
    k = keep24.reshape(12, 4, 4)
    assert (np.where(k, g, np.inf).min(-1) >= np.where(k, -np.inf, g).max(-1)).all()
    km = masks.unstructured(np.abs(w), 0.7, scope="matrix")
    assert km.sum() == w.size - int(w.size * 0.7)
    gm = masks.global_masks([np.abs(w), 2 * np.abs(w[:4])], 0.5)
    assert sum(x.sum() for x in gm) == (w.size + w[:4].size) - int((w.size + w[:4].size) * 0.5)
    with pytest.raises(ValueError, match="multiple of 4"):
        masks.n_of_m(np.ones((2, 6)), 2, 4)


@pytest.fixture(scope="module")
def tiny():
    c = load_config("configs/lm.py:tiny", unlocked=True).model
    model = build_model(c)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 200, (4, 16)), jnp.int32)
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens)["params"])
    import flax.linen as nn
    return c, nn.meta.unbox(params), tokens


@pytest.mark.parametrize("method,pattern,refine", [("magnitude", "unstructured", "tlr"),
                                                   ("wanda", "2:4", "svd"),
                                                   ("wanda", "unstructured", "none")])
def test_pruned_model_equals_dense_of_merged_weights(tiny, method, pattern, refine):
    c, params, tokens = tiny
    p2, c2, report = prune.prune_model(params, c, method=method, pattern=pattern, sparsity=0.5,
                                       refine=refine, rank=4, iters=4, calib_tokens=tokens)
    assert c2.lowrank == (0 if refine == "none" else 4)
    for key, entry in report.items():
        assert entry["kept"] == pytest.approx(0.5, abs=1e-6), key
    # the sparse kernels keep exactly the masks' share; the model runs with its factors
    mats = prune.matrices(p2["layer_1"], c)
    assert all(abs((m != 0).mean() - 0.5) < 1e-6 for m in mats.values())
    logits = build_model(c2).apply({"params": p2}, tokens)
    dense, dense_cfg = prune.merged_params(p2, c2)
    assert dense_cfg.lowrank == 0
    want = build_model(dense_cfg).apply({"params": dense}, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=2e-5, rtol=1e-5)
    if refine != "none":  # the factors change the function (they are not zero)
        merged_mats = prune.matrices(dense["layer_0"], c)
        assert any(np.abs(merged_mats[n] - prune.matrices(p2["layer_0"], c)[n]).max() > 1e-4
                   for n in merged_mats)


def test_matrix_views_round_trip(tiny):
    c, params, _ = tiny
    lay = params["layer_0"]
    back = prune.with_matrices(lay, c, prune.matrices(lay, c))
    for a, b in zip(jax.tree.leaves(lay), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    q = prune.matrices(lay, c)["q"]
    assert q.shape == (c.num_heads * c.head_dim, c.d_model)


def test_bad_arguments(tiny):
    c, params, _ = tiny
    with pytest.raises(ValueError, match="calib_tokens"):
        prune.prune_model(params, c, method="wanda")
    with pytest.raises(ValueError, match="refine must be one of"):
        prune.prune_model(params, c, refine="pcp")
    with pytest.raises(ValueError, match="'N:M'"):
        prune.prune_model(params, c, pattern="half")


def test_pruned_model_decodes_and_exports(tiny, tmp_path):
    """The TLR model runs in ``generate`` (same greedy tokens as its merged dense twin) and saves
    to the HF format once merged (save_hf refuses the factors with the fix)."""
    from icml_jax.inference.decode import generate
    from icml_jax.interop.hf import load_hf, save_hf
    c, params, tokens = tiny
    p2, c2, _ = prune.prune_model(params, c, refine="tlr", rank=4, iters=3)
    prompts = [list(map(int, tokens[0, :5])), list(map(int, tokens[1, :3]))]
    got = generate(c2, p2, prompts, key=jax.random.key(0), max_new_tokens=6, temperature=0.0)
    dense, dc = prune.merged_params(p2, c2)
    want = generate(dc, dense, prompts, key=jax.random.key(0), max_new_tokens=6, temperature=0.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    with pytest.raises(ValueError, match="merged_params"):
        save_hf(str(tmp_path / "x"), c2, p2)
    out = save_hf(str(tmp_path / "hf"), dc, dense)
    loaded_cfg, loaded = load_hf(out)[:2]
    a = build_model(dc).apply({"params": dense}, tokens)
    b = build_model(loaded_cfg).apply({"params": loaded}, tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_wanda_input_norms_by_hand(tiny):
    """Block 0's q/k/v norms are those of rmsnorm(embedding[tokens]) (computed here directly);
    gate/up read the MLP input and down the MLP activations, each of its own width."""
    c, params, tokens = tiny
    norms = prune.input_norms(params, c, tokens, 0)
    h = np.asarray(params["io"]["embedding"])[np.asarray(tokens)].reshape(-1, c.d_model)
    x = h / np.sqrt((h * h).mean(-1, keepdims=True) + c.norm_eps) * np.asarray(params["layer_0"]["attn_norm"]["scale"])
    np.testing.assert_allclose(norms["q"], np.sqrt((x * x).sum(0)), rtol=1e-4)
    assert norms["k"] is norms["q"] and norms["gate"] is norms["up"]
    assert norms["o"].shape == (c.num_heads * c.head_dim,) and norms["down"].shape == (c.ffn_dim,)
    assert not np.allclose(norms["up"], norms["q"])  # the MLP input is after the attention residual
