"""Simple sampling by full recomputation on a fixed-size buffer (one compile, no KV cache).

Good enough for printing samples from small models during training; KV-cache decoding lives in
its own module.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("model", "max_new", "temperature"))
def _generate(model, params, buf_BT, lengths_B, key, max_new: int, temperature: float):
    B, T = buf_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.ones((B, T), jnp.int32)

    def body(i, carry):
        buf, key = carry
        logits = model.apply({"params": params}, buf, positions, seg)
        cur = lengths_B + i - 1
        last = jnp.take_along_axis(logits, cur[:, None, None], axis=1)[:, 0]
        key, sub = jax.random.split(key)
        if temperature > 0:
            nxt = jax.random.categorical(sub, last / temperature, axis=-1)
        else:
            nxt = jnp.argmax(last, axis=-1)
        buf = buf.at[jnp.arange(B), cur + 1].set(nxt.astype(buf.dtype))
        return buf, key

    buf, _ = jax.lax.fori_loop(0, max_new, body, (buf_BT, key))
    return buf


def generate(model, params, tokenizer, prompts, key, max_new: int = 64, temperature: float = 0.8,
             max_len: int = None):
    """Continues each prompt string; returns the decoded continuations (prompt excluded)."""
    encoded = [[tokenizer.bos_id] + list(tokenizer.encode(p)) for p in prompts]
    longest = max(len(e) for e in encoded)
    T = longest + max_new if max_len is None else max_len
    if longest + max_new > T:
        raise ValueError(f"prompt ({longest} tokens) + max_new ({max_new}) exceeds the buffer ({T})")
    buf = np.full((len(prompts), T), tokenizer.pad_id, np.int32)
    for i, e in enumerate(encoded):
        buf[i, :len(e)] = e
    lengths = np.array([len(e) for e in encoded], np.int32)
    out = np.asarray(_generate(model, params, jnp.asarray(buf), jnp.asarray(lengths), key, max_new,
                               float(temperature)))
    texts = []
    for i, e in enumerate(encoded):
        ids = out[i, len(e):len(e) + max_new].tolist()
        if tokenizer.eos_id in ids:
            ids = ids[:ids.index(tokenizer.eos_id)]
        texts.append(tokenizer.decode(ids))
    return texts
