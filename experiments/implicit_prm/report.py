"""The implicit PRM experiment's report: the best-of-N and first-error tables aggregated from the
cached scores, config.json's ``info``, results.csv rows, results.md (with the ``reading``
statements) and the two plots."""
import os

import numpy as np

from experiments.common import (git_commit, markdown_table, mean_spread, pm, save_figure,
                                write_atomic, write_csv)
from experiments.implicit_prm.presets import ACCURACY_GATE
from experiments.implicit_prm.stages import STEP_PRM

# ----------------------------------------------------------------------------- aggregation

def _schedule(run_config: dict) -> str:
    """A trained run's schedule as results.md states it, from its stored config."""
    t = run_config["train"]
    return f"{t['steps']} steps × {t['batch_size']}, lr {t['lr']:g}"


# (host-side, from the cached scores: recomputed on every run, in seconds)
def selector_scores(q_raw, M, kappa):
    """Per-response scores [B] of every PRM selector from the raw prefix sums [B, K]."""
    from icml_jax.losses import implicit_prm as ip
    q = kappa * np.asarray(q_raw, np.float64)
    r = np.asarray(ip.step_rewards(q, M))
    has = M.sum(1) > 0
    low = -1e30

    def agg(s, how):
        return np.where(has, np.asarray(ip.aggregate(s, M, how), np.float64), low)
    return {"min r_k": agg(r, "min"), "min q_k": agg(q, "min"), "sum q_k": agg(q, "sum"),
            "q_K = sum r_k (outcome only)": agg(q, "last")}


def step_selector_scores(logit, M):
    """Per-response scores [B] of the step-label PRM from its per-step logits [B, K] (sigma(logit)
    = p_k, the probability that step k is correct): ``min p_k`` (the weakest step, as the implicit
    PRM's min r_k) and ``prod p_k`` (every step correct, Lightman et al.'s aggregation)."""
    lg, m = np.asarray(logit, np.float64), np.asarray(M) > 0
    has = m.sum(1) > 0
    log_p = -np.logaddexp(0.0, -lg)  # log sigma(logit), stable
    mn = np.where(m, lg, np.inf).min(1)  # sigma is monotone: the min logit is the min p_k
    return {"min p_k": np.where(has, mn, -1e30),
            "prod p_k": np.where(has, (log_p * m).sum(1), -1e30)}


def bon_over_orders(scores_GN, values_GN, ns, perms):
    """Per n, the mean of ``values_GN`` (e.g. correctness, or length) at the top-scored of each
    problem's first n responses (``prm_eval.best_of_n_picks``), averaged over the orders."""
    from icml_jax.analysis import prm_eval
    v = np.asarray(values_GN, np.float64)
    rows = np.arange(len(v))
    out = {int(n): [] for n in ns}
    for perm in perms:
        for n, pick in prm_eval.best_of_n_picks(scores_GN[:, perm], ns).items():
            out[n].append(v[:, perm][rows, pick].mean())
    return {n: float(np.mean(x)) for n, x in out.items()}


def wmv_over_orders(answers_GN, scores_GN, ref_G, ns, perms, sigmoid=True):
    from icml_jax.analysis import prm_eval
    out = {int(n): [] for n in ns}
    for perm in perms:
        a = [[row[j] for j in perm] for row in answers_GN]
        res = prm_eval.weighted_majority(a, scores_GN[:, perm], ref_G, ns, sigmoid=sigmoid)
        for n in ns:
            out[int(n)].append(res[int(n)])
    return {n: float(np.mean(v)) for n, v in out.items()}


def ranking_diagnostics(scores_GN, correct_GN, answers_GN):
    """How a scorer ranks, beside what best-of-N makes of it: ``auc``, the mean over problems
    with right and wrong samples of P(a right sample outscores a wrong one) (ties 1/2; 0.5 =
    no ranking), and ``rare_pick``, the share of problems whose top-scored of all N samples
    gives an answer no other sample gives (a scorer drawn to rare, off-distribution samples)."""
    s, c = np.asarray(scores_GN, np.float64), np.asarray(correct_GN, bool)
    aucs, rare = [], []
    for i in range(len(s)):
        right, wrong = s[i][c[i]], s[i][~c[i]]
        if len(right) and len(wrong):
            d = right[:, None] - wrong[None, :]
            aucs.append(float(np.mean((d > 0) + 0.5 * (d == 0))))
        top = answers_GN[i][int(np.argmax(s[i]))]
        rare.append(sum(a == top for a in answers_GN[i]) <= 1)
    return {"auc": float(np.mean(aucs)) if aucs else float("nan"),
            "rare_pick": float(np.mean(rare))}


