"""MASS's numpy half (icml_jax/data/mass.py): the spec's property tests (PageRank weights, scores of
skill embeddings, the top-x% rule, one skill = cosine ranking), the rule tagger, the graph, the
synthetic pool and the pipeline option config.data.select_scores / select_ratio."""
import json
import math

import numpy as np
import pytest

from icml_jax.data import arithmetic, mass, pipeline
from icml_jax.data.tokenizers import ByteTokenizer


# ----------------------------------------------------------------------------- property 1

def test_pagerank_nonnegative_sums_to_one_and_uniform_on_complete_graph():
    rng = np.random.default_rng(0)
    for k in (2, 5, 8):
        a = rng.random((k, k)) * (rng.random((k, k)) < 0.6)
        np.fill_diagonal(a, 0)
        w = mass.pagerank(a)
        assert (w >= 0).all() and w.sum() == pytest.approx(1.0, abs=1e-12)
        complete = 3.0 * (np.ones((k, k)) - np.eye(k))
        np.testing.assert_allclose(mass.pagerank(complete), np.full(k, 1 / k), atol=1e-12)
    # a star: the hub gets the most weight; the closed form of a symmetric star with 3 leaves
    star = np.zeros((4, 4))
    star[0, 1:] = star[1:, 0] = 1.0
    w = mass.pagerank(star, damping=0.85)
    hub = (1 - 0.85) / 4 + 0.85 * 3 * w[1]
    assert w[0] == pytest.approx(hub, abs=1e-10) and w[0] > w[1]
    np.testing.assert_allclose(w[1:], w[1])


# ----------------------------------------------------------------------------- property 2

@pytest.mark.parametrize("agg", mass.SCORE_AGGS)
def test_orthogonal_skills_score_their_weight_and_top_skill_ranks_first(agg):
    rng = np.random.default_rng(1)
    k, e = 5, 7
    q, _ = np.linalg.qr(rng.normal(size=(e, e)))
    skills = q[:k] * rng.uniform(0.5, 3.0, size=(k, 1))  # orthogonal, any norms
    w = rng.dirichlet(np.ones(k))
    scores = mass.mass_scores(skills * 2.5, skills, w, agg)  # sample x = e_k (rescaled)
    np.testing.assert_allclose(scores, w, atol=1e-12)
    assert np.argmax(scores) == np.argmax(w)


# ----------------------------------------------------------------------------- property 3

def test_top_fraction_keeps_ceil_xn_and_is_invariant_to_positive_rescaling():
    rng = np.random.default_rng(2)
    for n in (1, 7, 10, 33):
        s = rng.normal(size=n)
        s[: n // 3] = s[0]  # ties
        for x in (0.01, 0.3, 0.5, 0.7, 1.0):
            keep = mass.top_fraction(s, x)
            assert len(keep) == max(1, math.ceil(x * n - 1e-9)) and len(set(keep)) == len(keep)
            np.testing.assert_array_equal(keep, mass.top_fraction(s * 17.0, x))
            np.testing.assert_array_equal(keep, mass.top_fraction(s * 1e-3, x))
            rest = np.setdiff1d(np.arange(n), keep)
            if len(rest):
                assert s[keep].min() >= s[rest].max()
    assert len(mass.top_fraction(np.arange(10.0), 0.3)) == 3  # 0.3 * 10 is 3.0000000000000004
    with pytest.raises(ValueError, match="keep ratio"):
        mass.top_fraction(np.arange(3.0), 0.0)


# ----------------------------------------------------------------------------- property 4

def test_single_skill_ranking_is_the_cosine_ranking():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 6))
    e = rng.normal(size=(1, 6))
    cos = (x @ e[0]) / np.linalg.norm(x, axis=1) / np.linalg.norm(e)
    for agg in mass.SCORE_AGGS:
        np.testing.assert_array_equal(np.argsort(-mass.mass_scores(x, e, np.ones(1), agg)), np.argsort(-cos))


