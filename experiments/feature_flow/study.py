"""The pieces of the Feature Flow reproduction (spec section 6; docs/methods/feature_flow.md): the
synthetic-topic corpus, SAEs on every layer's residual / MLP / attention output trained together,
the data-based origin groups, deactivation of a feature through its predecessor, and topic steering
along a flow graph vs at one layer.

* **Corpus** (``topic_docs`` / ``mixed_corpus``): documents of ``length`` characters, each either a
  Shakespeare train piece (generic text) or templated sentences about one of four topics, each with
  its own nouns, verbs and adjectives (``TOPICS``) in a shared sentence frame (so a topic is the
  choice of words, not the syntax). ``topic_rate``: share of a text's words from a topic's lexicon.
* **SAEs** (``train_saes``): one TopK SAE (``models.sae.SAE``, AuxK over the batch's dead latents,
  ``tasks.sae.sae_objective``) per point: ``res`` at layers −1 (embeddings) … L−1, ``mlp`` and
  ``att`` (after o_proj) at 0 … L−1, all trained at once (vmap over points) on the LM's activations
  of fresh packed batches, each point divided by a scale c_p with E‖x/c_p‖² = D; the scale is
  folded into the trained params (``fold_scale``) so every SAE then reads the model's own units.
* **Groups** (``groups``): for each residual feature of layer L active on enough evaluation tokens,
  which of its top-1 predecessors (R_{L−1}, MLP_L, Attn_L, by decoder cosine) are active on the
  same tokens on at least ``coact`` of them.
* **Deactivation** (``deactivate``): rescale r = 0 at a predecessor's point on every token, read
  the target's activation again where it fired: activation change 1 − z_new/z_old and success
  (z_new = 0 [inferred: the spec names "successful deactivation rate" without a rule]), for the
  top-1 predecessor (highest cosine among the top-5 of each predecessor SAE) and a uniformly random
  one of the top 5.
* **Steering** (``steer_outcomes``): from a neutral prefix, add s·v at every point of a topic
  feature's flow graph (cumulative) or at its own layer only (single-layer); behaviour = topic
  word rate of the continuations, coherence = their NLL under the unsteered model mapped to [0, 1]
  between the unsteered continuations' NLL (1) and the corpus's byte-unigram entropy (0).
"""
from __future__ import annotations

import functools
import os
import re

import numpy as np

TOPICS = {
    "sea": dict(n=("ship", "sail", "wave", "tide", "anchor", "harbor", "reef", "mast", "sailor", "gull", "oar", "net"),
                v=("drifts", "floats", "rows", "sinks", "sails"), a=("salty", "stormy", "briny", "wet")),
    "kitchen": dict(n=("bread", "cheese", "soup", "honey", "butter", "oven", "flour", "onion", "pepper", "ladle",
                       "pie", "jam"),
                    v=("bakes", "boils", "stirs", "simmers", "tastes"), a=("sweet", "warm", "crusty", "spicy")),
    "forge": dict(n=("hammer", "anvil", "iron", "ember", "bellows", "tongs", "steel", "rivet", "smith", "coal",
                     "furnace", "chisel"),
                  v=("forges", "welds", "glows", "bends", "cools"), a=("molten", "sooty", "hot", "rusty")),
    "sky": dict(n=("comet", "planet", "orbit", "galaxy", "nebula", "meteor", "telescope", "rocket", "moon", "crater",
                   "asteroid", "star"),
                v=("orbits", "spins", "shines", "launches", "glitters"), a=("cosmic", "distant", "bright", "lunar")),
}
NAMES = tuple(TOPICS)
FRAMES = (
    "the {a} {n} {v} near the {n2}.",
    "I think the {n} {v}, and the {n2} is {a}.",
    "a {n} and a {n2} {v} all day.",
    "we saw the {a} {n} by the {n2}.",
    "every {n} {v} when the {n2} is {a}.",
    "I think a {a} {n2} {v} there.",
)
NEUTRAL = "I think "
_WORD = re.compile(r"[a-z]+")


