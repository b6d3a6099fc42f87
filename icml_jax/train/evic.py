"""EVIC (docs/methods/evic.md): sample-level interactions under the optimizer's own update rule,
and the selection of the samples whose total influence on the pool is positive.

  Int[i, j] = eta * <g_i, Gamma(g_j)>      g_i = grad of example i's loss at the current params
  I_j = sum_i Int[i, j];   select j iff I_j > 0   (or the top fraction by I_j)

Gamma(g) is the step Adam would take for the gradient g from the current moments (m, v, count):
m' = b1 m + (1-b1) g, v' = b2 v + (1-b2) g^2, Gamma(g) = [m'/(1-b1^(c+1))] / (sqrt(v'/(1-b2^(c+1)))
+ eps) -- exactly optax.scale_by_adam's update, so Int[i, j] > 0 means a step on j lowers i's
loss (promotion), < 0 a conflict. ``precond="sgd"``: Gamma = identity (Int symmetric).

Per-example gradients are ``vmap(grad)`` over ``chunk`` examples at a time (``lax.map`` over
chunks), each chunk immediately sketched to k numbers per example, so memory is about
2 * chunk * n_params floats (the gradients and their preconditioned copies) plus the sketch, for
any pool size. Sketches (``proj``):
  none         no projection: the features are the flattened gradients (exact; N * P floats);
  rademacher   a dense P x k matrix of +-1/sqrt(k) (the spec's JL sketch; materialised, so only
               for small P * k);
  countsketch  a sparse JL sketch: each parameter goes to one of k buckets (a random balanced
               assignment) with a random sign (E[Pi Pi^T] = I, the same inner-product guarantee
               in expectation, O(P) per example instead of O(P k)); the default, usable at any
               model size.
Both random sketches use one fixed matrix for g and Gamma(g) and preserve inner products in
expectation.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from icml_jax.atomic import atomic_path

PRECONDS = ("adam", "sgd")
PROJS = ("countsketch", "rademacher", "none")
SELECTS = ("positive", "top")
_DENSE_LIMIT = 1 << 27  # entries of a materialised Rademacher matrix (512 MiB of float32)


def adam_state(opt_state) -> optax.ScaleByAdamState:
    """The one ``optax.ScaleByAdamState`` inside an optimizer state (adam, adamw, or a chain
    holding ``scale_by_adam``); ValueError when there is none or more than one."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
             if isinstance(s, optax.ScaleByAdamState)]
    if len(found) != 1:
        raise ValueError(f"EVIC's Adam preconditioner needs exactly one optax ScaleByAdamState in "
                         f"the optimizer state, found {len(found)}; use an Adam-family optimizer "
                         "or config.evic.precond='sgd'")
    return found[0]


def adam_direction(g, state: optax.ScaleByAdamState, b1: float, b2: float, eps: float):
    """Gamma(g): the update direction ``optax.scale_by_adam(b1, b2, eps)`` would produce from
    ``state`` for the gradient tree ``g`` (its update is this times +1; an optimizer's step on the
    params is -lr times it)."""
    c = (state.count + 1).astype(jnp.float32)

    def leaf(gl, m, v):
        m1 = b1 * m + (1.0 - b1) * gl
        v1 = b2 * v + (1.0 - b2) * jnp.square(gl)
        return (m1 / (1.0 - b1 ** c)) / (jnp.sqrt(v1 / (1.0 - b2 ** c)) + eps)

    return jax.tree.map(leaf, g, state.mu, state.nu)


