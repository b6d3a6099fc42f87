"""Per-layer block layouts: the heterogeneous decoders Puzzle builds (docs/methods/puzzle.md).

``config.model.blocks.attention`` and ``config.model.blocks.ffn`` are "" (every layer as the rest
of ``config.model`` says: the homogeneous decoder) or one comma-separated entry per layer:

  attention   an integer G_l: GQA with G_l KV heads (num_heads % G_l == 0; the query heads of
              KV head g are g*R_l .. g*R_l + R_l - 1, R_l = num_heads / G_l)
              "linear": one D x D map of the normed input (no KV cache)
              "noop": nothing (the layer adds no attention, no norm, no cache)
  ffn         an integer F_l (the MLP's width, same activation), "linear" (D x D) or "noop"

A layer's params keep the parent's names (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``), so a
layout whose every entry is the parent's own loads the parent's params and computes the same
logits. The linear maps are ``attn/kernel`` and ``mlp/kernel`` [D, D]. Heterogeneous decoders run
unscanned (``scan_layers=False``) on the standard residual stream, without TLR factors or the
gathered sparse FFN.
"""
from __future__ import annotations

import flax.linen as nn
import ml_collections

from icml_jax.models import hooks
from icml_jax.models.attention import Attention
from icml_jax.models.layers import RMSNorm, constrain, get_dtype, param
from icml_jax.models.mlp import ACTIVATIONS, is_gated

KINDS = ("linear", "noop")


def _entries(m, key: str) -> list[str]:
    blocks = m.get("blocks", None)
    text = str(blocks.get(key, "") if blocks is not None else "").strip()
    return [e.strip() for e in text.split(",")] if text else []


def is_hetero(m) -> bool:
    return bool(_entries(m, "attention") or _entries(m, "ffn"))


def layout(m) -> list[tuple]:
    """[(attention, ffn)] per layer; each an int (KV heads / width) or "linear" / "noop"."""
    out = []
    for key, default in (("attention", m.num_kv_heads), ("ffn", m.ffn_dim)):
        entries = _entries(m, key)
        if entries and len(entries) != m.num_layers:
            raise ValueError(f"config.model.blocks.{key} has {len(entries)} entries for "
                             f"num_layers={m.num_layers}; give one per layer (or '' for the parent's)")
        vals = []
        for i, e in enumerate(entries or [str(default)] * m.num_layers):
            if e in KINDS:
                vals.append(e)
            elif e.isdigit() and int(e) > 0:
                vals.append(int(e))
            else:
                raise ValueError(f"config.model.blocks.{key} entry {i} is {e!r}; use a positive integer "
                                 f"({'KV heads' if key == 'attention' else 'FFN width'}), 'linear' or 'noop'")
        out.append(vals)
    return list(zip(*out))


def validate(m) -> None:
    """One-line errors naming the key, before any compute."""
    if not is_hetero(m):
        return
    for i, (a, _) in enumerate(layout(m)):
        if isinstance(a, int) and m.num_heads % a:
            raise ValueError(f"config.model.blocks.attention entry {i} is {a} KV heads, which does not "
                             f"divide num_heads={m.num_heads}")
    for key, bad in (("scan_layers", m.get("scan_layers", False)),
                     ("residual", m.get("residual", "standard") != "standard"),
                     ("lowrank", int(m.get("lowrank", 0) or 0)),
                     ("mlp.sparse_capacity", int(m.mlp.get("sparse_capacity", 0) or 0))):
        if bad:
            raise ValueError(f"config.model.blocks (a per-layer layout) runs on the unscanned standard "
                             f"decoder only: set config.model.{key} to its default "
                             "(scan_layers=False, residual='standard', lowrank=0, sparse_capacity=0)")


def layer_config(m, i: int):
    """``config.model`` as layer ``i``'s GQA / MLP modules read it (its KV heads and width)."""
    a, f = layout(m)[i]
    c = ml_collections.ConfigDict(m.to_dict() if hasattr(m, "to_dict") else dict(m))
    if isinstance(a, int):
        c.num_kv_heads = a
    if isinstance(f, int):
        c.ffn_dim = f
    c.blocks.attention = c.blocks.ffn = ""
    return ml_collections.FrozenConfigDict(c)


def _norm(c, name):
    return RMSNorm(eps=c.norm_eps, dtype=get_dtype(c.dtype),
                   param_dtype=get_dtype(c.param_dtype, "config.model.param_dtype"), name=name)


class Linear(nn.Module):
    """y = x W, W [D, D] (Puzzle's linear replacement of a sub-block)."""
    cfg: ml_collections.ConfigDict

    @nn.compact
    def __call__(self, x_BTD):
        c = self.cfg
        w = param(self, "kernel", nn.initializers.normal(c.init_std), (c.d_model, c.d_model),
                  ("embed", "mlp"), get_dtype(c.param_dtype, "config.model.param_dtype"))
        dt = get_dtype(c.dtype)
        return x_BTD.astype(dt) @ w.astype(dt)


