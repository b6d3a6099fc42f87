"""ToEdit (icml_jax/analysis/toedit.py): the resampling rule on logits, the corpus pass, the CLI."""
import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from scipy import stats

from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.data import get_split_source
from icml_jax.data.pipeline import tokenize_source
from icml_jax.data.tokenizers import ByteTokenizer
from icml_jax.analysis import toedit
from icml_jax import toedit as toedit_cli
from icml_jax.models.decoder import build_model

V = 16


def _probs(logits, targets):
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1)
    return np.asarray(jnp.exp(jnp.take_along_axis(lp, jnp.asarray(targets)[..., None], -1)[..., 0]))


def test_rule_edits_exactly_the_confident_tokens_from_the_top_k():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 40, V)).astype(np.float32) * 3
    targets = rng.integers(0, V, (3, 40)).astype(np.int32)
    targets[0, :10] = logits[0, :10].argmax(-1)  # some confident originals
    key = jax.random.key(1)
    prob = np.asarray(toedit.edit_targets(logits, targets, key, toedit.ToEditConfig(p=2.0))[2])
    np.testing.assert_allclose(prob, _probs(logits, targets), rtol=1e-6)
    p = np.sort(prob.ravel())[prob.size // 2]  # a probability that occurs: ge and gt differ there
    for compare in ("ge", "gt"):
        cfg = toedit.ToEditConfig(p=float(p), k=3, compare=compare)
        new, hit, _ = (np.asarray(x) for x in toedit.edit_targets(logits, targets, key, cfg))
        want = prob >= p if compare == "ge" else prob > p
        np.testing.assert_array_equal(hit, want)
        assert (new[~hit] == targets[~hit]).all()
        top3 = np.argsort(-logits, -1)[..., :3]
        assert all(new[i] in top3[i] for i in zip(*np.nonzero(hit)))
    # p > 1: identity; p = 0: every position resampled; k = 1 with p > 0.5: identity
    for cfg, rate in ((toedit.ToEditConfig(p=1.01), 0.0), (toedit.ToEditConfig(p=0.0, k=4), 1.0)):
        new, hit, _ = toedit.edit_targets(logits, targets, key, cfg)
        assert float(np.mean(hit)) == rate
        if rate == 0.0:
            assert (np.asarray(new) == targets).all()
    new, hit, _ = toedit.edit_targets(logits, targets, key, toedit.ToEditConfig(p=0.6, k=1))
    assert np.asarray(hit).any() and (np.asarray(new) == targets).all()
    # banned ids are never drawn, even when they are the most likely
    banned = np.unique(logits.argmax(-1))[:4]
    new, hit, _ = toedit.edit_targets(logits, targets, key, toedit.ToEditConfig(p=0.0, k=2), banned)
    assert not np.isin(np.asarray(new), banned).any()


def test_resampled_tokens_follow_the_tempered_top_k_distribution():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(1, 1, V)) * 2, jnp.float32)
    target = jnp.asarray([[int(jnp.argmax(logits))]], jnp.int32)
    n, k, beta = 4000, 4, 1.5
    draw = jax.jit(jax.vmap(lambda key, b: toedit.edit_targets(
        logits, target, key, toedit.ToEditConfig(p=0.0, k=k, beta=b))[0][0, 0], in_axes=(0, None)))
    keys = jax.random.split(jax.random.key(3), n)
    lp = np.asarray(jax.nn.log_softmax(logits[0, 0]))
    top = np.argsort(-lp)[:k]
    want = np.exp(lp[top] / beta) / np.exp(lp[top] / beta).sum()
    got = np.asarray(draw(keys, beta))
    assert np.isin(got, top).all()
    counts = np.array([(got == t).sum() for t in top])
    assert stats.chisquare(counts, want * n).pvalue > 1e-3
    wrong = np.array([(np.asarray(draw(keys, 1.0)) == t).sum() for t in top])  # beta 1 is told apart
    assert stats.chisquare(wrong, want * n).pvalue < 1e-6


@pytest.fixture(scope="module")
def prior():
    cfg = load_config("configs/lm.py:tiny", unlocked=True).model
    model = build_model(cfg)
    params = nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = jax.tree.map(lambda x: x * 6.0, params)  # peaked predictions: a spread of probabilities
    return cfg, model, params


