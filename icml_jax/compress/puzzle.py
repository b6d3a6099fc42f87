"""Puzzle's block library (docs/methods/puzzle.md): blockwise local distillation (BLD) of every
variant of every layer, replace-1-block scoring, exact and measured costs, the library the MIP
(``puzzle_mip``) reads, and the child it picks as a heterogeneous decoder (``models/hetero.py``).

The parent is a homogeneous, unscanned decoder on the standard residual stream. A ``Variant`` is
one sub-block replacement: ``Variant("attention", G')`` (GQA with G' KV heads), ``Variant("ffn",
F')`` (width F'), or either part's ``"linear"`` / ``"noop"``. Its params are a sub-tree of a
hetero layer (``attn_norm`` + ``attn`` or ``mlp_norm`` + ``mlp``; nothing for no-op), stacked over
the L layers so that every layer's copy trains at once under ``vmap``.

BLD (the spec's L_BLD): each variant learns to reproduce its parent sub-block's output from the
parent's input to that sub-block, loss ||y_child - y_parent||^2 / ||y_parent||^2 over the valid
tokens of a batch; the parent runs once per step and every variant of every layer takes an Adam
step on the same batch (attention variants see the parent's attention inputs, FFN variants the
parent's FFN inputs, so A + F runs cost what one would, not A * F). Initialisation: the parent's
own block for its own size; ``puzzle_blocks`` for fewer KV heads (group means) and a smaller FFN
(channel ranking on calibration activations); W_v W_o for linear attention; the least-squares map
from the normed inputs to the parent FFN's outputs for a linear FFN.

Scoring: score(l, (a, f)) = mean over valid held-out tokens of KL(p_parent || p_swap), where p_swap
is the parent with layer l's attention replaced by a and its FFN by f (``joint``, the default, one
score per pair), or the sum of the two single swaps (``summed``); ``lm_loss`` is the swapped
model's NLL instead. One compiled function per pair of kinds; the layer is a traced index (the
parent's other layers run as a scan, those below l masked off), so the compile count does not grow
with depth.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax.core import meta

from icml_jax.compress import puzzle_blocks as blocks
from icml_jax.losses.logps import token_logprobs
from icml_jax.models import hetero
from icml_jax.models.positions import position_param_count
from icml_jax.models.residual import StandardIO

ATTN, FFN = "attention", "ffn"


@dataclasses.dataclass(frozen=True)
class Variant:
    part: str  # "attention" | "ffn"
    kind: object  # int (KV heads / width) | "linear" | "noop"

    @property
    def name(self) -> str:
        if isinstance(self.kind, int):
            return f"kv{self.kind}" if self.part == ATTN else f"ffn{self.kind}"
        return f"{'attn' if self.part == ATTN else 'ffn'}_{self.kind}"

    def is_parent(self, m) -> bool:
        return self.kind == (m.num_kv_heads if self.part == ATTN else m.ffn_dim)


def _kind(k, part: str):
    """A variant entry as ``config.model.blocks`` reads it: a positive integer (also given as a
    string, as a command line gives it), "linear" or "noop"."""
    text = str(k).strip()
    if text in hetero.KINDS:
        return text
    if isinstance(k, bool) or not text.isdigit() or int(text) < 1 or (isinstance(k, float) and k != int(k)):
        raise ValueError(f"{part} variant {k!r}: use a positive integer "
                         f"({'KV heads' if part == ATTN else 'FFN width'}), 'linear' or 'noop'")
    return int(text)


def variants(m, attention: Sequence = (), ffn: Sequence = ()) -> list[Variant]:
    """The library's variants, the parent's own sizes always included (first). Raises ValueError
    for an entry that is not a positive integer / linear / noop, KV heads that do not divide the
    parent's, and widths above the parent's, before any compute."""
    out = [Variant(ATTN, m.num_kv_heads), Variant(FFN, m.ffn_dim)]
    for part, kinds in ((ATTN, attention), (FFN, ffn)):
        for k in kinds:
            v = Variant(part, _kind(k, part))
            if v not in out:
                out.append(v)
    for v in out:
        if v.part == ATTN and isinstance(v.kind, int) and (v.kind > m.num_kv_heads or m.num_kv_heads % v.kind):
            raise ValueError(f"attention variant {v.kind} KV heads must divide the parent's "
                             f"{m.num_kv_heads} (new heads are means of parent groups)")
        if v.part == FFN and isinstance(v.kind, int) and v.kind > m.ffn_dim:
            raise ValueError(f"FFN variant width {v.kind} exceeds the parent's {m.ffn_dim}")
    return out


def check_parent(m) -> None:
    """Raises ValueError unless ``m`` is a parent Puzzle can take apart."""
    if m.get("scan_layers", False) or m.get("residual", "standard") != "standard" or hetero.is_hetero(m) \
            or int(m.get("lowrank", 0) or 0):
        raise ValueError("Puzzle needs a homogeneous parent: an unscanned standard decoder "
                         "(config.model.scan_layers=False, residual='standard', blocks '' and lowrank=0)")
    if position_param_count(m):
        raise ValueError(f"Puzzle's variants cannot carry per-layer position params yet "
                         f"(config.model.position={m.position!r} has {position_param_count(m)} per layer); "
                         "use a parent with rope / alibi / nope")


def _plain_config(m) -> ml_collections.ConfigDict:
    """A mutable copy of ``m`` with ``blocks`` present and empty (old configs have no key)."""
    c = ml_collections.ConfigDict(m.to_dict())
    c.blocks = ml_collections.ConfigDict(dict(attention="", ffn=""))
    return c


def variant_config(m, v: Variant):
    """``config.model`` as the variant's module reads it."""
    c = _plain_config(m)
    if isinstance(v.kind, int):
        if v.part == ATTN:
            c.num_kv_heads = v.kind
        else:
            c.ffn_dim = v.kind
    c.scan_layers = False
    return ml_collections.FrozenConfigDict(c)