def best_of_n_table(exp, test, ev, prm_scores, ref_sum, step_scores=(), lengths=None):
    """({selector: {n: accuracy}}, {selector: {n: mean length in bytes of the selected
    response}}, {selector: ``ranking_diagnostics``}) (the selectors of the module docstring;
    lengths and diagnostics for the selectors that pick one response; lengths when ``lengths``
    [G * N] is given)."""
    G, N = len(ev), int(exp["eval_samples"])
    ns = [int(n) for n in exp["ns"] if n <= N]
    rng = np.random.default_rng(int(exp["seed"]) + 7)
    perms = [np.arange(N)] + [rng.permutation(N) for _ in range(int(exp["orders"]) - 1)]
    correct = np.array([e["correct"] for e in ev], bool)
    answers = [e["answers"] for e in ev]
    ref = [p.answer for p in test]
    L = None if lengths is None else np.asarray(lengths, np.float64).reshape(G, N)
    table, lens, diag = {}, {}, {}

    def pick(name, scores):
        table[name] = bon_over_orders(scores, correct, ns, perms)
        diag[name] = ranking_diagnostics(scores, correct, answers)
        if L is not None:
            lens[name] = bon_over_orders(scores, L, ns, perms)
    table["random pick"] = {n: float(np.mean([correct[:, perm[:n]].mean() for perm in perms]))
                            for n in ns}
    if L is not None:  # the expected length of a uniform pick
        lens["random pick"] = {n: float(np.mean([L[:, perm[:n]].mean() for perm in perms]))
                               for n in ns}
    table["pass@n (oracle)"] = {n: float(np.mean([correct[:, perm[:n]].any(1).mean()
                                                  for perm in perms])) for n in ns}
    table["majority vote"] = wmv_over_orders(answers, np.ones((G, N)), ref, ns, perms, sigmoid=False)
    pick("generator log-prob", ref_sum.reshape(G, N))
    beta = float(exp["beta"])
    for name, q_raw, M in prm_scores:
        for sel, s in selector_scores(q_raw, M, 1.0).items():
            pick(f"{name}: {sel}", s.reshape(G, N))
        for kappa, lab in ((beta, "β"), (0.001, "0.001")):
            s = selector_scores(q_raw, M, kappa)["min r_k"].reshape(G, N)
            table[f"{name}: weighted MV σ({lab}·min r_k)"] = wmv_over_orders(
                answers, s, ref, ns, perms)
    for name, logit, M in step_scores:
        for sel, s in step_selector_scores(logit, M).items():
            pick(f"{name}: {sel}", s.reshape(G, N))
    return table, lens, diag


def first_error_table(exp, ev, prm_scores, step_scores=()):
    """{prm: {tau, f1, acc_erroneous, acc_correct, tune_f1}} (τ on even problems, F1 on odd). The
    implicit PRMs' step value is sigma(beta * q_k), the step-label PRM's its p_k."""
    from icml_jax.analysis import prm_eval
    G, N = len(ev), int(exp["eval_samples"])
    true = np.array([e["first_error"] for e in ev]).reshape(-1)
    prob = np.repeat(np.arange(G), N)
    tune, test = prob % 2 == 0, prob % 2 == 1
    grid = np.linspace(0.0, 1.0, 1001)
    out = {}
    scaled = [(n, float(exp["beta"]) * np.asarray(q, np.float64), M) for n, q, M in prm_scores]
    for name, q, M in scaled + [(n, np.asarray(lg, np.float64), M) for n, lg, M in step_scores]:
        tau, tuned = prm_eval.choose_threshold(q[tune], M[tune], true[tune], grid)
        res = prm_eval.first_error_scores(prm_eval.predict_first_error(q[test], M[test], tau), true[test])
        if res["acc_erroneous"] != res["acc_erroneous"] or res["acc_correct"] != res["acc_correct"]:
            res["f1"] = float("nan")  # one subset is empty: the harmonic mean is undefined
        out[name] = {"tau": tau, "tune_f1": tuned["f1"], **res}
    out["_counts"] = {"test_erroneous": int((true[test] > 0).sum()),
                      "test_error_free": int((true[test] == 0).sum())}
    return out