# ----------------------------------------------------------------------------- tagging, graph

def test_rule_tags():
    t = mass.tag_skills
    assert t("Problem: 7+1\nStep 1: 7+1=8\nAnswer: 8\n") == {"add"}
    assert t("Problem: 7+5\nStep 1: 7+5=12\nAnswer: 12\n") == {"add", "carry"}
    assert t("Problem: 21-3\nStep 1: 21-3=18\nAnswer: 18\n") == {"sub", "carry"}  # borrow
    assert t("Problem: (6*3)/2\nStep 1: 6*3=18\nStep 2: 18/2=9\nAnswer: 9\n") == \
        {"mul", "div", "multi_step", "parentheses"}
    assert t("Problem: 9-2+4\nStep 1: 9-2=7\nStep 2: 7+4=11\nAnswer: 11\n") == \
        {"sub", "add", "carry", "multi_step"}
    assert "word_problem" in t("Problem: Ann has 4 coins, then loses 1. How many?\nStep 1: 4-1=3\nAnswer: 3\n")
    assert t("Problem: reverse abc\nAnswer: cba\n") == frozenset() == t("The ship sailed.\n")
    p = arithmetic.problem_from_expression("(23+45)*3")
    noisy, _ = arithmetic.inject_error(p, np.random.default_rng(0))
    clean = mass.tag_skills("Problem: (23+45)*3\n" + arithmetic.format_solution(p.steps))
    assert mass.tag_skills("Problem: (23+45)*3\n" + arithmetic.format_solution(noisy)) - {"carry"} == \
        clean - {"carry"}


def test_skill_graph_counts_cooccurrence_and_frequency_weights():
    tags = [frozenset({"add", "carry"}), frozenset({"add", "mul", "multi_step"}), frozenset({"add"}),
            frozenset()]
    g = mass.skill_graph(tags, "frequency")
    assert g.skills == ("add", "mul", "carry", "multi_step")  # SKILLS order, present ones only
    np.testing.assert_array_equal(g.counts, [3, 1, 1, 1])
    np.testing.assert_allclose(g.weights, np.array([3, 1, 1, 1]) / 6)
    expect = np.zeros((4, 4))
    for a, b in (("add", "carry"), ("add", "mul"), ("add", "multi_step"), ("mul", "multi_step")):
        i, j = g.skills.index(a), g.skills.index(b)
        expect[i, j] = expect[j, i] = 1
    np.testing.assert_array_equal(g.cooc, expect)
    pr = mass.skill_graph(tags, "pagerank")
    assert pr.weights.sum() == pytest.approx(1) and np.argmax(pr.weights) == 0
    emb = np.array([[1.0, 0], [0, 1.0], [3.0, 3.0], [9.0, 9.0]])
    e = mass.skill_embeddings(emb, mass.tag_matrix(tags, g.skills))
    np.testing.assert_allclose(e[0], emb[:3].mean(0))
    with pytest.raises(ValueError, match="mass_node_weight"):
        mass.skill_graph(tags, "degree")
    with pytest.raises(ValueError, match="mass_score_agg"):
        mass.mass_scores(emb, e, g.weights, "mean")


def test_pool_and_target_rows():
    rows = mass.pool_rows(100, dict(noisy=0.2, string=0.1, prose=0.3), seed=0)
    kinds = [r.kind for r in rows]
    assert [kinds.count(k) for k in mass.KINDS] == [40, 20, 10, 30]
    for r in rows:
        check = arithmetic.check_solution(r.problem, r.text.split("\n", 1)[1]) if r.problem else None
        assert (r.kind == "clean") == bool(check and check.answer_correct)
        assert bool(mass.tag_skills(r.text)) == (r.kind in ("clean", "noisy"))
    test = mass.target_rows(30, seed=1, exclude={r.prompt for r in rows})
    assert len({r.prompt for r in test}) == 30 and not {r.prompt for r in test} & {r.prompt for r in rows}
    assert rows == mass.pool_rows(100, dict(noisy=0.2, string=0.1, prose=0.3), seed=0)
    with pytest.raises(ValueError, match="kinds are"):
        mass.pool_rows(10, dict(junk=0.1), seed=0)


