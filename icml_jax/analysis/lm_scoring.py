"""Batched, fixed-shape log-likelihood and generation for evaluation harnesses
(``python -m icml_jax.evaluate``, the lm-eval adapter ``icml_jax/lm_eval_adapter.py``).

``TextLM(model_cfg, params, tokenizer)`` answers the three request kinds of EleutherAI's harness:

* ``loglikelihood([(context, continuation), ...]) -> [(log p(continuation | context), is_greedy)]``.
  The pair is encoded the harness's way: the context's trailing spaces move to the continuation,
  the whole string is encoded and the continuation is the tokens after the context's own
  encoding (``prompt_ids``: BOS for our tokenizers, the HF template's specials otherwise).
  ``is_greedy``: every continuation token is the argmax of its slot.
* ``loglikelihood_rolling([text, ...]) -> [log p(text)]``: every token of ``text`` predicted once
  after the prefix (BOS), in windows of ``max_seq_len`` predictions; each window after the first
  keeps a full ``max_seq_len`` of context (the harness's rolling windows, disjoint targets).
* ``generate(contexts, max_new_tokens, until=..., temperature=0)``: KV-cache decoding
  (``inference/decode.generate``), the text cut at the first ``until`` string.

Shapes: rows go through one jitted scorer in batches of ``batch_size`` (short batches are padded
with zero-weight rows) and right-padded to a power-of-two length bucket (``min_bucket`` ... the
model's ``max_seq_len``), so a whole evaluation compiles at most log2(max_seq_len / min_bucket) + 1
scorer shapes. Rows are sorted by length so a batch's rows share a bucket. Contexts longer than
the model's window are cut from the left (``truncated`` counts them). When the params live on a
mesh (``load_hf`` puts them on all devices), each batch's rows are split over its ``data`` /
``fsdp`` axes (``batch_sharding``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.data.tokenizers import continuation_text, prompt_ids
from icml_jax.inference import decode
from icml_jax.losses.logps import token_logprobs
from icml_jax.models.decoder import build_model

Progress = Callable[[int], None] | None  # called with the number of rows just finished


def buckets(max_len: int, min_bucket: int = 32) -> list[int]:
    """Powers of two from ``min_bucket`` below ``max_len``, then ``max_len`` itself."""
    out, b = [], max(1, min_bucket)
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_for(n: int, sizes: Sequence[int]) -> int:
    for b in sizes:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens exceed the largest bucket {sizes[-1]}")


def rolling_windows(tokens: Sequence[int], prefix: int, max_len: int
                    ) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that predict each token of ``tokens`` exactly once after
    ``prefix``: windows of at most ``max_len`` predictions; the context of each is the tokens just
    before its continuation, so context + continuation has at most ``max_len`` + 1 tokens."""
    seq = [prefix] + list(tokens)
    out = []
    for s in range(1, len(seq), max_len):
        e = min(s + max_len, len(seq))
        out.append((seq[max(0, e - 1 - max_len):s], seq[s:e]))
    return out


