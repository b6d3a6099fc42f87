"""FoPE length generalisation: RoPE / FoPE / ALiBi / NoPE and two controls trained at L, evaluated to 8L.

  python -m experiments.fope_length --workdir=runs/fope_length [--preset=tiny|default]
      [--seeds=0,1] [--methods=rope,rope_clip,fope,fope_pad0,alibi,nope] [--steps=N]
      [--passkey_train_fraction=F]

Methods (``METHOD_OVERRIDES``): ``rope``, ``fope`` (reference defaults, pad 1), ``alibi``, ``nope``
and the controls ``rope_clip`` (RoPE with FoPE's floor clipping, ``rope_floor_clip=True``) and
``fope_pad0`` (FoPE with the corrected padding, ``fope.pad_sin_value=0``). Every (method, seed)
trains ``configs/fope.py:PRESET`` with only those overrides and ``config.seed`` changed (same data
order per seed, same steps) in its own ``DIR/<method>_s<seed>/`` (a rerun resumes; a finished run
only re-evaluates if its ``eval.json`` is missing or was made with other evaluation settings).
Each model is then evaluated on the Shakespeare validation split: perplexity at 1x/2x/4x/8x L on
the same non-overlapping tokens, and retrieval (``length_eval.passkey_example``: a digit key after
a cue byte the filler never contains, queried by the cue at the end; teacher-forced and greedy
KV-cache digit accuracy, exact keys) over lengths x depths.

Retrieval training mix (preset ``passkey_train_fraction``, 0.95 in ``default``, 0 in ``tiny``):
the models train on ``DIR/passkey_mix_*.jsonl`` (``passkey_mix_corpus``): ``passkey_docs``
synthetic retrieval documents in the evaluation's exact format, each at most L tokens, plus
Shakespeare train-split passages for the rest of the tokens, so the task is taught within L and
tested beyond it. The gate (``GATE``): a (method, seed) whose within-L teacher-forced accuracy is
below 0.9 is reported but not read beyond L. Evaluation text is always the validation split.

Writes DIR/config.json, DIR/results.csv (long format), DIR/results.md (gate first, then mean ±
s.e. over seeds), DIR/perplexity_vs_length.png, DIR/retrieval_vs_length.png and
DIR/passkey_<method>.png (teacher-forced accuracy heatmaps, mean over seeds).
"""
import argparse
import copy
import json
import os
import sys

from experiments.common import (cached, git_commit, mean_spread, pm, preset, record, save_figure, stopwatch,
                                write_atomic, write_csv)
from icml_jax import xla_env