def module(m, v: Variant):
    """The Flax module of one variant: ``AttentionPart`` (h, positions, segments) or ``FfnPart`` (h)."""
    cls = hetero.AttentionPart if v.part == ATTN else hetero.FfnPart
    return cls(variant_config(m, v), v.kind)


def apply_variant(m, v: Variant, p, h, positions, segments):
    if v.kind == "noop":
        return jnp.zeros_like(h)
    mod = module(m, v)
    args = (h, positions, segments) if v.part == ATTN else (h,)
    return mod.apply({"params": p}, *args)


def parent_part(layer: Mapping, part: str) -> dict:
    """A parent layer's sub-block params (``attn_norm`` + ``attn`` or ``mlp_norm`` + ``mlp``)."""
    keys = ("attn_norm", "attn") if part == ATTN else ("mlp_norm", "mlp")
    return {k: layer[k] for k in keys}


def _layers(params, m) -> list[dict]:
    return [params[f"layer_{i}"] for i in range(m.num_layers)]


def stacked(trees: Sequence) -> dict:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def parent_io(m, params, batch) -> dict:
    """The parent's sub-block inputs and outputs, each [L, B, T, D]: ``attn_in`` (the stream before
    layer l), ``attn_out`` (what its attention adds), ``ffn_in`` and ``ffn_out``; plus ``logits``
    [B, T, V] and ``acts`` [L, B, T, F] (the FFN activations, for channel ranking)."""
    io = _io(m)
    h = io.apply({"params": params["io"]}, batch["inputs"])
    pos, seg = batch["positions"], batch["segment_ids"]
    A, F = Variant(ATTN, m.num_kv_heads), Variant(FFN, m.ffn_dim)
    ffn = hetero.FfnPart(variant_config(m, F), F.kind, with_acts=True)
    out = {k: [] for k in ("attn_in", "attn_out", "ffn_in", "ffn_out", "acts")}
    for layer in _layers(params, m):
        ya = apply_variant(m, A, parent_part(layer, ATTN), h, pos, seg)
        out["attn_in"].append(h)
        out["attn_out"].append(ya)
        h = h + ya
        yf, acts = ffn.apply({"params": parent_part(layer, FFN)}, h)
        out["ffn_in"].append(h)
        out["ffn_out"].append(yf)
        out["acts"].append(acts)
        h = h + yf
    res = {k: jnp.stack(v) for k, v in out.items()}
    res["logits"] = io.apply({"params": params["io"]}, h, method=StandardIO.unembed)
    return res


