"""Fed-ICL (Wang et al., ICML 2025): federated in-context learning by iterative answer refinement.

Only answers travel; demonstrations never leave their client. Round t (``run_fed_icl``):

1. the server broadcasts (x_q, ŷ⁽ᵗ⁾) to every client (ŷ⁽⁰⁾ is empty);
2. client k selects m of its own demonstrations, D'_k = Select_k(D_k, x_q) (``select``: the m
   nearest to x_q, flag ``fedicl_select=knn``, or m at random);
3. client k answers y_k⁽ᵗ⁺¹⁾ = f(D'_k, x_q, ŷ⁽ᵗ⁾) with the ICL model f (the previous answer goes
   into the query slot; ``include_prev_answer=False`` leaves it out: the ablation);
4. the server aggregates, ŷ⁽ᵗ⁺¹⁾ = Agg({y_k⁽ᵗ⁺¹⁾}) (``aggregate``: mean; ``weighted``: a mean
   weighted by a relevance score each client sends with its answer, 1 / (mean distance of its
   selected demonstrations to x_q); ``vote``: (weighted) majority for discrete answers).

It stops after ``rounds`` rounds, or earlier when no server answer moved by more than ``tol``.
The algorithm's details are the spec's reconstruction (no reference code exists).

An ICL model f is any callable ``f(X [B,S,d], Y [B,S], mask [B,S], xq [B,d], hint [B],
has_hint [B]) -> [B]``; demonstrations fill the last slots of the S (``mask`` True), so a jitted
model sees one shape. ``model_icl_fn`` wraps ``models.icl_regressor.ICLRegressor``;
``bayes_icl_fn`` is the exact posterior mean for Gaussian linear regression that treats the hint
as one more noisy observation of y_q (a reference learner, no training).

Baselines: ``local_only`` (each client alone, no hint, no aggregation) and ``centralised`` (all
clients' demonstrations pooled, the m·K selected from the pool in one prompt).
Every message of a run is in ``FedICLResult.log`` (sender, receiver, round, payload), so a test can
check that nothing but (x_q, ŷ) is broadcast and nothing but answers (and weights) come back.
"""
import dataclasses
from typing import Callable

import numpy as np

from icml_jax.data.icl_regression import nearest

SELECTS = ("knn", "random")
AGGREGATES = ("mean", "weighted", "vote")


def _check(name, value, options):
    if value not in options:
        raise ValueError(f"fed_icl: {name}={value!r}; choose one of {options}")


def select(X_BND, Y_BN, xq_BD, m: int, method: str = "knn", rng: np.random.Generator | None = None):
    """One client's local demonstration filtering (Alg. 2): indices [B, min(m, n)] of the chosen
    demonstrations (``knn``: nearest to x_q in Euclidean distance, nearest first, ties by index;
    ``random``: uniform without replacement, which needs ``rng``), and the chosen X, Y."""
    _check("fedicl_select", method, SELECTS)
    if m < 1:
        raise ValueError(f"fed_icl: m={m} demonstrations per client must be >= 1")
    B, n, _ = X_BND.shape
    k = min(m, n)
    if method == "knn":
        idx = nearest(X_BND, xq_BD, k)
    else:
        if rng is None:
            raise ValueError("fed_icl: fedicl_select='random' needs an rng (np.random.Generator)")
        idx = np.stack([rng.permutation(n)[:k] for _ in range(B)])
    take = lambda a: np.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), 1)  # noqa: E731
    return idx, take(X_BND), take(Y_BN)


def pad_prompt(Xs_BMD, Ys_BM, slots: int):
    """Chosen demonstrations placed in the last M of ``slots`` slots: (X [B,S,d], Y [B,S], mask)."""
    B, M, d = Xs_BMD.shape
    if M > slots:
        raise ValueError(f"fed_icl: {M} demonstrations do not fit a prompt of {slots} slots; raise slots")
    X = np.zeros((B, slots, d), np.float64)
    Y = np.zeros((B, slots), np.float64)
    X[:, slots - M:], Y[:, slots - M:] = Xs_BMD, Ys_BM
    mask = np.zeros((B, slots), bool)
    mask[:, slots - M:] = True
    return X, Y, mask


