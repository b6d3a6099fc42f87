"""TLR reproduction: pruning a trained decoder's projections with and without low-rank refinement.

  TFDS_DATA_DIR=/tmp/tfds python -m experiments.tlr_pruning --workdir=DIR [--preset=tiny|default]

A decoder (``model``: 4 layers, d 256, FFN 1024, byte tokens) is trained on the embedded
Shakespeare corpus with the normal trainer, then every block projection (q, k, v, o, gate, up,
down) is pruned (``icml_jax.compress.prune``) in each setting of the grid: unstructured at 50% and
70% and 2:4, with magnitude and Wanda masks (per output row, as fusion_bench). Arms per setting:
prune only; + one-shot SVD of the pruned-away part (rank k); TLR (``iters`` alternations, 0.99
early stop, rank k: the reference config's T = 10); TLR at ``long_iters`` (T = 50, what the
reference's example scripts run; 0 = no such arm); and the parameter-matched control: the same mask rule at the lower sparsity
that keeps as many parameters as TLR's nnz(S) + k (m + n) per matrix (unstructured, so for 2:4 it
is a per-row mask). Wanda's calibration rows are drawn from the training split with
``calib_seeds`` (2 seeds: the Wanda arms are pruned once per seed; magnitude masks need none).
Metric: perplexity (per byte) on the validation split; its relative reduction against prune only
(the paper's metric) and the share of prune only's excess over dense that an arm removes. The
spec's model has 6 layers; 4 keep the default preset's training inside this CPU's budget. Gates: the dense model learned (validation NLL below the
unigram entropy of its training bytes) and 70% prune-only hurts (perplexity >= 1.05x dense).
Outputs: DIR/results.csv, DIR/results.md, DIR/ppl.png, DIR/config.json.
"""
import json
import os
import sys

import numpy as np

from experiments.common import (gate_lines, git_commit, markdown_table, mean_spread, pm, preset, record,
                                run_overrides, save_figure, start, train_run, unigram_entropy, write_atomic,
                                write_csv, write_json)

QUIET = {"train.samples": 0, "train.progress": False}
PRESETS = {
    "tiny": preset(
        run=dict(model=dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=64,
                            max_seq_len=64),
                 data=dict(seq_len=32),
                 train=dict(steps=30, batch_size=8, lr=1e-2, warmup_steps=3, log_every=10, eval_every=30,
                            eval_batches=1, checkpoint_every=30)),
        settings=(("unstructured", 0.5), ("2:4", 0.5)), methods=("magnitude", "wanda"), ranks=(4,),
        iters=4, long_iters=0, calib_seeds=(0,), calib_rows=8, eval_batches=2, gate_damage=1.0),
    "default": preset(
        run=dict(model=dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64, ffn_dim=1024,
                            max_seq_len=128),
                 data=dict(seq_len=128),
                 train=dict(steps=1000, batch_size=16, lr=3e-3, warmup_steps=50, log_every=100, eval_every=500,
                            eval_batches=4, checkpoint_every=500)),
        settings=(("unstructured", 0.5), ("unstructured", 0.7), ("2:4", 0.5)), methods=("magnitude", "wanda"),
        ranks=(8, 16), iters=10, long_iters=50, calib_seeds=(0, 1), calib_rows=32, eval_batches=16,
        gate_damage=1.05),
}
FIELDS = ("pattern", "sparsity", "method", "arm", "rank", "calib_seed", "kept_params", "val_nll", "val_ppl")


def dense_config(exp):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**run_overrides(exp.run), **QUIET})
    return cfg


