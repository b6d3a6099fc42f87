"""Feature Flow (Laptev et al., ICML 2025; spec /work/shared/specs/feature_flow.md, §2, §4):
data-free matching of SAE features across layers, flow graphs, and interventions through hooks
(docs/methods/feature_flow.md, section "Matching, flow graphs and interventions").

SAEs are addressed by ``(layer, module)``; ``module`` is one of ``MODULES``:

  res   the residual stream leaving layer l (hook ``layer_{l}/resid_post``); layer -1 is the
        stream entering layer 0 (``layer_0/resid_pre``, the embeddings)
  mlp   what layer l's MLP adds (``layer_{l}/mlp_out``)
  att   what layer l's attention adds, after the output projection (``layer_{l}/attn_out``)

A decoder is an [M, D] matrix whose row j is feature j's direction (``models.sae.unit_decoder``);
rows are unit-normalised again here, so any row scale gives the same matches.

1. ``match``: for every feature of A its top-k features of B by cosine of decoder rows (the spec's
   top-1 "many-to-one" matching; ``match_matrix`` is the general form 1_{x>0}[topk(Ŵ_A Ŵ_Bᵀ)]);
   ``pearson_match``: the data-based alternative, by correlation of activations on shared tokens.
2. ``origins``: for every residual feature of layer L, its best predecessor in R_{L-1}, MLP_L and
   Attn_L with the similarity, and its class (``CLASSES``) from the per-layer thresholds.
3. ``flow_graph``: the origin matching applied backward from one feature, layer by layer: a list of
   ``Edge(target, source, similarity)`` with nodes ``(layer, module, index)``; the residual chain
   is cut where s(R) < t_R (0.5), module predecessors below t_mod (0.15) are dropped.
4. ``rescale_edits``: h ← h + (r − 1)·Σ_j a_j v_j at each node's hook point, a = the SAE's
   activations of h (r = 0 deactivates, r > 1 amplifies) — a ``hooks.Edits``.
5. ``steer_edits``: h ← h + s_ℓ·v at every token at each node's point (cumulative steering over a
   flow graph's nodes, or single-layer with one node), with the constant / exponential / linear
   schedules (``schedule``) and optional folding by a typical activation (``typical_activation``).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.models import hooks
from icml_jax.models.sae import unit_decoder

MODULES = ("res", "mlp", "att")
POINT_OF = {"res": "resid_post", "mlp": "mlp_out", "att": "attn_out"}
# class of a residual feature (spec §2: (A) carried over, (B) processed, (C) born, (D) unexplained);
# processed / born name the module whose match is higher among those above t_mod
CLASSES = ("carried", "processed_mlp", "processed_att", "born_mlp", "born_att", "unexplained")
T_RES, T_MOD = 0.5, 0.15  # spec §3: graph cutoffs t_R and the module similarity floor
SCHEDULES = ("constant", "exp", "linear")
EXP_ALPHA = -0.05


def hook_name(layer: int, module: str) -> str:
    """The hook point (models/hooks.py) an SAE of ``(layer, module)`` reads."""
    if module not in MODULES:
        raise ValueError(f"module {module!r}: choose one of {MODULES}")
    if layer == -1 and module == "res":
        return "layer_0/resid_pre"
    if layer < 0:
        raise ValueError(f"layer {layer} for module {module!r}: only 'res' has layer -1 (the embeddings)")
    return f"layer_{layer}/{POINT_OF[module]}"


def _unit(w) -> np.ndarray:
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2:
        raise ValueError(f"a decoder must be [M, D], got shape {w.shape}")
    return w / np.maximum(np.linalg.norm(w, axis=-1, keepdims=True), 1e-30)


# ----------------------------------------------------------------------------- matching
def cosine(dec_a, dec_b) -> np.ndarray:
    """[Ma, Mb] cosine similarities of the rows of two decoders (float64, clipped to [-1, 1])."""
    a, b = _unit(dec_a), _unit(dec_b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"decoders live in different spaces: D = {a.shape[1]} vs {b.shape[1]}")
    return np.clip(a @ b.T, -1.0, 1.0)


def match(dec_a, dec_b, k: int = 1, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """For each feature (row) of ``dec_a``, its ``k`` most similar features of ``dec_b``, best
    first: (index [Ma, k] int, similarity [Ma, k]). Ties go to the lower index. Row chunks of
    ``chunk`` keep memory at chunk × Mb."""
    a, b = _unit(dec_a), _unit(dec_b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"decoders live in different spaces: D = {a.shape[1]} vs {b.shape[1]}")
    if not 1 <= k <= b.shape[0]:
        raise ValueError(f"k={k} must be in [1, {b.shape[0]}]")
    idx, sim = [], []
    for s in range(0, a.shape[0], chunk):
        c = np.clip(a[s:s + chunk] @ b.T, -1.0, 1.0)
        top = np.argsort(-c, axis=1, kind="stable")[:, :k]
        idx.append(top)
        sim.append(np.take_along_axis(c, top, axis=1))
    return np.concatenate(idx), np.concatenate(sim)


def match_matrix(dec_a, dec_b, k: int = 1) -> np.ndarray:
    """The spec's general form T^(A→B) = 1_{x>0}[topk(Ŵ_A Ŵ_Bᵀ)]: bool [Ma, Mb], True at each row's
    top-k entries whose cosine is positive."""
    idx, sim = match(dec_a, dec_b, k)
    t = np.zeros((idx.shape[0], np.shape(dec_b)[0]), bool)
    np.put_along_axis(t, idx, sim > 0, axis=1)
    return t


def pearson(z_a, z_b, chunk: int = 4096) -> np.ndarray:
    """[Ma, Mb] Pearson correlations between the activations of two SAEs on the same N tokens
    (``z_a`` [N, Ma], ``z_b`` [N, Mb]; the spec's data-based alternative ``ff_match = pearson``).
    A feature that is constant on the tokens (e.g. never fires) correlates 0 with everything."""
    a = np.asarray(z_a, np.float64).reshape(-1, np.shape(z_a)[-1])
    b = np.asarray(z_b, np.float64).reshape(-1, np.shape(z_b)[-1])
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"pearson needs activations on the same tokens: {a.shape[0]} vs {b.shape[0]}")
    a, b = a - a.mean(0), b - b.mean(0)
    na, nb = np.linalg.norm(a, axis=0), np.linalg.norm(b, axis=0)
    a, b = a / np.where(na > 0, na, 1.0), b / np.where(nb > 0, nb, 1.0)
    return np.clip(np.concatenate([a[:, s:s + chunk].T @ b for s in range(0, a.shape[1], chunk)]), -1.0, 1.0)


def pearson_match(z_a, z_b, k: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``match`` by activation correlation instead of decoder cosine: for each feature of A its
    top-k features of B, best first (index [Ma, k], correlation [Ma, k]); ties to the lower index."""
    c = pearson(z_a, z_b)
    if not 1 <= k <= c.shape[1]:
        raise ValueError(f"k={k} must be in [1, {c.shape[1]}]")
    top = np.argsort(-c, axis=1, kind="stable")[:, :k]
    return top, np.take_along_axis(c, top, axis=1)


def _at(threshold, layer: int) -> float:
    """A threshold given as one number or per layer ({layer: value})."""
    if isinstance(threshold, Mapping):
        if layer not in threshold:
            raise ValueError(f"no threshold for layer {layer} in {sorted(threshold)}")
        return float(threshold[layer])
    return float(threshold)


class Origin(NamedTuple):
    """Where the residual features of ``layer`` come from. ``index[m]`` / ``sim[m]`` [M]: the best
    match of each feature in module m (``res`` = R_{layer−1}, ``mlp``, ``att`` of this layer;
    modules without an SAE are absent); ``label`` [M]: its class, one of ``CLASSES``."""
    layer: int
    index: dict
    sim: dict
    label: np.ndarray


def classify(s_res, s_mlp, s_att, t_res: float = T_RES, t_mod: float = T_MOD) -> np.ndarray:
    """Class of each feature from its best similarities (NaN: that SAE is missing, counted low).

    high s(R) ≥ t_res; a module is high if its similarity ≥ t_mod:
      carried        high R, neither module high
      processed_<m>  high R and a module high (m: the higher of the high modules; ties -> mlp)
      born_<m>       low R, a module high
      unexplained    all low
    """
    s_res, s_mlp, s_att = (np.nan_to_num(np.asarray(s, np.float64), nan=-np.inf) for s in (s_res, s_mlp, s_att))
    hi_r, hi_m, hi_a = s_res >= t_res, s_mlp >= t_mod, s_att >= t_mod
    any_mod = hi_m | hi_a
    mod = np.where(hi_m & (~hi_a | (s_mlp >= s_att)), "mlp", "att")
    return np.where(any_mod, np.char.add(np.where(hi_r, "processed_", "born_"), mod),
                    np.where(hi_r, "carried", "unexplained"))


def origins(decoders: Mapping, layer: int, t_res=T_RES, t_mod=T_MOD) -> Origin:
    """The origin of every feature of the residual SAE ``(layer, 'res')`` (spec §2): its top-1
    cosine match in ``(layer − 1, 'res')``, ``(layer, 'mlp')`` and ``(layer, 'att')`` — those of the
    three that ``decoders`` holds — and its class under ``t_res`` / ``t_mod`` (numbers, or
    {layer: value} for per-layer thresholds)."""
    if (layer, "res") not in decoders:
        raise ValueError(f"no residual SAE at layer {layer} (keys: {sorted(decoders)})")
    target = decoders[(layer, "res")]
    index, sim = {}, {}
    for m, key in (("res", (layer - 1, "res")), ("mlp", (layer, "mlp")), ("att", (layer, "att"))):
        if key in decoders:
            i, s = match(target, decoders[key], 1)
            index[m], sim[m] = i[:, 0], s[:, 0]
    if not index:
        raise ValueError(f"layer {layer}: no predecessor SAE ((layer-1, 'res'), (layer, 'mlp') or (layer, 'att'))")
    n = np.asarray(target).shape[0]
    missing = np.full(n, np.nan)
    label = classify(sim.get("res", missing), sim.get("mlp", missing), sim.get("att", missing),
                     _at(t_res, layer), _at(t_mod, layer))
    return Origin(layer, index, sim, label)


def all_origins(decoders: Mapping, t_res=T_RES, t_mod=T_MOD) -> dict:
    """{layer: Origin} for every residual SAE with at least one predecessor SAE."""
    out = {}
    for layer, m in sorted(decoders):
        if m == "res" and any(k in decoders for k in ((layer - 1, "res"), (layer, "mlp"), (layer, "att"))):
            out[layer] = origins(decoders, layer, t_res, t_mod)
    return out


# ----------------------------------------------------------------------------- flow graphs
class Edge(NamedTuple):
    """``source`` is the best match of ``target`` one step back; nodes are (layer, module, index)."""
    target: tuple
    source: tuple
    similarity: float


def flow_graph(decoders_or_origins: Mapping, layer: int, feature: int, t_res=T_RES, t_mod=T_MOD,
               stop_layer: int | None = None) -> list[Edge]:
    """The flow graph of residual feature ``feature`` of ``layer``, built backward (spec §2).

    At each layer L of the chain (starting at ``layer``): an edge to the best MLP_L and Attn_L
    feature when its similarity is ≥ t_mod, and an edge to the best R_{L−1} feature when s(R) ≥
    t_res, which then continues the chain at L − 1. The chain ends where s(R) < t_res, where no
    earlier SAE exists, or below ``stop_layer``. Module edges of the layer where the chain ends are
    kept: they say where the feature was born. ``decoders_or_origins``: {(layer, module): decoder}
    or the {layer: Origin} of ``all_origins`` (faster for many graphs; its thresholds are unused)."""
    cached = all(isinstance(v, Origin) for v in decoders_or_origins.values())
    edges = []
    node = (layer, "res", int(feature))
    while True:
        L, _, f = node
        if stop_layer is not None and L <= stop_layer:
            break
        if cached:
            if L not in decoders_or_origins:
                break
            o = decoders_or_origins[L]
        else:
            if (L, "res") not in decoders_or_origins or not any(
                    k in decoders_or_origins for k in ((L - 1, "res"), (L, "mlp"), (L, "att"))):
                break
            o = origins(decoders_or_origins, L, t_res, t_mod)
        for m in ("mlp", "att"):
            if m in o.sim and o.sim[m][f] >= _at(t_mod, L):
                edges.append(Edge(node, (L, m, int(o.index[m][f])), float(o.sim[m][f])))
        if "res" not in o.sim or o.sim["res"][f] < _at(t_res, L):
            break
        prev = (L - 1, "res", int(o.index["res"][f]))
        edges.append(Edge(node, prev, float(o.sim["res"][f])))
        node = prev
    return edges


def graph_nodes(edges: Iterable[Edge], root: tuple | None = None) -> list[tuple]:
    """The nodes of a flow graph, ``root`` first, then in edge order, each once."""
    out = [] if root is None else [tuple(root)]
    for e in edges:
        for n in (e.target, e.source):
            if n not in out:
                out.append(n)
    return out


# ----------------------------------------------------------------------------- interventions
class SAEAt(NamedTuple):
    """A trained SAE (``models.sae.SAE``) with its params, for encoding a hook point's values."""
    module: object
    params: object

    def encode(self, x):
        return self.module.apply({"params": self.params}, x)[1]

    def decoder(self):
        return unit_decoder(jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), self.params))


