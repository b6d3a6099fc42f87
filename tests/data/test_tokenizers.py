"""Byte and SentencePiece tokenizers: ids, specials, lossless round trips, the training CLI."""
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from icml_jax.data import ByteTokenizer, build_tokenizer, get_split_source, train_sentencepiece

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _random_unicode(rng, n):
    cps = rng.integers(0, 0x110000, size=n)
    cps = cps[(cps < 0xD800) | (cps > 0xDFFF)]  # surrogates are not encodable
    return "".join(map(chr, cps))


def test_byte_tokenizer_ids_and_round_trip():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
    assert tok.encode("A") == [ord("A") + 3]
    assert tok.encode("é") == [0xC3 + 3, 0xA9 + 3]
    rng = np.random.default_rng(0)
    for n in (0, 1, 10, 1000):
        text = _random_unicode(rng, n) + "ascii\n\t 日本語 😀"
        ids = tok.encode(text)
        assert all(3 <= i < 259 for i in ids)
        assert tok.decode(ids) == text
        np.testing.assert_array_equal(tok.encode_np(text), np.array(ids, np.int32))
    assert tok.encode_np("abc").dtype == np.int32


def test_byte_tokenizer_extra_ids():
    """Extra symbols (U+E000 + i) are one token each (259 + i), next to multi-byte text; other
    private-use characters stay bytes; spans and round trips hold; the config key reaches it."""
    tok = ByteTokenizer(extra_ids=5)
    assert tok.vocab_size == 264 and ByteTokenizer().vocab_size == 259
    text = "a" + tok.extra_symbol(0) + "é" + tok.extra_symbol(4) + "\ue005€" + tok.extra_symbol(2)
    ids = tok.encode(text)
    plain = ByteTokenizer()
    want = (plain.encode("a") + [259] + plain.encode("é") + [263] + plain.encode("\ue005€") + [261])
    assert ids == want
    assert tok.decode(ids) == text and tok.decode([1] + ids + [0, 2]) == text
    assert plain.encode(text) == list(np.frombuffer(text.encode(), np.uint8) + 3)  # extra_ids=0: all bytes
    got_ids, spans = tok.encode_with_spans(text)
    assert got_ids.tolist() == want and len(spans) == len(want)
    assert [text[a:b] for a, b in spans] == ["a", tok.extra_symbol(0), "é", "é", tok.extra_symbol(4)] + \
        ["\ue005"] * 3 + ["€"] * 3 + [tok.extra_symbol(2)]
    cfg = ml_collections.ConfigDict({"type": "byte", "extra_ids": 5})
    assert build_tokenizer(cfg).encode(tok.extra_symbol(3)) == [262]
    with pytest.raises(ValueError, match="extra symbol 5"):
        tok.extra_symbol(5)
    for bad in (-1, 2.5, 6401):
        with pytest.raises(ValueError, match="extra_ids"):
            ByteTokenizer(extra_ids=bad)
    with pytest.raises(ValueError, match="byte tokenizer only"):
        build_tokenizer(ml_collections.ConfigDict({"type": "sentencepiece", "model_path": "x", "extra_ids": 2}))


def test_byte_decode_ignores_specials_and_invalid_utf8():
    tok = ByteTokenizer()
    ids = [tok.bos_id] + tok.encode("hi") + [tok.eos_id, tok.pad_id, 999, -5]
    assert tok.decode(ids) == "hi"
    broken = tok.encode("é")[:1] + tok.encode("ok")  # a truncated 2-byte sequence
    assert tok.decode(broken) == "\ufffdok"
    assert tok.decode(np.array([0xFF + 3, 0xFE + 3])) == "\ufffd\ufffd"


@pytest.fixture(scope="module")
def spm_tok(tmp_path_factory, shakespeare_cfg):
    src = get_split_source(shakespeare_cfg, "validation")
    text = src[0]["text"][:20000]  # ~20 KB
    prefix = str(tmp_path_factory.mktemp("spm") / "tiny")
    return train_sentencepiece([text], prefix, vocab_size=400)


def test_sentencepiece_round_trip_and_specials(spm_tok):
    tok = spm_tok
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 300 <= tok.vocab_size <= 400
    rng = np.random.default_rng(1)
    for text in ["To be, or not to be:\n  that is the question.\n\n",
                 "  leading and   inner   spaces, tabs\tand newlines\n",
                 _random_unicode(rng, 200)]:
        ids = tok.encode(text)
        assert all(3 <= i < tok.vocab_size for i in ids)  # encode never emits pad/bos/eos
        assert tok.decode(ids) == text
        assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    # It compresses English better than bytes.
    sample = "Now is the winter of our discontent made glorious summer by this son of York."
    assert len(tok.encode(sample)) < 0.7 * len(sample)


def test_build_tokenizer_dispatch_and_errors(spm_tok, tmp_path):
    cfg = ml_collections.ConfigDict(dict(type="byte", model_path=""))
    assert isinstance(build_tokenizer(cfg), ByteTokenizer)
    cfg.type = "sentencepiece"
    cfg.model_path = spm_tok.model_path
    assert build_tokenizer(cfg).vocab_size == spm_tok.vocab_size
    cfg.model_path = ""
    with pytest.raises(ValueError, match="model_path"):
        build_tokenizer(cfg)
    cfg.model_path = str(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_tokenizer(cfg)
    cfg.type = "wordpiece"
    with pytest.raises(ValueError, match="'byte' or 'sentencepiece'"):
        build_tokenizer(cfg)


def test_training_cli_writes_a_model(txt_corpus, tmp_path):
    out = tmp_path / "spm" / "spm"
    cmd = [sys.executable, "-m", "icml_jax.data.tokenizers", "--train", f"--out={out}",
           "--vocab_size=300", "--dataset=text_files", f"--path={txt_corpus}",
           f"--data_dir={tmp_path / 'tfds'}"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert os.path.exists(f"{out}.model") and "vocab_size=" in res.stdout


def test_spans_for_alignment(spm_tok):
    """Both tokenizers give character spans that cover the text; aligning them maps every byte to
    the teacher piece whose surface contains its character."""
    from icml_jax.data import alignment
    text = "  Thou art more lovely, héllo wörld; and more temperate"
    ids, spans = ByteTokenizer().encode_with_spans(text)
    assert ids.tolist() == ByteTokenizer().encode(text) and spans[-1, 1] == len(text)
    t_ids, t_spans = spm_tok.encode_with_spans(text)
    assert t_ids.tolist() == spm_tok.encode(text)
    assert (t_spans[:, 0] <= t_spans[:, 1]).all() and (np.diff(t_spans[:, 0]) >= 0).all()
    start, end, mapped = alignment.align(spans, t_spans)
    covered = np.zeros(len(text), bool)
    for a, b in t_spans:
        covered[a:b] = True
    assert (mapped == covered[spans[:, 0]]).all()  # a byte is mapped iff a piece's surface covers it
    for i in np.nonzero(mapped)[0]:
        a, b = spans[i]
        assert all(t_spans[j, 0] < b and t_spans[j, 1] > a for j in range(start[i], end[i] + 1))
