"""MASS's model half (icml_jax/analysis/mass.py): mean-pooled hook embeddings agree with the
decoder's own ``hidden`` sow averaged by hand, do not depend on the batch a text sits in, and
``score_pool`` is the numpy formula on those embeddings; the scores file round-trips."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax.analysis import mass as amass
from icml_jax.config_utils import load_config
from icml_jax.data import mass
from icml_jax.data.tokenizers import ByteTokenizer
from icml_jax.models import build_model

SEQ, BATCH = 48, 4


@pytest.fixture(scope="module")
def lm():
    cfg = load_config("configs/lm.py:tiny").model
    model = build_model(cfg)
    params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    return cfg, model, params


def test_embeddings_are_the_mean_of_the_last_layer_over_real_tokens(lm):
    cfg, model, params = lm
    tok = ByteTokenizer()
    texts = ["Problem: 7+5\nStep 1: 7+5=12\nAnswer: 12\n", "The ship sailed.", "Problem: reverse ab\n",
             "x" * 80, "Problem: 3*3\n"]
    emb = amass.embed_texts(cfg, params, tok, texts, seq_len=SEQ, batch_size=BATCH)
    assert emb.shape == (5, cfg.d_model) and np.isfinite(emb).all()
    # the same texts in another order and batch: the same rows (padding and neighbours are ignored)
    again = amass.embed_texts(cfg, params, tok, texts[::-1], seq_len=SEQ, batch_size=BATCH)
    np.testing.assert_allclose(again[::-1], emb, rtol=2e-5, atol=2e-6)
    # independently: the decoder's hidden/h_{L-1} sow on one row, averaged by hand over its
    # real tokens (text 0 is padded with segment id 0, text 3 is cut to SEQ tokens)
    hidden = jax.jit(lambda p, x, s: model.apply({"params": p}, x, None, s, mutable=["hidden"])[1])
    for i in (0, 3):
        ids = ([tok.bos_id] + tok.encode(texts[i]))[:SEQ]
        x, seg = np.zeros((1, SEQ), np.int32), np.zeros((1, SEQ), np.int32)
        x[0, :len(ids)], seg[0, :len(ids)] = ids, 1
        h = np.asarray(hidden(params, x, seg)["hidden"][f"h_{cfg.num_layers - 1}"][0])[0]
        np.testing.assert_allclose(emb[i], h[:len(ids)].mean(0), rtol=2e-4, atol=2e-5)


def test_score_pool_is_the_formula_on_the_embeddings(lm, tmp_path):
    cfg, _, params = lm
    tok = ByteTokenizer()
    ref = [r.text for r in mass.target_rows(6, seed=0)]
    pool = [r.text for r in mass.pool_rows(6, dict(string=0.3, prose=0.3), seed=0)]
    scores, graph = amass.score_pool(cfg, params, tok, ref, pool, node_weight="frequency",
                                     seq_len=SEQ, batch_size=BATCH)
    e_ref = amass.embed_texts(cfg, params, tok, ref, seq_len=SEQ, batch_size=BATCH)
    e_pool = amass.embed_texts(cfg, params, tok, pool, seq_len=SEQ, batch_size=BATCH)
    tags = mass.tag_matrix([mass.tag_skills(t) for t in ref], graph.skills)
    e_k = tags.T @ e_ref / tags.sum(0)[:, None]
    cos = (e_pool / np.linalg.norm(e_pool, axis=1, keepdims=True)) @ \
        (e_k / np.linalg.norm(e_k, axis=1, keepdims=True)).T
    np.testing.assert_allclose(scores, cos @ (tags.sum(0) / tags.sum()), rtol=1e-5)
    path = str(tmp_path / "s.npy")
    amass.write_scores(path, scores)
    np.testing.assert_array_equal(mass.read_scores(path), scores)
    with pytest.raises(ValueError, match="mass_score_agg"):
        amass.score_pool(cfg, params, tok, ref, pool, agg="mean")
