"""Feature entanglement: how close a feature vector comes to any other feature's direction.

For feature vectors v_1 … v_N in R^M (rows; normalised here to unit length):

    E_i = max_{j != i} |v_i · v_j|

0 means v_i is orthogonal to every other feature; 1 means another feature lies on its line. With
more features than dimensions (N > M) they cannot all be orthogonal, and the Welch bound says how
entangled the worst of them must be: max_i E_i >= sqrt((N - M) / ((N - 1) M)). Used by the toy
superposition study of "When Bad Data Leads to Good Models" (docs/methods/iti_bad_data.md).
"""
import math

import numpy as np


def normalise_rows(vectors) -> np.ndarray:
    """The rows of ``vectors`` [N, M] scaled to unit L2 norm (float64). A zero row is an error:
    its direction, and so its entanglement, is undefined."""
    v = np.asarray(vectors, np.float64)
    if v.ndim != 2:
        raise ValueError(f"vectors must be [N, M], got shape {v.shape}")
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"zero feature vector(s) at rows {np.flatnonzero(norms[:, 0] == 0).tolist()}")
    return v / norms


def cosine_matrix(vectors) -> np.ndarray:
    """|cos| between every pair of rows [N, N] (the diagonal is 1)."""
    u = normalise_rows(vectors)
    return np.abs(u @ u.T)


def entanglement(vectors) -> np.ndarray:
    """E_i = max_{j != i} |v_i · v_j| of the row-normalised ``vectors`` [N, M], shape [N]
    (N >= 2)."""
    c = cosine_matrix(vectors)
    if len(c) < 2:
        raise ValueError("entanglement needs at least two vectors")
    np.fill_diagonal(c, -np.inf)
    return np.minimum(c.max(axis=1), 1.0)  # rounding can put |cos| of parallel rows a hair above 1


def welch_bound(n: int, m: int) -> float:
    """The least possible max_i E_i of ``n`` unit vectors in R^``m``:
    sqrt((n - m) / ((n - 1) m)); 0 when n <= m (an orthonormal set exists)."""
    n, m = int(n), int(m)
    if n < 2 or m < 1:
        raise ValueError(f"welch_bound needs n >= 2 and m >= 1, got n={n}, m={m}")
    if n <= m:
        return 0.0
    return math.sqrt((n - m) / ((n - 1) * m))
