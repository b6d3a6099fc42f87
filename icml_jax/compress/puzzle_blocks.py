"""Puzzle's block variants, initialised from the parent
(docs/methods/puzzle.md). Params are one block's ``attn`` / ``mlp`` sub-trees of our decoder
(``qkv`` [D, G, R+2, K], ``out`` [G, R, K, D]; ``wi`` [D, 2, F] or [D, F], ``wo`` [F, D]).

  FFN shrink       keep the channels with the largest mean_t |a_tc| * ||W_down[c]|| on
                   calibration activations a (the spec's ranking), in their original order.
  fewer KV heads   new KV head j covers parent KV heads j*g .. j*g+g-1 (g = G / G'): its key and
                   value projections start as their mean, and it serves all their query heads
                   (R' = R*g), so the query and output projections are only regrouped.
  (Costs: ``hetero.sub_block_params`` / ``sub_block_kv_bytes``, through ``puzzle.variant_costs``.)
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