@functools.lru_cache(maxsize=None)
def lexicon(topic: str) -> frozenset:
    t = TOPICS[topic]
    return frozenset(t["n"] + t["v"] + t["a"])


def topic_rate(text: str, topic: str) -> float:
    """Share of the words of ``text`` that belong to ``topic``'s lexicon (0 for no words)."""
    words = _WORD.findall(text.lower())
    return sum(w in lexicon(topic) for w in words) / len(words) if words else 0.0


def sentence(topic: str, rng: np.random.Generator) -> str:
    t = TOPICS[topic]

    def pick(xs):
        return xs[int(rng.integers(len(xs)))]
    n = pick(t["n"])
    n2 = pick([w for w in t["n"] if w != n])
    s = pick(FRAMES).format(a=pick(t["a"]), n=n, n2=n2, v=pick(t["v"]))
    return s[0].upper() + s[1:]


def topic_docs(topic: str, n: int, length: int, seed: int) -> list[str]:
    """``n`` documents of exactly ``length`` characters of ``topic`` sentences."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        s = ""
        while len(s) < length:
            s += sentence(topic, rng) + (" " if rng.random() < 0.8 else "\n")
        out.append(s[:length])
    return out


def mixed_corpus(docs: int, length: int, topic_share: float, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """(``docs`` documents, their topic index or −1 for Shakespeare): a share ``topic_share`` of
    topic documents split evenly over the topics, at positions drawn by ``seed``."""
    from experiments.iti_bad_data.lm import clean_pieces
    rng = np.random.default_rng(seed)
    n_topic = int(round(topic_share * docs))
    labels = np.full(docs, -1)
    where = rng.permutation(docs)[:n_topic]
    labels[where] = np.arange(n_topic) % len(NAMES)
    clean = clean_pieces("train", docs, length)
    per = {t: iter(topic_docs(NAMES[t], int((labels == t).sum()), length, seed=100 + 7 * seed + t))
           for t in range(len(NAMES))}
    return [clean[i] if labels[i] < 0 else next(per[labels[i]]) for i in range(docs)], labels


def eval_docs(per_topic: int, generic: int, length: int, seed: int) -> tuple[list[str], np.ndarray]:
    """Held-out documents: ``per_topic`` of each topic (fresh draws) and ``generic`` validation
    Shakespeare pieces, with labels as ``mixed_corpus``."""
    from experiments.iti_bad_data.lm import clean_pieces
    texts, labels = [], []
    for t, name in enumerate(NAMES):
        texts += topic_docs(name, per_topic, length, seed=50_000 + 10 * seed + t)
        labels += [t] * per_topic
    texts += clean_pieces("validation", generic, length, start=50_000)
    labels += [-1] * generic
    return texts, np.asarray(labels)


# ----------------------------------------------------------------------------- SAEs

def sae_points(num_layers: int) -> list[tuple[int, str]]:
    """Every (layer, module) an SAE reads: res at −1 … L−1, mlp and att at 0 … L−1."""
    return [(-1, "res")] + [(layer, m) for layer in range(num_layers) for m in ("mlp", "att", "res")]


def _capture_fn(model_cfg, points):
    import jax

    from icml_jax.analysis.feature_flow import hook_name
    from icml_jax.models import build_model, hooks
    model = build_model(model_cfg)
    names = [hook_name(*p) for p in points]

    def fn(params, tokens):
        got = hooks.capture(model, params, tokens, points=names)
        return jax.numpy.stack([got[n].astype(jax.numpy.float32) for n in names])  # [P, B, T, D]
    return fn


def sae_module(d_model: int, latents: int, k: int):
    """The experiment's SAE: TopK with b_dec subtracted before the encoder (``pre_bias``; the
    common TopK form, so the residual stream's shared mean, where b_dec starts, is not encoded)."""
    from icml_jax.models.sae import SAE
    return SAE(d_model=d_model, latents=latents, activation="topk", k=k, pre_bias=True)


