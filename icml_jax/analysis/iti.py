"""Inference-Time Intervention (ITI; Li et al. 2023, as in ``likenneth/honest_llama``), on the
``attn_heads`` hook points (``models/hooks.py``; docs/methods/iti_bad_data.md, section "ITI").

Pipeline:

1. ``head_activations``: every layer's per-head attention output (before the output projection)
   at the last valid token of each row, [N, L, H, K], in one jitted forward per chunk of rows.
2. ``train_val_split`` + ``fit_probes``: one logistic regression per (layer, head), all L*H fitted
   at once (vmap over probes, damped Newton on the full batch, L2: scikit-learn's C=1);
   ``validation_accuracy`` -> [L, H]; ``top_heads(acc, k)`` -> the K best (layer, head) pairs.
3. Directions θ_h (unit norm, pointing toward the desired class): ``mass_mean_directions``
   (μ(desired) − μ(undesired)) or ``probe_directions`` (the probe's weight vector);
   ``projection_std``: σ_h = std over a tuning set of ⟨act_h, θ_h⟩.
4. ``iti_edits``: a ``hooks.Edits`` that adds α·σ_h·θ_h to the selected heads at the current (last)
   position — every prefill and every KV-cache decoding step — or at all positions.

Heads are numbered as query heads, h = g * R + r for the [G, R, K] layout of ``attn_heads``
(the same order as a Hugging Face ``o_proj`` input reshaped to [heads, head_dim]).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from icml_jax.models import build_model, hooks

DIRECTIONS = ("mass_mean", "probe_weights")
DEFAULTS = dict(k=30, alpha=8.0, direction="mass_mean", positions="last", val_ratio=0.2, seed=42)


# ----------------------------------------------------------------------------- activations
def _heads_layout(model_cfg) -> tuple[int, int, int]:
    """(L, H, K): layers, query heads, head dim."""
    return int(model_cfg.num_layers), int(model_cfg.num_heads), int(model_cfg.head_dim)


@functools.partial(jax.jit, static_argnames=("model", "names", "at"))
def _chunk_heads(model, names, params, tokens, positions, segments, at):
    got = hooks.capture(model, params, tokens, positions, segments, points=list(names))
    if len(names) == 1 and names[0].startswith("layers/"):  # scanned stack: [L, B, T, G, R, K]
        heads = jnp.moveaxis(got[names[0]], 0, 2)
    else:
        heads = jnp.stack([got[n] for n in names], axis=2)  # [B, T, L, G, R, K]
    B, T, L, G, R, K = heads.shape
    heads = heads.reshape(B, T, L, G * R, K)
    if at == "all":
        return heads
    valid = segments > 0
    last = T - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # the last valid position of each row
    return heads[jnp.arange(B), last]  # [B, L, H, K]


def head_activations(model_cfg: ml_collections.ConfigDict, params, tokens, positions=None,
                     segment_ids=None, at: str = "last", batch_size: int = 64) -> np.ndarray:
    """Every layer's per-head attention outputs (``layer_i/attn_heads``, before o_proj) as float32.

    tokens: int [N, T], right-padded rows allowed: ``segment_ids`` (0 = pad) marks the valid
    tokens and ``at="last"`` takes each row's last position with segment id > 0 (the last column
    when ``segment_ids`` is None). positions default to 0..T-1.
    Returns [N, L, H, K] (``at="last"``) or [N, T, L, H, K] (``at="all"``), H = query heads.
    Rows run through one jitted forward in chunks of ``batch_size`` (the last chunk padded)."""
    if at not in ("last", "all"):
        raise ValueError(f"head_activations: at must be 'last' or 'all', got {at!r}")
    tokens = np.asarray(tokens, np.int32)
    N, T = tokens.shape
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (N, T)) if positions is None \
        else np.asarray(positions, np.int32)
    segment_ids = np.ones((N, T), np.int32) if segment_ids is None else np.asarray(segment_ids, np.int32)
    if not (segment_ids > 0).any(axis=1).all():
        raise ValueError("head_activations: every row needs at least one valid token (segment id > 0)")
    L = int(model_cfg.num_layers)
    names = ("layers/attn_heads",) if model_cfg.get("scan_layers", False) else \
        tuple(f"layer_{i}/attn_heads" for i in range(L))
    model = build_model(model_cfg)
    bs = max(1, min(int(batch_size), N))
    out = []
    for s in range(0, N, bs):
        tok, pos, seg = tokens[s:s + bs], positions[s:s + bs], segment_ids[s:s + bs]
        n = len(tok)
        if n < bs:  # pad the last chunk to the compiled shape
            pad = ((0, bs - n), (0, 0))
            tok, pos, seg = np.pad(tok, pad), np.pad(pos, pad), np.pad(seg, pad, constant_values=1)
        h = _chunk_heads(model, names, params, jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(seg), at)
        out.append(np.asarray(h[:n], np.float32))
    return np.concatenate(out, axis=0)


# ----------------------------------------------------------------------------- probes
def train_val_split(n: int, val_ratio: float = 0.2, seed: int = 42) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, val) row indices: int(n * (1 - val_ratio)) rows drawn for training without
    replacement (honest_llama: ``np.random.choice`` with ``val_ratio=0.2``, i.e. 4:1), the rest val."""
    rng = np.random.default_rng(seed)
    n_train = int(n * (1 - val_ratio))
    train = np.sort(rng.choice(n, size=n_train, replace=False))
    val = np.setdiff1d(np.arange(n), train)
    return train, val


