"""grain pipeline: chunking, packing (segment ids / positions), determinism, exact resume, sharding."""
import collections
import json
import time

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from icml_jax.data import ByteTokenizer, make_eval_batches, make_train_iterator, pipeline

TOK = ByteTokenizer()
KEYS = ("inputs", "targets", "segment_ids", "positions")


def _docs(n=9, seed=0):
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 5, 30, 31, 32, 33, 64, 100][:n]
    return [{"text": "".join(chr(c) for c in rng.integers(97, 123, size=l))} for l in lengths]


def _pairs(tokens):
    return list(zip(tokens[:-1].tolist(), tokens[1:].tolist()))


def _pieces(rows, seq_len):
    """Splits packed rows into pieces; checks segment ids and positions on the way."""
    pieces = []
    for row in rows:
        seg, pos = row["segment_ids"], row["positions"]
        assert all(row[k].shape == (seq_len,) and row[k].dtype == np.int32 for k in KEYS)
        n = int((seg > 0).sum())
        assert (seg[:n] > 0).all() and (seg[n:] == 0).all()  # padding only at the end
        for k in KEYS:
            assert (row[k][n:] == 0).all()
        ids = seg[:n]
        assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
        for s in range(1, int(ids.max()) + 1 if n else 1):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # restart at 0
            inp, tgt = row["inputs"][idx], row["targets"][idx]
            np.testing.assert_array_equal(inp[1:], tgt[:-1])  # targets are inputs shifted by one
            pieces.append(tuple(np.concatenate([inp, tgt[-1:]]).tolist()))
    return pieces


@pytest.mark.parametrize("seq_len", [1, 4, 32])
def test_chunks_cover_every_next_token_pair_once(seq_len):
    corpus = pipeline.tokenize_source(_docs(), TOK, seq_len)
    assert corpus.num_documents == 9
    doc_pairs, chunk_pairs = [], []
    for d in range(corpus.num_documents):
        doc = corpus.tokens[corpus.doc_starts[d]:corpus.doc_starts[d + 1]]
        assert doc[0] == TOK.bos_id and doc[-1] == TOK.eos_id
        doc_pairs += _pairs(doc)
    for s, e in zip(corpus.chunk_starts, corpus.chunk_ends):
        assert 2 <= e - s <= seq_len + 1
        d = np.searchsorted(corpus.doc_starts, s, side="right") - 1
        assert e <= corpus.doc_starts[d + 1]  # a chunk never crosses a document boundary
        chunk_pairs += _pairs(corpus.tokens[s:e])
    assert collections.Counter(doc_pairs) == collections.Counter(chunk_pairs)
    assert len(doc_pairs) == len(chunk_pairs)


def test_packing_segments_positions_and_no_lost_tokens():
    seq_len = 16
    corpus = pipeline.tokenize_source(_docs(), TOK, seq_len)
    rows = list(pipeline.packed_dataset(corpus, seq_len=seq_len, seed=None, num_epochs=1))
    pieces = _pieces(rows, seq_len)
    chunks = [tuple(corpus.tokens[s:e].tolist())
              for s, e in zip(corpus.chunk_starts, corpus.chunk_ends)]
    assert collections.Counter(pieces) == collections.Counter(chunks)  # every chunk, exactly once
    assert max(int(r["segment_ids"].max()) for r in rows) >= 2  # short chunks were packed together
    # bos appears only as the first input of a piece; eos only as a target.
    for r in rows:
        assert (r["positions"][r["inputs"] == TOK.bos_id] == 0).all()
        assert not (r["inputs"] == TOK.eos_id).any()


def test_epochs_are_reshuffled_permutations():
    order = pipeline.chunk_order(50, seed=7)
    e0 = [order[i] for i in range(50)]
    e1 = [order[i] for i in range(50, 100)]
    assert sorted(e0) == sorted(e1) == list(range(50))
    assert e0 != e1 and e0 != list(range(50))
    again = pipeline.chunk_order(50, seed=7)
    assert [again[i] for i in range(100)] == e0 + e1


def _take(it, n):
    return [next(it) for _ in range(n)]


def _assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() == set(KEYS)
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])


def _train_it(cfg, seed=0, batch=8, seq_len=32, **kw):
    kw.setdefault("process_index", 0)
    kw.setdefault("process_count", 1)
    return make_train_iterator(cfg, TOK, seq_len=seq_len, global_batch_size=batch, seed=seed, **kw)


