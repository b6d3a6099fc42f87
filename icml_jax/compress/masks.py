"""Pruning masks on matrices in PyTorch's orientation W [out, in] (a Flax kernel is [in, out]:
transpose first; ``compress.prune`` does it). A mask is bool, True = kept.

Scores: ``magnitude`` |W|; ``wanda`` |W_oi| * ||X_:,i||_2 (X: the calibration inputs of the
layer, so one norm per input feature); ``random`` uniform draws. Patterns:
  unstructured, scope ``row``     in every output row the floor(in * sparsity) lowest scores are
                                  pruned (ties: the earlier input first) -- fusion_bench's
                                  ``unstructured_magnitude_prune_``, used for magnitude and Wanda;
  unstructured, scope ``matrix``  the floor(size * sparsity) lowest scores of the whole matrix;
  N:M (e.g. 2:4)                  in every group of M consecutive inputs of a row the N lowest
                                  scores are pruned (fusion_bench's ``semistructured_..._prune_``:
                                  N counts the pruned weights, so 2:4 keeps 2 of 4).
``global_masks`` ranks the scores of several matrices together (one threshold for the model).
"""
from __future__ import annotations

import numpy as np

METHODS = ("magnitude", "wanda", "random")
SCOPES = ("row", "matrix")


def scores(w: np.ndarray, method: str, in_norms: np.ndarray | None = None,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """Importance of every entry of ``w`` [out, in] (higher = kept first)."""
    w = np.asarray(w, np.float32)
    if method == "magnitude":
        return np.abs(w)
    if method == "wanda":
        if in_norms is None or np.shape(in_norms) != (w.shape[1],):
            raise ValueError(f"wanda needs the calibration input norms, one per input feature "
                             f"({w.shape[1]}), got {None if in_norms is None else np.shape(in_norms)}")
        return np.abs(w) * np.asarray(in_norms, np.float32)[None, :]
    if method == "random":
        return (rng or np.random.default_rng(0)).random(w.shape, dtype=np.float32)
    raise ValueError(f"pruning method must be one of {METHODS}, got {method!r}")


def unstructured(score: np.ndarray, sparsity: float, scope: str = "row") -> np.ndarray:
    """Keep mask pruning the ``sparsity`` share of lowest scores per row or per matrix."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    s = np.asarray(score)
    if scope == "matrix":
        return global_masks([s], sparsity)[0]
    keep = np.ones(s.shape, bool)
    drop = np.argsort(s, axis=1, kind="stable")[:, :int(s.shape[1] * sparsity)]
    np.put_along_axis(keep, drop, False, axis=1)
    return keep


def n_of_m(score: np.ndarray, n: int = 2, m: int = 4) -> np.ndarray:
    """Keep mask pruning the ``n`` lowest of every ``m`` consecutive inputs of each row."""
    s = np.asarray(score)
    if not 0 < n < m:
        raise ValueError(f"an N:M pattern needs 0 < N < M, got {n}:{m}")
    if s.shape[1] % m:
        raise ValueError(f"N:M pruning with M={m} needs the input size ({s.shape[1]}) to be a "
                         f"multiple of {m}")
    groups = s.reshape(s.shape[0], -1, m)
    drop = np.argsort(groups, axis=2, kind="stable")[:, :, :n]
    keep = np.ones(groups.shape, bool)
    np.put_along_axis(keep, drop, False, axis=2)
    return keep.reshape(s.shape)


def parse_pattern(pattern: str) -> tuple[int, int] | None:
    """"unstructured" -> None; "2:4" -> (2, 4) (pruned, group)."""
    if pattern == "unstructured":
        return None
    try:
        n, m = (int(x) for x in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern must be 'unstructured' or 'N:M' (e.g. '2:4'), got {pattern!r}") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern!r}: need 0 < N < M")
    return n, m


def global_masks(score_list, sparsity: float) -> list[np.ndarray]:
    """Keep masks of several matrices pruned together: the floor(total * sparsity) lowest scores
    over all of them (ties: earlier matrix and index first)."""
    if not 0 <= sparsity < 1:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    flat = np.concatenate([np.asarray(s).reshape(-1) for s in score_list])
    keep = np.ones(flat.size, bool)
    keep[np.argsort(flat, kind="stable")[:int(flat.size * sparsity)]] = False
    out, i = [], 0
    for s in score_list:
        out.append(keep[i:i + np.size(s)].reshape(np.shape(s)))
        i += np.size(s)
    return out
