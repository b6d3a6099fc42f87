"""Puzzle reproduction: a heterogeneous child searched from a block library against uniform
compressions at the same parameter and KV-cache budget, before and after global distillation.

  TFDS_DATA_DIR=/tmp/tfds python -m experiments.puzzle --workdir=DIR [--preset=tiny|default]

1. Parent: a decoder (default: 6 layers, d 128, 8 query / 4 KV heads of 16, FFN 512, byte tokens)
   trained on the embedded Shakespeare corpus with the normal trainer.
2. Library (``icml_jax.compress.puzzle``): per layer, attention {4 (parent), 2, 1 KV heads,
   linear, no-op} and FFN {512 (parent), 256, 192, 128, 64, linear, no-op}, every variant of every
   layer trained by BLD at once from the parent's own sub-block inputs (``bld_steps`` steps).
3. Scores: replace-1-block KL(parent || swapped) of every (attention, FFN) pair in every layer on
   held-out rows (the first ``score_batches`` validation batches; the metrics below use the rest).
   Costs: exact block parameters (weights + norms) and KV bytes per token; latency: the median time
   of each jitted variant on a [decode.batch, 1, D] input (a per-token decode proxy, no cache read).
4. Children, each a ``config.model.blocks`` layout built from the same BLD-trained blocks:
   uniform baselines (every layer the same (KV heads, FFN width)), layer dropping (the last or the
   middle layers as no-op / no-op) and, for every baseline's budget (parameters <= its, KV bytes
   <= its), the MIP's Puzzle child under the same budget; with ``latency_child`` also one under
   the first uniform baseline's parameters, KV and summed variant latency. The headline budget is
   50% of the parent's block parameters and 50% of its KV cache.
5. Metrics on held-out validation rows: perplexity (per byte) and KL(parent || child) per token;
   greedy decode tokens/s (batch ``decode.batch``, median of ``decode.repeats``) measured here.
   Then global distillation (task ``gkd``: cosine on every layer's hidden state + KL on the logits,
   ``gkd_steps`` steps, ``gkd_seeds`` data seeds) of the ``gkd_arms`` children (empty: all) from
   the parent, and the same metrics after it; the headline Puzzle child also with the LM loss added
   (weight 1). Decode speed: greedy generation of ``decode.new`` tokens for ``decode.batch``
   prompts, every model timed in turn for ``decode.repeats`` rounds (median round).

Gates: the parent learned (validation NLL below the unigram entropy of its training bytes), BLD
lowered every trained variant's block error, and dropping half the layers hurts (KL > 0.05): else
the library has nothing to choose between. Outputs: DIR/results.csv, DIR/library.csv,
DIR/bld.csv, DIR/results.md, DIR/pareto.png (KL and perplexity against decode tokens/s),
DIR/config.json.
"""
import hashlib
import json
import os
import shutil
import sys
import time

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
                            eval_batches=3, checkpoint_every=30)),
        attention=(1, "noop"), ffn=(32, "linear", "noop"), bld_steps=8, bld_lr=3e-3,
        calib_rows=8, score_batches=1, uniform=((1, 32),), drop=("last",), budget=(0.5, 0.5),
        latency_child=True, latency_repeats=3,
        gkd_steps=4, gkd_lr=3e-3, gkd_seeds=(0,), gkd_arms=("Puzzle @ 50% / 50%",),
        decode=dict(batch=2, prompt=8, new=8, repeats=1), gate_drop_kl=0.0),
    "default": preset(
        run=dict(model=dict(d_model=128, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=16, ffn_dim=512,
                            max_seq_len=128),
                 data=dict(seq_len=128),
                 train=dict(steps=800, batch_size=8, lr=3e-3, warmup_steps=50, log_every=100, eval_every=800,
                            eval_batches=12, checkpoint_every=800)),
        attention=(2, 1, "linear", "noop"), ffn=(256, 192, 128, 64, "linear", "noop"), bld_steps=300,
        bld_lr=2e-3, calib_rows=32, score_batches=4, uniform=((2, 192), (1, 192)), drop=("last", "middle"),
        latency_child=True, latency_repeats=50,
        budget=(0.5, 0.5), gkd_steps=150, gkd_lr=1e-3, gkd_seeds=(0, 1, 2), gkd_arms=(),
        decode=dict(batch=8, prompt=32, new=64, repeats=15), gate_drop_kl=0.05),
}
FIELDS = ("child", "kind", "layout_attention", "layout_ffn", "params", "params_share", "kv_bytes", "kv_share",
          "stage", "gkd_seed", "val_nll", "val_ppl", "kl_to_parent", "decode_tok_s")
