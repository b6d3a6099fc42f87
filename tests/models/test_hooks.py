"""Hook points (models/hooks.py): captures equal a manual forward, an identity edit changes nothing
(program and numbers), an edit at layer l leaves the layers below alone, and edits reach KV-cache
decoding with any policy and imported HF models.

Inits, captures and forwards run as jitted programs (eagerly, every primitive compiles on its own);
what only needs shapes or a raised error runs abstractly (``jax.eval_shape``: nothing compiles)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from icml_jax.config_utils import load_config
from icml_jax.inference.decode import generate, scored_decode
from icml_jax.models import build_model, hooks
from icml_jax.models.attention import Attention
from icml_jax.models.layers import RMSNorm

TOKENS = jnp.asarray(np.random.RandomState(0).randint(3, 250, (2, 12)))


def _cfg(**kw):
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # 2 layers, d 32, 4 heads, 2 KV, F 64
    m.update(kw)
    return m


def _init(m, seed=0):
    """The params of ``build_model(m)`` on TOKENS, initialised as one jitted program."""
    return meta.unbox(jax.jit(build_model(m).init)(jax.random.key(seed), TOKENS)["params"])


def _capture(model, params, points=None):
    """``hooks.capture`` on TOKENS as one jitted program."""
    return jax.jit(lambda p: hooks.capture(model, p, TOKENS, points=points))(params)


def _apply(model, params, tokens):
    return jax.jit(lambda p, t: model.apply({"params": p}, t))(params, tokens)


@pytest.fixture(scope="module")
def tiny():
    m = _cfg()
    return m, _init(m)


def test_capture_names_shapes_and_a_manual_forward(tiny):
    m, p = tiny
    got = _capture(build_model(m), p)
    assert set(got) == {f"layer_{i}/{pt}" for i in range(2) for pt in hooks.POINTS}
    assert got["layer_0/attn_heads"].shape == (2, 12, 2, 2, 8)
    assert got["layer_1/mlp_hidden"].shape == (2, 12, 64)
    emb = p["io"]["embedding"][TOKENS]
    np.testing.assert_array_equal(got["layer_0/resid_pre"], emb)
    # manual layer 0: norm -> attention (its per-head output, projected) -> residual
    lp = p["layer_0"]
    x = RMSNorm(eps=m.norm_eps).apply({"params": lp["attn_norm"]}, emb)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    att = Attention(m).apply({"params": lp["attn"]}, x, pos, jnp.ones_like(pos))
    np.testing.assert_allclose(got["layer_0/attn_out"], att, rtol=1e-6, atol=1e-6)
    heads = got["layer_0/attn_heads"]
    np.testing.assert_allclose(jnp.einsum("BTGRK,GRKD->BTD", heads, lp["attn"]["out"]), att, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["layer_0/resid_post"], emb + att + got["layer_0/mlp_out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["layer_0/mlp_out"], got["layer_0/mlp_hidden"] @ lp["mlp"]["wo"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_array_equal(got["layer_1/resid_pre"], got["layer_0/resid_post"])


def test_no_hook_and_identity_edits_leave_the_program_and_numbers_unchanged(tiny):
    m, p = tiny
    plain = jax.make_jaxpr(lambda q: build_model(m).apply({"params": q}, TOKENS))(p)
    ident = hooks.Edits({f"layer_{i}/{pt}": (lambda x: x) for i in range(2) for pt in hooks.POINTS})
    edited = jax.make_jaxpr(lambda q: build_model(m, edits=ident).apply({"params": q}, TOKENS))(p)
    assert str(plain) == str(edited)
    np.testing.assert_array_equal(_apply(build_model(m, edits=ident), p, TOKENS), _apply(build_model(m), p, TOKENS))


def test_an_edit_at_layer_l_changes_nothing_below_it_and_propagates_above(tiny):
    m, p = tiny
    shift = lambda x: x.at[:, :, 1, 0].add(1.0)  # noqa: E731  query head 2 (g=1, r=0)
    edited = build_model(m, edits={"layer_1/attn_heads": shift})
    # one program for both (bit-equal below: no fusion choice differs between two compiles)
    base, got = jax.jit(lambda q: (hooks.capture(build_model(m), q, TOKENS), hooks.capture(edited, q, TOKENS)))(p)
    for pt in hooks.POINTS:
        np.testing.assert_array_equal(got[f"layer_0/{pt}"], base[f"layer_0/{pt}"])
    np.testing.assert_array_equal(got["layer_1/resid_pre"], base["layer_1/resid_pre"])
    d = got["layer_1/attn_heads"] - base["layer_1/attn_heads"]
    np.testing.assert_allclose(d[:, :, 1, 0], 1.0, rtol=0, atol=1e-6)
    assert float(jnp.abs(d).sum() - jnp.abs(d[:, :, 1, 0]).sum()) < 1e-5  # only that head
    # linearity: the head shift reaches attn_out through that head's output projection
    w = p["layer_1"]["attn"]["out"][1, 0]  # [K, D]
    np.testing.assert_allclose(got["layer_1/attn_out"] - base["layer_1/attn_out"],
                               jnp.broadcast_to(w.sum(0), (2, 12, 32)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["full", "streaming"])
def test_edits_reach_kv_cache_decoding(tiny, policy):
    from icml_jax.models.kv_policies import KVPolicy
    m, p = tiny
    kw = {} if policy == "full" else {"kv_policy": KVPolicy("streaming", slots=64, window=8, sinks=2)}
    push = {"layer_1/resid_post": lambda x: x + 0.5 * p["io"]["embedding"][7]}
    out = generate(m, p, [[5, 6, 7, 8]], key=jax.random.key(0), max_new_tokens=4, temperature=0, edits=push,
                   **kw)
    seq = jnp.asarray([[5, 6, 7, 8] + list(out.tokens[0])])
    full = _apply(build_model(m, edits=push), p, seq)
    np.testing.assert_array_equal(np.argmax(np.asarray(full[0, 3:-1]), -1), out.tokens[0])
    want = jax.nn.log_softmax(full[0, :-1], -1)[jnp.arange(7), seq[0, 1:]]
    got = scored_decode(m, p, np.asarray(seq), prompt_len=4, edits=push, **kw)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_edit_arguments_are_traced_one_compile_for_every_value(tiny):
    """Edits with ``args``: the arrays enter generate / scored_decode as arguments (one compile for a
    sweep of strengths, here two), the results equal the same edit with the values closed over, and
    two Edits with different arrays never compare equal (no program with another's values baked in)."""
    from icml_jax.inference import decode
    m, p = tiny
    v = p["io"]["embedding"][7]
    add = lambda x, a: x + a["s"] * a["v"]  # noqa: E731
    prompt, seq = [[5, 6, 7, 8]], np.asarray([[5, 6, 7, 8, 9, 10, 11]])
    n_gen, n_sc = decode._generate._cache_size(), decode._scored._cache_size()
    strengths = (0.5, 2.0)  # each closed-over value compiles its own program: two show it
    for s in strengths:
        ed = hooks.Edits({"layer_1/resid_post": add}, args={"layer_1/resid_post": {"s": jnp.float32(s), "v": v}})
        closed = {"layer_1/resid_post": lambda x, s=s: x + s * v}
        got = generate(m, p, prompt, key=jax.random.key(0), max_new_tokens=4, temperature=0, edits=ed)
        want = generate(m, p, prompt, key=jax.random.key(0), max_new_tokens=4, temperature=0, edits=closed)
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(scored_decode(m, p, seq, prompt_len=4, edits=ed),
                                   scored_decode(m, p, seq, prompt_len=4, edits=closed), rtol=1e-6, atol=1e-6)
    # the argument-edits share one program each; the closed-over ones compiled one per value
    assert decode._generate._cache_size() - n_gen == 1 + len(strengths)
    assert decode._scored._cache_size() - n_sc == 1 + len(strengths)
    a = {"layer_1/resid_post": {"s": jnp.float32(1.0), "v": v}}
    b = {"layer_1/resid_post": {"s": jnp.float32(1.0), "v": v + 1}}
    assert hooks.Edits({"layer_1/resid_post": add}, a) != hooks.Edits({"layer_1/resid_post": add}, b)
    assert hooks.Edits({"layer_1/resid_post": add}, a).split()[0] == hooks.Edits({"layer_1/resid_post": add}, b).split()[0]
    with pytest.raises(ValueError, match="split off"):
        jax.eval_shape(build_model(m, edits=hooks.Edits({"layer_1/resid_post": add}, a).split()[0]).apply,
                       {"params": p}, TOKENS)
    with pytest.raises(ValueError, match="no edit function"):
        hooks.Edits({"layer_1/resid_post": add}, {"layer_0/resid_post": 1.0})


def test_bad_hooks_fail_clearly(tiny):
    m, p = tiny
    with pytest.raises(ValueError, match="use 'layer_<i>/<point>'"):
        hooks.Edits({"layer_0/residual": lambda x: x})
    with pytest.raises(ValueError, match="keep shape"):
        jax.eval_shape(build_model(m, edits={"layer_0/attn_out": lambda x: x[:, :1]}).apply, {"params": p}, TOKENS)
    with pytest.raises(ValueError, match="layers < num_layers=2"):
        jax.eval_shape(build_model(m, edits={"layer_5/attn_out": lambda x: x}).apply, {"params": p}, TOKENS)
    with pytest.raises(ValueError, match="do not exist"):
        jax.eval_shape(lambda q: hooks.capture(build_model(m), q, TOKENS, points=["layer_3/resid_pre"]), p)


def test_edits_reach_the_decoding_of_a_scanned_model(tiny):
    """A scanned model decodes unrolled (``decoder.unrolled``), so ``generate`` and ``scored_decode``
    take per-layer edits for it: the same tokens and log-probs as the unscanned model with the
    same weights and edit; its full forward refuses them."""
    from icml_jax.models.decoder import split_layers
    m, _ = tiny
    ms = _cfg(scan_layers=True)
    ps = _init(ms, seed=1)
    pu = split_layers(ps, ms.num_layers)  # the same weights, unscanned
    push = {"layer_1/resid_post": lambda x: x + 0.5 * ps["io"]["embedding"][7]}
    kw = dict(key=jax.random.key(0), max_new_tokens=4, temperature=0, edits=push)
    got, want = generate(ms, ps, [[5, 6, 7, 8]], **kw), generate(m, pu, [[5, 6, 7, 8]], **kw)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    plain = generate(m, pu, [[5, 6, 7, 8]], **{**kw, "edits": None})
    assert np.abs(plain.logprobs - want.logprobs).max() > 1e-2  # the edit matters
    seq = np.asarray(TOKENS[:1])
    np.testing.assert_allclose(scored_decode(ms, ps, seq, prompt_len=4, edits=push),
                               scored_decode(m, pu, seq, prompt_len=4, edits=push), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unscanned"):
        jax.eval_shape(build_model(ms, edits=push).apply, {"params": ps}, TOKENS)


def test_scanned_models_capture_stacked_points():
    m = _cfg(scan_layers=True)  # shapes only: params and capture abstract
    p = meta.unbox(jax.eval_shape(build_model(m).init, jax.random.key(0), TOKENS)["params"])
    got = jax.eval_shape(lambda q: hooks.capture(build_model(m), q, TOKENS, points=["layers/resid_post"]), p)
    assert got["layers/resid_post"].shape == (2, 2, 12, 32)


def test_heterogeneous_layers_have_the_points_of_their_sub_blocks(tiny, tmp_path):
    from icml_jax.interop.hf import load_hf, save_hf
    m = _cfg()
    m.blocks.attention, m.blocks.ffn = "linear,1", "noop,32"
    # names and shapes only: params and capture abstract
    p = meta.unbox(jax.eval_shape(build_model(m).init, jax.random.key(0), TOKENS)["params"])
    got = jax.eval_shape(lambda q: hooks.capture(build_model(m), q, TOKENS), p)
    assert {k for k in got if k.startswith("layer_0/")} == {"layer_0/resid_pre", "layer_0/attn_out",
                                                             "layer_0/resid_post"}
    assert got["layer_1/attn_heads"].shape == (2, 12, 1, 4, 8) and got["layer_1/mlp_hidden"].shape[-1] == 32
    # an imported HF checkpoint is the same decoder: its points capture and edit alike
    parent, pp = tiny
    save_hf(str(tmp_path / "hf"), parent, pp, "LlamaForCausalLM")
    hm, hp = load_hf(str(tmp_path / "hf"))
    a = _capture(build_model(hm), hp, points=["layer_1/attn_heads"])
    b = _capture(build_model(parent), pp, points=["layer_1/attn_heads"])
    np.testing.assert_allclose(a["layer_1/attn_heads"], b["layer_1/attn_heads"], rtol=1e-5, atol=1e-6)
