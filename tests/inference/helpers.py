"""Drives the KV policies' slot rules (icml_jax/models/kv_policies.py) with a logit map, as the
decode cache runs them, for the policy tests and the reference-parity tests."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.inference import kv_policies as kp


@functools.partial(jax.jit, static_argnums=0)
def _step(policy, state, t, row_HT):
    """One decode step of the slot rules: choose the slot, write, observe the raw logits and their
    softmax over the valid slots (one program per policy and shape, shared by every caller)."""
    slot = kp.choose_slot(policy, state, t)
    state = kp.write(policy, state, slot, t)
    z = jnp.where(state.pos >= 0, jnp.take_along_axis(row_HT, jnp.clip(state.pos, 0), axis=-1), -jnp.inf)
    return kp.observe(policy, state, z, jax.nn.softmax(z, axis=-1))


def decode_kept(policy, L_HTT, state, t0: int) -> np.ndarray:
    """Decode steps t0 .. T-1 from ``state`` (lead shape [H]), each head h's query t scoring its
    slots with the raw logits L[h, t, slot position] (``_step``). The kept positions after each
    step, sorted per head, -1 = empty first: [H, steps, N]."""
    kept = []
    for t in range(t0, L_HTT.shape[1]):
        state = _step(policy, state, jnp.int32(t), jnp.asarray(L_HTT[:, t], jnp.float32))
        kept.append(np.sort(np.asarray(state.pos), -1))
    return np.stack(kept, 1)


def kept_sets(a) -> list:
    """Rows of positions (-1 = empty) -> sorted lists of the kept ones."""
    return [sorted(int(x) for x in row if x >= 0) for row in np.asarray(a)]