def test_train_batches_shapes_and_contract(shakespeare_cfg):
    it = _train_it(shakespeare_cfg)
    assert isinstance(it, grain.DatasetIterator)
    batches = _take(it, 3)
    for b in batches:
        assert set(b) == set(KEYS)
        for k in KEYS:
            assert b[k].shape == (8, 32) and b[k].dtype == np.int32
        _pieces([{k: b[k][i] for k in KEYS} for i in range(8)], 32)
        assert (b["inputs"] < TOK.vocab_size).all()
    assert (batches[0]["segment_ids"] > 0).mean() > 0.9  # packing keeps padding low


def test_same_seed_same_batches_other_seed_differs(shakespeare_cfg):
    a = _take(_train_it(shakespeare_cfg, seed=1), 4)
    b = _take(_train_it(shakespeare_cfg, seed=1), 4)
    _assert_batches_equal(a, b)
    c = _take(_train_it(shakespeare_cfg, seed=2), 4)
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


@pytest.mark.parametrize("skip", [0, 1, 5])
def test_set_state_resumes_exactly(shakespeare_cfg, skip):
    it = _train_it(shakespeare_cfg, batch=6)
    _take(it, skip)
    state = json.loads(json.dumps(it.get_state()))  # states are JSON (grain's checkpoint format)
    expected = _take(it, 4)
    fresh = _train_it(shakespeare_cfg, batch=6)
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 4), expected)


def test_resume_across_epoch_boundary(txt_corpus, make_cfg, tmp_path):
    # A tiny corpus (a few chunks) so that the iterator wraps around several epochs.
    cfg = make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path))
    it = _train_it(cfg, batch=4, seq_len=16)
    _take(it, 7)
    state = it.get_state()
    expected = _take(it, 30)
    fresh = _train_it(cfg, batch=4, seq_len=16)
    fresh.set_state(state)
    _assert_batches_equal(_take(fresh, 30), expected)


def test_orbax_checkpoint_round_trip_with_grain_handler(shakespeare_cfg, tmp_path):
    it = _train_it(shakespeare_cfg)
    _take(it, 3)
    manager = ocp.CheckpointManager(
        tmp_path / "ckpt", options=ocp.CheckpointManagerOptions(create=True),
        item_handlers={"data": grain.checkpoint.CheckpointHandler()})
    manager.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
    manager.wait_until_finished()
    expected = _take(it, 3)

    restored_it = _train_it(shakespeare_cfg)
    _take(restored_it, 11)  # wherever it is, restoring must move it back to step 3
    manager = ocp.CheckpointManager(
        tmp_path / "ckpt", item_handlers={"data": grain.checkpoint.CheckpointHandler()})
    out = manager.restore(3, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(restored_it)))
    assert out["data"] is restored_it
    _assert_batches_equal(_take(restored_it, 3), expected)


def test_process_shards_are_disjoint_halves_of_the_global_batch(shakespeare_cfg):
    """Process p of P gets rows [p*B/P, (p+1)*B/P) of the 1-process global batch of B rows."""
    full = _take(_train_it(shakespeare_cfg, batch=8), 3)
    p0 = _take(_train_it(shakespeare_cfg, batch=8, process_index=0, process_count=2), 3)
    p1 = _take(_train_it(shakespeare_cfg, batch=8, process_index=1, process_count=2), 3)
    for f, a, b in zip(full, p0, p1):
        for k in KEYS:
            assert a[k].shape == b[k].shape == (4, 32)
            np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), f[k])
        rows_a = {r.tobytes() for r in a["inputs"]}
        assert not rows_a & {r.tobytes() for r in b["inputs"]}


