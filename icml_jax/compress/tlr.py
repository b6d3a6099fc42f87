"""Targeted low-rank refinement (TLR) of a pruned matrix, and the one-shot SVD baseline
(docs/methods/tlr_pruning.md). W [m, n] ~ S + B A with supp(S) in the mask P, B [m, k], A [k, n].

TLR (the paper's Algorithm 1 as fusion_bench's ``iterative_weight_update`` runs it):
  S_0 = W * P
  for r in floor(linspace(1, k, T)):             the rank grows from 1 to k
      U, s, V = svd(W - S_t);  r = min(r, len(s) - 1)
      S_{t+1} = S_t + P * (U[:, r:] diag(s[r:]) V[:, r:]^T)     (the masked SVD tail)
      stop early when sum(s[:r]) / sum(s) > early_stop          (plain singular values)
  B = U_k diag(s_k), A = V_k^T of svd(W - S_T)
Since S_t = P * S_t, the update is S_{t+1} = P * (W - SVD_r(W - S_t)): alternating projection for
min ||W - S - L|| with supp(S) in P and rank(L) <= r.
"""
from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_limits


def rank_schedule(rank: int, iters: int) -> np.ndarray:
    """floor(linspace(1, rank, iters)) (numpy's integer linspace, as the reference); [1] for T = 1."""
    if rank < 1 or iters < 1:
        raise ValueError(f"TLR needs rank >= 1 and iters >= 1, got rank={rank}, iters={iters}")
    return np.linspace(1, rank, iters, dtype=np.int64)


def _svd(x):
    """float32 thin SVD by LAPACK's divide and conquer (numpy; torch's CPU default driver too),
    on one BLAS thread: OpenBLAS's pool made these small SVDs up to 160x slower when the cores
    were busy (0.025 s vs 4 s for 256 x 512)."""
    with threadpool_limits(limits=1, user_api="blas"):
        return np.linalg.svd(np.asarray(x, np.float32), full_matrices=False)


def low_rank(residual: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(B [m, k], A [k, n]): the rank-k truncated SVD of ``residual``, B = U_k diag(s_k)."""
    u, s, vh = _svd(residual)
    return (u[:, :rank] * s[:rank]).astype(np.float32), vh[:rank].astype(np.float32)


def one_shot(w: np.ndarray, keep: np.ndarray, rank: int):
    """The zero-shot baseline: S = W * P and the rank-k SVD of the pruned-away part W - S."""
    w = np.asarray(w, np.float32)
    s = np.where(keep, w, 0.0).astype(np.float32)
    b, a = low_rank(w - s, rank)
    return s, b, a


def tlr(w: np.ndarray, keep: np.ndarray, rank: int, iters: int = 10,
        early_stop: float | None = 0.99, keep_states: bool = False):
    """(S, B, A, info): TLR of ``w`` on the keep mask. ``early_stop`` None runs all ``iters``
    (the paper's algorithm as quoted); info = {"iterations", "ranks", "errors"}, errors[t] =
    ||W - S_t - SVD_r(t)(W - S_t)||_F / ||W||_F at each iteration's rank (non-increasing);
    ``keep_states`` adds "states": S_0, S_1, ... (for tests)."""
    w = np.asarray(w, np.float32)
    p = np.asarray(keep, bool)
    s_mat = np.where(p, w, 0.0).astype(np.float32)
    norm = float(np.linalg.norm(w)) or 1.0
    ranks, errors, states = [], [], [s_mat]
    for r in rank_schedule(rank, iters):
        u, sv, vh = _svd(w - s_mat)
        r = int(min(len(sv) - 1, r))
        tail = (u[:, r:] * sv[r:]) @ vh[r:]
        errors.append(float(np.linalg.norm(tail)) / norm)
        ranks.append(r)
        s_mat = s_mat + np.where(p, tail, 0.0).astype(np.float32)
        states.append(s_mat)
        total = float(sv.sum())  # 0 when W - S is 0: the reference's 0/0 = nan never stops
        if early_stop is not None and total > 0 and float(sv[:r].sum()) / total > early_stop:
            break
    b, a = low_rank(w - s_mat, rank)
    info = {"iterations": len(ranks), "ranks": ranks, "errors": errors}
    if keep_states:
        info["states"] = states
    return s_mat, b, a, info


def relative_error(w, s, b=None, a=None) -> float:
    """||W - S - B A||_F / ||W||_F."""
    approx = s if b is None else s + b @ a
    return float(np.linalg.norm(np.asarray(w) - approx) / (np.linalg.norm(w) or 1.0))
