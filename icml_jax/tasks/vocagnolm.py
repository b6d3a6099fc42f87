"""``vocagnolm``: continual LM training with teacher-guided token selection across vocabularies
(VocAgnoLM, Shin et al., ICML 2025; ``docs/methods/vocagnolm.md``), and the arms it is compared with.

Data: ``config.data.path`` (and ``eval_path``; "" = the first ``eval_batches * batch_size``
training rows), JSONL with the text under ``config.data.text_key``. Each document is one row of
``config.data.seq_len`` student tokens (bos + text, targets text + eos; longer documents are cut).
Everything the loss needs is made once, on the host, when the task is built, and travels in the
batches as fixed-shape arrays (``pairs.RowsTask``: ``pair_train_iterator``, exact resume):

  inputs, targets, positions, segment_ids   int32 [B, T] (a row per document)
  teacher_loss   float32 [B, M]    the frozen teacher's per-token loss, indexed by its target token
  voc_index      int32 [B, T, P]   each student target's window of teacher positions (P = span_pad)
  voc_window     bool [B, T, P]    which of them lie in its aligned range
  voc_mapped     bool [B, T]       whether the student target overlaps any teacher token
  voc_truncated  bool [B, T]       mapped targets whose range is longer than P (cut to P)

The teacher is another training workdir (``config.loss.voc_teacher``): its model config and
tokenizer come from its ``config.json`` (``voc_teacher_tokenizer`` overrides the tokenizer: a
SentencePiece ``.model`` path or "byte"), its newest params through ``context.restore_params``.
It scores every row once in a jitted batched pass; the losses are kept in
``TEACHER/teacher_losses/<fingerprint>.npz`` and reused by later runs over the same rows.

``config.loss.voc_mode``:
  guided        VocAgnoLM: the two tokenizations aligned by character offsets (``data.alignment``),
                ``losses.vocagnolm.guided_loss`` with voc_k_ratio / voc_agg / voc_include_unmapped /
                voc_select_scope / voc_span_pad
  rho1          Rho-1 with a teacher that shares the student's tokenizer: the identity alignment
                (every valid target, EOS included, maps to the teacher's same position)
  ce            every valid token (plain mean CE; no teacher)
  random        a random voc_k_ratio of the valid tokens (drawn on device with a key folded from
                ``config.seed`` and a checksum of the batch's tokens: a new draw every step, the same
                one on a resumed run)
  student_topk  the voc_k_ratio of the valid tokens with the highest student loss (no teacher)

The loss is the student's mean NLL over the selected tokens (the count is the selected tokens);
metrics: ``selected_share`` (selected / valid tokens), ``truncated_share`` (of the mapped tokens),
``unmapped_share``, ``ce_all`` (mean NLL over every valid token) and ``accuracy`` (all valid
tokens). With ``grad_accum`` > 1 the batch-scope selection is per micro-batch.
"""
from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from icml_jax.config_utils import complete_config
from icml_jax.data import alignment
from icml_jax.data.tokenizers import build_tokenizer
from icml_jax.losses.logps import token_logprobs
from icml_jax.losses.vocagnolm import AGGREGATIONS, selection_weights
from icml_jax.models import build_model
from icml_jax.tasks import TASKS
from icml_jax.tasks.pairs import RowsTask, _code_digest, _read_cache, _write_cache, batched_apply

MODES = ("guided", "rho1", "ce", "random", "student_topk")
TEACHER_MODES = ("guided", "rho1")
LOSS_KEYS = ("voc_mode", "voc_teacher", "voc_teacher_tokenizer", "voc_teacher_seq_len", "voc_k_ratio", "voc_agg",
             "voc_include_unmapped", "voc_select_scope", "voc_span_pad")  # configs/vocagnolm.py's LOSS


