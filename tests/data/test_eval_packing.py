"""Evaluation packing (pipeline.first_fit_rows) equals grain's FirstFitPackIterDataset without bin
shuffling, row for row, and make_eval_batches memoises it per process without sharing arrays."""
import numpy as np
import pytest

from icml_jax.data import ByteTokenizer, make_eval_batches, pipeline

TOK = ByteTokenizer()


class _Docs:
    """A source of documents (the pipeline reads ``len`` and ``[i]["text"]``)."""

    def __init__(self, texts):
        self.texts = texts

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return {"text": self.texts[i]}


def _random_corpus(seed, n_docs, max_len, seq_len):
    r = np.random.default_rng(seed)
    texts = ["".join(r.choice(list("abcdefgh "), size=int(n))) for n in
             r.integers(0, max_len, size=n_docs)]
    return pipeline.tokenize_source(_Docs(texts), TOK, seq_len)


def _grain_rows(corpus, seq_len, num_bins):
    rows = list(pipeline.packed_dataset(corpus, seq_len=seq_len, seed=None, num_epochs=1,
                                        num_bins=num_bins))
    return {k: np.stack([r[k] for r in rows]) for k in pipeline.FEATURES}


@pytest.mark.parametrize("seed,n_docs,max_len,seq_len,num_bins", [
    (0, 60, 40, 8, 16),    # many short documents, several pieces per row
    (1, 40, 300, 16, 3),   # few bins: batches flush often
    (2, 25, 90, 32, 1),    # one bin
    (3, 200, 12, 4, 16),   # pieces of one token
])
def test_first_fit_rows_equal_grain_packing(seed, n_docs, max_len, seq_len, num_bins):
    corpus = _random_corpus(seed, n_docs, max_len, seq_len)
    want = _grain_rows(corpus, seq_len, num_bins)
    got = pipeline.first_fit_rows(corpus, seq_len, num_bins)
    assert want["inputs"].shape[0] > num_bins  # more than one batch of bins was packed
    for k in pipeline.FEATURES:
        assert got[k].dtype == np.int32
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_first_fit_rows_equal_grain_on_shakespeare(shakespeare_cfg):
    corpus = pipeline.load_corpus(shakespeare_cfg, TOK, "validation", 128)
    want = _grain_rows(corpus, 128, 16)
    got = pipeline.first_fit_rows(corpus, 128, 16)
    for k in pipeline.FEATURES:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_first_fit_rows_reject_a_corpus_chunked_for_another_length():
    corpus = _random_corpus(0, 10, 100, 16)
    with pytest.raises(ValueError, match="another seq_len"):
        pipeline.first_fit_rows(corpus, 8, 16)


def test_eval_batches_memoised_per_corpus_content(tmp_path, make_cfg, monkeypatch):
    packed = []
    real = pipeline.first_fit_rows
    monkeypatch.setattr(pipeline, "first_fit_rows",
                        lambda *a: packed.append(a[1:]) or real(*a))
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(6):
        (folder / f"d{i}.txt").write_text("to be or not to be " * (i + 2))
    cfg = make_cfg(name="text_files", path=str(folder), data_dir=str(tmp_path / "tfds"), seq_len=16)
    kw = dict(split="train", seq_len=16, batch_size=4, process_index=0, process_count=1)
    first = make_eval_batches(cfg, TOK, **kw)
    first[0]["inputs"][:] = -1  # a caller's edit does not reach the memo
    again = make_eval_batches(cfg, TOK, **kw)
    assert (again[0]["inputs"] >= 0).all()
    assert packed == [(16, 16)]  # packed once for both calls
    (folder / "d0.txt").write_text("an edited document " * 3)
    edited = make_eval_batches(cfg, TOK, **kw)
    assert len(packed) == 2  # new contents, packed anew
    cat = lambda bs: np.concatenate([b["inputs"] for b in bs])  # noqa: E731
    assert cat(edited).shape != cat(again).shape or not np.array_equal(cat(edited), cat(again))
    corpus = pipeline.load_corpus(cfg, TOK, "train", 16)
    want = pipeline.first_fit_rows(corpus, 16, 16)
    np.testing.assert_array_equal(cat(edited)[:len(want["inputs"])], want["inputs"])