class Probes(NamedTuple):
    """L*H logistic regressions on raw activations: P(label = 1 | x) = sigmoid(x · w + b)."""
    w: np.ndarray  # [L, H, K]
    b: np.ndarray  # [L, H]


@functools.partial(jax.jit, static_argnames=("steps",))
def _fit(x_PNK, y_N, l2_PK, steps):
    """Damped Newton on every probe at once (vmap over P), penalty 0.5 · sum_k l2_PK[p, k] · w_k²:
    the L2-regularised logistic loss is strictly convex in the weights, so a few Newton steps
    reach its minimiser to float32 precision. A step that does not lower the objective is halved
    (up to 20 times); one that still does not (or gives NaN) is not taken. Dots at full float32
    precision (a GPU would otherwise run them in TF32)."""
    P, N, K = x_PNK.shape
    x1 = jnp.concatenate([x_PNK, jnp.ones((P, N, 1), x_PNK.dtype)], axis=-1)  # bias as a last feature
    regs = jnp.concatenate([l2_PK.astype(jnp.float32), jnp.zeros((P, 1), jnp.float32)], axis=-1)
    dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)

    def newton(theta, x1_NK1, reg):
        def f(t):
            z = dot(x1_NK1, t)
            return optax.sigmoid_binary_cross_entropy(z, y_N).mean() + 0.5 * jnp.sum(reg * t * t)

        def step(theta, _):
            p = jax.nn.sigmoid(dot(x1_NK1, theta))
            g = dot(x1_NK1.T, p - y_N) / N + reg * theta
            h = dot((x1_NK1 * (p * (1 - p) / N)[:, None]).T, x1_NK1) + jnp.diag(reg) + 1e-9 * jnp.eye(K + 1)
            d = jnp.linalg.solve(h, g)
            f0 = f(theta)
            worse = lambda c: ~(c[1] <= f0) & (c[0] > 2.0 ** -20)  # noqa: E731  (NaN counts as worse)
            t, f_new = jax.lax.while_loop(worse, lambda c: (c[0] * 0.5, f(theta - c[0] * 0.5 * d)),
                                          (1.0, f(theta - d)))
            return jnp.where(f_new <= f0, theta - t * d, theta), None

        return jax.lax.scan(step, theta, None, length=steps)[0]

    theta = jax.vmap(newton)(jnp.zeros((P, K + 1), jnp.float32), x1, regs)
    return theta[:, :K], theta[:, K]


