"""Compile time of the CLI's programs, and the start-up the persistent compilation cache saves.

Run (``make bench``):
  python -m benchmarks.compile_time [--presets=small] [--steps=2] [--tokens=32]

For each preset it runs the two commands a user runs first, each in a fresh child process, three
times: with the cache off (``ICML_JAX_COMPILATION_CACHE=off``), with an empty cache folder (cold:
compiles and writes), and again with that folder filled (warm: reads):

* ``train``: ``python -m icml_jax.main --config=configs/lm.py:PRESET --config.train.steps=N``
  (the train step, the eval step at the end, the checkpoint);
* ``sample``: ``python -m icml_jax.sample --checkpoint=<that workdir> --max_new_tokens=T``
  (prefill + KV-cache ``generate``).

Per run it reports the child's wall time (process start to exit: Python and JAX imports, data,
compiles, the work itself) and, from JAX's own monitoring events inside the child, the seconds
spent in XLA compilation (``/jax/core/compile/backend_compile_duration``: a compile, or on a cache
hit the load from disk) per jitted function, tracing + lowering, and the cache's hits. The
programs run for a few steps only, so compile time is most of a cold run; the saving is the
cold-minus-warm wall time. The threshold is ``icml_jax.xla_env.CACHE_MIN_COMPILE_SECS`` unless
``--min_compile_secs`` is given. The benchmark only reports; it asserts no targets.
Results: benchmarks/results/compile_time.{json,md}.
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from benchmarks.common import write_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
          "/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower"}


def child(module: str, argv: list, out_path: str) -> None:
    """Runs ``module``'s CLI in this process with JAX's monitoring listeners attached; writes
    {"compile": {fun_name: seconds}, "trace", "lower", "cache_hits", "cache_dir"} to out_path."""
    import runpy

    import jax
    from jax import monitoring
    rec = {"compile": {}, "trace": 0.0, "lower": 0.0, "cache_hits": 0}

    def on_duration(event, secs, **kw):
        kind = EVENTS.get(event)
        if kind == "compile":
            name = str(kw.get("fun_name", "?"))
            rec["compile"][name] = rec["compile"].get(name, 0.0) + secs
        elif kind:
            rec[kind] += secs

    def on_event(event, **kw):
        if event == "/jax/compilation_cache/cache_hits":
            rec["cache_hits"] += 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)
    sys.argv = [module] + argv
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    rec["cache_dir"] = jax.config.jax_compilation_cache_dir
    rec["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES", "")
    with open(out_path, "w") as f:
        json.dump(rec, f)


def run_child(module, argv, cache, min_secs):
    """One fresh process; returns the child's record plus its wall seconds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE",
                                                                     "JAX_PERSISTENT_CACHE"))}
    # The child runs the CLI through runpy, where the CLI's huge-page restart does not act (the
    # interpreter's -m names this module), so it starts with the environment that restart gives
    # (the restart's own ~0.1 s is then not in the wall time)
    from icml_jax import xla_env
    env = xla_env.hugepage_environ(env) or env
    env["ICML_JAX_COMPILATION_CACHE"] = cache
    if min_secs is not None:
        env["ICML_JAX_CACHE_MIN_COMPILE_SECS"] = str(min_secs)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", module, out, "--",
                        *argv], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"error: {module} {' '.join(argv)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    with open(out) as f:
        rec = json.load(f)
    os.unlink(out)
    return {**rec, "wall_s": wall, "compile_s": sum(rec["compile"].values())}


def measure(preset, steps, tokens, min_secs, tmp):
    wd = os.path.join(tmp, f"wd_{preset}")
    cache = os.path.join(tmp, f"cache_{preset}")
    commands = {
        "train": ("icml_jax.main", [f"--config=configs/lm.py:{preset}", f"--workdir={wd}",
                                    f"--config.train.steps={steps}", "--config.train.progress=False",
                                    "--config.train.samples=0"]),
        "sample": ("icml_jax.sample", [f"--checkpoint={wd}", "--prompt=ROMEO.",
                                       f"--max_new_tokens={tokens}"]),
    }
    out = {}
    for mode, c in (("off", "off"), ("cold", cache), ("warm", cache)):
        import shutil
        shutil.rmtree(wd, ignore_errors=True)  # the same work each time: train from scratch
        for name, (module, argv) in commands.items():
            r = run_child(module, argv, c, min_secs)
            out.setdefault(name, {})[mode] = r
            print(f"{preset} {name} [{mode}]: {r['wall_s']:.2f} s wall, {r['compile_s']:.2f} s compiling "
                  f"({len(r['compile'])} programs), {r['cache_hits']} cache hits", flush=True)
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(cache) for f in fs]
    out["cache"] = {"files": len(files), "bytes": sum(os.path.getsize(f) for f in files)}
    return out