# ----------------------------------------------------------------------------- pipeline option

def test_select_scores_keeps_the_top_documents_in_the_train_pipeline(tmp_path, make_cfg):
    texts = [f"document number {i} " + "x" * (i % 5) for i in range(40)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = make_cfg(name="jsonl", path=str(path), data_dir=str(tmp_path / "tfds"))
    tok = ByteTokenizer()
    full = pipeline.load_corpus(cfg, tok, "train", 32)
    from icml_jax.data.sources import get_split_source
    train = [get_split_source(cfg, "train")[i]["text"] for i in range(full.num_documents)]
    scores = np.array([len(t) + 0.01 * i for i, t in enumerate(train)])  # longest first
    np.save(tmp_path / "s.npy", scores)
    cfg.select_scores, cfg.select_ratio = str(tmp_path / "s.npy"), 0.25
    kept = pipeline.load_corpus(cfg, tok, "train", 32)
    n = math.ceil(0.25 * len(train))
    assert kept.num_documents == n
    want = [train[i] for i in sorted(np.argsort(-scores)[:n])]
    got = [tok.decode(kept.tokens[a + 1:b - 1].tolist()) for a, b in zip(kept.doc_starts, kept.doc_starts[1:])]
    assert got == want
    assert pipeline.load_corpus(cfg, tok, "validation", 32).num_documents == \
        len(get_split_source(cfg, "validation"))  # evaluation splits are never filtered
    # bad keys: one-line errors naming the key
    bad = [(dict(select_ratio=0.0), "select_ratio=0.0"), (dict(select_ratio=1.5), "select_ratio=1.5"),
           (dict(select_scores="", select_ratio=0.5), "needs config.data.select_scores"),
           (dict(select_scores=str(tmp_path / "none.npy")), "does not exist"),
           (dict(select_scores=str(tmp_path / "c.jsonl")), "expected a .npy")]
    np.save(tmp_path / "short.npy", scores[:-1])
    bad.append((dict(select_scores=str(tmp_path / "short.npy")), f"holds {len(train) - 1} scores"))
    np.save(tmp_path / "nan.npy", np.full(len(train), np.nan))
    bad.append((dict(select_scores=str(tmp_path / "nan.npy")), "finite"))
    for over, msg in bad:
        c = make_cfg(name="jsonl", path=str(path), data_dir=str(tmp_path / "tfds"), select_scores="",
                     select_ratio=1.0)
        c.update(over)
        with pytest.raises((ValueError, FileNotFoundError), match=msg) as e:
            pipeline.load_corpus(c, tok, "train", 32)
        assert "\n" not in str(e.value) and "config.data.select" in str(e.value)


def test_trainer_validates_the_selection_keys_before_any_compute(tmp_path):
    from icml_jax.config_utils import load_config
    from icml_jax.train.trainer import validate_config
    cfg = load_config("configs/lm.py:tiny", unlocked=True)
    validate_config(cfg, 1)
    np.save(tmp_path / "s.npy", np.arange(5.0))
    cfg.data.select_scores, cfg.data.select_ratio = str(tmp_path / "s.npy"), 0.5
    validate_config(cfg, 1)
    for path, ratio, msg in (("", 0.5, "needs config.data.select_scores"), (str(tmp_path / "s.npy"), 2.0, "(0, 1]"),
                             (str(tmp_path / "x.npy"), 0.5, "does not exist")):
        cfg.data.select_scores, cfg.data.select_ratio = path, ratio
        with pytest.raises((ValueError, FileNotFoundError), match=msg.replace("(", r"\(").replace("]", r"\]")):
            validate_config(cfg, 1)