# ----------------------------------------------------------------------------- outputs

def run_info(gen_dir, gen, labels, n_pairs, ev, prm_info, prm_cfgs, seq_len, paths, nbytes):
    """config.json's ``info``: the generator, the sample accuracies, the mean length in bytes of
    the right and the wrong eval samples (``nbytes``: per eval sample), the PRMs and their
    configs."""
    right = np.array([c for e in ev for c in e["correct"]], bool)
    mean = lambda x: float(x.mean()) if len(x) else float("nan")
    return {"generator": {"eval_loss": gen["eval"].get("eval_loss", float("nan")),
                          "seconds": gen["train_seconds"], "steps_total": gen["steps_total"],
                          "workdir": gen_dir},
            "train_accuracy": float(np.mean(labels)), "n_pairs": n_pairs,
            "eval_accuracy": float(np.mean([e["correct"] for e in ev])),
            "eval_all_steps_correct": float(np.mean([e["all_steps_correct"] for e in ev])),
            "length": {"correct": mean(nbytes[right]), "wrong": mean(nbytes[~right])},
            "prm": prm_info, "prm_configs": prm_cfgs, "seq_len": seq_len, "paths": paths}


def _fmt(x):
    return "—" if x is None or x != x else f"{x:.3f}"


# ----------------------------------------------------------------------------- over seeds

def per_seed(runs, field):
    """{selector: {n: [value per seed]}} of ``field`` ("table", "lengths") of the seeds' runs;
    ``first_error``: {prm: {metric: [value per seed]}}."""
    out = {}
    for r in runs.values():
        for sel, res in r[field].items():
            if sel.startswith("_"):
                continue
            for k, v in res.items():
                out.setdefault(sel, {}).setdefault(k, []).append(float(v))
    return out


def means(stacked):
    """``per_seed``'s lists -> their means (NaN-free where any seed has a value)."""
    return {s: {k: mean_spread(v)[0] for k, v in res.items()} for s, res in stacked.items()}


def cell(xs, nd=3):
    """One value as is; several as ``mean ± s.e.`` over the seeds."""
    if len(xs) == 1:
        return "—" if xs[0] != xs[0] else f"{xs[0]:.{nd}f}"
    m, se, n = mean_spread(xs, "se")
    return "—" if not n else pm(m, se, nd)


def gate_passes(acc):
    lo, hi = ACCURACY_GATE
    return lo <= acc <= hi


def info_acc(run):
    """The gate's number: the generator's per-sample accuracy on the held-out problems."""
    return run["info"]["eval_accuracy"]