FACTORS = (1, 2, 4, 8)  # evaluation lengths, in units of the training length L
PRESETS = {
    # methods, seeds, ppl token budget (multiple of 8L), retrieval depths and keys per (length,
    # depth) cell, and the share of the training corpus's tokens that are synthetic retrieval
    # documents (0 = plain Shakespeare). tiny: the two bases over two seeds, no mix (the controls'
    # configs are checked without training in tests/experiments/test_fope_length.py; ALiBi / NoPE
    # only change config.model.position, covered by tests/models/test_positions.py).
    "tiny": preset(methods=("rope", "fope"), seeds=(0, 1),
                   eval_tokens=2048, depths=(0.2, 0.8), trials=2, passkey_train_fraction=0.0,
                   passkey_docs=0, passkey_repeat_prob=0.0, key_digits=1, steps=0,
                   passkey_factors=(1, 8)),  # retrieval at L and 8L only: fewer compiles
    # default: PILOT (RoPE, seed 0, teacher-forced key accuracy at L = 64 for depths
    # 0.1/0.5/0.9, 32 keys each, chance 0.10). 4-digit keys (needs an induction head): mix 0.5
    # (all of the Shakespeare train split), 600 steps, 8 keys each: 0.16/0.09/0.16; mix 0.8,
    # 600 steps: 0.12/0.06/0.12; mix 0.8, 600 -> 1200 steps (resumed): 0.12/0.13/0.10; mix
    # 0.95, 40k docs, 1500 steps: 0.62/0.93/0.95; the same with 60k docs: 0.09 (mean over 5
    # depths); 60k docs + repeated queries (repeat_prob 0.7): 0.09 at 1500 steps, 0.10 at 2400;
    # batch 32, lr 6e-3, 1200 steps: 0.12/0.06/0.12 -- whether the induction head forms in this
    # budget depends on the draw. 1-digit keys (the digit after the cue; one content-matching
    # head), mix 0.95, 60k docs, repeat_prob 0.7, 1500 steps: 1.00/1.00/1.00 (at 512 tokens:
    # 0.09/0.66/1.00), 103 s of training. Hence the default below; ~2 min per run on 2 cores:
    # the four arms the controls need x 3 seeds (ALiBi / NoPE: add them with --methods).
    "default": preset(methods=("rope", "rope_clip", "fope", "fope_pad0"),
                      seeds=(0, 1, 2), eval_tokens=32768, depths=(0.1, 0.3, 0.5, 0.7, 0.9),
                      trials=32, passkey_train_fraction=0.95, passkey_docs=60000,
                      passkey_repeat_prob=0.7, key_digits=1, steps=1500, passkey_factors=FACTORS),
}
METHODS = ("rope", "rope_clip", "fope", "fope_pad0", "alibi", "nope")
# each method = the preset (position "fope", reference defaults) with these config overrides
METHOD_OVERRIDES = {
    "rope": {"model.position": "rope"},
    "rope_clip": {"model.position": "rope", "model.rope_floor_clip": True},
    "fope": {"model.position": "fope"},
    "fope_pad0": {"model.position": "fope", "model.fope.pad_sin_value": 0.0},
    "alibi": {"model.position": "alibi"},
    "nope": {"model.position": "nope"},
}
METHOD_DOC = {
    "rope": "RoPE, no floor clipping",
    "rope_clip": "RoPE with FoPE's floor clipping (`rope_floor_clip=True`: frequencies with period > L set to 0)",
    "fope": "FoPE, reference defaults (pad 1)",
    "fope_pad0": "FoPE with the corrected padding (`fope.pad_sin_value=0`)",
    "alibi": "ALiBi",
    "nope": "no position embedding",
}
PASSKEY_METRICS = ("teacher_forced", "greedy", "exact")
GATE = 0.9  # within-L teacher-forced digit accuracy a (method, seed) needs for its beyond-L read


def shakespeare_passages(works, min_chars=2048):
    """The works cut at line ends into passages of at least ``min_chars`` characters (the last
    one of a work may be shorter); their concatenation is the works."""
    out = []
    for text in works:
        start = 0
        while start < len(text):
            end = text.find("\n", start + min_chars)
            end = len(text) if end < 0 else end + 1
            out.append(text[start:end])
            start = end
    return out