@dataclasses.dataclass(frozen=True)
class Sketch:
    """A fixed random projection of flattened parameter trees to ``dim`` numbers (see the module
    docstring); ``kind="none"`` keeps the flattened vector."""
    kind: str
    dim: int
    tables: tuple  # rademacher: per leaf a dense [P_l, dim]; countsketch: (perm [P], sign [P])

    def __call__(self, tree_c) -> jax.Array:
        """Leaves with a leading example axis c -> float32 [c, dim] (or [c, P] for ``none``)."""
        leaves = [x.reshape(x.shape[0], -1).astype(jnp.float32) for x in jax.tree.leaves(tree_c)]
        if self.kind == "rademacher":
            return sum(x @ table for x, table in zip(leaves, self.tables))
        flat = jnp.concatenate(leaves, axis=1)
        if self.kind == "none":
            return flat
        # countsketch as permute, sign and fold: coordinate perm[q] lands in bucket q % dim, so
        # every bucket sums about P / dim randomly chosen, randomly signed coordinates (a gather
        # and a reshape; a scatter-add is far slower on CPU)
        perm, sign = self.tables
        x = jnp.take(flat, perm, axis=1) * sign[None]
        x = jnp.pad(x, ((0, 0), (0, -x.shape[1] % self.dim)))
        return x.reshape(x.shape[0], -1, self.dim).sum(1)


def make_sketch(params, kind: str = "countsketch", dim: int = 4096, seed: int = 0) -> Sketch:
    """The sketch of ``kind`` for trees shaped like ``params`` (host arrays, made once)."""
    if kind not in PROJS:
        raise ValueError(f"config.evic.proj must be one of {PROJS}, got {kind!r}")
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    total = sum(sizes)
    if kind == "none":
        return Sketch("none", total, ())
    if dim < 1:
        raise ValueError(f"config.evic.proj_dim must be >= 1, got {dim}")
    rng = np.random.default_rng(seed)
    signs = np.array([-1.0, 1.0], np.float32)
    if kind == "countsketch":
        return Sketch(kind, dim, (jnp.asarray(rng.permutation(total).astype(np.int32)),
                                  jnp.asarray(rng.choice(signs, total))))
    if total * dim > _DENSE_LIMIT:
        raise ValueError(
            f"config.evic.proj='rademacher' would materialise a {total:,} x {dim} matrix "
            f"(> {_DENSE_LIMIT:,} entries); use config.evic.proj='countsketch' (same expected "
            "inner products, O(P) per example) or a smaller config.evic.proj_dim")
    return Sketch(kind, dim, tuple(jnp.asarray(rng.choice(signs, (p, dim)) / np.float32(math.sqrt(dim)))
                                   for p in sizes))


def features(example_loss: Callable, params, examples: dict, sketch: Sketch, *,
             direction: Callable | None = None, chunk: int = 16) -> tuple[jax.Array, jax.Array]:
    """Sketched per-example gradients and their preconditioned copies.

    Args:
      example_loss: ``(params, example) -> scalar`` for one example (arrays without the batch axis).
      params: the current params.
      examples: dict of arrays with a leading axis N.
      sketch: from ``make_sketch``.
      direction: ``g -> Gamma(g)`` (``adam_direction`` bound to a state); None = identity (SGD).
      chunk: examples per ``vmap`` (memory ~ 2 * chunk * n_params floats).

    Returns:
      (A, B) float32 [N, k]: A_i = sketch(g_i), B_i = sketch(Gamma(g_i)).
    """
    n = jax.tree.leaves(examples)[0].shape[0]
    chunk = max(1, min(int(chunk), n))
    pad = -n % chunk
    padded = jax.tree.map(lambda x: jnp.concatenate([x, jnp.repeat(x[:1], pad, 0)]) if pad else x,
                          examples)
    grouped = jax.tree.map(lambda x: x.reshape((-1, chunk) + x.shape[1:]), padded)
    grad_fn = jax.vmap(jax.grad(example_loss), in_axes=(None, 0))

    def one_chunk(ex):
        g = grad_fn(params, ex)
        gamma = g if direction is None else jax.vmap(direction)(g)
        return sketch(g), sketch(gamma)

    a, b = jax.lax.map(one_chunk, grouped)
    return a.reshape(-1, a.shape[-1])[:n], b.reshape(-1, b.shape[-1])[:n]


def interactions(a: jax.Array, b: jax.Array, eta: float = 1.0) -> jax.Array:
    """Int [N, N]: Int[i, j] = eta * <a_i, b_j> (the effect of a step on j on i's loss)."""
    return eta * (a @ b.T)