def test_corpus_pass_conditions_on_the_original_text_and_reproduces(prior):
    cfg, model, params = prior
    tok = ByteTokenizer()
    texts = ["To be, or not to be, that is the question.", "Ay", "Whether 'tis nobler in the mind to suffer"]
    corpus = tokenize_source([{"text": t} for t in texts], tok, 16)  # documents longer than 16 tokens are chunked
    # the prior's probability of every original token, chunk by chunk (the pipeline's contexts)
    prob = np.zeros(len(corpus.tokens), np.float32)
    apply = jax.jit(lambda x: model.apply({"params": params}, x))
    for c in range(corpus.num_chunks):  # right-padded to one shape: causal, so padding changes nothing
        s, e = corpus.chunk_starts[c], corpus.chunk_ends[c]
        piece = np.zeros((1, 17), np.int32)
        piece[0, :e - s] = corpus.tokens[s:e]
        prob[s + 1:e] = _probs(apply(piece[:, :-1]), piece[:, 1:])[0, :e - s - 1]
    scored = np.ones(len(prob), bool)  # every token but each document's BOS and EOS
    scored[corpus.doc_starts[:-1]] = False
    scored[corpus.doc_starts[1:] - 1] = False
    p = float(np.median(prob[scored]))
    conf = toedit.ToEditConfig(p=p, k=4)
    banned = toedit.banned_for(tok, cfg.vocab_size)
    key = jax.random.key(7)
    out, hit, drop = toedit.edit_corpus(cfg, params, corpus, key, conf, banned, batch_size=4)
    # resampled exactly where the original prefix makes the token likely (an autoregressive
    # edit, conditioning on earlier edits, would change these probabilities)
    np.testing.assert_array_equal(hit, scored & (prob >= p))
    assert 0.3 < hit[scored].mean() < 0.7 and not drop.any()
    assert (out[~hit] == corpus.tokens[~hit]).all() and len(out) == len(corpus.tokens)
    assert (out[corpus.doc_starts[1:] - 1] == tok.eos_id).all()  # a confident EOS stays
    assert not np.isin(out[hit], banned).any()
    again = toedit.edit_corpus(cfg, params, corpus, key, conf, banned, batch_size=4)[0]
    other = toedit.edit_corpus(cfg, params, corpus, jax.random.key(8), conf, banned, batch_size=4)[0]
    assert (again == out).all() and (other != out).any()
    st = toedit.edit_stats(corpus, corpus.tokens, out, hit, drop, conf)
    assert st["scored_tokens"] == len(out) - 2 * len(texts) and st["edit_rate"] == hit.sum() / st["scored_tokens"]
    # the drop variant deletes the unlikely tokens that were not resampled
    dconf = toedit.ToEditConfig(p=p, k=4, drop_below=float(np.quantile(prob[scored], 0.2)))
    _, dhit, ddrop = toedit.edit_corpus(cfg, params, corpus, key, dconf, banned, batch_size=4)
    np.testing.assert_array_equal(ddrop, scored & (prob < dconf.drop_below))
    texts_out = toedit.edited_texts(tok, corpus, corpus.tokens, ddrop)
    assert sum(len(t.encode()) for t in texts_out) == sum(len(t.encode()) for t in texts) - ddrop.sum()


def _workdir(tmp_path, corpus_path):
    """A trainer-style workdir of the tiny preset whose config.data is the JSONL corpus."""
    from icml_jax.train import checkpoint as ckpt_lib
    from icml_jax.train.optimizer import make_optimizer
    from icml_jax.train.trainer import TrainState, _config_dict
    wd = tmp_path / "prior"
    wd.mkdir()
    config = load_config("configs/lm.py:tiny", unlocked=True)
    config.data.name, config.data.path, config.data.data_dir = "jsonl", str(corpus_path), str(tmp_path / "tfds")
    with open(wd / "config.json", "w") as f:
        json.dump(_config_dict(config), f)
    params = nn.meta.unbox(build_model(config.model).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    ckpt = ckpt_lib.Checkpointer(str(wd / "checkpoints"), async_save=False)
    ckpt.save(1, TrainState(jnp.asarray(1, jnp.int32), params, make_optimizer(config.train).init(params)), None,
              _config_dict(config))
    ckpt.close()
    return wd, config


def test_cli_writes_an_edited_corpus_that_the_pipeline_reads(tmp_path):
    docs = [f"Line {i}: the quality of mercy is not strained, it droppeth as the gentle rain." for i in range(8)]
    corpus_path = tmp_path / "human.jsonl"
    corpus_path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    wd, config = _workdir(tmp_path, corpus_path)
    out = tmp_path / "edited.jsonl"
    # bad settings stop before any compute and write nothing
    for args, msg in ((["--k=0"], "k=0"), (["--beta=0"], "beta=0"), (["--p=nan"], "p=nan"),
                      ([f"--out={corpus_path}"], "exists"), (["--split=dev"], "dev"),
                      ([f"--data_path={tmp_path / 'missing.jsonl'}"], "missing.jsonl")):
        with pytest.raises(SystemExit, match=msg):
            toedit_cli.main([f"--checkpoint={wd}", f"--out={out}", *args])
        assert not out.exists() and not os.path.exists(str(out) + ".stats.json")
    # in a fresh process: a bad split stops with one line before JAX is imported
    probe = ("import atexit, sys; atexit.register(lambda: print('jax imported:', 'jax' in sys.modules)); "
             "from icml_jax import toedit; toedit.main(sys.argv[1:])")
    r = subprocess.run([sys.executable, "-c", probe, f"--checkpoint={wd}", f"--out={out}", "--split=dev"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "jax imported: False" in r.stdout, r.stdout + r.stderr
    assert r.stderr.strip().startswith("toedit:") and "dev" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    st = toedit_cli.main([f"--checkpoint={wd}", f"--out={out}", "--p=0", "--k=3", "--split=train"])
    assert st["edit_rate"] == 1.0 and st["documents"] >= 1
    assert json.loads((tmp_path / "edited.jsonl.stats.json").read_text())["edit_rate"] == 1.0
    written = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(written) == st["documents"] and written != docs[:len(written)]
    cfg = ml_collections.ConfigDict(dict(name="jsonl", path=str(out), text_key="text",
                                         data_dir=str(tmp_path / "tfds2"), seq_len=32))
    back = [get_split_source(cfg, s) for s in ("train", "validation", "test")]
    assert sorted(src[i]["text"] for src in back for i in range(len(src))) == sorted(written)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
