"""The sentiment preference testbed: gold reward, prompts, sampling, pairs, metrics, builder."""
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.data import sentiment_testbed as tb


def test_gold_reward_sign_and_range():
    g = tb.gold_reward(["O sweet love, how fair and gentle is thy kindness!",
                        "Cursed villain, I hate thee; die in misery and grief.",
                        "The table stands by the door of the house."])
    assert g.dtype == np.float32 and g.shape == (3,)
    assert g[0] > 0.5 and g[1] < -0.5 and g[2] == 0.0
    assert np.all(np.abs(g) <= 1.0)
    assert tb.gold_reward([]).shape == (0,)


def test_prompt_pool_deterministic_disjoint_and_shaped():
    in_works, ood_works = tb.works_of(tb.IN_DOMAIN_SPLIT), tb.works_of(tb.OOD_SPLIT)
    assert in_works and ood_works and not set(in_works) & set(ood_works)
    a = tb.prompt_pool("train", 30, 48, seed=3, part="train")
    assert a == tb.prompt_pool("train", 30, 48, seed=3, part="train")
    assert a != tb.prompt_pool("train", 30, 48, seed=4, part="train")
    assert tb.prompt_pool("train", 10, 48, seed=3, part="train") == a[:10]
    assert len(set(a)) == 30
    for p in a:
        assert 24 <= len(p) <= 48 and p == p.rstrip() and p.strip()
    # the train and held-out parts of the in-domain works never share a prompt
    held = tb.prompt_pool("train", 200, 48, seed=3, part="heldout")
    train = tb.prompt_pool("train", 2000, 48, seed=3, part="train")
    assert not set(held) & set(train)
    # OOD prompts come from the test works' texts, not the train works'
    ood = tb.prompt_pool(tb.OOD_SPLIT, 20, 48, seed=0)
    assert not set(ood) & set(tb.prompt_pool("train", 20000, 48, seed=0))
    with pytest.raises(ValueError, match="unknown split"):
        tb.prompt_pool("dev", 1, 48, seed=0)
    with pytest.raises(ValueError, match="distinct candidates"):
        tb.prompt_pool(["phoenix_and_the_turtle"], 10**6, 48, seed=0)


def _group(prompt, gold):
    return {"prompt": prompt, "responses": [f"r{i}" for i in range(len(gold))],
            "gold": list(gold), "temperature": 1.0}


def test_pairs_from_groups_labels_by_gold_and_min_gap():
    groups = [_group("a", [0.1, 0.9, -0.5, 0.3]), _group("b", [0.2, 0.2]),
              _group("c", [0.0, 0.05])]
    bw = tb.pairs_from_groups(groups, "best_worst")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in bw] == [("a", "r1", "r2"),
                                                                      ("c", "r1", "r0")]
    assert set(bw[0]) == {"prompt", "chosen", "rejected", "score_chosen", "score_rejected"}
    assert bw[0]["score_chosen"] == pytest.approx(0.9) and bw[0]["score_rejected"] == -0.5
    allp = tb.pairs_from_groups(groups, "all")
    assert len(allp) == 6 + 0 + 1  # the tied pair of "b" is never labelled
    assert all(r["score_chosen"] > r["score_rejected"] for r in allp)
    gap = tb.pairs_from_groups(groups, "all", min_gap=0.25)
    assert {(r["chosen"], r["rejected"]) for r in gap} == {("r1", "r0"), ("r0", "r2"),
                                                           ("r1", "r2"), ("r3", "r2"),
                                                           ("r1", "r3")}
    assert tb.pairs_from_groups(groups, "best_worst", min_gap=0.1) == bw[:1]


def test_kendall_tau_per_prompt():
    gold = [[0.1, 0.2, 0.3, 0.4], [0.5, -0.5, 0.0]]
    assert tb.kendall_tau_per_prompt([[1, 2, 3, 4], [3, 1, 2]], gold) == pytest.approx(1.0)
    assert tb.kendall_tau_per_prompt([[4, 3, 2, 1], [1, 3, 2]], gold) == pytest.approx(-1.0)
    assert tb.kendall_tau_per_prompt([[1, 2, 3, 4], [1, 3, 2]], gold) == pytest.approx(0.0)
    # a constant-gold group (and a constant-proxy group) is left out of the mean
    assert tb.kendall_tau_per_prompt([[1, 2, 3, 4], [1, 2, 3]],
                                     [gold[0], [0.0, 0.0, 0.0]]) == pytest.approx(1.0)
    assert tb.kendall_tau_per_prompt([[1, 2, 3, 4], [5, 5, 5]], gold) == pytest.approx(1.0)
    assert np.isnan(tb.kendall_tau_per_prompt([[1, 1]], [[0.0, 1.0]]))