def influence(a: jax.Array, b: jax.Array, eta: float = 1.0) -> jax.Array:
    """I [N]: I_j = sum_i Int[i, j], without forming Int (= eta * <sum_i a_i, b_j>)."""
    return eta * (b @ a.sum(0))


def select(total: np.ndarray, rule: str = "positive", top_fraction: float = 0.5) -> np.ndarray:
    """bool [N]: I_j > 0 (``positive``), or the ceil(top_fraction * N) largest I_j (``top``;
    ties by index)."""
    total = np.asarray(total)
    if rule == "positive":
        return total > 0
    if rule != "top":
        raise ValueError(f"config.evic.select must be one of {SELECTS}, got {rule!r}")
    if not 0 < top_fraction <= 1:
        raise ValueError(f"config.evic.top_fraction must be in (0, 1], got {top_fraction}")
    k = math.ceil(top_fraction * len(total))
    mask = np.zeros(len(total), bool)
    mask[np.argsort(-total, kind="stable")[:k]] = True
    return mask


def sign_flip_rate(int_a: np.ndarray, int_b: np.ndarray) -> float:
    """Share of the off-diagonal entries whose sign differs between two rounds' Int."""
    off = ~np.eye(len(int_a), dtype=bool)
    return float(np.mean(np.sign(int_a[off]) != np.sign(int_b[off])))


# ------------------------------------------------------------------ the train loop's refresh


def settings(config) -> dict | None:
    """``config.evic`` checked (ValueError naming the key), or None when absent / disabled."""
    e = config.get("evic")
    if e is None or not e.get("enabled", False):
        return None
    out = dict(every=int(e.every), start=int(e.start), precond=str(e.precond), proj=str(e.proj),
               proj_dim=int(e.proj_dim), chunk=int(e.chunk), select=str(e.select),
               top_fraction=float(e.top_fraction), seed=int(e.seed),
               save_matrix_max=int(e.save_matrix_max), noise_check=bool(e.get("noise_check", False)))
    for key in ("every", "chunk", "proj_dim"):
        if out[key] < 1:
            raise ValueError(f"config.evic.{key} must be >= 1, got {out[key]}")
    if out["start"] == -1:  # the default: one interval of training on the whole pool first
        out["start"] = out["every"]
    if out["start"] < 0:
        raise ValueError(f"config.evic.start must be >= 0 (the step of the first refresh) or -1 "
                         f"(= config.evic.every), got {out['start']}")
    steps = config.get("train", {}).get("steps")
    if steps is not None and out["start"] >= int(steps):
        raise ValueError(f"config.evic.start={out['start']} (the first refresh; -1 means config.evic.every="
                         f"{out['every']}) is not before config.train.steps={int(steps)}: no refresh would run "
                         "and the run would be plain SFT; lower config.evic.every or set config.evic.start")
    for key, allowed in (("precond", PRECONDS), ("proj", PROJS), ("select", SELECTS)):
        if out[key] not in allowed:
            raise ValueError(f"config.evic.{key} must be one of {allowed}, got {out[key]!r}")
    if not 0 < out["top_fraction"] <= 1:
        raise ValueError(f"config.evic.top_fraction must be in (0, 1], got {out['top_fraction']}")
    return out


def check_task(config, task) -> None:
    """ValueError unless ``config.evic`` is off or ``task`` has per-example losses over a pool."""
    if settings(config) is None:
        return
    if not callable(getattr(task, "example_loss", None)) or not hasattr(task, "train_arrays"):
        raise ValueError(f"config.evic.enabled needs a task with per-example losses over a fixed "
                         f"pool (e.g. 'sft'); config.task={config.task!r} has none")


