"""The implicit PRM experiment's report: the best-of-N and first-error tables aggregated from the
cached scores, config.json's ``info``, results.csv rows, results.md (with the ``reading``
statements) and the two plots."""
import os

import numpy as np

from experiments.common import git_commit, markdown_table, save_figure, write_atomic, write_csv
from experiments.implicit_prm.presets import ACCURACY_GATE

# ----------------------------------------------------------------------------- aggregation
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


def bon_over_orders(scores_GN, correct_GN, ns, perms):
    from icml_jax.analysis import prm_eval
    out = {int(n): [] for n in ns}
    for perm in perms:
        res = prm_eval.best_of_n(scores_GN[:, perm], correct_GN[:, perm], ns)
        for n in ns:
            out[int(n)].append(res[int(n)])
    return {n: float(np.mean(v)) for n, v in out.items()}


def wmv_over_orders(answers_GN, scores_GN, ref_G, ns, perms, sigmoid=True):
    from icml_jax.analysis import prm_eval
    out = {int(n): [] for n in ns}
    for perm in perms:
        a = [[row[j] for j in perm] for row in answers_GN]
        res = prm_eval.weighted_majority(a, scores_GN[:, perm], ref_G, ns, sigmoid=sigmoid)
        for n in ns:
            out[int(n)].append(res[int(n)])
    return {n: float(np.mean(v)) for n, v in out.items()}


def best_of_n_table(exp, test, ev, prm_scores, ref_sum):
    """{selector: {n: accuracy}} (the selectors of the module docstring)."""
    G, N = len(ev), int(exp["eval_samples"])
    ns = [int(n) for n in exp["ns"] if n <= N]
    rng = np.random.default_rng(int(exp["seed"]) + 7)
    perms = [np.arange(N)] + [rng.permutation(N) for _ in range(int(exp["orders"]) - 1)]
    correct = np.array([e["correct"] for e in ev], bool)
    answers = [e["answers"] for e in ev]
    ref = [p.answer for p in test]
    table = {}
    table["random pick"] = {n: float(np.mean([correct[:, perm[:n]].mean() for perm in perms]))
                            for n in ns}
    table["pass@n (oracle)"] = {n: float(np.mean([correct[:, perm[:n]].any(1).mean()
                                                  for perm in perms])) for n in ns}
    table["majority vote"] = wmv_over_orders(answers, np.ones((G, N)), ref, ns, perms, sigmoid=False)
    table["generator log-prob"] = bon_over_orders(ref_sum.reshape(G, N), correct, ns, perms)
    beta = float(exp["beta"])
    for name, q_raw, M in prm_scores:
        for sel, s in selector_scores(q_raw, M, 1.0).items():
            table[f"{name}: {sel}"] = bon_over_orders(s.reshape(G, N), correct, ns, perms)
        for kappa, lab in ((beta, "β"), (0.001, "0.001")):
            s = selector_scores(q_raw, M, kappa)["min r_k"].reshape(G, N)
            table[f"{name}: weighted MV σ({lab}·min r_k)"] = wmv_over_orders(
                answers, s, ref, ns, perms)
    return table


def first_error_table(exp, ev, prm_scores):
    """{prm: {tau, f1, acc_erroneous, acc_correct, tune_f1}} (τ on even problems, F1 on odd)."""
    from icml_jax.analysis import prm_eval
    G, N = len(ev), int(exp["eval_samples"])
    true = np.array([e["first_error"] for e in ev]).reshape(-1)
    prob = np.repeat(np.arange(G), N)
    tune, test = prob % 2 == 0, prob % 2 == 1
    grid = np.linspace(0.0, 1.0, 1001)
    out = {}
    for name, q_raw, M in prm_scores:
        q = float(exp["beta"]) * np.asarray(q_raw, np.float64)
        tau, tuned = prm_eval.choose_threshold(q[tune], M[tune], true[tune], grid)
        res = prm_eval.first_error_scores(prm_eval.predict_first_error(q[test], M[test], tau), true[test])
        if res["acc_erroneous"] != res["acc_erroneous"] or res["acc_correct"] != res["acc_correct"]:
            res["f1"] = float("nan")  # one subset is empty: the harmonic mean is undefined
        out[name] = {"tau": tau, "tune_f1": tuned["f1"], **res}
    out["_counts"] = {"test_erroneous": int((true[test] > 0).sum()),
                      "test_error_free": int((true[test] == 0).sum())}
    return out


