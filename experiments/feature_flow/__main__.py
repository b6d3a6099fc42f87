"""Feature Flow (Laptev et al., ICML 2025), the spec's small reproduction (section 6): a byte-level
decoder trained on Shakespeare mixed with text about four synthetic topics, TopK SAEs on every
layer's residual stream, MLP output and attention output (after o_proj), data-free matching by
decoder cosine, and the three studies.

  python -m experiments.feature_flow --workdir=DIR [--preset=tiny|default]

Per seed (init, data order, SAE init; the corpus is fixed):
1. Groups: each residual feature's top-1 predecessor in R_{L−1}, MLP_L and Attn_L, and which of
   them are active on the tokens where the feature is; s(P) of the features whose group contains
   P against the rest (one-sided Mann–Whitney). Spec: the distributions differ, p < 0.001.
2. Deactivation: rescale r = 0 at the top-1 predecessor vs a uniformly random one of the top 5;
   the target's activation change 1 − z_new/z_old and success rate (z_new = 0) where it fired.
   Spec: top-1 higher on both. Also the top-1 by activation correlation (Pearson).
3. Steering: for each topic, the last layer's most topic-selective residual feature; add s·v on
   every token at every node of its flow graph (cumulative) or at its own layer (single-layer),
   from the neutral prefix "I think "; behaviour = topic word rate, coherence = the continuation's
   NLL under the unsteered model mapped to [0, 1]; and suppression (rescale r at the same nodes,
   from a topic prompt). Spec: cumulative reaches the same behaviour at smaller s and a better
   behaviour × coherence; for suppression cumulative wins at small |r|.
Gates: the LM learned (held-out CE below the unigram entropy), it writes on-topic text after a
topic prompt, and the SAEs reconstruct (mean FVU below ``fvu_gate``).
Outputs: DIR/results.md, DIR/groups.csv, DIR/deactivation.csv, DIR/steering.csv,
DIR/feature_flow.png, DIR/config.json; per-seed caches and runs under DIR/runs.
"""
import json
import os
import sys

import numpy as np

from experiments.common import (cached, gate_lines, git_commit, markdown_table, mean_spread, pm, preset, record,
                                save_figure, start, stopwatch, write_atomic, write_csv, write_json)
from experiments.feature_flow import study

_MODEL = dict(d_model=128, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32, ffn_dim=384)
PRESETS = {
    "tiny": preset(
        seeds=(0,), docs=96, piece_len=63, topic_share=0.5, latents=64, k=4, aux_k=8, sae_steps=6, sae_batch=4,
        sae_lr=1e-3, eval_per_topic=2, eval_generic=2, min_active=2, coact=0.5, targets=1, top=5,
        strengths=(2.0,), rs=(0.0,), steer_topics=1, prompts=4, new_tokens=8, temperature=1.27, top_p=0.7, fvu_gate=10.0,
        topic_gate=0.0,
        run=dict(model=dict(d_model=32, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16, ffn_dim=64),
                 train=dict(steps=6, batch_size=4, lr=1e-2, warmup_steps=2, log_every=3, eval_every=6,
                            eval_batches=1, checkpoint_every=6))),
    "default": preset(
        seeds=(0, 1, 2), docs=4000, piece_len=127, topic_share=0.5, latents=512, k=16, aux_k=64, sae_steps=500,
        sae_batch=16, sae_lr=2e-3, eval_per_topic=8, eval_generic=16, min_active=5, coact=0.5, targets=64, top=5,
        strengths=(0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0), rs=(0.5, 0.0, -1.0, -3.0), steer_topics=4, prompts=32, new_tokens=48, temperature=1.27,
        top_p=0.7, fvu_gate=0.3, topic_gate=0.3,
        run=dict(model=_MODEL, train=dict(steps=600, batch_size=16, lr=3e-3, warmup_steps=40, log_every=100,
                                          eval_every=600, eval_batches=4, checkpoint_every=300))),
}
MODES = ("cumulative", "single")
KINDS = ("top1", "random_top5", "pearson_top1")
SAE_KEYS = ("latents", "k", "aux_k", "sae_steps", "sae_batch", "sae_lr", "docs", "piece_len", "topic_share")


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    from experiments.iti_bad_data.lm import run_config, unigram_entropy, write_corpus
    wd = args.workdir
    docs, labels = study.mixed_corpus(exp.docs, exp.piece_len, exp.topic_share)
    corpus = os.path.join(wd, "corpus.jsonl")
    write_corpus(corpus, docs)
    unigram = unigram_entropy([d for d, lab in zip(docs, labels) if lab < 0][:500] + docs[:500])
    per_seed = {}
    for seed in exp.seeds:
        cfg = run_config(exp, corpus, seed)
        key = dict(exp=record(exp, ("run",)), seed=seed, unigram=unigram)
        per_seed[seed] = cached(os.path.join(wd, "runs", f"seed{seed}.json"), key,
                                lambda: run_seed(exp, cfg, docs, seed, unigram, wd), seconds_key="seconds")
        print(f"seed {seed}: {per_seed[seed]['seconds'] / 60:.1f} min", flush=True)
    report(args, exp, per_seed, unigram, elapsed)
    return per_seed


