"""Batched KV-cache decoding: one prefill call, then a one-token loop inside ``jax.lax.while_loop``.

    out = generate(model_cfg, params, [[1, 5, 9], [1, 7]], key=jax.random.key(0),
                   max_new_tokens=32, temperature=0.8, top_p=0.95, stop_tokens=(2,))
    out.tokens   # [B, max_new] int32 numpy; ``pad_id`` after a row's stop token
    out.lengths  # [B] tokens generated per row (the stop token included)

Axis letters: B batch, P padded prompt length (a bucket), N max new tokens, S = P + N cache slots,
V vocab.

Prompts are LEFT-padded to a bucket (a multiple of 16, or of 64 above 256 tokens) so that every
row's last prompt token sits in the same slot and one compile serves all prompt lengths in the
bucket. Pads carry segment id 0 (never attended by real tokens), real tokens segment 1, and
positions count real tokens only, so a padded row decodes exactly as it would alone. The cache is
the model's own ``cache`` collection (``build_model(cfg, decode=True)``), sized S; position
embeddings, sliding windows and qkv biases all live inside the model, so nothing here depends on
them. Logits and log-probs are float32.

Compiles once per (model config, B, P, N, sampling mode); temperature, top-p and top-k values are
traced, only whether each filter is on is static.

Sparse inference. ``sparsity`` (a thresholds tree from ``analysis.sparsity.thresholds_tree``, or
any ``sparsity`` collection) is passed to every ``model.apply``, prefill and decode steps alike, so
each MLP applies its CETT (or FAT) zeroing rule: the masked dense MLP of ``models/mlp.py``. With
``sparse_capacity`` = C > 0 as well (batch 1, gated MLPs only), ``sparse_ffn.add_gather_rows`` lays
out the row-contiguous [F, D] gate/up rows and norms ONCE per call, inside the jit but before the
while loop, and the one-token decode steps take the gathered path of ``models/sparse_ffn.py``
(exact: same tokens and logits as C = 0 up to float summation order; more than C candidates fall
back to the masked dense computation). The prefill stays the masked dense MLP. C is static (it
lives in the model config, ``config.model.mlp.sparse_capacity``) and changing it recompiles.
``return_sparse_stats`` reports, per decode step and MLP, whether the gathered branch ran.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from icml_jax.models import hooks, sparse_ffn
from icml_jax.models.decoder import build_model, split_layers, unrolled
from icml_jax.models.layers import layer_order_key
from icml_jax.models.mlp import is_gated
from icml_jax.xla_env import decode_jit

NEG_INF = -1e30


class GenerateOutput(NamedTuple):
    tokens: np.ndarray  # [B, N] int32; pad_id after a row stopped (and after N if it ended early)
    lengths: np.ndarray  # [B] int32 generated tokens per row, a hit stop token included
    logprobs: np.ndarray | None  # [B, N] float32 log p(token) under the raw model (T=1, unfiltered)
    logits: np.ndarray | None = None  # [B, N, V] float32 raw logits per step (return_logits=True)
    # return_sparse_stats=True: {"sparse" bool, "candidates" int32, "kept" int32}, each [N - 1, M]
    # for the decode steps (token 1 on; the prefill is never gathered) x the M gathered MLPs in
    # layer order; "sparse" = the gathered branch ran (False: fallback, or the step never ran,
    # then candidates = kept = -1)
    sparse_stats: dict | None = None


class SamplerMode(NamedTuple):
    """The static part of the sampler (changing it recompiles); the values are traced."""
    greedy: bool
    use_top_k: bool
    use_top_p: bool


# ----------------------------------------------------------------------------- sampling filters

def top_k_filter(logits_BV: jax.Array, k) -> jax.Array:
    """Keeps the k largest logits of each row (ties at the k-th value kept), others -> NEG_INF.

    ``k`` may be traced (an int array); k <= 0 or k >= V keeps everything."""
    V = logits_BV.shape[-1]
    k = jnp.clip(jnp.asarray(k, jnp.int32), 1, V)
    kth = jnp.take(jnp.sort(logits_BV, axis=-1), V - k, axis=-1)  # k-th largest, [B]
    keep = jnp.where(jnp.asarray(k) >= V, True, logits_BV >= kth[..., None])
    return jnp.where(keep, logits_BV, NEG_INF)


def top_p_filter(logits_BV: jax.Array, p) -> jax.Array:
    """Nucleus filter: keeps the smallest set of most likely tokens whose probability mass is
    >= p (always at least the top token); the others -> NEG_INF. ``p`` may be traced."""
    sorted_BV = jnp.sort(logits_BV, axis=-1)[..., ::-1]  # descending
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_sorted_BV = mass_before_BV < p  # token i is needed while the mass before it is < p
    keep_sorted_BV = keep_sorted_BV.at[..., 0].set(True)
    threshold_B = jnp.min(jnp.where(keep_sorted_BV, sorted_BV, jnp.inf), axis=-1)
    return jnp.where(logits_BV >= threshold_B[..., None], logits_BV, NEG_INF)


def sample_logits(key, logits_BV, mode: SamplerMode, temperature, top_k, top_p) -> jax.Array:
    """Next token ids [B] (int32) from float32 logits [B, V]."""
    logits_BV = logits_BV.astype(jnp.float32)
    if mode.greedy:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if mode.use_top_k:
        logits_BV = top_k_filter(logits_BV, top_k)
    if mode.use_top_p:
        logits_BV = top_p_filter(logits_BV, top_p)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the jitted core

def init_cache(model, batch: int, size: int):
    """The model's zero ``cache`` collection for [batch, size] (shapes from ``eval_shape``, so no
    dummy forward or param init is ever run)."""
    dummy = jnp.zeros((batch, size), jnp.int32)
    # a model without softmax attention (e.g. a Puzzle child of linear / no-op layers) has none
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), dummy).get("cache", {}))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _gather_stats(intermediates) -> dict:
    """The sown ``sparse_ffn_stats`` of one step: {"sparse", "candidates", "kept"}, each [M]
    (scanned layers contribute [L] each), MLPs in layer order."""
    leaves = jax.tree_util.tree_flatten_with_path(intermediates)[0]
    found: dict = {}
    for path, v in sorted(leaves, key=lambda kv: layer_order_key(kv[0])):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if "sparse_ffn_stats" in keys:
            found.setdefault(keys[-1], []).append(jnp.reshape(v, (-1,)))
    return {k: jnp.concatenate(v) for k, v in found.items()}


@decode_jit(static_argnames=("model", "max_new", "mode", "return_logits", "return_stats", "split"))
def _generate(model, params, sparsity, tokens_BP, positions_BP, segments_BP, key, temperature, top_k,
              top_p, stop_tokens, pad_id, edit_args, *, max_new: int, mode: SamplerMode, return_logits: bool,
              return_stats: bool = False, split: int = 0):
    B, P = tokens_BP.shape
    # a scanned model's stacked layers, split once, before the loop (``decoder.unrolled``)
    params, sparsity = split_layers(params, split), split_layers(sparsity, split)
    model = hooks.bind_model(model, edit_args)
    cache = init_cache(model, B, P + max_new)
    variables = {"params": params}
    if sparsity is not None:
        if model.cfg.mlp.sparse_capacity:  # row-contiguous weights, once, outside the loop
            sparsity = sparse_ffn.add_gather_rows(params, sparsity)
        variables["sparsity"] = sparsity

    def forward(cache, tok_BT, pos_BT, seg_BT, stats=False):
        mutable = ["cache", "intermediates"] if stats else ["cache"]
        logits_BTV, mut = model.apply({**variables, "cache": cache}, tok_BT, pos_BT, seg_BT,
                                      last_only=True, mutable=mutable)
        out = (logits_BTV[:, -1].astype(jnp.float32), mut["cache"])
        return out + (_gather_stats(mut.get("intermediates", {})),) if stats else out

    def emit(state, logits_BV, key, i):
        """Samples token i from logits and records it; rows already done emit pad."""
        out, lps, lgs, done, lengths = state
        tok = sample_logits(key, logits_BV, mode, temperature, top_k, top_p)
        tok = jnp.where(done, pad_id, tok)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, -1), tok[:, None], -1)[:, 0]
        out = out.at[:, i].set(tok)
        lps = lps.at[:, i].set(jnp.where(done, 0.0, lp))
        if return_logits:
            lgs = lgs.at[:, i].set(logits_BV)
        lengths = lengths + (~done).astype(jnp.int32)
        done = done | jnp.isin(tok, stop_tokens)
        return tok, (out, lps, lgs, done, lengths)

    logits_BV, cache = forward(cache, tokens_BP, positions_BP, segments_BP)
    V = logits_BV.shape[-1]
    state = (jnp.full((B, max_new), pad_id, jnp.int32), jnp.zeros((B, max_new), jnp.float32),
             jnp.zeros((B, max_new, V) if return_logits else (0,), jnp.float32),
             jnp.zeros((B,), bool), jnp.zeros((B,), jnp.int32))
    key, sub = jax.random.split(key)
    tok, state = emit(state, logits_BV, sub, 0)
    next_pos = jnp.max(positions_BP, axis=1) + 1  # [B]: one past each row's last real token

    def step(cache, tok, i):
        pos = (next_pos + i - 1)[:, None]
        return forward(cache, tok[:, None], pos, jnp.ones((B, 1), jnp.int32), stats=return_stats)

    stats = {}
    if return_stats:  # [N - 1, M] per stat, shapes from one abstract step
        shapes = jax.eval_shape(lambda c, t: step(c, t, jnp.int32(1))[2], cache, tok)
        stats = {k: jnp.full((max(max_new - 1, 0),) + s.shape, False if s.dtype == bool else -1, s.dtype)
                 for k, s in shapes.items()}

    def cond(carry):
        i, _, _, _, state, _ = carry
        return (i < max_new) & ~jnp.all(state[3])

    def body(carry):
        i, cache, tok, key, state, stats = carry
        logits_BV, cache, *step_stats = step(cache, tok, i)
        if return_stats:
            stats = {k: v.at[i - 1].set(step_stats[0][k]) for k, v in stats.items()}
        key, sub = jax.random.split(key)
        tok, state = emit(state, logits_BV, sub, i)
        return i + 1, cache, tok, key, state, stats

    *_, state, stats = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, tok, key, state, stats))
    out, lps, lgs, _, lengths = state
    return out, lengths, lps, lgs, stats


# ----------------------------------------------------------------------------- teacher-forced scoring

@decode_jit(static_argnames=("model", "prompt_len", "split"))
def _scored(model, params, tokens_BT, edit_args, *, prompt_len: int, split: int = 0):
    """(log p(token_i | tokens_<i) [B, T - 1], the argmax token at each of those steps [B, T - 1])."""
    model = hooks.bind_model(model, edit_args)
    params = split_layers(params, split)
    B, T = tokens_BT.shape
    P = prompt_len
    cache = init_cache(model, B, T)
    pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg_BT = jnp.ones((B, T), jnp.int32)
    logits_BPV, mut = model.apply({"params": params, "cache": cache}, tokens_BT[:, :P], pos_BT[:, :P],
                                  seg_BT[:, :P], mutable=["cache"])
    lp_prompt = jnp.take_along_axis(jax.nn.log_softmax(logits_BPV[:, :-1].astype(jnp.float32), -1),
                                    tokens_BT[:, 1:P, None], -1)[..., 0]  # [B, P - 1]
    top_prompt = jnp.argmax(logits_BPV[:, :-1], -1).astype(jnp.int32)

    def body(carry, i):
        cache, last_BV = carry
        tok_B = jax.lax.dynamic_index_in_dim(tokens_BT, i, axis=1, keepdims=False)
        lp_B = jnp.take_along_axis(jax.nn.log_softmax(last_BV, -1), tok_B[:, None], -1)[:, 0]
        logits, mut = model.apply({"params": params, "cache": cache}, tok_B[:, None],
                                  jax.lax.dynamic_slice_in_dim(pos_BT, i, 1, axis=1),
                                  jnp.ones((B, 1), jnp.int32), last_only=True, mutable=["cache"])
        return (mut["cache"], logits[:, -1].astype(jnp.float32)), (lp_B, jnp.argmax(last_BV, -1).astype(jnp.int32))

    _, (lps, tops) = jax.lax.scan(body, (mut["cache"], logits_BPV[:, -1].astype(jnp.float32)),
                                  jnp.arange(P, T))
    return jnp.concatenate([lp_prompt, lps.T], axis=1), jnp.concatenate([top_prompt, tops.T], axis=1)


def scored_decode(model_cfg: ml_collections.ConfigDict, params, tokens, *, prompt_len: int,
                  kv_policy=None, return_argmax: bool = False, edits=None):
    """Teacher-forced scoring through the decode cache: the first ``prompt_len`` tokens of each
    row are one prefill, then every later token is fed one at a time through the cached step (with
    ``kv_policy``'s evictions, if any). Returns log p(token_i | tokens_<i) [B, T - 1] float32 for
    i = 1..T-1, the quantity a full forward gives when nothing is evicted. ``tokens`` [B, T] int,
    all rows real tokens (no padding). ``return_argmax``: also the model's most likely token at
    each of those steps (int32 [B, T - 1]; accuracy = ``argmax == tokens[:, 1:]``). ``edits``:
    hook edits applied in the prefill and every step (``models/hooks.py``)."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or not 1 <= prompt_len < tokens.shape[1]:
        raise ValueError(f"scored_decode: tokens must be [B, T] with 1 <= prompt_len < T; got shape "
                         f"{tokens.shape} and prompt_len={prompt_len}")
    if tokens.shape[1] > model_cfg.max_seq_len:
        raise ValueError(f"scored_decode: {tokens.shape[1]} tokens exceed the model's max_seq_len="
                         f"{model_cfg.max_seq_len}")
    model_cfg, split = unrolled(model_cfg)
    if kv_policy is not None:
        model_cfg = _with_kv_policy(model_cfg, kv_policy)
    model, edit_args = hooks.split_model(build_model(model_cfg, decode=True, edits=edits))
    lps, tops = _scored(model, params, jnp.asarray(tokens), edit_args, prompt_len=int(prompt_len), split=split)
    return (np.asarray(lps), np.asarray(tops)) if return_argmax else np.asarray(lps)


# ----------------------------------------------------------------------------- host-side driver

def bucket_length(n: int) -> int:
    """Prompt bucket: n rounded up to a multiple of 16 (of 64 above 256)."""
    step = 16 if n <= 256 else 64
    return -(-n // step) * step


def pad_prompts(prompts_tokens: Sequence[Sequence[int]], length: int, pad_id: int = 0):
    """Left-pads to ``length``: tokens, positions (0 at each first real token) and segment ids
    (0 = pad, 1 = real), each int32 [B, length]."""
    B = len(prompts_tokens)
    tokens = np.full((B, length), pad_id, np.int32)
    positions = np.zeros((B, length), np.int32)
    segments = np.zeros((B, length), np.int32)
    for b, p in enumerate(prompts_tokens):
        n = len(p)
        if n:
            tokens[b, length - n:] = np.asarray(p, np.int32)
            positions[b, length - n:] = np.arange(n, dtype=np.int32)
            segments[b, length - n:] = 1
    return tokens, positions, segments


def _validate(model_cfg, prompts_tokens, max_new_tokens, max_len, temperature, top_k, top_p):
    if not prompts_tokens:
        raise ValueError("generate: no prompts given")
    lengths = [len(p) for p in prompts_tokens]
    if min(lengths) == 0:
        raise ValueError(f"generate: prompt {lengths.index(0)} is empty; every prompt needs at "
                         "least one token (e.g. the tokenizer's bos_id)")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate: need temperature >= 0 (0 = greedy), top_k >= 0 (0 = off) and "
                         f"0 < top_p <= 1; got temperature={temperature}, top_k={top_k}, "
                         f"top_p={top_p}")
    limit = model_cfg.max_seq_len if max_len is None else min(max_len, model_cfg.max_seq_len)
    longest = max(lengths)
    if longest + max_new_tokens > limit:
        which = (f"max_len={max_len}" if max_len is not None and max_len < model_cfg.max_seq_len
                 else f"the model's max_seq_len={model_cfg.max_seq_len}")
        raise ValueError(
            f"generate: the longest prompt ({longest} tokens, prompt {lengths.index(longest)}) + "
            f"max_new_tokens ({max_new_tokens}) = {longest + max_new_tokens} exceeds {which}; "
            "shorten the prompt or ask for fewer new tokens")
    vocab = model_cfg.vocab_size
    bad = [t for p in prompts_tokens for t in p if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"generate: token ids {bad[:5]} are outside the model's vocab [0, {vocab})")
    return longest, limit


def generate(model_cfg: ml_collections.ConfigDict, params, prompts_tokens: Sequence[Sequence[int]], *,
             key: jax.Array, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             max_len: int | None = None, return_logits: bool = False, sparsity: dict | None = None,
             sparse_capacity: int | None = None, return_sparse_stats: bool = False,
             kv_policy=None, edits=None) -> GenerateOutput:
    """Continues each prompt (token ids) with KV-cache decoding.

    Args:
        model_cfg: ``config.model`` (the decode-mode model is built from it).
        params: the model's params pytree (``{"params": ...}`` contents).
        prompts_tokens: B lists of token ids, each non-empty, any lengths.
        key: a ``jax.random`` key; split once per step (unused when greedy).
        max_new_tokens: N, tokens generated per row at most.
        temperature: 0 = greedy (argmax), else logits / temperature are sampled.
        top_k: keep only the k most likely tokens (0 = off).
        top_p: nucleus sampling, keep the smallest set with mass >= top_p (1 = off).
        stop_tokens: ids that end a row (the stop token is emitted; pads follow).
        pad_id: id emitted after a row stopped; also fills the left padding of prompts.
        max_len: optional cap on prompt + new tokens (besides the model's max_seq_len).
        return_logits: also return the raw float32 logits of every step [B, N, V] (debugging).
        sparsity: a ``sparsity`` collection for every forward, e.g. ``thresholds_tree(model_cfg,
            per_layer_thresholds)`` (``layer_i/mlp/threshold`` or scanned ``layers/mlp/threshold``
            [L]): the CETT zeroing rule in the prefill and every decode step (masked dense MLP).
        sparse_capacity: C > 0 runs the batch-1 decode steps' MLPs on the gathered path of
            ``models/sparse_ffn.py`` (C static candidate neurons, dense fallback above; e.g.
            ``sparse_ffn.capacity_for(ratio, F)``); needs ``sparsity``, a gated MLP and one prompt.
            None = ``model_cfg.mlp.sparse_capacity`` (0 when absent); 0 = masked dense.
        return_sparse_stats: also return ``sparse_stats`` (see ``GenerateOutput``).
        kv_policy: a ``kv_policies.KVPolicy`` for the decode cache (None = ``model_cfg.kv_policy``,
            the full cache by default): streaming / h2o / morphkv keep ``slots`` per KV head and
            evict every step once full; snapkv compresses the prompt to ``slots`` and then grows.
        edits: hook edits (``models/hooks.Edits`` or a dict ``{"layer_i/point": fn}``), applied in
            the prefill and at every decode step (whose T is 1: the current token).

    Returns:
        ``GenerateOutput(tokens [B, N], lengths [B], logprobs [B, N], logits)`` as numpy.
    """
    longest, limit = _validate(model_cfg, prompts_tokens, max_new_tokens, max_len, temperature,
                               top_k, top_p)
    P = max(longest, min(bucket_length(longest), limit - max_new_tokens))
    tokens, positions, segments = pad_prompts(prompts_tokens, P, pad_id)
    greedy = temperature == 0
    mode = SamplerMode(greedy=greedy, use_top_k=not greedy and top_k > 0,
                       use_top_p=not greedy and top_p < 1.0)
    stops = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
    model_cfg, split = unrolled(model_cfg)
    model_cfg = _with_capacity(model_cfg, sparse_capacity, sparsity, len(prompts_tokens))
    if kv_policy is not None:
        model_cfg = _with_kv_policy(model_cfg, kv_policy)
    model, edit_args = hooks.split_model(build_model(model_cfg, decode=True, edits=edits))
    out, lengths, lps, lgs, stats = _generate(
        model, params, sparsity, tokens, positions, segments, key,
        jnp.float32(temperature if not greedy else 1.0), jnp.int32(top_k), jnp.float32(top_p),
        stops, jnp.int32(pad_id), edit_args, max_new=int(max_new_tokens), mode=mode,
        return_logits=return_logits, return_stats=return_sparse_stats, split=split)
    return GenerateOutput(np.asarray(out), np.asarray(lengths), np.asarray(lps),
                          np.asarray(lgs) if return_logits else None,
                          {k: np.asarray(v) for k, v in stats.items()} if return_sparse_stats else None)


def _with_kv_policy(model_cfg, policy):
    """``model_cfg`` (a copy) with ``kv_policy`` set from a ``KVPolicy``, after the checks."""
    import dataclasses
    if policy.name != "full" and policy.name != "snapkv" and policy.slots < 1:
        raise ValueError(f"generate: kv_policy {policy.name!r} needs slots >= 1, got {policy.slots}")
    if model_cfg.get("residual", "standard") != "standard" and policy.name != "full":
        raise ValueError(f"generate: kv_policy {policy.name!r} is for the transformer's attention; "
                         f"config.model.residual={model_cfg.residual!r} has its own cache")
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.kv_policy = ml_collections.ConfigDict(dataclasses.asdict(policy))
    return cfg


def _with_capacity(model_cfg, sparse_capacity, sparsity, batch: int):
    """``model_cfg`` with ``mlp.sparse_capacity`` set (a copy when it changes), after the checks."""
    current = int(model_cfg.mlp.sparse_capacity or 0)
    capacity = current if sparse_capacity is None else int(sparse_capacity)
    if capacity:
        if sparsity is None:
            raise ValueError(f"generate: sparse_capacity={capacity} needs a sparsity tree (thresholds)")
        if not is_gated(model_cfg.mlp.activation):
            raise ValueError(f"generate: sparse_capacity={capacity} needs a gated MLP (relu_glu or "
                             f"swiglu), not {model_cfg.mlp.activation!r}")
        if not 0 < capacity <= model_cfg.ffn_dim:
            raise ValueError(f"generate: sparse_capacity={capacity} must lie in [0, ffn_dim={model_cfg.ffn_dim}]")
        if batch != 1:
            raise ValueError(f"generate: sparse_capacity={capacity} is for batch-1 decoding, got {batch} "
                             "prompts (use sparse_capacity=0: the masked dense path batches)")
    if capacity == current:
        return model_cfg
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.mlp.sparse_capacity = capacity
    return cfg
