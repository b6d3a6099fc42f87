"""Where the train step's time goes, by op class, from a ``jax.profiler`` trace of XLA's thunks.

  python -m benchmarks.step_profile [--presets=small,20m] [--steps=5]

For each preset it builds the trainer's step exactly as ``benchmarks.train_throughput`` does
(``compiled_train_step``), runs one warm-up step, then traces ``--steps`` steps with
``jax.profiler`` at host tracer level 3, which records one event per executed XLA thunk (each
fusion, dot, copy...) on the CPU's worker threads. Each thunk is matched by name to its HLO
instruction in the compiled module (``compiled.as_text()``) and classified from the instruction's
opcode and its ``op_name`` metadata (the JAX / Flax call path, e.g. ``.../layer_0/attn/...``):

  matmul (attention)   dots under an ``attn`` module (QKV, scores, values, output projection)
  matmul (MLP)         dots under an ``mlp`` module
  matmul (lm head)     other dots (embedding / unembedding and their gradients)
  attention softmax    non-dot work under ``attn`` (mask, softmax, rotary positions)
  cross-entropy        the loss around the decoder (``jvp()`` paths: log-softmax, gather, mean)
  norms                RMSNorm / LayerNorm inside the decoder
  embedding            the token embedding lookup (``io`` module, non-dot)
  optimizer & checks   elementwise work outside any module: AdamW, clipping, the non-finite guard
  layout copies        copy / transpose / bitcast fusions (parameter and activation layouts)
  other                the rest (residual adds, MLP activations, ...)

Shares are of the summed thunk time (threads overlap, so the sum can exceed the wall time; the
wall step time is reported beside it). Thunk events shorter than the tracer's resolution are
counted with their measured duration. Results: benchmarks/results/step_profile.{json,md}.
"""
import argparse
import collections
import datetime
import glob
import os
import platform
import re
import tempfile
import time

from benchmarks.common import RESULTS_DIR, write_report

CLASSES = ("matmul (attention)", "matmul (MLP)", "matmul (lm head)", "attention softmax", "cross-entropy",
           "norms", "embedding", "optimizer & checks", "layout copies", "other")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^ ]+\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_index(hlo_text: str) -> dict:
    """{instruction name: (opcode, op_name metadata)} of every instruction in the module text."""
    out = {}
    for line in hlo_text.split("\n"):
        m = _INSTR.match(line)
        if m:
            op = _OP_NAME.search(line)
            out[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return out


def classify(name: str, opcode: str, op_name: str) -> str:
    """The op class of one thunk (see the module docstring)."""
    p = op_name.lower()
    in_model = "(decoder)" in p  # jvp(Decoder) / transpose(jvp(Decoder)): the forward and backward
    if opcode in ("dot", "convolution") or name.startswith("dot"):
        return ("matmul (attention)" if "/attn/" in p else "matmul (MLP)" if "/mlp/" in p
                else "matmul (lm head)")
    if any(k in name for k in ("copy", "transpose", "bitcast")) or opcode in ("copy", "transpose"):
        return "layout copies"
    if in_model:
        return ("attention softmax" if "/attn/" in p else "norms" if "norm" in p
                else "embedding" if "/io/" in p else "other")
    if "jvp(" in p or any(k in p for k in ("log_softmax", "logsumexp", "token_logprobs")):
        return "cross-entropy"  # the loss around the decoder (its forward and backward)
    if p.startswith("jit(") and p.count("/") >= 1:
        return "optimizer & checks"  # AdamW, clipping, the finiteness guard: outside any module
    return "other"


def profile(preset: str, batch: int, steps: int) -> dict:
    import jax
    from benchmarks.train_throughput import _preset_config, compiled_train_step
    c = _preset_config(preset)
    compiled, state, b, compile_s = compiled_train_step(c, batch)
    index = hlo_index(compiled.as_text())
    box = {"s": state}

    def run():
        box["s"], m = compiled(box["s"], b)
        jax.block_until_ready(m)

    run()
    opts = jax.profiler.ProfileOptions()
    opts.host_tracer_level = 3
    with tempfile.TemporaryDirectory(prefix="step_profile_") as d:
        t0 = time.perf_counter()
        jax.profiler.start_trace(d, profiler_options=opts)
        for _ in range(steps):
            run()
        jax.profiler.stop_trace()
        wall = (time.perf_counter() - t0) / steps
        data = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"),
                                                            recursive=True)[0])
        by_class, by_thunk, unmatched = collections.Counter(), collections.Counter(), 0
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith("tf_XLA"):
                    continue
                for ev in line.events:
                    if ev.name.startswith("ThunkExecutor") or ev.name not in index:
                        unmatched += ev.name not in index and not ev.name.startswith("ThunkExecutor")
                        continue
                    op, op_name = index[ev.name]
                    k = classify(ev.name, op, op_name)
                    by_class[k] += ev.duration_ns / 1e9 / steps
                    by_thunk[(ev.name, k)] += ev.duration_ns / 1e9 / steps
    total = sum(by_class.values())
    return {"preset": preset, "batch": batch, "seq_len": c.data.seq_len, "compile_s": compile_s,
            "wall_step_s": wall, "thunk_s": total, "unmatched_events": unmatched,
            "by_class_s": {k: by_class.get(k, 0.0) for k in CLASSES},
            "top_thunks": [{"name": n, "class": k, "s": s} for (n, k), s in by_thunk.most_common(12)]}


def markdown(res) -> str:
    lines = ["# Train step profile by op class (XLA CPU thunks)", "",
             f"`python -m benchmarks.step_profile` on {res['date']}: {res['machine']}, jax {res['jax']}, "
             f"XLA_FLAGS=`{res['xla_flags']}`, load average {res['loadavg']:.2f} before the run. One "
             "trace per preset (host tracer level 3); seconds per step summed over worker threads.", "",
             "| op class | " + " | ".join(f"`{r['preset']}` s/step (share)" for r in res["runs"]) + " |",
             "|---|" + "---:|" * len(res["runs"])]
    for k in CLASSES:
        lines.append(f"| {k} | " + " | ".join(
            f"{1e3 * r['by_class_s'][k]:.1f} ms ({r['by_class_s'][k] / r['thunk_s']:.0%})" for r in res["runs"]) + " |")
    lines.append("| **sum of thunks** | " + " | ".join(f"{1e3 * r['thunk_s']:.1f} ms" for r in res["runs"]) + " |")
    lines.append("| wall step (traced) | " + " | ".join(f"{1e3 * r['wall_step_s']:.1f} ms" for r in res["runs"]) + " |")
    lines += [""]
    for r in res["runs"]:
        lines += [f"Largest thunks of `{r['preset']}` (batch {r['batch']} × {r['seq_len']}): " + ", ".join(
            f"`{t['name']}` {1e3 * t['s']:.1f} ms ({t['class']})" for t in r["top_thunks"][:8]) + ".", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="small,20m")
    p.add_argument("--batch", default="small=16,20m=8")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out_dir", default=RESULTS_DIR)
    a = p.parse_args(argv)
    from icml_jax import xla_env
    xla_env.use_default_flags()
    import jax
    batches = dict(kv.split("=") for kv in a.batch.split(",") if kv)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "loadavg": os.getloadavg()[0],
           "runs": [profile(pr, int(batches.get(pr, 8)), a.steps) for pr in a.presets.split(",") if pr]}
    md = markdown(res)
    write_report(a.out_dir, "step_profile", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
