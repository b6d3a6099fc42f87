"""ECON at tiny scale (Yi et al., ICML 2025; docs/methods/econ.md): belief networks choose each
executor's sampling parameters, a coordinator LM commits to one answer; compared with majority
vote over the same number of executor samples.

  python -m experiments.econ --workdir=DIR [--preset=tiny|default]

Setup (spec section 6): 3 executor LMs and a coordinator LM, byte-level decoders trained briefly
(``experiments/econ/lms.py``) on one-step 2-digit arithmetic ``"23+45=68"`` from
``icml_jax.data.arithmetic``; held-out problems split into the harness's training questions and
the evaluation questions. Per harness seed: ``epochs`` passes over the training questions in
rounds of ``batch`` questions (``icml_jax.analysis.econ.run_round``: actions, one sample per
executor, commitment, reward, ``updates`` steps), then evaluation with 3 executor samples per
question in every arm:

  majority (T=1, p=1)     majority vote over plain samples (the baseline)
  coordinator (T=1, p=1)  the coordinator's commitment over the same plain samples (control)
  majority (ECON T, p)    majority vote over the trained belief networks' samples (control)
  ECON                    the commitment over the trained belief networks' samples
  ECON untrained          the commitment over samples at the initial belief networks' actions

plus per-sample accuracy and pass@3 (any sample right) of the plain samples. Gate (pilot): every
executor is sometimes right and sometimes wrong (plain-sample accuracy in (gate_lo, gate_hi)).
Outputs: DIR/results.csv (one row per arm and seed), DIR/results.md, DIR/econ.png,
DIR/config.json, DIR/lms/ (cached LM runs).
"""
import os
import sys

import numpy as np

from experiments.common import (gate_lines, git_commit, markdown_table, mean_spread, pm, preset, record,
                                save_figure, start, write_atomic, write_csv, write_json)

_LM = dict(model=dict(d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, ffn_dim=128),
           data=dict(seq_len=32), train=dict(batch_size=32, lr=3e-3, warmup_steps=20, log_every=100,
                                             eval_batches=1))
_HARNESS = dict(obs_len=16, hidden_dim=32, belief_dim=32, heads=4, layers=2, mixing_dim=32, feature_dim=64,
                hyper_hidden=64)
PRESETS = {
    "tiny": preset(data_seed=0, knobs=dict(num_steps=1, digits=2, operators="+-"), train_problems=64,
                   test_problems=8, harness_questions=4, n_agents=3, executor_steps=0, coordinator_steps=0,
                   lm=dict(model=dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                                      ffn_dim=64),
                           data=dict(seq_len=32), train=dict(batch_size=4, lr=3e-3, warmup_steps=1, log_every=2,
                                                             eval_batches=1)),
                   harness=dict(obs_len=16, hidden_dim=8, belief_dim=8, heads=2, layers=1, mixing_dim=4,
                                feature_dim=8, hyper_hidden=8, lr=1e-2),
                   seeds=(0,), epochs=1, batch=4, updates=2, max_new=4, gate_lo=0.05, gate_hi=0.95),
    "default": preset(data_seed=0, knobs=dict(num_steps=1, digits=2, operators="+-"), train_problems=3000,
                      test_problems=400, harness_questions=200, n_agents=3, executor_steps=1000,
                      coordinator_steps=1500, lm=_LM, harness=_HARNESS, seeds=(0, 1, 2), epochs=3, batch=50,
                      updates=25, max_new=4, gate_lo=0.05, gate_hi=0.95),
}
ARMS = ("majority (T=1, p=1)", "coordinator (T=1, p=1)", "majority (ECON T, p)", "ECON", "ECON untrained")
FIELDS = ("seed", "arm", "accuracy", "mean_T", "mean_p")


def log(*m):
    print("[econ]", *m, flush=True)