def batch_sharding(params, batch_size: int):
    """Rows split over the params' mesh axes ``data`` and ``fsdp`` (``load_hf``'s default mesh puts
    every device on ``data``), or None: params on one device, or ``batch_size`` not a multiple of
    those axes' size (then every device computes every row)."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.size == 1:
        return None
    axes = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in axes)
    if not axes or batch_size % n:
        return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))


class TokenScorer:
    """Sum of log-probs and greediness of continuation tokens, in fixed-shape jitted batches."""

    def __init__(self, model_cfg, params, *, batch_size: int = 8, min_bucket: int = 32):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.max_len = int(model_cfg.max_seq_len)
        self.vocab = int(model_cfg.vocab_size)
        self.batch_size = batch_size
        self.sizes = buckets(self.max_len, min_bucket)
        self.params = params
        model = build_model(model_cfg)

        def score(p, inputs_BT, targets_BT, valid_BT, weights_BT):
            pos = jnp.broadcast_to(jnp.arange(inputs_BT.shape[1], dtype=jnp.int32), inputs_BT.shape)
            logits = model.apply({"params": p}, inputs_BT, pos, valid_BT)
            lp = token_logprobs(logits, targets_BT)
            greedy = (jnp.argmax(logits, -1) == targets_BT) | (weights_BT == 0)
            return (lp * weights_BT).sum(-1), greedy.all(-1)

        self._score = jax.jit(score)
        self.compiled_shapes: set[tuple[int, int]] = set()
        self.batch_sharding = batch_sharding(params, batch_size)

    def check(self, context: Sequence[int], continuation: Sequence[int]) -> None:
        if not continuation:
            raise ValueError("an empty continuation has nothing to score")
        if len(continuation) > self.max_len:
            raise ValueError(f"a continuation of {len(continuation)} tokens exceeds the model's "
                             f"max_seq_len={self.max_len}")
        if not context:
            raise ValueError("the context must hold at least one token (e.g. BOS)")
        bad = [t for t in list(context) + list(continuation) if not 0 <= int(t) < self.vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the model's vocab [0, {self.vocab})")

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
              progress: Progress = None) -> tuple[list[tuple[float, bool]], int]:
        """([(sum log p(continuation | context), is_greedy)] in input order, the number of pairs
        whose context was cut from the left to fit ``max_seq_len``)."""
        rows, truncated = [], 0
        for ctx, cont in pairs:
            self.check(ctx, cont)
            full = list(ctx) + list(cont)
            if len(full) - 1 > self.max_len:
                full, truncated = full[-(self.max_len + 1):], truncated + 1
            rows.append((full, len(cont)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        B = self.batch_size
        for lo in range(0, len(order), B):
            idx = order[lo:lo + B]
            T = bucket_for(max(len(rows[i][0]) - 1 for i in idx), self.sizes)
            inputs, targets = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
            valid, weights = np.zeros((B, T), np.int32), np.zeros((B, T), np.float32)
            for r, i in enumerate(idx):
                full, n_cont = rows[i]
                n = len(full) - 1
                inputs[r, :n], targets[r, :n], valid[r, :n] = full[:-1], full[1:], 1
                weights[r, n - n_cont:n] = 1.0
            self.compiled_shapes.add((B, T))
            arrays = (inputs, targets, valid, weights)
            if self.batch_sharding is not None:
                arrays = jax.device_put(arrays, self.batch_sharding)
            lp, greedy = self._score(self.params, *arrays)
            lp, greedy = np.asarray(lp, np.float64), np.asarray(greedy)
            for r, i in enumerate(idx):
                out[i] = (float(lp[r]), bool(greedy[r]))
            if progress is not None:
                progress(len(idx))
        return out, truncated


class TextLM:
    """Strings in, log-likelihoods and generations out (module docstring)."""

    def __init__(self, model_cfg, params, tokenizer, *, batch_size: int = 8, min_bucket: int = 32,
                 seed: int = 0):
        self.model_cfg, self.params, self.tok = model_cfg, params, tokenizer
        self.scorer = TokenScorer(model_cfg, params, batch_size=batch_size, min_bucket=min_bucket)
        self.stops = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
        self.seed = seed
        self.truncated = 0  # contexts cut from the left so far

    @property
    def max_len(self) -> int:
        return self.scorer.max_len

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        ctx = prompt_ids(self.tok, context)
        whole = prompt_ids(self.tok, context + continuation)
        cont = whole[len(ctx):] if whole[:len(ctx)] == ctx else self.tok.encode(continuation)
        if not ctx:  # an empty context under a template that adds nothing: BOS as the context
            ctx = [self.tok.bos_id]
        return ctx, cont

    def loglikelihood(self, pairs: Sequence[tuple[str, str]],
                      progress: Progress = None) -> list[tuple[float, bool]]:
        out, cut = self.scorer.score([self.encode_pair(c, x) for c, x in pairs], progress)
        self.truncated += cut
        return out

    def loglikelihood_rolling(self, texts: Sequence[str], progress: Progress = None) -> list[float]:
        windows, owner = [], []
        for i, text in enumerate(texts):
            for w in rolling_windows(self.tok.encode(text), self.tok.bos_id, self.max_len):
                windows.append(w)
                owner.append(i)
        scores, _ = self.scorer.score(windows)
        total = [0.0] * len(texts)
        for i, (lp, _) in zip(owner, scores):
            total[i] += lp
        if progress is not None:
            progress(len(texts))
        return total

    def generate(self, contexts: Sequence[str], max_new_tokens: int, *,
                 until: Sequence[str] = (), temperature: float = 0.0,
                 progress: Progress = None) -> list[str]:
        """Continuations of ``contexts`` (without the context), each cut before the first of
        ``until``; contexts longer than ``max_seq_len - max_new_tokens`` tokens lose their start.
        Rows are decoded ``batch_size`` at a time, shortest first (a short batch is filled with
        copies of its first row), so batches share prompt buckets."""
        N = min(int(max_new_tokens), self.max_len - 1)
        if N < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        keep = self.max_len - N
        encoded = []
        for c in contexts:
            ids = prompt_ids(self.tok, c) or [self.tok.bos_id]
            if len(ids) > keep:
                ids, self.truncated = ids[-keep:], self.truncated + 1
            encoded.append(ids)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        out = [""] * len(encoded)
        B = self.scorer.batch_size
        for b, lo in enumerate(range(0, len(order), B)):
            idx = order[lo:lo + B]
            rows = [encoded[i] for i in idx]
            rows += [rows[0]] * (B - len(rows))
            res = decode.generate(self.model_cfg, self.params, rows,
                                  key=jax.random.fold_in(jax.random.key(self.seed), b),
                                  max_new_tokens=N, temperature=temperature, stop_tokens=self.stops,
                                  pad_id=self.tok.pad_id)
            for r, i in enumerate(idx):
                ids = res.tokens[r][:res.lengths[r]].tolist()
                if ids and ids[-1] in self.stops:
                    ids = ids[:-1]
                text = continuation_text(self.tok, "", encoded[i], ids)
                out[i] = cut_at(text, until)
            if progress is not None:
                progress(len(idx))
        return out


def cut_at(text: str, until: Sequence[str]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cut = min((text.find(s) for s in until if s and s in text), default=-1)
    return text if cut < 0 else text[:cut]


def chance_band(n: int, p: float, z: float = 3.0) -> tuple[float, float]:
    """p ± z binomial standard errors for n questions (the harness checks' 'near chance')."""
    se = math.sqrt(p * (1 - p) / max(n, 1))
    return p - z * se, p + z * se
