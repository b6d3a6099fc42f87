"""KV-cache eviction policies as static-shape slot rules: full, StreamingLLM, H2O, SnapKV, MorphKV.

Every policy sees the cache as N slots per (batch row, KV head), each holding one token's key and
value (stored after the position embedding, so moving or overwriting a slot never re-rotates) and
its position (-1 = empty). A decode step at position t:

1. ``choose_slot(policy, state, t)`` -> the slot the new token is written to: the first empty slot,
   else the slot the policy evicts (an int32 per row and head);
2. ``write(policy, state, slot, t)`` records the new token there;
3. the caller attends over the valid slots and reports what the policy needs:
   ``observe(policy, state, logits, probs)`` with the current query's raw logits to every slot summed
   over the KV head's query group (MorphKV) and its attention probabilities summed over the group
   (H2O), both [..., N], empty slots ignored.

Rules (C = ``slots`` = N, W = ``window``):
  ``full``       never evicts (N must cover prompt + response).
  ``streaming``  StreamingLLM: the ``sinks`` first positions are never evicted; otherwise the oldest
                 slot goes, so the cache holds the sinks and the N - sinks most recent tokens.
  ``h2o``        heavy hitters: each slot accumulates the attention probability every later query put
                 on it; the slot with the least accumulated score among those older than the recent
                 window (pos < t - W) is evicted: W recent + the N - W - 1 heaviest older + current.
  ``snapkv``     compresses only the prompt (``prefill_keep``), then keeps every generated token: its
                 decode never evicts, so its slots must cover the kept prompt plus the response.
  ``morphkv``    the window holds the raw group-summed logit rows of the W previous queries; each
                 older slot (pos < t - W) is scored by a softmax of every window row over the older slots
                 only, fused over the rows by ``fuse`` = "sum" or "max"; the lowest-scoring older slot is
                 evicted. N = C_old + W + 1 (the reference's max_capacity C_old + W, plus the current
                 token); C_old = 0 is sliding-window attention of width W + 1. A row with no older
                 slot contributes 0.

``prefill_keep`` picks which prompt positions a policy keeps when the prompt is longer than its
slots, from the prompt's group-summed logits / probabilities:
  SnapKV   the last ``window`` observation queries' probabilities summed, average-pooled (kernel
           ``pool``, zero padding, divisor ``pool``) over the positions before the window only,
           as ``snapkv_utils.SnapKVCluster.update_kv`` pools ``attn[..., :-window]``;
  MorphKV  what the reference's first decode step after an uncompressed prompt keeps (it never
           compresses at prefill): the W most recent prompt positions, and the top C_old of the
           positions before them, scored by the last W prompt queries' rows. That is N - 1
           slots; the first generated token takes the free one, so nothing is evicted then.
           (The spec's static sketch scores by the W rows before the last prompt token and keeps
           the last W + 1 positions, then evicts once more at the first step: a different set.)
  H2O      the prompt queries' accumulated probabilities, the recent window kept.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

POLICIES = ("full", "streaming", "h2o", "snapkv", "morphkv")
NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class KVPolicy:
    """A cache policy and its sizes (static: they fix the cache's shapes)."""
    name: str = "full"
    slots: int = 0  # N, slots per (row, KV head); 0 = the caller sizes a full cache
    window: int = 32  # W: recent tokens kept (h2o, morphkv) / observation queries (snapkv)
    sinks: int = 4  # streaming: attention-sink tokens never evicted
    fuse: str = "sum"  # morphkv: "sum" or "max" over the window rows
    pool: int = 5  # snapkv: average-pooling kernel over positions (odd; SnapKV's default)

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"KV policy {self.name!r}; choose one of {POLICIES}")
        if self.fuse not in ("sum", "max"):
            raise ValueError(f"KV policy fuse={self.fuse!r}; choose 'sum' or 'max'")
        if self.name in ("h2o", "morphkv") and self.slots and self.slots < self.window + 1:
            raise ValueError(f"{self.name}: slots={self.slots} must be at least window + 1 = "
                             f"{self.window + 1} (the recent window and the current token)")
        if self.name == "streaming" and self.slots and self.slots <= self.sinks:
            raise ValueError(f"streaming: slots={self.slots} must exceed sinks={self.sinks}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"snapkv pool={self.pool} must be a positive odd kernel size")


class SlotState(NamedTuple):
    """Per (row, KV head) bookkeeping of N slots; leading dims [...] are the caller's (e.g. [B, G])."""
    pos: jax.Array  # int32 [..., N], -1 = empty
    score: jax.Array  # float32 [..., N]: h2o's accumulated attention
    window: jax.Array  # float32 [..., W, N]: morphkv's window logit rows (oldest first), -inf = unseen


def init_state(policy: KVPolicy, lead_shape: tuple, slots: int) -> SlotState:
    W = policy.window if policy.name == "morphkv" else 0
    return SlotState(pos=jnp.full(lead_shape + (slots,), -1, jnp.int32),
                     score=jnp.zeros(lead_shape + (slots,), jnp.float32),
                     window=jnp.full(lead_shape + (W, slots), NEG_INF, jnp.float32))


def _fused_old_softmax(fuse: str, rows, old):
    """MorphKV's score: each logit row [..., W, N] as a softmax over the ``old`` columns [..., N]
    only (a row with no old column gives zeros, not NaN), fused over the rows by sum or max."""
    z = jnp.where(old[..., None, :], rows, NEG_INF)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.where(old[..., None, :], jnp.exp(z - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    tot = e.sum(-1, keepdims=True)
    a = jnp.where(tot > 0, e / jnp.where(tot > 0, tot, 1.0), 0.0)
    return a.sum(-2) if fuse == "sum" else a.max(-2)


def morph_scores(policy: KVPolicy, state: SlotState, t) -> jax.Array:
    """MorphKV's fused score of every slot older than the window ([..., N]; -inf for the others)."""
    old = (state.pos >= 0) & (state.pos < t - policy.window)
    return jnp.where(old, _fused_old_softmax(policy.fuse, state.window, old), NEG_INF)


def choose_slot(policy: KVPolicy, state: SlotState, t) -> jax.Array:
    """The slot position t's token is written to: the first empty slot, else the policy's victim.
    ``t`` broadcasts against ``state.pos`` [..., N] (a scalar, or e.g. [B, 1, 1] per row)."""
    pos = state.pos
    empty = pos < 0
    first_empty = jnp.argmax(empty, axis=-1)
    big = jnp.iinfo(jnp.int32).max
    if policy.name == "streaming":
        victim = jnp.argmin(jnp.where(pos >= policy.sinks, pos, big), axis=-1)
    elif policy.name == "h2o":
        old = pos < t - policy.window
        victim = jnp.argmin(jnp.where(old, state.score, jnp.inf), axis=-1)
    elif policy.name == "morphkv":
        s = morph_scores(policy, state, t)
        victim = jnp.argmin(jnp.where(jnp.isfinite(s), s, jnp.inf), axis=-1)
    else:  # full, snapkv: no decode eviction; a full cache overwrites nothing useful (caller sizes it)
        victim = jnp.argmin(pos, axis=-1)
    return jnp.where(empty.any(-1), first_empty, victim).astype(jnp.int32)


def write(policy: KVPolicy, state: SlotState, slot, t) -> SlotState:
    """Records position t in ``slot`` ([...]): its score restarts at 0 and no window row saw it."""
    hit = jnp.arange(state.pos.shape[-1]) == jnp.asarray(slot)[..., None]
    pos = jnp.where(hit, jnp.asarray(t, jnp.int32), state.pos)
    score = jnp.where(hit, 0.0, state.score)
    window = jnp.where(hit[..., None, :], NEG_INF, state.window)
    return SlotState(pos, score, window)


def observe(policy: KVPolicy, state: SlotState, logits, probs) -> SlotState:
    """After the current query attended: h2o adds its group-summed probabilities [..., N] to the
    scores; morphkv drops its oldest window row and appends the group-summed raw logits [..., N]."""
    valid = state.pos >= 0
    score, window = state.score, state.window
    if policy.name == "h2o":
        score = score + jnp.where(valid, probs, 0.0)
    if policy.name == "morphkv" and window.shape[-2]:
        row = jnp.where(valid, logits.astype(jnp.float32), NEG_INF)
        window = jnp.concatenate([window[..., 1:, :], row[..., None, :]], axis=-2)
    return SlotState(state.pos, score, window)


def prefill_scores(policy: KVPolicy, slots: int, pos_P, valid_P, logits_PP=None, probs_PP=None):
    """Keep priority of each prompt column [..., P]: +inf = always kept (the recent window, sinks,
    or every real token when they fit in ``slots``), -inf = never (padding), else the policy's score.

    ``pos_P`` the tokens' positions (0 at each row's first real token; rows may be left-padded),
    ``valid_P`` real tokens; ``logits_PP`` / ``probs_PP`` [..., P, P] the prompt's causal
    group-summed raw logits and attention probabilities (query row, key column); padding rows
    and columns are ignored. Real tokens are right-aligned (the last column is the last token)."""
    src = logits_PP if logits_PP is not None else probs_PP
    P = src.shape[-1]
    n = valid_P.sum(-1, keepdims=True)  # real tokens per row
    last_w = pos_P >= n - 1 - policy.window  # the current (last) token and the W before it
    if policy.name == "streaming":
        keep = (pos_P < policy.sinks) | (pos_P >= n - (slots - policy.sinks))
        score = jnp.where(keep, jnp.inf, NEG_INF)
    elif policy.name == "full":
        score = jnp.full(pos_P.shape, jnp.inf)
    elif policy.name == "snapkv":
        W = policy.window
        # [..., P]; the window's own columns are zeroed, so the pooling sees the prefix only
        before = valid_P & (pos_P < n - W)
        obs = jnp.where(before[..., None, :], probs_PP[..., P - W:, :], 0.0).sum(-2)
        k = policy.pool
        lead = obs.shape[:-1]
        pad = jnp.pad(obs, [(0, 0)] * len(lead) + [(k // 2, k // 2)])
        pooled = sum(pad[..., i:i + P] for i in range(k)) / k
        score = jnp.where(pos_P >= n - W, jnp.inf, pooled)
    elif policy.name == "h2o":
        acc = jnp.where(valid_P[..., :, None] & valid_P[..., None, :], probs_PP, 0.0).sum(-2)
        score = jnp.where(last_w, jnp.inf, acc)
    else:  # morphkv: the last W prompt queries score the positions before them
        W = policy.window
        recent = pos_P >= n - W
        # [..., W, P]; a prompt of P <= W tokens has fewer rows (and no old column: all kept)
        rows = logits_PP[..., max(P - W, 0):P, :]
        fused = (_fused_old_softmax(policy.fuse, rows, valid_P & ~recent) if rows.shape[-2]
                 else jnp.zeros(rows.shape[:-2] + rows.shape[-1:], rows.dtype))
        score = jnp.where(recent, jnp.inf, fused)
    score = jnp.where(n <= slots, jnp.inf, score)  # everything fits: keep every real token
    return jnp.where(valid_P, score, NEG_INF)


def prefill_select(policy: KVPolicy, slots: int, pos_P, valid_P, logits_PP=None, probs_PP=None):
    """(column indices [..., min(slots, P)] ascending, chosen [...]: a real token was chosen there)."""
    score = prefill_scores(policy, slots, pos_P, valid_P, logits_PP, probs_PP)
    k = min(slots, score.shape[-1])
    top, idx = jax.lax.top_k(score, k)
    if policy.name == "morphkv" and k == slots:  # a compressed prompt keeps N - 1: one slot stays free
        compressed = valid_P.sum(-1) > slots
        top = top.at[..., -1].set(jnp.where(compressed, NEG_INF, top[..., -1]))
    order = jnp.argsort(idx, axis=-1)
    idx, top = jnp.take_along_axis(idx, order, -1), jnp.take_along_axis(top, order, -1)
    return idx, top > NEG_INF


def prefill_state(policy: KVPolicy, slots: int, pos_P, valid_P, logits_PP=None, probs_PP=None):
    """(column indices [..., n] the prompt keeps, ``SlotState`` of ``slots`` slots): the policy's
    state after its prompt (``prefill_select``'s choice; empty slots after the kept ones): the
    kept positions, h2o's accumulated prompt attention (``probs_PP`` summed over the real query
    rows) and MorphKV's window (the last W prompt rows' logits at the kept columns). The cache
    module gathers its keys and values at the same indices."""
    keep_n = policy.slots or slots  # snapkv: its prompt budget; the rest grows during decode
    idx, chosen = prefill_select(policy, keep_n, pos_P, valid_P, logits_PP, probs_PP)
    lead, n = idx.shape[:-1], idx.shape[-1]
    take = lambda x: jnp.take_along_axis(x, idx, axis=-1)  # noqa: E731
    pad = lambda x, val: (jnp.concatenate(  # noqa: E731
        [x, jnp.full(x.shape[:-1] + (slots - n,), val, x.dtype)], axis=-1) if slots > n else x)
    pos = pad(jnp.where(chosen, take(pos_P), -1).astype(jnp.int32), -1)
    if probs_PP is None:
        score = jnp.zeros(lead + (slots,), jnp.float32)
    else:
        acc = jnp.where(valid_P[..., None, :], probs_PP, 0.0).sum(-2)
        score = pad(jnp.where(chosen, take(acc), 0.0).astype(jnp.float32), 0.0)
    W = policy.window if policy.name == "morphkv" else 0
    window = jnp.full(lead + (W, slots), NEG_INF, jnp.float32)
    if W:
        P = logits_PP.shape[-1]
        rows = logits_PP[..., max(0, P - W):, :]  # the last W prompt rows (fewer for a short prompt)
        rows = jnp.take_along_axis(rows, jnp.broadcast_to(idx[..., None, :], rows.shape[:-1] + (n,)), -1)
        rows = jnp.where(chosen[..., None, :], rows, NEG_INF).astype(jnp.float32)
        window = window.at[..., W - rows.shape[-2]:, :n].set(rows)
    return idx, SlotState(pos, score, window)


def prefill_keep(policy: KVPolicy, slots: int, logits_PP=None, probs_PP=None) -> jax.Array:
    """Prompt positions [..., slots] (ascending) a policy keeps of an unpadded P-token prompt,
    P > slots (``prefill_scores`` with every token real); MorphKV keeps slots - 1 (its free slot
    is the first generated token's)."""
    src = logits_PP if logits_PP is not None else probs_PP
    P = src.shape[-1]
    if slots >= P:
        raise ValueError(f"prefill_keep: the prompt ({P} tokens) fits in {slots} slots; keep it all")
    if policy.name == "full":
        raise ValueError("the full policy keeps the whole prompt: size its cache to the prompt + response")
    lead = src.shape[:-2]
    pos = jnp.broadcast_to(jnp.arange(P), lead + (P,))
    idx, chosen = prefill_select(policy, slots, pos, jnp.ones(lead + (P,), bool), logits_PP, probs_PP)
    if policy.name != "morphkv":
        return idx
    order = jnp.argsort(~chosen, axis=-1, stable=True)[..., :slots - 1]  # the chosen, still ascending
    return jnp.take_along_axis(idx, order, -1)