def _io(m):
    return StandardIO(ml_collections.FrozenConfigDict(m))


# ----------------------------------------------------------------------------- initialisation

def _normed(x_ND, scale, eps):
    x = np.asarray(x_ND, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def init_variant(m, layer: Mapping, v: Variant, calib: Mapping | None = None) -> dict:
    """One layer's variant params from the parent layer. ``calib`` (numpy, this layer's): ``acts``
    [N, F] for FFN shrink, ``ffn_in`` / ``ffn_out`` [N, D] for the linear FFN."""
    np_tree = lambda t: jax.tree.map(np.asarray, dict(t))  # noqa: E731
    if v.kind == "noop":
        return {}
    if v.is_parent(m):
        return np_tree(parent_part(layer, v.part))
    if v.part == ATTN:
        attn = np_tree(layer["attn"])
        if v.kind == "linear":
            qkv, out = attn["qkv"], attn["out"]  # [D, G, R+2, K], [G, R, K, D]
            w = np.einsum("DGK,GRKE->DE", qkv[:, :, -1], out)  # each token attending to itself
            new = {"kernel": w.astype(qkv.dtype)}
        else:
            new = blocks.merge_kv_heads(attn, v.kind)
        return {"attn_norm": np_tree(layer["attn_norm"]), "attn": new}
    if calib is None:
        raise ValueError(f"FFN variant {v.name} needs calibration activations (calib)")
    mlp = np_tree(layer["mlp"])
    if v.kind == "linear":
        x = _normed(calib["ffn_in"], layer["mlp_norm"]["scale"], m.norm_eps)
        w = np.linalg.lstsq(x, np.asarray(calib["ffn_out"], np.float64), rcond=None)[0]
        new = {"kernel": w.astype(mlp["wo"].dtype)}
    else:
        scores = blocks.ffn_channel_scores(calib["acts"], mlp["wo"])
        new = blocks.shrink_ffn(mlp, blocks.top_channels(scores, v.kind))
    return {"mlp_norm": np_tree(layer["mlp_norm"]), "mlp": new}


def calibration(m, params, batch) -> list[dict]:
    """Per layer, numpy ``acts`` / ``ffn_in`` / ``ffn_out`` over the batch's valid tokens."""
    io = _parent_io_fn(_frozen(m))(params, batch)
    valid = np.asarray(batch["segment_ids"]).reshape(-1) > 0
    flat = lambda x: np.asarray(x).reshape(-1, x.shape[-1])[valid]  # noqa: E731
    return [{k: flat(io[k][i]) for k in ("acts", "ffn_in", "ffn_out")} for i in range(m.num_layers)]


def init_library(m, params, library: Sequence[Variant], calib_batch) -> dict:
    """{variant name: params stacked over layers [L, ...]} (no-op variants: {})."""
    check_parent(m)
    params = meta.unbox(params)
    calib = calibration(m, params, calib_batch)
    return {v.name: stacked([init_variant(m, layer, v, c) for layer, c in zip(_layers(params, m), calib)])
            if v.kind != "noop" else {} for v in library}


# ----------------------------------------------------------------------------- BLD

def bld_loss(m, v: Variant, p, x, y, positions, segments) -> jax.Array:
    """L_BLD of one layer's variant: ||f(x) - y||^2 / ||y||^2 over the valid tokens."""
    w = (segments > 0).astype(jnp.float32)[..., None]
    pred = apply_variant(m, v, p, x, positions, segments).astype(jnp.float32)
    y = y.astype(jnp.float32)
    return jnp.sum(w * jnp.square(pred - y)) / jnp.maximum(jnp.sum(w * jnp.square(y)), 1e-30)


def bld_losses(m, params, library: Sequence[Variant], vparams: Mapping, batch) -> dict:
    """{variant name: L_BLD per layer [L]} on one batch (the parent's own sizes give 0)."""
    io = parent_io(m, params, batch)
    return _losses(m, library, vparams, io, batch)


def _losses(m, library, vparams, io, batch):
    out = {}
    for v in library:
        x, y = (io["attn_in"], io["attn_out"]) if v.part == ATTN else (io["ffn_in"], io["ffn_out"])
        fn = lambda p, x, y, v=v: bld_loss(m, v, p, x, y, batch["positions"], batch["segment_ids"])  # noqa: E731
        out[v.name] = jax.vmap(fn)(vparams[v.name], x, y) if vparams[v.name] else jax.vmap(
            lambda x, y, fn=fn: fn({}, x, y))(x, y)
    return out


def trainable(m, library: Sequence[Variant]) -> list[Variant]:
    """The variants BLD trains: not the parent's own blocks, not no-ops."""
    return [v for v in library if v.kind != "noop" and not v.is_parent(m)]


def train_bld(m, params, library: Sequence[Variant], vparams: Mapping, batches, *, steps: int,
              lr: float = 1e-3, warmup: int = 10, log_every: int = 0, log=print) -> tuple[dict, list]:
    """Trains every trainable variant of every layer for ``steps`` steps on ``batches`` (an iterator
    of LM batches) -> (trained vparams, [(step, {name: mean L_BLD over layers})])."""
    train = trainable(m, library)
    theta = {v.name: vparams[v.name] for v in train}
    if not theta:
        return dict(vparams), []
    schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, max(warmup, 1)),
                                     optax.cosine_decay_schedule(lr, max(steps - warmup, 1), 0.1)], [warmup])
    tx = optax.adam(schedule)
    opt = tx.init(theta)

    @jax.jit
    def step(theta, opt, params, batch):  # the parent is an argument: never an HLO constant
        io = parent_io(m, params, batch)
        io = jax.tree.map(jax.lax.stop_gradient, io)

        def loss(th):
            per = _losses(m, train, th, io, batch)
            return sum(jnp.sum(x) for x in per.values()), per

        (_, per), g = jax.value_and_grad(loss, has_aux=True)(theta)
        updates, opt = tx.update(g, opt, theta)
        return optax.apply_updates(theta, updates), opt, per

    history = []
    for i in range(steps):
        theta, opt, per = step(theta, opt, params, next(batches))
        if log_every and (i % log_every == 0 or i == steps - 1):
            row = {k: float(np.mean(np.asarray(v))) for k, v in per.items()}
            history.append((i, row))
            log(f"[bld] step {i}: " + " ".join(f"{k} {x:.3f}" for k, x in row.items()))
    return {**vparams, **theta}, history