def attention_part(module, c, kind, decode, h_BTD, positions_BT, segment_ids_BT, edits: tuple = ()):
    """What the attention sub-block adds to the stream (created in ``module``'s scope)."""
    if kind == "noop":
        return None
    x = _norm(c, "attn_norm")(h_BTD)
    if kind == "linear":
        return Linear(c, name="attn")(x)
    return Attention(c, decode, edits=edits, name="attn")(x, positions_BT, segment_ids_BT)


def ffn_part(module, c, kind, h_BTD, edits: tuple = ()):
    """(what the FFN sub-block adds, its activations or None)."""
    if kind == "noop":
        return None, None
    x = _norm(c, "mlp_norm")(h_BTD)
    if kind == "linear":
        return Linear(c, name="mlp")(x), None
    return ACTIVATIONS.get(c.mlp.activation)(c, edits=edits, name="mlp")(x)


class AttentionPart(nn.Module):
    """One attention variant alone (``attn_norm`` + ``attn``): its output, zeros for no-op."""
    cfg: ml_collections.ConfigDict
    kind: object

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT):
        y = attention_part(self, self.cfg, self.kind, False, h_BTD, positions_BT, segment_ids_BT)
        return h_BTD * 0 if y is None else y


class FfnPart(nn.Module):
    """One FFN variant alone (``mlp_norm`` + ``mlp``): its output, zeros for no-op; with
    ``with_acts`` also its activations [B, T, F] (None for linear / no-op)."""
    cfg: ml_collections.ConfigDict
    kind: object
    with_acts: bool = False

    @nn.compact
    def __call__(self, h_BTD):
        y, acts = ffn_part(self, self.cfg, self.kind, h_BTD)
        y = h_BTD * 0 if y is None else y
        return (y, acts) if self.with_acts else y


class HeteroBlock(nn.Module):
    """Layer ``layer`` of a per-layer layout: h += attn_l(h); h += ffn_l(h); hook points as the
    standard block's (``models/hooks.py``) where the layer has the sub-block."""
    cfg: ml_collections.ConfigDict
    decode: bool = False
    layer: int = 0
    edits: tuple = ()

    @nn.compact
    def __call__(self, h_BTD, positions_BT, segment_ids_BT):
        a, f = layout(self.cfg)[self.layer]
        c, e = layer_config(self.cfg, self.layer), self.edits
        h_BTD = hooks.point(self, "resid_pre", h_BTD, e)
        y = attention_part(self, c, a, self.decode, h_BTD, positions_BT, segment_ids_BT, e)
        if y is not None:
            h_BTD = h_BTD + hooks.point(self, "attn_out", y, e)
        y, acts = ffn_part(self, c, f, h_BTD, e)
        if acts is not None:
            self.sow("intermediates", "mlp_acts", acts)
        if y is not None:
            h_BTD = h_BTD + hooks.point(self, "mlp_out", y, e)
        return hooks.point(self, "resid_post", constrain(h_BTD, ("batch", "length", "act_embed")), e), None


# ----------------------------------------------------------------------------- accounting

def sub_block_params(m, kind, part: str) -> tuple[int, int]:
    """(matmul weights, other params: the norm's, plus the q/k/v biases of ``qkv_bias`` models) of
    one sub-block variant ("attention" | "ffn")."""
    D = m.d_model
    if kind == "noop":
        return 0, 0
    if kind == "linear":
        return D * D, D
    if part == "attention":
        bias = (m.num_heads + 2 * kind) * m.head_dim if m.get("qkv_bias", False) else 0
        return D * (m.num_heads + 2 * kind) * m.head_dim + m.num_heads * m.head_dim * D, D + bias
    return (3 if is_gated(m.mlp.activation) else 2) * D * kind, D


def layer_params(m) -> list[tuple[int, int]]:
    """[(matmul weights, other params)] per layer of ``config.model``'s layout."""
    out = []
    for a, f in layout(m):
        (ma, na), (mf, nf) = sub_block_params(m, a, "attention"), sub_block_params(m, f, "ffn")
        out.append((ma + mf, na + nf))
    return out


def attention_layers(m) -> int:
    """Layers that run softmax attention (the ones with a KV cache)."""
    return sum(isinstance(a, int) for a, _ in layout(m))


def sub_block_kv_bytes(m, kind, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token adds to one attention variant (keys and values; 0 for linear /
    no-op)."""
    return 2 * kind * m.head_dim * bytes_per_value if isinstance(kind, int) else 0


def kv_bytes_per_token(m, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token adds over all layers (keys and values)."""
    return sum(sub_block_kv_bytes(m, a, bytes_per_value) for a, _ in layout(m))
