"""A synthetic preference world with a transparent, token-additive gold reward.

Strings are words over a small ``alphabet`` (lower-case letters, one byte each: the byte tokenizer
maps letter i to one token). A dense first-order Markov chain (``init`` [A], ``trans`` [A, A])
generates prompts and continuations; the gold reward of a response is the sum of a fixed weight per
letter,

  gold(y) = sum_t w[y_t],      token reward of y_t = w[y_t]   (``token_rewards``),

so every quantity a preference method estimates has an exact value here: the gold of a response,
which of two responses is better, and the true per-token contribution that TGDPO's guidance model
(or an implicit PRM) tries to recover. The prompt never enters the gold.

Shifts for out-of-distribution evaluation:

* ``tilt`` (prompts, ``val_prompt_ood``): the chain's next-letter probabilities times
  exp(tilt * w), renormalised: the same letters, another distribution (high-reward letters more
  frequent for tilt > 0).
* ``temperature`` (responses, ``val_temp_ood``): next-letter probabilities to the power 1/T,
  renormalised.

Groups use ``sentiment_testbed``'s format (``{"prompt", "responses", "gold", "temperature"}``), so
``sentiment_testbed.pairs_from_groups``, ``kendall_tau_per_prompt``, ``best_of_n_curve`` and
``gold_stats`` apply unchanged. Everything is a deterministic function of the seeds.

Axis letters: A alphabet letters, G groups (prompts), M responses per group.
"""
from __future__ import annotations

import dataclasses
import string

import numpy as np

Group = dict