# ----------------------------------------------------------------------------- scoring

def _frozen(m):
    return m if isinstance(m, ml_collections.FrozenConfigDict) else ml_collections.FrozenConfigDict(m)


@functools.lru_cache(maxsize=16)
def _parent_io_fn(m):
    """``parent_io`` jitted once per (frozen) model config, reused across calls."""
    return jax.jit(lambda p, b: parent_io(m, p, b))


@functools.lru_cache(maxsize=256)
def _swap_fn(m, a: Variant, f: Variant, score: str):
    """jitted (params, pa, pf, layer, batch, parent_logps) -> score summed over valid tokens, count."""
    A0, F0 = Variant(ATTN, m.num_kv_heads), Variant(FFN, m.ffn_dim)

    def fn(params, pa, pf, layer, batch, h_in, parent_logp):
        pos, seg = batch["positions"], batch["segment_ids"]
        h = h_in[layer]
        h = h + apply_variant(m, a, pa, h, pos, seg)
        h = h + apply_variant(m, f, pf, h, pos, seg)
        stack = stacked(_layers(params, m))

        def body(h, xs):
            i, lp = xs
            y = h + apply_variant(m, A0, parent_part(lp, ATTN), h, pos, seg)
            y = y + apply_variant(m, F0, parent_part(lp, FFN), y, pos, seg)
            return jnp.where(i > layer, y, h), None

        h, _ = jax.lax.scan(body, h, (jnp.arange(m.num_layers), stack))
        logits = _io(m).apply({"params": params["io"]}, h, method=StandardIO.unembed)
        w = (seg > 0).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        if score == "kl_div":
            per = jnp.sum(jnp.exp(parent_logp) * (parent_logp - logp), -1)
        else:
            per = -token_logprobs(logits, batch["targets"])
        return jnp.sum(per * w), jnp.sum(w)

    return jax.jit(fn)


