"""In-context linear regression tasks with non-IID clients (Fed-ICL's toy, docs/methods/fed_icl.md).

A task is a weight vector w ~ N(0, I_d / d), so that y = w·x has unit variance for x ~ N(0, I_d);
observed labels carry Gaussian noise of std ``noise``. Pure numpy; every function takes an explicit
``np.random.Generator``.

``federated_tasks``  B tasks, each with one query x_q ~ N(0, I_d) and K clients whose private
                     demonstrations come from the client's own region of x-space: x = c_k + s·z with
                     the centre c_k = ``offset``·u_k (u_k a random unit vector per task and client)
                     and spread s = ``spread`` (non-IID: a client sees only its corner).
``nearest``          the m demonstrations nearest to x_q (Euclidean; nearest first, ties by index).
``federated_training_batch``  training prompts shaped like Fed-ICL's: r ∈ {1..K} clients' pools
                     (``federated_tasks`` with B tasks), the r·m nearest to x_q in the last slots, a hint
                     as below. r = 1 is a client's prompt, r = K the centralised one.
``training_batch``   prompts for training the ICL model: a random number of demonstrations (1..S)
                     drawn from a random region (or IID), a query from N(0, I), and a *hint* (the
                     previous answer of Fed-ICL's round protocol) that is absent with probability
                     ``p_no_hint`` and otherwise the clean label plus noise of a log-uniform scale.
"""
import numpy as np


def sample_weights(rng: np.random.Generator, B: int, d: int) -> np.ndarray:
    """[B, d] task vectors w ~ N(0, I / d)."""
    return rng.standard_normal((B, d)) / np.sqrt(d)


def _unit(rng, shape):
    u = rng.standard_normal(shape)
    return u / np.linalg.norm(u, axis=-1, keepdims=True)


def federated_tasks(rng: np.random.Generator, B: int, K: int, n: int, d: int, *, offset: float = 1.5,
                    spread: float = 0.5, noise: float = 0.1) -> dict:
    """B tasks with K clients of n demonstrations each. Returns ``w`` [B, d], ``xq`` [B, d], ``yq``
    [B] (clean w·x_q), ``X`` [B, K, n, d], ``Y`` [B, K, n] (noisy), ``centres`` [B, K, d]."""
    for name, v in (("B", B), ("K", K), ("n", n), ("d", d)):
        if int(v) < 1:
            raise ValueError(f"federated_tasks: {name}={v} must be >= 1")
    w = sample_weights(rng, B, d)
    xq = rng.standard_normal((B, d))
    centres = offset * _unit(rng, (B, K, d))
    X = centres[:, :, None, :] + spread * rng.standard_normal((B, K, n, d))
    Y = np.einsum("bknd,bd->bkn", X, w) + noise * rng.standard_normal((B, K, n))
    return dict(w=w, xq=xq, yq=np.einsum("bd,bd->b", xq, w),
                X=X, Y=Y, centres=centres)


def nearest(X_BND, xq_BD, m: int) -> np.ndarray:
    """[B, min(m, n)] indices of the demonstrations nearest to x_q, nearest first (ties: lower index)."""
    dist = np.linalg.norm(X_BND - xq_BD[:, None, :], axis=-1)
    return np.argsort(dist, axis=1, kind="stable")[:, :min(m, X_BND.shape[1])]


def _hints(rng, yq, p_no_hint, hint_scale_range):
    B = len(yq)
    has_hint = rng.random(B) >= p_no_hint
    lo, hi = np.log(hint_scale_range[0]), np.log(hint_scale_range[1])
    scale = np.exp(rng.uniform(lo, hi, B))
    return np.where(has_hint, yq + scale * rng.standard_normal(B), 0.0), has_hint


def federated_training_batch(rng: np.random.Generator, B: int, K: int, n: int, m: int, d: int, *,
                             offset: float = 1.5, spread: float = 0.5, noise: float = 0.1, p_no_hint: float = 0.3,
                             hint_scale_range=(0.03, 1.5)) -> dict:
    """Training prompts of S = K·m slots, same keys as ``training_batch``."""
    t = federated_tasks(rng, B, K, n, d, offset=offset, spread=spread, noise=noise)
    r = rng.integers(1, K + 1, B)
    S = K * m
    X, Y = np.zeros((B, S, d)), np.zeros((B, S))
    mask = np.zeros((B, S), bool)
    for j in range(1, K + 1):  # prompts that pool j clients
        sel = np.flatnonzero(r == j)
        if not len(sel):
            continue
        pool_X = t["X"][sel, :j].reshape(len(sel), j * n, d)
        pool_Y = t["Y"][sel, :j].reshape(len(sel), j * n)
        idx = nearest(pool_X, t["xq"][sel], j * m)
        k = idx.shape[1]
        X[sel, S - k:] = np.take_along_axis(pool_X, idx[..., None], 1)
        Y[sel, S - k:] = np.take_along_axis(pool_Y, idx, 1)
        mask[sel, S - k:] = True
    hint, has_hint = _hints(rng, t["yq"], p_no_hint, hint_scale_range)
    return dict(X=X, Y=Y, mask=mask, xq=t["xq"], hint=hint, has_hint=has_hint, yq=t["yq"])


def training_batch(rng: np.random.Generator, B: int, S: int, d: int, *, noise: float = 0.1,
                   offset_max: float = 2.0, spread_range=(0.3, 1.0), p_iid: float = 0.3,
                   p_no_hint: float = 0.3, hint_scale_range=(0.03, 1.5)) -> dict:
    """A batch of training prompts with up to S demonstrations each. Returns ``X`` [B, S, d],
    ``Y`` [B, S], ``mask`` [B, S] (True: a demonstration; the first S - n slots are empty),
    ``xq`` [B, d], ``hint`` [B], ``has_hint`` [B] (bool) and the target ``yq`` [B] (clean)."""
    w = sample_weights(rng, B, d)
    n = rng.integers(1, S + 1, B)
    iid = rng.random(B) < p_iid
    centre = np.where(iid[:, None], 0.0, rng.uniform(0, offset_max, (B, 1)) * _unit(rng, (B, d)))
    spread = np.where(iid, 1.0, rng.uniform(*spread_range, B))
    X = centre[:, None, :] + spread[:, None, None] * rng.standard_normal((B, S, d))
    Y = np.einsum("bsd,bd->bs", X, w) + noise * rng.standard_normal((B, S))
    mask = np.arange(S)[None, :] >= (S - n)[:, None]
    X, Y = X * mask[..., None], Y * mask
    xq = rng.standard_normal((B, d))
    yq = np.einsum("bd,bd->b", xq, w)
    hint, has_hint = _hints(rng, yq, p_no_hint, hint_scale_range)
    return dict(X=X, Y=Y, mask=mask, xq=xq, hint=hint, has_hint=has_hint, yq=yq)