def markdown(res) -> str:
    lines = ["# Compile time and the persistent compilation cache", "",
             f"Measured {res['date']} on {res['machine']} (load average {res['loadavg']:.2f} before the "
             f"run), jax {res['jax']}; `python -m benchmarks.compile_time` — {res['command']}. Each row is "
             "one fresh process; `compile` = XLA compile time (or, on a cache hit, the load) summed over "
             f"the jitted programs, from JAX's monitoring events; cache threshold {res['min_compile_secs']} s. "
             "The children run with the `GLIBC_TUNABLES` the CLI's huge-page restart gives "
             f"({' / '.join(repr(t) for t in res.get('glibc_tunables', [])) or 'not recorded'}), "
             "without the restart itself (about 0.1 s).",
             ""]
    for preset, r in res["presets"].items():
        lines += [f"## `{preset}`", "",
                  "| command | cache | wall s | compile s | trace + lower s | programs | cache hits |",
                  "|---|---|---|---|---|---|---|"]
        for name in ("train", "sample"):
            for mode in ("off", "cold", "warm"):
                x = r[name][mode]
                lines.append(f"| {name} | {mode} | {x['wall_s']:.2f} | {x['compile_s']:.2f} | "
                             f"{x['trace'] + x['lower']:.2f} | {len(x['compile'])} | {x['cache_hits']} |")
        lines.append("")
        for name in ("train", "sample"):
            off, cold, warm = (r[name][m]["wall_s"] for m in ("off", "cold", "warm"))
            top = sorted(r[name]["off"]["compile"].items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"* `{name}`: the warm start saves {off - warm:.2f} s of {off:.2f} s "
                         f"({warm / off:.2f}× the uncached wall time); writing the cache cost "
                         f"{cold - off:+.2f} s on the cold run. Largest compiles (cache off): "
                         + ", ".join(f"`{k}` {v:.2f} s" for k, v in top) + ".")
        lines += [f"* Cache folder after the runs: {r['cache']['files']} files, "
                  f"{r['cache']['bytes'] / 1e6:.1f} MB.", ""]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        module, out = argv[1], argv[2]
        rest = argv[4:] if len(argv) > 3 and argv[3] == "--" else argv[3:]
        return child(module, rest, out)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="small")
    p.add_argument("--steps", type=int, default=2, help="train steps per train run")
    p.add_argument("--tokens", type=int, default=32, help="tokens sampled per sample run")
    p.add_argument("--min_compile_secs", type=float, default=None,
                   help="cache threshold (default: icml_jax.xla_env.CACHE_MIN_COMPILE_SECS)")
    p.add_argument("--out_dir", default=os.path.join(REPO, "benchmarks", "results"))
    a = p.parse_args(argv)
    import jax
    from icml_jax import xla_env
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="compile_time_") as tmp:
        res = {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
               f"{os.cpu_count()} CPUs", "loadavg": load, "jax": jax.__version__,
               "command": " ".join(["python -m benchmarks.compile_time", *argv]) or "defaults",
               "min_compile_secs": a.min_compile_secs if a.min_compile_secs is not None
               else xla_env.CACHE_MIN_COMPILE_SECS,
               "presets": {pr: measure(pr, a.steps, a.tokens, a.min_compile_secs, tmp)
                           for pr in a.presets.split(",") if pr}}
    # what the children ran with (this process's own value is not theirs)
    res["glibc_tunables"] = sorted({r.get("glibc_tunables", "") for p in res["presets"].values()
                                    for name in ("train", "sample") for r in p[name].values()})
    md = markdown(res)
    write_report(a.out_dir, "compile_time", res, md)
    print(md)


if __name__ == "__main__":
    main()
