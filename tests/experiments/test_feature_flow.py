"""experiments/feature_flow at its tiny preset (outputs, rows, values in range) and its pieces: the
topic corpus and word rate, folding the input scale into an SAE, the deactivation rows against a
direct computation."""
import csv
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.feature_flow import study
from experiments.feature_flow.__main__ import PRESETS, main


def test_feature_flow_tiny_outputs(tmp_path):
    wd = str(tmp_path / "exp")
    main([f"--workdir={wd}", "--preset=tiny"])
    exp = PRESETS["tiny"]
    for name in ("results.md", "groups.csv", "deactivation.csv", "steering.csv", "feature_flow.png", "config.json"):
        assert os.path.getsize(os.path.join(wd, name)) > 0, name
    d = list(csv.DictReader(open(os.path.join(wd, "deactivation.csv"))))
    assert len(d) == 3 * exp.targets and {r["kind"] for r in d} == {"top1", "random_top5", "pearson_top1"}
    for r in d:
        assert 0.0 <= float(r["success"]) <= 1.0 and int(r["tokens"]) >= 1
    s = list(csv.DictReader(open(os.path.join(wd, "steering.csv"))))
    # per steered topic: unsteered + suppression base, then each mode x (strengths + rs)
    assert len(s) == exp.steer_topics * (2 + 2 * (len(exp.strengths) + len(exp.rs)))
    for r in s:
        assert 0.0 <= float(r["behaviour"]) <= 1.0 and 0.0 <= float(r["coherence"]) <= 1.0
    md = open(os.path.join(wd, "results.md")).read()
    assert "Gates:" in md and "Mann–Whitney" in md and "Deactivation" in md


def test_topic_corpus_and_word_rate():
    docs, labels = study.mixed_corpus(40, 64, 0.5, seed=0)
    assert len(docs) == 40 and all(len(d) == 64 for d in docs)
    assert (labels >= 0).sum() == 20 and set(np.bincount(labels[labels >= 0])) == {5}
    for d, lab in zip(docs, labels):
        if lab >= 0:  # a topic document's words come from its lexicon or the shared frames
            assert study.topic_rate(d, study.NAMES[lab]) > 0.3
            assert all(study.topic_rate(d, n) == 0 for i, n in enumerate(study.NAMES) if i != lab)
    assert study.topic_rate("The ship sails, I think.", "sea") == pytest.approx(2 / 5)
    assert study.topic_rate("", "sea") == 0.0


def test_folding_the_input_scale_reads_the_models_units():
    from icml_jax.models.sae import SAE
    c = 3.5

    def outputs(sae):  # one jitted program per SAE: init, the SAE on x / c, the folded SAE on x
        x = jax.random.normal(jax.random.key(0), (5, 8)) * 7.0
        p = sae.init(jax.random.key(1), x)["params"]
        p = {**p, "b_enc": jnp.linspace(-0.2, 0.2, 16), "b_dec": jnp.linspace(-1, 1, 8)}
        return sae.apply({"params": p}, x / c), sae.apply({"params": study.fold_scale(p, c)}, x)

    for sae in (study.sae_module(8, 16, 3), SAE(d_model=8, latents=16, k=3)):  # with and without pre_bias
        (xh, z), (xh_f, z_f) = jax.jit(lambda: outputs(sae))()
        assert (np.asarray(z) > 0).sum() > 0
        np.testing.assert_allclose(z_f, c * z, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(xh_f, c * xh, rtol=1e-5, atol=1e-5)
