"""Collaborative decoding of n models and its speculative acceleration (CoS, Fu et al., ICML 2025).

Collaborative decoding samples every token from a combined distribution r = f(p_1, ..., p_n) of
models that share a tokenizer (``COMBINERS``: ``we`` weighted ensemble of the tempered
probabilities, ``cd`` contrastive decoding of two models on raw logits, ``target`` = the last
model alone, i.e. plain speculative decoding). Three drivers, all batch 1, give the same output
distribution (models listed small first: ``[a, b]`` or ``[a, b, c]``):

  ``collaborative_decode``  every model scores every token (the reference, n calls per token);
  ``speculative_decode(..., alternate=False)``  Naive-CoS: model a drafts ``gamma`` tokens from
      its own distribution, every other model scores them in one call, draft j is accepted with
      probability min(1, r_j(x_j) / q_j(x_j)) and the first rejection is replaced by a sample of
      normalise(max(0, r - q)); when every draft is accepted the next token is drawn from r
      (for which a feeds its last draft);
  ``speculative_decode(..., alternate=True)``  CoS: the models take turns; each turn's call scores
      the others' drafts and yields the caller's own distribution after them, from which it draws a
      bonus token that becomes a draft (ratio r / p_caller) for the next models to check, together
      with their own drafting: the roles alternate and no call is spent only on the bonus. A token
      is final once every model has scored it.
At temperature 0 every rule becomes: accept iff the draft is argmax r, replace by argmax r, so the
output equals argmax-r decoding token for token.

Models are ``CachedLM`` objects (``feed(tokens) -> logits after each``, ``rollback(length)``):
``FlaxLM`` wraps one of our decoders with its KV cache (a rollback resets the cache's index
pointer; stale slots past it are never attended), ``TableLM`` a fixed next-token table (tests).
Every call is counted per model (``calls``, ``tokens_fed``) for the cost comparison.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from icml_jax.xla_env import decode_jit


class CachedLM(Protocol):
    length: int  # tokens consumed so far
    calls: int

    def feed(self, tokens: Sequence[int]) -> np.ndarray:
        """Consumes ``tokens``; float32 logits [len(tokens), V] for the position after each."""

    def rollback(self, length: int) -> None:
        """Forgets every token after the first ``length`` consumed ones."""


# ----------------------------------------------------------------------------- combination

def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class Combiner:
    """r = f(l_1, ..., l_n) from the models' raw logits at one position, at temperature
    ``temperature`` (> 0; temperature 0 is handled by the drivers as argmax of the T = 1 combination).
    Models are in the drivers' order: the first is the main proposer ("a"), the last the target."""
    name: str = "we"
    weight_a: float = 0.5  # we, two models: r = weight_a * p_a + (1 - weight_a) * p_b
    alpha: float = 0.1  # cd (two models): r = softmax((l_b - alpha * l_a) / T), a the amateur
    weights: tuple = ()  # we, n models: r = sum_i weights[i] * p_i (sums to 1; () = see weight_a / uniform)

    def __post_init__(self):
        if self.name not in COMBINERS:
            raise ValueError(f"combiner {self.name!r}; choose one of {sorted(COMBINERS)}")
        if not 0 <= self.weight_a <= 1:
            raise ValueError(f"weight_a={self.weight_a} must lie in [0, 1]")
        if self.weights and (min(self.weights) < 0 or abs(sum(self.weights) - 1) > 1e-6):
            raise ValueError(f"weights={self.weights} must be non-negative and sum to 1")

    def mixture(self, n: int) -> np.ndarray:
        """``we``'s weight of each of n models."""
        if self.weights:
            if len(self.weights) != n:
                raise ValueError(f"combiner weights={self.weights} name {len(self.weights)} models; got {n}")
            return np.asarray(self.weights, np.float64)
        return np.asarray([self.weight_a, 1 - self.weight_a] if n == 2 else [1 / n] * n, np.float64)

    def __call__(self, *logits, temperature: float = 1.0) -> np.ndarray:
        """``combiner(l_a, l_b[, l_c, ...], temperature=T)`` -> r [V] (float64, sums to 1)."""
        if len(logits) < 2:
            raise ValueError(f"a combination needs at least two models' logits, got {len(logits)}")
        t = max(temperature, 1e-6) if temperature > 0 else 1.0
        return COMBINERS[self.name](self, [np.asarray(z, np.float64) for z in logits], t)


