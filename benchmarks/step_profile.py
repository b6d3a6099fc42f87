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
  attention softmax & mask  non-dot work under ``attn`` (mask, softmax, rotary positions, their
                       transposes)
  MLP elementwise      non-dot work under ``mlp`` (activation, gate x up, gradient sums)
  cross-entropy        the loss around the decoder (``jvp()`` paths: log-softmax, gather, mean)
  norms                RMSNorm / LayerNorm inside the decoder
  embedding            the token embedding lookup (``io`` module, non-dot)
  optimizer & checks   elementwise work outside any module: AdamW, clipping, the non-finite guard
  layout copies        thunks that only move data: copy / transpose / bitcast / pad / concatenate /
                       slice / broadcast, or a fusion made of those only (its fused computation's
                       opcodes; a fusion holding a dot is a matmul)
  other                the rest (residual adds, MLP activations, ...)

**Caveat, measured:** XLA:CPU runs dot thunks asynchronously on its intra-op thread pool, and
their trace events end when the work is launched, not when it is done (the 24 MLP dots of
``small`` show 0.2-0.6 ms each for ~1 GFLOP of work). The matmul rows are therefore lower bounds
and the non-matmul rows are the reliable part; the matmul time is better read as the wall step
minus the rest, or from ``benchmarks.train_throughput``'s MFU. Shares are of the summed thunk time (threads overlap, so the sum can exceed the wall time; the
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

CLASSES = ("matmul (attention)", "matmul (MLP)", "matmul (lm head)", "attention softmax & mask",
           "MLP elementwise", "cross-entropy",
           "norms", "embedding", "optimizer & checks", "layout copies", "other")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^ ]+\s+([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# data movement: a thunk (or a fusion whose first op is one of these) that only moves elements
_MOVES = ("copy", "transpose", "bitcast", "pad", "concatenate", "slice", "dynamic-slice",
          "dynamic-update-slice", "reshape", "broadcast", "iota")


_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^%?([\w.\-]+)\s.*\{\s*$")
_BOOKKEEPING = {"parameter", "constant", "tuple", "get-tuple-element"}


def hlo_index(hlo_text: str) -> dict:
    """{instruction name: (opcode, op_name metadata, opcodes inside it)}: for a fusion, the
    opcodes of its fused computation (so a fusion that holds a dot counts as a matmul, and one of
    copies and bitcasts only as data movement); for other instructions, its own opcode."""
    bodies, current, instr = {}, None, {}
    for line in hlo_text.split("\n"):
        m = _INSTR.match(line)
        if m:
            op = _OP_NAME.search(line)
            calls = _CALLS.search(line) if m.group(2) == "fusion" else None
            instr[m.group(1)] = (m.group(2), op.group(1) if op else "", calls.group(1) if calls else None)
            if current is not None:
                bodies[current].add(m.group(2))
            continue
        c = _COMPUTATION.match(line.strip()) if not line.startswith(" ") else None
        if c and "=" not in line:
            current = c.group(1)
            bodies[current] = set()
    return {n: (op, name, (bodies.get(calls, set()) - _BOOKKEEPING) if calls else {op})
            for n, (op, name, calls) in instr.items()}


def classify(name: str, opcode: str, op_name: str, inside=frozenset()) -> str:
    """The op class of one thunk (see the module docstring); ``inside``: the opcodes it runs."""
    p = op_name.lower()
    in_model = "(decoder)" in p  # jvp(Decoder) / transpose(jvp(Decoder)): the forward and backward
    if {"dot", "convolution"} & set(inside) or opcode in ("dot", "convolution") or name.startswith("dot"):
        return ("matmul (attention)" if "/attn/" in p else "matmul (MLP)" if "/mlp/" in p
                else "matmul (lm head)")
    if (inside and set(inside) <= set(_MOVES)) or opcode in _MOVES:
        return "layout copies"
    if in_model:
        return ("attention softmax & mask" if "/attn/" in p else "MLP elementwise" if "/mlp/" in p
                else "norms" if "norm" in p else "embedding" if "/io/" in p else "other")
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
    from benchmarks.common import median_time
    untraced = median_time(run, 3)
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
                    op, op_name, inside = index[ev.name]
                    k = classify(ev.name, op, op_name, inside)
                    by_class[k] += ev.duration_ns / 1e9 / steps
                    by_thunk[(ev.name, k)] += ev.duration_ns / 1e9 / steps
    total = sum(by_class.values())
    return {"preset": preset, "batch": batch, "seq_len": c.data.seq_len, "compile_s": compile_s,
            "wall_step_s": wall, "untraced_step_s": untraced, "thunk_s": total, "unmatched_events": unmatched,
            "by_class_s": {k: by_class.get(k, 0.0) for k in CLASSES},
            "top_thunks": [{"name": n, "class": k, "s": s} for (n, k), s in by_thunk.most_common(12)]}


def markdown(res) -> str:
    lines = ["# Train step profile by op class (XLA CPU thunks)", "",
             f"`python -m benchmarks.step_profile` on {res['date']}: {res['machine']}, jax {res['jax']}, "
             f"XLA_FLAGS=`{res['xla_flags']}`, GLIBC_TUNABLES=`{res.get('glibc_tunables') or '(none)'}`, "
             f"load average {res['loadavg']:.2f} before the run. One "
             "trace per preset (host tracer level 3); seconds per step summed over worker threads.", "",
             "| op class | " + " | ".join(f"`{r['preset']}` s/step (share)" for r in res["runs"]) + " |",
             "|---|" + "---:|" * len(res["runs"])]
    for k in CLASSES:
        lines.append(f"| {k} | " + " | ".join(
            f"{1e3 * r['by_class_s'][k]:.1f} ms ({r['by_class_s'][k] / r['thunk_s']:.0%})" for r in res["runs"]) + " |")
    lines.append("| **sum of thunks** | " + " | ".join(f"{1e3 * r['thunk_s']:.1f} ms" for r in res["runs"]) + " |")
    lines.append("| wall step (traced) | " + " | ".join(f"{1e3 * r['wall_step_s']:.1f} ms" for r in res["runs"]) + " |")
    lines.append("| wall step (untraced, median of 3) | " + " | ".join(f"{1e3 * r['untraced_step_s']:.1f} ms"
                                                                     for r in res["runs"]) + " |")
    cores = res.get("cores", 1)
    lines.append(f"| thunk time / ({cores} cores × traced wall) | " + " | ".join(
        f"{r['thunk_s'] / (cores * r['wall_step_s']):.0%}" for r in res["runs"]) + " |")
    lines += ["", "The last row is the share of the cores' time covered by thunk events. **The matmul rows "
              "are lower bounds**: XLA:CPU runs dots asynchronously on its intra-op pool and their events end "
              "at the launch (the 24 MLP dots of `small` show 0.2–0.6 ms each for ~1 GFLOP of work), so the "
              "uncovered time is mostly matmul work plus the executor's gaps. The non-matmul rows (softmax "
              "and mask, MLP elementwise, norms, optimizer, copies) are measured as they run. Shares add to "
              "100% of the thunk time, not of the wall time.", ""]
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
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "cores": os.cpu_count(), "jax": jax.__version__,
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "loadavg": os.getloadavg()[0],
           "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
           "runs": [profile(pr, int(batches.get(pr, 8)), a.steps) for pr in a.presets.split(",") if pr]}
    md = markdown(res)
    write_report(a.out_dir, "step_profile", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
