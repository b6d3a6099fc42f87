"""FoPE length generalisation: RoPE vs FoPE vs ALiBi vs NoPE trained at L, evaluated to 8L.

  python -m experiments.fope_length --workdir=runs/fope_length [--preset=tiny|default]
      [--seeds=0,1] [--methods=rope,fope,alibi,nope] [--steps=N] [--passkey_train_fraction=F]

Every (method, seed) trains ``configs/fope.py:PRESET`` with only ``config.model.position`` and
``config.seed`` changed (same data order per seed, same steps) through ``train_and_evaluate`` in its
own ``DIR/<method>_s<seed>/`` (a rerun resumes; a finished run only re-evaluates if its
``eval.json`` is missing). Each model is then evaluated on the Shakespeare validation split:
perplexity at 1x/2x/4x/8x L on the same non-overlapping tokens, and passkey retrieval
(teacher-forced and greedy KV-cache digit accuracy) over lengths x depths.

Passkey training mix (preset field ``passkey_train_fraction``, 0.5 in ``default``, 0 in ``tiny``
whose L is shorter than a passkey example): the models train on ``DIR/passkey_mix_*.jsonl`` —
the Shakespeare train split plus synthetic passkey documents in the evaluation's exact format, each
at most L tokens (``passkey_mix_corpus``) — so the task is taught within L and tested beyond it.
Evaluation text is always the Shakespeare validation split.

Writes DIR/config.json, DIR/results.csv (long format), DIR/results.md, DIR/perplexity_vs_length.png
and DIR/passkey_<method>.png (teacher-forced accuracy heatmaps, mean over seeds).
"""
import argparse
import copy
import json
import os
import sys

from experiments.common import (cached, git_commit, mean_spread, pm, preset, record, save_figure, stopwatch,
                                write_atomic, write_csv)
from icml_jax import xla_env

PRESETS = {
    # seeds, ppl token budget (multiple of 8L), passkey depths and trials per cell, and the share of
    # the training corpus's tokens that are synthetic passkey documents (0 = plain Shakespeare; tiny
    # has none: its L = 32 is shorter than the shortest passkey example)
    "tiny": preset(seeds=(0, 1), eval_tokens=2048, depths=(0.2, 0.8), trials=2,
                   passkey_train_fraction=0.0),
    "default": preset(seeds=(0, 1), eval_tokens=32768, depths=(0.1, 0.5, 0.9), trials=8,
                      passkey_train_fraction=0.5),
}
METHODS = ("rope", "fope", "alibi", "nope")
FACTORS = (1, 2, 4, 8)
def passkey_mix_corpus(workdir, data_cfg, tokenizer, seq_len, fraction, seed):
    """Writes (once) and returns the path of a JSONL training corpus: the Shakespeare train-split
    works plus synthetic passkey documents that make up ``fraction`` of its tokens.

    Each passkey document is ``length_eval.passkey_example`` (same needle, question and key format
    as the evaluation) built from train-split filler, with the evaluation's leading bos dropped
    (the pipeline adds [bos] ... [eos] around every document): a random length in
    [passkey_min_length, seq_len] and a random depth, so the model only sees the task within L.
    Deterministic in ``seed``. Every Shakespeare work is put on a JSONL line that
    ``text_files.assign_splits`` sends to 'train' (the corpus's validation/test splits hold only
    passkey documents), so training sees exactly the Shakespeare train split plus the mix.
    """
    import numpy as np
    from icml_jax.analysis import length_eval
    from icml_jax.data import get_split_source
    from icml_jax.data.text_files import assign_splits
    path = os.path.abspath(os.path.join(workdir, f"passkey_mix_f{fraction:g}_L{seq_len}_s{seed}.jsonl"))
    if os.path.exists(path):
        return path
    lo = length_eval.passkey_min_length(tokenizer)
    if lo > seq_len:
        raise ValueError(f"passkey_train_fraction > 0 needs seq_len >= {lo} (the shortest passkey "
                         f"example), got {seq_len}")
    src = get_split_source(data_cfg, "train")
    works = [src[i]["text"] for i in range(len(src))]
    filler = length_eval.heldout_stream(data_cfg, tokenizer, "train")
    filler = filler[(filler != tokenizer.bos_id) & (filler != tokenizer.eos_id)]
    target = fraction / (1.0 - fraction) * len(filler)
    rng = np.random.RandomState(seed + 104729)
    docs, tokens, misses = [], 0, 0
    while tokens < target:
        length = int(rng.randint(lo, seq_len + 1))
        start = int(rng.randint(0, len(filler) - 2 * seq_len))
        prompt, answer, _ = length_eval.passkey_example(
            tokenizer, filler[start:start + 2 * seq_len], length, float(rng.uniform()), rng)
        ids = prompt[1:] + answer
        text = tokenizer.decode(ids)
        if tokenizer.encode(text) != ids:  # e.g. filler cut inside a UTF-8 character
            misses += 1
            if misses > 1000 + len(docs):
                raise ValueError("passkey documents do not round-trip through the tokenizer")
            continue
        docs.append(text)
        tokens += len(ids) + 2
    n = len(works) + len(docs)
    splits = assign_splits([str(i) for i in range(1, n + 1)])
    train_lines = [i for i in range(n) if splits[str(i + 1)] == "train"]
    work_lines = set(rng.choice(train_lines, len(works), replace=False).tolist())
    rows, wi, di = [], iter(works), iter(docs)
    for i in range(n):
        kind, text = ("shakespeare", next(wi)) if i in work_lines else ("passkey", next(di))
        rows.append(json.dumps({"text": text, "kind": kind}))
    os.makedirs(workdir, exist_ok=True)
    write_atomic(path, "\n".join(rows) + "\n")
    return path


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
        pk_lengths = [l for l in lengths if l >= length_eval.passkey_min_length(tokenizer)]
        pk = length_eval.passkey_grid(cfg.model, params, tokenizer, stream, pk_lengths, exp["depths"],
                                      trials=exp["trials"], seed=cfg.seed)
        return {"perplexity": {str(k): v for k, v in ppl.items()}, "passkey": pk,
                "train_seconds": train_s, "eval_seconds": elapsed(),
                "final_train_loss": summary.get("loss"), "val_loss": summary.get("eval_loss")}
    key = {"config": json.loads(cfg.to_json_best_effort()), "exp": exp}
    return cached(os.path.join(workdir, "eval.json"), key, compute)