def reading(exp, runs, prm_names):
    """The reading's bullet points over the seeds (each verdict over the seeds that pass the gate)."""
    lo, hi = ACCURACY_GATE
    seeds = list(runs)
    accs = {s: info_acc(r) for s, r in runs.items()}
    ok = [s for s in seeds if gate_passes(accs[s])]
    ns = sorted(runs[seeds[0]]["table"]["random pick"])
    big = [n for n in ns if n >= 8] or [ns[-1]]
    G = int(exp["test_problems"])
    if len(seeds) == 1:
        acc = accs[seeds[0]]
        lines = [f"* **Gate.** The generator's per-sample accuracy on the held-out problems is "
                 f"{acc:.3f}: " + (f"inside [{lo:.2f}, {hi:.2f}], so best-of-N has right and wrong "
                                   "samples to choose between." if ok else
                                   f"outside [{lo:.2f}, {hi:.2f}]: the gate fails, so the selector "
                                   "comparison below has little to pick from " +
                                   ("(almost every sample is wrong)" if acc < lo else
                                    "(most samples are right)") +
                                   " and does not test the paper's claim.")]
    else:
        lines = ["* **Gate.** The generator's per-sample accuracy on the held-out problems, per "
                 "seed: " + ", ".join(f"seed {s} {accs[s]:.3f}" for s in seeds) +
                 f"; the window is [{lo:.2f}, {hi:.2f}]. " +
                 (f"{'All' if len(ok) == len(seeds) else 'Seeds ' + str(ok)} pass, so the "
                  "verdicts below are over " + (f"the {len(ok)} seeds" if len(ok) > 1 else
                                                 f"seed {ok[0]}") +
                  " that pass (the tables hold every seed)." if ok else
                  "No seed passes: the selector comparison below does not test the paper's claim.")]
    use = ok or seeds

    def at_big(r, sel):
        return float(np.mean([r["table"][sel][n] for n in big])) if sel in r["table"] else np.nan

    def diff(sel, other):
        """(mean, s.e., n) over the used seeds of the per-seed difference at N >= 8."""
        return mean_spread([at_big(runs[s], sel) - at_big(runs[s], other) for s in use])

    def noise(p_):  # one seed: the binomial s.e. of a difference of two selectors on G problems
        p_ = min(max(p_, 1.0 / (2 * G)), 1 - 1.0 / (2 * G))
        return float(np.sqrt(2 * p_ * (1 - p_) / G))

    implicit = [n for n in prm_names if n != STEP_PRM]
    step_sel = f"{STEP_PRM}: min p_k"
    for name in implicit:
        mn_sel = f"{name}: min r_k"
        mn = mean_spread([at_big(runs[s], mn_sel) for s in use])[0]
        parts, beats = [], []
        for label, other in (("random", "random pick"), ("majority vote", "majority vote"),
                             ("outcome-only", f"{name}: q_K = sum r_k (outcome only)")):
            d, se, n = diff(mn_sel, other)
            se = se if n > 1 else noise(mn)
            parts.append(f"{label} {d:+.3f} ± {se:.3f}")
            if d > 2 * se:
                beats.append(label)
        gap = ""
        if any(step_sel in runs[s]["table"] for s in use):
            d, se, n = diff(step_sel, mn_sel)
            gap = (f" Step-label PRM (min p_k) minus it: {d:+.3f} ± "
                   f"{se if n > 1 else noise(mn):.3f}.")
        verdict = ("shows" if len(beats) == 3 else
                   f"partly shows (beats {', '.join(beats)} by > 2 s.e.)" if beats else
                   "does not show")
        lines.append(f"* **{name}** at N ∈ {big} (mean over N): min r_k {mn:.3f}; its difference "
                     f"from {', '.join(parts)} (± {'s.e. over seeds' if len(use) > 1 else '~1 s.e. of a difference on ' + str(G) + ' problems'}). "
                     f"The paper's direction (min-step implicit PRM beats random, majority vote "
                     f"and outcome-only) {verdict} here.{gap}")
    best = max(implicit, key=lambda n: np.mean([at_big(runs[s], f"{n}: min r_k") for s in use]))
    if "DPO" in implicit:
        lines.append(f"* Best implicit PRM by min r_k at N ≥ 8: **{best}** (paper: DPO best "
                     "overall).")
    if any(step_sel in runs[s]["table"] for s in use):
        d, se, n = diff(step_sel, f"{best}: min r_k")
        auc = mean_spread([runs[s]["ranking"][step_sel]["auc"] for s in use])[0]
        auc_b = mean_spread([runs[s]["ranking"][f"{best}: min r_k"]["auc"] for s in use])[0]
        bound = d > 0 and auc >= auc_b
        lines.append(f"* **Step-label PRM (the supervised upper bound).** At N ≥ 8 it is "
                     f"{d:+.3f} against {best} (min r_k); within-problem AUC {auc:.3f} vs "
                     f"{auc_b:.3f}. " + ("It acts as the upper bound here." if bound else
                                         "It does **not** act as an upper bound here: trained on "
                                         "the same responses with their step labels (TRL's recipe, "
                                         "a fresh two-class head), it learned less than the "
                                         "implicit PRMs (a likely reason, not tested: their "
                                         "scores reuse the generator's token predictions)."))
    fe = per_seed(runs, "first_error")
    counts = [r["first_error"]["_counts"] for r in runs.values()]
    if any(c["test_error_free"] == 0 or c["test_erroneous"] == 0 for c in counts):
        lines.append("* First-error F1 is **undefined** for a seed whose held-out half has no "
                     "erroneous or no error-free responses (one of the two accuracies has no "
                     "data); see the table.")
    lines.append("* First-error F1 (held-out half): " + ", ".join(
        f"{n} {cell(fe[n]['f1'])}" for n in prm_names if n in fe) +
        ". Always predicting \"no error\" scores F1 0; no implicit PRM ever saw a step label"
        + (" (the step-label PRM did: the upper bound)." if STEP_PRM in fe else "."))
    lens = per_seed(runs, "lengths")
    if lens:
        n_max = ns[-1]
        lc = [r["info"]["length"]["correct"] for r in runs.values()]
        lw = [r["info"]["length"]["wrong"] for r in runs.values()]
        sels = ["random pick"] + [f"{n}: min r_k" for n in implicit] + (
            [step_sel] if step_sel in lens else [])
        lines.append(f"* Length: correct samples average {cell(lc, 1)} bytes, wrong ones "
                     f"{cell(lw, 1)}; at N = {n_max} the selected response averages " + ", ".join(
                         f"{s} {cell(lens[s][n_max], 1)}" for s in sels) + " bytes (a selector "
                     "that prefers short or long responses shows here).")
    rk = per_seed(runs, "ranking")
    if rk:
        sels = ["generator log-prob"] + [f"{n}: min r_k" for n in implicit] + (
            [step_sel] if step_sel in rk else [])
        lines.append("* Ranking (within-problem AUC; rare top pick): " + ", ".join(
            f"{s} {cell(rk[s]['auc'])}; {cell(rk[s]['rare_pick'])}" for s in sels if s in rk) +
            ". An AUC above 0.5 with best-of-N below random at large N means the scorer ranks "
            "right above wrong on average but its very top is a rare wrong sample.")
    tabs = per_seed(runs, "table")
    lines.append(f"* Random pick at N = 1 (the first sample of each order): "
                 f"{cell(tabs['random pick'][ns[0]])}; pass@{ns[-1]} = "
                 f"{cell(tabs['pass@n (oracle)'][ns[-1]])} bounds every selector.")
    lines.append(f"* Sampling noise: {G} test problems per seed, so one problem is {1 / G:.3f} of "
                 f"accuracy; " + ("the ± are standard errors over the seeds (each seed: its own "
                                  "problems, generator, samples and PRMs)." if len(seeds) > 1 else
                                  f"differences below ~2 s.e. (≈ {2 * 0.5 / np.sqrt(G):.2f} at 50% "
                                  "accuracy, less for paired comparisons on the same samples) are "
                                  "not resolved."))
    return lines


