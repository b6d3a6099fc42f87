"""Puzzle's block variants (icml_jax/compress/puzzle_blocks.py): identity variants reproduce the
parent, KV-head merging regroups query heads correctly, shrinking keeps exactly the chosen
channels, and the costs match the modules' own parameter counts."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.compress import puzzle
from icml_jax.compress import puzzle_blocks as pb
from icml_jax.models import hetero
from icml_jax.config_utils import load_config
from icml_jax.models.attention import Attention
from icml_jax.models.mlp import GatedMLP


@pytest.fixture(scope="module")
def setup():
    c = load_config("configs/lm.py:tiny", unlocked=True).model  # G = 2 KV heads, 4 query heads
    x = jax.random.normal(jax.random.key(1), (2, 6, c.d_model))
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    seg = jnp.ones((2, 6), jnp.int32)
    return c, x, pos, seg


def _attn(cfg, params, x, pos, seg):
    return Attention(cfg).apply({"params": params}, x, pos, seg)


def _with(cfg, **kw):
    out = load_config("configs/lm.py:tiny", unlocked=True).model
    out.update(cfg.to_dict())
    out.update(kw)
    return out


def test_kv_merge_identity_and_duplicated_heads(setup):
    c, x, pos, seg = setup
    params = jax.tree.map(np.asarray, nn.meta.unbox(Attention(c).init(jax.random.key(0), x, pos, seg)["params"]))
    same = pb.merge_kv_heads(params, c.num_kv_heads)  # group size 1: the parent itself
    np.testing.assert_array_equal(_attn(c, same, x, pos, seg), _attn(c, params, x, pos, seg))
    # parent whose two KV heads are equal: one merged KV head computes the same attention
    qkv = params["qkv"].copy()
    R = c.num_heads // c.num_kv_heads
    qkv[:, 1, R:] = qkv[:, 0, R:]
    dup = {**params, "qkv": qkv}
    merged = pb.merge_kv_heads(dup, 1)
    assert merged["qkv"].shape == (c.d_model, 1, c.num_heads + 2, c.head_dim)
    np.testing.assert_allclose(_attn(_with(c, num_kv_heads=1), merged, x, pos, seg),
                               _attn(c, dup, x, pos, seg), atol=1e-5)
    # and the count formula is the module's
    n = sum(v.size for v in jax.tree.leaves(merged))
    assert n == hetero.sub_block_params(c, 1, "attention")[0]
    with pytest.raises(ValueError, match="must divide"):
        pb.merge_kv_heads(params, 3)


def test_ffn_shrink_identity_and_subset(setup):
    c, x, _, _ = setup
    mlp = GatedMLP(c)
    params = jax.tree.map(np.asarray, nn.meta.unbox(mlp.init(jax.random.key(2), x)["params"]))
    y, acts = mlp.apply({"params": params}, x)
    full = pb.shrink_ffn(params, np.arange(c.ffn_dim))
    np.testing.assert_array_equal(mlp.apply({"params": full}, x)[0], y)  # L_BLD = 0
    scores = pb.ffn_channel_scores(acts, params["wo"])
    want = np.abs(np.asarray(acts)).reshape(-1, c.ffn_dim).mean(0) * np.linalg.norm(params["wo"], axis=1)
    np.testing.assert_allclose(scores, want, rtol=1e-6)
    keep = pb.top_channels(scores, 16)
    assert len(keep) == 16 and (np.diff(keep) > 0).all() and scores[keep].min() >= np.delete(scores, keep).max()
    small = _with(c, ffn_dim=16)
    y_small = GatedMLP(small).apply({"params": pb.shrink_ffn(params, keep)}, x)[0]
    np.testing.assert_allclose(y_small, np.asarray(acts)[..., keep] @ params["wo"][keep], atol=1e-5)
    assert sum(v.size for v in jax.tree.leaves(pb.shrink_ffn(params, keep))) == hetero.sub_block_params(c, 16, "ffn")[0]


def test_variant_costs(setup):
    """The spec's property 7: no-op = 0 params and 0 KV bytes, linear = exactly D^2 weights (plus
    its sub-block's norm), attention KV bytes = 2 G' K per token per byte."""
    c = setup[0]
    D = c.d_model
    assert puzzle.variant_costs(c, puzzle.Variant("attention", "noop")) == {"params": 0, "kv_bytes": 0}
    assert hetero.sub_block_params(c, "linear", "ffn") == (D * D, D)
    assert puzzle.variant_costs(c, puzzle.Variant("ffn", "linear")) == {"params": D * D + D, "kv_bytes": 0}
    assert puzzle.variant_costs(c, puzzle.Variant("attention", 1))["kv_bytes"] == 2 * 1 * c.head_dim * 2
