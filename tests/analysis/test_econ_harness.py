"""ECON's harness (icml_jax/analysis/econ.py): a few training steps lower the losses; the voting
and reward rules by hand."""
import numpy as np
import pytest

from icml_jax.analysis import econ as E

# one worker for this module and tests/experiments/test_econ.py: the experiment's tiny run then
# finds this harness's compiled init and train step in the compilation cache
pytestmark = pytest.mark.xdist_group("econ_harness")


@pytest.fixture(scope="module")
def trained():
    # the sizes of experiments/econ's tiny preset (byte vocab, 4 questions, a 32-wide LM's
    # embedding): the same compiled programs serve both tests through the compilation cache
    cfg = E.EconConfig(n_agents=3, obs_len=16, hidden_dim=8, belief_dim=8, heads=2, layers=1, mixing_dim=4,
                       feature_dim=8, hyper_hidden=8, lr=1e-2)
    h = E.Harness(cfg, vocab_size=259, commit_dim=32, seed=0)
    rng = np.random.default_rng(0)
    obs = rng.integers(3, 259, (4, 3, 16)).astype(np.int32)
    obs[:, :, 9:] = 0
    batch = E.make_batch(obs, rng.uniform(0, 1, 4), rng.normal(size=(4, 32)))
    before = h.update(batch)      # metrics are taken at the parameters before the step
    for _ in range(40):
        after = h.update(batch)
    return h, before, after


def test_training_lowers_every_loss(trained):
    h, before, after = trained
    for k in ("mix_loss", "td_loss", "sd_loss", "q_align_loss", "belief_loss", "encoder_loss"):
        assert after[k] < before[k], (k, before[k], after[k])


def test_only_the_harness_is_trainable(trained):
    """Spec property 6: the LMs and the embedding model are not in the trained state; the
    commitment embedding enters the losses as data."""
    h, _, _ = trained
    assert set(h.state["params"]) == {"beliefs", "encoder", "mixer"}
    assert set(h.state["opt"]) == {"beliefs", "encoder", "mixer"}


def test_majority_vote_and_toy_rewards_by_hand():
    assert E.majority_vote([3, None, 5, 5]) == 5
    assert E.majority_vote([4, 3, 3, 4]) == 4          # tie: first seen
    assert E.majority_vote([None, None]) is None
    r = E.toy_rewards([7, 7, 8], commitment=7, truth=7)
    al, ts, cc = 2 / 3, 1.0, 0.3 + 0.3 * 2 / 3 + 0.2 * 2 / 3
    assert r["reward"] == pytest.approx(0.3 * al + 0.5 * ts + 0.2 * cc)
    assert E.toy_rewards([None, None, None], None, 7)["reward"] == pytest.approx(0.2 * 0.3 / 3)
