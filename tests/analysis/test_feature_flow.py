"""icml_jax.analysis.feature_flow (spec feature_flow.md §5): self-matching is the identity with
similarity 1; matches and classes of planted (permuted, globally rotated, rescaled) decoders are
recovered; flow graphs of planted chains respect t_R / t_mod; rescaling a dead feature or steering
with s = 0 leaves the logits bit-identical; a rescale edit moves its point by exactly
(r − 1)·a_j v_j; a steer edit at layer l leaves everything below l alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from icml_jax.analysis import feature_flow as ff
from icml_jax.config_utils import load_config
from icml_jax.models import build_model, hooks
from icml_jax.models.sae import SAE

D = 64
TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 250, (2, 10)))


def _orthonormal(d, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q


E = np.eye(D)


def _rotate(decs, seed=7):
    """Every decoder in one random rotation of the space, each row with a random scale."""
    g, rng = _orthonormal(D, seed), np.random.default_rng(seed + 1)
    return {k: (v @ g) * rng.uniform(0.2, 5.0, (v.shape[0], 1)) for k, v in decs.items()}


def test_self_match_is_the_identity_and_similarities_are_cosines():
    w = np.random.default_rng(0).normal(size=(40, D))
    idx, sim = ff.match(w, 3.0 * w)
    np.testing.assert_array_equal(idx[:, 0], np.arange(40))
    np.testing.assert_allclose(sim[:, 0], 1.0, atol=1e-12)
    c = ff.cosine(w, np.random.default_rng(1).normal(size=(30, D)))
    assert c.shape == (40, 30) and np.all(np.abs(c) <= 1.0)
    # top-1 = argmax of the normalised dot products, invariant to row scales; top-k sorted
    v = np.random.default_rng(1).normal(size=(30, D))
    i2, s2 = ff.match(w * np.random.default_rng(2).uniform(0.1, 9, (40, 1)), v, k=4, chunk=7)
    np.testing.assert_array_equal(i2[:, 0], np.argmax(c, axis=1))
    assert np.all(np.diff(s2, axis=1) <= 0)
    t = ff.match_matrix(w, v, k=4)
    assert t.shape == (40, 30) and np.all(t.sum(1) == (s2 > 0).sum(1))


def test_pearson_matching_equals_numpy_corrcoef_and_finds_a_permuted_copy():
    rng = np.random.default_rng(3)
    za = np.maximum(rng.normal(size=(200, 12)), 0)
    za[:, 5] = 0.0  # never fires: correlates 0
    perm = rng.permutation(12)
    zb = np.concatenate([2.5 * za[:, perm] + 0.01 * rng.normal(size=(200, 12)), rng.normal(size=(200, 3))], 1)
    c = ff.pearson(za, zb, chunk=5)
    live = np.delete(np.arange(12), 5)
    want = np.corrcoef(za[:, live].T, zb.T)[:len(live), len(live):]
    np.testing.assert_allclose(c[live], want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(c[5], 0.0)
    idx, sim = ff.pearson_match(za, zb, k=2)
    np.testing.assert_array_equal(idx[live, 0], np.argsort(perm)[live])  # column j of zb is za's perm[j]
    assert np.all(sim[live, 0] > 0.99) and np.all(np.diff(sim, axis=1) <= 0)
    with pytest.raises(ValueError, match="same tokens"):
        ff.pearson(za, zb[:10])


def test_origins_recover_planted_predecessors_and_classes():
    rng = np.random.default_rng(3)
    pi = rng.permutation(16)
    prev = E[pi]  # R_{L-1}: row i = e_{pi[i]}
    mlp, att = E[16:28], E[28:40]
    rows, want = [], []  # (predecessor module, index) and class
    for i in range(4):  # carried: cos 0.95 to prev row r, 0 to the modules
        r = int(rng.integers(16))
        rows.append(0.95 * prev[r] + np.sqrt(1 - 0.95 ** 2) * E[40 + i])
        want.append(("carried", "res", r, 0.95))
    for i, (mod, dec) in enumerate((("mlp", mlp), ("att", att))):
        r = 5 + i
        rows.append(0.8 * prev[r] + 0.6 * dec[3 + i])  # processed: 0.8 and 0.6
        want.append((f"processed_{mod}", "res", r, 0.8))
        rows.append(0.3 * prev[r] + 0.95 * dec[7] + np.sqrt(1 - 0.09 - 0.95 ** 2) * E[44 + i])  # born
        want.append((f"born_{mod}", mod, 7, 0.95))
    rows.append(E[50])
    want.append(("unexplained", None, None, None))
    rows.append(0.7 * mlp[1] + 0.71 * att[2])  # both modules high, attention higher, R low
    want.append(("born_att", "att", 2, 0.71 / np.hypot(0.7, 0.71)))
    decs = _rotate({(2, "res"): np.stack(rows), (1, "res"): prev, (2, "mlp"): mlp, (2, "att"): att})
    o = ff.origins(decs, 2)
    assert o.layer == 2 and set(o.index) == {"res", "mlp", "att"}
    for f, (cls, mod, j, s) in enumerate(want):
        assert o.label[f] == cls, (f, o.label[f], cls)
        if mod is not None:
            assert o.index[mod][f] == j
            np.testing.assert_allclose(o.sim[mod][f], s, atol=1e-9)
    assert set(o.label) <= set(ff.CLASSES)
    # a higher per-layer t_R turns the carried (0.95) features unexplained, a lower t_mod keeps them
    o2 = ff.origins(decs, 2, t_res={2: 0.99}, t_mod={2: 0.15})
    assert list(o2.label[:4]) == ["unexplained"] * 4 and o2.label[4] == "born_mlp"
    # a missing module SAE counts as low: without attention, born_att -> unexplained,
    # processed_att -> carried, and the feature that was high in both modules is born in the MLP
    o3 = ff.origins({k: v for k, v in decs.items() if k != (2, "att")}, 2)
    assert "att" not in o3.sim and list(o3.label[5:10]) == ["born_mlp", "carried", "unexplained",
                                                            "unexplained", "born_mlp"]
    assert ff.all_origins(decs).keys() == {2}


def _chain_decoders():
    """A planted chain (3,res,5) ← (2,res,7) [0.9] ← (1,res,2) [0.8]; (2,res,7) also ← (2,mlp,1)
    [0.5] and (2,att,1) [0.1, below t_mod]; (1,res,2) ← (1,att,1) [0.9] and (0,res,3) [0.3, cut]."""
    res0, att1, mlp1 = E[0:8], E[8:12], E[12:16]
    res1 = E[16:24].copy()
    res1[2] = 0.3 * E[3] + 0.9 * E[9] + np.sqrt(0.1) * E[40]
    mlp2, att2 = E[24:28], E[28:32]
    res2 = E[32:40].copy()
    res2[7] = 0.8 * res1[2] + 0.5 * E[25] + 0.1 * E[29] + np.sqrt(0.1) * E[41]
    res3 = E[43:51].copy()
    res3[5] = 0.9 * res2[7] + np.sqrt(0.19) * E[42]
    return _rotate({(0, "res"): res0, (1, "att"): att1, (1, "mlp"): mlp1, (1, "res"): res1,
                    (2, "mlp"): mlp2, (2, "att"): att2, (2, "res"): res2, (3, "res"): res3})


def test_flow_graph_of_a_planted_chain():
    decs = _chain_decoders()
    edges = ff.flow_graph(decs, 3, 5)
    got = [(e.target, e.source) for e in edges]
    assert got == [((3, "res", 5), (2, "res", 7)), ((2, "res", 7), (2, "mlp", 1)),
                   ((2, "res", 7), (1, "res", 2)), ((1, "res", 2), (1, "att", 1))]
    np.testing.assert_allclose([e.similarity for e in edges], [0.9, 0.5, 0.8, 0.9], atol=1e-9)
    for e in edges:  # spec §5.7
        assert e.similarity >= (ff.T_RES if e.source[1] == "res" else ff.T_MOD)
    assert ff.graph_nodes(edges, (3, "res", 5)) == [(3, "res", 5), (2, "res", 7), (2, "mlp", 1),
                                                    (1, "res", 2), (1, "att", 1)]
    # the cached origins give the same graph; per-layer thresholds move the cut
    assert ff.flow_graph(ff.all_origins(decs), 3, 5) == edges
    longer = ff.flow_graph(decs, 3, 5, t_res={1: 0.25, 2: 0.5, 3: 0.5})
    assert longer[-1].source == (0, "res", 3) and len(longer) == 5
    assert ff.flow_graph(decs, 3, 5, stop_layer=2) == edges[:1]
    assert ff.flow_graph(decs, 0, 3) == []


# ----------------------------------------------------------------------------- interventions
@pytest.fixture(scope="module")
def tiny():
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # 2 layers, d 32
    p = meta.unbox(build_model(m).init(jax.random.key(0), TOKENS)["params"])
    sae = SAE(d_model=m.d_model, latents=16, activation="topk", k=4)
    saes = {}
    for i, key in enumerate([(0, "res"), (0, "mlp"), (1, "att"), (1, "res")]):
        sp = sae.init(jax.random.key(10 + i), jnp.zeros((1, m.d_model)))["params"]
        sp = dict(sp, b_enc=sp["b_enc"].at[0].set(-1e4))  # feature 0 never fires
        saes[key] = ff.SAEAt(sae, sp)
    return m, p, saes


def _logits(m, p, edits=None):
    return np.asarray(build_model(m, edits=edits).apply({"params": p}, TOKENS))


def test_rescaling_a_dead_feature_and_steering_with_zero_change_nothing(tiny):
    m, p, saes = tiny
    base = _logits(m, p)
    dead = [(0, "res", 0), (0, "mlp", 0), (1, "att", 0)]
    for r in (0.0, 2.0):
        np.testing.assert_array_equal(_logits(m, p, ff.rescale_edits(saes, dead, r)), base)
    np.testing.assert_array_equal(_logits(m, p, ff.rescale_edits(saes, [(0, "mlp", 3), (1, "res", 5)], 1.0)), base)
    jitted = lambda e: np.asarray(jax.jit(lambda q: build_model(m, edits=e).apply({"params": q}, TOKENS))(p))  # noqa: E731
    np.testing.assert_array_equal(jitted(ff.rescale_edits(saes, dead, 0.0)), jitted(None))
    decs = {k: s.params["W_dec"] for k, s in saes.items()}
    nodes = [(1, "res", 2), (1, "att", 4), (0, "mlp", 1), (0, "res", 6)]
    for kind in ff.SCHEDULES:
        np.testing.assert_array_equal(_logits(m, p, ff.steer_edits(decs, nodes, 0.0, kind, s_end=0.0)), base)


def test_a_rescale_edit_moves_its_point_by_exactly_r_minus_1_times_a_v(tiny):
    m, p, saes = tiny
    base = hooks.capture(build_model(m), p, TOKENS)
    sae = saes[(0, "mlp")]
    z = np.asarray(sae.encode(base["layer_0/mlp_out"]))
    j1, j2 = np.argsort(-(z != 0).sum((0, 1)))[:2]  # the two features firing on most tokens
    assert (z[..., j1] != 0).sum() > 0
    v = np.asarray(sae.decoder())
    for feats, r in (([j1], 0.0), ([j1, j2], 0.0), ([j1], 3.0)):
        got = hooks.capture(build_model(m, edits=ff.rescale_edits(saes, [(0, "mlp", j) for j in feats], r)),
                            p, TOKENS)
        want = (r - 1.0) * sum(z[..., j:j + 1] * v[j] for j in feats)
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got["layer_0/mlp_out"] - base["layer_0/mlp_out"], want,
                                   atol=1e-4 * np.abs(want).max())
        for pt in ("resid_pre", "attn_out", "mlp_hidden"):
            np.testing.assert_array_equal(got[f"layer_0/{pt}"], base[f"layer_0/{pt}"])
    # r per point: r = 1 at a point leaves it exactly as it was, so {mlp: 0, res of layer 1: 1}
    # is the mlp-only edit, bit for bit, and the wrong key set is refused
    nodes = [(0, "mlp", j1), (1, "res", 5)]
    per_point = hooks.capture(build_model(m, edits=ff.rescale_edits(saes, nodes, {(0, "mlp"): 0.0, (1, "res"): 1.0})),
                              p, TOKENS)
    only = hooks.capture(build_model(m, edits=ff.rescale_edits(saes, nodes[:1], 0.0)), p, TOKENS)
    np.testing.assert_array_equal(per_point["layer_1/resid_post"], only["layer_1/resid_post"])
    assert not np.array_equal(only["layer_1/resid_post"], base["layer_1/resid_post"])
    with pytest.raises(ValueError, match="exactly the nodes' points"):
        ff.rescale_edits(saes, nodes, {(0, "mlp"): 0.0})


def test_steering_at_layer_l_leaves_everything_below_alone_and_adds_s_v(tiny):
    m, p, saes = tiny
    decs = {k: s.params["W_dec"] for k, s in saes.items()}
    base = hooks.capture(build_model(m), p, TOKENS)
    v = ff._unit(decs[(1, "att")])[4]
    got = hooks.capture(build_model(m, edits=ff.steer_edits(decs, [(1, "att", 4)], 3.0)), p, TOKENS)
    for pt in hooks.POINTS:
        np.testing.assert_array_equal(got[f"layer_0/{pt}"], base[f"layer_0/{pt}"])
    np.testing.assert_array_equal(got["layer_1/resid_pre"], base["layer_1/resid_pre"])
    np.testing.assert_array_equal(got["layer_1/attn_heads"], base["layer_1/attn_heads"])
    np.testing.assert_allclose(got["layer_1/attn_out"] - base["layer_1/attn_out"],
                               np.broadcast_to(3.0 * v, base["layer_1/attn_out"].shape), atol=1e-5)
    # cumulative over a graph's nodes, exponential schedule, folded: the first point moves by s_0 f v
    nodes = [(1, "res", 2), (1, "att", 4), (0, "res", 6)]
    fold = {n: 0.5 + n[2] for n in nodes}
    got = hooks.capture(build_model(m, edits=ff.steer_edits(decs, nodes, 2.0, "exp", fold=fold)), p, TOKENS)
    np.testing.assert_array_equal(got["layer_0/mlp_out"], base["layer_0/mlp_out"])
    np.testing.assert_allclose(got["layer_0/resid_post"] - base["layer_0/resid_post"],
                               np.broadcast_to(2.0 * 6.5 * ff._unit(decs[(0, "res")])[6], base["layer_0/resid_post"].shape),
                               atol=1e-5)
    assert not np.allclose(got["layer_1/resid_post"], base["layer_1/resid_post"])


def test_schedules_hit_their_endpoints_and_helpers():
    e = ff.schedule(range(6), 2.0, "exp")
    assert e[0] == 2.0 and np.isclose(e[5], 2.0 * np.exp(-0.25))
    lin = ff.schedule([2, 3, 5], 4.0, "linear", s_end=1.0)
    assert lin[2] == 4.0 and lin[5] == 1.0 and np.isclose(lin[3], 3.0)
    assert ff.schedule([1, 4], 1.5) == {1: 1.5, 4: 1.5}
    with pytest.raises(ValueError, match="schedule"):
        ff.schedule([0], 1.0, "cosine")
    np.testing.assert_allclose(ff.typical_activation(np.array([[0.0, 2.0, 0.0], [4.0, 0.0, 0.0]])), [4.0, 2.0, 0.0])
    assert ff.hook_name(-1, "res") == "layer_0/resid_pre" and ff.hook_name(3, "att") == "layer_3/attn_out"
    with pytest.raises(ValueError, match="module"):
        ff.hook_name(0, "attn")
    with pytest.raises(ValueError, match="different spaces"):
        ff.match(np.ones((2, 3)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="no SAE"):
        ff.rescale_edits({}, [(0, "res", 1)])