def control_sparsity(model_cfg, sparsity: float, rank: int) -> dict:
    """Per projection: the sparsity s' with (1 - s') m n = (1 - s) m n + k (m + n)."""
    D, F, H, G, K = (model_cfg.d_model, model_cfg.ffn_dim, model_cfg.num_heads, model_cfg.num_kv_heads,
                     model_cfg.head_dim)
    shapes = {"q": (H * K, D), "k": (G * K, D), "v": (G * K, D), "o": (D, H * K), "gate": (F, D),
              "up": (F, D), "down": (D, F)}
    return {n: max(0.0, sparsity - rank * (m + n_) / (m * n_)) for n, (m, n_) in shapes.items()}


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    import jax
    import jax.numpy as jnp

    from icml_jax.compress import prune
    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models import build_model
    from icml_jax.tasks.lm import LMTask
    from icml_jax.train.checkpoint import restore_model_params
    wd = args.workdir
    cfg = dense_config(exp)
    summary, _, seconds = train_run(cfg, os.path.join(wd, "dense"))
    # the dense model's training time as measured when it trained (a finished run is only reloaded)
    tpath = os.path.join(wd, "dense", "train_seconds.json")
    if summary.get("start_step", 0) < cfg.train.steps or not os.path.exists(tpath):
        write_json(tpath, {"seconds": seconds})
    with open(tpath) as f:
        train_minutes = json.load(f)["seconds"] / 60
    params, _ = restore_model_params(os.path.join(wd, "dense"), cfg.model)
    params = jax.tree.map(np.asarray, params)
    task = LMTask(cfg)
    cfg.train.eval_batches = exp.eval_batches
    batches = task.eval_batches("validation")

    nll_fns = {}

    def val_nll(p, model_cfg) -> float:
        key = int(model_cfg.get("lowrank", 0) or 0)
        if key not in nll_fns:
            model = build_model(model_cfg)
            nll_fns[key] = jax.jit(lambda q, b: (
                (-token_logprobs(model.apply({"params": q}, b["inputs"], b["positions"], b["segment_ids"]),
                                 b["targets"]) * (b["segment_ids"] > 0)).sum(), (b["segment_ids"] > 0).sum()))
        tot = cnt = 0.0
        for b in batches:
            s, n = nll_fns[key](p, {k: jnp.asarray(v) for k, v in b.items()})
            tot, cnt = tot + float(s), cnt + float(n)
        return tot / cnt

    def calib(seed):
        it = task.train_iterator(seed=1000 + seed, shard=(0, 1))
        rows = []
        while sum(len(r["inputs"]) for r in rows) < exp.calib_rows:
            rows.append(next(it))
        cat = {k: np.concatenate([r[k] for r in rows])[:exp.calib_rows]
               for k in ("inputs", "segment_ids", "positions")}
        return cat["inputs"], cat["segment_ids"], cat["positions"]

    dense_nll = val_nll(params, cfg.model)
    dense_count = prune.sparse_param_count(params, cfg.model)["dense"]
    results = [dict(pattern="dense", sparsity=0.0, method="", arm="dense", rank=0, calib_seed="",
                    kept_params=dense_count, val_nll=dense_nll, val_ppl=float(np.exp(dense_nll)))]
    for pattern, sparsity in exp.settings:
        for method in exp.methods:
            seeds = exp.calib_seeds if method == "wanda" else (exp.calib_seeds[0],)
            for seed in seeds:
                toks, segs, pos = calib(seed) if method == "wanda" else (None, None, None)
                kw = dict(method=method, pattern=pattern, sparsity=sparsity, calib_tokens=toks,
                          calib_segments=segs, calib_positions=pos, seed=seed)
                arms = [("prune only", 0, lambda: prune.prune_model(params, cfg.model, **kw)[:2])]
                for k in exp.ranks:
                    arms += [("one-shot SVD", k, lambda k=k: prune.prune_model(params, cfg.model, refine="svd",
                                                                                  rank=k, **kw)[:2]),
                             ("TLR", k, lambda k=k: prune.prune_model(params, cfg.model, refine="tlr", rank=k,
                                                                       iters=exp.iters, **kw)[:2]),
                             *([(f"TLR (T = {exp.long_iters})", k, lambda k=k: prune.prune_model(
                                 params, cfg.model, refine="tlr", rank=k, iters=exp.long_iters, **kw)[:2])]
                               if exp.get("long_iters", 0) else []),
                             ("param-matched control", k, lambda k=k: prune.prune_model(
                                 params, cfg.model, **{**kw, "pattern": "unstructured",
                                                       "sparsity": control_sparsity(cfg.model, sparsity, k)})[:2])]
                for arm, k, fn in arms:
                    p2, c2 = fn()
                    nll = val_nll(p2, c2)
                    results.append(dict(pattern=pattern, sparsity=sparsity, method=method, arm=arm, rank=k,
                                        calib_seed=seed if method == "wanda" else "",
                                        kept_params=prune.sparse_param_count(p2, c2)["nonzero"],
                                        val_nll=nll, val_ppl=float(np.exp(nll))))
                    print(f"[tlr] {pattern} {sparsity} {method} seed {seed} {arm} k={k}: ppl "
                          f"{np.exp(nll):.3f} ({elapsed() / 60:.1f} min)", flush=True)
    freq = unigram_entropy(task)
    worst = [r for r in results if r["arm"] == "prune only" and r["sparsity"] == max(s for _, s in exp.settings)]
    damage = float(np.mean([r["val_ppl"] for r in worst])) / float(np.exp(dense_nll))
    gates = {f"dense model learned (val NLL {dense_nll:.3f} < unigram entropy {freq:.3f})": bool(dense_nll < freq),
             f"prune only at the highest sparsity hurts (ppl {damage:.3f}x dense >= {exp.gate_damage})":
                 bool(damage >= exp.gate_damage)}
    write_csv(os.path.join(wd, "results.csv"), results, FIELDS)
    write_json(os.path.join(wd, "config.json"), dict(preset=args.preset, exp=record(exp, ["run"]), gates=gates,
                                                     minutes=elapsed() / 60, commit=git_commit()))
    write_atomic(os.path.join(wd, "results.md"), report(exp, results, gates, elapsed() / 60, train_minutes))
    plot(exp, results, os.path.join(wd, "ppl.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return results


def summary(exp, results):
    """{(pattern, sparsity, method): {(arm, rank): (mean ppl, se, mean kept params)}}."""
    out = {}
    for r in results:
        if r["arm"] == "dense":
            continue
        out.setdefault((r["pattern"], r["sparsity"], r["method"]), {}).setdefault((r["arm"], r["rank"]), []).append(r)
    return {key: {arm: (*mean_spread([x["val_ppl"] for x in rs])[:2], float(np.mean([x["kept_params"] for x in rs])))
                  for arm, rs in arms.items()} for key, arms in out.items()}


def report(exp, results, gates, minutes, train_minutes):
    dense = next(r for r in results if r["arm"] == "dense")
    s = summary(exp, results)
    rows, verdicts = [], []
    for (pattern, sp, method), arms in s.items():
        base = arms[("prune only", 0)][0]
        label = f"{pattern} {sp:.0%}" if pattern == "unstructured" else pattern
        for (arm, k), (m, se, kept) in arms.items():
            excess = base - dense["val_ppl"]  # undefined when pruning did no harm
            red = f"{(base - m) / excess:+.1%}" if arm != "prune only" and excess > 0.01 * dense["val_ppl"] else "—"
            rel = f"{(base - m) / base:+.1%}" if arm != "prune only" else "—"  # the paper's metric
            rows.append([label, method, arm, k or "—", f"{kept / dense['kept_params']:.3f}", pm(m, se, nd=3), rel,
                         red])
        for k in exp.ranks:
            t, o, c = arms[("TLR", k)][0], arms[("one-shot SVD", k)][0], arms[("param-matched control", k)][0]
            long = arms.get((f"TLR (T = {exp.get('long_iters', 0)})", k))
            verdicts.append(f"{label} {method} k={k}: TLR {t:.3f} {'<' if t < o else '>='} one-shot {o:.3f} "
                            f"{'<' if o < base else '>='} prune only {base:.3f}; TLR {'<' if t < c else '>='} "
                            f"control {c:.3f}" + (" (the control is unstructured at the matched count)"
                                                  if pattern != "unstructured" else "")
                            + (f"; TLR at T = {exp.long_iters} {long[0]:.3f} "
                               f"{'<' if long[0] < o else '>='} one-shot" if long else ""))
    lines = [
        "# TLR: pruning with targeted low-rank refinement", "",
        f"Commit {git_commit()}; dense training {train_minutes:.1f} min (measured when it trained), this "
        f"invocation {minutes:.1f} min. Dense model: {exp.run.model.num_layers} layers, d "
        f"{exp.run.model.d_model}, FFN {exp.run.model.ffn_dim}, {exp.run.train.steps} steps on Shakespeare; "
        f"validation perplexity (per byte) {dense['val_ppl']:.3f}. Every block projection pruned; TLR with "
        f"T = {exp.iters}, early stop 0.99; Wanda calibration: {exp.calib_rows} training rows, seeds "
        f"{list(exp.calib_seeds)} (± = s.e. over them; magnitude masks are deterministic). Kept = non-zero "
        "block-projection weights + factor entries over the dense projections' size. vs prune only = "
        "(ppl_prune_only - ppl) / ppl_prune_only, the paper's relative reduction; share of excess = the part "
        "of prune only's excess perplexity over dense that the arm removes. The parameter-matched control "
        "prunes per row at the lower sparsity that keeps TLR's count (for 2:4 that is an unstructured mask, "
        "which favours the control). Wanda calibration follows the reference's order: the next block's "
        "inputs pass through TLR's factors but not through the one-shot arm's (fusion_bench computes them "
        "before it extracts that arm's factors), so Wanda's TLR-vs-one-shot gap mixes refinement and "
        "calibration path.", "",
        *gate_lines(gates, "A gate failed: read the table as a record of this run only."),
        markdown_table(["setting", "mask", "arm", "rank", "kept", "val ppl", "vs prune only", "share of excess"],
                       rows), "",
        "Orderings (means):", "", *[f"- {v}" for v in verdicts], ""]
    return "\n".join(lines)


def plot(exp, results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = summary(exp, results)
    dense = next(r for r in results if r["arm"] == "dense")["val_ppl"]
    fig, axes = plt.subplots(1, len(s), figsize=(3.2 * len(s), 3.6), sharey=False, squeeze=False)
    for ax, ((pattern, sp, method), arms) in zip(axes[0], s.items()):
        names = list(arms)
        ax.bar(range(len(names)), [arms[n][0] - dense for n in names], yerr=[arms[n][1] for n in names], capsize=2)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([f"{a}\nk={k}" if k else a for a, k in names], rotation=70, fontsize=6)
        ax.set_title(f"{pattern} {sp:.0%} {method}", fontsize=8)
    axes[0][0].set_ylabel(f"validation perplexity - dense ({dense:.3f})")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main() and 0)
