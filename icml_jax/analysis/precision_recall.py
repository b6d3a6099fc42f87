"""Precision and recall of a model distribution Q against a reference P (docs/methods/precision_recall.md).

Axis letters: N outcomes (aligned probability vectors), M reference samples, G generated samples,
E embedding dimension.

Exact, for discrete distributions given as aligned probability vectors p_N, q_N (entry i is the
same outcome in both; put all of Q's mass off P's support into one extra entry with p = 0, see
``align``): the PRD parameterisation of Simon et al. (2019) and the PR-divergence of Verine et al.
(NeurIPS 2023), both faithful to the prior work:

  alpha_lambda(P, Q) = sum_x min(lambda P(x), Q(x))          precision side   (``alpha``)
  beta_lambda(P, Q)  = alpha_lambda / lambda                  recall side      (``beta``)
  precision = alpha_inf = Q(supp P),  recall = beta_0 = P(supp Q)              (``*_limit``)
  D_lambda(P||Q) = sum_x Q f_lambda(P/Q) = min(lambda, 1) - alpha_lambda,
  f_lambda(u) = max(lambda u, 1) - max(lambda, 1)                               (``pr_divergence``)

Lumping Q's off-support mass into one entry is exact for all of these (P is 0 there, so
min(lambda P, Q) = 0 however that mass is split).

Practical recall for a softmax model, whose support is everything (so beta_0 = 1 always):
``threshold_recall`` = P({x : Q(x) >= eps P(x)}), the P-mass of the outcomes the model generates
at no less than a fraction eps of their data frequency. It is 1 for Q = P (any eps <= 1) and falls
as Q drops modes; beta_eps = sum_x min(P, Q/eps) is its soft version.

Estimated, for samples in an embedding space (Le Bronnec et al., ACL 2024; Kynkaanniemi et al.
2019): ``knn_precision_recall`` — precision = the share of generated points inside some reference
point's k-NN ball, recall = the share of reference points inside some generated point's k-NN ball,
after an optional PCA (fit on the reference set). k and the PCA dimension are arguments: the paper's
values are unknown (docs/methods/precision_recall.md), so record them with every result.
``AUTHORS_PROTOCOL`` holds the settings of the group's public text evaluation (``AlexVerine/
pr-4-llm``, read 2026-12-02): rows L2-normalised, PCA fitted on both sets together and kept to 90%
of the explained variance, k = 4, strict "<" for a ball's inside — pass it as
``knn_precision_recall(ref, gen, **AUTHORS_PROTOCOL)``.
"""
from __future__ import annotations

import numpy as np


def _check_lambda(lam) -> np.ndarray:
    lam = np.asarray(lam, dtype=np.float64)
    if not np.all(lam > 0):
        raise ValueError(f"lambda must be > 0 (lambda < 1 weighs recall, > 1 precision), got {lam}")
    return lam