# ----------------------------------------------------------------------------- outputs

def run_info(gen_dir, gen, labels, n_pairs, ev, prm_info, prm_cfgs, seq_len, paths):
    """config.json's ``info``: the generator, the sample accuracies, the PRMs and their configs."""
    return {"generator": {"eval_loss": gen["eval"].get("eval_loss", float("nan")),
                          "seconds": gen["train_seconds"], "steps_total": gen["steps_total"],
                          "workdir": gen_dir},
            "train_accuracy": float(np.mean(labels)), "n_pairs": n_pairs,
            "eval_accuracy": float(np.mean([e["correct"] for e in ev])),
            "eval_all_steps_correct": float(np.mean([e["all_steps_correct"] for e in ev])),
            "prm": prm_info, "prm_configs": prm_cfgs, "seq_len": seq_len, "paths": paths}


def _fmt(x):
    return "—" if x is None or x != x else f"{x:.3f}"


def reading(exp, table, fe, prm_names):
    ns = sorted(table["random pick"])
    big = [n for n in ns if n >= 8] or [ns[-1]]
    lo, hi = ACCURACY_GATE
    acc = info_acc(table)
    lines = [f"* **Gate.** The generator's per-sample accuracy on the held-out problems is {acc:.3f}: "
             + (f"inside [{lo:.2f}, {hi:.2f}], so best-of-N has right and wrong samples to choose "
                "between." if lo <= acc <= hi else
                f"outside [{lo:.2f}, {hi:.2f}]: the gate fails, so the selector comparison below "
                "has little to pick from " + ("(almost every sample is wrong)" if acc < lo else
                                              "(most samples are right)") +
                " and does not test the paper's claim.")]
    rnd = np.mean([table["random pick"][n] for n in big])
    for name in prm_names:
        mn = np.mean([table[f"{name}: min r_k"][n] for n in big])
        orm = np.mean([table[f"{name}: q_K = sum r_k (outcome only)"][n] for n in big])
        maj = np.mean([table["majority vote"][n] for n in big])
        wmv = np.mean([table[f"{name}: weighted MV σ(β·min r_k)"][n] for n in big])
        verdict = ("shows" if mn > rnd and mn > orm else
                   "partly shows (beats random, not outcome-only)" if mn > rnd else "does not show")
        p_ = max(mn, rnd, orm, 1.0 / (2 * int(exp["test_problems"])))
        se = np.sqrt(2 * p_ * (1 - p_) / int(exp["test_problems"]))
        if mn > rnd and abs(mn - max(rnd, orm if mn > orm else rnd)) < 2 * se:
            verdict += f" nominally, but within ~2 s.e. ({2 * se:.3f}) of sampling noise"
        lines.append(f"* **{name}** at N ∈ {big} (mean): min r_k {mn:.3f} vs random {rnd:.3f}, "
                     f"outcome-only {orm:.3f}, majority vote {maj:.3f}, weighted MV {wmv:.3f}. "
                     f"The paper's direction (min-step PRM beats random and outcome-only as N grows) "
                     f"{verdict} here.")
    if "DPO" in prm_names:
        best = max(prm_names, key=lambda n: np.mean([table[f"{n}: min r_k"][k] for k in big]))
        lines.append(f"* Best PRM by min r_k at N ≥ 8: **{best}** (paper: DPO best overall).")
    f1s = {n: fe[n]["f1"] for n in prm_names}
    c = fe["_counts"]
    if c["test_error_free"] == 0 or c["test_erroneous"] == 0:
        lines.append(f"* First-error F1 is **undefined** here: the held-out half has "
                     f"{c['test_erroneous']} erroneous and {c['test_error_free']} error-free "
                     "responses, so one of the two accuracies has no data (the accuracy on the "
                     "other subset is in the table).")
    else:
        lines.append("* First-error F1 (held-out half): "
                     + ", ".join(f"{n} {_fmt(v)}" for n, v in f1s.items())
                     + ". Always predicting \"no error\" scores F1 0; no PRM ever saw a step label.")
    lines.append(f"* Per-sample accuracy of the generator on the held-out problems: "
                 f"{info_acc(table):.3f} (random pick at N = 1); pass@{ns[-1]} = "
                 f"{table['pass@n (oracle)'][ns[-1]]:.3f} bounds every selector.")
    lines.append(f"* Sampling noise: {exp['test_problems']} test problems, so one problem is "
                 f"{1 / int(exp['test_problems']):.3f} of accuracy; differences below ~2 s.e. "
                 f"(≈ {2 * 0.5 / np.sqrt(int(exp['test_problems'])):.2f} at 50% accuracy, less for "
                 "paired comparisons on the same samples) are not resolved.")
    return lines