def _pick(vparams, v: Variant, layer: int):
    return jax.tree.map(lambda x: x[layer], vparams[v.name]) if vparams[v.name] else {}


def score_pairs(m, params, vparams: Mapping, pairs: Sequence[tuple[Variant, Variant]], batch, *,
                score: str = "kl_div", layers: Sequence[int] | None = None) -> dict:
    """{(layer, a.name, f.name): score} for every layer and pair, on ``batch`` (one array batch)."""
    if score not in ("kl_div", "lm_loss"):
        raise ValueError(f"puzzle_score={score!r}: choose kl_div | lm_loss")
    io = _parent_io_fn(_frozen(m))(params, batch)
    parent_logp = jax.nn.log_softmax(io["logits"].astype(jnp.float32), -1)
    out = {}
    for a, f in pairs:
        fn = _swap_fn(_frozen(m), a, f, score)
        for layer in (range(m.num_layers) if layers is None else layers):
            s, n = fn(params, _pick(vparams, a, layer), _pick(vparams, f, layer), jnp.int32(layer), batch,
                      io["attn_in"], parent_logp)
            out[(layer, a.name, f.name)] = float(s) / max(float(n), 1.0)
    return out


# ----------------------------------------------------------------------------- costs and library

def variant_costs(m, v: Variant, bytes_per_value: int = 2) -> dict:
    """Exact {"params" (weights + norm), "kv_bytes" (per token)} of one layer's variant."""
    w, n = hetero.sub_block_params(m, v.kind, v.part)
    kv = hetero.sub_block_kv_bytes(m, v.kind, bytes_per_value) if v.part == ATTN else 0
    return {"params": w + n, "kv_bytes": kv}


