"""What the tasks over tokenised examples share (``reward_model``, ``preference``: pairs;
``implicit_prm``: labelled single responses): data loading, batch shapes, frozen-model caches.

Batches follow ``icml_jax/data/preference.py``: ``inputs``, ``segment_ids``, ``positions``,
``response_mask`` int32 [B, 2, T] (index 0 chosen, 1 rejected), ``lengths`` int32 [B, 2],
``weight`` float32 [B] (0 for eval padding rows), plus whatever per-token arrays a task caches
beside them (float32 [B, 2, T]). A task's loss is a mean over pairs, so its loss sum is
mean * sum(weight) and its count is sum(weight): the trainer's token-weighted mean then averages
the (micro-)batches' means, as a PyTorch trainer does with gradient accumulation.
"""
import hashlib
import json
import os
import zipfile

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from icml_jax.atomic import atomic_path
from icml_jax.config_utils import mesh_shape
from icml_jax.data import preference as pref_data
from icml_jax.losses import response_token_logps
from icml_jax.tasks.base import Task


def flat(x):
    """[B, 2, ...] -> [2B, ...] (chosen and rejected rows interleaved)."""
    return x.reshape((-1,) + x.shape[2:])


def as_sums(loss, metrics, w_B):
    """(mean loss, mean metrics) -> the trainer's (loss sum, count, metric sums)."""
    n = jnp.sum(w_B)
    return loss * n, n, {k: v * n for k, v in metrics.items()}


def response_logps_fn(model):
    """One jitted ``(params, batch) -> per-token log-probs`` of ``model`` on example rows
    (``inputs``, ``positions``, ``segment_ids``, ``response_mask`` [N, T]; float32 [N, T], 0
    outside the responses). Under an outer jit (the train step) it is inlined."""
    return jax.jit(lambda p, b: response_token_logps(
        model.apply({"params": p}, b["inputs"], b["positions"], b["segment_ids"]),
        b["inputs"], b["response_mask"]))


class RowsTask(Task):
    """A task whose data are fixed-shape example rows, dicts of arrays ``self.train_arrays`` and
    ``self.eval_arrays`` with a common leading axis, fed by ``pair_train_iterator`` (shuffled,
    exact resume) and ``eval_batches`` (in order, padding rows of weight 0)."""

    train_arrays: dict
    eval_arrays: dict

    def train_iterator(self, seed: int, shard=None):
        """``shard`` = (index, count) as in ``LMTask.train_iterator``."""
        index, count = shard if shard is not None else (None, None)
        return pref_data.pair_train_iterator(self.train_arrays, self.config.train.batch_size, seed,
                                             process_index=index, process_count=count)

    def eval_batches(self, split: str = "validation", shard=None):
        t = self.config.train
        index, count = shard if shard is not None else (None, None)
        return pref_data.eval_batches(self.eval_arrays, t.batch_size, max_batches=t.eval_batches,
                                      process_index=index, process_count=count)


