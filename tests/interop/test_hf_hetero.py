"""save_hf of a heterogeneous child (Puzzle, models/hetero.py): written padded in the parent's
uniform Llama / Qwen2 shape, it computes the child's logits in transformers and loads back through
load_hf into the homogeneous parent config with the same logits; layouts a uniform checkpoint
cannot hold exactly are refused before anything is written."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from icml_jax.config_utils import load_config  # noqa: E402
from icml_jax.interop import load_hf, save_hf  # noqa: E402
from icml_jax.interop.hf import uniform_params  # noqa: E402
from icml_jax.models import build_model  # noqa: E402

pytestmark = pytest.mark.xdist_group("hf_interop")

TOKENS = np.random.RandomState(0).randint(0, 384, (2, 12))


def _cfg(attention, ffn, heads=8, kv_heads=4, layers=3, qkv_bias=False):
    m = load_config("configs/lm.py:tiny", unlocked=True).model  # D 32, head_dim 8, F 64
    m.num_layers, m.num_heads, m.num_kv_heads, m.qkv_bias = layers, heads, kv_heads, qkv_bias
    m.blocks.attention, m.blocks.ffn = attention, ffn
    return m


def _random_params(m, seed=0):
    """Non-trivial values everywhere (norms around 1, biases and kernels around 0). Every value is
    drawn here, so the init only gives the tree's shapes: traced abstractly, nothing compiled."""
    p = meta.unbox(jax.eval_shape(build_model(m).init, jax.random.key(seed), jnp.asarray(TOKENS))["params"])
    leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    rng = np.random.RandomState(seed)
    out = []
    for path, x in leaves:
        noise = rng.randn(*x.shape).astype(np.float32)
        norm = any("norm" in str(getattr(k, "key", "")) for k in path)
        out.append(jnp.asarray(1.0 + 0.1 * noise if norm else 0.2 * noise))
    return jax.tree_util.tree_unflatten(tree, out)


def _ours(m, params):
    model = build_model(m)
    return np.asarray(jax.jit(lambda p, t: model.apply({"params": p}, t))(params, jnp.asarray(TOKENS)))


# layer 0: 2 of 4 KV heads + FFN 40 of 64; layer 1: no-op attention + FFN 24; layer 2: 1 KV head,
# no-op FFN
@pytest.mark.parametrize("arch,qkv_bias", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)])
def test_child_exports_padded_with_the_same_logits(tmp_path, arch, qkv_bias):
    m = _cfg("2,noop,1", "40,24,noop", qkv_bias=qkv_bias)
    params = _random_params(m)
    want = _ours(m, params)
    out = save_hf(str(tmp_path / "child"), m, params, arch)

    hf = json.load(open(os.path.join(out, "config.json")))
    assert (hf["num_key_value_heads"], hf["intermediate_size"], hf["num_hidden_layers"]) == (4, 64, 3)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        got = model(torch.tensor(TOKENS)).logits.float().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

    cfg2, params2 = load_hf(out)
    assert cfg2.blocks.attention == "" and cfg2.blocks.ffn == ""
    assert (cfg2.num_kv_heads, cfg2.ffn_dim) == (4, 64)
    np.testing.assert_allclose(_ours(cfg2, params2), want, atol=1e-5, rtol=0)


def test_padding_index_mapping():
    """Slot j of a parent with G = 4 holds child KV head j // (G / G_l); queries keep their order."""
    m = _cfg("2,1,4", "64,64,64")
    params = _random_params(m)
    parent, padded = uniform_params(m, params)
    assert parent.blocks.attention == "" and parent.num_kv_heads == 4
    for i, gl in enumerate((2, 1, 4)):
        child, wide = params[f"layer_{i}"]["attn"], padded[f"layer_{i}"]["attn"]
        rl, rep = 8 // gl, 4 // gl
        for j in range(4):  # k and v of slot j are child head j // rep's
            np.testing.assert_array_equal(wide["qkv"][:, j, 2:], child["qkv"][:, j // rep, rl:])
        for h in range(8):  # query head h: slot h // 2, index h % 2 <- child head h // rl, h % rl
            np.testing.assert_array_equal(wide["qkv"][:, h // 2, h % 2], child["qkv"][:, h // rl, h % rl])
            np.testing.assert_array_equal(wide["out"][h // 2, h % 2], child["out"][h // rl, h % rl])
    np.testing.assert_allclose(_ours(parent, padded), _ours(m, params), atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention,ffn,heads,kv,match", [
    ("2,linear", "64,64", 8, 4, r"config\.model\.blocks\.attention layer 1 is 'linear'"),
    ("4,4", "linear,noop", 8, 4, r"config\.model\.blocks\.ffn layer 0 is 'linear'"),
    ("6,4", "48,48", 12, 6, r"config\.model\.blocks\.attention layer 1 has 4 KV heads.*num_kv_heads=6"),
    ("4,4", "64,80", 8, 4, r"config\.model\.blocks\.ffn layer 1 is 80 wide.*ffn_dim=64"),
])
def test_layouts_without_an_exact_uniform_form_are_refused_before_writing(
        tmp_path, attention, ffn, heads, kv, match):
    m = _cfg(attention, ffn, heads=heads, kv_heads=kv, layers=2)
    params = _random_params(m)
    with pytest.raises(ValueError, match=match):
        save_hf(str(tmp_path / "out"), m, params)
    assert os.listdir(tmp_path) == []


def test_params_of_another_layout_are_refused(tmp_path):
    parent = _random_params(_cfg("", "", layers=2))
    with pytest.raises(ValueError, match=r"params do not match config\.model\.blocks.*layer_1/mlp/wo"):
        save_hf(str(tmp_path / "out"), _cfg("4,2", "64,32", layers=2), parent)
    assert os.listdir(tmp_path) == []