HEADLINE = "Puzzle @ 50% / 50%"
LATENCY = "+ latency"


def parent_config(exp):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/lm.py:small", unlocked=True)
    cfg.update_from_flattened_dict({**run_overrides(exp.run), **QUIET})
    return cfg


def gkd_config(parent_cfg, child_model, teacher: str, init_from: str, exp, seed: int, lm_weight: float = 0.0):
    from icml_jax.config_utils import load_config
    cfg = load_config("configs/gkd.py", unlocked=True)
    cfg.data = parent_cfg.data
    cfg.model = child_model
    cfg.seed = seed
    cfg.update_from_flattened_dict({**QUIET, "train.steps": exp.gkd_steps, "train.lr": exp.gkd_lr,
                                    "train.warmup_steps": max(1, exp.gkd_steps // 10),
                                    "train.batch_size": parent_cfg.train.batch_size,
                                    "train.eval_every": exp.gkd_steps, "train.checkpoint_every": exp.gkd_steps,
                                    "train.log_every": max(1, exp.gkd_steps // 5),
                                    "train.eval_batches": 1, "train.init_from": init_from,
                                    "gkd.teacher": teacher, "gkd.lm_weight": float(lm_weight)})
    return cfg


def children(P, m, exp, lib, solve):
    """[(name, kind, choice)]: the baselines, then the Puzzle child at each distinct budget."""
    L = m.num_layers
    full = P.choice_costs(m, P.uniform_choice(m, m.num_kv_heads, m.ffn_dim))
    out = [(f"uniform KV {a}, FFN {f}", "baseline", P.uniform_choice(m, a, f)) for a, f in exp.uniform]
    half = L // 2
    spots = {"last": range(L - half, L), "middle": range((L - half) // 2, (L - half) // 2 + half)}
    out += [(f"drop {d}", "baseline", P.drop_choice(m, spots[d])) for d in exp.drop]
    budgets = [(HEADLINE, {"stats.params": exp.budget[0] * full["params"],
                           "stats.kv_bytes": exp.budget[1] * full["kv_bytes"]})]
    for name, _, choice in out:
        if name.startswith("uniform"):
            c = P.choice_costs(m, choice)
            budgets.append((f"Puzzle @ {name}", {"stats.params": c["params"], "stats.kv_bytes": c["kv_bytes"]}))
    if exp.latency_child and exp.uniform:  # the first uniform baseline's budget, its latency too
        name, _, choice = out[0]
        lat = sum(lib[layer][P.pair_name(P.Variant(P.ATTN, a), P.Variant(P.FFN, f))]["stats"]["latency"]
                  for layer, (a, f) in enumerate(choice))
        budgets.append((f"Puzzle @ {name} {LATENCY}", {**budgets[1][1], "stats.latency": lat}))
    for name, budget in budgets:
        chosen, _, _ = solve(lib, "metrics.kl_div", budget)
        out.append((name, "puzzle", [lib[layer][chosen[layer]]["choice"] for layer in range(L)]))
    return out, full


def params_digest(tree) -> str:
    """A hash of a param tree's leaves (paths, shapes, bytes)."""
    import jax
    h = hashlib.sha256()
    for path, x in sorted(jax.tree_util.tree_leaves_with_path(tree), key=lambda t: str(t[0])):
        x = np.ascontiguousarray(np.asarray(x))
        h.update(f"{path}{x.shape}{x.dtype}".encode())
        h.update(x.tobytes())
    return h.hexdigest()[:16]


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    import jax
    import jax.numpy as jnp

    from icml_jax.compress import puzzle as P
    from icml_jax.compress import puzzle_mip
    from icml_jax.inference.decode import generate
    from icml_jax.losses.logps import token_logprobs
    from icml_jax.models import build_model
    from icml_jax.tasks.lm import LMTask
    from icml_jax.train.checkpoint import restore_model_params
    from icml_jax.train.trainer import save_initial
    wd = args.workdir
    cfg = parent_config(exp)
    m = cfg.model
    parent_dir = os.path.join(wd, "parent")
    summary, _, seconds = train_run(cfg, parent_dir)
    tpath = os.path.join(parent_dir, "train_seconds.json")
    if summary.get("start_step", 0) < cfg.train.steps or not os.path.exists(tpath):
        write_json(tpath, {"seconds": seconds})
    with open(tpath) as f:
        parent_minutes = json.load(f)["seconds"] / 60
    params, _ = restore_model_params(parent_dir, m)
    params = jax.tree.map(np.asarray, params)
    task = LMTask(cfg)
    val = [{k: jnp.asarray(v) for k, v in b.items()} for b in task.eval_batches("validation")]
    score_batch = {k: jnp.concatenate([b[k] for b in val[:exp.score_batches]]) for k in val[0]}
    held = val[exp.score_batches:]

    # --- library: init, BLD, scores, costs
    t0 = time.time()
    library = P.variants(m, attention=exp.attention, ffn=exp.ffn)
    it = task.train_iterator(seed=2000, shard=(0, 1))
    calib = next(it)
    while len(calib["inputs"]) < exp.calib_rows:
        calib = {k: np.concatenate([calib[k], v]) for k, v in next(it).items()}
    vparams = P.init_library(m, params, library, {k: jnp.asarray(v[:exp.calib_rows]) for k, v in calib.items()})
    batches = ({k: jnp.asarray(v) for k, v in next(it).items()} for _ in iter(int, 1))
    bld_eval = jax.jit(lambda p, v, b: P.bld_losses(m, p, library, v, b))
    before = {k: np.asarray(x) for k, x in bld_eval(params, vparams, score_batch).items()}
    vparams, _ = P.train_bld(m, params, library, vparams, batches, steps=exp.bld_steps, lr=exp.bld_lr,
                             log_every=max(1, exp.bld_steps // 4), log=lambda s: print(s, flush=True))
    after = {k: np.asarray(x) for k, x in bld_eval(params, vparams, score_batch).items()}
    bld_minutes = (time.time() - t0) / 60
    scores = P.score_pairs(m, params, vparams, P.pairs_for(library, "joint", m), score_batch)
    # per-token decode proxy: the jitted sub-block on [decode.batch, 1, D] (no cache read)
    latency = {v.name: P.measure_latency(m, v, vparams, exp.decode.batch, 1, repeats=exp.latency_repeats)
               for v in library}
    lib = P.build_library(m, library, scores, scoring="joint", latency=latency)
    lib_rows = [dict(layer=layer, pair=name, kl_div=st["metrics"]["kl_div"], params=st["stats"]["params"],
                     kv_bytes=st["stats"]["kv_bytes"], latency_ms=1e3 * st["stats"]["latency"])
                for layer, row in lib.items() for name, st in row.items()]
    bld_rows = [dict(variant=v.name, layer=i, before=float(before[v.name][i]), after=float(after[v.name][i]))
                for v in P.trainable(m, library) for i in range(m.num_layers)]
    print(f"[puzzle] library ready ({elapsed() / 60:.1f} min)", flush=True)

    # --- children, metrics before and after GKD
    kids, full = children(P, m, exp, lib, puzzle_mip.solve)
    parent_logp = {}
    evals = {}

    def metrics(model_cfg, p):
        key = (model_cfg.blocks.attention, model_cfg.blocks.ffn)
        if key not in evals:
            model = build_model(model_cfg)

            def fn(q, b, lp):
                logits = model.apply({"params": q}, b["inputs"], b["positions"], b["segment_ids"])
                w = (b["segment_ids"] > 0).astype(jnp.float32)
                nll = -token_logprobs(logits, b["targets"])
                lq = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
                kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1) if lp is not None else jnp.zeros_like(nll)
                return jnp.sum(nll * w), jnp.sum(kl * w), jnp.sum(w), lq
            evals[key] = jax.jit(fn)
        tot = np.zeros(3)
        for i, b in enumerate(held):
            s_nll, s_kl, n, lq = evals[key](p, b, parent_logp.get(i))
            if i not in parent_logp:
                parent_logp[i] = lq
            tot += [float(s_nll), float(s_kl), float(n)]
        return tot[0] / tot[2], tot[1] / tot[2]

    prompts = [list(np.asarray(held[0]["inputs"][i % len(held[0]["inputs"]), :exp.decode.prompt]))
               for i in range(exp.decode.batch)]

    def decode_speeds(models):
        """{name: tokens/s}: one warm-up each, then ``repeats`` rounds timing every model in turn
        (load from other processes falls on all alike); the median round per model."""
        runs = {n: (lambda cm=cm, p=p: generate(cm, p, prompts, key=jax.random.key(0),
                                                max_new_tokens=exp.decode.new, temperature=0))
                for n, cm, p in models}
        for run in runs.values():
            run()
        times = {n: [] for n in runs}
        for _ in range(exp.decode.repeats):
            for n, run in runs.items():
                t = time.perf_counter()
                run()
                times[n].append(time.perf_counter() - t)
        return {n: exp.decode.batch * exp.decode.new / float(np.median(ts)) for n, ts in times.items()}

    nll0, _ = metrics(m, params)  # fills parent_logp: the parent itself first
    rows = [dict(child="parent", kind="parent", layout_attention="", layout_ffn="", params=full["params"],
                 params_share=1.0, kv_bytes=full["kv_bytes"], kv_share=1.0, stage="-", gkd_seed="",
                 val_nll=nll0, val_ppl=float(np.exp(nll0)), kl_to_parent=0.0)]
    child_cfgs = {}
    for name, kind, choice in kids:
        cm = P.child_config(m, choice)
        cp = P.child_params(m, params, vparams, choice)
        child_cfgs[name] = (cm, cp)
        c = P.choice_costs(m, choice)
        base = dict(child=name, kind=kind, layout_attention=cm.blocks.attention, layout_ffn=cm.blocks.ffn,
                    params=c["params"], params_share=c["params"] / full["params"], kv_bytes=c["kv_bytes"],
                    kv_share=c["kv_bytes"] / full["kv_bytes"])
        nll, kl = metrics(cm, cp)
        rows.append({**base, "stage": "BLD blocks", "gkd_seed": "", "val_nll": nll, "val_ppl": float(np.exp(nll)),
                     "kl_to_parent": kl})
        print(f"[puzzle] {name}: {cm.blocks.attention} | {cm.blocks.ffn}: KL {kl:.4f} ppl {np.exp(nll):.3f} "
              f"({elapsed() / 60:.1f} min)", flush=True)
    speeds = decode_speeds([("parent", m, params)] + [(n, *child_cfgs[n]) for n in child_cfgs])
    for r in rows:
        r["decode_tok_s"] = speeds[r["child"]]
    gkd_runs = [(n, 0.0) for n in (exp.gkd_arms or list(child_cfgs))] + [(HEADLINE, 1.0)]
    for name, lm_weight in gkd_runs:
        cm, cp = child_cfgs[name]
        base = {k: v for k, v in next(r for r in rows if r["child"] == name and r["stage"] == "BLD blocks").items()}
        slug = name.replace(" ", "_").replace("/", "").replace("%", "").replace(",", "").replace("@", "at")
        init_dir = os.path.join(wd, "children", slug)
        child_run_cfg = parent_config(exp)
        child_run_cfg.model = cm
        # the child's step-0 run is reused only if it holds these very params (same layout and
        # blocks); otherwise it and its GKD runs are made again
        key = {"layout": [cm.blocks.attention, cm.blocks.ffn], "params": params_digest(cp)}
        key_path = os.path.join(init_dir, "child_key.json")
        if os.path.isdir(init_dir) and (not os.path.exists(key_path) or json.load(open(key_path)) != key):
            stale, gkd_root = [init_dir], os.path.join(wd, "gkd")
            if os.path.isdir(gkd_root):
                stale += [os.path.join(gkd_root, d) for d in os.listdir(gkd_root) if d.startswith(slug + "_lm")]
            for d in stale:
                shutil.rmtree(d)
        if not os.path.isdir(init_dir):
            save_initial(child_run_cfg, init_dir, cp)
            write_json(key_path, key)
        for seed in exp.gkd_seeds:
            gcfg = gkd_config(cfg, cm, parent_dir, init_dir, exp, seed, lm_weight)
            run_dir = os.path.join(wd, "gkd", f"{slug}_lm{lm_weight:g}_s{seed}")
            train_run(gcfg, run_dir)
            q, _ = restore_model_params(run_dir, cm)
            nll, kl = metrics(cm, q)
            stage = "after GKD" + (f" + LM x{lm_weight:g}" if lm_weight else "")
            rows.append({**base, "stage": stage, "gkd_seed": seed, "val_nll": nll, "val_ppl": float(np.exp(nll)),
                         "kl_to_parent": kl})
            print(f"[puzzle] {name} {stage} seed {seed}: KL {kl:.4f} ppl {np.exp(nll):.3f} "
                  f"({elapsed() / 60:.1f} min)", flush=True)

    # control for the LM term: the parent trained on as many more LM steps (its own data stream)
    ctl_cfg = parent_config(exp)
    ctl_cfg.update_from_flattened_dict({"train.steps": exp.gkd_steps, "train.lr": exp.gkd_lr,
                                        "train.warmup_steps": max(1, exp.gkd_steps // 10), "seed": 1,
                                        "train.eval_every": exp.gkd_steps, "train.checkpoint_every": exp.gkd_steps,
                                        "train.init_from": parent_dir})
    ctl_dir = os.path.join(wd, "parent_more_lm")
    train_run(ctl_cfg, ctl_dir)
    nll, kl = metrics(m, restore_model_params(ctl_dir, m)[0])
    rows.append({**rows[0], "stage": "+ LM steps", "val_nll": nll, "val_ppl": float(np.exp(nll)), "kl_to_parent": kl})

    freq = unigram_entropy(task)
    bld_means = {v: (np.mean([r["before"] for r in bld_rows if r["variant"] == v]),
                     np.mean([r["after"] for r in bld_rows if r["variant"] == v]))
                 for v in dict.fromkeys(r["variant"] for r in bld_rows)}
    drops = [r for r in rows if r["child"].startswith("drop") and r["stage"] == "BLD blocks"]
    gates = {f"parent learned (val NLL {nll0:.3f} < unigram entropy {freq:.3f})": bool(nll0 < freq),
             "BLD lowered every trained variant's block error (mean over layers)":
                 bool(all(after <= before for before, after in bld_means.values())),
             f"dropping half the layers hurts (KL {min(r['kl_to_parent'] for r in drops):.3f} > "
             f"{exp.gate_drop_kl})": bool(min(r["kl_to_parent"] for r in drops) > exp.gate_drop_kl)}
    write_csv(os.path.join(wd, "results.csv"), rows, FIELDS)
    write_csv(os.path.join(wd, "library.csv"), lib_rows, list(lib_rows[0]))
    write_csv(os.path.join(wd, "bld.csv"), bld_rows, list(bld_rows[0]))
    write_json(os.path.join(wd, "config.json"), dict(preset=args.preset, exp=record(exp, ["run"]), gates=gates,
                                                     minutes=elapsed() / 60, commit=git_commit(),
                                                     latency_ms={k: 1e3 * v for k, v in latency.items()}))
    write_atomic(os.path.join(wd, "results.md"), report(exp, rows, bld_rows, gates, elapsed() / 60, parent_minutes,
                                                         bld_minutes))
    plot(rows, os.path.join(wd, "pareto.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return rows


def _agg(rows, child, stage):
    rs = [r for r in rows if r["child"] == child and r["stage"] == stage]
    if not rs:
        return None
    kl = mean_spread([r["kl_to_parent"] for r in rs])
    ppl = mean_spread([r["val_ppl"] for r in rs])
    return kl, ppl, rs[0]


def report(exp, rows, bld_rows, gates, minutes, parent_minutes, bld_minutes):
    parent = rows[0]
    names = list(dict.fromkeys(r["child"] for r in rows if r["kind"] != "parent"))
    table = []
    for n in names:
        b = _agg(rows, n, "BLD blocks")
        a = _agg(rows, n, "after GKD")
        r = b[2]
        table.append([n, f"`{r['layout_attention']}`", f"`{r['layout_ffn']}`", f"{r['params_share']:.3f}",
                      f"{r['kv_share']:.3f}", f"{b[0][0]:.4f}", f"{b[1][0]:.3f}",
                      pm(a[0][0], a[0][1], nd=4) if a else "—", pm(a[1][0], a[1][1], nd=3) if a else "—",
                      f"{r['decode_tok_s']:.0f}"])
    verdicts = []
    for n in names:
        if not n.startswith("Puzzle @ "):
            continue
        budget_of = n[len("Puzzle @ "):].replace(f" {LATENCY}", "")  # a baseline's name, or 50% / 50%
        rivals = [budget_of] if budget_of in names else [x for x in names if x.startswith("drop")]
        for rival in rivals:
            for stage in ("BLD blocks", "after GKD"):
                p, q = _agg(rows, n, stage), _agg(rows, rival, stage)
                if p and q:
                    verdicts.append(f"{stage}: {n} KL {p[0][0]:.4f} {'<' if p[0][0] < q[0][0] else '>='} "
                                    f"{rival} {q[0][0]:.4f}; ppl {p[1][0]:.3f} vs {q[1][0]:.3f}; params "
                                    f"{p[2]['params_share']:.3f} vs {q[2]['params_share']:.3f}, KV "
                                    f"{p[2]['kv_share']:.3f} vs {q[2]['kv_share']:.3f}")
    lm = _agg(rows, HEADLINE, "after GKD + LM x1")
    plain = _agg(rows, HEADLINE, "after GKD")
    if lm and plain:
        ctl = next((r for r in rows if r["child"] == "parent" and r["stage"] == "+ LM steps"), None)
        verdicts.append(f"GKD without the LM loss: KL {plain[0][0]:.4f}, ppl {plain[1][0]:.3f}; with it: KL "
                        f"{lm[0][0]:.4f}, ppl {lm[1][0]:.3f} (the paper: adding the LM loss hurt)"
                        + (f"; control: the parent itself after the same {exp.gkd_steps} LM steps has ppl "
                           f"{ctl['val_ppl']:.3f} (what the LM term can add by training on more data)" if ctl else ""))
    bld = {}
    for r in bld_rows:
        bld.setdefault(r["variant"], []).append((r["before"], r["after"]))
    bld_table = [[v, f"{np.mean([b for b, _ in xs]):.3f}", f"{np.mean([a for _, a in xs]):.3f}"]
                 for v, xs in bld.items()]
    m = exp.run.model
    lines = [
        "# Puzzle: block library, MIP search and global distillation", "",
        f"Commit {git_commit()}; parent training {parent_minutes:.1f} min (measured when it trained), library "
        f"(init + BLD {exp.bld_steps} steps) {bld_minutes:.1f} min, this invocation {minutes:.1f} min. Parent: "
        f"{m.num_layers} layers, d {m.d_model}, {m.num_heads} query / {m.num_kv_heads} KV heads of {m.head_dim}, "
        f"FFN {m.ffn_dim}, {exp.run.train.steps} steps on Shakespeare; validation perplexity (per byte) "
        f"{parent['val_ppl']:.3f}, decode {parent['decode_tok_s']:.0f} tokens/s (batch {exp.decode.batch}, "
        f"greedy, {exp.decode.new} new tokens). Every child is built from the same BLD-trained blocks, so the "
        "comparison isolates the layout; shares are of the parent's block parameters (weights + norms, no "
        "embedding) and KV bytes per token. KL = mean over held-out tokens of KL(parent || child); after GKD: "
        f"{exp.gkd_steps} steps of cosine (every layer) + KL distillation, mean ± s.e. over data seeds "
        f"{list(exp.gkd_seeds)}. Decode tokens/s: greedy, batch {exp.decode.batch}, {exp.decode.new} new tokens, "
        f"every model timed in turn for {exp.decode.repeats} rounds (median) in this run on a shared 2-core CPU "
        "(ratios within the run are what it shows).", "",
        *gate_lines(gates, "A gate failed: read the table as a record of this run only."),
        markdown_table(["child", "attention", "FFN", "params", "KV", "KL (BLD blocks)", "ppl (BLD blocks)",
                        "KL after GKD", "ppl after GKD", "decode tok/s"], table), "",
        "Comparisons at matched budgets (Puzzle's child uses at most the rival's parameters and KV):", "",
        *[f"- {v}" for v in verdicts], "",
        "BLD (mean over layers of L_BLD on held-out rows, before -> after):", "",
        markdown_table(["variant", "before", "after"], bld_table), ""]
    return "\n".join(lines)


def plot(rows, path):
    """KL to the parent and perplexity against measured decode tokens/s, before and after GKD."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 8.5))
    parent = rows[0]
    names = list(dict.fromkeys(r["child"] for r in rows if r["kind"] != "parent"))
    tags = {n: f"{'P' if n.startswith('Puzzle') else 'B'}{i + 1}" for i, n in enumerate(names)}
    for col, stage in enumerate(("BLD blocks", "after GKD")):
        for row, (metric, idx, label) in enumerate((("kl_to_parent", 0, "KL(parent || child) per token"),
                                                    ("val_ppl", 1, "validation perplexity (per byte)"))):
            ax = axes[row][col]
            for n in names:
                a = _agg(rows, n, stage)
                if a is None:
                    continue
                r = a[2]
                color = "tab:red" if r["kind"] == "puzzle" else "tab:blue"
                ax.errorbar(r["decode_tok_s"], a[idx][0], yerr=a[idx][1], fmt="o", color=color)
                ax.annotate(tags[n], (r["decode_tok_s"], a[idx][0]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
            if metric == "val_ppl":
                ax.axhline(parent["val_ppl"], color="gray", ls="--", lw=0.8)
            ax.axvline(parent["decode_tok_s"], color="gray", ls=":", lw=0.8)
            ax.set_xlabel("decode tokens/s (measured; dotted: parent)")
            ax.set_ylabel(label)
            ax.set_title(f"{stage} (red: Puzzle, blue: uniform / layer drop)", fontsize=9)
    key = [f"{tags[n]}: {n} ({r['params_share']:.2f} params, {r['kv_share']:.2f} KV)"
           for n in names for r in [next(x for x in rows if x["child"] == n)]]
    fig.text(0.01, 0.005, "\n".join(key), fontsize=6.5, va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.018 * len(key), 1, 1))
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main() and 0)