def fold_scale(params, c: float) -> dict:
    """TopK SAE params trained on x / c, rewritten to read x: with b_dec·c and b_enc·c the
    pre-activation (x − b_dec·c)·W_enc + b_enc·c is c times the trained one (W_enc unchanged), so
    z scales by c and so does x̂ = z Ŵ_dec + b_dec·c; the unit decoder rows are unchanged. Holds
    with and without ``pre_bias``."""
    return {**params, "b_enc": params["b_enc"] * c, "b_dec": params["b_dec"] * c}


def train_saes(model_cfg, lm_params, batches, *, latents: int, k: int, aux_k: int, lr: float, seed: int,
               log=print) -> tuple[dict, dict]:
    """One TopK SAE per point of ``sae_points``, trained together on the LM's activations of
    ``batches`` (an iterator of int32 [B, T] token arrays; every token counts). Returns
    ({(layer, module): params in the model's units}, {"scale": {...}, "fvu": {...}, "dead": {...},
    "l0": ...}) with the metrics of the last 20 steps."""
    import jax
    import jax.numpy as jnp
    import optax

    from icml_jax.tasks.sae import sae_objective
    points = sae_points(model_cfg.num_layers)
    P, D = len(points), model_cfg.d_model
    capture = jax.jit(_capture_fn(model_cfg, points))
    first = next(batches)
    acts = capture(lm_params, first)
    scale = jnp.sqrt(jnp.mean(jnp.sum(acts ** 2, -1), axis=(1, 2)) / D)  # [P]
    sae = sae_module(D, latents, k)
    keys = jax.random.split(jax.random.key(seed), P)
    params = jax.jit(jax.vmap(lambda key: sae.init(key, jnp.zeros((1, D)))["params"]))(keys)
    # b_dec starts at the first batch's mean (scaled): the residual stream's large shared component
    # is not left for the sparse latents to reconstruct
    params["b_dec"] = jnp.mean(acts, axis=(1, 2)) / scale[:, None]
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    def loss(ps, x, w):
        total, n, m = jax.vmap(lambda p, xp: sae_objective(sae, p, xp, w, aux_k=aux_k))(ps, x)
        return total.sum() / n[0], jax.tree.map(lambda v: v / n[0], m)  # per point

    @jax.jit
    def step(ps, state, tokens):
        x = capture(lm_params, tokens) / scale[:, None, None, None]
        w = jnp.ones(tokens.shape, jnp.float32)
        (_, m), g = jax.value_and_grad(loss, has_aux=True)(ps, x, w)
        upd, state = opt.update(g, state, ps)
        return optax.apply_updates(ps, upd), state, m

    hist = []
    for i, tokens in enumerate([first, *batches]):
        params, opt_state, m = step(params, opt_state, tokens)
        hist.append(jax.device_get(m))
        if log and (i + 1) % 100 == 0:
            log(f"  SAE step {i + 1}: mean fvu {np.mean(hist[-1]['fvu']):.3f}, dead {np.mean(hist[-1]['dead']):.3f}")
    tail = hist[-20:]
    out = {pt: fold_scale(jax.tree.map(lambda v, j=j: v[j], params), float(scale[j])) for j, pt in enumerate(points)}
    stats = {name: {f"{pt[0]}/{pt[1]}": float(np.mean([h[name][j] for h in tail])) for j, pt in enumerate(points)}
             for name in ("fvu", "dead", "l0")}
    stats["scale"] = {f"{pt[0]}/{pt[1]}": float(scale[j]) for j, pt in enumerate(points)}
    stats["steps"] = len(hist)
    return out, stats


def cached_saes(path: str, key: dict, train) -> tuple[dict, dict]:
    """``train()``'s (SAE params, stats), stored at ``path``.npz / ``path``.json (atomically) and
    read back when the stored key equals ``key`` (the LM run and the SAE settings), so a change
    to the analysis does not retrain the SAEs."""
    import json

    from experiments.common import write_json
    from icml_jax.atomic import atomic_path
    key = json.loads(json.dumps(key))
    if os.path.exists(path + ".json") and os.path.exists(path + ".npz"):
        with open(path + ".json") as f:
            meta = json.load(f)
        if meta["key"] == key:
            arrays = np.load(path + ".npz")
            out = {}
            for name in arrays.files:
                layer, module, leaf = name.split("|")
                out.setdefault((int(layer), module), {})[leaf] = arrays[name]
            return out, meta["stats"]
    saes, stats = train()
    flat = {f"{layer}|{m}|{leaf}": np.asarray(v) for (layer, m), p in saes.items() for leaf, v in p.items()}
    with atomic_path(path + ".npz", suffix=".tmp.npz") as tmp:
        np.savez(tmp, **flat)
    write_json(path + ".json", dict(key=key, stats=stats))
    return saes, stats


