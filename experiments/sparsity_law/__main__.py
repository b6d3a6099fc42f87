"""Sparsing Law at CPU scale: CETT-PPL-1% activation ratio of ReLU-GLU vs SiLU-GLU along training.

  python -m experiments.sparsity_law --workdir=runs/sparsity_law [--preset=tiny|default]
      [--activations=relu_glu,swiglu] [--steps=N] [--seed=S]

Each activation trains ``configs/sparsity.py:PRESET`` with only ``config.model.mlp.activation``
changed (same init seed, data order, schedule and steps) through ``train_and_evaluate`` in
``DIR/<activation>/``, keeping a checkpoint every ``config.train.checkpoint_every`` steps. A
log-spaced subset of those checkpoints (``eval_points`` of them, first and last included) is
loaded back with orbax and evaluated on the Shakespeare validation split:
  * CETT-PPL-p% (``icml_jax.analysis.sparsity.cett_ppl_search``, p = 1, tol 1e-6, the reference's
    threshold grid) on a held-out slice of ``cett_batches`` x ``cett_batch_size`` rows: the
    activation ratio (fraction of neuron slots not zeroed, over layers and tokens) at the largest
    shared target CETT whose sparse perplexity stays below 1.01 x the dense one;
  * dense validation perplexity on ``ppl_batches`` x ``ppl_batch_size`` rows (a larger slice).
Tokens seen D = step x batch_size x seq_len (packed rows). The ReLU law
A = exp(-c D^a + b) + A0 is fitted to the ReLU-GLU points and the SiLU law A = -c D^-a + A0 to
the SwiGLU points (``fit_relu_law`` / ``fit_silu_law``, D in billions of tokens as the paper).

Resumes: training resumes from its checkpoints, a finished run is not retrained (its
``train.json``), and each evaluated checkpoint's result is cached in
``DIR/<activation>/eval/step_<N>.json``. A workdir made with another preset or config stops with
an error instead of mixing runs.

Writes DIR/config.json, DIR/results.csv (one row per activation x checkpoint), DIR/results.md,
DIR/activation_ratio_vs_tokens.png and DIR/dense_ppl_vs_tokens.png; per run the trainer's
metrics.jsonl, TensorBoard events and checkpoints.
"""
import argparse
import json
import math
import os
import sys

from experiments.common import cached, git_commit, preset, record, stopwatch, write_atomic, write_csv, write_json
from experiments.sparsity_law.report import ACTIVATIONS, FIELDS, markdown, plots
from icml_jax import xla_env

PRESETS = {
    # evaluated checkpoints, CETT slice, dense-PPL slice, CETT-PPL-p% settings
    "tiny": preset(eval_points=5, cett_batches=2, cett_batch_size=4, ppl_batches=2, ppl_batch_size=8,
                   p=1.0, tol=1e-6),
    "default": preset(eval_points=9, cett_batches=2, cett_batch_size=8, ppl_batches=8, ppl_batch_size=16,
                      p=1.0, tol=1e-6),
}
def eval_steps(steps: int, every: int, points: int) -> list:
    """``points`` log-spaced checkpoint steps from ``every`` to ``steps`` (multiples of ``every``,
    deduplicated, the last step always included)."""
    import numpy as np
    if steps < every:
        raise ValueError(f"train.steps={steps} is below train.checkpoint_every={every}: no checkpoint "
                         "to evaluate before the last")
    raw = np.geomspace(every, steps, points)
    out = sorted({min(steps, max(every, int(round(s / every)) * every)) for s in raw} | {steps})
    return out


