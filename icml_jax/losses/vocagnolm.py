"""VocAgnoLM's teacher-guided token selection (Shin et al., ICML 2025; ``docs/methods/vocagnolm.md``).

Each student token's teacher loss is aggregated (``max``, or ``mean`` / ``min`` as ablations) over
the teacher tokens aligned to it (``icml_jax.data.alignment``: a fixed window of ``span_pad``
positions from ``start``, masked past ``end``). Its score is the student's loss minus that teacher
loss (the excess loss of Rho-1 with the teacher as the reference). The loss trains on the top
``k_ratio`` of the mapped valid tokens by score, exactly ceil(k_ratio * n) of them (ties broken by
position), plus every valid unmapped token when ``include_unmapped``; over the whole batch
(``scope="batch"``) or per row (``"sequence"``). Axis letters: B rows, T student tokens, M teacher
tokens, P the window.
"""
from __future__ import annotations

import fractions

import jax
import jax.numpy as jnp

AGGREGATIONS = ("max", "mean", "min")


def aggregate_teacher(teacher_loss_BM, index_BTP, window_BTP, agg: str = "max"):
    """The teacher loss of each student token [B, T] over its window (0 where nothing is mapped)."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"aggregation {agg!r}; choose one of {list(AGGREGATIONS)}")
    B, M = teacher_loss_BM.shape
    g = teacher_loss_BM[jnp.arange(B)[:, None, None], jnp.clip(index_BTP, 0, M - 1)]  # [B, T, P]
    n = window_BTP.sum(-1)
    if agg == "max":
        out = jnp.where(window_BTP, g, -jnp.inf).max(-1)
    elif agg == "min":
        out = jnp.where(window_BTP, g, jnp.inf).min(-1)
    else:
        out = jnp.where(window_BTP, g, 0.0).sum(-1) / jnp.maximum(n, 1)
    return jnp.where(n > 0, out, 0.0)


def _ceil_ratio(n, k_ratio: float):
    """ceil(k_ratio * n) in integer arithmetic, k_ratio read as the nearest fraction p / q with
    q <= 10000 (0.3 is 3/10): in float32, 0.3 * 50 rounds above 15 and its ceiling is 16."""
    frac = fractions.Fraction(k_ratio).limit_denominator(10_000)
    p, q = frac.numerator, frac.denominator
    return (n // q) * p + ((n % q) * p + q - 1) // q


def _top_count(score, cand, k_ratio):
    """Selects exactly ceil(k_ratio * cand.sum()) candidates of the highest score (flat arrays)."""
    k = _ceil_ratio(cand.sum().astype(jnp.int32), k_ratio)
    order = jnp.argsort(jnp.where(cand, -score, jnp.inf), stable=True)
    rank = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    return (rank < k) & cand


def selection_weights(student_loss_BT, teacher_loss_BM, index_BTP, window_BTP, mapped_BT, valid_BT, *,
                      k_ratio: float = 0.4, agg: str = "max", include_unmapped: bool = True,
                      scope: str = "batch"):
    """(weights [B, T] float32, score [B, T]): 1 for the selected and (optionally) unmapped tokens."""
    if not 0 < k_ratio <= 1:
        raise ValueError(f"k_ratio={k_ratio} must be in (0, 1]")
    if scope not in ("batch", "sequence"):
        raise ValueError(f"scope={scope!r}; choose 'batch' or 'sequence'")
    teacher = aggregate_teacher(teacher_loss_BM, index_BTP, window_BTP, agg)
    score = jax.lax.stop_gradient(student_loss_BT - teacher)
    cand = mapped_BT & valid_BT
    if scope == "batch":
        sel = _top_count(score.reshape(-1), cand.reshape(-1), k_ratio).reshape(score.shape)
    else:
        sel = jax.vmap(lambda s, c: _top_count(s, c, k_ratio))(score, cand)
    keep = sel | (include_unmapped & ~mapped_BT & valid_BT)
    return keep.astype(jnp.float32), score


def guided_loss(student_loss_BT, teacher_loss_BM, index_BTP, window_BTP, mapped_BT, valid_BT, **kw):
    """(loss, metrics): the student's mean loss over the selected tokens (``selection_weights``)."""
    w, score = selection_weights(student_loss_BT, teacher_loss_BM, index_BTP, window_BTP, mapped_BT, valid_BT,
                                 **kw)
    loss = (w * student_loss_BT).sum() / jnp.maximum(w.sum(), 1.0)
    return loss, {"selected_share": w.sum() / jnp.maximum(valid_BT.sum(), 1)}
