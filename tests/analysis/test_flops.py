"""FLOP / parameter accounting against the real model: initialised params and traced matmuls."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis.flops import matmul_params, param_count, train_flops_per_token
from icml_jax.config_utils import load_config
from icml_jax.models import build_model

MATMUL_KERNELS = ("qkv", "out", "wi", "wo", "lm_head")


def _cfg(tie=True, heads=4, kv_heads=2):
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.model.tie_embeddings, c.model.num_heads, c.model.num_kv_heads = tie, heads, kv_heads
    return c.model


def _params(m, T=8):
    tokens = jnp.zeros((1, T), jnp.int32)
    return nn.meta.unbox(jax.eval_shape(build_model(m).init, jax.random.key(0), tokens)["params"])


def _leaves(params):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(params)]


@pytest.mark.parametrize("tie,heads,kv_heads", [(True, 4, 2), (False, 4, 2), (True, 4, 4), (False, 2, 1)])
def test_param_count_matches_initialised_model(tie, heads, kv_heads):
    m = _cfg(tie, heads, kv_heads)
    assert param_count(m) == sum(int(np.prod(x.shape)) for _, x in _leaves(_params(m)))


@pytest.mark.parametrize("tie", [True, False])
def test_matmul_params_are_the_projection_kernels(tie):
    """Every kernel that multiplies activations, plus the output projection (the tied embedding
    when tied); never the input embedding lookup or the norm gains."""
    m = _cfg(tie)
    leaves = _leaves(_params(m))
    kernels = sum(int(np.prod(x.shape)) for k, x in leaves if k.split("'")[-2] in MATMUL_KERNELS)
    out_proj = 0 if not tie else m.vocab_size * m.d_model
    assert matmul_params(m) == kernels + out_proj
    assert matmul_params(m) < param_count(m)


def _dot_flops(jaxpr) -> int:
    """2·(output size)·(contracted size) summed over every dot_general, recursing into sub-jaxprs."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in lc]))
        for sub in jax.core.jaxprs_in_params(eqn.params):
            total += _dot_flops(sub)
    return total


def test_forward_matmul_flops_match_the_traced_model():
    """The traced forward's dots = 2·matmul_params per token + full (non-causal) QK^T and PV."""
    m = _cfg()
    B, T = 2, 16
    model, tokens = build_model(m), jnp.zeros((B, T), jnp.int32)
    params = _params(m, T)
    jaxpr = jax.make_jaxpr(lambda p, t: model.apply({"params": p}, t))(params, tokens).jaxpr
    attn_full = 2 * 2 * m.num_layers * m.num_heads * m.head_dim * T  # per token, both matmuls
    assert _dot_flops(jaxpr) == B * T * (2 * matmul_params(m) + attn_full)


def test_train_flops_hand_computed():
    """tiny: D=32, L=2, H=4, G=2, K=8, F=64, V=384, tied; T=32."""
    m = _cfg()
    per_layer = 32 * (4 + 2 * 2) * 8 + 4 * 8 * 32 + 3 * 32 * 64  # qkv + out + gate/up/down
    assert matmul_params(m) == 2 * per_layer + 32 * 384
    # Attention: QK^T and PV each 2·T·K FLOPs per head per token, halved for causal, x3 for
    # training: 3 · 2 · 2·T·K · H · L / 2 = 6·L·H·K·T = 6·2·4·8·32.
    attn = 6 * 2 * 4 * 8 * 32
    assert train_flops_per_token(m, 32) == 6 * matmul_params(m) + attn
    assert train_flops_per_token(m, 64) - train_flops_per_token(m, 32) == attn