def test_streams_split_the_packing_across_processes(shakespeare_cfg):
    """With S streams, process p of P builds only its S/P streams, and the processes' rows stack to
    the 1-process batch; a state saved with 2 processes resumes the 1-process iterator."""
    from icml_jax.data.pipeline import StreamsIterator
    full_it = _train_it(shakespeare_cfg, batch=8, streams=4)
    full = _take(full_it, 3)
    parts = [_train_it(shakespeare_cfg, batch=8, streams=4, process_index=p, process_count=2)
             for p in (0, 1)]
    assert all(isinstance(it, StreamsIterator) and len(it.iterators) == 2 for it in parts)
    assert [it.first for it in parts] == [0, 2] and len(full_it.iterators) == 4
    got = [_take(it, 3) for it in parts]
    for f, a, b in zip(full, *got):
        for k in KEYS:
            assert a[k].shape == (4, 32)
            np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), f[k])
        _pieces([{k: f[k][i] for k in KEYS} for i in range(8)], 32)
    # each stream holds its own chunks: streams 0-1 (process 0) and 2-3 (process 1) share no row
    assert not ({r.tobytes() for r in got[0][0]["inputs"]}
                & {r.tobytes() for r in got[1][0]["inputs"]})
    # merge the two processes' states (what the checkpoint does) and resume one process
    merged = {"streams": {**parts[0].get_state()["streams"], **parts[1].get_state()["streams"]}}
    resumed = _train_it(shakespeare_cfg, batch=8, streams=4)
    resumed.set_state(merged)
    _assert_batches_equal(_take(resumed, 2), _take(full_it, 2))
    # fewer streams than row shards: every process builds them all and slices
    three = _train_it(shakespeare_cfg, batch=8, streams=2, process_index=1, process_count=4)
    assert len(three.iterators) == 2
    want = _take(_train_it(shakespeare_cfg, batch=8, streams=2), 2)
    for w, g in zip(want, _take(three, 2)):
        np.testing.assert_array_equal(g["inputs"], w["inputs"][2:4])
    # streams change the data order (they are a config choice, not a process-count effect)
    assert not np.array_equal(full[0]["inputs"], _take(_train_it(shakespeare_cfg, batch=8), 1)[0]["inputs"])
    with pytest.raises(ValueError, match="another config.data.streams"):
        _train_it(shakespeare_cfg, batch=8, streams=4).set_state({"streams": {"0": {}}})
    with pytest.raises(ValueError, match="config.data.streams=3 must be >= 1 and divide"):
        _train_it(shakespeare_cfg, batch=8, streams=3)


def test_argument_validation(shakespeare_cfg):
    with pytest.raises(ValueError, match="multiple of the process count 3"):
        _train_it(shakespeare_cfg, batch=8, process_index=0, process_count=3)
    with pytest.raises(ValueError, match=r"seq_len=0 \(config\.data\.seq_len\)"):
        _train_it(shakespeare_cfg, seq_len=0)
    with pytest.raises(ValueError, match="process_index=2"):
        _train_it(shakespeare_cfg, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="positive multiple"):
        _train_it(shakespeare_cfg, batch=0)


def test_eval_batches_deterministic_padded_and_complete(shakespeare_cfg):
    kw = dict(split="validation", seq_len=64, batch_size=4, process_index=0, process_count=1)
    a = make_eval_batches(shakespeare_cfg, TOK, max_batches=3, **kw)
    b = make_eval_batches(shakespeare_cfg, TOK, max_batches=3, **kw)
    assert len(a) == 3
    _assert_batches_equal(a, b)
    everything = make_eval_batches(shakespeare_cfg, TOK, max_batches=None, **kw)
    # a capped evaluation takes evenly spaced batches over the whole split: first, middle, last
    spread = np.linspace(0, len(everything) - 1, 3).round().astype(int)
    assert spread[-1] == len(everything) - 1 > 3
    _assert_batches_equal([everything[i] for i in spread], a)
    for batch in everything:
        assert all(batch[k].shape == (4, 64) and batch[k].dtype == np.int32 for k in KEYS)
    # Every next-token pair of the split is scored exactly once.
    corpus = pipeline.load_corpus(shakespeare_cfg, TOK, "validation", 64)
    n_targets = sum(int((bt["segment_ids"] > 0).sum()) for bt in everything)
    assert n_targets == len(corpus.tokens) - corpus.num_documents
    # Test split works too, and process halves split the rows.
    halves = [make_eval_batches(shakespeare_cfg, TOK, split="test", seq_len=64, batch_size=4,
                                max_batches=2, process_index=p, process_count=2) for p in (0, 1)]
    full = make_eval_batches(shakespeare_cfg, TOK, split="test", seq_len=64, batch_size=4,
                             max_batches=2, process_index=0, process_count=1)
    for f, x, y in zip(full, *halves):
        np.testing.assert_array_equal(np.concatenate([x["inputs"], y["inputs"]]), f["inputs"])


def test_eval_last_batch_is_padded_with_segment_zero(txt_corpus, make_cfg, tmp_path):
    cfg = make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path))
    batches = make_eval_batches(cfg, TOK, split="train", seq_len=128, batch_size=8,
                                max_batches=None, process_index=0, process_count=1)
    last = batches[-1]
    empty_rows = (last["segment_ids"] == 0).all(axis=1)
    assert empty_rows.any()  # the corpus does not fill a whole last batch
    for k in KEYS:
        assert (last[k][empty_rows] == 0).all()


def test_tokenising_shakespeare_train_is_fast(shakespeare_cfg):
    t0 = time.perf_counter()
    corpus = pipeline.load_corpus(shakespeare_cfg, TOK, "train", 256)
    elapsed = time.perf_counter() - t0
    assert len(corpus.tokens) > 4_000_000
    assert elapsed < 10.0, f"tokenising the train split took {elapsed:.1f}s"