def evaluate(exp, harness, params, params0, executors, coord, tok, prompts, truths, key):
    """Accuracy of every arm on the evaluation questions with ``params`` as the belief networks
    (``params0``: the untrained ones, for the arm ECON untrained)."""
    import jax
    import jax.numpy as jnp

    from experiments.econ import lms
    from icml_jax.analysis import econ as E
    obs = jnp.asarray(E.encode_obs(tok, prompts, harness.cfg.obs_len, harness.cfg.n_agents))

    def actions(p):
        out = harness.act(p, obs)
        return np.stack([np.asarray(out["temperature"]), np.asarray(out["top_p"])], -1)
    acts, acts0 = actions(params), actions(params0)
    s_plain = E.sample_team(executors, tok, prompts, np.ones_like(acts), jax.random.fold_in(key, 0), exp.max_new,
                            lms.parse)
    s_econ = E.sample_team(executors, tok, prompts, acts, jax.random.fold_in(key, 1), exp.max_new, lms.parse)
    s_econ0 = E.sample_team(executors, tok, prompts, acts0, jax.random.fold_in(key, 1), exp.max_new, lms.parse)
    acc = lambda picks: float(np.mean([p is not None and p == t for p, t in zip(picks, truths)]))  # noqa: E731
    res = {"majority (T=1, p=1)": acc([E.majority_vote(a) for a in s_plain]),
           "coordinator (T=1, p=1)": acc(E.commit(coord, prompts, s_plain)),
           "majority (ECON T, p)": acc([E.majority_vote(a) for a in s_econ]),
           "ECON": acc(E.commit(coord, prompts, s_econ)),
           "ECON untrained": acc(E.commit(coord, prompts, s_econ0))}
    per_exec = [float(np.mean([a[i] == t for a, t in zip(s_plain, truths)])) for i in range(len(executors))]
    extra = dict(per_executor=per_exec, pass_at_n=float(np.mean([t in a for a, t in zip(s_plain, truths)])),
                 mean_T=float(acts[..., 0].mean()), mean_p=float(acts[..., 1].mean()),
                 mean_T0=float(acts0[..., 0].mean()), mean_p0=float(acts0[..., 1].mean()))
    return res, extra