def _contrast(c, ls, t):
    if len(ls) != 2:
        raise ValueError(f"combiner 'cd' contrasts two models (amateur first, expert last); got {len(ls)}")
    return _softmax((ls[1] - c.alpha * ls[0]) / t)


COMBINERS: dict[str, Callable] = {
    "we": lambda c, ls, t: sum(w * _softmax(z / t) for w, z in zip(c.mixture(len(ls)), ls)),
    "cd": _contrast,
    "target": lambda c, ls, t: _softmax(ls[-1] / t),
}


def _draw(rng, p) -> int:
    """A draw from normalise(p): the same index, from the same random stream, as
    ``rng.choice(len(p), p=p / p.sum())`` (numpy's own inverse-CDF rule, a third of its cost)."""
    p = np.asarray(p, np.float64)
    total = p.sum()
    if not (np.isfinite(total) and total > 0) or (p < 0).any():
        raise ValueError(f"cannot sample from weights summing to {total} (min {p.min()}): need finite, "
                         "non-negative weights with a positive sum")
    cdf = (p / total).cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def _accept(rng, r, q, x: int, greedy: bool) -> bool:
    """The speculative rule: greedy, x is argmax r; else accept with probability min(1, r(x)/q(x))."""
    if greedy:
        return x == int(np.argmax(r))
    return bool(rng.uniform() < min(1.0, r[x] / q[x]))


def _residual(r, q):
    d = np.maximum(np.asarray(r, np.float64) - np.asarray(q, np.float64), 0.0)
    return d / d.sum() if d.sum() > 0 else np.asarray(r, np.float64)


# ----------------------------------------------------------------------------- drivers

def collaborative_decode(models: Sequence[CachedLM], prompt: Sequence[int], max_new: int, combiner: Combiner,
                         *, temperature: float = 1.0, seed: int = 0) -> list[int]:
    """The reference: every token from r, each model called once per token."""
    rng = np.random.default_rng(seed)
    logits = [m.feed(prompt)[-1] for m in models]
    out = []
    for _ in range(max_new):
        r = combiner(*logits, temperature=temperature)
        y = int(np.argmax(r)) if temperature == 0 else _draw(rng, r)
        out.append(y)
        if len(out) < max_new:
            logits = [m.feed([y])[-1] for m in models]
    return out