def plot_bon(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tabs = per_seed(runs, "table")
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    base = {"random pick": ("k", "--"), "pass@n (oracle)": ("gray", ":"),
            "majority vote": ("tab:brown", "-."), "generator log-prob": ("tab:olive", "--")}
    kinds = {"min r_k": "-", "q_K = sum r_k (outcome only)": "--", "weighted MV σ(β·min r_k)": ":",
             "min p_k": "-"}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan"]
    prms = list(dict.fromkeys(s.split(": ")[0] for s in tabs if ": " in s))
    for sel, res in tabs.items():
        if ": " in sel:
            prm, kind = sel.split(": ", 1)
            if kind not in kinds:
                continue
            c, ls = palette[prms.index(prm) % len(palette)], kinds[kind]
        else:
            c, ls = base.get(sel, ("k", "-"))
        ns = sorted(res)
        stats = [mean_spread(res[n]) for n in ns]
        ax.errorbar(ns, [m for m, _, _ in stats], yerr=[e for _, e, _ in stats], color=c, ls=ls,
                    marker="o", ms=3, capsize=2 if len(runs) > 1 else 0, label=sel)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (responses per problem)")
    ax.set_ylabel("accuracy of the selected response")
    ax.set_title("Best-of-N on held-out problems" + (
        f" (mean ± s.e. over {len(runs)} seeds)" if len(runs) > 1 else ""))
    ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_f1(runs, prm_names, ce_ms, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fe = per_seed(runs, "first_error")
    st = {n: {k: mean_spread(fe[n][k]) for k in fe[n]} for n in fe}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = [n for n in prm_names if n in st]
    axes[0].bar(range(len(names)), [st[n]["f1"][0] for n in names],
                yerr=[st[n]["f1"][1] for n in names], color="tab:blue", capsize=3)
    axes[0].set_xticks(range(len(names)), names, fontsize=7)
    axes[0].set_ylabel("first-error F1 (held-out half)")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("ProcessBench rule" + (f" (± s.e., {len(runs)} seeds)" if len(runs) > 1
                                             else ""))
    ce = [f"CE M={m}" for m in ce_ms]
    for k, mk, ls, lab in (("f1", "o", "-", "F1"), ("acc_erroneous", "s", "--", "acc (erroneous)"),
                           ("acc_correct", "^", ":", "acc (error-free)")):
        axes[1].errorbar(list(ce_ms), [st[n][k][0] for n in ce], yerr=[st[n][k][1] for n in ce],
                         marker=mk, ls=ls, capsize=2, label=lab)
    axes[1].set_xlabel("responses per training problem (CE)")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    axes[1].set_title("CE PRM vs responses per problem")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


CSV_FIELDS = ("kind", "selector", "n", "seed", "value")


def csv_rows(runs, prm_names):
    rows = []
    for seed, r in runs.items():
        for kind in ("table", "lengths", "ranking"):
            rows += [{"kind": {"table": "best_of_n", "lengths": "selected_length",
                               "ranking": "ranking"}[kind],
                      "selector": sel, "n": n, "seed": seed, "value": round(v, 5)}
                     for sel, res in r[kind].items() for n, v in sorted(res.items())]
        for name in prm_names:
            for k in ("f1", "acc_erroneous", "acc_correct", "tau", "tune_f1"):
                rows.append({"kind": "first_error", "selector": name, "n": k, "seed": seed,
                             "value": round(float(r["first_error"][name][k]), 5)})
    return rows


def write_outputs(workdir, exp, preset, argv, runs, seconds):
    """results.csv, results.md and the two plots (``exp``: the preset's ConfigDict; ``runs``:
    seed -> ``__main__.run``'s result)."""
    seeds = list(runs)
    first = runs[seeds[0]]
    prm_names = first["prm_names"]
    write_csv(os.path.join(workdir, "results.csv"), csv_rows(runs, prm_names), CSV_FIELDS)
    tabs, lens, rk, fe = (per_seed(runs, f) for f in ("table", "lengths", "ranking",
                                                      "first_error"))
    ns = sorted(first["table"]["random pick"])
    cmd = "python -m experiments.implicit_prm " + " ".join(argv)
    info = first["info"]
    g, gen, prm = info["generator"], exp.generator, exp.prm.train
    knobs = exp.knobs.to_dict()
    multi = len(seeds) > 1
    seed_txt = (f"seeds {seeds} (each: its own problems, generator, samples, PRM data order); "
                "cells are mean ± s.e. over the seeds" if multi else
                f"seed {seeds[0]} (problems, generator, sampling, PRM data order)")
    per = lambda key: cell([r["info"][key] for r in runs.values()])
    md = [f"# Implicit PRM on the arithmetic testbed ({preset} preset)", "",
          f"Command: `{cmd}` | {seed_txt} | commit {git_commit()} | wall time {seconds:.0f} s this "
          "invocation (stage times in config.json → timing).", "",
          f"Problems: {knobs}. Generator: byte LM, {gen.model.num_layers} layers, "
          f"d = {gen.model.d_model}, {g['steps_total']} steps on sft_corpus of "
          f"{exp['gen_problems']} problems with {exp['error_rate']:.0%} injected slips "
          f"(eval loss {cell([r['info']['generator']['eval_loss'] for r in runs.values()])} "
          f"nats/byte). PRM data: {exp['responses']} samples (T = {exp['temperature']}) for each "
          f"of {exp['prm_problems']} training problems, labelled by final-answer correctness only "
          f"({per('train_accuracy')} correct); {cell([r['info']['n_pairs'] for r in runs.values()], 0)} "
          f"DPO pairs. Implicit PRMs from the generator (= frozen reference), beta = "
          f"{exp['beta']}: CE with the first M ∈ {list(exp['ce_responses'])} samples per problem "
          f"({prm.steps} steps × {prm.batch_size}, lr {prm.lr:g}); DPO on the pairs "
          f"({exp['dpo_steps']} steps × {prm.batch_size} pairs)."
          + (f" Upper bound: a step-label PRM (TRL's PRMTrainer recipe, task `step_prm`) on the "
             f"same {exp['responses']} samples per training problem with the checker's step "
             "labels (the last step also needs the right answer), from the generator, "
             f"{_schedule(info['prm_configs'][STEP_PRM])}." if STEP_PRM in prm_names else "") +
          f" Evaluation: {exp['eval_samples']} samples per held-out problem for "
          f"{exp['test_problems']} problems; per-sample accuracy {per('eval_accuracy')}, all steps "
          f"correct {per('eval_all_steps_correct')}. Best-of-N is averaged over {exp['orders']} "
          "random orders of the samples (first n of each order).", ""]
    if multi:
        md += ["## Per seed", "", markdown_table(
            ["seed", "generator eval loss", "train-sample accuracy", "eval accuracy",
             "all steps correct", "DPO pairs", "gate"],
            [[s, _fmt(r["info"]["generator"]["eval_loss"]), _fmt(r["info"]["train_accuracy"]),
              _fmt(r["info"]["eval_accuracy"]), _fmt(r["info"]["eval_all_steps_correct"]),
              r["info"]["n_pairs"], "pass" if gate_passes(info_acc(r)) else "fails"]
             for s, r in runs.items()])]
    md += ["## Best-of-N accuracy", ""]
    md.append(markdown_table(["selector"] + [f"N={n}" for n in ns],
                             [[s] + [cell(res[n]) for n in ns] for s, res in tabs.items()]))
    md += ["`min r_k`: the reference's default (single score, min over steps). `q_K = sum r_k`: the "
           "implicit ORM reward (outcome only; steps tile the response so these are the same "
           "number). `min q_k`, `sum q_k`: the accumulative score type. Weighted MV: each answer "
           "gets Σ σ(κ·score); at κ = 0.001 every σ ≈ 0.5 and it reduces to majority vote. "
           "Step-label PRM: `min p_k` the weakest step's probability of being correct, `prod p_k` "
           "their product. Random pick: the expected accuracy of a uniformly random choice among "
           "the n. pass@n: an oracle, the upper bound of any selector.", ""]
    if lens:
        md += ["## Length of the selected response (bytes)", "",
               markdown_table(["selector"] + [f"N={n}" for n in ns],
                              [[s] + [cell(res[n], 1) for n in ns] for s, res in lens.items()]),
               "Random pick: the mean length of the n samples.", ""]
    if rk:
        n_max = ns[-1]
        md += ["## Ranking vs the top pick", "",
               "Within-problem AUC: over the problems with right and wrong samples, the chance that "
               "a right sample outscores a wrong one (0.5: no ranking). Rare top pick: the share of "
               f"problems whose top-scored of all {exp['eval_samples']} samples gives an answer no "
               "other sample gives. A scorer can rank well on average (AUC > 0.5) and still lose "
               "at large N if its top is drawn to rare, off-distribution samples.", "",
               markdown_table(["selector", "within-problem AUC", "rare top pick",
                               f"best-of-N accuracy at N={n_max}"],
                              [[sel, cell(res["auc"]), cell(res["rare_pick"]),
                                cell(tabs[sel][n_max])] for sel, res in rk.items()]), ""]
    md += ["## First-error detection (ProcessBench rule)", "",
           f"τ chosen on the even-indexed test problems' responses, scores on the odd-indexed ones "
           f"({cell([r['first_error']['_counts']['test_erroneous'] for r in runs.values()], 0)} "
           f"erroneous / {cell([r['first_error']['_counts']['test_error_free'] for r in runs.values()], 0)} "
           "error-free responses; a response's true first error comes from the checker, used only "
           "here). Predicted first error = first step with σ(β·q_k) < τ (the step-label PRM: "
           "p_k < τ).", ""]
    md.append(markdown_table(
        ["PRM", "F1", "acc erroneous", "acc error-free", "τ", "F1 on the tuning half"],
        [[n, cell(fe[n]["f1"]), cell(fe[n]["acc_erroneous"]), cell(fe[n]["acc_correct"]),
          cell(fe[n]["tau"]), cell(fe[n]["tune_f1"])] for n in prm_names]))
    md += ["CE M = responses per training problem (same problems, same steps).", "",
           "## PRM training", ""]
    pi = lambda n, k: [r["info"]["prm"][n][k] if r["info"]["prm"][n][k] is not None else np.nan
                       for r in runs.values()]
    md.append(markdown_table(
        ["PRM", "rows", "final train loss", "train accuracy", "eval loss", "train s"],
        [[n, cell(pi(n, "rows"), 0), cell(pi(n, "loss")), cell(pi(n, "acc")),
          cell(pi(n, "eval_loss")), cell(pi(n, "seconds"), 0)] for n in prm_names]))
    md += ["## Reading", ""] + reading(exp, runs, prm_names) + [
        "", "Plots: `best_of_n.png`, `first_error_f1.png`."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_bon(runs, os.path.join(workdir, "best_of_n.png"))
    plot_f1(runs, prm_names, exp["ce_responses"], os.path.join(workdir, "first_error_f1.png"))