def relevance(Xs_BMD, xq_BD, eps: float = 1e-6):
    """A client's weight for ``weighted`` aggregation: 1 / (mean distance of its chosen
    demonstrations to x_q) [B]."""
    return 1.0 / (np.linalg.norm(Xs_BMD - xq_BD[:, None, :], axis=-1).mean(1) + eps)


def aggregate(answers_KB, method: str = "mean", weights_KB=None):
    """The server's aggregation (Alg. 3) of K answers per query [K, B] -> [B]. ``mean``; ``weighted``
    (weights [K, B] or [K], normalised per query); ``vote``: the answer with the largest (weighted)
    count, ties to the smallest answer."""
    _check("fedicl_agg", method, AGGREGATES)
    a = np.asarray(answers_KB)
    K = a.shape[0]
    w = np.ones(a.shape, np.float64)
    if weights_KB is not None and method != "mean":
        w = np.asarray(weights_KB, np.float64)
        w = np.broadcast_to(w.reshape((K,) + (1,) * (a.ndim - 1)) if w.ndim == 1 else w, a.shape)
    if method in ("mean", "weighted"):
        return (w * a).sum(0) / w.sum(0)
    # Each client's answer scores the summed weight of the clients that gave the same answer
    # (NaN equals NaN, as np.unique groups them), vectorised over the queries (the loop runs over
    # the K clients). The weights are added in client order, as np.bincount adds them, so equal
    # scores are the same ties the per-query count finds. Among the best-scoring answers the
    # smallest wins (by sort rank: NaN sorts last, as in np.unique; any sortable dtype).
    nan = np.isnan(a) if a.dtype.kind in "fc" else np.zeros(a.shape, bool)
    score = np.zeros(a.shape, np.float64)
    for j in range(K):
        score += np.where((a == a[j]) | (nan & nan[j]), w[j], 0.0)
    top = score == score.max(0, keepdims=True)
    rank = np.argsort(np.argsort(a, axis=0, kind="stable"), axis=0, kind="stable")
    pick = np.argmin(np.where(top, rank, K), axis=0)
    return np.asarray(np.take_along_axis(a, pick[None], axis=0)[0])


@dataclasses.dataclass
class FedICLResult:
    server: np.ndarray    # [R, B]: ŷ after round 1..R (rounds after a stop repeat the last answer)
    clients: np.ndarray   # [R, K, B]: each client's answer in each round
    rounds_run: int       # rounds actually run (< R after an early stop)
    log: list             # messages: dict(round, sender, receiver, payload={name: array})
    selected: list        # per client: the indices [B, m] of the demonstrations it chose


def run_fed_icl(f: Callable, X_BKND, Y_BKN, xq_BD, *, m: int, rounds: int = 5, select_method: str = "knn",
                agg: str = "mean", include_prev_answer: bool = True, slots: int | None = None,
                tol: float = 0.0, rng: np.random.Generator | None = None, init_B=None) -> FedICLResult:
    """The Fed-ICL round protocol over K clients (axis 1 of X [B, K, n, d], Y [B, K, n]); ``init``
    is ŷ⁽⁰⁾ (None: empty). Each client filters once, before the first round: ``knn`` depends only
    on x_q; ``random`` is drawn once from ``rng`` and kept for every round."""
    _check("fedicl_agg", agg, AGGREGATES)
    if rounds < 1:
        raise ValueError(f"fed_icl: fedicl_rounds={rounds} must be >= 1")
    B, K, n, _ = X_BKND.shape
    slots = slots or min(m, n)
    log, selected, prompts, weights = [], [], [], []
    for k in range(K):  # each client's private step: filter its own data
        idx, Xs, Ys = select(X_BKND[:, k], Y_BKN[:, k], xq_BD, m, select_method, rng)
        selected.append(idx)
        prompts.append(pad_prompt(Xs, Ys, slots))
        weights.append(relevance(Xs, xq_BD))
    prev = None if init_B is None else np.asarray(init_B, np.float64)
    server, clients = [], []
    for t in range(rounds):
        answers = []
        for k in range(K):
            sent = prev if include_prev_answer else None
            log.append(dict(round=t, sender="server", receiver=f"client{k}",
                            payload=dict(xq=xq_BD, answer=sent)))
            X, Y, mask = prompts[k]
            has = np.full(B, sent is not None)
            y = np.asarray(f(X, Y, mask, xq_BD, np.zeros(B) if sent is None else sent, has), np.float64)
            reply = dict(answer=y, weight=weights[k]) if agg == "weighted" else dict(answer=y)
            log.append(dict(round=t, sender=f"client{k}", receiver="server", payload=reply))
            answers.append(y)
        answers = np.stack(answers)
        new = aggregate(answers, agg, np.stack(weights) if agg == "weighted" else None)
        clients.append(answers)
        server.append(new)
        stop = prev is not None and np.all(np.abs(new - prev) <= tol)
        prev = new
        if stop:
            break
    rounds_run = len(server)
    server += [server[-1]] * (rounds - rounds_run)
    clients += [clients[-1]] * (rounds - rounds_run)
    return FedICLResult(np.stack(server), np.stack(clients), rounds_run, log, selected)