def passkey_mix_corpus(workdir, data_cfg, tokenizer, seq_len, fraction, seed, num_docs,
                       repeat_prob=0.0, max_gap=16, key_digits=4):
    """Writes (once) and returns the path of a JSONL training corpus: ``num_docs`` synthetic
    retrieval documents plus Shakespeare train-split text making up ``1 - fraction`` of its tokens.

    Each retrieval document is ``length_eval.passkey_example`` (the evaluation's cue / key / query
    format) built from train-split filler (``passkey_filler``: no cue, no digits), with the
    evaluation's leading bos dropped (the pipeline adds [bos] ... [eos] around every document): a
    random length in [passkey_min_length, seq_len] and a random depth, so the model only sees the
    task within L. With ``repeat_prob`` > 0 the document then goes on, while it fits in
    ``seq_len``, with further queries (``^KEY`` after 0..``max_gap`` filler tokens), each with
    probability ``repeat_prob``. The Shakespeare part is a random subset of the train split's passages
    (``shakespeare_passages``), drawn until it holds ``(1 - fraction) / fraction`` times the
    retrieval tokens (a run sees far fewer tokens than the whole train split, so a subset loses
    nothing and keeps the corpus small). Deterministic in ``seed``. Every passage is put on a JSONL
    line that ``text_files.assign_splits`` sends to 'train' (the corpus's validation/test splits
    hold only retrieval documents), so training sees only Shakespeare train-split text plus the mix.
    """
    import numpy as np
    from icml_jax.analysis import length_eval
    from icml_jax.data import get_split_source
    from icml_jax.data.text_files import assign_splits
    path = os.path.abspath(os.path.join(
        workdir, f"passkey_mix_f{fraction:g}_n{num_docs}_r{repeat_prob:g}_k{key_digits}_L{seq_len}_s{seed}.jsonl"))
    if os.path.exists(path):
        return path
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"passkey_train_fraction must be in (0, 1), got {fraction}")
    lo = length_eval.passkey_min_length(tokenizer, key_digits)
    if lo > seq_len:
        raise ValueError(f"passkey_train_fraction > 0 needs seq_len >= {lo} (the shortest passkey "
                         f"example), got {seq_len}")
    src = get_split_source(data_cfg, "train")
    passages = shakespeare_passages([src[i]["text"] for i in range(len(src))])
    filler = length_eval.passkey_filler(tokenizer, length_eval.heldout_stream(data_cfg, tokenizer,
                                                                              "train"))
    rng = np.random.RandomState(seed + 104729)
    docs, tokens, misses = [], 0, 0
    while len(docs) < num_docs:
        length = int(rng.randint(lo, seq_len + 1))
        start = int(rng.randint(0, len(filler) - 2 * seq_len))
        prompt, answer, _ = length_eval.passkey_example(
            tokenizer, filler[start:start + 2 * seq_len], length, float(rng.uniform()), rng,
            filler_is_clean=True, key_digits=key_digits)
        ids = prompt[1:] + answer
        # more queries of the same key after short filler gaps while the document fits in L
        # (bos + ids + eos): denser, short-range retrieval targets next to the long-range one
        tail = list(tokenizer.encode(length_eval.QUESTION)) + answer
        while rng.uniform() < repeat_prob and len(ids) + len(tail) + 2 <= seq_len:
            gap = int(rng.randint(0, min(max_gap, seq_len - 2 - len(ids) - len(tail)) + 1))
            at = int(rng.randint(0, len(filler) - gap))
            ids += [int(t) for t in filler[at:at + gap]] + tail
        text = tokenizer.decode(ids)
        if tokenizer.encode(text) != ids:  # e.g. filler cut inside a UTF-8 character
            misses += 1
            if misses > 1000 + len(docs):
                raise ValueError("passkey documents do not round-trip through the tokenizer")
            continue
        docs.append(text)
        tokens += len(ids) + 2
    target, works, text_tokens = (1.0 - fraction) / fraction * tokens, [], 0
    for i in rng.permutation(len(passages)):
        if text_tokens >= target:
            break
        works.append(passages[i])
        text_tokens += len(tokenizer.encode(passages[i])) + 2
    n = len(works) + len(docs)
    splits = assign_splits([str(i) for i in range(1, n + 1)])
    train_lines = [i for i in range(n) if splits[str(i + 1)] == "train"]
    if len(train_lines) < len(works):
        raise ValueError(f"{len(works)} passages but only {len(train_lines)} train lines: raise num_docs")
    work_lines = set(rng.choice(train_lines, len(works), replace=False).tolist())
    rows, wi, di = [], iter(works), iter(docs)
    for i in range(n):
        kind, text = ("shakespeare", next(wi)) if i in work_lines else ("passkey", next(di))
        rows.append(json.dumps({"text": text, "kind": kind}))
    os.makedirs(workdir, exist_ok=True)
    write_atomic(path, "\n".join(rows) + "\n")
    return path


def method_config(preset: str, method: str, seed: int, steps: int):
    """The run config of one arm: ``configs/fope.py:<preset>`` with ``train.steps``, the method's
    ``METHOD_OVERRIDES`` and the seed (the training corpus is set by the caller)."""
    from icml_jax.config_utils import load_config
    cfg = load_config(f"configs/fope.py:{preset}", unlocked=True)
    cfg.update_from_flattened_dict({"train.steps": steps, **METHOD_OVERRIDES[method]})
    cfg.seed = seed
    return cfg


