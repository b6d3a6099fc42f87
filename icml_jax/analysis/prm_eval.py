"""Host-side evaluation of process reward model scores (docs/methods/implicit_prm.md), on numpy
arrays after the scores are computed (``icml_jax.losses.implicit_prm.score``):

  best_of_n            accuracy of the top-scored of each problem's first n responses
  best_of_n_picks      which response that is (e.g. to average the picks' lengths)
  weighted_majority    weighted majority voting over the answers of the first n responses
  predict_first_error  ProcessBench's first-error rule at a threshold tau on sigma(q_k)
  first_error_scores   ProcessBench's accuracies on erroneous / error-free solutions and their f1
  choose_threshold     the tau that maximises that f1 on a held-out set

Axis letters: G problems, N responses per problem, B solutions, K steps.
"""
import numpy as np


def best_of_n_picks(scores_GN: np.ndarray, ns) -> dict:
    """Per n, the index [G] of the top-scored response among each problem's FIRST n responses.

    The reference ranks "the top-n by generator log-prob" but sets every log-prob to 0 before a
    stable sort, so as executed it takes the first n samples; ties go to the earliest response
    (its stable descending sort). Returns {n: int array [G]}."""
    s = np.asarray(scores_GN, np.float64)
    return {int(n): np.argmax(s[:, :n], axis=1) for n in ns}  # first maximum = stable sort's first


def best_of_n(scores_GN: np.ndarray, correct_GN: np.ndarray, ns) -> dict:
    """Accuracy of the top-scored response among each problem's first n responses
    (``best_of_n_picks``), per n. Returns {n: accuracy}."""
    c = np.asarray(correct_GN, bool)
    return {n: float(np.mean(c[np.arange(len(c)), pick]))
            for n, pick in best_of_n_picks(scores_GN, ns).items()}


def weighted_majority(answers_GN, scores_GN, reference_G, ns, *, sigmoid: bool = True) -> dict:
    """Weighted majority voting over each problem's first n responses: every distinct answer gets
    sum sigma(score) of the responses giving it (``sigmoid=False``: sum of the scores; all-ones
    scores = plain majority vote); the top answer is compared with the reference. Missing answers
    (None) never win. Returns {n: accuracy}."""
    out = {}
    for n in ns:
        hits = 0
        for answers, scores, ref in zip(answers_GN, scores_GN, reference_G):
            votes: dict = {}
            for a, s in zip(answers[:n], scores[:n]):
                if a is None:
                    continue
                votes[a] = votes.get(a, 0.0) + (1 / (1 + np.exp(-s)) if sigmoid else float(s))
            if votes:
                hits += max(votes, key=votes.get) == ref  # first-seen answer wins ties
        out[int(n)] = hits / max(len(reference_G), 1)
    return out


def predict_first_error(q_BK, step_mask_BK, tau: float) -> np.ndarray:
    """ProcessBench's rule: the predicted first error is the first step k with sigma(q_k) < tau
    (q_k: the kappa-scaled prefix values); int [B], 1-based, 0 = no error predicted."""
    q, m = np.asarray(q_BK, np.float64), np.asarray(step_mask_BK) > 0
    bad = (1 / (1 + np.exp(-q)) < tau) & m
    return np.where(bad.any(1), bad.argmax(1) + 1, 0)


def first_error_scores(pred_B, true_B) -> dict:
    """ProcessBench's metric: accuracy of the predicted first-error step on the erroneous
    solutions (true > 0), accuracy of predicting "no error" on the error-free ones (true = 0),
    and their harmonic mean ``f1``."""
    pred, true = np.asarray(pred_B), np.asarray(true_B)
    err, ok = true > 0, true == 0
    acc_err = float(np.mean(pred[err] == true[err])) if err.any() else float("nan")
    acc_ok = float(np.mean(pred[ok] == 0)) if ok.any() else float("nan")
    f1 = 2 * acc_err * acc_ok / (acc_err + acc_ok) if (acc_err + acc_ok) > 0 else 0.0
    return {"acc_erroneous": acc_err, "acc_correct": acc_ok, "f1": f1}


def choose_threshold(q_BK, step_mask_BK, true_B, grid=None) -> tuple[float, dict]:
    """The tau of ``grid`` (default 0.00, 0.01, ..., 1.00) maximising ``first_error_scores``'s
    f1 (the reference picks it on a held-out set): (tau, its scores)."""
    grid = np.linspace(0.0, 1.0, 101) if grid is None else grid
    best = max(((float(t), first_error_scores(predict_first_error(q_BK, step_mask_BK, t), true_B))
                for t in grid), key=lambda x: (np.nan_to_num(x[1]["f1"]), -abs(x[0] - 0.5)))
    return best