@functools.lru_cache(maxsize=4)
def _encode_all(model_cfg, points, latents: int, k: int):
    """jit: (lm params, stacked SAE params, tokens [B, T]) -> z [P, B, T, M] of every point."""
    import jax

    sae = sae_module(model_cfg.d_model, latents, k)
    capture = _capture_fn(model_cfg, points)

    def fn(lm_params, stacked, tokens):
        x = capture(lm_params, tokens)
        return jax.vmap(lambda p, xp: sae.apply({"params": p}, xp)[1])(stacked, x)
    return jax.jit(fn)


def encode_points(model_cfg, lm_params, saes: dict, tokens, *, latents: int, k: int) -> dict:
    """{(layer, module): z [B, T, M] numpy} of every SAE on ``tokens``."""
    import jax
    import ml_collections
    points = tuple(saes)
    stacked = jax.tree.map(lambda *v: np.stack(v), *[saes[p] for p in points])
    z = np.asarray(_encode_all(ml_collections.FrozenConfigDict(model_cfg), points, latents, k)(lm_params, stacked,
                                                                                                 tokens))
    return {p: z[j] for j, p in enumerate(points)}


# ----------------------------------------------------------------------------- groups

GROUP_MODULES = ("res", "mlp", "att")


def groups(decoders: dict, z: dict, num_layers: int, *, min_active: int, coact: float) -> list[dict]:
    """One row per residual feature of layers 0 … L−1 active on ≥ ``min_active`` evaluation tokens:
    its top-1 predecessor's similarity s_<m> in each of R_{L−1}, MLP_L, Attn_L, the share of its
    active tokens on which that predecessor is active too (co_<m>), and its group: the modules with
    co_<m> ≥ ``coact`` joined by "+" ("nowhere" for none)."""
    from icml_jax.analysis.feature_flow import origins
    rows = []
    for layer in range(num_layers):
        o = origins(decoders, layer)
        on = z[(layer, "res")].reshape(-1, z[(layer, "res")].shape[-1]) > 0  # [N, M]
        prev = {m: z[key].reshape(-1, z[key].shape[-1]) > 0
                for m, key in (("res", (layer - 1, "res")), ("mlp", (layer, "mlp")), ("att", (layer, "att")))}
        count = on.sum(0)
        for f in np.flatnonzero(count >= min_active):
            row = dict(layer=layer, feature=int(f), active=int(count[f]))
            members = []
            for m in GROUP_MODULES:
                j = int(o.index[m][f])
                co = float(prev[m][on[:, f], j].mean())
                row[f"s_{m}"], row[f"co_{m}"] = float(o.sim[m][f]), co
                if co >= coact:
                    members.append(m.upper() if m != "res" else "RES")
            row["group"] = "+".join(members) or "nowhere"
            row["label"] = str(o.label[f])
            rows.append(row)
    return rows


def group_tests(rows: list[dict]) -> list[dict]:
    """For each module m: s_m of the features whose group contains m against those whose group does
    not — medians and a one-sided Mann–Whitney U test (greater)."""
    from scipy.stats import mannwhitneyu
    out = []
    for m in GROUP_MODULES:
        tag = m.upper()
        inside = [r[f"s_{m}"] for r in rows if tag in r["group"].split("+")]
        outside = [r[f"s_{m}"] for r in rows if tag not in r["group"].split("+")]
        p = float(mannwhitneyu(inside, outside, alternative="greater").pvalue) if inside and outside else float("nan")
        out.append(dict(module=m, n_in=len(inside), n_out=len(outside),
                        median_in=float(np.median(inside)) if inside else float("nan"),
                        median_out=float(np.median(outside)) if outside else float("nan"), p=p))
    return out