def _group(nodes: Iterable) -> dict:
    """{(layer, module): [index, ...]} of (layer, module, index) nodes, in order, each once."""
    out = {}
    for layer, m, j in nodes:
        hook_name(layer, m)
        out.setdefault((int(layer), m), [])
        if int(j) not in out[(int(layer), m)]:
            out[(int(layer), m)].append(int(j))
    return out


@functools.lru_cache(maxsize=64)
def _rescale(module):
    """The rescale edit of an SAE module, x, (params, feats, scale) -> x + scale·a_F(x) Ŵ_F (one
    function per module, so Edits of any arrays share their static half)."""
    def fn(x, a):
        z = module.apply({"params": a["params"]}, x.astype(jnp.float32))[1][..., a["feats"]]  # [..., |F|]
        return x + (a["scale"] * (z @ a["dec_F"])).astype(x.dtype)
    return fn


def rescale_args(sae: SAEAt, features: Iterable[int], r) -> dict:
    """The arrays of ``rescale_fn``'s edit: the SAE's params (float32), the feature indices, their
    unit decoder rows (normalised once here, not at every decode step) and r − 1."""
    params = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), sae.params)
    feats = jnp.asarray(sorted(set(int(j) for j in features)), jnp.int32)
    return {"params": params, "feats": feats, "dec_F": unit_decoder(params)[feats],
            "scale": jnp.asarray(r, jnp.float32) - 1.0}


