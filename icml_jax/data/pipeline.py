"""grain pipelines: tokenise, chunk, pack (with segment ids) and batch text for LM training.

Axis letters: B rows per process (``global_batch_size // process_count``), T ``seq_len``.

Batch contract (train and eval), every value a numpy int32 array of shape [B, T]:
  inputs       token ids; 0 (= pad_id of both tokenizers) in padding.
  targets      next-token ids: targets[b, t] follows inputs[b, t] in the same document.
  segment_ids  1, 2, 3, ... for the pieces packed into a row, 0 for padding. Use
               ``segment_ids > 0`` as the loss weight and equal, non-zero segment ids for the
               attention mask.
  positions    0, 1, 2, ... restarting at every piece; 0 in padding.

How documents become pieces. A document is tokenised as ``[bos] + encode(text) + [eos]`` (length
L >= 2). It is cut into chunks of at most T + 1 tokens that overlap by one token: chunk i covers
tokens [i*T, min(i*T + T + 1, L)), and gives inputs = chunk[:-1], targets = chunk[1:]. So every
(token, next token) pair of the document appears in exactly one piece — no prediction is lost at
chunk boundaries and no target crosses a document boundary; the only cost is that a chunk's first
token (the previous chunk's last target) is re-read as context, with positions restarting at 0.
Pieces are packed into rows of T by grain's ``FirstFitPackIterDataset``.

Selection: with ``config.data.select_scores`` (a .npy of one score per train document) and
``select_ratio`` = x < 1, the train split keeps only its ceil(x N) highest-scored documents (MASS's
top-x%, ``data/mass.py``); evaluation splits are never filtered.

Training order: the corpus is tokenised once into memory (int32; a corpus must fit in host RAM), the
chunk table is shuffled per epoch from ``seed`` (grain ``MapDataset.shuffle`` + ``repeat``, a new
permutation each epoch), packed, and batched to ``global_batch_size`` rows. Process p keeps rows
``[p * B, (p + 1) * B)``: processes get disjoint, equally sized slices whose concatenation (in
process order) is the 1-process batch.

Streams (``config.data.streams`` = S). With S = 1 there is one packed stream, and every process
packs the whole global batch and keeps its slice. With S > 1 the chunks are dealt into S streams
(chunk c goes to stream c mod S), each shuffled, packed and batched to ``global_batch_size / S``
rows on its own; the global batch is the streams' batches stacked in stream order. A process then
builds only the streams its rows come from (when S is a multiple of the number of row shards), so
the packing work is split across hosts. Either way the batches depend on S, never on the process
count, so a run gives the same losses on 1 or many processes and its checkpoints move between them.

The iterator is a ``grain.DatasetIterator``: ``get_state()`` / ``set_state()`` restore it exactly;
save it beside the train state with ``grain.checkpoint.CheckpointSave(iterator)`` in orbax.
No worker processes are used (deterministic, cheap on a 2-core CPU).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from typing import Any

import grain
import numpy as np
from absl import logging

from icml_jax.data import mass, sources

FEATURES = ("inputs", "targets", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    """All documents of a split as one int32 array plus a chunk table.

    tokens: [N] every document as [bos] + ids + [eos], concatenated.
    doc_starts: [D + 1] document boundaries into ``tokens``.
    chunk_starts, chunk_ends: [C] chunk i is tokens[chunk_starts[i]:chunk_ends[i]] (2..T+1 tokens).
    """

    tokens: np.ndarray
    doc_starts: np.ndarray
    chunk_starts: np.ndarray
    chunk_ends: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_starts)

    def chunk(self, i: int) -> dict[str, np.ndarray]:
        c = self.tokens[self.chunk_starts[i]:self.chunk_ends[i]]
        return {"inputs": c[:-1], "targets": c[1:]}


def _process_slice(global_batch_size: int, process_index: int | None,
                   process_count: int | None) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax  # pylint: disable=g-import-not-at-top

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, process_count="
                         f"{process_count}).")
    if global_batch_size < 1 or global_batch_size % process_count:
        raise ValueError(
            f"global batch size {global_batch_size} (config.train.batch_size) must be a positive "
            f"multiple of the process count {process_count}; pick e.g. "
            f"{max(1, global_batch_size // process_count) * process_count}.")
    per_process = global_batch_size // process_count
    return process_index * per_process, per_process


def _check_seq_len(seq_len: int) -> None:
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} (config.data.seq_len) must be a positive integer.")


def tokenize_source(source: Any, tokenizer: Any, seq_len: int) -> TokenizedCorpus:
    """Tokenises every document of ``source`` and builds the chunk table for ``seq_len``."""
    _check_seq_len(seq_len)
    if len(source) == 0:
        raise ValueError(f"{source!r} has no documents.")
    pieces = []
    for i in range(len(source)):
        ids = tokenizer.encode_np(source[i]["text"])
        doc = np.empty(len(ids) + 2, dtype=np.int32)
        doc[0], doc[1:-1], doc[-1] = tokenizer.bos_id, ids, tokenizer.eos_id
        pieces.append(doc)
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    # A document of length L gives ceil((L - 1) / T) chunks starting at s, s + T, s + 2T, ...
    n_chunks = (lengths - 1 + seq_len - 1) // seq_len
    doc_of_chunk = np.repeat(np.arange(len(pieces)), n_chunks)
    first_chunk = np.concatenate([[0], np.cumsum(n_chunks)])[:-1]
    within = np.arange(n_chunks.sum()) - np.repeat(first_chunk, n_chunks)
    starts = doc_starts[doc_of_chunk] + within * seq_len
    ends = np.minimum(starts + seq_len + 1, doc_starts[doc_of_chunk + 1])
    return TokenizedCorpus(tokens=np.concatenate(pieces), doc_starts=doc_starts,
                           chunk_starts=starts, chunk_ends=ends)


def load_corpus(data_cfg: Any, tokenizer: Any, split: str, seq_len: int) -> TokenizedCorpus:
    """get_split_source + tokenize_source, with a log line of the corpus size and timing."""
    t0 = time.perf_counter()
    source = sources.get_split_source(data_cfg, split)
    if split == "train":  # config.data.select_scores / select_ratio: MASS's top-x% (data/mass.py)
        source = mass.select_source(source, data_cfg)
    corpus = tokenize_source(source, tokenizer, seq_len)
    logging.info("data %s: %d documents, %d tokens, %d chunks of <= %d (%.2fs)", source,
                 corpus.num_documents, len(corpus.tokens), corpus.num_chunks, seq_len + 1,
                 time.perf_counter() - t0)
    return corpus


def _rename(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"inputs": row["inputs"].astype(np.int32),
            "targets": row["targets"].astype(np.int32),
            "segment_ids": row["inputs_segment_ids"].astype(np.int32),
            "positions": row["inputs_positions"].astype(np.int32)}


def _pack(ds: grain.IterDataset, seq_len: int, num_bins: int, seed: int,
          shuffle_bins: bool) -> grain.IterDataset:
    packed = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": seq_len, "targets": seq_len}, num_packing_bins=num_bins,
        seed=seed, shuffle_bins=shuffle_bins)
    return packed.map(_rename)


def _slice_rows(start: int, size: int):
    def fn(batch):
        return {k: v[start:start + size] for k, v in batch.items()}
    return fn


_READ = grain.ReadOptions(num_threads=1, prefetch_buffer_size=16)


def chunk_order(num_chunks: int, *, seed: int | None,
                num_epochs: int | None = None) -> grain.MapDataset:
    """Chunk indices: epoch e is a permutation of range(num_chunks) seeded by (seed, e)."""
    ds = grain.MapDataset.range(num_chunks)
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    return ds if num_epochs == 1 else ds.repeat(num_epochs)


def packed_dataset(corpus: TokenizedCorpus, *, seq_len: int, seed: int | None,
                   num_epochs: int | None = None, num_bins: int = 16) -> grain.IterDataset:
    """Rows of T packed pieces (dicts of [T] int32). ``seed=None``: corpus order, no shuffling.

    ``num_epochs=None`` repeats forever (each epoch a new permutation of the chunks).
    """
    ds = chunk_order(corpus.num_chunks, seed=seed, num_epochs=num_epochs)
    ds = ds.map(corpus.chunk).to_iter_dataset(_READ)
    return _pack(ds, seq_len, num_bins, seed or 0, shuffle_bins=seed is not None)


class StreamsIterator:
    """The global batch's rows from streams ``first .. first + len(iterators) - 1`` stacked, then
    rows ``[start, start + size)`` of that block kept. State: each stream's grain state by its
    global stream index, so states of processes holding different streams can be merged."""

    def __init__(self, iterators, first: int, start: int, size: int):
        self.iterators, self.first, self.start, self.size = list(iterators), first, start, size

    def __iter__(self):
        return self

    def __next__(self):
        parts = [next(it) for it in self.iterators]
        block = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        return _slice_rows(self.start, self.size)(block)

    def get_state(self) -> dict:
        return {"streams": {str(self.first + i): it.get_state()
                            for i, it in enumerate(self.iterators)}}

    def set_state(self, state: dict) -> None:
        streams = state.get("streams") if isinstance(state, dict) else None
        missing = [str(self.first + i) for i in range(len(self.iterators))
                   if streams is None or str(self.first + i) not in streams]
        if missing:
            raise ValueError(f"the saved data state has no position for stream(s) {missing}; it "
                             "was written with another config.data.streams (keep it the same "
                             "when resuming)")
        for i, it in enumerate(self.iterators):
            it.set_state(streams[str(self.first + i)])


def _stream_seed(seed: int, stream: int) -> int:
    return int(np.random.SeedSequence([int(seed), int(stream)]).generate_state(1)[0] >> 1)


def make_train_iterator(data_cfg: Any, tokenizer: Any, *, seq_len: int, global_batch_size: int,
                        seed: int, process_index: int | None = None,
                        process_count: int | None = None, streams: int = 1):
    """Endless iterator of training batches (see the module docstring for the contract).

    Args:
      data_cfg: ``config.data``.
      tokenizer: from ``build_tokenizer``.
      seq_len: T.
      global_batch_size: rows across all processes; must divide by process_count.
      seed: shuffling seed; equal seeds give identical batches.
      process_index, process_count: default to ``jax.process_index() / process_count()``.
      streams: S, independently packed streams (module docstring); must divide the batch size.

    Returns:
      an iterator of dicts of int32 [global_batch_size // process_count, T] with
      ``get_state()`` / ``set_state()``: a grain ``DatasetIterator`` when S = 1, else a
      ``StreamsIterator``.
    """
    _check_seq_len(seq_len)
    start, size = _process_slice(global_batch_size, process_index, process_count)
    streams = int(streams)
    if streams < 1 or global_batch_size % streams:
        raise ValueError(f"config.data.streams={streams} must be >= 1 and divide the global batch "
                         f"size {global_batch_size} (config.train.batch_size)")
    corpus = load_corpus(data_cfg, tokenizer, "train", seq_len)
    if streams == 1:
        ds = packed_dataset(corpus, seq_len=seq_len, seed=int(seed),
                            num_bins=max(16, global_batch_size))
        ds = ds.batch(global_batch_size, drop_remainder=True).map(_slice_rows(start, size))
        return iter(ds)
    rows = global_batch_size // streams
    # the streams holding this process's rows: all of them unless its slice is whole streams
    first, last = (start // rows, (start + size) // rows) if size % rows == 0 and start % rows == 0 \
        else (0, streams)
    iterators = []
    for i in range(first, last):
        ids = np.arange(i, corpus.num_chunks, streams)
        if len(ids) == 0:
            raise ValueError(f"config.data.streams={streams} exceeds the {corpus.num_chunks} "
                             "training chunks; lower it")
        order = grain.MapDataset.source(ids).shuffle(seed=_stream_seed(seed, i)).repeat(None)
        ds = order.map(corpus.chunk).to_iter_dataset(_READ)
        ds = _pack(ds, seq_len, max(16, rows), _stream_seed(seed, i), shuffle_bins=True)
        iterators.append(iter(ds.batch(rows, drop_remainder=True)))
    return StreamsIterator(iterators, first, start - first * rows, size)


def make_eval_batches(data_cfg: Any, tokenizer: Any, *, split: str = "validation", seq_len: int,
                      batch_size: int, max_batches: int | None = None,
                      process_index: int | None = None,
                      process_count: int | None = None) -> list[dict[str, np.ndarray]]:
    """Deterministic, unshuffled evaluation batches of ``split`` (same contract as training).

    ``batch_size`` is global (split across processes like training). Documents are read in the
    source's stored order, packed into rows, and batched; the last batch is completed with all-
    padding rows (segment_ids 0), so every batch has the same shape. ``max_batches`` (None or <= 0:
    all) caps the number of batches: that many batches evenly spaced over the whole split (so a
    capped evaluation still sees every part of it, not just its first document).
    """
    _check_seq_len(seq_len)
    start, size = _process_slice(batch_size, process_index, process_count)
    corpus = load_corpus(data_cfg, tokenizer, split, seq_len)
    rows = _packed_rows(corpus, seq_len, max(16, batch_size))
    n_batches = -(-len(rows["inputs"]) // batch_size)
    keep = range(n_batches)
    if max_batches and 0 < max_batches < n_batches:
        keep = np.unique(np.linspace(0, n_batches - 1, max_batches).round().astype(int))
    return [_slice_rows(start, size)(_batch(rows, int(i), batch_size, seq_len)) for i in keep]


def first_fit_rows(corpus: TokenizedCorpus, seq_len: int, num_bins: int) -> dict[str, np.ndarray]:
    """Every row of ``packed_dataset(corpus, seq_len=seq_len, seed=None, num_epochs=1,
    num_bins=num_bins)``, stacked ([R, T] int32 per feature), computed directly with numpy.

    The same first-fit packing as grain's ``FirstFitPackIterDataset`` without bin shuffling
    (tests/data/test_eval_packing.py compares the two): chunks in corpus order; each goes into the
    lowest-numbered of ``num_bins`` rows with room for it; a chunk that fits in none emits the
    batch's used rows in order and starts the next batch. Segment ids count 1, 2, ... within a
    row, positions restart at 0 per piece, padding is 0. Evaluation packs whole splits, and
    grain's per-element iteration took seconds for a small one (make_eval_batches on
    the 16k-chunk Shakespeare validation split at seq_len 32: 11 s -> 0.4 s).
    """
    lengths = (corpus.chunk_ends - corpus.chunk_starts - 1).astype(np.int64)
    if lengths.size and (lengths.max() > seq_len or lengths.min() < 1):
        raise ValueError(f"chunks of 1..{seq_len} tokens expected (the corpus was chunked for "
                         "another seq_len)")
    row_of = np.empty(len(lengths), np.int64)  # global row of each chunk
    offset = np.empty(len(lengths), np.int64)  # its first cell in that row
    seg = np.empty(len(lengths), np.int32)     # its segment id there
    free = np.zeros(num_bins, np.int64)
    count = np.zeros(num_bins, np.int32)
    base = used = 0
    for i, n in enumerate(lengths.tolist()):
        fits = np.flatnonzero(free + n <= seq_len)
        if fits.size == 0:  # emit this batch's used rows; a new batch starts with this chunk
            base, used = base + used, 0
            free[:], count[:] = 0, 0
            r = 0
        else:
            r = int(fits[0])
        used = max(used, r + 1)
        row_of[i], offset[i] = base + r, free[r]
        count[r] += 1
        seg[i] = count[r]
        free[r] += n
    num_rows = base + used
    out = {k: np.zeros((num_rows, seq_len), np.int32) for k in FEATURES}
    if not len(lengths):
        return out
    # scatter every token of every chunk to (row, cell) in one vectorised step
    pieces = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows, cells = row_of[pieces], offset[pieces] + within
    src = corpus.chunk_starts[pieces] + within
    out["inputs"][rows, cells] = corpus.tokens[src]
    out["targets"][rows, cells] = corpus.tokens[src + 1]
    out["segment_ids"][rows, cells] = seg[pieces]
    out["positions"][rows, cells] = within
    return out


# The unshuffled packing of a whole split, memoised per process: evaluation packs every row of a
# split to choose its evenly spaced batches, and a process often asks again for the same split
# (each model of an experiment, a resumed run). Keyed by the chunks' contents.
_PACKED_ROWS: collections.OrderedDict = collections.OrderedDict()
_PACKED_ROWS_MAX = 4


def _packed_rows(corpus: TokenizedCorpus, seq_len: int, num_bins: int) -> dict[str, np.ndarray]:
    digest = hashlib.sha1()
    for a in (corpus.tokens, corpus.chunk_starts, corpus.chunk_ends):
        digest.update(np.ascontiguousarray(a).tobytes())
    key = (digest.hexdigest(), int(seq_len), int(num_bins))
    if key not in _PACKED_ROWS:
        _PACKED_ROWS[key] = first_fit_rows(corpus, seq_len, num_bins)
        while len(_PACKED_ROWS) > _PACKED_ROWS_MAX:
            _PACKED_ROWS.popitem(last=False)
    _PACKED_ROWS.move_to_end(key)
    return _PACKED_ROWS[key]


def _batch(rows: dict[str, np.ndarray], i: int, batch_size: int, seq_len: int):
    """Batch ``i`` of the packed rows (a fresh copy), completed with all-padding rows."""
    out = {k: np.zeros((batch_size, seq_len), np.int32) for k in FEATURES}
    for k in FEATURES:
        part = rows[k][i * batch_size:(i + 1) * batch_size]
        out[k][:len(part)] = part
    return out


def describe(data_cfg: Any, tokenizer: Any, seq_len: int) -> dict[str, dict[str, int]]:
    """Corpus statistics per split: documents, tokens, chunks, utf-8 bytes per token."""
    stats = {}
    for split in sources.SPLITS:
        try:
            source = sources.get_split_source(data_cfg, split)
        except ValueError:
            continue  # e.g. a tiny corpus without a test split
        corpus = tokenize_source(source, tokenizer, seq_len)
        n_bytes = sum(len(source[i]["text"].encode("utf-8")) for i in range(len(source)))
        stats[split] = {"documents": corpus.num_documents, "tokens": int(len(corpus.tokens)),
                        "chunks": corpus.num_chunks,
                        "bytes_per_token": round(n_bytes / max(1, len(corpus.tokens)), 3)}
    return stats