def run_one(cfg, workdir, exp, stream, tokenizer):
    """Trains (or resumes) one model and evaluates it; returns its eval dict, cached in
    ``workdir/eval.json`` under the run's config and ``exp`` (a plain dict, ``common.record``)."""
    import jax
    from icml_jax.analysis import length_eval
    from icml_jax.train.trainer import train

    def compute():
        elapsed = stopwatch()
        state, summary = train(cfg, workdir)
        train_s = elapsed()
        params = jax.device_get(state.params)
        L = cfg.data.seq_len
        lengths = [f * L for f in FACTORS]
        elapsed = stopwatch()
        ppl = length_eval.perplexity_at_lengths(cfg.model, params, stream, lengths,
                                                num_tokens=exp["eval_tokens"])
        kd = exp["key_digits"]
        pk_lengths = [f * L for f in exp["passkey_factors"]
                      if f * L >= length_eval.passkey_min_length(tokenizer, kd)]
        pk = length_eval.passkey_grid(cfg.model, params, tokenizer, stream, pk_lengths, exp["depths"],
                                      trials=exp["trials"], seed=cfg.seed, key_digits=kd)
        return {"perplexity": {str(k): v for k, v in ppl.items()}, "passkey": pk,
                "passkey_format": {"cue": length_eval.CUE, "key_digits": kd},
                "train_seconds": train_s, "eval_seconds": elapsed(),
                "final_train_loss": summary.get("loss"), "val_loss": summary.get("eval_loss")}
    # the evaluation's settings only: a run is reused whatever the other methods / seeds are
    key = {"config": json.loads(cfg.to_json_best_effort()),
           "exp": {k: exp[k] for k in ("eval_tokens", "depths", "trials", "passkey_train_fraction",
                                  "passkey_docs", "passkey_repeat_prob", "key_digits",
                                  "passkey_factors")}}
    return cached(os.path.join(workdir, "eval.json"), key, compute)


def gate(results, L, threshold=GATE):
    """{(method, seed): (teacher-forced digit accuracy at length L, mean over depths, passed)}."""
    out = {}
    for key, r in results.items():
        vals = [p["teacher_forced"] for p in r["passkey"] if p["length"] == L]
        acc = sum(vals) / len(vals) if vals else float("nan")
        out[key] = (acc, acc >= threshold)
    return out


def aggregate(results, L, exp):
    """Long-format rows and per-seed summaries.

    Returns (rows, stats): ``stats[(method, metric, length, depth)]`` = (mean, s.e. over seeds, n)
    of the per-seed values; depth "" is the mean over depths (passkey) or no depth (perplexity).
    ``perplexity_ratio`` = ppl(length) / ppl(L) per seed. ``*_passed`` keys are the passkey metrics
    over the seeds that passed the within-L gate only."""
    rows = []
    for (method, seed), r in sorted(results.items()):
        for length, v in r["perplexity"].items():
            rows.append(dict(method=method, seed=seed, metric="perplexity", length=int(length),
                             depth="", value=v["perplexity"]))
        for p in r["passkey"]:
            for kind in PASSKEY_METRICS:
                rows.append(dict(method=method, seed=seed, metric=f"passkey_{kind}",
                                 length=p["length"], depth=p["depth"], value=p[kind]))
    passed = gate(results, L)
    per_seed = {}  # (method, metric, length, depth) -> {seed: value}
    for row in rows:
        per_seed.setdefault((row["method"], row["metric"], row["length"], row["depth"]),
                            {})[row["seed"]] = row["value"]
    for (m, metric, length, depth), vals in list(per_seed.items()):
        if metric == "perplexity":
            base = per_seed[(m, metric, L, "")]
            per_seed[(m, "perplexity_ratio", length, "")] = {s: v / base[s] for s, v in vals.items()}
        elif depth != "":
            k = (m, metric, length, "")
            if k not in per_seed:
                ds = [d for (m2, me2, l2, d) in per_seed if (m2, me2, l2) == (m, metric, length)
                      and d != ""]
                per_seed[k] = {s: sum(per_seed[(m, metric, length, d)][s] for d in ds) / len(ds)
                               for s in vals}
    stats = {}
    for (m, metric, length, depth), vals in per_seed.items():
        stats[(m, metric, length, depth)] = mean_spread(list(vals.values()), "se")
        if metric.startswith("passkey_"):
            ok = [v for s, v in vals.items() if passed[(m, s)][1]]
            stats[(m, metric + "_passed", length, depth)] = mean_spread(ok, "se")
    return rows, stats