def aggregate(results, L, exp):
    """Long-format rows and per-(method, metric, length, depth) (mean, half the seed range, n)."""
    rows = []
    for (method, seed), r in sorted(results.items()):
        for length, v in r["perplexity"].items():
            rows.append(dict(method=method, seed=seed, metric="perplexity", length=int(length),
                             depth="", value=v["perplexity"]))
        for p in r["passkey"]:
            for kind in ("teacher_forced", "greedy"):
                rows.append(dict(method=method, seed=seed, metric=f"passkey_{kind}",
                                 length=p["length"], depth=p["depth"], value=p[kind]))
    stats = {}
    for row in rows:
        k = (row["method"], row["metric"], row["length"], row["depth"])
        stats.setdefault(k, []).append(row["value"])
    stats = {k: mean_spread(v, "half_range") for k, v in stats.items()}
    return rows, stats


def markdown(stats, methods, L, exp, meta):
    lengths = [f * L for f in FACTORS]
    lines = ["# FoPE length generalisation (RoPE / FoPE / ALiBi / NoPE)", "",
             f"Command: `{meta['command']}` — commit `{meta['commit']}`, seeds {list(meta['seeds'])}, "
             f"preset `{meta['preset']}`, {meta['steps']} steps at training length L = {L}, "
             f"wall time {meta['wall_seconds'] / 60:.1f} min ({meta['cpus']} CPUs, shared).", "",
             f"Model: {meta['model']}. Data: Shakespeare (byte tokens), train split; evaluation on the "
             f"validation split, the same {exp['eval_tokens']} tokens at every length, cut into "
             "non-overlapping windows that each start at position 0.", ""]
    f = exp.get("passkey_train_fraction", 0.0)
    if f > 0:
        lines += [f"Passkey training mix: the training corpus is the Shakespeare train split plus "
                  f"synthetic passkey documents making up {f:.0%} of its tokens (`passkey_mix_corpus`, "
                  "JSONL in the workdir, one per seed): each is `length_eval.passkey_example` on "
                  "train-split filler (same needle, question and 5-digit key as the evaluation) with "
                  f"a random depth and a random length in [{meta['passkey_min_length']}, {L}], so the "
                  "task is only ever seen within L. Perplexity stays on the Shakespeare validation "
                  "split and passkey evaluation uses validation-split filler.", ""]
    else:
        lines += ["No passkey documents in training (`passkey_train_fraction` = 0).", ""]
    lines += [
             "## Validation perplexity (mean ± half the seed range)", "",
             "| method | " + " | ".join(f"{l} ({l // L}×L)" for l in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for m in methods:
        cells = []
        for l in lengths:
            mean, spread, _ = stats[(m, "perplexity", l, "")]
            cells.append(pm(mean, spread, 2))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    for kind, title in (("teacher_forced", "teacher-forced"), ("greedy", "greedy KV-cache")):
        lines += ["", f"## Passkey digit accuracy, {title} (mean over seeds and depths "
                      f"{list(exp['depths'])}, {exp['trials']} keys per cell; chance ≈ 0.10)", "",
                  "| method | " + " | ".join(f"{l}" for l in lengths) + " |",
                  "|---|" + "---|" * len(lengths)]
        for m in methods:
            cells = []
            for l in lengths:
                vals = [stats[(m, f"passkey_{kind}", l, d)][0] for d in exp["depths"]
                        if (m, f"passkey_{kind}", l, d) in stats]
                cells.append(f"{sum(vals) / len(vals):.2f}" if vals else "— (too short)")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "Plots: `perplexity_vs_length.png`, `passkey_<method>.png` (teacher-forced, length × depth).",
              ""]
    return "\n".join(lines)


def plots(stats, methods, L, exp, workdir):
    """DIR/perplexity_vs_length.png and DIR/passkey_<method>.png."""
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
    ax.set_title("Perplexity vs context length")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(workdir, "perplexity_vs_length.png"), dpi=110)
    for m in methods:
        grid = np.array([[stats.get((m, "passkey_teacher_forced", l, d), (np.nan,))[0]
                          for l in lengths] for d in exp["depths"]])
        fig, ax = plt.subplots(figsize=(4.5, 3))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(l) for l in lengths])
        ax.set_yticks(range(len(exp["depths"])), [f"{d:.0%}" for d in exp["depths"]])
        ax.set_xlabel("length")
        ax.set_ylabel("depth")
        ax.set_title(f"{m}: passkey digit accuracy (teacher-forced)")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w", fontsize=8)
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        save_figure(fig, os.path.join(workdir, f"passkey_{m}.png"), dpi=110)


