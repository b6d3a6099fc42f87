"""The sparsing laws: the activation ratio as a function of training data D (ReLU and SiLU
forms) and their fits.

The released ``calc.py`` (``Raincleared-Song/SparsingLawData`` @ 1cab443) does not fit the power
laws; it evaluates hand-tuned parameters (``CURVE_PARAM``) and fits only the logarithmic and
sigmoid-like baselines with ``curve_fit``. ``show.py`` shows how those parameters were found: A0
(and b for ReLU) chosen with sliders so that the linearised points ln(b - ln(A - A0)) (ReLU) or
ln(A0 - A) (SiLU) lie on the line alpha * ln D + ln c (SiLU: -alpha * ln D + ln c). We automate
that: for each (A0[, b]) the line is the linear least-squares fit of the linearised points;
(A0[, b]) are chosen by a bounded search minimising the squared error of A itself; then a
Levenberg-Marquardt ``curve_fit`` of all parameters on A polishes the result (kept only when it
lowers the error).
"""
from __future__ import annotations

import numpy as np


# ----------------------------------------------------------------------------- sparsing laws


def relu_law(D, alpha: float, b: float, c: float, A0: float):
    """ReLU: A(D) = exp(-c * D^alpha + b) + A0 (D in billions of tokens); decreasing, -> A0."""
    return np.exp(-c * np.asarray(D, np.float64) ** alpha + b) + A0


def silu_law(D, alpha: float, c: float, A0: float):
    """SiLU: A(D) = -c * D^(-alpha) + A0 (D in billions of tokens); increasing, -> A0."""
    return -c * np.asarray(D, np.float64) ** (-alpha) + A0


def _line(x, y):
    """Least-squares slope and intercept of y on x (closed form)."""
    xm, ym = x.mean(), y.mean()
    slope = float(np.sum((x - xm) * (y - ym)) / np.sum((x - xm) ** 2))
    return slope, float(ym - slope * xm)


def _check_fit_data(D, A):
    D, A = np.asarray(D, np.float64).reshape(-1), np.asarray(A, np.float64).reshape(-1)
    if D.shape != A.shape or D.size < 4:
        raise ValueError(f"need matching D and A with >= 4 points; got {D.shape} and {A.shape}")
    if np.any(D <= 0) or not np.all(np.isfinite(A)):
        raise ValueError("D must be > 0 (billions of tokens) and A finite")
    if np.unique(D).size < 2:
        raise ValueError("D needs at least two distinct values")
    return D, A


def _sse(f, D, A, *params):
    with np.errstate(all="ignore"):
        r = f(D, *params) - A
    s = float(np.sum(r * r))
    return s if np.isfinite(s) else np.inf


def _polish(f, D, A, p0, keys, valid):
    """Levenberg-Marquardt (``curve_fit``) refinement on A itself, kept only when it lowers the
    squared error and the parameters stay ``valid`` (the form's constraints)."""
    from scipy.optimize import OptimizeWarning, curve_fit
    import warnings
    best = np.asarray(p0, np.float64)
    try:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            popt, _ = curve_fit(f, D, A, p0=best, method="lm", maxfev=40000)
        if valid(*popt) and _sse(f, D, A, *popt) < _sse(f, D, A, *best):
            best = popt
    except (RuntimeError, ValueError):
        pass
    out = dict(zip(keys, map(float, best)))
    # the linearised line fit leaves alpha's sign free: data that does not follow the law's
    # direction (e.g. a rising ReLU ratio) gives parameters outside the form, flagged here
    out["valid"] = bool(valid(*best))
    out["mse"] = _sse(f, D, A, *best) / D.size
    out["mae"] = float(np.mean(np.abs(f(D, *best) - A)))
    return out


def fit_silu_law(D, A) -> dict:
    """Fit A = -c * D^(-alpha) + A0 (D in billions): for each A0 > max A the line
    ln(A0 - A) = -alpha ln D + ln c by least squares; A0 by a bounded search on the squared error
    of A; then LM polish. Returns {"alpha", "c", "A0", "valid", "mse", "mae"}; ``valid`` says whether
    the parameters satisfy the form (alpha, c > 0, A0 > max A: increasing towards A0)."""
    from scipy.optimize import minimize_scalar
    D, A = _check_fit_data(D, A)
    x, top, span = np.log(D), float(A.max()), max(float(np.ptp(A)), 1e-12)

    def given(z):  # A0 = max A + span * exp(z); non-finite candidates score inf in _sse
        with np.errstate(all="ignore"):
            A0 = top + span * float(np.exp(z))
            slope, icpt = _line(x, np.log(A0 - A))
            return -slope, float(np.exp(icpt)), A0

    grid = np.linspace(-12.0, 6.0, 73)
    z = grid[int(np.argmin([_sse(silu_law, D, A, *given(g)) for g in grid]))]
    res = minimize_scalar(lambda g: _sse(silu_law, D, A, *given(g)), bounds=(z - 0.25, z + 0.25),
                          method="bounded", options={"xatol": 1e-10})
    return _polish(silu_law, D, A, given(res.x), ("alpha", "c", "A0"),
                   lambda a, c, A0: a > 0 and c > 0 and A0 > top)


def fit_relu_law(D, A) -> dict:
    """Fit A = exp(-c * D^alpha + b) + A0 (D in billions): for each (0 < A0 < min A,
    b > max ln(A - A0)) the line ln(b - ln(A - A0)) = alpha ln D + ln c by least squares;
    (A0, b) from a coarse grid then Nelder-Mead on the squared error of A; then LM polish.
    Returns {"alpha", "b", "c", "A0", "valid", "mse", "mae"}; ``valid`` says whether the
    parameters satisfy the form (alpha, c > 0, 0 <= A0 < min A: decreasing towards A0)."""
    from scipy.optimize import minimize
    D, A = _check_fit_data(D, A)
    x, low = np.log(D), float(A.min())
    if low <= 0:
        raise ValueError(f"the ReLU law needs activation ratios A > 0; min A = {low}")

    def given(z):  # A0 = min A * sigmoid(z0), b = max ln(A - A0) + exp(z1); non-finite -> inf loss
        with np.errstate(all="ignore"):
            A0 = low / (1.0 + float(np.exp(-z[0])))
            b = float(np.log(A - A0).max()) + float(np.exp(z[1]))
            alpha, icpt = _line(x, np.log(b - np.log(A - A0)))
            return alpha, b, float(np.exp(icpt)), A0

    loss = lambda z: _sse(relu_law, D, A, *given(z))  # noqa: E731
    starts = sorted(((loss((z0, z1)), (z0, z1)) for z0 in np.linspace(-4, 10, 15)
                     for z1 in np.linspace(-6, 3, 10)), key=lambda t: t[0])[:3]
    best = min((minimize(loss, np.array(z), method="Nelder-Mead",
                         options={"xatol": 1e-9, "fatol": 1e-22, "maxiter": 3000}) for _, z in starts),
               key=lambda r: r.fun)
    return _polish(relu_law, D, A, given(best.x), ("alpha", "b", "c", "A0"),
                   lambda a, b, c, A0: a > 0 and c > 0 and 0 <= A0 < low)