def markdown(stats, passed, methods, seeds, L, exp, meta):
    lengths = [f * L for f in FACTORS]
    pk_lengths = [l for l in lengths if (methods[0], "passkey_teacher_forced", l, "") in stats]
    lines = [f"# FoPE length generalisation ({', '.join(methods)})", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, seeds {list(meta['seeds'])}, "
             f"preset `{meta['preset']}`, {meta['steps']} steps at training length L = {L}, "
             f"wall time {meta['wall_seconds'] / 60:.1f} min ({meta['cpus']} CPUs, shared).", "",
             f"Model: {meta['model']}. Data: Shakespeare (byte tokens), train split; evaluation on the "
             f"validation split, the same {exp['eval_tokens']} tokens at every length, cut into "
             "non-overlapping windows that each start at position 0.", "",
             "Methods: " + "; ".join(f"`{m}` = {METHOD_DOC[m]}" for m in methods) + ".", "",
             "Retrieval task (`length_eval.passkey_example`): `[bos] filler[:cut] "
             f"{length_eval_cue()}KEY filler[cut:] {length_eval_cue()}` → `KEY`, a random "
             f"{meta['key_digits']}-digit key after a cue byte `{length_eval_cue()}` that the filler "
             "never contains (filler = real text with the cue and all digits removed); the cue "
             "again is the query. Metrics: digit accuracy teacher-forced and greedy (KV cache), and "
             f"exact-key rate (greedy); chance ≈ 0.10 per digit. {exp['trials']} keys per "
             f"(length, depth) cell, depths {list(exp['depths'])}.", ""]
    f = exp.get("passkey_train_fraction", 0.0)
    if f > 0:
        lines += [f"Training mix: the Shakespeare train split plus synthetic retrieval documents "
                  f"making up {f:.0%} of its tokens (`passkey_mix_corpus`, one per seed), each with "
                  f"a random depth and a random length in [{meta['passkey_min_length']}, {L}], "
                  "so the task is only ever seen within L. Perplexity stays on the Shakespeare "
                  "validation split; retrieval uses validation-split filler.", ""]
    else:
        lines += ["No retrieval documents in training (`passkey_train_fraction` = 0).", ""]
    lines += [f"## Gate: retrieval within L (teacher-forced digit accuracy at {L} tokens, mean over "
              f"depths; pass = ≥ {GATE:.2f})", "",
              "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | passed |",
              "|---|" + "---|" * (len(seeds) + 1)]
    for m in methods:
        cells = [f"{passed[(m, s)][0]:.3f} {'✓' if passed[(m, s)][1] else '✗'}" for s in seeds]
        lines.append(f"| {m} | " + " | ".join(cells) +
                     f" | {sum(passed[(m, s)][1] for s in seeds)}/{len(seeds)} |")
    lines += ["", "Beyond-L retrieval is read only for methods (and seeds) that pass the gate.", "",
              "## Validation perplexity (mean ± s.e. over seeds)", "",
              "| method | " + " | ".join(f"{l} ({l // L}×L)" for l in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(pm(*stats[(m, "perplexity", l, "")][:2], 2)
                                             for l in lengths) + " |")
    lines += ["", "## Perplexity ratio ppl(k×L) / ppl(L) (per seed, mean ± s.e.)", "",
              "| method | " + " | ".join(f"{l // L}×L" for l in lengths[1:]) + " |",
              "|---|" + "---|" * (len(lengths) - 1)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(pm(*stats[(m, "perplexity_ratio", l, "")][:2], 3)
                                             for l in lengths[1:]) + " |")
    for kind, title in (("teacher_forced", "digit accuracy, teacher-forced"),
                        ("greedy", "digit accuracy, greedy KV-cache"),
                        ("exact", "exact keys, greedy KV-cache")):
        lines += ["", f"## Retrieval {title} (mean over depths, mean ± s.e. over the seeds that "
                      "passed the gate; n = those seeds)", "",
                  "| method | n | " + " | ".join(f"{l} ({l // L}×L)" for l in pk_lengths) + " |",
                  "|---|---|" + "---|" * len(pk_lengths)]
        for m in methods:
            n = stats[(m, f"passkey_{kind}_passed", pk_lengths[0], "")][2]
            cells = [pm(*stats[(m, f"passkey_{kind}_passed", l, "")][:2], 2) if n else
                     f"({stats[(m, f'passkey_{kind}', l, '')][0]:.2f})" for l in pk_lengths]
            lines.append(f"| {m} | {n} | " + " | ".join(cells) + " |")
        lines += ["", "(a method with n = 0 failed the gate on every seed: its all-seed mean is "
                      "shown in parentheses and is not read)"]
    lines += ["", f"## Retrieval by depth (teacher-forced digit accuracy, mean over the gate-passing "
                  "seeds)", "",
              "| method | length | " + " | ".join(f"{d:.0%}" for d in exp["depths"]) + " |",
              "|---|---|" + "---|" * len(exp["depths"])]
    for m in methods:
        if not stats[(m, "passkey_teacher_forced_passed", pk_lengths[0], "")][2]:
            continue
        for l in pk_lengths:
            lines.append(f"| {m} | {l} | " + " | ".join(
                f"{stats[(m, 'passkey_teacher_forced_passed', l, d)][0]:.2f}" for d in exp["depths"])
                + " |")
    lines += ["", "Plots: `perplexity_vs_length.png`, `retrieval_vs_length.png`, `passkey_<method>.png` "
                  "(teacher-forced, length × depth, mean over all seeds).", ""]
    return "\n".join(lines)


def length_eval_cue():
    from icml_jax.analysis import length_eval
    return length_eval.CUE


def plots(stats, methods, L, exp, workdir):
    """DIR/perplexity_vs_length.png, DIR/retrieval_vs_length.png and DIR/passkey_<method>.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    lengths = [f * L for f in FACTORS]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        mean = [stats[(m, "perplexity", l, "")][0] for l in lengths]
        spread = [stats[(m, "perplexity", l, "")][1] for l in lengths]
        ax.errorbar(lengths, mean, yerr=spread, marker="o", capsize=3, label=m)
    ax.axvline(L, color="gray", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [str(l) for l in lengths])
    ax.set_xlabel("evaluation context length (tokens); dotted = training length")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Perplexity vs context length (mean ± s.e. over seeds)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "perplexity_vs_length.png"), dpi=110)
    pk_lengths = [l for l in lengths if (methods[0], "passkey_teacher_forced", l, "") in stats]
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        st = [stats[(m, "passkey_teacher_forced", l, "")] for l in pk_lengths]
        ax.errorbar(pk_lengths, [s[0] for s in st], yerr=[s[1] for s in st], marker="o", capsize=3,
                    label=m)
    ax.axvline(L, color="gray", ls=":", lw=1)
    ax.axhline(0.1, color="gray", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(pk_lengths, [str(l) for l in pk_lengths])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("prompt length (tokens); dotted = training length, dashed = chance")
    ax.set_ylabel("key digit accuracy (teacher-forced)")
    ax.set_title("Retrieval vs length (all seeds, mean ± s.e.)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "retrieval_vs_length.png"), dpi=110)
    for m in methods:
        grid = np.array([[stats.get((m, "passkey_teacher_forced", l, d), (np.nan,))[0]
                          for l in pk_lengths] for d in exp["depths"]])
        fig, ax = plt.subplots(figsize=(4.5, 3))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(pk_lengths)), [str(l) for l in pk_lengths])
        ax.set_yticks(range(len(exp["depths"])), [f"{d:.0%}" for d in exp["depths"]])
        ax.set_xlabel("length")
        ax.set_ylabel("depth")
        ax.set_title(f"{m}: key digit accuracy (teacher-forced)", fontsize=9)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        save_figure(fig, os.path.join(workdir, f"passkey_{m}.png"), dpi=110)


def main(argv=None):
    xla_env.use_defaults()  # flags and compilation cache, before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="FoPE length-generalisation experiment")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--seeds", default="")
    p.add_argument("--methods", default="", help=f"comma list of {METHODS} (default: the preset's)")
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    p.add_argument("--passkey_train_fraction", type=float, default=-1.0,
                   help="override the preset's share of passkey documents in the training corpus")
    a = p.parse_args(argv)
    from icml_jax.analysis import length_eval
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer

    elapsed = stopwatch()
    exp = copy.deepcopy(PRESETS[a.preset])
    if a.passkey_train_fraction >= 0:
        exp.passkey_train_fraction = a.passkey_train_fraction
    seeds = tuple(int(s) for s in a.seeds.split(",")) if a.seeds else tuple(exp.seeds)
    methods = tuple(m for m in a.methods.split(",") if m) or tuple(exp.methods)
    unknown = [m for m in methods if m not in METHOD_OVERRIDES]
    if unknown:
        raise ValueError(f"unknown --methods {unknown}; choose from {METHODS}")
    exp.seeds, exp.methods = seeds, methods
    rec = record(exp)
    base = load_config(f"configs/fope.py:{a.preset}", unlocked=True)
    if a.steps or exp.steps:  # the command line's, else the preset's (0 = the config's)
        base.train.steps = a.steps or exp.steps
    os.makedirs(a.workdir, exist_ok=True)
    meta_cfg = {"preset": a.preset, "methods": list(methods), "seeds": list(seeds), "exp": rec,
                "eval_factors": list(FACTORS), "base_config": json.loads(base.to_json_best_effort())}
    write_atomic(os.path.join(a.workdir, "config.json"), json.dumps(meta_cfg, indent=2))
    tokenizer = build_tokenizer(base.data.tokenizer)
    stream = length_eval.heldout_stream(base.data, tokenizer, "validation")
    results = {}
    for seed in seeds:
        for m in methods:
            cfg = method_config(a.preset, m, seed, base.train.steps)
            if exp["passkey_train_fraction"] > 0:  # train on Shakespeare + passkey docs (≤ L)
                cfg.data.name = "jsonl"
                cfg.data.path = passkey_mix_corpus(a.workdir, base.data, tokenizer, base.data.seq_len,
                                                   exp["passkey_train_fraction"], seed,
                                                   exp["passkey_docs"], exp["passkey_repeat_prob"],
                                                   key_digits=exp["key_digits"])
            print(f"=== {m} seed {seed} ===", flush=True)
            results[(m, seed)] = run_one(cfg, os.path.join(a.workdir, f"{m}_s{seed}"), rec, stream,
                                         tokenizer)
            r = results[(m, seed)]
            acc = {}
            for p in r["passkey"]:
                acc.setdefault(p["length"], []).append(p["teacher_forced"])
            print(f"{m} s{seed}: train {r['train_seconds']:.0f}s eval {r['eval_seconds']:.0f}s ppl "
                  + " ".join(f"{k}:{v['perplexity']:.2f}" for k, v in r["perplexity"].items())
                  + " | retrieval " + " ".join(f"{k}:{sum(v) / len(v):.2f}" for k, v in acc.items()),
                  flush=True)
    L = base.data.seq_len
    rows, stats = aggregate(results, L, exp)
    passed = gate(results, L)
    write_csv(os.path.join(a.workdir, "results.csv"), rows,
              ["method", "seed", "metric", "length", "depth", "value"])
    m = base.model
    meta = {"command": "python -m experiments.fope_length " + " ".join(argv if argv is not None
                                                                       else sys.argv[1:]),
            "commit": git_commit(), "seeds": seeds, "preset": a.preset, "steps": base.train.steps,
            "wall_seconds": elapsed(), "cpus": os.cpu_count(),
            "passkey_min_length": length_eval.passkey_min_length(tokenizer, exp.key_digits),
            "key_digits": exp.key_digits,
            "model": f"d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} heads of {m.head_dim}, "
                     f"SwiGLU {m.ffn_dim}, batch {base.train.batch_size} x {L}, lr {base.train.lr}; "
                     f"FoPE gain {m.fope.init_gain}, fixed"}
    md = markdown(stats, passed, methods, seeds, L, exp, meta)
    write_atomic(os.path.join(a.workdir, "results.md"), md)
    plots(stats, methods, L, exp, a.workdir)
    print(md)
    return stats


if __name__ == "__main__":
    main(sys.argv[1:])