def check_loss_config(L) -> None:
    """One-line ValueErrors naming the ``config.loss`` key, before anything is computed."""
    missing = [k for k in LOSS_KEYS if k not in L]
    if missing:
        raise ValueError(f"config.loss lacks {missing}: use configs/vocagnolm.py (its LOSS section)")
    if L.voc_mode not in MODES:
        raise ValueError(f"config.loss.voc_mode={L.voc_mode!r}; choose one of {list(MODES)}")
    if not isinstance(L.voc_k_ratio, (int, float)) or not 0 < L.voc_k_ratio <= 1:
        raise ValueError(f"config.loss.voc_k_ratio={L.voc_k_ratio!r} must be in (0, 1]")
    if L.voc_agg not in AGGREGATIONS:
        raise ValueError(f"config.loss.voc_agg={L.voc_agg!r}; choose one of {list(AGGREGATIONS)}")
    if L.voc_select_scope not in ("batch", "sequence"):
        raise ValueError(f"config.loss.voc_select_scope={L.voc_select_scope!r}; choose 'batch' or 'sequence'")
    if not isinstance(L.voc_include_unmapped, bool):
        raise ValueError(f"config.loss.voc_include_unmapped={L.voc_include_unmapped!r} must be True or False")
    if not isinstance(L.voc_span_pad, int) or L.voc_span_pad < 1:
        raise ValueError(f"config.loss.voc_span_pad={L.voc_span_pad!r} must be a positive integer")
    if not isinstance(L.voc_teacher_seq_len, int) or L.voc_teacher_seq_len < 0:
        raise ValueError(f"config.loss.voc_teacher_seq_len={L.voc_teacher_seq_len!r} must be >= 0 "
                         "(0 = config.data.seq_len)")
    if L.voc_mode in TEACHER_MODES and not L.voc_teacher:
        raise ValueError(f"config.loss.voc_mode={L.voc_mode!r} needs config.loss.voc_teacher (the teacher's "
                         "training workdir)")