class PairTask(RowsTask):
    """Reads ``config.data.path`` (training pairs) and ``config.data.eval_path`` (validation
    pairs; "" = the first ``eval_batches * batch_size`` training pairs) once, tokenised."""

    loss_unit = "pairs"
    reports_perplexity = False
    data_format = "prompt/chosen/rejected per line"

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        super().__init__(config, context)
        self._token_logps = None  # built at first use, once self.model exists
        d, t = config.data, config.train
        if d.name != "preference_jsonl" or not d.path:
            raise ValueError(
                f"config.task={config.task!r} reads a JSONL data file: set "
                f"config.data.name='preference_jsonl' (got {d.name!r}) and config.data.path to a "
                f"TRL-format JSONL file ({self.data_format})")
        self.tokens_per_unit = 2 * d.seq_len
        if self.context.num_shards is None:
            shape = mesh_shape(config.mesh, jax.device_count())
            self.num_shards = shape[0] * shape[1]  # devices holding distinct batch rows
        else:
            self.num_shards = int(self.context.num_shards)
        if config.get("loss", {}).get("bsr_num_shards", 0):  # emulate another run's layout
            self.num_shards = int(config.loss.bsr_num_shards)
        self.train_arrays, stats = self.load(d.path)
        if d.eval_path:
            self.eval_arrays, _ = self.load(d.eval_path)
        else:
            k = t.eval_batches * t.batch_size
            self.eval_arrays = {key: v[:k] for key, v in self.train_arrays.items()}
        if jax.process_index() == 0 and (stats["truncated_prompt"] or stats["truncated_response"]):
            logging.warning("%s: %d examples, %d with a truncated prompt and %d with a truncated "
                            "response at config.data.seq_len=%d", d.path, stats["n"],
                            stats["truncated_prompt"], stats["truncated_response"], d.seq_len)
        self.cached = []

    example_shape = (2,)  # per-example leading axes of the token arrays: a (chosen, rejected) pair

    def load(self, path: str):
        """(arrays, stats) of a data file; pairs from TRL's preference JSONL."""
        d = self.config.data
        return pref_data.encode_pairs(pref_data.read_preference_jsonl(path), self.tokenizer,
                                      d.seq_len, max_prompt_len=d.max_prompt_len, add_eos=d.add_eos)

    def dummy_batch(self, batch_size: int, seq_len: int):
        lead = (batch_size,) + self.example_shape
        z = jnp.zeros(lead + (seq_len,), jnp.int32)
        return dict(inputs=z, segment_ids=z + 1, positions=z, response_mask=z,
                    lengths=jnp.ones(lead, jnp.int32), weight=jnp.ones((batch_size,), jnp.float32),
                    **self.extra_dummies(batch_size),
                    **{k: z.astype(jnp.float32) for k in self.cached})

    def extra_dummies(self, batch_size: int):
        """Stand-ins for per-example arrays the task's data adds (e.g. labels)."""
        return {}

    def token_logps(self, params, batch):
        """Per-token response log-probs of ``self.model`` on example rows [N, T]: one jitted
        function per task, shared by the loss and the frozen-model caches (one compile)."""
        if self._token_logps is None:
            self._token_logps = response_logps_fn(self.model)
        return self._token_logps(params, batch)

    def cache_frozen_logps(self, key: str, workdir: str, where: str):
        """Adds ``key``: the per-token log-probs (float32, aligned with ``inputs``) of every train
        and eval example under the frozen decoder ``self.model`` (the same architecture) whose
        params are ``workdir``'s newest checkpoint. The params are dropped afterwards: only the arrays stay.

        The arrays are also kept on disk, in ``WORKDIR/frozen_logps/<fingerprint>.npz`` of the
        frozen run, and reused by every later run that asks for the same ones (a DPO and a TGDPO
        run from one SFT reference compute them once). The fingerprint covers what they depend
        on: the params' bytes, the token / position / segment / response-mask arrays (so the
        dataset, tokenizer and truncation), the model config, the scoring batch, the source of
        ``models/`` and ``losses/logps.py``, and the JAX version, backend and device kind; not the
        process count, so runs of any process count share a file.

        In a multi-process run each process holds the whole frozen params on its first device
        (``restore_params``) and scores only its share of the rows (``_score_shares``), the
        same batches a single process would score; the shares are then gathered, so every
        process ends with all the arrays (its slices of a global batch may be any rows). The
        processes first compare their fingerprints (they must have read the same data,
        checkpoint and code) and read the file only when every one of them can; process 0 alone
        writes it. A folder that cannot be written is skipped with a warning; an INFO line says
        whether the arrays were read or computed, and how many rows this process scored."""
        if self.context.restore_params is None:
            raise ValueError(f"{where}={workdir!r}: reading another run's params needs "
                             "tasks.TaskContext(restore_params=...) (train_and_evaluate passes it)")
        try:
            params = self.context.restore_params(workdir, self.config.model)
        except ValueError as e:
            raise ValueError(f"{where}={workdir!r}: {e}") from e
        T, batch = self.config.data.seq_len, 2 * self.config.train.batch_size
        splits = {"train": self.train_arrays, "eval": self.eval_arrays}
        rows = {name: {k: arrays[k].reshape(-1, T) for k in _SCORED_KEYS}
                for name, arrays in splits.items()}
        fingerprint = _fingerprint(params, rows, self.config.model, batch)
        path = os.path.join(workdir, "frozen_logps", fingerprint + ".npz")
        cached = _read_cache(path, {n: splits[n]["inputs"].shape for n in splits})
        if jax.process_count() > 1 and not _everyone_can_read(fingerprint, cached is not None,
                                                              where, workdir):
            cached = None  # scoring is shared, so every process scores when any one must
        total = sum(len(r["inputs"]) for r in rows.values())
        if cached is not None:
            logging.info("frozen log-probs %s (%s=%s): read %s", key, where, workdir, path)
        else:
            scored, counts = _score_shares(lambda b: self.token_logps(params, b), rows, batch)
            cached = {name: scored[name].reshape(splits[name]["inputs"].shape) for name in splits}
            if jax.process_index() == 0:
                _write_cache(path, cached)
            each = f" ({' + '.join(map(str, counts))} in {len(counts)} processes)" \
                if len(counts) > 1 else ""
            logging.info("frozen log-probs %s (%s=%s): computed %d of %d rows on this process%s; "
                         "kept in %s", key, where, workdir, counts[jax.process_index()], total,
                         each, path)
        for name, arrays in splits.items():
            arrays[key] = cached[name]
        self.cached.append(key)


