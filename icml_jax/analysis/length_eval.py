"""Length-generalisation evaluation: perplexity at several context lengths, passkey retrieval.

  stream = heldout_stream(config.data, tokenizer, "validation")        # int32 [N] token ids
  ppl = perplexity_at_lengths(config.model, params, stream, [64, 128, 256, 512], num_tokens=8192)
  pk = passkey_grid(config.model, params, tokenizer, stream, lengths=[64, 128], depths=[0.1, 0.5, 0.9])

Perplexity: the same held-out token prefix (``num_tokens``, a multiple of every length) is cut into
non-overlapping windows of ``length`` inputs (targets shifted by one); every window starts a fresh
context at position 0, so each length scores exactly the same tokens. Documents are joined with
their bos/eos ids as in training.

Passkey (associative recall with a distinct cue): a random ``key_digits``-digit key follows a cue
token ``CUE`` that never occurs in the filler, at ``depth`` (fraction of the filler) of real
held-out text; the prompt ends with the cue again and the answer is the key, ``length`` tokens in
all: ``[bos] filler[:cut] ^1234 filler[cut:] ^`` -> ``1234``. The filler has the cue and every
digit removed (``passkey_filler``), so a one-token induction head on the cue solves it exactly.
Teacher-forced accuracy = fraction of the key digits that are the argmax given the true prefix;
greedy accuracy = fraction of digits right when the key is generated with the KV-cache
``generate`` (temperature 0); ``exact`` = fraction of keys whose digits are all right greedily.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import numpy as np

from icml_jax.data import get_split_source
from icml_jax.inference import decode
from icml_jax.losses.logps import token_logprobs
from icml_jax.models import build_model

CUE = "^"  # one byte that no Shakespeare text contains (and stripped from the filler anyway)
KEY_DIGITS = 4  # default key length; every passkey function takes ``key_digits``
NEEDLE = CUE + "{key}"  # inserted into the filler
QUESTION = CUE  # ends the prompt; the answer is the key

def heldout_stream(data_cfg, tokenizer, split: str = "validation") -> np.ndarray:
    """All documents of ``split`` as one int32 token stream, each as [bos] + text + [eos]."""
    source = get_split_source(data_cfg, split)
    pieces = []
    for i in range(len(source)):
        ids = np.asarray(tokenizer.encode_np(source[i]["text"]), np.int32)
        pieces.append(np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]]).astype(np.int32))
    return np.concatenate(pieces)


@functools.lru_cache(maxsize=None)
def _nll_fn(model_cfg):
    model = build_model(model_cfg)

    @jax.jit
    def f(params, inputs_BT, targets_BT):
        return -token_logprobs(model.apply({"params": params}, inputs_BT), targets_BT)  # [B, T]
    return f


def _frozen(model_cfg):
    import ml_collections
    return model_cfg if isinstance(model_cfg, ml_collections.FrozenConfigDict) else \
        ml_collections.FrozenConfigDict(model_cfg)


def perplexity_at_lengths(model_cfg, params, stream: np.ndarray, lengths: Sequence[int],
                          num_tokens: int | None = None, tokens_per_batch: int = 8192) -> dict:
    """{length: {"loss", "perplexity", "tokens"}} over the same ``num_tokens`` scored tokens.

    ``num_tokens`` is rounded down to a multiple of max(lengths) (default: as much of the stream
    as fits). Raises ValueError if a length exceeds ``model_cfg.max_seq_len`` or the stream is too
    short for one window of the longest length."""
    model_cfg = _frozen(model_cfg)
    Lmax = max(lengths)
    if Lmax > model_cfg.max_seq_len:
        raise ValueError(f"eval length {Lmax} exceeds config.model.max_seq_len={model_cfg.max_seq_len}; "
                         "raise max_seq_len (it does not change the parameters)")
    n = (len(stream) - 1) if num_tokens is None else min(num_tokens, len(stream) - 1)
    n = n // Lmax * Lmax
    if n == 0:
        raise ValueError(f"the held-out stream ({len(stream)} tokens) is shorter than one window of "
                         f"{Lmax} + 1 tokens")
    f = _nll_fn(model_cfg)
    out = {}
    for L in lengths:
        inputs = stream[:n].reshape(-1, L)
        targets = stream[1:n + 1].reshape(-1, L)
        B = max(1, min(tokens_per_batch, n) // L)  # no all-padding rows when n is small
        total = 0.0
        for i in range(0, len(inputs), B):
            x, y = inputs[i:i + B], targets[i:i + B]
            pad = B - len(x)  # fixed batch shape: one compile per length
            nll = np.asarray(f(params, np.pad(x, ((0, pad), (0, 0))), np.pad(y, ((0, pad), (0, 0)))))
            total += float(nll[:len(x)].astype(np.float64).sum())
        loss = total / n
        out[int(L)] = {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": int(n)}
    return out


def passkey_min_length(tokenizer, key_digits: int = KEY_DIGITS) -> int:
    """Shortest passkey example (bos + needle + question + key, no filler)."""
    key = "0" * key_digits
    return 1 + len(tokenizer.encode(NEEDLE.format(key=key))) + \
        len(tokenizer.encode(QUESTION)) + len(tokenizer.encode(key))


def passkey_filler(tokenizer, stream: np.ndarray) -> np.ndarray:
    """``stream`` without bos/eos, the cue's tokens and any digit token: the filler text."""
    drop = {tokenizer.bos_id, tokenizer.eos_id}
    for ch in CUE + "0123456789":
        drop.update(tokenizer.encode(ch))
    return stream[~np.isin(stream, np.asarray(sorted(drop), stream.dtype))]


