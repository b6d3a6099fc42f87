"""CoS speed: standard collaborative decoding vs fixed-role speculation vs CoS, tokens/s on this CPU.

Run:
  TFDS_DATA_DIR=/tmp/tfds python -m benchmarks.cos_speed [--new_tokens=64] [--prompts=4]
      [--trained=DIR | --random] [--tiny]

The two decoders of ``experiments/cos`` (proposer a: d 64 x 2 layers, 131k params; b: d 512 x 6
layers, 8 query / 4 KV heads, 17.9M params, whose float32 weights do not fit this CPU's L3 cache),
trained on the embedded Shakespeare corpus by that experiment's default preset in ``--trained``
(default ``experiments/cos/results``, where the experiment keeps them; trained there first when
missing, about 12 minutes), each a ``collab.FlaxLM``
(its jitted cached step, batch 1), continue Shakespeare prompts by ``--new_tokens`` tokens with the
three drivers of ``icml_jax.inference.collab`` for the weighted ensemble (``we``, weight 0.7 on a)
and contrastive decoding (``cd``, alpha 0.1), at T = 0 and at T = 1 (3 seeds). ``--random`` uses
random weights of the same sizes instead (init std x 4): the drafts' acceptance is then only what
the combination guarantees (``we`` at T = 1: at least 0.7; ``cd`` about 0), which isolates the
drivers' own cost; ``--tiny`` (random tiny models, the test suite's check) as well.

Every program is compiled and each setting run once before the timed passes (compile time excluded);
tokens/s = tokens / wall seconds of a timed pass summed over prompts and seeds; ``--passes`` (3)
timed passes, and the report gives the median pass and the range of the speedup (one pass of
about 1 s per setting moved the CoS speedup by +-10% between back-to-back runs). The T = 0 rows
also check that the three drivers give identical tokens. Target (issue 20): CoS >= 1.5x standard.
Results: benchmarks/results/cos_speed.{json,md} (written atomically).
"""
import argparse
import copy
import datetime
import os
import platform
import sys
import time

import numpy as np

from benchmarks.common import RESULTS_DIR, write_report
from experiments.cos.__main__ import METHODS, PRESETS, PROMPTS, call_cost, decode_all, warm_up
from icml_jax import xla_env

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def random_models(preset: str, max_len):
    """Random-weight models (init std x 4) of the sizes of the experiment's ``preset``."""
    import jax
    import jax.numpy as jnp

    from icml_jax.config_utils import load_config
    from icml_jax.models.decoder import build_model
    out = {}
    for i, which in enumerate(("a", "b")):
        cfg = load_config("configs/lm.py:small", unlocked=True).model
        cfg.update(dict(PRESETS[preset][which].model.to_dict(), max_seq_len=max_len))
        m = build_model(cfg)
        params = jax.jit(lambda k: jax.tree.map(lambda x: x * 4.0, m.init(k, jnp.zeros((1, 8), jnp.int32))["params"]))(
            jax.random.key(i))
        out[which] = (cfg, params)
    return out


def trained_models(workdir):
    """The experiment's trained pair in ``workdir`` (``experiments/cos`` default preset), trained
    there first if it is not (about 4 minutes on this CPU; a finished run is reused)."""
    from experiments.common import train_run
    from experiments.cos.__main__ import model_config
    from icml_jax.train.checkpoint import restore_model_params
    out = {}
    for which in ("a", "b"):
        cfg = model_config(PRESETS["default"], which)
        wd = os.path.join(workdir, f"model_{which}")
        train_run(cfg, wd)
        out[which] = (cfg.model, restore_model_params(wd, cfg.model)[0])
    return out