def test_best_of_n_curve_oracle_rises_random_stays_flat():
    rng = np.random.default_rng(0)
    gold = rng.normal(size=(40, 64))
    ns = [1, 2, 4, 16, 64]
    oracle = tb.best_of_n_curve(gold, gold, ns, num_draws=32, seed=0)
    assert oracle["n"] == ns
    assert np.all(np.diff(oracle["gold"]) > 0)
    assert oracle["gold"][-1] == pytest.approx(gold.max(axis=1).mean())  # N = M: the pool's best
    assert oracle["gold"][0] == pytest.approx(gold.mean(), abs=0.05)
    assert oracle["proxy"] == oracle["gold"]
    assert oracle["gold"][-1] - oracle["gold"][0] > 2.0
    # a proxy independent of gold: its pick is a random response (at N = M, one fixed response per
    # prompt, hence the many prompts: the standard error of the mean is 1/sqrt(400) = 0.05)
    gold = rng.normal(size=(400, 64))
    rand = tb.best_of_n_curve(rng.normal(size=gold.shape), gold, ns, num_draws=32, seed=0)
    assert np.all(np.abs(np.asarray(rand["gold"]) - gold.mean()) < 0.2)
    assert rand["kl_bound"][0] == 0.0
    assert rand["kl_bound"][-1] == pytest.approx(np.log(64) - 63 / 64)
    with pytest.raises(ValueError, match="N=65"):
        tb.best_of_n_curve(gold, gold, [65])


def test_gold_stats_and_groups_file(tmp_path):
    groups = [_group("a", [0.0, 0.5, 0.5]), _group("b", [0.0, 0.0, 0.0])]
    s = tb.gold_stats(groups)
    assert s["responses"] == 6 and s["frac_zero"] == pytest.approx(4 / 6)
    assert s["frac_tied_pairs"] == pytest.approx(4 / 6) and s["frac_constant_groups"] == 0.5
    path = str(tmp_path / "g" / "groups.json")
    tb.save_groups(path, groups, note="x")
    assert tb.load_groups(path) == groups and os.listdir(tmp_path / "g") == ["groups.json"]
    with open(path, "w") as f:
        json.dump({"groups": [{"prompt": "p"}]}, f)
    with pytest.raises(ValueError, match="lacks"):
        tb.load_groups(path)


def test_sample_groups_tiny_random_model(tiny_config):
    """experiments.preference_testbed.sample_groups: inference.sampling.sample_batched's
    continuations scored by this module's gold reward."""
    from experiments.preference_testbed import sample_groups
    from icml_jax.data.tokenizers import ByteTokenizer
    from icml_jax.models.decoder import build_model
    cfg = tiny_config.model
    cfg.num_layers = 1
    model = build_model(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    tok = ByteTokenizer()
    prompts = ["ROMEO.\nGood", "To be, or not"]
    groups = sample_groups(model, params, tok, prompts, 3, 1.0, 10, seed=0, batch_size=4,
                           prompt_tokens=16)
    assert [g["prompt"] for g in groups] == prompts
    for g in groups:
        assert len(g["responses"]) == len(g["gold"]) == 3 and g["temperature"] == 1.0
        for r, s in zip(g["responses"], g["gold"]):
            assert len(r) <= 10  # <= 1 char per new byte: the continuation only, no prompt
            assert s == pytest.approx(float(tb.gold_reward([r])[0]))
    again = sample_groups(model, params, tok, prompts, 3, 1.0, 10, seed=0, batch_size=4,
                          prompt_tokens=16)
    assert again == groups
    other = sample_groups(model, params, tok, prompts, 3, 1.0, 10, seed=1, batch_size=4,
                          prompt_tokens=16)
    assert other != groups
    # 6 rows in batches of 4: the second batch is padded with 2 rows, which are dropped; one prompt
    # alone gets the same first 3 rows (batch 0, same key and shapes)
    alone = sample_groups(model, params, tok, prompts[:1], 3, 1.0, 10, seed=0, batch_size=4,
                          prompt_tokens=16)
    assert alone == groups[:1]


def test_build_testbed_tiny_end_to_end_and_cached(tmp_path, monkeypatch):
    from experiments.preference_testbed import PARTS, TINY, build_testbed
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    wd = str(tmp_path / "tb")
    out = build_testbed(wd, TINY)
    assert set(out["paths"]) == set(PARTS)
    for name, path in out["paths"].items():
        groups = tb.load_groups(path)
        assert groups == out["groups"][name]
        assert len(groups) == out["stats"][name]["groups"] > 0
    assert os.path.exists(os.path.join(wd, "testbed.json"))
    assert os.path.isdir(os.path.join(out["sft_workdir"], "checkpoints"))
    bon = out["groups"]["bon"]
    assert all(len(g["responses"]) == 64 for g in bon)
    assert all(len(g["responses"]) == 5 and g["temperature"] == 0.8
               for g in out["groups"]["tgdpo_train"])
    assert out["prompts"]["val_in"] == out["prompts"]["val_response_ood"]
    assert {g["temperature"] for g in out["groups"]["val_response_ood"]} == {0.7}
    assert not set(out["prompts"]["val_in"]) & set(out["prompts"]["train"])
    assert not set(out["prompts"]["val_prompt_ood"]) & set(out["prompts"]["train"])
    mtimes = {p: os.path.getmtime(p) for p in out["paths"].values()}
    t0 = time.time()
    again = build_testbed(wd, TINY)
    assert time.time() - t0 < 10.0  # loads JSON; no training, no sampling, no policy load
    assert again["groups"] == out["groups"]
    assert {p: os.path.getmtime(p) for p in again["paths"].values()} == mtimes
    # another SFT config in the same workdir is refused, not resumed into
    changed = {**TINY, "sft": {**TINY["sft"], "model.d_model": 48}}
    with pytest.raises(ValueError, match="another config.*model.d_model"):
        build_testbed(wd, changed)