@dataclasses.dataclass(frozen=True)
class AdditiveWorld:
    alphabet: str
    init: np.ndarray  # [A] first-letter probabilities
    trans: np.ndarray  # [A, A] next-letter probabilities (rows sum to 1)
    weights: np.ndarray  # [A] gold reward of each letter

    def letter_ids(self, text: str, unknown: str = "error") -> np.ndarray:
        """Letter indices of ``text``; with ``unknown="zero"`` a character outside the alphabet
        gets index -1 instead of raising."""
        if unknown not in ("error", "zero"):
            raise ValueError(f"unknown={unknown!r}; choose 'error' or 'zero'")
        index = {c: i for i, c in enumerate(self.alphabet)}
        bad = sorted(set(text) - set(index))
        if bad and unknown == "error":
            raise ValueError(f"{text[:40]!r} has letters outside the alphabet {self.alphabet!r}: "
                             f"{bad}; the gold reward is defined on the world's letters only")
        return np.asarray([index.get(c, -1) for c in text], np.int64)

    def token_rewards(self, response: str, unknown: str = "error") -> np.ndarray:
        """The true per-token contribution w[y_t] of every letter of ``response``, float64 [len].
        ``unknown``: ``"error"`` (default) rejects a character outside the alphabet, ``"zero"``
        gives it reward 0 (text sampled from a model, which may emit other bytes)."""
        ids = self.letter_ids(response, unknown)
        return np.where(ids >= 0, self.weights[np.maximum(ids, 0)], 0.0).astype(np.float64)

    def gold_reward(self, responses, unknown: str = "error") -> np.ndarray:
        """gold(y) = sum_t w[y_t] of each response, float64 [n]; ``unknown`` as in
        ``token_rewards``."""
        return np.asarray([float(self.token_rewards(r, unknown).sum()) for r in responses],
                          np.float64)

    def chain(self, tilt: float = 0.0, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
        """(init, trans) with probabilities p * exp(tilt * w) then p ** (1 / temperature),
        renormalised."""
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        def shift(p):
            q = (p * np.exp(tilt * self.weights)) ** (1.0 / temperature)
            return q / q.sum(-1, keepdims=True)
        return shift(self.init), shift(self.trans)

    def sample(self, n: int, length: int, rng: np.random.Generator, *, after: str | None = None,
               tilt: float = 0.0, temperature: float = 1.0) -> list[str]:
        """``n`` strings of ``length`` letters from the (shifted) chain; ``after``: continue the
        string ``after`` (its last letter conditions the first one)."""
        init, trans = self.chain(tilt, temperature)
        first = init if not after else trans[self.letter_ids(after[-1])[0]]
        out = []
        for _ in range(n):
            ids = [int(rng.choice(len(self.alphabet), p=first))]
            for _ in range(length - 1):
                ids.append(int(rng.choice(len(self.alphabet), p=trans[ids[-1]])))
            out.append("".join(self.alphabet[i] for i in ids))
        return out

    def groups(self, prompts, n_per_prompt: int, response_len: int, rng: np.random.Generator, *,
               temperature: float = 1.0) -> list[Group]:
        """``n_per_prompt`` source continuations of every prompt, each scored by the gold."""
        out = []
        for p in prompts:
            responses = self.sample(n_per_prompt, response_len, rng, after=p,
                                    temperature=temperature)
            out.append({"prompt": p, "responses": responses,
                        "gold": self.gold_reward(responses).tolist(), "temperature": temperature})
        return out


def make_world(seed: int = 0, *, num_letters: int = 8, concentration: float = 1.0) -> AdditiveWorld:
    """A random world: Dirichlet(``concentration``) chain rows and N(0, 1) letter weights."""
    if not 2 <= num_letters <= 26:
        raise ValueError(f"num_letters={num_letters} must be in 2..26 (lower-case letters)")
    rng = np.random.default_rng(seed)
    a = num_letters
    return AdditiveWorld(alphabet=string.ascii_lowercase[:a],
                         init=rng.dirichlet(np.full(a, concentration)),
                         trans=rng.dirichlet(np.full(a, concentration), size=a),
                         weights=rng.standard_normal(a))


def _fresh(world: AdditiveWorld, n: int, length: int, rng, used: set, **shift) -> list[str]:
    """Up to ``n`` distinct chain strings (one draw of 4n) not in ``used``, in draw order."""
    return [p for p in dict.fromkeys(world.sample(4 * n, length, rng, **shift)) if p not in used][:n]


def make_splits(world: AdditiveWorld, seed: int, *, n_train: int, n_val: int, n_per_prompt: int,
                prompt_len: int, response_len: int, tilt: float = 1.0,
                ood_temperature: float = 2.0, n_bon: int = 0,
                bon_per_prompt: int = 0) -> dict[str, list[Group]]:
    """Groups for training and evaluation: ``train`` and ``val_in`` (prompts from the chain,
    disjoint sets), ``val_prompt_ood`` (prompts from the ``tilt``-ed chain), ``val_temp_ood``
    (in-domain prompts, responses at ``ood_temperature``), ``val_both_ood`` (the tilted prompts,
    responses at ``ood_temperature``) and, with ``n_bon``, ``bon``: ``n_bon`` further in-domain
    prompts with ``bon_per_prompt`` responses each (best-of-N). The later parts are drawn after
    the earlier ones, so adding them leaves the earlier parts as they were."""
    rng = np.random.default_rng(seed)
    pool = list(dict.fromkeys(world.sample(4 * (n_train + 2 * n_val), prompt_len, rng)))
    if len(pool) < n_train + 2 * n_val:
        raise ValueError(f"only {len(pool)} distinct prompts of {prompt_len} letters; raise "
                         "prompt_len or lower n_train / n_val")
    train_p, val_p = pool[:n_train], pool[n_train:n_train + n_val]
    temp_p = pool[n_train + n_val:n_train + 2 * n_val]
    used = set(pool[:n_train + 2 * n_val])
    ood_p = _fresh(world, n_val, prompt_len, rng, used, tilt=tilt)
    out = {"train": world.groups(train_p, n_per_prompt, response_len, rng),
           "val_in": world.groups(val_p, n_per_prompt, response_len, rng),
           "val_prompt_ood": world.groups(ood_p, n_per_prompt, response_len, rng),
           "val_temp_ood": world.groups(temp_p, n_per_prompt, response_len, rng,
                                        temperature=ood_temperature)}
    out["val_both_ood"] = world.groups(ood_p, n_per_prompt, response_len, rng,
                                       temperature=ood_temperature)
    if n_bon:
        if bon_per_prompt < 1:
            raise ValueError(f"n_bon={n_bon} needs bon_per_prompt >= 1, got {bon_per_prompt}")
        used |= set(ood_p)
        bon_p = _fresh(world, n_bon, prompt_len, rng, used)
        if len(bon_p) < n_bon:
            raise ValueError(f"only {len(bon_p)} unused prompts of {prompt_len} letters for "
                             f"n_bon={n_bon}; raise prompt_len or lower n_bon")
        out["bon"] = world.groups(bon_p, bon_per_prompt, response_len, rng)
    return out
