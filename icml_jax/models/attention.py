"""Grouped-query attention with causal + segment (+ optional sliding-window) masking and a KV cache.

Projections are stored grouped by kv head so that tensor parallelism shards whole groups:
  qkv kernel [D, G, R + 2, K]  (R query heads, then k, then v, per kv head g; query head h = g*R + r)
  qkv bias   [G, R + 2, K]     (only with ``config.model.qkv_bias``, Qwen2 style)
  out kernel [G, R, K, D]

Decoding (``decode=True``): the layer keeps a ``cache`` collection sized by the input it was
initialised with ([B, S]): keys [B*G, K, S] and values [B*G, S, K] (already position-encoded; no
leading axis when B*G = 1; callers see [B, S, G, K] views), per-slot positions and segment ids
[B, S], and the next write index. Each call writes its T new tokens at the index
and attends over the whole cache; empty slots are never visible (causality by slot index).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from icml_jax.models import hooks, lowrank
from icml_jax.models.layers import constrain, get_dtype, matmul, param, row_max, row_sum, upcast
from icml_jax.models.positions import POSITIONS

NEG_INF = -1e30
MAX_QUERY_BLOCKS = 8  # causal query blocks of the einsum path (config.model.attention_block)
# config.model.attention_impl -> jax.nn.dot_product_attention's ``implementation`` (None: ours)
ATTENTION_IMPLS = {"einsum": None, "xla": "xla", "cudnn": "cudnn"}


def attention_mask(q_seg_BT, k_seg_BS, q_idx_BT, k_idx_BS, q_pos_BT=None, k_pos_BS=None,
                   window: int = 0):
    """Boolean [B, T, S]: key s is visible to query t.

    Same segment, not in the future (``*_idx`` are slot indices in the row or cache) and, with a
    sliding window, q_pos - k_pos < window (``*_pos`` are per-document positions)."""
    mask = q_seg_BT[:, :, None] == k_seg_BS[:, None, :]
    mask &= k_idx_BS[:, None, :] <= q_idx_BT[:, :, None]
    if window:
        mask &= (q_pos_BT[:, :, None] - k_pos_BS[:, None, :]) < window
    return mask


def _logits(q_BTGRK, k_BSGK, bias=None):
    """q k^T / sqrt(K) + bias in float32 (unmasked): [B, G, R, T, S]."""
    logits = upcast(jnp.einsum("BTGRK,BSGK->BGRTS", q_BTGRK, k_BSGK)) * (q_BTGRK.shape[-1] ** -0.5)
    return logits if bias is None else logits + bias


def _softmax_attend(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None):
    """softmax(q k^T / sqrt(K) + bias, masked) v with float32 logits: [B, T, G, R, K]."""
    logits = jnp.where(mask_BTS[:, None, None], _logits(q_BTGRK, k_BSGK, bias), NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BSGK.dtype)
    return jnp.einsum("BGRTS,BSGK->BTGRK", probs, v_BSGK)


def _decode_attend(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None):
    """``_softmax_attend`` for a few queries against a cache (decode): the R query heads of a KV
    head and the T queries are one matrix dimension M = R*T of each (B, G) dot, so XLA on CPU
    runs two plain batched matmuls over the cache (a [B, G, R, T, S] layout with T = 1 ran at a
    third of the speed). The dots batch over N = B*G, the cache's own leading axis (``KVCache``),
    so the views' reshapes cancel and the dots read the updated cache itself. Same numbers."""
    B, T, G, R, K = q_BTGRK.shape
    S = k_BSGK.shape[1]
    n = cache_lead(B, G)
    q = jnp.transpose(q_BTGRK, (0, 2, 3, 1, 4)).reshape(n + (R * T, K))
    k = jnp.transpose(k_BSGK, (0, 2, 3, 1)).reshape(n + (K, S))
    v = jnp.transpose(v_BSGK, (0, 2, 1, 3)).reshape(n + (S, K))
    logits = upcast(jnp.einsum("...MK,...KS->...MS", q, k)).reshape(B, G, R * T, S) * (K ** -0.5)
    if bias is not None:
        logits = logits + jnp.broadcast_to(bias, (B, G, R, T, S)).reshape(B, G, R * T, S)
    mask = jnp.broadcast_to(mask_BTS[:, None, None], (B, 1, R, T, S)).reshape(B, 1, R * T, S)
    probs = jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1).astype(v_BSGK.dtype)
    o = jnp.einsum("...MS,...SK->...MK", probs.reshape(n + (R * T, S)), v).reshape(B, G, R, T, K)
    return jnp.transpose(o, (0, 3, 1, 2, 4))