def speculative_decode(models: Sequence[CachedLM], prompt: Sequence[int], max_new: int, combiner: Combiner,
                       *, gamma: int | Sequence[int] = 5, temperature: float = 1.0, alternate: bool = True,
                       seed: int = 0, stats: dict | None = None) -> list[int]:
    """Tokens of collaborative decoding of ``models`` sped up by speculation (module docstring).

    Every position of the sequence is settled in order once every model has its logits there: a
    pending draft x (drawn from its proposer's distribution q) is accepted with probability
    min(1, r(x)/q(x)), else replaced by a draw from normalise(max(0, r - q)) and every model rolls
    back to it; a position with all logits and no draft gets a token drawn from r itself.

    ``alternate`` (CoS): models take turns in list order. On its turn model i is called once on
    everything it has not seen (scoring the others' drafts, which may settle them), then drafts
    ``gamma[i]`` tokens from its own distribution: the first from the logits of that call (its
    bonus token, no extra call), each further one after feeding the previous. After a rejection
    model 0 (the main drafter) takes the next turn. ``alternate=False`` (Naive-CoS, fixed roles):
    model 0 drafts ``gamma[0]`` tokens each round and the others only verify; when every draft
    passes, the next token is drawn from r (model 0 feeds its last draft for it).
    ``gamma`` an int is model 0's draft length, every other model proposing only its bonus token
    (per-model list otherwise). ``stats`` (a dict) receives ``rounds`` (model 0's drafting turns),
    ``accepted`` (drafts accepted) and ``drafted`` (drafts verified)."""
    n = len(models)
    if n < 2:
        raise ValueError(f"speculative_decode needs at least two models, got {n}")
    gammas = [int(gamma)] + [1] * (n - 1) if np.isscalar(gamma) else [int(g) for g in gamma]
    if len(gammas) != n or min(gammas) < 1:
        raise ValueError(f"gamma={gamma}: one draft length >= 1 per model ({n} models)")
    greedy = temperature == 0
    t = temperature if not greedy else 1.0
    rng = np.random.default_rng(seed)
    st = stats if stats is not None else {}
    st.update(rounds=0, accepted=0, drafted=0)
    P = len(prompt)
    seq = list(prompt)  # prompt + settled tokens + pending drafts
    qs: dict[int, np.ndarray] = {}  # position -> proposal distribution of the draft there
    lg: list[dict[int, np.ndarray]] = [{} for _ in models]  # model -> {unsettled position: its logits}
    st_out: list[int] = []  # settled tokens

    def call(i):
        """Model i consumes every token it has not seen; its logits at each position after."""
        m = models[i]
        start = m.length
        rows = m.feed(seq[start:])
        for k, row in enumerate(rows):
            lg[i][start + 1 + k] = row

    def settle() -> bool:
        """Settles positions in order while every model has logits there; True on a rejection."""
        while len(st_out) < max_new:
            p = P + len(st_out)
            if not all(p in d for d in lg):
                return False
            r = combiner(*[d.pop(p) for d in lg], temperature=t)  # p settles now: its logits go
            if p == len(seq):  # no draft here: the token comes from r
                y = int(np.argmax(r)) if greedy else _draw(rng, r)
                seq.append(y)
                st_out.append(y)
                continue
            x, q = seq[p], qs.pop(p)
            st["drafted"] += 1
            if _accept(rng, r, q, x, greedy):
                st["accepted"] += 1
                st_out.append(x)
                continue
            z = int(np.argmax(r)) if greedy else _draw(rng, _residual(r, q))
            del seq[p:]
            seq.append(z)
            st_out.append(z)
            for k in [k for k in qs if k > p]:
                del qs[k]
            for i, m in enumerate(models):
                if m.length > p:
                    m.rollback(p)
                for k in [k for k in lg[i] if k > p]:
                    del lg[i][k]
            return True
        return False

    def propose(i, g) -> bool:
        """Model i drafts g tokens (feeding what it needs first); True if a rejection intervened."""
        drafted = 0
        while drafted < g and len(st_out) < max_new:
            if len(seq) not in lg[i]:
                call(i)
            if settle():
                return True
            if len(st_out) >= max_new or len(seq) not in lg[i]:
                continue  # tokens were drawn from r: feed them before drafting
            x_dist = _softmax(np.asarray(lg[i][len(seq)], np.float64) / t)
            x = int(np.argmax(x_dist)) if greedy else _draw(rng, x_dist)
            qs[len(seq)] = x_dist
            seq.append(x)
            drafted += 1
        return False

    for i in range(n):  # every model reads the prompt (the prefill call)
        call(i)
    turn = 0
    while len(st_out) < max_new:
        if turn == 0:
            st["rounds"] += 1
        if alternate:
            rejected = propose(turn, gammas[turn])
            turn = 0 if rejected else (turn + 1) % n
            continue
        if propose(0, gammas[0]):
            continue
        for v in range(1, n):
            if len(st_out) >= max_new:
                break
            if len(seq) not in lg[v]:
                call(v)
            if settle():
                break
    return st_out[:max_new]


# ----------------------------------------------------------------------------- models

