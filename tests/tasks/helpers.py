"""Shared test data for the pairwise tasks."""
import numpy as np


def synthetic_pairs(n, seed):
    """An easy, learnable preference: responses praising vs cursing, after Shakespeare-ish prompts."""
    rng = np.random.default_rng(seed)
    names = ["ROMEO", "JULIET", "HAMLET", "LEAR", "PUCK", "IAGO"]
    good = [" sweet love and joy", " good and gentle", " fair and kind", " joy, joy"]
    bad = [" vile hate and woe", " cursed and foul", " death and grief", " woe, woe"]
    return [{"prompt": f"{names[rng.integers(6)]}. Say", "chosen": good[rng.integers(4)],
             "rejected": bad[rng.integers(4)]} for _ in range(n)]
