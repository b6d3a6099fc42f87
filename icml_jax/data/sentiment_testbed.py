"""A preference testbed with a known gold reward: VADER sentiment of Shakespeare continuations.

A small SFT policy (a byte-level LM trained on the Shakespeare ``train`` works) continues prompts
cut from the texts; a fixed *gold* reward that no model ever sees labels the continuations:
``gold_reward`` = the VADER compound sentiment score of the continuation alone (prompt excluded).
Reward models learn it from gold-labelled pairs; policies are judged by it.

Pieces (the builder that trains the policy and caches every part is
``experiments/preference_testbed.py``):

* ``prompt_pool``     n distinct prompts from the texts of a split (or a list of works). The
  in-domain works are the corpus ``train`` split (``IN_DOMAIN_SPLIT``), the out-of-domain ones
  the ``test`` split (``OOD_SPLIT``: 4 works no model trains on; the ``validation`` works are the
  SFT's eval set). Within each work, lines are grouped into fixed blocks and a fixed 20% of the
  blocks are *held out* (``part="heldout"``) from the prompts used for training reward models or
  policies (``part="train"``), so train and held-out prompts never share a passage. The SFT
  policy itself was trained on every line of the ``train`` works, held-out blocks included: for
  in-domain prompts "held out" means unseen by the reward model / preference training, not by
  the LM pre-training.
* groups: n continuations per prompt (``inference.sampling.sample_batched``), each scored by
  the gold reward, ``{"prompt", "responses", "gold", "temperature"}``, are sampled by
  ``experiments/preference_testbed.sample_groups``: this module reads and scores text only.
* ``pairs_from_groups`` TRL-format preference rows labelled by gold.
* ``kendall_tau_per_prompt``, ``best_of_n_curve`` and ``gold_stats``: evaluation against gold.
* ``save_groups`` / ``load_groups``: JSON, written atomically.

Axis letters: G groups (prompts), M responses per group, N best-of-n size, R draws.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from icml_jax.atomic import write_atomic

IN_DOMAIN_SPLIT = "train"
OOD_SPLIT = "test"
GOLD_NAME = "vader-3.3.2-compound"  # names the gold function in cache keys
HELDOUT_FRACTION = 0.2
BLOCK_LINES = 40  # lines per block of the train / held-out partition of a work

Group = dict[str, Any]


# ----------------------------------------------------------------------------- gold reward

@functools.lru_cache(maxsize=1)
def _analyzer():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer  # pylint: disable=g-import-not-at-top
    return SentimentIntensityAnalyzer()


def gold_reward(texts: Sequence[str]) -> np.ndarray:
    """The gold reward of each text: its VADER compound sentiment score, float32 [len(texts)].

    VADER (Hutto & Gilbert 2014; PyPI ``vaderSentiment==3.3.2``, lexicon bundled) sums the
    valences of the words it finds in its ~7,500-entry human-rated lexicon ("love" +3.2,
    "sweet" +2.0, "death" -2.9, ...), adjusted by rules for negation ("not good"), degree words
    ("very"), contrast ("but"), ALL-CAPS and exclamation marks, and squashes the sum s to
    s / sqrt(s^2 + 15). The score lies in [-1, 1]: > 0 positive sentiment, < 0 negative, exactly 0
    when no lexicon word occurs (or the valences cancel). It is deterministic and sees only the
    string given (score the continuation, not prompt + continuation).
    """
    analyzer = _analyzer()
    return np.asarray([analyzer.polarity_scores(t)["compound"] for t in texts], np.float32)


# ----------------------------------------------------------------------------- prompts

def works_of(split_or_works: str | Sequence[str], folder: str | None = None) -> list[str]:
    """Work ids of a corpus split ("train" | "validation" | "test") or of an explicit id list
    (checked against the corpus), sorted."""
    from icml_jax.data import shakespeare  # pylint: disable=g-import-not-at-top
    all_ids = [w.work_id for w in shakespeare.list_works(folder)]
    if isinstance(split_or_works, str):
        splits = shakespeare.split_of_works(all_ids)
        if split_or_works not in set(splits.values()):
            raise ValueError(f"unknown split {split_or_works!r}; pass one of "
                             f"{sorted(set(splits.values()))} or a list of work ids")
        return sorted(w for w in all_ids if splits[w] == split_or_works)
    unknown = sorted(set(split_or_works) - set(all_ids))
    if unknown:
        raise ValueError(f"unknown Shakespeare work ids {unknown}; see shakespeare.list_works()")
    return sorted(set(split_or_works))


def is_heldout_block(work_id: str, block: int) -> bool:
    """Whether block ``block`` (lines [block*BLOCK_LINES, (block+1)*BLOCK_LINES)) of a work is in
    the held-out part: a fixed hash, independent of any seed."""
    h = int.from_bytes(hashlib.sha256(f"testbed/{work_id}/{block}".encode()).digest()[:8], "big")
    return h / 2.0**64 < HELDOUT_FRACTION


def _cut(text: str, start: int, prompt_chars: int) -> str | None:
    """~prompt_chars characters from ``start``, ending at a word end (None if none fits)."""
    window = text[start: start + prompt_chars + 1]
    if len(window) <= prompt_chars:
        return None
    cut = max(window.rfind(" ", 0, prompt_chars + 1), window.rfind("\n", 0, prompt_chars + 1))
    if cut < prompt_chars // 2:
        return None
    prompt = window[:cut].rstrip()
    return prompt if len(prompt) >= prompt_chars // 2 else None


@functools.lru_cache(maxsize=64)
def _candidates(work_path: str, work_id: str, prompt_chars: int, part: str) -> tuple[str, ...]:
    from icml_jax.data.shakespeare import strip_gutenberg  # pylint: disable=g-import-not-at-top
    with open(work_path, encoding="utf-8", errors="replace") as f:
        text = strip_gutenberg(f.read())
    out, pos = [], 0
    for i, line in enumerate(text.split("\n")):
        start, pos = pos, pos + len(line) + 1
        if not line.strip():
            continue
        if part != "all" and is_heldout_block(work_id, i // BLOCK_LINES) != (part == "heldout"):
            continue
        prompt = _cut(text, start, prompt_chars)
        if prompt is not None:
            out.append(prompt)
    return tuple(out)


def prompt_pool(split_or_works: str | Sequence[str], n: int, prompt_chars: int, seed: int, *,
                part: str = "all", folder: str | None = None) -> list[str]:
    """n distinct prompts from the given works, deterministic in ``seed``.

    Every non-blank line start of the works (restricted to the ``part`` of the lines: "all",
    "train" or "heldout", see the module docstring) is a candidate; a candidate prompt is the
    ~``prompt_chars`` characters from there, cut at the last whitespace at or before
    ``prompt_chars`` and right-stripped (so it ends with a whole word; newlines kept as in the
    text). Candidates are drawn uniformly without replacement over all works (longer works give
    more prompts); duplicate texts are dropped. Draws with the same (works, prompt_chars, part,
    seed) and a larger n extend the smaller draw (the first n are the same).
    """
    from icml_jax.data import shakespeare  # pylint: disable=g-import-not-at-top
    if part not in ("all", "train", "heldout"):
        raise ValueError(f"part={part!r}: choose 'all', 'train' or 'heldout'")
    if prompt_chars < 8:
        raise ValueError(f"prompt_chars={prompt_chars} is too short; use >= 8")
    ids = works_of(split_or_works, folder)
    paths = {w.work_id: w.path for w in shakespeare.list_works(folder)}
    cands = list(dict.fromkeys(itertools.chain.from_iterable(
        _candidates(paths[w], w, prompt_chars, part) for w in ids)))
    if n > len(cands):
        raise ValueError(f"asked for {n} prompts but works {ids} (part={part!r}, "
                         f"prompt_chars={prompt_chars}) only have {len(cands)} distinct candidates")
    order = np.random.default_rng(seed).permutation(len(cands))
    return [cands[i] for i in order[:n]]


# ----------------------------------------------------------------------------- sampling

# ----------------------------------------------------------------------------- pairs

def pairs_from_groups(groups: Sequence[Group], rule: str = "best_worst",
                      min_gap: float = 0.0) -> list[dict[str, Any]]:
    """TRL-format preference rows ``{"prompt", "chosen", "rejected", "score_chosen",
    "score_rejected"}`` (chosen/rejected are continuations only), labelled by the gold scores.

    ``rule="best_worst"``: one pair per group, the gold-best vs the gold-worst response (first
    index on ties). ``rule="all"``: every pair (i < j) of the group, the higher-gold one chosen.
    A pair is kept only if its gold gap is > 0 and >= ``min_gap`` (ties are never labelled).
    """
    if rule not in ("best_worst", "all"):
        raise ValueError(f"rule={rule!r}: choose 'best_worst' or 'all'")
    if min_gap < 0:
        raise ValueError(f"min_gap={min_gap} must be >= 0")
    rows = []
    for g in groups:
        gold = np.asarray(g["gold"], np.float64)
        resp = g["responses"]
        if len(gold) != len(resp):
            raise ValueError(f"group {g['prompt'][:30]!r}: {len(resp)} responses but "
                             f"{len(gold)} gold scores")
        if len(gold) < 2:
            continue
        idx = ([(int(np.argmax(gold)), int(np.argmin(gold)))] if rule == "best_worst"
               else itertools.combinations(range(len(gold)), 2))
        for i, j in idx:
            if gold[i] < gold[j]:
                i, j = j, i
            gap = gold[i] - gold[j]
            if gap <= 0 or gap < min_gap:
                continue
            rows.append({"prompt": g["prompt"], "chosen": resp[i], "rejected": resp[j],
                         "score_chosen": float(gold[i]), "score_rejected": float(gold[j])})
    return rows


# ----------------------------------------------------------------------------- evaluation

def kendall_tau_per_prompt(proxy_scores_by_group: Sequence[Sequence[float]],
                           gold_by_group: Sequence[Sequence[float]]) -> float:
    """Mean over groups of Kendall's tau-b between the proxy's and the gold scores of the group's
    responses. Groups where tau is undefined (gold or proxy constant, < 2 responses) are left
    out; NaN if every group is."""
    from scipy import stats  # pylint: disable=g-import-not-at-top
    if len(proxy_scores_by_group) != len(gold_by_group):
        raise ValueError(f"{len(proxy_scores_by_group)} proxy groups vs {len(gold_by_group)} gold")
    taus = []
    for p, g in zip(proxy_scores_by_group, gold_by_group):
        p, g = np.asarray(p, np.float64), np.asarray(g, np.float64)
        if p.shape != g.shape:
            raise ValueError(f"group sizes differ: proxy {p.shape} vs gold {g.shape}")
        if len(p) < 2 or np.all(p == p[0]) or np.all(g == g[0]):
            continue
        tau = stats.kendalltau(p, g).statistic
        if np.isfinite(tau):
            taus.append(tau)
    return float(np.mean(taus)) if taus else float("nan")


def best_of_n_curve(proxy: Sequence[Sequence[float]], gold: Sequence[Sequence[float]],
                    ns: Sequence[int], num_draws: int = 64, seed: int = 0) -> dict[str, list]:
    """Best-of-N selection with a proxy reward, judged by gold.

    For each N and each prompt's pool of M >= N responses, ``num_draws`` times: draw N responses
    without replacement, keep the proxy's top pick (ties broken at random), record its gold and
    proxy score. Returns ``{"n": [N], "gold": [mean gold of the pick], "gold_sem": [standard error
    over prompts], "proxy": [mean proxy score of the pick], "kl_bound": [log N - (N-1)/N]}`` (the
    analytic KL(best-of-N || policy) bound, nats).
    """
    if len(proxy) != len(gold) or len(proxy) == 0:
        raise ValueError(f"need matching, non-empty proxy/gold pools; got {len(proxy)}, {len(gold)}")
    rng = np.random.default_rng(seed)
    pools = [(np.asarray(p, np.float64), np.asarray(g, np.float64)) for p, g in zip(proxy, gold)]
    out = {"n": [], "gold": [], "gold_sem": [], "proxy": [], "kl_bound": []}
    for n in ns:
        n = int(n)
        per_prompt_gold, per_prompt_proxy = [], []
        for p, g in pools:
            if p.shape != g.shape or not 1 <= n <= len(p):
                raise ValueError(f"N={n} needs pools of >= N responses with matching proxy/gold; "
                                 f"got proxy {p.shape}, gold {g.shape}")
            pick_RN = rng.permuted(np.tile(np.arange(len(p)), (num_draws, 1)), axis=1)[:, :n]
            top_R = pick_RN[np.arange(num_draws), np.argmax(p[pick_RN], axis=1)]
            per_prompt_gold.append(g[top_R].mean())
            per_prompt_proxy.append(p[top_R].mean())
        gg = np.asarray(per_prompt_gold)
        out["n"].append(n)
        out["gold"].append(float(gg.mean()))
        out["gold_sem"].append(float(gg.std(ddof=1) / math.sqrt(len(gg))) if len(gg) > 1 else 0.0)
        out["proxy"].append(float(np.mean(per_prompt_proxy)))
        out["kl_bound"].append(float(math.log(n) - (n - 1) / n))
    return out


def gold_stats(groups: Sequence[Group]) -> dict[str, float]:
    """Summary of the gold scores of some groups: count, mean, std, min, max, the fraction
    exactly 0 (no sentiment word), the fraction of within-group response pairs with exactly equal
    gold, and the fraction of groups with constant gold (no labelled best/worst pair)."""
    gold = [np.asarray(g["gold"], np.float64) for g in groups]
    flat = np.concatenate(gold) if gold else np.zeros((0,))
    pairs = ties = 0
    for g in gold:
        d = g[:, None] == g[None, :]
        m = len(g)
        pairs += m * (m - 1) // 2
        ties += int((d.sum() - m) // 2)
    return {"responses": int(flat.size), "groups": len(gold),
            "mean": float(flat.mean()) if flat.size else float("nan"),
            "std": float(flat.std()) if flat.size else float("nan"),
            "min": float(flat.min()) if flat.size else float("nan"),
            "max": float(flat.max()) if flat.size else float("nan"),
            "frac_zero": float(np.mean(flat == 0)) if flat.size else float("nan"),
            "frac_tied_pairs": ties / pairs if pairs else float("nan"),
            "frac_constant_groups": (float(np.mean([np.all(g == g[0]) for g in gold if len(g)]))
                                     if gold else float("nan"))}


# ----------------------------------------------------------------------------- files

def save_groups(path: str, groups: Sequence[Group], **meta) -> None:
    """Writes ``{**meta, "groups": groups}`` as JSON via a temp file (named by the process id, so
    concurrent writers of one path never share it) + rename."""
    write_atomic(path, lambda f: json.dump({**meta, "groups": list(groups)}, f, ensure_ascii=False))


def load_groups(path: str) -> list[Group]:
    """The groups of a file written by ``save_groups`` (or any JSON object with a "groups" list,
    e.g. an ``experiments.common.cached`` result)."""
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, Mapping) or not isinstance(obj.get("groups"), list):
        raise ValueError(f"{path}: not a groups file (expected a JSON object with a 'groups' list)")
    for i, g in enumerate(obj["groups"]):
        missing = {"prompt", "responses", "gold", "temperature"} - set(g)
        if missing:
            raise ValueError(f"{path}: group {i} lacks {sorted(missing)}")
    return obj["groups"]
