"""Shared test data for the pairwise tasks, and the frozen LM run of the tasks that read one."""
import numpy as np


def synthetic_pairs(n, seed):
    """An easy, learnable preference: responses praising vs cursing, after Shakespeare-ish prompts."""
    rng = np.random.default_rng(seed)
    names = ["ROMEO", "JULIET", "HAMLET", "LEAR", "PUCK", "IAGO"]
    good = [" sweet love and joy", " good and gentle", " fair and kind", " joy, joy"]
    bad = [" vile hate and woe", " cursed and foul", " death and grief", " woe, woe"]
    return [{"prompt": f"{names[rng.integers(6)]}. Say", "chosen": good[rng.integers(4)],
             "rejected": bad[rng.integers(4)]} for _ in range(n)]


def restore_params(workdir, model_cfg):
    """``TaskContext.restore_params`` for tests: the newest params of a training workdir."""
    from icml_jax.train.checkpoint import restore_model_params
    return restore_model_params(workdir, model_cfg)[0]


def tiny_lm_run(workdir, tfds_dir):
    """``workdir`` after a 4-step configs/lm.py:tiny run (a frozen parent, teacher or source)."""
    from tests.train.helpers import train_in_process
    train_in_process(workdir, "--config.train.steps=4", "--config.train.checkpoint_every=4",
                     "--config.train.eval_every=4", "--config.train.samples=0", data_dir=tfds_dir)
    return workdir