def _tokens(tok, texts, length):
    from experiments.iti_bad_data.lm import encode_rows
    return encode_rows(tok, texts, length)[0]


def run_seed(exp, cfg, docs, seed, unigram, wd) -> dict:
    import jax

    from experiments.common import train_run
    from icml_jax.analysis import feature_flow as ff
    from icml_jax.data.tokenizers import ByteTokenizer
    from icml_jax.train.checkpoint import restore_model_params
    tok = ByteTokenizer()
    T = exp.piece_len + 1
    t = stopwatch()
    run_dir = os.path.join(wd, "runs", f"lm_seed{seed}")
    summary, _, _ = train_run(cfg, run_dir)
    params = restore_model_params(run_dir, cfg.model)[0]
    times = {"lm_s": t()}
    # SAEs on fresh windows of the training documents
    t = stopwatch()
    train_tok = _tokens(tok, docs, T)
    rng = np.random.default_rng(1000 + seed)
    batches = (train_tok[rng.integers(len(train_tok), size=exp.sae_batch)] for _ in range(exp.sae_steps))
    key = dict(run=json.loads(cfg.to_json_best_effort()), seed=seed, **{k: exp[k] for k in SAE_KEYS})
    saes, sae_stats = study.cached_saes(
        os.path.join(wd, "runs", f"saes_seed{seed}"), key,
        lambda: study.train_saes(cfg.model, params, batches, latents=exp.latents, k=exp.k, aux_k=exp.aux_k,
                                 lr=exp.sae_lr, seed=seed))
    times["sae_s"] = t()
    t = stopwatch()
    decoders = {p: np.asarray(ff.SAEAt(None, v).decoder()) for p, v in saes.items()}
    texts, doc_labels = study.eval_docs(exp.eval_per_topic, exp.eval_generic, exp.piece_len, seed)
    ev_tok = _tokens(tok, texts, T)
    z = study.encode_points(cfg.model, params, saes, ev_tok, latents=exp.latents, k=exp.k)
    L = cfg.model.num_layers
    g_rows = study.groups(decoders, z, L, min_active=exp.min_active, coact=exp.coact)
    tests = study.group_tests(g_rows)
    # deactivation: targets sampled among residual features active on enough tokens
    rng = np.random.default_rng(2000 + seed)
    live = [(r["layer"], r["feature"]) for r in g_rows]
    pick = rng.permutation(len(live))[:exp.targets]
    pairs, kinds = [], []
    for i in pick:
        layer, f = live[i]
        cands = study.candidates(decoders, layer, f, exp.top)
        for kind, c in (("top1", cands[0]), ("random_top5", cands[int(rng.integers(len(cands)))]),
                        ("pearson_top1", study.pearson_candidate(z, layer, f))):
            pairs.append((layer, f, c[:3]))
            kinds.append((kind, c[3]))
    d_rows = study.deactivate(cfg.model, params, saes, z, ev_tok, pairs, latents=exp.latents, k=exp.k)
    for r, (kind, sim) in zip(d_rows, kinds):
        r.update(kind=kind, similarity=sim, seed=seed)
    times["analysis_s"] = t()
    # steering and suppression
    t = stopwatch()
    tok_labels = np.repeat(doc_labels[:, None], T, 1)
    feats = study.topic_features(z[(L - 1, "res")], tok_labels, len(study.NAMES), exp.min_active)
    module = study.sae_module(cfg.model.d_model, exp.latents, exp.k)
    sae_at = {p: ff.SAEAt(module, v) for p, v in saes.items()}
    norm = float(sae_stats["scale"][f"{L - 1}/res"]) * np.sqrt(cfg.model.d_model)  # RMS residual norm there
    gen = dict(prompts=exp.prompts, new_tokens=exp.new_tokens, temperature=exp.temperature, top_p=exp.top_p,
               seed=seed, unigram=unigram)
    s_rows, graphs = [], {}
    origins = ff.all_origins(decoders)
    for ti, (name, cands) in enumerate(list(zip(study.NAMES, feats))[:exp.steer_topics]):
        # of the topic's most selective features, the one whose flow graph reaches furthest back
        # (ties: the more selective); a graph cut at once makes cumulative = its own layer
        graph = {f: ff.graph_nodes(ff.flow_graph(origins, L - 1, f), root=(L - 1, "res", f)) for f, _ in cands}
        f, sel = min(cands, key=lambda c: min(n[0] for n in graph[c[0]]))
        root, nodes = (L - 1, "res", f), graph[f]
        graphs[name] = dict(feature=f, selectivity=sel, nodes=[list(n) for n in nodes],
                            depth=L - min(n[0] for n in nodes))
        points = {(n[0], n[1]) for n in nodes}
        # every run of a topic edits the graph's points (one compiled program per topic): the
        # single-layer runs and the baselines add 0 (steer weight 0) / rescale by r = 1 elsewhere,
        # which leaves those values exactly unchanged
        weight = {"none": {n: 0.0 for n in nodes}, "cumulative": {n: 1.0 for n in nodes},
                  "single": {n: float(n == root) for n in nodes}}
        r_at = {"none": lambda r: {p: 1.0 for p in points}, "cumulative": lambda r: {p: r for p in points},
                "single": lambda r: {p: (r if p == root[:2] else 1.0) for p in points}}
        topic_prompt = study.sentence(name, np.random.default_rng(ti)) + " " + study.NEUTRAL
        base = study.steer_outcomes(cfg.model, params, tok, ff.steer_edits(decoders, nodes, 0.0, fold=weight["none"]),
                                    topic=name, nll_ref=None, **gen)
        sup0 = study.steer_outcomes(cfg.model, params, tok, ff.rescale_edits(sae_at, nodes, r_at["none"](1.0)),
                                    topic=name, nll_ref=None, prompt=topic_prompt, **gen)
        s_rows.append(dict(seed=seed, topic=name, kind="steer", mode="none", strength=0.0, **base))
        s_rows.append(dict(seed=seed, topic=name, kind="suppress", mode="none", strength=1.0, **sup0))
        for mode in MODES:
            for s in exp.strengths:
                ed = ff.steer_edits(decoders, nodes, s * norm, fold=weight[mode])
                out = study.steer_outcomes(cfg.model, params, tok, ed, topic=name, nll_ref=base["nll"], **gen)
                s_rows.append(dict(seed=seed, topic=name, kind="steer", mode=mode, strength=s, **out))
            for r in exp.rs:
                ed = ff.rescale_edits(sae_at, nodes, r_at[mode](r))
                out = study.steer_outcomes(cfg.model, params, tok, ed, topic=name, nll_ref=sup0["nll"],
                                           prompt=topic_prompt, **gen)
                s_rows.append(dict(seed=seed, topic=name, kind="suppress", mode=mode, strength=r, **out))
    times["steer_s"] = t()
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()), flush=True)
    return dict(eval_loss=float(summary.get("eval_loss", float("nan"))), sae=sae_stats, groups=g_rows, tests=tests,
                deactivation=d_rows, steering=s_rows, graphs=graphs, times=times, norm=norm)


