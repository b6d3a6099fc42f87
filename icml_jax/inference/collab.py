"""Collaborative decoding of two models and its speculative acceleration (CoS, Fu et al., ICML 2025).

Collaborative decoding samples every token from a combined distribution r = f(p_a, p_b) of two
models that share a tokenizer (``COMBINERS``: ``we`` weighted ensemble of the tempered
probabilities, ``cd`` contrastive decoding on raw logits, ``target`` = model b alone, i.e. plain
speculative decoding). Three drivers, all batch 1, give the same output distribution:

  ``collaborative_decode``  both models score every token (the reference, 2 calls per token);
  ``speculative_decode(..., alternate=False)``  Naive-CoS: model a drafts ``gamma`` tokens from
      its own distribution, model b scores them all in one call, draft j is accepted with
      probability min(1, r_j(x_j) / q_j(x_j)) and the first rejection is replaced by a sample of
      normalise(max(0, r - q)); when every draft is accepted a bonus token is drawn from r
      (for which a feeds its last draft);
  ``speculative_decode(..., alternate=True)``  CoS: when every draft is accepted the bonus is drawn
      from the verifier's own distribution p_b and becomes a draft that model a checks against r
      (ratio r / p_b) in its next call, together with its next drafting step: the roles alternate
      and no call is spent only on the bonus.
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
    """r = f(a, b) from the two models' raw logits at one position, at temperature ``temperature``
    (> 0; temperature 0 is handled by the drivers as argmax of the T = 1 combination)."""
    name: str = "we"
    weight_a: float = 0.5  # we: r = weight_a * p_a + (1 - weight_a) * p_b
    alpha: float = 0.1  # cd: r = softmax((l_b - alpha * l_a) / T), a the amateur

    def __post_init__(self):
        if self.name not in COMBINERS:
            raise ValueError(f"combiner {self.name!r}; choose one of {sorted(COMBINERS)}")
        if not 0 <= self.weight_a <= 1:
            raise ValueError(f"weight_a={self.weight_a} must lie in [0, 1]")

    def __call__(self, logits_a, logits_b, temperature: float = 1.0) -> np.ndarray:
        return COMBINERS[self.name](self, np.asarray(logits_a, np.float64), np.asarray(logits_b, np.float64),
                                    max(temperature, 1e-6) if temperature > 0 else 1.0)


COMBINERS: dict[str, Callable] = {
    "we": lambda c, la, lb, t: c.weight_a * _softmax(la / t) + (1 - c.weight_a) * _softmax(lb / t),
    "cd": lambda c, la, lb, t: _softmax((lb - c.alpha * la) / t),
    "target": lambda c, la, lb, t: _softmax(lb / t),
}


def _draw(rng, p) -> int:
    p = np.asarray(p, np.float64)
    return int(rng.choice(p.shape[-1], p=p / p.sum()))


def _accept(rng, r, q, x: int, greedy: bool) -> bool:
    """The speculative rule: greedy, x is argmax r; else accept with probability min(1, r(x)/q(x))."""
    if greedy:
        return x == int(np.argmax(r))
    return bool(rng.uniform() < min(1.0, r[x] / q[x]))


def _residual(r, q):
    d = np.maximum(np.asarray(r, np.float64) - np.asarray(q, np.float64), 0.0)
    return d / d.sum() if d.sum() > 0 else np.asarray(r, np.float64)


# ----------------------------------------------------------------------------- drivers

def collaborative_decode(a: CachedLM, b: CachedLM, prompt: Sequence[int], max_new: int, combiner: Combiner,
                         *, temperature: float = 1.0, seed: int = 0) -> list[int]:
    """The reference: every token from r, both models called once per token."""
    rng = np.random.default_rng(seed)
    la, lb = a.feed(prompt)[-1], b.feed(prompt)[-1]
    out = []
    for _ in range(max_new):
        r = combiner(la, lb, temperature if temperature > 0 else 1.0)
        y = int(np.argmax(r)) if temperature == 0 else _draw(rng, r)
        out.append(y)
        if len(out) < max_new:
            la, lb = a.feed([y])[-1], b.feed([y])[-1]
    return out


def speculative_decode(a: CachedLM, b: CachedLM, prompt: Sequence[int], max_new: int, combiner: Combiner,
                       *, gamma: int = 5, temperature: float = 1.0, alternate: bool = True,
                       seed: int = 0, stats: dict | None = None) -> list[int]:
    """Tokens of collaborative decoding with model a drafting ``gamma`` tokens per round and model b
    verifying them in one call (see the module docstring); ``alternate`` = CoS's bonus rule.
    ``stats`` (a dict) receives ``rounds``, ``accepted`` (drafts accepted) and ``drafted``."""
    if gamma < 1:
        raise ValueError(f"gamma={gamma} must be >= 1")
    greedy = temperature == 0
    t = temperature if not greedy else 1.0
    rng = np.random.default_rng(seed)
    dist = (lambda logits: _softmax(np.asarray(logits, np.float64) / t))  # noqa: E731
    st = stats if stats is not None else {}
    st.update(rounds=0, accepted=0, drafted=0)

    la_next = a.feed(prompt)[-1]  # a's logits for the next position (after everything it consumed)
    lb_next = b.feed(prompt)[-1]
    out: list[int] = []
    unfed_a: list[int] = []  # final tokens a has not consumed yet
    unfed_b: list[int] = []
    carried = None  # CoS: (token, proposal dist, b's logits there) drafted by b, to be checked by a

    def emit(tok):
        out.append(tok)
        return len(out) >= max_new

    while len(out) < max_new:
        st["rounds"] += 1
        if carried is not None:  # a checks b's bonus token against r in the call that feeds it
            y, q_y, lb_y = carried
            carried = None
            la = a.feed(unfed_a + [y])
            unfed_a = []
            r = combiner(la[-2], lb_y, t)  # a's logits at y's position, b's from its last call
            ok = _accept(rng, r, q_y, y, greedy)
            st["drafted"] += 1
            if ok:
                st["accepted"] += 1
                if emit(y):
                    break
                la_next, unfed_b = la[-1], [y]
            else:
                a.rollback(a.length - 1)
                z = int(np.argmax(r)) if greedy else _draw(rng, _residual(r, q_y))
                if emit(z):
                    break
                unfed_a, unfed_b = [z], [z]
                continue
        if unfed_a:
            la_next = a.feed(unfed_a)[-1]
            unfed_a = []
        # a drafts gamma tokens (its own distribution; greedy: its argmax)
        base_a = a.length
        drafts, qs, las = [], [], []
        for j in range(gamma):
            q = dist(la_next)
            x = int(np.argmax(q)) if greedy else _draw(rng, q)
            drafts.append(x)
            qs.append(q)
            las.append(la_next)
            if j < gamma - 1:
                la_next = a.feed([x])[-1]
        # b scores its unfed tokens and the drafts in one call
        base_b = b.length
        lbs = b.feed(unfed_b + drafts)
        lb_pos = [lb_next if not unfed_b else lbs[len(unfed_b) - 1]] + list(lbs[len(unfed_b):])
        n = 0
        stop = False
        for j in range(gamma):
            st["drafted"] += 1
            r = combiner(las[j], lb_pos[j], t)
            x = drafts[j]
            ok = _accept(rng, r, qs[j], x, greedy)
            if not ok:
                z = int(np.argmax(r)) if greedy else _draw(rng, _residual(r, qs[j]))
                break
            n += 1
            st["accepted"] += 1
            if emit(x):
                stop = True
                break
        if stop:
            break
        if n < gamma:  # rejected at draft n: keep the accepted prefix, emit the replacement
            a.rollback(base_a + n)
            b.rollback(base_b + len(unfed_b) + n)
            if emit(z):
                break
            unfed_a, unfed_b = [z], [z]
            lb_next = None
            continue
        # every draft accepted: b's logits after the last draft are lb_pos[gamma]
        if alternate:  # CoS: the bonus comes from b's own distribution, a checks it next round
            q_b = dist(lb_pos[gamma])
            y = int(np.argmax(q_b)) if greedy else _draw(rng, q_b)
            carried = (y, q_b, lb_pos[gamma])
            unfed_a, unfed_b = [drafts[-1]], []
            lb_next = None
        else:  # Naive-CoS: a feeds its last draft so that r can be formed there
            la_next = a.feed([drafts[-1]])[-1]
            r = combiner(la_next, lb_pos[gamma], t)
            y = int(np.argmax(r)) if greedy else _draw(rng, r)
            if emit(y):
                break
            unfed_a, unfed_b = [y], [y]
            lb_next = None
    return out[:max_new]


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
    tokens (one jitted program per token count), ``rollback`` resets every layer's cache index
    (the slots past it are never attended and are overwritten by the next feed)."""

    def __init__(self, model_cfg, params, max_len: int | None = None):
        from icml_jax.inference.decode import init_cache
        from icml_jax.models.decoder import build_model
        model = build_model(model_cfg, decode=True)
        self.params = params
        self.max_len = int(max_len or model_cfg.max_seq_len)
        self._empty = init_cache(model, 1, self.max_len)

        def step(params, cache, toks, pos):
            logits, mut = model.apply({"params": params, "cache": cache}, toks, pos,
                                      jnp.ones_like(toks), mutable=["cache"])
            return logits[0].astype(jnp.float32), mut["cache"]
        self._step = jax.jit(step)
        self._reset()

    def _reset(self):
        self.cache = self._empty
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
        logits, self.cache = self._step(self.params, self.cache, toks, pos)
        self.calls += 1
        self.tokens_fed += n
        self.tokens += [int(x) for x in tokens]
        return np.asarray(logits)

    def rollback(self, length: int) -> None:
        del self.tokens[length:]
        self.cache = _set_cache_index(self.cache, np.int32(length))


@jax.jit
def _set_cache_index(cache, length):
    """The cache with every ``index`` leaf (the KV write pointer) set to ``length``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, length) if getattr(path[-1], "key", None) == "index" else x, cache)