def cache_lead(B: int, G: int) -> tuple:
    """The leading axes of a ``KVCache`` entry: (B*G,), or none when B*G = 1 (XLA drops a unit
    axis for the dots, and the cache update was then computed twice, once per shape). One merged
    axis: a sharded decode could not split batch and KV heads over different mesh axes (none
    shards the cache today)."""
    return (B * G,) if B * G > 1 else ()


def query_block_count(model_cfg, T: int, S: int) -> int:
    """Causal query blocks for T queries over their own S = T keys: T / ``attention_block``
    (0: one block), at most ``MAX_QUERY_BLOCKS`` (each block is its own pair of dots in the
    program, so compile time grows with the count); 1 unless the blocks split T evenly."""
    blk = model_cfg.get("attention_block", 0)
    if not blk or T != S or T % blk:
        return 1
    n = min(T // blk, MAX_QUERY_BLOCKS)
    return n if T % n == 0 else 1


def causal_attention(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None, n: int = 1, row_scale=None,
                     precision=None):
    """``_softmax_attend`` over the queries' own keys (training / scoring without a cache) in n
    causal query blocks, with a hand-written VJP. Query block i is causally masked from every key
    after its own block, so the core skips those n(n-1)/2 of the n^2 tiles (they contribute
    exactly 0).

    Same numbers as the autodiff of ``_softmax_attend`` applied per query block (float32: ~1e-6;
    tested in ``tests/models/test_attention_core.py``), at less memory traffic on the CPU,
    measured on ``small``'s shapes:
      * the R query heads of a KV head and a block's c queries are one matrix dimension M = R*c,
        so each (B, G) pair runs plain [M, K] x [K, S] dots, and q / dout are laid out block-major
        once ([n, B, G, M, K]) instead of sliced and transposed per block;
      * the forward keeps e = exp(z - max) and its row sums l and divides the [M, K] output, not
        the [M, S] probabilities;
      * the backward takes the softmax's row term from the outputs, rowsum(dout * out) ([M, K]),
        not from a pass over the [M, S] matrices, and needs no mask (e is exactly 0 where masked).
    Contract: the keys are the queries' own S = T slots, n divides T, and every query sees at
    least one key (its own slot: true of ``attention_mask`` for causal rows with segment ids; a
    fully masked row would leak gradient where autodiff gives 0).
    ``bias`` (ALiBi) is an array broadcastable to [B, G, R, T, S] whose last two axes are T and S;
    its cotangent is returned (and dropped by XLA where nothing needs it). The logits are
    q.k * K^-0.5, or q.k * ``row_scale`` [B] (one factor per batch row, the RMT's scale /
    (layer + 1); treated as a constant: no gradient flows to it). ``precision``: the dots'
    ``jax.lax.Precision`` (the RMT asks for HIGHEST, so float32 dots stay float32 on GPUs)."""
    B, T = q_BTGRK.shape[:2]
    if k_BSGK.shape[1] != T or T % n:
        raise ValueError(f"causal_attention: {k_BSGK.shape[1]} keys for {T} queries in {n} blocks; "
                         "it needs the queries' own keys (S = T) and n dividing T")
    if bias is not None and bias.shape[-2:] != (T, T):
        raise ValueError(f"causal_attention: bias shape {bias.shape} must end in (T, S) = ({T}, {T})")
    return _causal_attention(n, precision, q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias, row_scale)


def _blocks(x_BTGRK, n: int):
    """[B, T, G, R, K] -> [n, B, G, R*c, K]: query block i (block-major, so each block is one
    contiguous operand), its R heads and c queries as M."""
    B, T, G, R, K = x_BTGRK.shape
    c = T // n
    return jnp.transpose(x_BTGRK.reshape(B, n, c, G, R, K), (1, 0, 3, 4, 2, 5)).reshape(n, B, G, R * c, K)


def _unblocks(x_nBGMK, R: int):
    """The inverse of :func:`_blocks`."""
    n, B, G, M, K = x_nBGMK.shape
    c = M // R
    return jnp.transpose(x_nBGMK.reshape(n, B, G, R, c, K), (1, 0, 4, 2, 3, 5)).reshape(B, n * c, G, R, K)


def _block_ts(x, shape_BGRTS, i: int, c: int):
    """Query block i's rows of a [.., T, S] mask or bias broadcastable to [B, G, R, T, S], keys
    [0, (i+1)c), as [B or 1, G or 1, R*c, (i+1)c] (the R axis broadcast into M)."""
    B, G, R, T, S = shape_BGRTS
    x = x[..., i * c:(i + 1) * c, :(i + 1) * c]
    x = x.reshape((1,) * (5 - x.ndim) + x.shape)
    x = jnp.broadcast_to(x, x.shape[:2] + (R,) + x.shape[3:])
    return x.reshape(x.shape[:2] + (R * c, (i + 1) * c))


def _logit_scale(row_scale, K: int):
    """K^-0.5, or ``row_scale`` [B] as [B, 1, 1, 1] against [B, G, M, S] logits."""
    return K ** -0.5 if row_scale is None else row_scale.reshape(-1, 1, 1, 1)


def _causal_fwd(n, precision, q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias, row_scale):
    B, T, G, R, K = q_BTGRK.shape
    c, shape = T // n, (B, G, R, T, T)
    scale = _logit_scale(row_scale, K)
    q_nBGMK = _blocks(q_BTGRK, n)
    k_BGSK = jnp.transpose(k_BSGK, (0, 2, 1, 3))
    v_BGSK = jnp.transpose(v_BSGK, (0, 2, 1, 3))
    mask_B1TS = mask_BTS[:, None, None]
    outs, es, ls = [], [], []
    for i in range(n):
        hi = (i + 1) * c
        z = upcast(jnp.einsum("BGMK,BGSK->BGMS", q_nBGMK[i], k_BGSK[:, :, :hi], precision=precision)) * scale
        if bias is not None:
            z = z + _block_ts(bias, shape, i, c)
        z = jnp.where(_block_ts(mask_B1TS, shape, i, c), z, NEG_INF)
        e = jnp.exp(z - row_max(z))
        l = row_sum(e)
        outs.append(upcast(jnp.einsum("BGMS,BGSK->BGMK", e.astype(v_BSGK.dtype), v_BGSK[:, :, :hi],
                                      precision=precision)) / l)
        es.append(e)
        ls.append(l)
    o_nBGMK = jnp.stack(outs)
    # the bias's shape and dtype only (a zero-size array), not the [B, G, R, T, T] bias itself
    bias_like = None if bias is None else jnp.zeros((0,) + bias.shape, bias.dtype)
    res = (q_nBGMK, k_BGSK, v_BGSK, es, ls, o_nBGMK, bias_like, row_scale)
    return _unblocks(o_nBGMK, R).astype(v_BSGK.dtype), res


def _causal_bwd(n, precision, res, do_BTGRK):
    q_nBGMK, k_BGSK, v_BGSK, es, ls, o_nBGMK, bias_like, row_scale = res
    bias = None if bias_like is None else jax.ShapeDtypeStruct(bias_like.shape[1:], bias_like.dtype)
    _, B, G, M, K = q_nBGMK.shape
    T = k_BGSK.shape[2]
    c = T // n
    R = M // c
    scale = _logit_scale(row_scale, K)
    do_nBGMK = upcast(_blocks(do_BTGRK, n))
    delta_nBGM1 = row_sum(do_nBGMK * o_nBGMK)
    dqs, dk, dv, dbias = [], 0.0, 0.0, None
    if bias is not None:
        dbias = jnp.zeros(jnp.broadcast_shapes(bias.shape, (1, 1, 1, T, T)),
                          jnp.result_type(bias.dtype, es[0].dtype))
    for i in range(n):
        hi = (i + 1) * c
        e, l, do = es[i], ls[i], do_nBGMK[i]
        dp = jnp.einsum("BGMK,BGSK->BGMS", do, upcast(v_BGSK[:, :, :hi]), precision=precision)
        g = e * (dp - delta_nBGM1[i]) / l  # d logits (after the bias, before the mask)
        if bias is not None:
            gb = g.reshape(B, G, R, c, hi)
            gb = gb.sum(axis=tuple(a for a in range(3) if dbias.shape[a] == 1), keepdims=True)
            dbias = dbias.at[..., i * c:hi, :hi].add(gb.reshape(dbias.shape[:3] + (c, hi)))
        g = g * scale
        dqs.append(jnp.einsum("BGMS,BGSK->BGMK", g, upcast(k_BGSK[:, :, :hi]), precision=precision))
        pad = [(0, 0), (0, 0), (0, T - hi), (0, 0)]
        dk = dk + jnp.pad(jnp.einsum("BGMS,BGMK->BGSK", g, upcast(q_nBGMK[i]), precision=precision), pad)
        dv = dv + jnp.pad(jnp.einsum("BGMS,BGMK->BGSK", e, do / l, precision=precision), pad)
    dq = _unblocks(jnp.stack(dqs), R).astype(q_nBGMK.dtype)
    dk = jnp.transpose(dk, (0, 2, 1, 3)).astype(k_BGSK.dtype)
    dv = jnp.transpose(dv, (0, 2, 1, 3)).astype(v_BGSK.dtype)
    if bias is not None:
        dbias = dbias.reshape(dbias.shape[dbias.ndim - bias.ndim:]).astype(bias.dtype)
    return dq, dk, dv, None, dbias, None


_causal_attention = jax.custom_vjp(lambda n, precision, *args: _causal_fwd(n, precision, *args)[0],
                                   nondiff_argnums=(0, 1))
_causal_attention.defvjp(_causal_fwd, _causal_bwd)


class KVCache(nn.Module):
    """Decode-time key/value store (collection ``cache``), sized by the input it is initialised with.

    Values are stored head-major, [B*G, S, K], and keys key-major, [B*G, K, S], the batch and KV
    head axes as one (no leading axis when B*G = 1, :func:`cache_lead`): the decode attention's
    two dots batch over that axis and are then plain [M, K] x [K, S] and [M, S] x [S, K] matmuls
    over the cache as it lies in memory. (With [B, S, G, K] the compiled decode loop transposed
    both caches of every layer at every step; with head-major keys it still transposed the whole
    key cache at every step. With separate B and G axes, at batch 1 XLA dropped the unit axis for
    the dots and computed each cache update twice, once per shape, copying every layer's K and V
    cache two to four times per step; seen in the compiled HLO.) Callers get [B, S, G, K] views,
    which XLA folds into the einsum path's dots; this layout was measured on that path only
    (``attention_impl`` "xla" / "cudnn" may copy the key view per step)."""

    @nn.compact
    def __call__(self, k_BTGK, v_BTGK, positions_BT, segment_ids_BT):
        """Writes the T new tokens at the write index; returns the whole cache (k, v [B, S, G, K],
        positions, segment ids) and the slot indices of the queries [B, T] and keys [B, S]."""
        B, T = positions_BT.shape
        ready = self.has_variable("cache", "k")
        G, K = k_BTGK.shape[2], k_BTGK.shape[3]
        n = cache_lead(B, G)  # (B, G) as one leading axis: [B*G, T, K] / [B*G, K, T]
        head_major = lambda x: jnp.swapaxes(x, 1, 2).reshape(n + (x.shape[1], K))  # noqa: E731
        key_major = lambda x: jnp.transpose(x, (0, 2, 3, 1)).reshape(n + (K, x.shape[1]))  # noqa: E731
        ck = self.variable("cache", "k", jnp.zeros, key_major(k_BTGK).shape, k_BTGK.dtype)
        cv = self.variable("cache", "v", jnp.zeros, head_major(v_BTGK).shape, v_BTGK.dtype)
        cpos = self.variable("cache", "positions", jnp.zeros, (B, T), jnp.int32)
        cseg = self.variable("cache", "segment_ids", jnp.zeros, (B, T), jnp.int32)
        cidx = self.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
        if not ready:  # initialisation: allocate only, attend within the input as usual
            idx = jnp.broadcast_to(jnp.arange(T), (B, T))
            return k_BTGK, v_BTGK, positions_BT, segment_ids_BT, idx, idx
        i = cidx.value
        z = (0,) * len(n)
        ck.value = jax.lax.dynamic_update_slice(ck.value, key_major(k_BTGK).astype(ck.value.dtype), z + (0, i))
        cv.value = jax.lax.dynamic_update_slice(cv.value, head_major(v_BTGK).astype(cv.value.dtype), z + (i, 0))
        cpos.value = jax.lax.dynamic_update_slice(cpos.value, positions_BT.astype(jnp.int32), (0, i))
        cseg.value = jax.lax.dynamic_update_slice(cseg.value, segment_ids_BT.astype(jnp.int32), (0, i))
        cidx.value = i + T
        S = cv.value.shape[-2]
        q_idx = jnp.broadcast_to(i + jnp.arange(T), (B, T))
        k_idx = jnp.broadcast_to(jnp.arange(S), (B, S))
        k_BSGK = jnp.transpose(ck.value.reshape(B, G, K, S), (0, 3, 1, 2))
        v_BSGK = jnp.swapaxes(cv.value.reshape(B, G, S, K), 1, 2)
        return k_BSGK, v_BSGK, cpos.value, cseg.value, q_idx, k_idx


def kv_policy_of(model_cfg):
    """The ``config.model.kv_policy`` as a ``KVPolicy``, or None for today's full cache."""
    from icml_jax.models.kv_policies import KVPolicy
    pc = model_cfg.get("kv_policy", None)
    if pc is None or pc.get("name", "full") == "full":
        return None
    return KVPolicy(**{k: pc[k] for k in ("name", "slots", "window", "sinks", "fuse", "pool") if k in pc})


class PolicyKVCache(nn.Module):
    """A decode cache run by a ``kv_policies.KVPolicy``: N slots per (row, KV head), keys stored after
    the position embedding, per-head kept sets. The prefill attends within the prompt and keeps
    the policy's choice of its real tokens; each decode step writes the new token into the slot
    ``choose_slot`` names and attends over that head's valid slots. N = ``policy.slots``
    (``snapkv``: the size the cache is initialised with, its prompt compressed to ``slots``)."""
    policy: object
    window_mask: int = 0  # config.model.sliding_window

    @nn.compact
    def __call__(self, q_BTGRK, k_BTGK, v_BTGK, positions_BT, segment_ids_BT, bias_fn):
        from icml_jax.models import kv_policies as kp
        pol = self.policy
        B, T, G, R, K = q_BTGRK.shape
        ready = self.has_variable("cache", "k")
        N = T if pol.name == "snapkv" or not pol.slots else pol.slots  # init sees the full size
        ck = self.variable("cache", "k", jnp.zeros, (B, G, N, K), k_BTGK.dtype)
        cv = self.variable("cache", "v", jnp.zeros, (B, G, N, K), v_BTGK.dtype)
        init = kp.init_state(pol, (B, G), N)
        spos = self.variable("cache", "slot_pos", lambda: init.pos)
        sscore = self.variable("cache", "slot_score", lambda: init.score)
        swin = self.variable("cache", "slot_window", lambda: init.window)
        N = ck.value.shape[2]
        if not ready or T > 1:  # init or prefill: attend within the input, then keep the policy's slots
            idx = jnp.broadcast_to(jnp.arange(T), (B, T))
            mask = attention_mask(segment_ids_BT, segment_ids_BT, idx, idx, positions_BT, positions_BT,
                                  self.window_mask)
            z = _logits(q_BTGRK, k_BTGK, bias_fn(positions_BT, positions_BT))
            probs = jax.nn.softmax(jnp.where(mask[:, None, None], z, NEG_INF), axis=-1)
            o = jnp.einsum("BGRTS,BSGK->BTGRK", probs.astype(v_BTGK.dtype), v_BTGK)
            if ready:  # the policy's inputs: group-summed raw logits (-inf = unseen) and probabilities
                self._fill(ck, cv, spos, sscore, swin, k_BTGK, v_BTGK, positions_BT, segment_ids_BT,
                           jnp.where(mask[:, None, None], z, -jnp.inf).sum(2), probs.sum(2), N)
            return o
        state = kp.SlotState(spos.value, sscore.value, swin.value)
        t = positions_BT[:, :1, None]  # [B, 1, 1]: the new token's position, against [B, G, N]
        slot = kp.choose_slot(pol, state, t)
        state = kp.write(pol, state, slot, t)
        hit = (jnp.arange(N) == slot[..., None])[..., None]  # [B, G, N, 1]
        ck.value = jnp.where(hit, jnp.swapaxes(k_BTGK, 1, 2).astype(ck.value.dtype), ck.value)
        cv.value = jnp.where(hit, jnp.swapaxes(v_BTGK, 1, 2).astype(cv.value.dtype), cv.value)
        z = upcast(jnp.einsum("BGRK,BGNK->BGRN", q_BTGRK[:, 0], ck.value)) * K ** -0.5
        if bias_fn(positions_BT, positions_BT) is not None:  # per-head slot positions: head g's bias from its own
            per = jax.vmap(lambda p: bias_fn(positions_BT, p), in_axes=1, out_axes=0)(jnp.clip(state.pos, 0))
            z = z + jnp.stack([per[g][:, g] for g in range(G)], axis=1)[:, :, :, 0]
        valid = state.pos >= 0
        if self.window_mask:
            valid &= (t - state.pos) < self.window_mask
        z_masked = jnp.where(valid[:, :, None], z, NEG_INF)
        probs = jax.nn.softmax(z_masked, axis=-1)
        o = jnp.einsum("BGRN,BGNK->BGRK", probs.astype(cv.value.dtype), cv.value)
        state = kp.observe(pol, state, z.sum(2), probs.sum(2))
        spos.value, sscore.value, swin.value = state
        return o[:, None]

    def _fill(self, ck, cv, spos, sscore, swin, k_BSGK, v_BSGK, pos_BS, seg_BS, zsum_BGTS, psum_BGTS, N):
        """Keeps the policy's prompt slots (``kv_policies.prefill_state``) and their keys/values."""
        from icml_jax.models import kv_policies as kp
        B, S, G, K = k_BSGK.shape
        valid = jnp.broadcast_to((seg_BS > 0)[:, None], (B, G, S))
        pos = jnp.broadcast_to(pos_BS[:, None], (B, G, S))
        idx, state = kp.prefill_state(self.policy, N, pos, valid, zsum_BGTS, psum_BGTS)  # idx [B, G, n]
        n = idx.shape[-1]
        fill = lambda x: jnp.concatenate(  # noqa: E731
            [x, jnp.zeros(x.shape[:2] + (N - n,) + x.shape[3:], x.dtype)], axis=2) if N > n else x
        ck.value = fill(jnp.take_along_axis(jnp.swapaxes(k_BSGK, 1, 2), idx[..., None], axis=2).astype(ck.value.dtype))
        cv.value = fill(jnp.take_along_axis(jnp.swapaxes(v_BSGK, 1, 2), idx[..., None], axis=2).astype(cv.value.dtype))
        spos.value, sscore.value, swin.value = state


class Attention(nn.Module):
    cfg: ml_collections.ConfigDict
    decode: bool = False
    edits: tuple = ()  # this layer's hook edits (models/hooks.py): attn_heads

    def setup(self):
        c = self.cfg
        if c.num_heads % c.num_kv_heads:
            raise ValueError(f"config.model.num_heads={c.num_heads} must be a multiple of "
                             f"config.model.num_kv_heads={c.num_kv_heads}")
        G, R, K = c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim
        impl = c.get("attention_impl", "einsum")
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"config.model.attention_impl={impl!r}; choose one of {sorted(ATTENTION_IMPLS)}")
        self.impl = ATTENTION_IMPLS[impl]
        pdt = get_dtype(c.param_dtype, "config.model.param_dtype")
        init = nn.initializers.normal(c.init_std)
        self.dtype = get_dtype(c.dtype)
        self.position = POSITIONS.get(c.position)(c)
        self.w_qkv = param(self, "qkv", init, (c.d_model, G, R + 2, K),
                           ("embed", "kv_heads", None, "head_dim"), pdt)
        if c.qkv_bias:
            self.b_qkv = param(self, "qkv_bias", nn.initializers.zeros, (G, R + 2, K),
                               ("kv_heads", None, "head_dim"), pdt)
        self.w_out = param(self, "out", init, (G, R, K, c.d_model),
                           ("kv_heads", None, "head_dim", "embed"), pdt)
        self.lowrank = lowrank.attention_factors(self, c, G, R, K, pdt)  # None unless TLR
        if self.decode:
            policy = kv_policy_of(c)
            self.kv_cache = (KVCache() if policy is None
                             else PolicyKVCache(policy, c.sliding_window))

    def project_qkv(self, x_BTD):
        """x [B, T, D] -> q [B, T, G, R, K], k [B, T, G, K], v [B, T, G, K]."""
        R = self.cfg.num_heads // self.cfg.num_kv_heads
        qkv_BTGCK = matmul(x_BTD.astype(self.dtype), self.w_qkv.astype(self.dtype))
        if self.cfg.qkv_bias:
            qkv_BTGCK = qkv_BTGCK + self.b_qkv.astype(self.dtype)
        q_BTGRK, k_BTGK, v_BTGK = qkv_BTGCK[:, :, :, :R], qkv_BTGCK[:, :, :, R], qkv_BTGCK[:, :, :, R + 1]
        if self.lowrank is not None:
            dq, dk, dv = lowrank.qkv_deltas(self.lowrank, x_BTD.astype(self.dtype))
            q_BTGRK, k_BTGK, v_BTGK = q_BTGRK + dq, k_BTGK + dk, v_BTGK + dv
        q_BTGRK = constrain(q_BTGRK, ("batch", "length", "act_kv_heads", None, None))
        return q_BTGRK, k_BTGK, v_BTGK

    def attend(self, q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias=None, causal_rows=False):
        """Softmax attention in float32 logits; returns [B, T, G, R, K] in the compute dtype.
        With ``attention_impl`` "xla" / "cudnn", ``jax.nn.dot_product_attention`` computes it
        (query head g*R + r uses kv head g there too; the mask and bias are passed as [B, 1, T, S]
        and [B, G*R, T, S]; cuDNN turns the mask into an additive bias, so packed documents and
        sliding windows work there too, at the cost of reading a [B, 1, T, S] bias).

        ``causal_rows``: the keys are the queries' own T slots in order (training / scoring
        without a cache), so with ``config.model.attention_block`` = c the einsum path splits the
        queries into T/c blocks and skips the key blocks every query of a block is causally masked
        from: the same numbers (masked probabilities are exactly 0) at ~(n+1)/2n of the attention
        work for n blocks."""
        B, T, G, R, K = q_BTGRK.shape
        if self.impl is not None:
            S = k_BSGK.shape[1]
            b = None if bias is None else jnp.broadcast_to(bias, (B, G, R, T, S)).reshape(B, G * R, T, S)
            if b is not None and self.impl == "cudnn":  # cuDNN takes the bias in the input dtype
                b = b.astype(q_BTGRK.dtype)
            o = jax.nn.dot_product_attention(q_BTGRK.reshape(B, T, G * R, K), k_BSGK, v_BSGK, bias=b,
                                             mask=mask_BTS[:, None], implementation=self.impl)
            return o.reshape(B, T, G, R, K)
        if self.decode and not causal_rows:  # queries against the KV cache
            return _decode_attend(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias)
        if causal_rows:
            return causal_attention(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias,
                                    query_block_count(self.cfg, T, k_BSGK.shape[1]))
        return _softmax_attend(q_BTGRK, k_BSGK, v_BSGK, mask_BTS, bias)

    def project_out(self, o_BTGRK):
        # one [B*T, G*R*K] x [G*R*K, D] matmul (G, tensor-sharded, stays the merged axis' major
        # part): for the einsum, XLA copied the whole transposed W_O at every decode step
        B, T, G, R, K = o_BTGRK.shape
        y_BTD = matmul(o_BTGRK.reshape(B, T, G * R * K), self.w_out.astype(o_BTGRK.dtype).reshape(G * R * K, -1))
        return y_BTD if self.lowrank is None else y_BTD + lowrank.out_delta(self.lowrank, o_BTGRK)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT):
        if self.is_mutable_collection("intermediates"):  # analysis only (pruning calibration)
            self.sow("intermediates", "attn_in", x_BTD)
        q, k, v = self.project_qkv(x_BTD)
        q, k = self.position(q, k, positions_BT, positions_BT)
        if self.decode and isinstance(self.kv_cache, PolicyKVCache):
            o = self.kv_cache(q, k, v, positions_BT, segment_ids_BT, self.position.bias)
            return self.project_out(hooks.point(self, "attn_heads", o.astype(q.dtype), self.edits))
        if self.decode:
            k, v, k_pos, k_seg, q_idx, k_idx = self.kv_cache(k, v, positions_BT, segment_ids_BT)
        else:
            k_pos, k_seg = positions_BT, segment_ids_BT
            q_idx = k_idx = jnp.broadcast_to(jnp.arange(x_BTD.shape[1]), positions_BT.shape)
        mask = attention_mask(segment_ids_BT, k_seg, q_idx, k_idx, positions_BT, k_pos,
                              self.cfg.sliding_window)
        bias = self.position.bias(positions_BT, k_pos)
        o = self.attend(q, k, v, mask, bias, causal_rows=not self.decode)
        o = hooks.point(self, "attn_heads", o, self.edits)
        if self.is_mutable_collection("intermediates"):
            self.sow("intermediates", "attn_out_in", o)
        return self.project_out(o)