# ----------------------------------------------------------------------------- deactivation

def candidates(decoders: dict, layer: int, feature: int, top: int = 5) -> list[tuple]:
    """The ``top`` predecessors of residual feature (layer, feature) by decoder cosine among the
    top-``top`` of each of R_{L−1}, MLP_L, Attn_L, best first: [(layer, module, index, sim)]."""
    from icml_jax.analysis.feature_flow import match
    target = np.asarray(decoders[(layer, "res")])[feature:feature + 1]
    pool = []
    for m, key in (("res", (layer - 1, "res")), ("mlp", (layer, "mlp")), ("att", (layer, "att"))):
        idx, sim = match(target, decoders[key], top)
        pool += [(key[0], m, int(i), float(s)) for i, s in zip(idx[0], sim[0])]
    return sorted(pool, key=lambda t: -t[3])[:top]


def pearson_candidate(z: dict, layer: int, feature: int) -> tuple:
    """The predecessor of residual feature (layer, feature) with the highest activation correlation
    on the evaluation tokens among R_{L−1}, MLP_L and Attn_L (the spec's data-based matching):
    (layer, module, index, correlation)."""
    from icml_jax.analysis.feature_flow import pearson
    target = z[(layer, "res")][..., feature:feature + 1]
    best = None
    for m, key in (("res", (layer - 1, "res")), ("mlp", (layer, "mlp")), ("att", (layer, "att"))):
        c = pearson(target, z[key])[0]
        j = int(np.argmax(c))
        if best is None or c[j] > best[3]:
            best = (key[0], m, j, float(c[j]))
    return best


@functools.lru_cache(maxsize=32)
def _deactivate_fn(model_cfg, source_name: str, target_name: str, latents: int, k: int):
    """jit: (lm params, source SAE params, source feature [n], target SAE params, target feature [n],
    tokens) -> the target feature's activations [n, B, T] with the source feature rescaled to 0 at its
    point on every token (one forward per row, vmapped)."""
    import jax
    import jax.numpy as jnp

    from icml_jax.analysis.feature_flow import _rescale
    from icml_jax.models import build_model, hooks
    from icml_jax.models.sae import unit_rows
    sae = sae_module(model_cfg.d_model, latents, k)
    edit = _rescale(sae)

    def one(lm_params, src, j, tgt, f, tokens):
        # the one decoder row normalised, not the whole [M, D] decoder per vmapped pair
        args = {"params": src, "feats": j[None], "dec_F": unit_rows(src["W_dec"][j][None]), "scale": jnp.float32(-1.0)}
        model = build_model(model_cfg, edits=hooks.Edits({source_name: edit}, args={source_name: args}))
        x = hooks.capture(model, lm_params, tokens, points=[target_name])[target_name]
        return sae.apply({"params": tgt}, x.astype(jnp.float32))[1][..., f]

    return jax.jit(jax.vmap(one, in_axes=(None, None, 0, None, 0, None)))


def deactivate(model_cfg, lm_params, saes: dict, z: dict, tokens, pairs: list[tuple], *, latents: int, k: int,
               chunk: int = 16) -> list[dict]:
    """``pairs``: (target layer, target feature, source (layer, module, index)). For each, the
    target's activation change 1 − z_new/z_old and success (z_new = 0) averaged over the tokens where
    it fired, with the source rescaled to 0."""
    import ml_collections

    from icml_jax.analysis.feature_flow import hook_name
    cfg = ml_collections.FrozenConfigDict(model_cfg)
    out = []
    by = {}
    for i, (tl, tf, src) in enumerate(pairs):
        by.setdefault((src[0], src[1], tl), []).append(i)
    res = [None] * len(pairs)
    for (sl, sm, tl), idx in by.items():
        fn = _deactivate_fn(cfg, hook_name(sl, sm), hook_name(tl, "res"), latents, k)
        for s in range(0, len(idx), chunk):
            part = idx[s:s + chunk]
            js = np.asarray([pairs[i][2][2] for i in part] + [pairs[part[0]][2][2]] * (chunk - len(part)), np.int32)
            fs = np.asarray([pairs[i][1] for i in part] + [pairs[part[0]][1]] * (chunk - len(part)), np.int32)
            z_new = np.asarray(fn(lm_params, saes[(sl, sm)], js, saes[(tl, "res")], fs, tokens))
            for r, i in enumerate(part):
                res[i] = z_new[r]
    for (tl, tf, src), z_new in zip(pairs, res):
        old = z[(tl, "res")][..., tf]
        on = old > 0
        change = 1.0 - z_new[on] / old[on]
        out.append(dict(layer=tl, feature=tf, source=f"{src[0]}/{src[1]}/{src[2]}", change=float(change.mean()),
                        success=float((z_new[on] <= 0).mean()), tokens=int(on.sum())))
    return out