def run(args, exp, elapsed):
    import jax

    from experiments.econ import lms
    from icml_jax.analysis import econ as E
    from icml_jax.data.tokenizers import ByteTokenizer
    tok = ByteTokenizer()
    wd = args.workdir
    train, test = lms.problems(exp)
    h_q, ev_q = test[:exp.harness_questions], test[exp.harness_questions:]
    if not ev_q:
        sys.exit(f"experiments/econ: preset {args.preset!r} has test_problems={exp.test_problems} <= "
                 f"harness_questions={exp.harness_questions}; no evaluation questions are left")
    trained = lms.train_lms(exp, wd, train)
    executors = [(cfg.model, params) for name, cfg, params, _ in trained if name.startswith("executor")]
    _, ccfg, cparams, _ = trained[-1]
    length = 16
    coord = E.FrozenLM(ccfg.model, cparams, tok, length)
    hcfg = E.EconConfig(n_agents=exp.n_agents, **exp.harness.to_dict())
    ev_prompts, ev_truths = [lms.prompt(p) for p in ev_q], [p.answer for p in ev_q]
    rows, curves, extras = [], {}, {}
    for seed in exp.seeds:
        key = jax.random.key(1000 + seed)
        harness = E.Harness(hcfg, tok.vocab_size, commit_dim=ccfg.model.d_model, pad_id=tok.pad_id, seed=seed)
        params0 = harness.state["params"]
        curve, rng = [], np.random.default_rng(seed)
        for epoch in range(exp.epochs):
            order = rng.permutation(len(h_q))
            for r, lo in enumerate(range(0, len(order) - exp.batch + 1, exp.batch)):
                qs = [h_q[i] for i in order[lo:lo + exp.batch]]
                res = E.run_round(harness, executors, coord, coord, tok, [lms.prompt(q) for q in qs],
                                  [q.answer for q in qs], lms.parse, jax.random.fold_in(key, 10_000 + 100 * epoch + r),
                                  max_new=exp.max_new, updates=exp.updates)
                for m in res["metrics"]:
                    curve.append(dict(m, reward=float(np.mean([x["reward"] for x in res["rewards"]])),
                                      ts=float(np.mean([x["ts"] for x in res["rewards"]]))))
        log(f"seed {seed}: {len(curve)} updates; mix loss {curve[0]['mix_loss']:.3f} -> {curve[-1]['mix_loss']:.3f}, "
            f"belief loss {curve[0]['belief_loss']:.3f} -> {curve[-1]['belief_loss']:.3f} ({elapsed() / 60:.1f} min)")
        accs, extra = evaluate(exp, harness, harness.state["params"], params0, executors, coord, tok, ev_prompts,
                               ev_truths, jax.random.fold_in(key, 1))
        for arm in ARMS:
            tp = ((1.0, 1.0) if "T=1" in arm else (extra["mean_T0"], extra["mean_p0"]) if arm == "ECON untrained"
                  else (extra["mean_T"], extra["mean_p"]))
            rows.append(dict(seed=seed, arm=arm, accuracy=accs[arm], mean_T=tp[0], mean_p=tp[1]))
        curves[seed], extras[seed] = curve, extra
        log(f"seed {seed}: " + ", ".join(f"{a} {accs[a]:.3f}" for a in ARMS))
    per_exec = np.mean([extras[s]["per_executor"] for s in exp.seeds], axis=0)
    gates = {f"every executor sometimes right and sometimes wrong (plain-sample accuracy "
             f"{', '.join(f'{a:.3f}' for a in per_exec)} in ({exp.gate_lo}, {exp.gate_hi}))":
                 bool(np.all((per_exec > exp.gate_lo) & (per_exec < exp.gate_hi)))}
    meta = dict(preset=args.preset, commit=git_commit(), minutes=elapsed() / 60, lms={n: i for n, _, _, i in trained},
                per_executor=per_exec.tolist(), pass_at_n=float(np.mean([extras[s]["pass_at_n"] for s in exp.seeds])),
                eval_questions=len(ev_q), harness_questions=len(h_q),
                first_last={str(s): dict(first=curves[s][0], last=curves[s][-1]) for s in exp.seeds})
    write_csv(os.path.join(wd, "results.csv"), rows, FIELDS)
    write_json(os.path.join(wd, "config.json"), dict(exp=record(exp, ("lm",)), meta=meta, gates=gates))
    write_atomic(os.path.join(wd, "results.md"), report(exp, rows, curves, gates, meta))
    plot(exp, rows, curves, os.path.join(wd, "econ.png"))
    print(open(os.path.join(wd, "results.md")).read())
    return rows, curves, gates


def _arm_stats(rows, arm):
    return mean_spread([r["accuracy"] for r in rows if r["arm"] == arm])