class Refresher:
    """EVIC in the train loop: before the update of every step ``start + r * every`` the
    interactions of the whole training pool are computed under that step's params and optimizer
    state, and the sampler (``data.preference.SubsetIterator``) continues on the selected rows.
    The selection lives in the sampler's checkpointed state, and a refresh is a deterministic
    function of the checkpointed train state, so a resumed run repeats it exactly.

    Each refresh writes ``WORKDIR/evic/round_<step>.npz`` (process 0, atomically): ``mask``,
    ``influence`` (I_j), ``selected_before`` and ``interactions``: Int (eta = 1) among the first
    ``save_matrix_max`` rows of the pool (all of it when smaller); with ``noise_check`` also
    ``interactions_alt_sketch``, the same block under a second, independent sketch."""

    def __init__(self, opts: dict, config, task, data_iter, abstract_state, workdir: str):
        check_task(config, task)
        where = f"config.task={config.task!r}"
        if not callable(getattr(data_iter, "select", None)):
            raise ValueError(f"config.evic.enabled needs a selectable sampler; {where}'s train "
                             "iterator has no select()")
        if opts["precond"] == "adam":
            adam_state(abstract_state.opt_state)  # raises when the optimizer holds no Adam
        self.opts, self.data_iter, self.workdir = opts, data_iter, workdir
        t = config.train
        keys = ("inputs", "positions", "segment_ids", "response_mask")
        self.pool = {k: np.asarray(task.train_arrays[k]) for k in keys}
        self.n = int(self.pool["inputs"].shape[0])
        sketch = make_sketch(abstract_state.params, opts["proj"], opts["proj_dim"], opts["seed"])
        alt = make_sketch(abstract_state.params, opts["proj"], opts["proj_dim"], opts["seed"] + 1)
        b1, b2, eps = float(t.b1), float(t.b2), float(t.eps)

        def fn(params, opt_state, pool):
            direction = None
            if opts["precond"] == "adam":
                st = adam_state(opt_state)
                direction = lambda g: adam_direction(g, st, b1, b2, eps)  # noqa: E731
            a, b = features(task.example_loss, params, pool, sketch, direction=direction,
                            chunk=opts["chunk"])
            total = influence(a, b)
            m = min(self.n, opts["save_matrix_max"])  # Int of the first m rows only
            mat = interactions(a[:m], b[:m])
            if not opts["noise_check"]:
                return total, mat, jnp.zeros((0, 0))
            # the same rows under an independent sketch: how much of Int's sign pattern is the
            # sketch's own noise (compare its flip rate with the rounds')
            head = jax.tree.map(lambda x: x[:m], pool)
            a_alt, b_alt = features(task.example_loss, params, head, alt, direction=direction,
                                  chunk=opts["chunk"])
            return total, mat, interactions(a_alt, b_alt)

        self.fn = jax.jit(fn)

    def due(self, step: int) -> bool:
        o = self.opts
        return step >= o["start"] and (step - o["start"]) % o["every"] == 0

    def __call__(self, step: int, state) -> dict:
        """Recomputes the selection before update ``step``; returns the metrics to log."""
        t0 = time.time()
        total, mat, mat_alt = jax.device_get(self.fn(state.params, state.opt_state, self.pool))
        mask = select(total, self.opts["select"], self.opts["top_fraction"])
        before = self.data_iter.selection
        kept = bool(mask.any())
        round_id = (step - self.opts["start"]) // self.opts["every"] + 1
        # nothing with positive influence: keep drawing from the previous selection
        self.data_iter.select(mask if kept else before, round_id)
        if jax.process_index() == 0:
            path = f"{self.workdir}/evic/round_{step:07d}.npz"
            with atomic_path(path, suffix=".tmp.npz") as tmp:
                np.savez(tmp, mask=self.data_iter.selection, influence=total,
                         selected_before=before, interactions=mat, interactions_alt_sketch=mat_alt,
                         step=step)
        return {"evic/selected": float(self.data_iter.selection.mean()),
                "evic/positive": float((total > 0).mean()),
                "evic/changed": float((self.data_iter.selection != before).mean()),
                "evic/kept_previous": float(not kept), "evic/seconds": time.time() - t0}
