"""Low-rank factors beside the dense kernels: the sparse + low-rank layers of TLR
(docs/methods/tlr_pruning.md). With ``config.model.lowrank`` = r > 0 every linear map of the
standard block's attention and MLP computes

    y = x W + (x A) B          W: the (pruned) kernel, A [in, r], B [r, out]

per Hugging Face projection (q, k, v, o, gate, up, down: the fused kernels get one pair of factors
per projection they hold, so a factorisation made on the HF matrices maps onto them). A is
initialised normal(init_std) and B zero, so a fresh model equals the dense one and the factors
can be trained (LoRA's convention). ``icml_jax.compress.prune`` fills them.

Params (G kv heads, R query heads per kv head, K head dim, D width, F ffn width, C = 2 for gated
MLPs, 1 for plain ones):
  attn:  qkv_lr_a [3, D, r] (q, k, v),  q_lr_b [r, G, R, K],  kv_lr_b [2, r, G, K],
         out_lr_a [G, R, K, r],  out_lr_b [r, D]
  mlp:   wi_lr_a [C, D, r],  wi_lr_b [C, r, F],  wo_lr_a [F, r],  wo_lr_b [r, D]
"""
import flax.linen as nn
import jax.numpy as jnp

from icml_jax.models.layers import param


def rank_of(cfg) -> int:
    return int(cfg.get("lowrank", 0) or 0)


def _pair(module, cfg, name, a_shape, a_axes, b_shape, b_axes, pdt):
    a = param(module, f"{name}_lr_a", nn.initializers.normal(cfg.init_std), a_shape, a_axes, pdt)
    b = param(module, f"{name}_lr_b", nn.initializers.zeros, b_shape, b_axes, pdt)
    return a, b


def attention_factors(module, cfg, G: int, R: int, K: int, pdt):
    """The attention's factors (None when ``config.model.lowrank`` is 0)."""
    r = rank_of(cfg)
    if not r:
        return None
    D = cfg.d_model
    qkv_a = param(module, "qkv_lr_a", nn.initializers.normal(cfg.init_std), (3, D, r),
                  (None, "embed", None), pdt)
    q_b = param(module, "q_lr_b", nn.initializers.zeros, (r, G, R, K),
                (None, "kv_heads", None, "head_dim"), pdt)
    kv_b = param(module, "kv_lr_b", nn.initializers.zeros, (2, r, G, K),
                 (None, None, "kv_heads", "head_dim"), pdt)
    out_a, out_b = _pair(module, cfg, "out", (G, R, K, r), ("kv_heads", None, "head_dim", None),
                         (r, D), (None, "embed"), pdt)
    return dict(qkv_a=qkv_a, q_b=q_b, kv_b=kv_b, out_a=out_a, out_b=out_b)


def qkv_deltas(f, x_BTD):
    """(dq [B, T, G, R, K], dk [B, T, G, K], dv [B, T, G, K]): the factors' share of q, k, v."""
    dt = x_BTD.dtype
    h_BTCr = jnp.einsum("BTD,CDr->BTCr", x_BTD, f["qkv_a"].astype(dt))
    kv_b = f["kv_b"].astype(dt)
    return (jnp.einsum("BTr,rGRK->BTGRK", h_BTCr[:, :, 0], f["q_b"].astype(dt)),
            jnp.einsum("BTr,rGK->BTGK", h_BTCr[:, :, 1], kv_b[0]),
            jnp.einsum("BTr,rGK->BTGK", h_BTCr[:, :, 2], kv_b[1]))


def out_delta(f, o_BTGRK):
    dt = o_BTGRK.dtype
    h_BTr = jnp.einsum("BTGRK,GRKr->BTr", o_BTGRK, f["out_a"].astype(dt))
    return jnp.einsum("BTr,rD->BTD", h_BTr, f["out_b"].astype(dt))


def mlp_factors(module, cfg, D: int, gated: bool, pdt):
    """The MLP's factors (None when ``config.model.lowrank`` is 0)."""
    r = rank_of(cfg)
    if not r:
        return None
    C, F = (2 if gated else 1), cfg.ffn_dim
    wi_a, wi_b = _pair(module, cfg, "wi", (C, D, r), (None, "embed", None), (C, r, F),
                       (None, None, "mlp"), pdt)
    wo_a, wo_b = _pair(module, cfg, "wo", (F, r), ("mlp", None), (r, D), (None, "embed"), pdt)
    return dict(wi_a=wi_a, wi_b=wi_b, wo_a=wo_a, wo_b=wo_b)


def mlp_in_delta(f, x_BTD):
    """[B, T, C, F]: the factors' share of the gate (C index 0) and up (1) pre-activations, or
    of the single input projection (C = 1)."""
    dt = x_BTD.dtype
    h_BTCr = jnp.einsum("BTD,CDr->BTCr", x_BTD, f["wi_a"].astype(dt))
    return jnp.einsum("BTCr,CrF->BTCF", h_BTCr, f["wi_b"].astype(dt))


def mlp_out_delta(f, a_BTF):
    dt = a_BTF.dtype
    return jnp.einsum("BTr,rD->BTD", jnp.einsum("BTF,Fr->BTr", a_BTF, f["wo_a"].astype(dt)),
                      f["wo_b"].astype(dt))