def rescale_fn(sae: SAEAt, features: Iterable[int], r: float):
    """x -> x + (r − 1)·Σ_{j∈features} a_j v_j at every token, a = ``sae``'s activations of x and v_j
    its unit decoder rows (spec §2's rescaling; r = 0 removes the features' decoder contribution,
    which equals x̂ with those latents zeroed minus x̂). Computed in float32, added in x's dtype."""
    fn, a = _rescale(sae.module), rescale_args(sae, features, r)
    return lambda x: fn(x, a)


def rescale_edits(saes: Mapping, nodes: Iterable, r=0.0) -> hooks.Edits:
    """A ``hooks.Edits`` rescaling features at their points: ``nodes`` are (layer, module, index)
    (e.g. a feature's top-1 predecessor, or a flow graph's nodes); ``saes``: {(layer, module):
    SAEAt}; ``r``: one factor, or {(layer, module): r} per point (r = 1 leaves a point's value
    exactly as it was). Features of one point are rescaled together. Edits downstream encode the
    already edited stream (each edit applies where its value is made). The SAE params, indices and
    r are the edits' array arguments: decoding compiles once per set of points and feature counts,
    so a sweep over r, or a graph's points with r = 1 except at one, share one program."""
    groups = _group(nodes)
    missing = [k for k in groups if k not in saes]
    if missing:
        raise ValueError(f"no SAE for {missing}")
    if isinstance(r, Mapping) and set(r) != set(groups):
        raise ValueError(f"r per point must name exactly the nodes' points {sorted(groups)}, got {sorted(r)}")
    names = {k: hook_name(*k) for k in groups}
    return hooks.Edits({names[k]: _rescale(saes[k].module) for k in groups},
                       args={names[k]: rescale_args(saes[k], js, r[k] if isinstance(r, Mapping) else r)
                             for k, js in groups.items()})


