"""Puzzle's block variants, initialised from the parent, and their exact costs
(docs/methods/puzzle.md). Params are one block's ``attn`` / ``mlp`` sub-trees of our decoder
(``qkv`` [D, G, R+2, K], ``out`` [G, R, K, D]; ``wi`` [D, 2, F] or [D, F], ``wo`` [F, D]).

  FFN shrink       keep the channels with the largest mean_t |a_tc| * ||W_down[c]|| on
                   calibration activations a (the spec's ranking), in their original order.
  fewer KV heads   new KV head j covers parent KV heads j*g .. j*g+g-1 (g = G / G'): its key and
                   value projections start as their mean, and it serves all their query heads
                   (R' = R*g), so the query and output projections are only regrouped.
  linear / no-op   a D x D map (D^2 parameters, no KV cache) / nothing (0 and 0).
"""
from __future__ import annotations

import numpy as np


def ffn_channel_scores(acts_NF: np.ndarray, wo_FD: np.ndarray) -> np.ndarray:
    """[F]: mean over calibration tokens of |a_c| times the norm of W_down's row c."""
    acts = np.abs(np.asarray(acts_NF, np.float32)).reshape(-1, np.shape(acts_NF)[-1])
    return acts.mean(0) * np.linalg.norm(np.asarray(wo_FD, np.float32), axis=1)


def shrink_ffn(mlp: dict, keep: np.ndarray) -> dict:
    """The MLP params restricted to the channels ``keep`` (indices, or a bool mask over F)."""
    keep = np.asarray(keep)
    idx = np.flatnonzero(keep) if keep.dtype == bool else np.sort(keep)
    wi = np.asarray(mlp["wi"])
    return {"wi": wi[..., idx], "wo": np.asarray(mlp["wo"])[idx]}


def top_channels(scores: np.ndarray, width: int) -> np.ndarray:
    """Indices of the ``width`` highest scores, in their original order (ties: lower index)."""
    if not 0 < width <= len(scores):
        raise ValueError(f"an FFN width must be in 1..{len(scores)}, got {width}")
    return np.sort(np.argsort(-np.asarray(scores), kind="stable")[:width])


def merge_kv_heads(attn: dict, kv_heads: int) -> dict:
    """The attention params with ``kv_heads`` KV heads, each the mean of its parent group's."""
    qkv = np.asarray(attn["qkv"])  # [D, G, R+2, K]
    D, G, C, K = qkv.shape
    R = C - 2
    if kv_heads < 1 or G % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide the parent's {G} KV heads")
    g = G // kv_heads
    grouped = qkv.reshape(D, kv_heads, g, C, K)
    q = grouped[:, :, :, :R].reshape(D, kv_heads, g * R, K)  # the group's query heads, in order
    kv = grouped[:, :, :, R:].mean(axis=2)  # [D, G', 2, K]
    out = {"qkv": np.concatenate([q, kv], axis=2),
           "out": np.asarray(attn["out"]).reshape(kv_heads, g * R, K, -1)}
    if "qkv_bias" in attn:
        b = np.asarray(attn["qkv_bias"]).reshape(kv_heads, g, C, K)
        out["qkv_bias"] = np.concatenate([b[:, :, :R].reshape(kv_heads, g * R, K), b[:, :, R:].mean(1)], axis=1)
    return out


def attention_params(d_model: int, num_heads: int, kv_heads: int, head_dim: int) -> int:
    """Weights of a GQA attention block (q, k, v, o; no biases)."""
    return d_model * (num_heads + 2 * kv_heads) * head_dim + num_heads * head_dim * d_model


def ffn_params(d_model: int, width: int, gated: bool = True) -> int:
    return (3 if gated else 2) * d_model * width


def kv_bytes_per_token(kv_heads: int, head_dim: int, bytes_per_value: int = 2) -> int:
    """KV-cache bytes one token adds to one layer (keys and values)."""
    return 2 * kv_heads * head_dim * bytes_per_value


def variant_costs(kind: str, d_model: int, *, num_heads: int = 0, head_dim: int = 0, kv_heads: int = 0,
                  width: int = 0, gated: bool = True, bytes_per_value: int = 2) -> dict:
    """{"params", "kv_bytes"} of one variant: kind attention | ffn | linear | noop."""
    if kind == "attention":
        return {"params": attention_params(d_model, num_heads, kv_heads, head_dim),
                "kv_bytes": kv_bytes_per_token(kv_heads, head_dim, bytes_per_value)}
    if kind == "ffn":
        return {"params": ffn_params(d_model, width, gated), "kv_bytes": 0}
    if kind == "linear":
        return {"params": d_model * d_model, "kv_bytes": 0}
    if kind == "noop":
        return {"params": 0, "kv_bytes": 0}
    raise ValueError(f"variant kind must be attention | ffn | linear | noop, got {kind!r}")
