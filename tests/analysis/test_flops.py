"""FLOP / parameter accounting against the real model: initialised params and traced matmuls;
the RMT and the RMT paper's convention (docs/methods/rmt.md): its reported training-FLOP
totals and parameter counts."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import flops
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
    """2·(output size)·(contracted size) summed over every dot_general, recursing into sub-jaxprs.
    The RMT's storage (``rmt.store_add``: X [B, T, E, K] + Σ_r v [B, T, r, E] ⊗ s [r, K]) runs as
    one elementwise pass, not a dot; it counts as the R multiply-adds per entry it does."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "custom_vjp_call" and "_store_add_bwd" in str(eqn.params.get("bwd")):
            x_shape, _, s_shape = (v.aval.shape for v in eqn.invars)
            total += 2 * s_shape[0] * int(np.prod(x_shape))
            continue
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


# ----------------------------------------------------------------------------- RMT, paper convention

def _paper_rmt(**rmt):
    """The paper's 305M RMT (L=24, Dk=64, Dv=64, R=16, N_ff=4096) with the GPT-2 vocabulary."""
    c = load_config("configs/rmt.py:paper_305m", unlocked=True).model
    c.vocab_size = 50257
    for k, v in rmt.items():
        c.rmt[k] = v
    return c


def _paper_transformer():
    """GPT-2-medium-shaped transformer 405M: L=24, D=1024, 16 heads of 64, D_FF=4096, plain
    gelu MLP, untied, no position params (ALiBi), GPT-2 vocabulary."""
    c = load_config("configs/lm.py:base", unlocked=True).model
    c.d_model, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn_dim = 1024, 24, 16, 16, 64, 4096
    c.vocab_size, c.tie_embeddings, c.position, c.mlp.activation = 50257, False, "alibi", "gelu_tanh"
    return c


def _within(x, want, tol=0.01):
    return abs(x / want - 1) < tol


def test_paper_training_flops_totals():
    """transformer 1.18e19 and RMT 8.45e18 at 6.04e9 tokens, RMT 4.97e18 at 3.55e9 (N=512)."""
    tf, r = _paper_transformer(), _paper_rmt()
    assert _within(flops.paper_train_flops(tf, 512, 6.04e9), 1.18e19)
    assert _within(flops.paper_train_flops(r, 512, 6.04e9), 8.45e18)
    assert _within(flops.paper_train_flops(r, 512, 3.55e9), 4.97e18)
    # the same through the per-token entry point
    assert flops.train_flops_per_token(r, 512, convention="paper") * 6.04e9 == pytest.approx(
        flops.paper_train_flops(r, 512, 6.04e9), rel=1e-12)
    # the formula as printed (4N·R·V·Dv) overshoots the reported RMT totals by roughly 40%
    printed = flops.paper_train_flops(r, 512, 6.04e9, vocab_term="RVDv")
    assert 1.3 < printed / 8.45e18 < 1.5
    assert flops.paper_train_flops(tf, 512, 6.04e9, vocab_term="RVDv") == flops.paper_train_flops(
        tf, 512, 6.04e9)  # the transformer formula has one vocabulary term
    with pytest.raises(ValueError, match="vocab_term"):
        flops.paper_train_flops(r, 512, 6.04e9, vocab_term="RVD")


def test_paper_parameter_totals():
    """305M / 405M: our exact counts equal the executed reference totals (304,603,136 and
    404,966,400); the paper's formulas plus the untied unembedding give 304.9M / 404.9M."""
    r, tf = _paper_rmt(), _paper_transformer()
    assert flops.param_count(r) == 304_603_136
    assert flops.param_count(tf) == 404_966_400
    paper_rmt = flops.rmt_paper_param_count(24, 16, 64, 64, 4096, 50257, 512) + 16 * 50257 * 64
    paper_tf = flops.transformer_paper_param_count(24, 1024, 16, 64, 4096, 50257) + 50257 * 1024
    assert _within(paper_rmt, 305e6) and _within(paper_tf, 405e6)
    # ours = paper formula + unembedding + norm gains (2L+1)·Dk·Dv - the R·Dv·N position term
    assert flops.param_count(r) == paper_rmt + 49 * 64 * 64 - 16 * 64 * 512


def _tiny(**kw):
    c = load_config("configs/rmt.py:tiny", unlocked=True).model
    rmt = kw.pop("rmt", {})
    for k, v in kw.items():
        c[k] = v
    for k, v in rmt.items():
        c.rmt[k] = v
    return c


@pytest.mark.parametrize("kw", [dict(), dict(rmt=dict(position="learned")), dict(rmt=dict(key_dim=7)),
                                dict(num_heads=3, num_kv_heads=3, ffn_dim=20)])
def test_rmt_param_count_equals_initialised_params(kw):
    m = _tiny(**kw)
    shapes = jax.eval_shape(build_model(m).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    assert flops.param_count(m) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


@pytest.mark.parametrize("activation", ["gelu_tanh", "swiglu"])
def test_exact_rmt_flops_match_the_traced_model(activation):
    """The traced forward's dot_generals = matmul FLOPs per token + full QK^T and PV."""
    m = _tiny()
    m.mlp.activation = activation
    B, T = 2, 16
    model, tokens = build_model(m), jnp.zeros((B, T), jnp.int32)
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens)["params"])
    jaxpr = jax.make_jaxpr(lambda p, t: model.apply({"params": p}, t))(params, tokens).jaxpr
    attn_full = 2 * 2 * m.num_layers * m.num_heads * m.head_dim * T
    assert _dot_flops(jaxpr) == B * T * (flops.rmt_matmul_flops_per_token(m) + attn_full)
    # training: 3x, causal attention halved
    want = 3 * flops.rmt_matmul_flops_per_token(m) + 3 * attn_full / 2
    assert flops.train_flops_per_token(m, T) == want


def test_exact_flops_nearly_independent_of_key_dim():
    """Dk grows the residual 8x while the exact FLOPs grow by the storage/retrieval terms only."""
    c = load_config("configs/rmt.py:small", unlocked=True).model
    f = {}
    for dk in (4, 32):
        c.rmt.key_dim = dk
        f[dk] = flops.train_flops_per_token(c, 256)
    L, R, E = c.num_layers, c.num_heads, c.head_dim
    assert f[32] - f[4] == 3 * (2 + 6 * L) * 2 * R * E * (32 - 4)


def test_unknown_convention_is_a_clear_error():
    with pytest.raises(ValueError, match="convention"):
        flops.train_flops_per_token(_tiny(), 32, convention="chinchilla")