def read_texts(path: str, key: str = "text") -> list[str]:
    """The ``key`` field of every line of a JSONL file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get(key), str):
                    raise ValueError(f"{path}:{n}: no string field {key!r} (config.data.text_key)")
                out.append(row[key])
    return out


def encode_rows(tokenizer, texts, seq_len: int):
    """(arrays, target spans, cut): one row per text, ``inputs`` = bos + tokens, ``targets`` =
    tokens + eos, cut to ``seq_len``; int32 [N, T] ``inputs``, ``targets``, ``positions``,
    ``segment_ids``; per row the character spans [n, 2] of its kept targets (EOS: the empty span
    at the text's end); the number of texts that were cut."""
    N = len(texts)
    a = {k: np.zeros((N, seq_len), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
    spans, cut = [], 0
    for r, text in enumerate(texts):
        ids, sp = tokenizer.encode_with_spans(text)
        toks = np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int32)
        sp = np.concatenate([sp, [[len(text), len(text)]]])
        n = min(len(toks) - 1, seq_len)
        cut += n < len(toks) - 1
        a["inputs"][r, :n], a["targets"][r, :n] = toks[:n], toks[1:n + 1]
        a["positions"][r, :n], a["segment_ids"][r, :n] = np.arange(n), 1
        if n < seq_len:
            a["inputs"][r, n:] = a["targets"][r, n:] = tokenizer.pad_id
        spans.append(sp[:n])
    return a, spans, cut


def guided_arrays(student_spans, teacher_spans, seq_len: int, span_pad: int):
    """The alignment of every row as fixed-shape arrays: ``voc_index`` int32 [N, T, P],
    ``voc_window`` bool [N, T, P], ``voc_mapped`` and ``voc_truncated`` bool [N, T]. Row r's student
    targets are aligned with its teacher targets (``alignment.align``); the teacher's EOS (an
    empty span at the end) overlaps nothing, so it is never in a range."""
    N, P = len(student_spans), span_pad
    out = dict(voc_index=np.zeros((N, seq_len, P), np.int32), voc_window=np.zeros((N, seq_len, P), bool),
               voc_mapped=np.zeros((N, seq_len), bool), voc_truncated=np.zeros((N, seq_len), bool))
    for r, (s, t) in enumerate(zip(student_spans, teacher_spans)):
        start, end, mapped = alignment.align(s, t)
        idx, win, _ = alignment.windows(start, end, mapped, P)
        n = len(s)
        out["voc_index"][r, :n], out["voc_window"][r, :n], out["voc_mapped"][r, :n] = idx, win, mapped
        out["voc_truncated"][r, :n] = mapped & (end - start + 1 > P)
    return out


def identity_arrays(segment_ids, span_pad: int):
    """Rho-1's alignment when the teacher reads the student's own tokens: target t maps to the
    teacher's target t alone (every valid target, EOS included)."""
    N, T = segment_ids.shape
    valid = segment_ids > 0
    idx = np.broadcast_to(np.arange(T)[:, None] + np.arange(span_pad), (N, T, span_pad))
    win = np.zeros((N, T, span_pad), bool)
    win[..., 0] = valid
    return dict(voc_index=idx.astype(np.int32), voc_window=win, voc_mapped=valid.copy(),
                voc_truncated=np.zeros((N, T), bool))


def read_teacher_config(workdir: str, key: str = "config.loss.voc_teacher") -> ml_collections.ConfigDict:
    """The teacher run's saved config (``WORKDIR/config.json``, completed with newer keys); the
    one-line error names ``key``, the config key that gave ``workdir``."""
    path = os.path.join(workdir, "config.json")
    try:
        with open(path) as f:
            return ml_collections.ConfigDict(complete_config(json.load(f)))
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={workdir!r}: cannot read its config.json ({e}); "
                         "point it at a finished training workdir") from e


def frozen_run_section(config, section: str, key: str, what: str) -> ml_collections.ConfigDict:
    """``config.<section>`` of a task that reads another training run, after one-line checks that
    the section exists and that ``config.<section>.<key>`` (``what``: whose workdir) is set."""
    s = config.get(section)
    if s is None:
        raise ValueError(f"config.task={config.task!r} needs a config.{section} section: use "
                         f"configs/{config.task}.py")
    if not str(s.get(key, "") or "").strip():
        raise ValueError(f"config.{section}.{key} is empty: set it to {what} training workdir "
                         "(a folder with its config.json and checkpoints/)")
    return s


def restore_run_params(context, workdir: str, model_cfg, key: str):
    """``context.restore_params(workdir, model_cfg)`` with its one-line errors prefixed by
    ``key=workdir`` (the config key that gave the workdir)."""
    if context.restore_params is None:
        raise ValueError(f"{key}={workdir!r}: reading another run's params needs "
                         "tasks.TaskContext(restore_params=...) (train_and_evaluate passes it)")
    try:
        return context.restore_params(workdir, model_cfg)
    except ValueError as e:
        raise ValueError(f"{key}={workdir!r}: {e}") from e


def teacher_loss_fn(model):
    """A jitted (params, rows) -> per-token NLL [N, M] of ``model`` (0 at padding)."""
    def f(p, b):
        logits = model.apply({"params": p}, b["inputs"], b["positions"], b["segment_ids"])
        return -token_logprobs(logits, b["targets"]) * (b["segment_ids"] > 0)
    return jax.jit(f)


def _fingerprint(params, rows: dict, model_cfg, batch: int) -> str:
    h = hashlib.sha256(json.dumps({
        "model": json.loads(model_cfg.to_json_best_effort()), "batch": batch, "code": _code_digest(),
        "jax": jax.__version__, "backend": jax.default_backend()}, sort_keys=True).encode())
    for leaf in jax.tree.leaves(params):
        x = np.asarray(jax.device_get(leaf))
        h.update(f"{x.dtype}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    for name in sorted(rows):
        for k in sorted(rows[name]):
            h.update(f"{name}/{k}{rows[name][k].shape}".encode())
            h.update(np.ascontiguousarray(rows[name][k]).tobytes())
    return h.hexdigest()[:32]


@TASKS.register("vocagnolm")
class VocAgnoLMTask(RowsTask):
    """Student rows with (for ``guided`` / ``rho1``) the teacher's cached losses and the alignment."""

    def __init__(self, config: ml_collections.ConfigDict, context=None):
        L = config.get("loss")
        if L is None:
            raise ValueError("config.task='vocagnolm' needs a config.loss section: use configs/vocagnolm.py")
        check_loss_config(L)
        d = config.data
        if d.name != "jsonl" or not d.path:
            raise ValueError(f"config.task='vocagnolm' reads a JSONL file of documents: set config.data.name="
                             f"'jsonl' (got {d.name!r}) and config.data.path")
        super().__init__(config, context)
        self.mode = L.voc_mode
        self.reports_perplexity = self.mode == "ce"
        self.model = build_model(config.model)
        self.teacher_len = L.voc_teacher_seq_len or d.seq_len
        T, t = d.seq_len, config.train
        train_texts = read_texts(d.path, d.text_key)
        eval_texts = read_texts(d.eval_path, d.text_key) if d.eval_path else \
            train_texts[:t.eval_batches * t.batch_size]
        self.train_arrays, train_spans = self._student(train_texts, d.path)
        self.eval_arrays, eval_spans = self._student(eval_texts, d.eval_path or d.path)
        self.truncated_share = 0.0
        if self.mode in TEACHER_MODES:
            self._add_teacher({"train": (train_texts, train_spans), "eval": (eval_texts, eval_spans)})

    def _student(self, texts, path):
        arrays, spans, cut = encode_rows(self.tokenizer, texts, self.config.data.seq_len)
        if cut and jax.process_index() == 0:
            logging.warning("%s: %d of %d documents cut at config.data.seq_len=%d", path, cut, len(texts),
                            self.config.data.seq_len)
        return arrays, spans

    def _add_teacher(self, splits):
        L = self.config.loss
        if self.context.restore_params is None:
            raise ValueError(f"config.loss.voc_teacher={L.voc_teacher!r}: reading another run's params needs "
                             "tasks.TaskContext(restore_params=...) (train_and_evaluate passes it)")
        tcfg = read_teacher_config(L.voc_teacher)
        tok_cfg = tcfg.data.tokenizer
        if L.voc_teacher_tokenizer:
            kind = "byte" if L.voc_teacher_tokenizer == "byte" else "sentencepiece"
            tok_cfg = ml_collections.ConfigDict(dict(type=kind, model_path=L.voc_teacher_tokenizer))
        tok = build_tokenizer(tok_cfg)
        if tok.vocab_size > tcfg.model.vocab_size:
            raise ValueError(f"config.loss.voc_teacher_tokenizer: {tok.vocab_size} tokens, more than the teacher "
                             f"model's vocab_size {tcfg.model.vocab_size}")
        if self.teacher_len > tcfg.model.max_seq_len:
            raise ValueError(f"config.loss.voc_teacher_seq_len={self.teacher_len} is above the teacher's "
                             f"max_seq_len {tcfg.model.max_seq_len}")
        if self.mode == "rho1":
            same = (type(tok) is type(self.tokenizer)
                    and getattr(tok, "model_path", "") == getattr(self.tokenizer, "model_path", ""))
            if not same or self.teacher_len != self.config.data.seq_len:
                raise ValueError(f"config.loss.voc_mode='rho1' needs a teacher with the student's tokenizer and "
                                 f"config.loss.voc_teacher_seq_len 0 (got {tok!r} for {self.tokenizer!r})")
        rows, spans = {}, {}
        for name, (texts, _) in splits.items():
            if self.mode == "rho1":
                rows[name] = {k: self.arrays(name)[k] for k in ("inputs", "targets", "positions", "segment_ids")}
            else:
                rows[name], spans[name], cut = encode_rows(tok, texts, self.teacher_len)
                if cut and jax.process_index() == 0:
                    logging.warning("%d of %d %s documents cut at the teacher's %d tokens (config.loss."
                                    "voc_teacher_seq_len): their later student tokens are unmapped",
                                    cut, len(texts), name, self.teacher_len)
        losses = self._teacher_losses(L.voc_teacher, tcfg.model, rows)
        mapped = total = 0
        for name, (_, student_spans) in splits.items():
            arrays = self.arrays(name)
            arrays["teacher_loss"] = losses[name]
            if self.mode == "rho1":
                arrays.update(identity_arrays(arrays["segment_ids"], L.voc_span_pad))
            else:
                arrays.update(guided_arrays(student_spans, spans[name], self.config.data.seq_len, L.voc_span_pad))
            if name == "train":
                mapped, total = arrays["voc_mapped"].sum(), arrays["voc_truncated"].sum()
        self.truncated_share = float(total / max(mapped, 1))
        if jax.process_index() == 0:
            logging.info("vocagnolm: teacher %s, %.1f%% of the mapped training targets span more than "
                         "config.loss.voc_span_pad=%d teacher tokens (truncated)", L.voc_teacher,
                         100 * self.truncated_share, L.voc_span_pad)

    def arrays(self, name):
        return self.train_arrays if name == "train" else self.eval_arrays

    def _teacher_losses(self, workdir, model_cfg, rows):
        """{split: float32 [N, M]}: the teacher's per-token NLL of every row, read from or kept in
        ``workdir/teacher_losses/<fingerprint>.npz``."""
        try:
            params = self.context.restore_params(workdir, model_cfg)
        except ValueError as e:
            raise ValueError(f"config.loss.voc_teacher={workdir!r}: {e}") from e
        batch = 2 * self.config.train.batch_size
        path = os.path.join(workdir, "teacher_losses", _fingerprint(params, rows, model_cfg, batch) + ".npz")
        shapes = {n: r["inputs"].shape for n, r in rows.items()}
        out = _read_cache(path, shapes)
        if out is None:
            fn = teacher_loss_fn(build_model(model_cfg))
            out = {n: batched_apply(lambda b: fn(params, b), r, batch) for n, r in rows.items()}
            if jax.process_index() == 0:
                _write_cache(path, out)
            logging.info("vocagnolm: teacher losses computed, kept in %s", path)
        else:
            logging.info("vocagnolm: teacher losses read from %s", path)
        return out

    # ------------------------------------------------------------------ the contract

    def dummy_batch(self, batch_size: int, seq_len: int):
        z = jnp.zeros((batch_size, seq_len), jnp.int32)
        out = dict(inputs=z, targets=z, segment_ids=z + 1, positions=z, weight=jnp.ones((batch_size,), jnp.float32))
        if self.mode in TEACHER_MODES:
            P = self.config.loss.voc_span_pad
            out.update(teacher_loss=jnp.zeros((batch_size, self.teacher_len), jnp.float32),
                       voc_index=jnp.zeros((batch_size, seq_len, P), jnp.int32),
                       voc_window=jnp.zeros((batch_size, seq_len, P), bool),
                       voc_mapped=jnp.zeros((batch_size, seq_len), bool),
                       voc_truncated=jnp.zeros((batch_size, seq_len), bool))
        return out

    def init_params(self, rng, batch):
        return self.model.init(rng, batch["inputs"], batch["positions"], batch["segment_ids"])["params"]

    def token_nll(self, params, batch):
        """The student's per-token NLL [B, T] of the targets."""
        logits = self.model.apply({"params": params}, batch["inputs"], batch["positions"], batch["segment_ids"])
        return -token_logprobs(logits, batch["targets"]), logits

    def weights(self, nll, batch):
        """(selection weights [B, T] float32, valid [B, T] bool, mapped [B, T] bool) of the mode."""
        L = self.config.loss
        valid = (batch["segment_ids"] > 0) & (batch["weight"][:, None] > 0)
        kw = dict(k_ratio=L.voc_k_ratio, scope=L.voc_select_scope)
        if self.mode in TEACHER_MODES:
            mapped = batch["voc_mapped"]
            w, _ = selection_weights(nll, batch["teacher_loss"], batch["voc_index"], batch["voc_window"], mapped,
                                     valid, agg=L.voc_agg, include_unmapped=L.voc_include_unmapped, **kw)
            return w, valid, mapped
        if self.mode == "ce":
            return valid.astype(jnp.float32), valid, valid
        B, T = nll.shape
        score = jax.lax.stop_gradient(nll)
        if self.mode == "random":
            score = jax.random.uniform(jax.random.fold_in(jax.random.key(self.config.seed), batch_checksum(batch)),
                                       (B, T))
        none = jnp.zeros((B, T, 1), bool)
        w, _ = selection_weights(score, jnp.zeros((B, 1)), none.astype(jnp.int32), none, valid, valid,
                                 include_unmapped=False, **kw)
        return w, valid, valid

    def loss(self, params, batch):
        nll, logits = self.token_nll(params, batch)
        w, valid, mapped = self.weights(nll, batch)
        vf = valid.astype(jnp.float32)
        n_valid = jnp.maximum(vf.sum(), 1.0)
        n = w.sum()
        mv = (mapped & valid).astype(jnp.float32)
        trunc = batch["voc_truncated"] if "voc_truncated" in batch else jnp.zeros_like(valid)
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32) * vf
        means = {"selected_share": n / n_valid, "ce_all": (nll * vf).sum() / n_valid,
                 "accuracy": correct.sum() / n_valid, "unmapped_share": (vf - mv).sum() / n_valid,
                 "truncated_share": (trunc * mv).sum() / jnp.maximum(mv.sum(), 1.0)}
        return (w * nll).sum(), n, {k: v * n for k, v in means.items()}


def batch_checksum(batch):
    """A uint32 checksum of a batch's token ids (the random arm's per-step key)."""
    x = batch["targets"].astype(jnp.uint32)
    mult = (jnp.arange(x.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)).reshape(x.shape)
    return jnp.sum(x * mult, dtype=jnp.uint32)
