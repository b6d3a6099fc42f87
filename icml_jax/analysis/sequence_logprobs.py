"""Exact log-probabilities of whole strings under a trained decoder (docs/methods/precision_recall.md).

``sequence_logprobs`` scores each string exactly: log Q_T(x) = sum_t log softmax(logits_t / T)[x_t]
over the tokens of ``[bos] + bytes(x) + [eos]`` (the eos included), for several sampling
temperatures T at once. Each step normalises, so Q_T is a distribution over finite token strings
(up to the mass of strings that never end) and equals what temperature sampling generates. The
precision-recall experiment compares these Q_T with the data distribution P
(``icml_jax/analysis/precision_recall.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.losses.logps import token_logprobs


def encode_strings(tokenizer, strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, T + 1] int32 of [bos] + ids + [eos] right-padded with pad_id, lengths [N] = the
    number of predicted tokens, len(ids) + 1)."""
    enc = [tokenizer.encode(s) for s in strings]
    T = max(len(e) for e in enc) + 1
    toks = np.full((len(enc), T + 1), tokenizer.pad_id, np.int32)
    for i, e in enumerate(enc):
        toks[i, 0], toks[i, 1:len(e) + 1], toks[i, len(e) + 1] = tokenizer.bos_id, e, tokenizer.eos_id
    return toks, np.array([len(e) + 1 for e in enc], np.int32)


def sequence_logprobs(model, params, tokenizer, strings: Sequence[str],
                      temperatures: Sequence[float] = (1.0,), batch_size: int = 1024) -> np.ndarray:
    """log Q_T(x) [len(temperatures), N] float64 (the module docstring)."""
    temps = [float(t) for t in temperatures]
    if not temps or any(not t > 0 for t in temps):
        raise ValueError(f"temperatures must be > 0, got {list(temperatures)}")
    if not len(strings):
        return np.zeros((len(temps), 0))
    toks, lengths = encode_strings(tokenizer, strings)
    inv_t = jnp.asarray([1.0 / t for t in temps], jnp.float32)

    @jax.jit
    def score(p, toks_BT1, len_B):
        inp, tgt = toks_BT1[:, :-1], toks_BT1[:, 1:]
        T = inp.shape[1]
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), inp.shape)
        w = (pos < len_B[:, None]).astype(jnp.float32)
        logits = model.apply({"params": p}, inp, pos, jnp.ones_like(inp)).astype(jnp.float32)

        def one(it):  # one temperature at a time: memory of one [B, T, V] log-softmax
            return (token_logprobs(logits * it, tgt) * w).sum(-1)
        return jax.lax.map(one, inv_t)

    out = []
    for i in range(0, len(toks), batch_size):
        b, lb = toks[i:i + batch_size], lengths[i:i + batch_size]
        n = len(b)
        if n < batch_size and len(toks) > batch_size:  # keep one compiled shape
            b = np.concatenate([b, np.repeat(b[-1:], batch_size - n, 0)])
            lb = np.concatenate([lb, np.repeat(lb[-1:], batch_size - n)])
        out.append(np.asarray(score(params, jnp.asarray(b), jnp.asarray(lb)), np.float64)[:, :n])
    return np.concatenate(out, axis=1)