class TableLM:
    """A model whose next-token logits depend on the last token only (``table`` [V, V]); the
    prompt's first token conditions the first step. Counts calls like a real model."""

    def __init__(self, table):
        self.table = np.asarray(table, np.float64)
        self.tokens: list[int] = []
        self.calls = 0
        self.tokens_fed = 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def feed(self, tokens):
        self.calls += 1
        self.tokens_fed += len(tokens)
        self.tokens += [int(x) for x in tokens]
        return self.table[np.asarray(tokens, int)]

    def rollback(self, length: int) -> None:
        del self.tokens[length:]


class FlaxLM:
    """One of our decoders with its KV cache, batch 1: ``feed`` runs the cached model on the new
    tokens (one jitted program per token count), ``rollback`` only shortens the host-side token
    list: every feed sets each layer's cache index (the KV write pointer) to the number of tokens
    kept, inside its jitted step, so a rollback costs no device call (the slots past the pointer
    are never attended and are overwritten by the next feed)."""

    def __init__(self, model_cfg, params, max_len: int | None = None):
        from icml_jax.inference.decode import init_cache
        from icml_jax.models.attention import kv_policy_of
        from icml_jax.models.decoder import build_model, split_layers, unrolled
        pol = kv_policy_of(model_cfg)
        if pol is not None:  # its slots hold what it chose to keep: moving the pointer back cannot undo that
            raise ValueError(f"collab.FlaxLM: config.model.kv_policy.name={pol.name!r} evicts and overwrites "
                             "cache slots, which a rollback by write pointer cannot undo (and a multi-token "
                             "feed would be taken for a new prompt); set config.model.kv_policy.name='full' "
                             "for collaborative or speculative decoding")
        decode_cfg, split = unrolled(model_cfg)  # a scanned model runs unrolled (decoder.unrolled)
        params = split_layers(params, split)
        model = build_model(decode_cfg, decode=True)
        self.params = params
        self.max_len = int(max_len or model_cfg.max_seq_len)
        # every sequence starts from a fresh zero cache (one call): the step donates its cache
        self._empty = jax.jit(lambda: init_cache(model, 1, self.max_len))

        def step(params, cache, toks, pos):
            cache = _set_cache_index(cache, pos[0, 0])  # the pointer follows the host's length
            logits, mut = model.apply({"params": params, "cache": cache}, toks, pos,
                                      jnp.ones_like(toks), mutable=["cache"])
            return logits[0].astype(jnp.float32), mut["cache"]
        # the cache is donated: each call updates it in place instead of copying every layer's
        self._step = decode_jit(step, donate_argnums=(1,))
        self._reset()

    def _reset(self):
        self.cache = None  # made on the first feed
        self.tokens: list[int] = []
        self.calls = 0
        self.tokens_fed = 0

    def fork(self) -> "FlaxLM":
        """A fresh, empty copy sharing the weights and the compiled step (no recompilation)."""
        other = object.__new__(FlaxLM)
        other.__dict__.update(self.__dict__)
        other._reset()
        return other

    @property
    def length(self) -> int:
        return len(self.tokens)

    def feed(self, tokens):
        n = len(tokens)
        if self.length + n > self.max_len:
            raise ValueError(f"FlaxLM: {self.length + n} tokens exceed its cache of {self.max_len}")
        toks = np.asarray([list(tokens)], np.int32)  # host arrays: one transfer with the call
        pos = np.arange(self.length, self.length + n, dtype=np.int32)[None]
        cache = self._empty() if self.cache is None else self.cache
        try:
            logits, self.cache = self._step(self.params, cache, toks, pos)
        except BaseException:
            if any(x.is_deleted() for x in jax.tree.leaves(cache)):  # donated and gone: start over
                self._reset()
            raise
        self.calls += 1
        self.tokens_fed += n
        self.tokens += [int(x) for x in tokens]
        return np.asarray(logits)

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the next feed writes from position ``length`` on


def _set_cache_index(cache, length):
    """The cache with every ``index`` leaf (the KV write pointer) set to ``length``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, length) if getattr(path[-1], "key", None) == "index" else x, cache)