def measure_latency(m, v: Variant, vparams: Mapping, batch: int, seq_len: int, repeats: int = 5) -> float:
    """Median seconds of the jitted variant on a [batch, seq_len, D] input (layer 0's params)."""
    if v.kind == "noop":
        return 0.0
    p = _pick(vparams, v, 0)
    h = jax.random.normal(jax.random.key(0), (batch, seq_len, m.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    fn = jax.jit(lambda p, h: apply_variant(m, v, p, h, pos, jnp.ones_like(pos)))
    fn(p, h).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(p, h).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def pair_name(a: Variant, f: Variant) -> str:
    return f"{a.name}+{f.name}"


def build_library(m, library: Sequence[Variant], scores: Mapping, *, scoring: str = "joint",
                  latency: Mapping | None = None, score_key: str = "kl_div") -> dict:
    """The MIP's library ``{layer: {"a+f": {"metrics": {score_key}, "stats": {params, kv_bytes,
    latency}}}}`` over every (attention, FFN) pair. ``joint``: ``scores`` holds every pair's own
    score; ``summed``: the attention swap's (with the parent FFN) plus the FFN swap's."""
    if scoring not in ("joint", "summed"):
        raise ValueError(f"puzzle_variant_scoring={scoring!r}: choose joint | summed")
    A0, F0 = Variant(ATTN, m.num_kv_heads), Variant(FFN, m.ffn_dim)
    attn = [v for v in library if v.part == ATTN]
    ffn = [v for v in library if v.part == FFN]
    lat = latency or {}
    out = {}
    for layer in range(m.num_layers):
        row = {}
        for a in attn:
            for f in ffn:
                if scoring == "joint":
                    s = scores[(layer, a.name, f.name)]
                else:
                    s = scores[(layer, a.name, F0.name)] + scores[(layer, A0.name, f.name)]
                ca, cf = variant_costs(m, a), variant_costs(m, f)
                row[pair_name(a, f)] = {"metrics": {score_key: s}, "stats": {
                    "params": ca["params"] + cf["params"], "kv_bytes": ca["kv_bytes"] + cf["kv_bytes"],
                    "latency": lat.get(a.name, 0.0) + lat.get(f.name, 0.0)}, "choice": (a.kind, f.kind)}
        out[layer] = row
    return out


def pairs_for(library: Sequence[Variant], scoring: str, m) -> list[tuple[Variant, Variant]]:
    """The swaps scoring must measure: every pair (joint) or each single swap (summed)."""
    attn = [v for v in library if v.part == ATTN]
    ffn = [v for v in library if v.part == FFN]
    if scoring == "joint":
        return [(a, f) for a in attn for f in ffn]
    A0, F0 = Variant(ATTN, m.num_kv_heads), Variant(FFN, m.ffn_dim)
    return [(a, F0) for a in attn] + [(A0, f) for f in ffn if f != F0]


# ----------------------------------------------------------------------------- the child

def child_config(m, choice: Sequence[tuple]):
    """``config.model`` of the child: ``choice`` is one (attention kind, FFN kind) per layer."""
    if len(choice) != m.num_layers:
        raise ValueError(f"a child needs one (attention, ffn) choice per layer ({m.num_layers}), got {len(choice)}")
    c = _plain_config(m)
    c.blocks.attention = ",".join(str(a) for a, _ in choice)
    c.blocks.ffn = ",".join(str(f) for _, f in choice)
    hetero.validate(c)
    return c


def child_params(m, params, vparams: Mapping, choice: Sequence[tuple]) -> dict:
    """The child's params: the parent's embedding and final norm, layer l = its chosen variants'."""
    out = {"io": params["io"]}
    for layer, (a, f) in enumerate(choice):
        tree = {}
        for v in (Variant(ATTN, a), Variant(FFN, f)):
            if v.kind == "noop":
                continue
            if v.name not in vparams:
                raise ValueError(f"variant {v.name} is not in the block library")
            tree.update(_pick(vparams, v, layer))
        if tree:  # a no-op / no-op layer has no params at all
            out[f"layer_{layer}"] = tree
    return out


def uniform_choice(m, attention, ffn) -> list[tuple]:
    return [(attention, ffn)] * m.num_layers


def drop_choice(m, dropped: Sequence[int]) -> list[tuple]:
    """Layer dropping as a layout: no-op attention and FFN in the ``dropped`` layers."""
    return [("noop", "noop") if i in set(dropped) else (m.num_kv_heads, m.ffn_dim) for i in range(m.num_layers)]


def choice_costs(m, choice: Sequence[tuple]) -> dict:
    """{"params": block params, "kv_bytes": per token} of a layout (sums of its variants')."""
    tot = {"params": 0, "kv_bytes": 0}
    for a, f in choice:
        for v in (Variant(ATTN, a), Variant(FFN, f)):
            c = variant_costs(m, v)
            tot = {k: tot[k] + c[k] for k in tot}
    return tot