# ----------------------------------------------------------------------------- report

def _ms(xs):
    return mean_spread([x for x in xs if np.isfinite(x)])


def steer_table(exp, per_seed, kind, values):
    """{(mode, value): {col: (mean, s.e., n)}} of the topic-averaged outcomes over seeds."""
    out = {}
    for mode in ("none",) + MODES:
        for v in ([1.0 if kind == "suppress" else 0.0] if mode == "none" else values):
            by_seed = {c: [] for c in ("behaviour", "coherence", "score", "nll")}
            for res in per_seed.values():
                rows = [r for r in res["steering"] if r["kind"] == kind and r["mode"] == mode and r["strength"] == v]
                for c in by_seed:
                    by_seed[c].append(float(np.mean([r[c] for r in rows])))
            out[(mode, v)] = {c: mean_spread(x) for c, x in by_seed.items()}
    return out


def report(args, exp, per_seed, unigram, elapsed):
    wd = args.workdir
    seeds = list(per_seed)
    g_rows = [dict(seed=s, **r) for s, res in per_seed.items() for r in res["groups"]]
    d_rows = [r for res in per_seed.values() for r in res["deactivation"]]
    s_rows = [r for res in per_seed.values() for r in res["steering"]]
    write_csv(os.path.join(wd, "groups.csv"), g_rows,
              ["seed", "layer", "feature", "active", "group", "label"] + [f"{a}_{m}" for m in study.GROUP_MODULES
                                                                          for a in ("s", "co")])
    write_csv(os.path.join(wd, "deactivation.csv"), d_rows,
              ["seed", "kind", "layer", "feature", "source", "similarity", "change", "success", "tokens"])
    write_csv(os.path.join(wd, "steering.csv"), s_rows,
              ["seed", "topic", "kind", "mode", "strength", "behaviour", "coherence", "score", "nll", "sample"])
    ce = [res["eval_loss"] for res in per_seed.values()]
    fvu = [float(np.mean(list(res["sae"]["fvu"].values()))) for res in per_seed.values()]
    on_topic = [float(np.mean([r["behaviour"] for r in res["steering"] if r["kind"] == "suppress"
                               and r["mode"] == "none"])) for res in per_seed.values()]
    gates = {f"LM learned (worst held-out CE {max(ce):.3f} < byte unigram entropy {unigram:.3f})": max(ce) < unigram,
             f"on-topic after a topic prompt (worst seed's topic word rate {min(on_topic):.3f} > {exp.topic_gate:g})":
                 min(on_topic) > exp.topic_gate,
             f"SAEs reconstruct (worst seed's mean FVU {max(fvu):.3f} < {exp.fvu_gate:g})": max(fvu) < exp.fvu_gate}
    m = exp.run.model
    lines = [
        "# Feature Flow: groups, deactivation and steering on a synthetic-topic corpus", "",
        f"Commit {git_commit()}; {elapsed() / 60:.1f} min on this CPU (2 cores, shared with other jobs while it ran). "
        f"Byte-level decoder ({m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads × {m.head_dim}, FFN "
        f"{m.ffn_dim}), {exp.run.train.steps} steps × {exp.run.train.batch_size} sequences of {exp.piece_len + 1} "
        f"tokens on {exp.docs} documents: a share {exp.topic_share:g} about one of {len(study.NAMES)} topics "
        f"({', '.join(study.NAMES)}; own nouns, verbs, adjectives in shared sentence frames), Shakespeare otherwise. "
        f"TopK SAEs (M = {exp.latents}, k = {exp.k}, AuxK k_aux = {exp.aux_k}) on {len(study.sae_points(m.num_layers))} "
        f"points (residual −1 … {m.num_layers - 1}, MLP and attention output per layer), {exp.sae_steps} steps × "
        f"{exp.sae_batch * (exp.piece_len + 1)} tokens, inputs scaled to E‖x‖² = D (folded back). Evaluation: "
        f"{exp.eval_per_topic} fresh documents per topic + {exp.eval_generic} validation Shakespeare pieces. Seeds "
        f"{seeds}; mean ± s.e. over seeds.", "",
        *gate_lines(gates, "A gate failed: read the tables as a record of this run only."),
        "## SAEs", "",
        markdown_table(["seed", "held-out LM CE", "mean FVU", "FVU range", "dead share (last steps)", "L0"],
                       [[s, f"{res['eval_loss']:.3f}", f"{np.mean(list(res['sae']['fvu'].values())):.3f}",
                         f"{min(res['sae']['fvu'].values()):.3f}–{max(res['sae']['fvu'].values()):.3f}",
                         f"{np.mean(list(res['sae']['dead'].values())):.3f}",
                         f"{np.mean(list(res['sae']['l0'].values())):.1f}"] for s, res in per_seed.items()]), ""]
    # groups
    counts = {}
    for r in g_rows:
        counts[r["group"]] = counts.get(r["group"], 0) + 1
    lines += ["## 1. Groups (data) against similarities (no data)", "",
              f"Residual features active on ≥ {exp.min_active} evaluation tokens, all layers and seeds: "
              + ", ".join(f"{g} {n}" for g, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ". A predecessor "
              f"joins the group when it is active on ≥ {exp.coact:g} of the feature's active tokens.", "",
              markdown_table(["seed", "module P", "features with P in group", "median s(P)", "others", "median s(P)",
                              "Mann–Whitney p (greater)"],
                             [[s, t["module"], t["n_in"], f"{t['median_in']:.3f}", t["n_out"], f"{t['median_out']:.3f}",
                               f"{t['p']:.1e}"] for s, res in per_seed.items() for t in res["tests"]]), ""]
    # deactivation
    dtab = []
    agg = {}
    for kind in KINDS:
        ch = [float(np.mean([r["change"] for r in per_seed[s]["deactivation"] if r["kind"] == kind])) for s in seeds]
        su = [float(np.mean([r["success"] for r in per_seed[s]["deactivation"] if r["kind"] == kind])) for s in seeds]
        sim = [float(np.mean([r["similarity"] for r in per_seed[s]["deactivation"] if r["kind"] == kind]))
               for s in seeds]
        agg[kind] = (ch, su)
        dtab.append([kind, pm(*mean_spread(sim)[:2]), pm(*mean_spread(ch)[:2]), pm(*mean_spread(su)[:2])])
    dch = mean_spread([a - b for a, b in zip(agg["top1"][0], agg["random_top5"][0])])
    dsu = mean_spread([a - b for a, b in zip(agg["top1"][1], agg["random_top5"][1])])
    lines += ["## 2. Deactivation (r = 0 at one predecessor, every token)", "",
              f"{exp.targets} target residual features per seed (sampled among those active on ≥ {exp.min_active} "
              "tokens); the same targets for both choices. Change = mean over the target's active tokens of "
              "1 − z_new/z_old; success = share of them where it no longer fires [inferred rule].", "",
              markdown_table(["predecessor", "mean similarity (cosine; Pearson r for pearson_top1)", "activation change",
                              "success rate"], dtab), "",
              f"Top-1 − random (paired by seed): change {pm(*dch[:2])}, success {pm(*dsu[:2])} (spec: top-1 higher; "
              "the paper: 0.75 / 65% for top-1).", ""]
    # steering
    st = steer_table(exp, per_seed, "steer", exp.strengths)
    rows = [[mode, f"{v:g}", pm(*c["behaviour"][:2]), pm(*c["coherence"][:2]), pm(*c["score"][:2]),
             pm(*c["nll"][:2])] for (mode, v), c in st.items()]
    lines += ["## 3. Steering toward a topic from \"I think \"", "",
              f"Strength s in units of the last layer's RMS residual norm (seed mean {np.mean([r['norm'] for r in per_seed.values()]):.1f}); "
              "cumulative adds s·v at every node of the topic feature's flow graph (residual chain and module "
              "predecessors), single-layer at the feature's own layer. Behaviour: share of topic words in "
              f"{exp.prompts} continuations of {exp.new_tokens} bytes (T = {exp.temperature:g}, top-p {exp.top_p:g}); "
              "coherence: (unigram − NLL) / (unigram − NLL of unsteered continuations), clipped to [0, 1]; score = "
              "behaviour × coherence, per continuation. Averaged over the four topics, then over seeds.", "",
              markdown_table(["mode", "s", "behaviour", "coherence", "score", "NLL (nats/byte)"], rows), ""]
    sp = steer_table(exp, per_seed, "suppress", exp.rs)
    rows = [[mode, f"{v:g}", pm(*c["behaviour"][:2]), pm(*c["coherence"][:2]), pm(*c["nll"][:2])]
            for (mode, v), c in sp.items()]
    lines += ["### Suppression (rescale r at the same nodes, from a topic sentence + \"I think \")", "",
              markdown_table(["mode", "r", "topic word rate", "coherence", "NLL"], rows), ""]
    # direction
    graph_sizes = [len(g["nodes"]) for res in per_seed.values() for g in res["graphs"].values()]
    depths = [g["depth"] for res in per_seed.values() for g in res["graphs"].values()]
    best = {mode: max(exp.strengths, key=lambda v: st[(mode, v)]["score"][0]) for mode in MODES}
    base_b = st[("none", 0.0)]["behaviour"][0]
    lines += ["## Direction (as measured)", "",
              f"- Groups: s(P) higher when P is in the group in "
              f"{sum(t['p'] < 1e-3 for res in per_seed.values() for t in res['tests'])} of "
              f"{sum(1 for res in per_seed.values() for _ in res['tests'])} (seed, module) tests at p < 0.001.",
              f"- Deactivation: top-1 change {pm(*mean_spread(agg['top1'][0])[:2])} vs random "
              f"{pm(*mean_spread(agg['random_top5'][0])[:2])}; success {pm(*mean_spread(agg['top1'][1])[:2])} vs "
              f"{pm(*mean_spread(agg['random_top5'][1])[:2])}; Pearson top-1 change "
              f"{pm(*mean_spread(agg['pearson_top1'][0])[:2])}, success {pm(*mean_spread(agg['pearson_top1'][1])[:2])}.",
              f"- Steering: the steered features' flow graphs have {np.mean(graph_sizes):.1f} nodes on average (min "
              f"{min(graph_sizes)}) and span {np.mean(depths):.2f} layers (1 = the chain is cut at once, so cumulative "
              "steering adds the module predecessors' directions at the same layer only). "
              f"Unsteered topic word rate {base_b:.3f}. Best score: cumulative {st[('cumulative', best['cumulative'])]['score'][0]:.3f} "
              f"at s = {best['cumulative']:g}, single-layer {st[('single', best['single'])]['score'][0]:.3f} at "
              f"s = {best['single']:g}. Behaviour at the smallest s: cumulative "
              f"{st[('cumulative', min(exp.strengths))]['behaviour'][0]:.3f}, single "
              f"{st[('single', min(exp.strengths))]['behaviour'][0]:.3f}.",
              f"- Suppression at the smallest |r − 1| (r = {max(exp.rs):g}): topic word rate cumulative "
              f"{sp[('cumulative', max(exp.rs))]['behaviour'][0]:.3f}, single {sp[('single', max(exp.rs))]['behaviour'][0]:.3f} "
              f"(unsuppressed {sp[('none', 1.0)]['behaviour'][0]:.3f}).", ""]
    samples = [f"- seed {r['seed']} {r['topic']} {r['mode']} s={r['strength']:g}: {r['sample']!r}"
               for r in s_rows if r["kind"] == "steer" and r["seed"] == seeds[0] and r["strength"] in
               (0.0, max(exp.strengths))]
    lines += ["## Samples (first continuation, first seed)", "", *samples, ""]
    write_json(os.path.join(wd, "config.json"), dict(preset=args.preset, exp=record(exp, ("run",)), gates=gates,
                                                     unigram=unigram, commit=git_commit(),
                                                     graphs={s: r["graphs"] for s, r in per_seed.items()},
                                                     times={s: r["times"] for s, r in per_seed.items()},
                                                     sae={s: r["sae"] for s, r in per_seed.items()}))
    write_atomic(os.path.join(wd, "results.md"), "\n".join(lines))
    plot(exp, per_seed, st, sp, g_rows, agg, os.path.join(wd, "feature_flow.png"))
    print("\n".join(lines))


def plot(exp, per_seed, st, sp, g_rows, agg, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    ax = axes[0]
    data, names = [], []
    for m in study.GROUP_MODULES:
        tag = m.upper()
        for inside in (True, False):
            data.append([r[f"s_{m}"] for r in g_rows if (tag in r["group"].split("+")) == inside] or [np.nan])
            names.append(f"{tag}\n{'in' if inside else 'out'}")
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names, fontsize=7)
    ax.set_ylabel("top-1 cosine s(P)")
    ax.set_title("1. s(P): P in the feature's group or not", fontsize=9)
    ax = axes[1]
    for i, (kind, (ch, su)) in enumerate(agg.items()):
        for j, (vals, lab) in enumerate(((ch, "change"), (su, "success"))):
            mu, se, _ = mean_spread(vals)
            ax.bar(j + 0.28 * i, mu, 0.26, yerr=se, capsize=3, color=f"C{i}", label=kind if j == 0 else None)
    ax.set_xticks([0.28, 1.28], ["activation change", "success rate"])
    ax.set_title("2. deactivation: top-1 vs random of top 5 vs Pearson", fontsize=9)
    ax.legend(fontsize=7)
    for ax, col, title in ((axes[2], "behaviour", "3. steering: topic word rate"),
                           (axes[3], "score", "3. steering: behaviour × coherence")):
        for mode, ls in zip(MODES, ("-", "--")):
            xs = list(exp.strengths)
            ax.errorbar(xs, [st[(mode, v)][col][0] for v in xs], yerr=[st[(mode, v)][col][1] for v in xs],
                        marker="o", ls=ls, capsize=3, label=mode)
        ax.axhline(st[("none", 0.0)][col][0], color="gray", lw=1, ls=":", label="unsteered")
        ax.set_xscale("log")
        ax.set_xlabel("s (× RMS residual norm)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main() and 0)