def summarize(rows):
    """The experiment's per-prompt rows (``experiments.cos.decode_all``) summed per (combiner, T,
    method): tokens/s over the pass, b calls per token, acceptance, T = 0 agreement."""
    out = []
    keys = sorted({(r["combiner"], r["temperature"], r["method"]) for r in rows},
                  key=lambda k: (k[0] != "we", k[1], METHODS.index(k[2])))
    for key in keys:
        rs = [r for r in rows if (r["combiner"], r["temperature"], r["method"]) == key]
        tokens, wall = sum(r["tokens"] for r in rs), sum(r["wall_s"] for r in rs)
        drafted = sum(r["drafted"] for r in rs)
        out.append(dict(combiner=key[0], temperature=key[1], method=key[2], tokens=tokens, wall_s=wall,
                        tokens_per_s=tokens / wall, b_calls_per_token=sum(r["calls_b"] for r in rs) / tokens,
                        acceptance=sum(r["accepted"] for r in rs) / drafted if drafted else None,
                        same_as_standard=all(r["same_as_standard"] for r in rs) if key[1] == 0 else None))
    for r in out:
        ref = next(s for s in out if s["combiner"] == r["combiner"] and s["temperature"] == r["temperature"]
                   and s["method"] == "standard")
        r["speedup_vs_standard"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return out


def merge_passes(passes):
    """One row per setting from several passes' ``summarize`` rows (same order in each): the
    median pass's tokens/s and speedup (medians taken separately), the speedups' range over
    passes, and the counts of the first pass (calls and acceptance are the same in every pass:
    same seeds; T = 0's agreement must hold in every pass)."""
    if not passes:
        raise ValueError("merge_passes: no passes (--passes must be >= 1)")
    out = []
    for rs in zip(*passes):
        r = dict(rs[0])
        r["tokens_per_s"] = float(np.median([x["tokens_per_s"] for x in rs]))
        sp = [x["speedup_vs_standard"] for x in rs]
        r.update(speedup_vs_standard=float(np.median(sp)), speedup_range=[float(min(sp)), float(max(sp))],
                 passes=len(rs))
        if r["same_as_standard"] is not None:  # T = 0: the same tokens in every pass
            r["same_as_standard"] = all(x["same_as_standard"] for x in rs)
        out.append(r)
    return out


def markdown(res):
    lines = [
        "# CoS speed: standard collaborative decoding vs fixed-role speculation vs CoS", "",
        f"`python -m benchmarks.cos_speed` on {res['date']}: {res['cpus']} CPU cores ({res['machine']}), "
        f"load average {tuple(round(x, 1) for x in res['loadavg'])}, weights: {res['weights']}.", "",
        f"Proposer a {res['params']['a']:,} params, b {res['params']['b']:,} params (one-token call "
        f"{res['call_ms']['a']:.2f} ms vs {res['call_ms']['b']:.2f} ms; b's call on {res['gamma'] + 1} tokens "
        f"{res['call_ms']['b_x%d' % (res['gamma'] + 1)]:.2f} ms); {res['prompts']} prompts × "
        f"{res['new_tokens']} new tokens, gamma = {res['gamma']}, T = 1 over seeds {res['seeds']}; {res['passes']} timed "
        "pass(es) after a warm-up pass (compile excluded), each over every setting, prompt and seed in turn; tokens/s and "
        "the speedup are the median over passes (the speedup is taken within each pass, so slow and fast spells of "
        "the machine cancel).", "",
        "| combiner | T | method | tokens/s | vs standard | range over passes | b calls / token | drafts accepted | same tokens as standard |",
        "|---|---:|---|---:|---:|---|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['combiner']} | {r['temperature']:g} | {r['method']} | {r['tokens_per_s']:.0f} | "
                     f"{r['speedup_vs_standard']:.2f}× | {r['speedup_range'][0]:.2f}–{r['speedup_range'][1]:.2f}× | "
                     f"{r['b_calls_per_token']:.2f} | "
                     f"{'—' if r['acceptance'] is None else format(r['acceptance'], '.0%')} | "
                     f"{'n/a (sampled)' if r['same_as_standard'] is None else r['same_as_standard']} |")
    cos = [r["speedup_vs_standard"] for r in res["rows"] if r["method"] == "cos"]
    lines += ["", f"CoS vs standard (median pass): {min(cos):.2f}× to {max(cos):.2f}× over the four settings "
              f"(target ≥ 1.5×: met in {sum(c >= 1.5 for c in cos)} of {len(cos)}). One run on this machine; quote ratios, not "
              f"absolute tokens/s. b's call on {res['gamma'] + 1} tokens costs "
              f"{res['call_ms']['b_x%d' % (res['gamma'] + 1)] / res['call_ms']['b']:.2f}× its one-token call: "
              "speculation saves b's per-call cost and pays for every rejected draft b reads, so the gain follows "
              "the acceptance and how little a call's time grows with the tokens it feeds (a model whose weights "
              "stream from memory, as an LLM's do, grows least).", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new_tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3,
                    help="timed passes (each over every setting, prompt and seed); the report gives the median "
                         "pass and the range")
    ap.add_argument("--trained", default=os.path.join(REPO_ROOT, "experiments", "cos", "results"),
                    help="an experiments/cos workdir (model_a/, model_b/; trained there when missing)")
    ap.add_argument("--random", action="store_true", help="random weights instead of the trained pair")
    ap.add_argument("--tiny", action="store_true", help="tiny models, few tokens (the test suite's check)")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    if args.passes < 1:
        ap.error(f"--passes={args.passes} must be >= 1")
    xla_env.use_defaults()
    import jax
    from icml_jax.inference import collab
    seeds = (0,) if args.tiny else (0, 1, 2)
    max_len = 64 + args.new_tokens + args.gamma + 8
    trained = not (args.random or args.tiny)
    models = trained_models(args.trained) if trained else random_models(
        "tiny" if args.tiny else "default", max_len)
    factories = {w: collab.FlaxLM(cfg, p, max_len).fork for w, (cfg, p) in models.items()}
    vocab = min(cfg.vocab_size for cfg, _ in models.values())
    if trained:
        from icml_jax.data.tokenizers import ByteTokenizer
        tok = ByteTokenizer()
        prompts = [[tok.bos_id] + tok.encode(t) for t in (PROMPTS * args.prompts)[:args.prompts]]
    else:
        rng = np.random.default_rng(0)
        prompts = [[1] + rng.integers(3, min(vocab, 259), 15).tolist() for _ in range(args.prompts)]
    exp = copy.deepcopy(PRESETS["default"])  # its combiners (we 0.7, cd 0.1), gamma and seeds unless overridden
    exp.update(dict(new_tokens=args.new_tokens, gamma=args.gamma, seeds=seeds))
    warm_up(factories, prompts, args.gamma)
    costs = {w: call_cost(factories[w], 20) for w in ("a", "b")}
    call_ms = {w: 1e3 * c for w, c in costs.items()}
    call_ms[f"b_x{args.gamma + 1}"] = 1e3 * call_cost(factories["b"], 20, tokens=args.gamma + 1)
    decode_all(exp, factories, prompts, costs)  # warm-up pass
    rows = merge_passes([summarize(decode_all(exp, factories, prompts, costs))
                         for _ in range(1 if args.tiny else args.passes)])
    res = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=platform.machine(),
               cpus=os.cpu_count(), python=sys.version.split()[0], jax=jax.__version__, loadavg=os.getloadavg(),
               weights=f"trained by experiments/cos ({os.path.relpath(args.trained, REPO_ROOT)})" if trained
               else "random (init std x 4)",
               params={w: int(sum(x.size for x in jax.tree.leaves(p))) for w, (_, p) in models.items()},
               call_ms=call_ms, prompts=args.prompts, new_tokens=args.new_tokens, gamma=args.gamma,
               passes=rows[0]["passes"],
               seeds=list(seeds), rows=rows)
    write_report(args.out, "cos_speed", res, markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