# ----------------------------------------------------------------------------- steering

def topic_features(z_res, labels_tok, num_topics: int, min_active: int, top: int = 10) -> list[list[tuple]]:
    """For each topic, the ``top`` residual features (of ``z_res`` [N, M]) most selective for it,
    best first: [(feature, selectivity)] with selectivity = mean activation on the topic's tokens
    minus the largest mean on another topic's tokens (generic text left out, so a feature of
    templated text in general scores 0), among features active on ≥ ``min_active`` tokens."""
    z = z_res.reshape(-1, z_res.shape[-1])
    lab = labels_tok.reshape(-1)
    ok = (z > 0).sum(0) >= min_active
    means = np.stack([z[lab == t].mean(0) for t in range(num_topics)])  # [topics, M]
    out = []
    for t in range(num_topics):
        sel = means[t] - np.delete(means, t, axis=0).max(0)
        sel = np.where(ok, sel, -np.inf)
        order = np.argsort(-sel, kind="stable")[:top]
        out.append([(int(f), float(sel[f])) for f in order])
    return out


def continuation_nll(model_cfg, params, prompt_rows, cont_tokens) -> np.ndarray:
    """Mean NLL (nats/token) of each continuation [N, C] given its prompt, under ``params`` unedited."""
    import ml_collections

    from experiments.iti_bad_data.lm import _ce_fn  # the jitted per-token log-probs, no edits
    rows = np.asarray([list(p) + list(c) for p, c in zip(prompt_rows, cont_tokens)], np.int32)
    lp = np.asarray(_ce_fn(ml_collections.FrozenConfigDict(model_cfg), None)(params, rows))
    P = len(prompt_rows[0])
    return -lp[:, P - 1:].mean(1)


def steer_outcomes(model_cfg, params, tok, edits, *, topic: str, prompts: int, new_tokens: int, temperature: float,
                   top_p: float, seed: int, nll_ref: float | None, unigram: float, prompt: str = NEUTRAL) -> dict:
    """Behaviour (topic word rate), NLL and coherence of ``prompts`` sampled continuations of
    ``prompt`` under ``edits`` (None: unsteered); ``nll_ref``: the unsteered continuations' mean NLL
    (None: these continuations' own, for the unsteered run itself)."""
    import jax

    from icml_jax.inference.decode import generate
    row = [tok.bos_id] + tok.encode(prompt)
    out = generate(model_cfg, params, [row] * prompts, key=jax.random.key(seed), max_new_tokens=new_tokens,
                   temperature=temperature, top_p=top_p, pad_id=tok.pad_id, edits=edits)
    texts = [tok.decode([int(t) for t in r]) for r in out.tokens]
    nll = continuation_nll(model_cfg, params, [row] * prompts, out.tokens)
    ref = float(nll.mean()) if nll_ref is None else nll_ref
    coh = np.clip((unigram - nll) / max(unigram - ref, 1e-9), 0.0, 1.0)
    beh = np.asarray([topic_rate(t, topic) for t in texts])
    return dict(behaviour=float(beh.mean()), nll=float(nll.mean()), coherence=float(coh.mean()),
                score=float((beh * coh).mean()), sample=texts[0])