def fit_probes(acts_NLHK, labels_N, *, l2: float | None = None, steps: int = 30,
               standardize: bool = False) -> Probes:
    """One logistic regression per (layer, head), all fitted at once on the full batch.

    labels: 0/1 (1 = the class the probe's positive side points to). The objective is the mean
    log-loss plus 0.5·``l2``·‖w‖² (bias unpenalised); ``l2`` None = 1 / N, which is
    scikit-learn's default ``C=1`` written per sample, so on raw activations (the default) the
    probes are honest_llama's ``LogisticRegression(max_iter=1000)``, solved to convergence by
    ``steps`` damped Newton steps (``_fit``). ``standardize``: fit on features scaled by the
    training mean/std (the penalty then acts on the scaled weights: accuracies no longer depend on
    the activations' scale, unlike the reference's), mapped back so the returned (w, b) act on raw
    activations."""
    x = np.asarray(acts_NLHK, np.float32)
    y = np.asarray(labels_N, np.float32)
    N, L, H, K = x.shape
    if set(np.unique(y)) - {0.0, 1.0}:
        raise ValueError("fit_probes: labels must be 0/1")
    x_PNK = jnp.asarray(x.reshape(N, L * H, K).transpose(1, 0, 2))
    # always solved on centred, scaled features (conditioning); without ``standardize`` the penalty
    # is rescaled per feature (l2 / sd²) so the objective is exactly the raw-activation one
    mu = x_PNK.mean(1, keepdims=True)
    sd = x_PNK.std(1, keepdims=True) + 1e-6
    l2 = jnp.float32(1.0 / N if l2 is None else l2)
    l2_PK = jnp.broadcast_to(l2, (L * H, K)) if standardize else l2 / jnp.square(sd[:, 0])
    w, b = _fit((x_PNK - mu) / sd, jnp.asarray(y), l2_PK, int(steps))
    w_raw = w / sd[:, 0]
    b_raw = b - jnp.sum(w_raw * mu[:, 0], axis=-1)
    return Probes(np.asarray(w_raw).reshape(L, H, K), np.asarray(b_raw).reshape(L, H))


def probe_logits(probes: Probes, acts_NLHK) -> np.ndarray:
    """[N, L, H] probe logits x · w + b."""
    x = np.asarray(acts_NLHK, np.float32)
    return np.einsum("nlhk,lhk->nlh", x, probes.w) + probes.b


def validation_accuracy(probes: Probes, acts_NLHK, labels_N) -> np.ndarray:
    """[L, H] accuracy of each head's probe (logit > 0 predicts label 1)."""
    pred = probe_logits(probes, acts_NLHK) > 0
    return (pred == (np.asarray(labels_N)[:, None, None] > 0)).mean(0)