def passkey_example(tokenizer, stream: np.ndarray, length: int, depth: float,
                    rng: np.random.RandomState, filler_is_clean: bool = False,
                    key_digits: int = KEY_DIGITS):
    """(prompt ids, key digit ids [key_digits], key string): [bos] + filler[:cut] + needle +
    filler[cut:] + question, then the key, ``length`` tokens in all; the filler is a random slice
    of ``passkey_filler(stream)`` (pass ``filler_is_clean=True`` when ``stream`` already is one)."""
    key = "".join(str(d) for d in rng.randint(0, 10, key_digits))
    needle = list(tokenizer.encode(NEEDLE.format(key=key)))
    question = list(tokenizer.encode(QUESTION))
    answer = list(tokenizer.encode(key))
    n_fill = length - 1 - len(needle) - len(question) - len(answer)
    if n_fill < 0:
        raise ValueError(f"passkey length {length} is too short for the needle and question "
                         f"({length - n_fill} tokens needed)")
    text = stream if filler_is_clean else passkey_filler(tokenizer, stream)
    start = rng.randint(0, len(text) - n_fill)
    filler = [int(t) for t in text[start:start + n_fill]]
    cut = int(round(depth * n_fill))
    prompt = [tokenizer.bos_id] + filler[:cut] + needle + filler[cut:] + question
    return prompt, answer, key


@functools.lru_cache(maxsize=None)
def _logits_fn(model_cfg):
    model = build_model(model_cfg)
    return jax.jit(lambda p, t: model.apply({"params": p}, t))


def passkey_accuracy(model_cfg, params, tokenizer, stream, length: int, depth: float,
                     trials: int = 4, seed: int = 0, greedy: bool = True,
                     key_digits: int = KEY_DIGITS) -> dict:
    """{"teacher_forced", "greedy", "exact"}: digit accuracy over ``trials`` random keys
    (teacher-forced, greedy) and the share of keys generated exactly (greedy)."""
    model_cfg = _frozen(model_cfg)
    rng = np.random.RandomState(seed + 7919 * length + int(1000 * depth))
    text = passkey_filler(tokenizer, stream)
    ex = [passkey_example(tokenizer, text, length, depth, rng, filler_is_clean=True,
                          key_digits=key_digits) for _ in range(trials)]
    full = np.asarray([p + a for p, a, _ in ex], np.int32)  # [trials, length]
    answers = np.asarray([a for _, a, _ in ex], np.int32)  # [trials, key_digits]
    P = len(ex[0][0])
    logits = np.asarray(_logits_fn(model_cfg)(params, full[:, :-1]))
    pred = logits[:, P - 1:P - 1 + answers.shape[1]].argmax(-1)
    out = {"teacher_forced": float((pred == answers).mean())}
    if greedy:
        g = decode.generate(model_cfg, params, [p for p, _, _ in ex], key=jax.random.key(seed),
                            max_new_tokens=answers.shape[1], temperature=0.0,
                            stop_tokens=(), pad_id=tokenizer.pad_id)
        out["greedy"] = float((g.tokens == answers).mean())
        out["exact"] = float((g.tokens == answers).all(-1).mean())
    return out


def passkey_grid(model_cfg, params, tokenizer, stream, lengths: Sequence[int],
                 depths: Sequence[float], trials: int = 4, seed: int = 0, greedy: bool = True,
                 key_digits: int = KEY_DIGITS) -> list:
    """One row per (length, depth): {"length", "depth", "teacher_forced", "greedy", "exact"}."""
    rows = []
    for L in lengths:
        for d in depths:
            acc = passkey_accuracy(model_cfg, params, tokenizer, stream, L, d, trials, seed, greedy,
                                   key_digits)
            rows.append({"length": int(L), "depth": float(d), **acc})
    return rows