def _check_pq(p_N, q_N, atol: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    p, q = np.asarray(p_N, dtype=np.float64), np.asarray(q_N, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"p and q must be aligned 1-D probability vectors, got shapes {p.shape} "
                         f"and {q.shape}")
    for name, v in (("p", p), ("q", q)):
        if not np.all(np.isfinite(v)) or np.any(v < 0):
            raise ValueError(f"{name} must be finite and non-negative")
        if abs(v.sum() - 1.0) > atol:
            raise ValueError(f"{name} must sum to 1 (got {v.sum():.8f}); add Q's off-support mass "
                             "as an extra entry (see align)")
    return p, q


def align(p_support_N, q_support_N, q_rest: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) of length N + 1: the outcomes of P's support, then one entry holding Q's remaining
    mass (``q_rest``, default 1 - sum(q_support), clipped at 0) with p = 0."""
    p = np.asarray(p_support_N, dtype=np.float64)
    q = np.asarray(q_support_N, dtype=np.float64)
    rest = max(0.0, 1.0 - float(q.sum())) if q_rest is None else float(q_rest)
    return np.append(p, 0.0), np.append(q, rest)


def alpha(p_N, q_N, lam):
    """alpha_lambda = sum_x min(lambda P, Q); ``lam`` a scalar or an array (same shape out)."""
    p, q = _check_pq(p_N, q_N)
    lam = _check_lambda(lam)
    out = np.minimum(lam[..., None] * p, q).sum(-1)
    return float(out) if out.ndim == 0 else out


def beta(p_N, q_N, lam):
    """beta_lambda = alpha_lambda / lambda."""
    return alpha(p_N, q_N, lam) / _check_lambda(lam)


def prd_curve(p_N, q_N, lambdas=None) -> tuple[np.ndarray, np.ndarray]:
    """(alpha [L], beta [L]) at ``lambdas`` (default: Simon et al.'s tan of 1001 angles in
    (0, pi/2))."""
    if lambdas is None:
        lambdas = np.tan(np.linspace(1e-6, np.pi / 2 - 1e-6, 1001))
    lam = _check_lambda(lambdas)
    a = np.atleast_1d(alpha(p_N, q_N, lam))
    return a, a / lam


def pr_divergence(p_N, q_N, lam) -> float:
    """D_lambda(P||Q) = min(lambda, 1) - alpha_lambda(P, Q) >= 0."""
    lam = float(_check_lambda(lam))
    return min(lam, 1.0) - alpha(p_N, q_N, lam)


def f_lambda(u, lam):
    """The PR-divergence generator f_lambda(u) = max(lambda u, 1) - max(lambda, 1)."""
    lam = float(_check_lambda(lam))
    return np.maximum(lam * np.asarray(u, dtype=np.float64), 1.0) - max(lam, 1.0)


def pr_divergence_from_f(p_N, q_N, lam) -> float:
    """D_lambda from the f-divergence definition sum_x Q f_lambda(P/Q), with the conventions
    0 f(0/0) = 0 and 0 f(p/0) = p lim_{u->inf} f(u)/u = lambda p."""
    p, q = _check_pq(p_N, q_N)
    lam = float(_check_lambda(lam))
    pos = q > 0
    terms = np.where(pos, q * f_lambda(np.where(pos, p / np.where(pos, q, 1.0), 0.0), lam),
                     lam * p)
    return float(terms.sum())


def precision_limit(p_N, q_N) -> float:
    """alpha_inf = Q(supp P)."""
    p, q = _check_pq(p_N, q_N)
    return float(q[p > 0].sum())


def recall_limit(p_N, q_N) -> float:
    """beta_0 = P(supp Q)."""
    p, q = _check_pq(p_N, q_N)
    return float(p[q > 0].sum())


def threshold_recall(p_N, q_N, eps: float = 0.1) -> float:
    """P({x : Q(x) >= eps P(x), P(x) > 0}): the P-mass of outcomes Q generates at >= eps times
    their data frequency (module docstring)."""
    p, q = _check_pq(p_N, q_N)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return float(p[(p > 0) & (q >= eps * p)].sum())


# ----------------------------------------------------------------------------------------------
# k-NN precision / recall on embeddings


def pca_project(x_ME, fit_ME, dim: int | None = None, *, variance: float | None = None):
    """Projects ``x`` on the top principal directions of ``fit`` (centred on fit's mean): ``dim``
    of them, or (``variance`` in (0, 1]) the fewest whose explained variance reaches that share."""
    fit = np.asarray(fit_ME, dtype=np.float64)
    mu = fit.mean(0)
    _, sv, vt = np.linalg.svd(fit - mu, full_matrices=False)
    if variance is not None:
        if dim is not None or not 0.0 < variance <= 1.0:
            raise ValueError(f"pca_variance must be in (0, 1] and excludes pca_dim, got "
                             f"pca_variance={variance}, pca_dim={dim}")
        share = np.cumsum(sv ** 2) / max(float(np.sum(sv ** 2)), 1e-300)
        dim = int(min(np.searchsorted(share, variance - 1e-12) + 1, len(sv)))
    if dim is None or not 1 <= dim <= fit.shape[1]:
        raise ValueError(f"pca_dim must be in [1, {fit.shape[1]}], got {dim}")
    return (np.asarray(x_ME, dtype=np.float64) - mu) @ vt[:dim].T


def _sq_dists(a, b):
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(d, 0.0)


def _knn_radii(x, k):
    d = _sq_dists(x, x)
    # k-th nearest neighbour other than the point itself (index 0 after sorting is the point)
    return np.sqrt(np.sort(d, axis=1)[:, k])


def _coverage(points, centres, radii, strict=False):
    """Share of ``points`` within distance radii[j] of some centres[j] (``strict``: closer than
    it; else within it, with a float tolerance)."""
    d = np.sqrt(_sq_dists(points, centres))
    inside = d < radii[None, :] if strict else d <= radii[None, :] * (1 + 1e-9) + 1e-12
    return float(np.mean(inside.any(1)))


AUTHORS_PROTOCOL = {"k": 4, "normalize": True, "pca_fit": "both", "pca_variance": 0.9,
                    "strict": True}


def knn_precision_recall(reference_ME, generated_GE, *, k: int = 3,
                         pca_dim: int | None = None, normalize: bool = False,
                         pca_fit: str = "reference", pca_variance: float | None = None,
                         strict: bool = False) -> dict:
    """{"precision", "recall", "k", "pca_dim", "normalize", "pca_fit", "strict"} (module
    docstring). ``normalize``: L2-normalise every row first; PCA (``pca_dim`` directions, or the
    fewest reaching ``pca_variance`` of the variance) fitted on ``pca_fit`` = "reference" or
    "both" sets; ``strict``: a ball's inside is d < radius. Needs more than k points in each set."""
    ref = np.asarray(reference_ME, dtype=np.float64)
    gen = np.asarray(generated_GE, dtype=np.float64)
    if ref.ndim != 2 or gen.ndim != 2 or ref.shape[1] != gen.shape[1]:
        raise ValueError(f"embeddings must be [M, E] and [G, E] with the same E, got {ref.shape} "
                         f"and {gen.shape}")
    if not 1 <= k < min(len(ref), len(gen)):
        raise ValueError(f"k must be in [1, min(M, G) - 1] = [1, {min(len(ref), len(gen)) - 1}], "
                         f"got {k}")
    if pca_fit not in ("reference", "both"):
        raise ValueError(f"pca_fit must be 'reference' or 'both', got {pca_fit!r}")
    if normalize:
        ref = ref / np.maximum(np.linalg.norm(ref, axis=1, keepdims=True), 1e-300)
        gen = gen / np.maximum(np.linalg.norm(gen, axis=1, keepdims=True), 1e-300)
    if pca_dim or pca_variance is not None:
        fit = ref if pca_fit == "reference" else np.concatenate([ref, gen])
        ref = pca_project(ref, fit, pca_dim or None, variance=pca_variance)
        gen = pca_project(gen, fit, ref.shape[1])
    return {"precision": _coverage(gen, ref, _knn_radii(ref, k), strict),
            "recall": _coverage(ref, gen, _knn_radii(gen, k), strict), "k": int(k),
            "pca_dim": int(ref.shape[1]) if (pca_dim or pca_variance is not None) else None,
            "normalize": bool(normalize), "pca_fit": pca_fit, "strict": bool(strict)}