def info_acc(table):
    return table["random pick"][min(table["random pick"])]


def plot_bon(table, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    base = {"random pick": ("k", "--"), "pass@n (oracle)": ("gray", ":"),
            "majority vote": ("tab:brown", "-."), "generator log-prob": ("tab:olive", "--")}
    kinds = {"min r_k": "-", "q_K = sum r_k (outcome only)": "--", "weighted MV σ(β·min r_k)": ":"}
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:cyan"]
    prms = list(dict.fromkeys(s.split(": ")[0] for s in table if ": " in s))
    for sel, res in table.items():
        if ": " in sel:
            prm, kind = sel.split(": ", 1)
            if kind not in kinds:
                continue
            c, ls = palette[prms.index(prm) % len(palette)], kinds[kind]
        else:
            c, ls = base.get(sel, ("k", "-"))
        ns = sorted(res)
        ax.plot(ns, [res[n] for n in ns], color=c, ls=ls, marker="o", ms=3, label=sel)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (responses per problem)")
    ax.set_ylabel("accuracy of the selected response")
    ax.set_title("Best-of-N on held-out problems")
    ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def plot_f1(fe, prm_names, ce_ms, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(prm_names)
    axes[0].bar(range(len(names)), [fe[n]["f1"] for n in names], color="tab:blue")
    axes[0].set_xticks(range(len(names)), names, fontsize=8)
    axes[0].set_ylabel("first-error F1 (held-out half)")
    axes[0].set_ylim(0, 1)
    axes[0].set_title("ProcessBench rule on σ(β q_k)")
    ce = [f"CE M={m}" for m in ce_ms]
    axes[1].plot(list(ce_ms), [fe[n]["f1"] for n in ce], marker="o", label="F1")
    axes[1].plot(list(ce_ms), [fe[n]["acc_erroneous"] for n in ce], marker="s", ls="--",
                 label="acc (erroneous)")
    axes[1].plot(list(ce_ms), [fe[n]["acc_correct"] for n in ce], marker="^", ls=":",
                 label="acc (error-free)")
    axes[1].set_xlabel("responses per training problem (CE)")
    axes[1].set_ylim(0, 1)
    axes[1].legend(fontsize=7)
    axes[1].set_title("CE PRM vs responses per problem")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


CSV_FIELDS = ("kind", "selector", "n", "value")


def write_outputs(workdir, exp, preset, argv, info, table, fe, prm_names, seconds):
    """results.csv, results.md and the two plots (``exp``: the preset's ConfigDict)."""
    rows = [{"kind": "best_of_n", "selector": s, "n": n, "value": round(v, 5)}
            for s, res in table.items() for n, v in sorted(res.items())]
    for name in prm_names:
        for k in ("f1", "acc_erroneous", "acc_correct", "tau", "tune_f1"):
            rows.append({"kind": "first_error", "selector": name, "n": k,
                         "value": round(float(fe[name][k]), 5)})
    write_csv(os.path.join(workdir, "results.csv"), rows, CSV_FIELDS)
    ns = sorted(table["random pick"])
    cmd = "python -m experiments.implicit_prm " + " ".join(argv)
    g, gen, prm = info["generator"], exp.generator, exp.prm.train
    knobs = exp.knobs.to_dict()
    md = [f"# Implicit PRM on the arithmetic testbed ({preset} preset)", "",
          f"Command: `{cmd}` | seed {exp['seed']} (problems, generator, sampling, PRM data order) | "
          f"commit {git_commit()} | wall time {seconds:.0f} s this invocation (stage times in "
          "config.json → timing).", "",
          f"Problems: {knobs}. Generator: byte LM, {gen.model.num_layers} layers, "
          f"d = {gen.model.d_model}, {g['steps_total']} steps on sft_corpus of "
          f"{exp['gen_problems']} problems with {exp['error_rate']:.0%} injected slips "
          f"(eval loss {g['eval_loss']:.3f} nats/byte). PRM data: {exp['responses']} samples "
          f"(T = {exp['temperature']}) for each of {exp['prm_problems']} training problems, "
          f"labelled by final-answer correctness only ({info['train_accuracy']:.1%} correct); "
          f"{info['n_pairs']} DPO pairs. PRMs from the generator (= frozen reference), beta = "
          f"{exp['beta']}: CE with the first M ∈ {list(exp['ce_responses'])} samples per problem "
          f"({prm.steps} steps × {prm.batch_size}, lr {prm.lr:g}); DPO on the pairs "
          f"({exp['dpo_steps']} steps × {prm.batch_size} pairs). Evaluation: "
          f"{exp['eval_samples']} samples per held-out problem for {exp['test_problems']} "
          f"problems; per-sample accuracy {info['eval_accuracy']:.1%}, all steps correct {info['eval_all_steps_correct']:.1%}. "
          f"Best-of-N is averaged over {exp['orders']} random orders of the samples (first n of "
          "each order).", "",
          "## Best-of-N accuracy", ""]
    md.append(markdown_table(["selector"] + [f"N={n}" for n in ns],
                             [[s] + [f"{res[n]:.3f}" for n in ns] for s, res in table.items()]))
    md += ["`min r_k`: the reference's default (single score, min over steps). `q_K = sum r_k`: the "
           "implicit ORM reward (outcome only; steps tile the response so these are the same "
           "number). `min q_k`, `sum q_k`: the accumulative score type. Weighted MV: each answer "
           "gets Σ σ(κ·score); at κ = 0.001 every σ ≈ 0.5 and it reduces to majority vote. Random "
           "pick: the expected accuracy of a uniformly random choice among the n. pass@n: an "
           "oracle, the upper bound of any selector.", "",
           "## First-error detection (ProcessBench rule)", "",
           f"τ chosen on the even-indexed test problems' responses, scores on the odd-indexed ones "
           f"({fe['_counts']['test_erroneous']} erroneous / {fe['_counts']['test_error_free']} "
           "error-free responses; a response's true first error comes from the checker, used only "
           "here). Predicted first error = first step with σ(β·q_k) < τ.", ""]
    md.append(markdown_table(
        ["PRM", "F1", "acc erroneous", "acc error-free", "τ", "F1 on the tuning half"],
        [[n, _fmt(fe[n]["f1"]), _fmt(fe[n]["acc_erroneous"]), _fmt(fe[n]["acc_correct"]),
          f"{fe[n]['tau']:.3f}", _fmt(fe[n]["tune_f1"])] for n in prm_names]))
    md += ["CE M = responses per training problem (same problems, same steps).", "",
           "## PRM training", ""]
    md.append(markdown_table(
        ["PRM", "rows", "final train loss", "train accuracy", "eval loss", "train s"],
        [[n, info["prm"][n]["rows"], _fmt(info["prm"][n]["loss"]), _fmt(info["prm"][n]["acc"]),
          _fmt(info["prm"][n]["eval_loss"]), f"{info['prm'][n]['seconds']:.0f}"]
         for n in prm_names]))
    md += ["## Reading", ""] + reading(exp, table, fe, prm_names) + [
        "", "Plots: `best_of_n.png`, `first_error_f1.png`."]
    write_atomic(os.path.join(workdir, "results.md"), "\n".join(md) + "\n")
    plot_bon(table, os.path.join(workdir, "best_of_n.png"))
    plot_f1(fe, prm_names, exp["ce_responses"], os.path.join(workdir, "first_error_f1.png"))