_SCORED_KEYS = ("inputs", "positions", "segment_ids", "response_mask")


_CODE = ("models", os.path.join("losses", "logps.py"))  # what computes the log-probs


def _code_digest() -> str:
    """sha256 of the source that computes the log-probs (the model package and logps.py)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in _CODE:
        path = os.path.join(root, rel)
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py")) \
            if os.path.isdir(path) else [path]
        for f in files:
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _fingerprint(params, rows: dict, model_cfg, batch: int) -> str:
    """What the log-probs depend on: the params' bytes, the scored arrays, the model config, the
    scoring batch, the code and the platform (JAX version, backend, device kind)."""
    h = hashlib.sha256(json.dumps({
        "model": json.loads(model_cfg.to_json_best_effort()), "batch": batch, "code": _code_digest(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind}, sort_keys=True).encode())
    for leaf in jax.tree.leaves(params):
        x = np.asarray(jax.device_get(leaf))
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    for name in sorted(rows):
        for k in _SCORED_KEYS:
            h.update(f"{name}/{k}{rows[name][k].shape}".encode())
            h.update(np.ascontiguousarray(rows[name][k], np.int32).tobytes())
    return h.hexdigest()[:32]


def _everyone_can_read(fingerprint: str, readable: bool, where: str, workdir: str) -> bool:
    """Whether every process of a multi-process run read the cache file; raises ValueError when
    their fingerprints differ (they read other data, another checkpoint step or other code)."""
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    mine = np.frombuffer(bytes.fromhex(fingerprint) + bytes([readable]), np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
    prints = [bytes(r[:-1]).hex() for r in rows]
    if len(set(prints)) > 1:
        raise ValueError(
            f"{where}={workdir!r}: the processes disagree on what the frozen log-probs depend on "
            f"(fingerprints {prints}, in process order): every process must read the same data "
            "files and code, and the same checkpoint step of the frozen run")
    return bool(np.all(rows[:, -1]))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _score_shares(fn, rows: dict, batch: int) -> tuple[dict, list]:
    """``batched_apply(fn, ...)`` of every split of ``rows`` ({split: {key: [N, T]}}), the work
    shared by the processes: process p scores the p-th contiguous run of the batches a single
    process would score (so the results are the same), then every process gets all of them ->
    ({split: float32 [N, T]}, rows each process scored, in process order)."""
    count, index = jax.process_count(), jax.process_index()
    out, mine = {}, 0
    for name, r in rows.items():
        n = len(r["inputs"])
        share = _ceil(_ceil(n, batch), count) * batch  # rows per process: whole batches
        lo, hi = min(n, index * share), min(n, (index + 1) * share)
        part = {k: v[lo:hi] for k, v in r.items()}
        out[name] = batched_apply(fn, part, batch) if hi > lo else \
            np.zeros((0,) + r["inputs"].shape[1:], np.float32)
        mine += hi - lo
        if count > 1:  # equal shapes for the gather; the padding is cut off below
            out[name] = np.pad(out[name], ((0, share - (hi - lo)), (0, 0)))
    if count == 1:
        return out, [mine]
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    out["rows"] = np.asarray([mine], np.int32)
    got = multihost_utils.process_allgather(out, tiled=True)
    counts = [int(c) for c in np.asarray(got.pop("rows"))]
    return {name: np.asarray(got[name])[:len(rows[name]["inputs"])] for name in rows}, counts


def _read_cache(path, shapes: dict):
    """The cached arrays of ``path`` if it holds every split at its shape, else None."""
    if not os.path.exists(path):
        return None
    try:
        with np.load(path) as f:
            out = {n: np.asarray(f[n], np.float32) for n in shapes}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        logging.warning("ignoring the unreadable frozen log-prob cache %s (%s)", path, e)
        return None
    return out if all(out[n].shape == s for n, s in shapes.items()) else None


def _write_cache(path, arrays: dict) -> None:
    try:
        with atomic_path(path, suffix=".tmp.npz") as tmp:
            np.savez_compressed(tmp, **arrays)
    except OSError as e:
        logging.warning("could not keep the frozen log-probs in %s (%s); they are recomputed "
                        "next time", path, e)


def batched_apply(fn, arrays: dict, batch_size: int) -> np.ndarray:
    """``fn(batch) -> [b, ...]`` over the rows of ``arrays`` in fixed-size chunks (the last one
    padded with row 0, so ``fn`` compiles once); the results concatenated, float32 numpy."""
    n = len(next(iter(arrays.values())))
    out = []
    for s in range(0, n, batch_size):
        idx = np.arange(s, s + batch_size)
        idx[idx >= n] = 0
        out.append(np.asarray(jax.device_get(fn({k: v[idx] for k, v in arrays.items()}))))
    return np.concatenate(out)[:n].astype(np.float32)