def report(exp, rows, curves, gates, meta) -> str:
    n = len(exp.seeds)
    lines = ["# ECON vs majority vote at equal sampling budget (tiny LMs, arithmetic)", "",
             f"Preset `{meta['preset']}`, commit `{meta['commit']}`, {meta['minutes']:.1f} min. "
             f"{exp.n_agents} executors, one sample each per question (both ECON and majority vote use "
             f"{exp.n_agents} executor samples; ECON also runs the coordinator's scoring pass). "
             f"{meta['eval_questions']} evaluation questions, {meta['harness_questions']} harness-training "
             f"questions, {n} harness seed(s); mean ± standard error over seeds.", ""]
    lines += gate_lines(gates, "The pilot gate failed: the comparison below is not meaningful.")
    table = []
    for arm in ARMS:
        m, se, _ = _arm_stats(rows, arm)
        ts = [r for r in rows if r["arm"] == arm]
        table.append((arm, pm(m, se), f"{np.mean([r['mean_T'] for r in ts]):.3f}",
                      f"{np.mean([r['mean_p'] for r in ts]):.3f}"))
    lines += [markdown_table(("arm", "accuracy", "mean T", "mean top-p"), table), ""]
    pe = ", ".join(f"{a:.3f}" for a in meta["per_executor"])
    lines += [f"Plain samples (T = 1, p = 1): per-executor accuracy {pe}; pass@{exp.n_agents} "
              f"{meta['pass_at_n']:.3f} (bounds every selector over those samples).", ""]
    lines += ["## Training signals (first → last update, per seed)", ""]
    keys = ("mix_loss", "td_loss", "sd_loss", "q_align_loss", "belief_loss", "encoder_loss", "reward")
    lines += [markdown_table(("seed",) + keys, [
        (s,) + tuple(f"{c[0][k]:.3f} → {c[-1][k]:.3f}" for k in keys) for s, c in curves.items()]), ""]
    def diff(a, b):
        da = {r["seed"]: r["accuracy"] for r in rows if r["arm"] == a}
        db = {r["seed"]: r["accuracy"] for r in rows if r["arm"] == b}
        d, se, _ = mean_spread([da[s] - db[s] for s in da])
        res = "beyond 2 s.e." if n > 1 and abs(d) > 2 * se else "within 2 s.e. (not resolved)"
        return f"{pm(d, se)} ({res})"
    d_main = np.mean([r["accuracy"] for r in rows if r["arm"] == "ECON"]) - \
        np.mean([r["accuracy"] for r in rows if r["arm"] == "majority (T=1, p=1)"])
    verdict = "in the paper's direction (ECON ≥ majority vote)" if d_main >= 0 else \
        "not in the paper's direction (ECON < majority vote)"
    lines += ["## Reading (paired differences over seeds)", "",
              f"* ECON − majority vote (T = 1, p = 1): {diff('ECON', 'majority (T=1, p=1)')}, {verdict}.",
              f"* Where it comes from. Sampling parameters: majority (ECON T, p) − majority (T = 1, p = 1) = "
              f"{diff('majority (ECON T, p)', 'majority (T=1, p=1)')}. The coordinator's commitment instead of "
              f"the vote: at plain samples {diff('coordinator (T=1, p=1)', 'majority (T=1, p=1)')}, at ECON's "
              f"samples {diff('ECON', 'majority (ECON T, p)')}. Training the harness: ECON − ECON untrained = "
              f"{diff('ECON', 'ECON untrained')}.",
              "* The belief networks' temperature / top-p heads receive no gradient from any of the "
              "reference's three losses (Q_tot does not depend on the actions; the actions reach only "
              "the consistency term, whose gradient is kept for the mixer alone), so the actions move "
              "only through the shared belief features. Their range (top-p ≤ 0.9, about 0.5 at "
              "initialisation) already makes sampling close to greedy, which is what a majority vote "
              "over 3 weak samples lacks.",
              f"* One evaluation question is {1 / meta['eval_questions']:.3f} of accuracy.", "",
              "Plot: `econ.png` (accuracy by arm; the mixer and belief losses over updates)."]
    return "\n".join(lines) + "\n"


def plot(exp, rows, curves, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    stats = [_arm_stats(rows, arm) for arm in ARMS]
    a1.bar(range(len(ARMS)), [s[0] for s in stats], yerr=[s[1] for s in stats], capsize=4,
           color=["#999", "#bbb", "#6a9", "#2a7", "#9cb"])
    a1.set_xticks(range(len(ARMS)))
    a1.set_xticklabels([a.replace(" (", "\n(") for a in ARMS], fontsize=7)
    a1.set_ylabel("accuracy")
    a1.set_title(f"{exp.n_agents} executor samples per question")
    for s, c in curves.items():
        a2.plot([m["mix_loss"] for m in c], color="C0", alpha=0.7, label="mixer loss" if s == exp.seeds[0] else None)
        a2.plot([m["belief_loss"] for m in c], color="C1", alpha=0.7,
                label="belief loss" if s == exp.seeds[0] else None)
    a2.set_yscale("log")
    a2.set_xlabel("update")
    a2.legend()
    a2.set_title("training signals (one line per seed)")
    fig.tight_layout()
    save_figure(fig, path)


def main(argv=None):
    args, exp, elapsed = start(__doc__, PRESETS, argv)
    return run(args, exp, elapsed)


if __name__ == "__main__":
    main()