def local_only(f: Callable, X_BKND, Y_BKN, xq_BD, *, m: int, select_method: str = "knn", slots: int | None = None,
               rng: np.random.Generator | None = None):
    """Each client alone: its ICL answer from its own m chosen demonstrations, no hint [K, B]."""
    B, K, n, _ = X_BKND.shape
    out = []
    for k in range(K):
        _, Xs, Ys = select(X_BKND[:, k], Y_BKN[:, k], xq_BD, m, select_method, rng)
        X, Y, mask = pad_prompt(Xs, Ys, slots or min(m, n))
        out.append(np.asarray(f(X, Y, mask, xq_BD, np.zeros(B), np.zeros(B, bool)), np.float64))
    return np.stack(out)


def centralised(f: Callable, X_BKND, Y_BKN, xq_BD, *, m_total: int, select_method: str = "knn",
                slots: int | None = None, rng: np.random.Generator | None = None):
    """Centralised ICL: the clients' demonstrations pooled, m_total chosen from the pool, one
    prompt, no hint [B]."""
    B, K, n, d = X_BKND.shape
    _, Xs, Ys = select(X_BKND.reshape(B, K * n, d), Y_BKN.reshape(B, K * n), xq_BD, m_total, select_method, rng)
    X, Y, mask = pad_prompt(Xs, Ys, slots or min(m_total, K * n))
    return np.asarray(f(X, Y, mask, xq_BD, np.zeros(B), np.zeros(B, bool)), np.float64)


def bayes_icl_fn(noise: float, hint_std: float, prior_var: float):
    """The exact posterior-mean ICL learner for y = w·x + N(0, noise²), w ~ N(0, prior_var·I): the
    hint, when present, counts as one more observation (x_q, ŷ) with noise std ``hint_std``."""
    def f(X, Y, mask, xq, hint, has_hint):
        m = np.asarray(mask, np.float64) / noise ** 2
        h = np.asarray(has_hint, np.float64) / hint_std ** 2
        d = X.shape[-1]
        A = np.einsum("bs,bsi,bsj->bij", m, X, X) + h[:, None, None] * np.einsum("bi,bj->bij", xq, xq) \
            + np.eye(d) / prior_var
        rhs = np.einsum("bs,bsi,bs->bi", m, X, Y) + (h * hint)[:, None] * xq
        return np.einsum("bi,bi->b", np.linalg.solve(A, rhs[..., None])[..., 0], xq)
    return f


def model_icl_fn(model, params, batch: int | None = None):
    """An ICL function from an ``ICLRegressor`` and its params: one jitted forward (compiled once
    per prompt shape), run in chunks of ``batch`` queries (the last chunk padded)."""
    import jax

    @jax.jit
    def fwd(p, X, Y, mask, xq, hint, has):
        return model.apply({"params": p}, X, Y, mask, xq, hint, has)

    def f(X, Y, mask, xq, hint, has_hint):
        B = X.shape[0]
        size = batch or B
        arrays = [np.asarray(a, np.float32 if i in (0, 1, 3, 4) else None)
                  for i, a in enumerate((X, Y, mask, xq, hint, has_hint))]
        out = []
        for s in range(0, B, size):
            chunk = [a[s:s + size] for a in arrays]
            pad = size - chunk[0].shape[0]
            if pad:
                chunk = [np.concatenate([a, np.repeat(a[-1:], pad, 0)]) for a in chunk]
            out.append(np.asarray(fwd(params, *chunk))[:size - pad])
        return np.concatenate(out)
    return f
