"""Host-side PRM evaluation (icml_jax/analysis/prm_eval.py) on hand-made scores."""
import numpy as np
import pytest

from icml_jax.analysis import prm_eval


def test_best_of_n_and_majority():
    scores = np.array([[0.1, 0.9, 0.5, 0.9], [0.3, 0.2, 0.8, 0.1]])
    correct = np.array([[0, 1, 0, 0], [1, 0, 0, 0]])
    got = prm_eval.best_of_n(scores, correct, [1, 2, 4])
    # n=1: first responses (wrong, right); n=2: 0.9 (right) and 0.3 (right); n=4: row 0 ties at
    # 0.9 and the first of the tie (index 1, right) wins, row 1 picks 0.8 (wrong)
    assert got == {1: 0.5, 2: 1.0, 4: 0.5}
    answers = [["3", "4", "4", None], ["7", "7", "8", "8"]]
    ones = np.ones((2, 4))
    assert prm_eval.weighted_majority(answers, ones, ["4", "8"], [4], sigmoid=False)[4] == 0.5


def test_first_error_prediction_and_threshold():
    q = np.array([[2.0, -3.0, -4.0], [2.0, 2.0, 2.0], [-5.0, 1.0, 0.0]])
    m = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 0]])
    pred = prm_eval.predict_first_error(q, m, 0.5)
    assert pred.tolist() == [2, 0, 1]
    s = prm_eval.first_error_scores(pred, np.array([2, 0, 2]))
    assert s["acc_erroneous"] == 0.5 and s["acc_correct"] == 1.0
    assert s["f1"] == pytest.approx(2 / 3)
    tau, best = prm_eval.choose_threshold(q, m, np.array([2, 0, 1]))
    assert best["f1"] == 1.0 and 0 < tau < 1