def check_workdir(path: str, meta: dict) -> None:
    """Stops when DIR/config.json was written for another preset / config (one line)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        old = json.load(f)
    for k in ("preset", "base_config", "exp"):
        if old.get(k) != meta[k]:
            what = (f"preset {old.get('preset')!r}" if k == "preset" else f"a different {k}")
            raise SystemExit(f"error: {path} holds results from {what} (this run: preset "
                             f"{meta['preset']!r}); use another --workdir or delete that one")


def load_params(ckpt_dir: str, step: int):
    """The params of checkpoint ``step`` (restored without a target: plain arrays)."""
    import orbax.checkpoint as ocp
    from icml_jax.train.checkpoint import Checkpointer
    ck = Checkpointer(ckpt_dir, keep=1_000_000, async_save=False)
    try:
        if step not in ck.all_steps():
            raise FileNotFoundError(f"checkpoint {step} is missing from {ckpt_dir} (have "
                                    f"{ck.all_steps()}); delete {os.path.dirname(ckpt_dir)} to retrain")
        state = ck.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return state["state"]["params"]
    finally:
        ck.close()


def evaluate_checkpoint(cfg, params, cett_batches, ppl_batches, exp) -> dict:
    from icml_jax.analysis import sparsity as sp
    from icml_jax.models import build_model
    model = build_model(cfg.model)
    elapsed = stopwatch()
    r = sp.cett_ppl_search(model, params, cett_batches, p=exp["p"], tol=exp["tol"])
    dense_ppl = math.exp(sp.dense_loss(model, params, ppl_batches))
    return {"dense_ppl": dense_ppl, "cett_slice_ppl_dense": r["ppl_dense"],
            "cett_slice_ppl_sparse": r["ppl_sparse"], "ppl_ratio": r["ppl_ratio"], "cett": r["cett"],
            "activation_ratio": r["activation_ratio"], "sparsity": r["sparsity"],
            "thresholds": [float(t) for t in r["thresholds"]], "iterations": r["iterations"],
            "eval_seconds": elapsed()}


def gate_active(cfg, params, cett_batches) -> dict:
    """Share of (token, neuron) slots with act(gate) != 0 on the CETT slice: for ReLU-GLU the most
    neurons the exact decode-time sparse path (``models/sparse_ffn.py``) can have to gather."""
    import numpy as np
    from icml_jax.analysis import sparsity as sp
    from icml_jax.models import build_model
    model = build_model(cfg.model)
    nz = tot = 0
    for b in cett_batches:
        for g, _ in sp.collect_gate_up(model, params, b):
            nz, tot = nz + int(np.count_nonzero(g)), tot + g.size
    return {"gate_active": nz / tot}


def run_activation(cfg, run_dir, exp, steps, batches):
    """Trains (or resumes) one model, evaluates its checkpoints; returns (train info, rows)."""
    from icml_jax.train.trainer import train_and_evaluate
    key = {"config": json.loads(cfg.to_json_best_effort())}
    rec = record(exp)  # the eval cache keys hold the preset as the plain dict it used to be

    def train():
        s = train_and_evaluate(cfg, run_dir)
        return {"final_loss": s.get("loss"), "eval_loss": s.get("eval_loss"), "params": s.get("params")}

    info = dict(cached(os.path.join(run_dir, "train.json"), key, train, seconds_key="train_seconds"),
                eval_seconds=0.0)
    rows = []
    for step in steps:
        ev = cached(os.path.join(run_dir, "eval", f"step_{step:06d}.json"), {**key, "exp": rec, "step": step},
                    lambda: evaluate_checkpoint(cfg, load_params(os.path.join(run_dir, "checkpoints"),
                                                                 step), *batches, exp))
        ga = cached(os.path.join(run_dir, "eval", f"gate_{step:06d}.json"), {**key, "exp": rec, "step": step},
                    lambda: gate_active(cfg, load_params(os.path.join(run_dir, "checkpoints"), step),
                                        batches[0]))
        info["eval_seconds"] += ev["eval_seconds"]
        tokens = step * cfg.train.batch_size * cfg.data.seq_len
        rows.append({"activation": cfg.model.mlp.activation, "step": step, "tokens": tokens,
                     **{k: ev[k] for k in FIELDS if k in ev}, "gate_active": ga["gate_active"]})
        print(f"{cfg.model.mlp.activation} step {step} ({tokens:,} tokens): activation ratio "
              f"{ev['activation_ratio']:.4f} (CETT {ev['cett']:.4f}), dense PPL {ev['dense_ppl']:.3f}",
              flush=True)
    return info, rows


def fit_laws(rows) -> dict:
    """{activation: fit dict or {"error": ...}} with D in billions of tokens."""
    from icml_jax.analysis import sparsity as sp
    out = {}
    for act, fit in (("relu_glu", sp.fit_relu_law), ("swiglu", sp.fit_silu_law)):
        pts = [r for r in rows if r["activation"] == act]
        if not pts:
            continue
        try:
            out[act] = fit([r["tokens"] / 1e9 for r in pts], [r["activation_ratio"] for r in pts])
        except (ValueError, RuntimeError, FloatingPointError) as e:
            out[act] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main(argv=None):
    xla_env.use_default_flags()  # before the first JAX computation (kept if set)
    p = argparse.ArgumentParser(description="Sparsing Law: activation ratio vs tokens, ReLU-GLU vs SiLU-GLU")
    p.add_argument("--workdir", required=True)
    p.add_argument("--preset", default="default", choices=sorted(PRESETS))
    p.add_argument("--activations", default=",".join(ACTIVATIONS))
    p.add_argument("--steps", type=int, default=0, help="override config.train.steps")
    p.add_argument("--seed", type=int, default=None, help="override config.seed")
    a = p.parse_args(argv)
    from icml_jax.config_utils import load_config
    from icml_jax.data import build_tokenizer, make_eval_batches

    elapsed = stopwatch()
    acts = tuple(x for x in a.activations.split(",") if x)
    bad = [x for x in acts if x not in ACTIVATIONS]
    if bad or not acts:
        raise SystemExit(f"error: --activations takes a subset of {list(ACTIVATIONS)}, got {a.activations!r}")
    exp = PRESETS[a.preset]
    base = load_config(f"configs/sparsity.py:{a.preset}", unlocked=True)
    if a.steps:
        base.train.steps = a.steps
    if a.seed is not None:
        base.seed = a.seed
    t = base.train
    steps = eval_steps(t.steps, t.checkpoint_every, exp["eval_points"])
    if t.steps // t.checkpoint_every > t.keep_checkpoints:
        raise SystemExit(f"error: {t.steps // t.checkpoint_every} checkpoints would be written but only "
                         f"train.keep_checkpoints={t.keep_checkpoints} kept; the evaluated ones would be lost")
    meta_cfg = {"preset": a.preset, "activations": list(acts), "exp": record(exp), "eval_steps": steps,
                "base_config": json.loads(base.to_json_best_effort())}
    os.makedirs(a.workdir, exist_ok=True)
    check_workdir(os.path.join(a.workdir, "config.json"), meta_cfg)
    write_json(os.path.join(a.workdir, "config.json"), meta_cfg)
    tok = build_tokenizer(base.data.tokenizer)
    L = base.data.seq_len
    batches = tuple(make_eval_batches(base.data, tok, split="validation", seq_len=L, batch_size=bs,
                                      max_batches=nb)
                    for nb, bs in ((exp["cett_batches"], exp["cett_batch_size"]),
                                   (exp["ppl_batches"], exp["ppl_batch_size"])))
    rows, infos = [], {}
    for act in acts:
        cfg = load_config(f"configs/sparsity.py:{a.preset}", unlocked=True)
        cfg.update_from_flattened_dict({"train.steps": t.steps, "seed": base.seed})
        cfg.model.mlp.activation = act
        print(f"=== {act} ===", flush=True)
        infos[act], r = run_activation(cfg, os.path.join(a.workdir, act), exp, steps, batches)
        rows += r
    fits = fit_laws(rows)
    out_rows = [{**r, "thresholds": " ".join(f"{x:.6g}" for x in r["thresholds"])} for r in rows]
    write_csv(os.path.join(a.workdir, "results.csv"), out_rows, FIELDS)
    write_json(os.path.join(a.workdir, "fits.json"), fits)
    m = base.model
    meta = {"command": "python -m experiments.sparsity_law " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(), "seed": base.seed, "preset": a.preset, "steps": t.steps,
            "wall_seconds": elapsed(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0],
            "train_seconds": sum(i["train_seconds"] for i in infos.values()),
            "eval_seconds": sum(i["eval_seconds"] for i in infos.values()),
            "batch": t.batch_size, "seq_len": L, "p": exp["p"], "tol": exp["tol"],
            "cett_tokens": exp["cett_batches"] * exp["cett_batch_size"] * L,
            "ppl_tokens": exp["ppl_batches"] * exp["ppl_batch_size"] * L,
            "model": f"{m.num_layers} layers, d_model {m.d_model}, d_ff {m.ffn_dim} (gated), {m.num_heads} "
                     f"heads of {m.head_dim}, RoPE, {infos[acts[0]].get('params') or 0:,} params; AdamW lr "
                     f"{t.lr}, {t.warmup_steps} warmup steps then constant, batch {t.batch_size} × {L}"}
    md = markdown(rows, fits, meta)
    write_atomic(os.path.join(a.workdir, "results.md"), md)
    plots(rows, fits, a.workdir)
    print(md)
    return {"rows": rows, "fits": fits, "infos": infos}


if __name__ == "__main__":
    main(sys.argv[1:])