def schedule(layers: Iterable[int], s: float, kind: str = "constant", alpha: float = EXP_ALPHA,
             s_end: float = 1.0, start: int | None = None, end: int | None = None) -> dict:
    """{layer: s_ℓ} (spec §2): ``constant`` s; ``exp`` s·e^{αℓ} (ℓ the layer index, so s at ℓ = 0);
    ``linear`` from (start, s) to (end, s_end), start / end defaulting to the first and last of
    ``layers`` (one layer: s)."""
    layers = sorted(set(int(l) for l in layers))
    if kind not in SCHEDULES:
        raise ValueError(f"schedule {kind!r}: choose one of {SCHEDULES}")
    if kind == "constant":
        return {l: float(s) for l in layers}
    if kind == "exp":
        return {l: float(s * np.exp(alpha * l)) for l in layers}
    a = layers[0] if start is None else start
    b = layers[-1] if end is None else end
    if a == b:
        return {l: float(s) for l in layers}
    return {l: float(s + (s_end - s) * (l - a) / (b - a)) for l in layers}


def typical_activation(z, axis=None) -> np.ndarray:
    """Folding's scale per feature: the mean of its non-zero activations over ``z`` [..., M] (0 for a
    feature that never fires) — one reading of "typical activation level" [inferred]."""
    z = np.asarray(z, np.float64).reshape(-1, np.shape(z)[-1])
    n = (z != 0).sum(0)
    return np.where(n > 0, z.sum(0) / np.maximum(n, 1), 0.0)


