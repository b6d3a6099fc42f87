"""The token-additive gold world (``icml_jax.data.additive_gold``): exact gold, shifts, and a pilot
showing the preference is learnable from the responses and not from their length."""
import numpy as np
import pytest

from icml_jax.data import additive_gold as ag
from icml_jax.data import sentiment_testbed as tb


@pytest.fixture(scope="module")
def world():
    return ag.make_world(0, num_letters=8)


@pytest.fixture(scope="module")
def splits(world):
    return ag.make_splits(world, 1, n_train=40, n_val=20, n_per_prompt=6, prompt_len=6,
                          response_len=10)


def test_gold_is_the_sum_of_the_token_rewards(world):
    y = "abcabh"
    np.testing.assert_allclose(world.token_rewards(y), world.weights[[0, 1, 2, 0, 1, 7]])
    assert world.gold_reward([y, "a"]).tolist() == pytest.approx(
        [world.token_rewards(y).sum(), world.weights[0]])
    with pytest.raises(ValueError, match=r"letters outside the alphabet 'abcdefgh': \['z'\]"):
        world.gold_reward(["abz"])


def test_unknown_characters_can_score_zero(world):
    # text sampled from a model may hold bytes outside the alphabet: with unknown="zero" they
    # contribute 0 and the letters keep their weights
    np.testing.assert_allclose(world.token_rewards("a?z\ufffdb", unknown="zero"),
                               [world.weights[0], 0.0, 0.0, 0.0, world.weights[1]])
    assert world.gold_reward(["abz", ""], unknown="zero").tolist() == pytest.approx(
        [world.weights[0] + world.weights[1], 0.0])
    assert world.token_rewards("", unknown="zero").shape == (0,)
    with pytest.raises(ValueError, match="unknown="):
        world.gold_reward(["a"], unknown="skip")


def test_deterministic_and_seed_dependent(world):
    again = ag.make_world(0, num_letters=8)
    np.testing.assert_array_equal(again.trans, world.trans)
    assert not np.allclose(ag.make_world(1, num_letters=8).weights, world.weights)
    rng = lambda: np.random.default_rng(3)  # noqa: E731
    assert world.sample(5, 7, rng()) == world.sample(5, 7, rng())


def test_the_shifts_move_the_distribution(world):
    base = world.sample(400, 12, np.random.default_rng(0))
    tilted = world.sample(400, 12, np.random.default_rng(0), tilt=1.5)
    assert world.gold_reward(tilted).mean() > world.gold_reward(base).mean() + 1.0
    hot = world.sample(400, 12, np.random.default_rng(0), temperature=3.0)
    letters = lambda s: np.bincount(np.concatenate([world.letter_ids(x) for x in s]), minlength=8)  # noqa: E731
    entropy = lambda c: -np.sum(c / c.sum() * np.log(c / c.sum() + 1e-12))  # noqa: E731
    assert entropy(letters(hot)) > entropy(letters(base))
    init, trans = world.chain(0.7, 1.3)
    np.testing.assert_allclose(trans.sum(-1), 1.0)
    np.testing.assert_allclose(init.sum(), 1.0)


def test_splits_are_disjoint_groups_with_gold(world, splits):
    assert set(splits) == {"train", "val_in", "val_prompt_ood", "val_temp_ood", "val_both_ood"}
    prompts = {k: {g["prompt"] for g in v} for k, v in splits.items()}
    assert not prompts["train"] & (prompts["val_in"] | prompts["val_prompt_ood"] | prompts["val_temp_ood"])
    assert prompts["val_both_ood"] == prompts["val_prompt_ood"]
    for g in splits["val_temp_ood"] + splits["val_both_ood"]:
        assert g["temperature"] == 2.0 and len(g["responses"]) == 6
        np.testing.assert_allclose(g["gold"], world.gold_reward(g["responses"]))


def test_best_of_n_part_adds_fresh_prompts_and_leaves_the_others(world, splits):
    more = ag.make_splits(world, 1, n_train=40, n_val=20, n_per_prompt=6, prompt_len=6,
                          response_len=10, n_bon=5, bon_per_prompt=32)
    assert {k: more[k] for k in splits} == splits  # drawn after the other parts
    bon = {g["prompt"] for g in more["bon"]}
    assert len(bon) == 5 and all(len(g["responses"]) == 32 for g in more["bon"])
    assert not bon & {g["prompt"] for k in splits for g in splits[k]}
    with pytest.raises(ValueError, match="bon_per_prompt"):
        ag.make_splits(world, 1, n_train=4, n_val=2, n_per_prompt=2, prompt_len=6,
                       response_len=4, n_bon=2)


def test_pilot_letter_counts_learn_the_preference_and_length_does_not(world, splits):
    """A least-squares fit of gold on letter counts (the simplest reward model) ranks held-out pairs
    almost perfectly, on both shifts; response length alone (all equal here) is at chance."""
    def counts(texts):
        return np.stack([np.bincount(world.letter_ids(t), minlength=8) for t in texts]).astype(float)
    train = [(r, s) for g in splits["train"] for r, s in zip(g["responses"], g["gold"])]
    coef, *_ = np.linalg.lstsq(counts([r for r, _ in train]), np.array([s for _, s in train]), rcond=None)
    for name in ("val_in", "val_prompt_ood", "val_temp_ood"):
        rows = tb.pairs_from_groups(splits[name], rule="all")
        assert len(rows) > 100
        c, r = counts([x["chosen"] for x in rows]) @ coef, counts([x["rejected"] for x in rows]) @ coef
        assert np.mean(c > r) > 0.95, name
        lengths = np.array([len(x["chosen"]) - len(x["rejected"]) for x in rows])
        assert np.all(lengths == 0)  # the length control: no pair is decided by length