def main(argv=None):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="FoPE length-generalisation experiment")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--seeds", default="")
    p.add_argument("--methods", default=",".join(METHODS))
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
    methods = tuple(m for m in a.methods.split(",") if m)
    exp.seeds = seeds
    rec = record(exp)
    base = load_config(f"configs/fope.py:{a.preset}", unlocked=True)
    if a.steps:
        base.train.steps = a.steps
    os.makedirs(a.workdir, exist_ok=True)
    meta_cfg = {"preset": a.preset, "methods": list(methods), "seeds": list(seeds), "exp": rec,
                "eval_factors": list(FACTORS), "base_config": json.loads(base.to_json_best_effort())}
    write_atomic(os.path.join(a.workdir, "config.json"), json.dumps(meta_cfg, indent=2))
    tokenizer = build_tokenizer(base.data.tokenizer)
    stream = length_eval.heldout_stream(base.data, tokenizer, "validation")
    results = {}
    for seed in seeds:
        for m in methods:
            cfg = load_config(f"configs/fope.py:{a.preset}", unlocked=True)
            cfg.update_from_flattened_dict({"train.steps": base.train.steps})
            cfg.model.position, cfg.seed = m, seed
            if exp["passkey_train_fraction"] > 0:  # train on Shakespeare + passkey docs (≤ L)
                cfg.data.name = "jsonl"
                cfg.data.path = passkey_mix_corpus(a.workdir, base.data, tokenizer, base.data.seq_len,
                                                   exp["passkey_train_fraction"], seed)
            print(f"=== {m} seed {seed} ===", flush=True)
            results[(m, seed)] = run_one(cfg, os.path.join(a.workdir, f"{m}_s{seed}"), rec, stream,
                                         tokenizer)
            r = results[(m, seed)]
            print(f"{m} s{seed}: train {r['train_seconds']:.0f}s eval {r['eval_seconds']:.0f}s ppl "
                  + " ".join(f"{k}:{v['perplexity']:.2f}" for k, v in r["perplexity"].items()), flush=True)
    L = base.data.seq_len
    rows, stats = aggregate(results, L, exp)
    write_csv(os.path.join(a.workdir, "results.csv"), rows,
              ["method", "seed", "metric", "length", "depth", "value"])
    m = base.model
    meta = {"command": "python -m experiments.fope_length " + " ".join(argv if argv is not None
                                                                       else sys.argv[1:]),
            "commit": git_commit(), "seeds": seeds, "preset": a.preset, "steps": base.train.steps,
            "wall_seconds": elapsed(), "cpus": os.cpu_count(),
            "passkey_min_length": length_eval.passkey_min_length(tokenizer),
            "model": f"d_model {m.d_model}, {m.num_layers} layers, {m.num_heads} heads of {m.head_dim}, "
                     f"SwiGLU {m.ffn_dim}, batch {base.train.batch_size} x {L}, lr {base.train.lr}; "
                     f"FoPE gain {m.fope.init_gain}, fixed, pad-sin {m.fope.pad_sin_value}"}
    md = markdown(stats, methods, L, exp, meta)
    write_atomic(os.path.join(a.workdir, "results.md"), md)
    plots(stats, methods, L, exp, a.workdir)
    print(md)
    return stats


if __name__ == "__main__":
    main(sys.argv[1:])