def steer_edits(decoders: Mapping, nodes: Iterable, s: float, kind: str = "constant",
                alpha: float = EXP_ALPHA, s_end: float = 1.0, fold: Mapping | None = None,
                dtype=jnp.float32) -> hooks.Edits:
    """A ``hooks.Edits`` adding s_ℓ·v_n at every token at the point of each node n = (layer, module,
    index) (spec §2's activation steering): pass a flow graph's nodes (``graph_nodes``) for
    cumulative steering, or one node for single-layer steering. s_ℓ follows ``schedule`` over the
    nodes' layers; ``fold``: {node: typical activation} multiplies each node's strength. v_n is the
    unit row of ``decoders[(layer, module)]``; nodes of one point are summed. The vectors are the
    edits' array arguments: a sweep over s compiles one decoding program per set of points."""
    nodes = [tuple(n) for n in nodes]
    groups = _group(nodes)
    sl = schedule([l for l, _ in groups], s, kind, alpha, s_end)
    edits = {}
    for (layer, m), js in groups.items():
        if (layer, m) not in decoders:
            raise ValueError(f"no decoder for {(layer, m)}")
        dec = _unit(decoders[(layer, m)])
        vec = np.zeros(dec.shape[1])
        for j in js:
            vec += sl[layer] * (1.0 if fold is None else float(fold[(layer, m, j)])) * dec[j]
        edits[hook_name(layer, m)] = jnp.asarray(vec, dtype)
    return hooks.Edits({n: _add for n in edits}, args=edits)


def _add(x, vec):
    return x + vec.astype(x.dtype)
