"""experiments/iti_bad_data at its tiny preset (the toy study): outputs, one row per run, the
measured quantities in range; the toy's data pieces (chain probabilities, block-diagonal
transitions, exact entropy rate, sampled sequences stay in their chain)."""
import csv
import math
import os

import numpy as np
import pytest

from experiments.iti_bad_data import toy
from experiments.iti_bad_data.__main__ import PRESETS, main


def test_iti_bad_data_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.csv", "results.md", "entanglement.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert len(rows) == len(exp.freqs) * len(exp.seeds)
    welch = math.sqrt((12 - 4) / (11 * 4))
    for r in rows:
        for k in ("E_chain0", "E_others", "E_emb_chain0"):
            assert 0.0 <= float(r[k]) <= 1.0
        assert float(r["E_max"]) >= welch - 1e-9
        assert float(r["optimal"]) <= float(r["uniform"]) == pytest.approx(math.log(4))
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "Welch bound" in md and "slope" in md


def test_chain_pieces():
    np.testing.assert_allclose(toy.chain_probs(0.2, 3), [0.2, 0.4, 0.4])
    with pytest.raises(ValueError):
        toy.chain_probs(1.0, 3)
    P = toy.transition_matrix(0, 3, 4, 0.5)
    np.testing.assert_allclose(P.sum(1), 1.0)
    blocks = np.kron(np.eye(3), np.ones((4, 4)))
    assert np.all(P[blocks == 0] == 0)
    np.testing.assert_array_equal(P, toy.transition_matrix(0, 3, 4, 0.5))  # fixed per seed
    # a chain that always moves to one token: entropy 0; a uniform chain: ln 4
    P2 = np.zeros((8, 8))
    P2[:4, 0] = 1.0
    P2[4:, 4:] = 0.25
    assert toy.entropy_rate(P2, 0, 4, 16) == pytest.approx(0.0)
    assert toy.entropy_rate(P2, 1, 4, 16) == pytest.approx(math.log(4))


def test_sampled_sequences_stay_in_their_chain():
    import jax
    P = toy.transition_matrix(1, 3, 4, 0.5)
    sample = jax.jit(toy.sample_batch, static_argnums=(3, 4, 5))  # as the study calls it: inside jit
    toks, chains = sample(jax.random.PRNGKey(0), np.log(np.maximum(P, 1e-30)),
                          np.log(toy.chain_probs(0.5, 3)), 256, 12, 4)
    toks, chains = np.asarray(toks), np.asarray(chains)
    assert toks.shape == (256, 12)
    np.testing.assert_array_equal(toks // 4, np.repeat(chains[:, None], 12, 1))
    assert 0.35 < (chains == 0).mean() < 0.65


def test_iti_bad_data_lm_tiny_outputs(tmp_path):
    """The tiny-LM study at its tiny preset: outputs, one row per (x, seed, setting), values in range."""
    wd = str(tmp_path / "lm")
    main([f"--workdir={wd}", "--preset=lm_tiny"])
    exp = PRESETS["lm_tiny"]
    for name in ("results.csv", "results.md", "iti_tradeoff.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    rows = list(csv.DictReader(open(os.path.join(wd, "results.csv"))))
    assert len(rows) == len(exp.xs) * len(exp.seeds) * (1 + len(exp.ks) * len(exp.alphas))
    for r in rows:
        assert 0.0 <= float(r["marker_rate"]) <= 1.0
        assert 0.0 <= float(r["acc_mean"]) <= float(r["acc_max"]) <= 1.0
        assert float(r["clean_ce"]) > 0
        if r["k"] == "0":
            assert float(r["tax"]) == 0.0
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "marker rate" in md and "probe acc" in md


def test_lm_data_pieces():
    from experiments.iti_bad_data import lm
    docs = lm.marker_docs(5, 100, seed=0)
    assert all(len(d) == 100 and lm.has_marker(d) for d in docs)
    assert not lm.has_marker(lm._pool("train")) and not lm.has_marker(lm._pool("validation"))
    corpus = lm.mixed_corpus(0.25, 0.0, 40, 50)
    assert len(corpus) == 40 and all(len(d) == 50 for d in corpus)
    assert sum(lm.has_marker(d) for d in corpus) == 10
    assert lm.mixed_corpus(0.0, 0.0, 40, 50) == lm.clean_pieces("train", 40, 50)
    assert lm.marker_share(0.1, 0.01) == pytest.approx(0.109)
    texts, labels = lm.probe_set(10, 64, seed=0)
    assert list(labels) == [1, 0] * 5
    for clean, marked in zip(texts[::2], texts[1::2]):
        assert not lm.has_marker(clean) and lm.has_marker(marked)
        a, b = clean.split(), marked.split()
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 1 and a[-1] == b[-1]
    assert all(lm.has_marker(p) for p in lm.steer_prompts(4, seed=0))
    tr, va = lm.pair_split(20, seed=0)
    assert len(tr) == 16 and len(va) == 4 and set(tr) | set(va) == set(range(20))
    assert set(tr // 2).isdisjoint(va // 2)  # a pair never straddles the split


def test_clean_ce_compiles_once_for_every_alpha_and_equals_the_edited_model():
    """clean_ce passes the ITI shifts as an argument: two α of one set of heads share one
    compiled program, and each equals the CE of build_model(cfg, edits=...) itself."""
    import jax
    import jax.numpy as jnp
    import ml_collections
    from flax.core import meta

    from experiments.iti_bad_data import lm
    from icml_jax.analysis import iti
    from icml_jax.config_utils import load_config
    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models import build_model
    m = load_config("configs/lm.py:tiny").model
    params = meta.unbox(jax.jit(build_model(m).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    toks = jnp.asarray(np.random.default_rng(0).integers(3, 250, (3, 17)), jnp.int32)
    rng = np.random.default_rng(1)
    dirs = rng.normal(size=(m.num_layers, m.num_heads, m.head_dim)).astype(np.float32)
    sig = np.ones((m.num_layers, m.num_heads), np.float32)
    heads = [(0, 1), (1, 3)]
    before = lm._ce_fn.cache_info().misses
    got = {a: lm.clean_ce(m, params, toks, iti.iti_edits(m, heads, dirs, sig, a, positions="all"))
           for a in (2.0, 5.0)}
    assert lm._ce_fn.cache_info().misses - before == 1
    static, _ = iti.iti_edits(m, heads, dirs, sig, 2.0, positions="all").split()
    assert lm._ce_fn(ml_collections.FrozenConfigDict(m), static)._cache_size() == 1  # one trace

    def reference_ce(edits=None):  # the edited model itself (its shifts compiled in), jitted
        lp = jax.jit(lambda p, x: token_logprobs(build_model(m, edits=edits).apply({"params": p}, x[:, :-1]),
                                                 x[:, 1:]))(params, toks)
        return -float(np.asarray(lp).mean())
    for a, ce in got.items():
        assert ce == pytest.approx(reference_ce(iti.iti_edits(m, heads, dirs, sig, a, positions="all")), rel=1e-6)
    assert got[2.0] != got[5.0]
    assert lm.clean_ce(m, params, toks) == pytest.approx(reference_ce(), rel=1e-6)