def top_heads(acc_LH, k: int) -> list[tuple[int, int]]:
    """The k (layer, head) pairs with the highest accuracy, best first; ties: lower flat index
    (layer * H + head) first. (honest_llama's ``argsort(...)[::-1]`` breaks ties the other way.)"""
    acc = np.asarray(acc_LH)
    L, H = acc.shape
    if not 0 <= k <= L * H:
        raise ValueError(f"top_heads: k={k} outside [0, {L * H}]")
    order = np.argsort(-acc.reshape(-1), kind="stable")[:k]
    return [(int(i // H), int(i % H)) for i in order]


# ----------------------------------------------------------------------------- directions
def _unit(v, axis=-1):
    n = np.linalg.norm(v, axis=axis, keepdims=True)
    if (n == 0).any():
        raise ValueError("ITI direction: a head's direction is zero (identical class means / zero probe)")
    return v / n


def mass_mean_directions(acts_NLHK, labels_N, desired: int = 1) -> np.ndarray:
    """[L, H, K] unit θ_h = (μ_h(desired) − μ_h(undesired)) / ‖·‖ (honest_llama
    ``get_com_directions``: true_mean − false_mean, labels 1 = true = desired, over train + val)."""
    x = np.asarray(acts_NLHK, np.float64)
    y = np.asarray(labels_N) == desired
    if y.all() or not y.any():
        raise ValueError("mass_mean_directions: both classes are needed")
    return _unit(x[y].mean(0) - x[~y].mean(0)).astype(np.float32)


def probe_directions(probes: Probes, desired: int = 1) -> np.ndarray:
    """[L, H, K] the probes' weight vectors, unit norm, signed toward the desired class (w points
    toward label 1; honest_llama uses ``probe.coef_`` as is, label 1 = true = desired)."""
    w = np.asarray(probes.w, np.float64)
    return (_unit(w) * (1.0 if desired == 1 else -1.0)).astype(np.float32)


def projection_std(acts_NLHK, directions_LHK, ddof: int = 0) -> np.ndarray:
    """[L, H] σ_h = std over the rows of ⟨act_h, θ_h⟩. ddof=0 as honest_llama's
    ``get_interventions_dict`` (``np.std``); its pyvene script ``validate_2fold.py`` uses
    ``torch.std``, i.e. ddof=1."""
    proj = np.einsum("nlhk,lhk->nlh", np.asarray(acts_NLHK, np.float64), np.asarray(directions_LHK, np.float64))
    return proj.std(axis=0, ddof=ddof).astype(np.float32)


# ----------------------------------------------------------------------------- intervention
def iti_deltas(model_cfg, heads, directions_LHK, sigmas_LH, alpha: float) -> dict[int, np.ndarray]:
    """{layer: [G, R, K] float32} the shift α·σ_h·θ_h of each selected head (zeros elsewhere),
    for the layers that have a selected head."""
    L, H, K = _heads_layout(model_cfg)
    G = int(model_cfg.num_kv_heads)
    d = np.asarray(directions_LHK, np.float32)
    s = np.asarray(sigmas_LH, np.float32)
    if d.shape != (L, H, K) or s.shape != (L, H):
        raise ValueError(f"iti: directions {d.shape} / sigmas {s.shape} should be {(L, H, K)} / {(L, H)}")
    out = {}
    for layer, head in heads:
        layer, head = int(layer), int(head)
        if not (0 <= layer < L and 0 <= head < H):
            raise ValueError(f"iti: head ({layer}, {head}) outside {L} layers x {H} heads")
        delta = out.setdefault(layer, np.zeros((H, K), np.float32))
        delta[head] = np.float32(alpha) * s[layer, head] * d[layer, head]
    return {layer: v.reshape(G, H // G, K) for layer, v in out.items()}


@functools.lru_cache(maxsize=None)
def _shift(positions):
    """The edit x, delta [G, R, K] -> x shifted at ``positions`` (one function per positions, so
    ITI edits of any heads' shifts share their static half: the shift is an array argument)."""
    def fn(x, delta):  # x: [B, T, G, R, K]
        d = delta.astype(x.dtype)
        if positions == "all":
            return x + d
        if positions == "last":
            return x.at[:, -1].add(d)
        return x.at[:, positions:].add(d)

    return fn


def iti_edits(model_cfg, heads, directions_LHK, sigmas_LH, alpha: float,
              positions: str | int = "last") -> hooks.Edits:
    """A ``hooks.Edits`` adding α·σ_h·θ_h to each selected (layer, head) of ``layer_i/attn_heads``.

    positions: "last" — the last position of the forward, i.e. the last prompt token in the
    prefill and the current token at every KV-cache decoding step (honest_llama: ``b[0, -1]``
    with pyvene, ``head_output[:, -1]`` in the legacy ``lt_modulated_vector_add``); "all" — every
    position; an int s — positions s.. of a full-sequence forward (honest_llama's
    ``start_edit_location``; not for KV-cache decoding, whose steps have T = 1).
    Use with ``build_model(cfg, edits=...)``, ``generate(..., edits=...)``, ``scored_decode``.
    The shifts are the edits' array arguments: ``generate`` compiles once for every α of a set of
    selected layers."""
    if not (positions in ("last", "all") or (isinstance(positions, int) and positions >= 0)):
        raise ValueError(f"iti_edits: positions must be 'last', 'all' or an int >= 0, got {positions!r}")
    deltas = iti_deltas(model_cfg, heads, directions_LHK, sigmas_LH, alpha)
    names = {layer: f"layer_{layer}/attn_heads" for layer in deltas}
    return hooks.Edits({n: _shift(positions) for n in names.values()},
                       args={names[layer]: jnp.asarray(d) for layer, d in deltas.items()})


def fit_iti(acts_NLHK, labels_N, *, k: int = DEFAULTS["k"], direction: str = DEFAULTS["direction"],
            tuning_acts=None, val_ratio: float = DEFAULTS["val_ratio"], seed: int = DEFAULTS["seed"],
            desired: int = 1, ddof: int = 0, **probe_kw) -> dict:
    """Probes on a train/val split, the top-k heads by validation accuracy, their directions and
    σ (on ``tuning_acts``, default all rows). Returns {heads, accuracy [L, H], directions
    [L, H, K], sigmas [L, H], probes, train_idx, val_idx}; pass heads/directions/sigmas to
    ``iti_edits``."""
    if direction not in DIRECTIONS:
        raise ValueError(f"fit_iti: direction must be one of {DIRECTIONS}, got {direction!r}")
    acts = np.asarray(acts_NLHK, np.float32)
    labels = np.asarray(labels_N)
    train, val = train_val_split(len(acts), val_ratio, seed)
    probes = fit_probes(acts[train], labels[train], **probe_kw)
    acc = validation_accuracy(probes, acts[val], labels[val])
    heads = top_heads(acc, k)
    dirs = mass_mean_directions(acts, labels, desired) if direction == "mass_mean" \
        else probe_directions(probes, desired)
    sig = projection_std(acts if tuning_acts is None else tuning_acts, dirs, ddof=ddof)
    return dict(heads=heads, accuracy=acc, directions=dirs, sigmas=sig, probes=probes,
                train_idx=train, val_idx=val)
