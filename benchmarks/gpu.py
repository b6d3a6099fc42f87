"""One-command GPU benchmark: train-step MFU of a ~1B bf16 model, decode tokens/s and HBM bandwidth.

  python -m benchmarks.gpu                   # on one NVIDIA GPU: benchmarks/results/gpu_<device>.{json,md}
  python -m benchmarks.gpu --dry-run         # the same code at tiny sizes on the CPU (the test suite runs it)

Models (``configs/lm.py`` base config with the overrides of ``MODELS``; synthetic tokens, no data):

* ``transformer``: 16 layers, d_model 2048, 16 query / 8 kv heads of 128, SwiGLU 5632, vocabulary
  32,000 (0.89B parameters; RMT 0.69B, FoPE 0.89B); bf16 compute with fp32 params and AdamW state, ``remat="dots"``,
  scanned layers, attention through ``jax.nn.dot_product_attention`` with cuDNN flash attention
  (``config.model.attention_impl="cudnn"``), mesh fsdp=1 (the FSDP code path on one device);
* ``fope``: the same with FoPE positions;
* ``rmt``: the Residual Matrix Transformer at the same depth, heads and FFN (key_dim 64; its own
  attention, einsum).

Per model:

* **train**: the trainer's jitted step (``create_sharded_state`` + ``make_train_step`` +
  ``LMTask``, donated state), batch x seq_len tokens, compile timed apart, then the minimum and
  median of ``--steps`` steps. MFU = model FLOPs/s (``train_flops_per_token``, exact convention:
  every matmul, causal attention as half) / the device's nominal dense bf16 peak (``PEAKS``), and
  also against the bf16 matmul rate measured here (``matmul_tflops``).
* **decode**: ``decode.generate`` greedy at batch 1 / 8 / 64 with bf16 params, prompt
  ``prompt_len`` tokens; the per-token step time is (t(N new tokens) - t(1)) / (N - 1), so
  prefill is excluded; achieved HBM bandwidth = (param bytes + the KV cache's bytes at the mean
  context) / step time, against the nominal bandwidth of ``PEAKS``.

The whole run must fit ``--budget_s`` (default 480 s, compile included): parts still to run when
the budget is spent are recorded as skipped. It asserts no targets (the issue's: >= 50% MFU,
decode >= 70% of HBM bandwidth at batch 1); the report says how far each number is from them.
"""
import argparse
import datetime
import json
import os
import platform
import sys
import time

from benchmarks.common import RESULTS_DIR, write_report

# nominal dense bf16 FLOP/s and HBM bytes/s by device kind (vendor data sheets, SXM parts)
PEAKS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         "L4": (121e12, 0.3e12)}
BIG = dict(d_model=2048, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, ffn_dim=5632,
           vocab_size=32000, max_seq_len=2048, dtype="bfloat16", remat="dots", scan_layers=True,
           attention_impl="cudnn", tie_embeddings=False)
TINY = dict(d_model=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, ffn_dim=128,
            vocab_size=384, max_seq_len=128, dtype="bfloat16", remat="dots", scan_layers=True,
            attention_impl="xla", tie_embeddings=False)
MODELS = {"transformer": {}, "fope": {"position": "fope"},
          "rmt": {"residual": "rmt", "position": "alibi", "num_kv_heads": None, "attention_impl": "einsum",
                  "rmt": {"key_dim": 64}}}
SIZES = {"full": dict(model=BIG, seq_len=2048, batch=8, steps=10, prompt_len=128, new_tokens=64,
                      decode_batches=(1, 8, 64), matmul=8192),
         "dry": dict(model=TINY, seq_len=64, batch=2, steps=2, prompt_len=8, new_tokens=16,
                     decode_batches=(1,), matmul=256)}


def model_config(name: str, size: dict):
    """configs/lm.py's base config with the size's model and the variant's overrides."""
    from configs.lm import get_config
    c = get_config("small")
    m = dict(size["model"])
    over = dict(MODELS[name])
    rmt = over.pop("rmt", None)
    m.update({k: v for k, v in over.items() if v is not None})
    if over.get("num_kv_heads", 0) is None:  # the RMT needs num_kv_heads == num_heads
        m["num_kv_heads"] = m["num_heads"]
    if rmt and size["model"] is TINY:
        rmt = {"key_dim": 8}
    c.model.update(m)
    if rmt:
        c.model.rmt.update(rmt)
    c.data.seq_len = size["seq_len"]
    c.train.batch_size = size["batch"]
    return c


def matmul_tflops(n: int) -> float:
    import jax
    import jax.numpy as jnp
    from benchmarks.common import time_calls
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * n ** 3 / min(time_calls(lambda: f(a).block_until_ready(), 5)) / 1e12


def bench_train(c, steps: int) -> dict:
    import jax
    from benchmarks.common import time_calls
    from benchmarks.train_throughput import compiled_train_step
    from icml_jax.analysis.flops import train_flops_per_token
    B, T = c.train.batch_size, c.data.seq_len
    compiled, state, batch, compile_s = compiled_train_step(c, B)
    box = {"state": state}

    def run():
        box["state"], box["m"] = compiled(box["state"], batch)
        jax.block_until_ready(box["m"])

    run()
    times = time_calls(run, steps)
    fpt = train_flops_per_token(c.model, T)
    n = sum(x.size for x in jax.tree.leaves(box["state"].params))
    best = min(times)
    return {"params": int(n), "compile_s": compile_s, "step_s_min": best,
            "step_s_median": sorted(times)[len(times) // 2], "tokens_per_s": B * T / best,
            "flops_per_token": fpt, "model_tflops_per_s": B * T / best * fpt / 1e12,
            "loss": float(box["m"]["loss"])}


def bench_decode(c, batches, prompt_len: int, new_tokens: int) -> list:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from icml_jax.inference import decode
    from icml_jax.models import build_model
    from benchmarks.common import median_time
    m = c.model
    model = build_model(m)
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    import flax.linen as nn
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nn.meta.unbox(params))
    pbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    out = []
    for B in batches:
        rng = np.random.default_rng(B)
        rows = rng.integers(1, min(m.vocab_size, 256), (B, prompt_len)).tolist()
        times = {}
        for n in (1, new_tokens):
            run = lambda n=n: decode.generate(m, params, rows, key=jax.random.key(0), max_new_tokens=n,  # noqa: E731
                                              temperature=0, stop_tokens=())
            t0 = time.perf_counter()
            run()
            times[f"compile_{n}"] = time.perf_counter() - t0
            times[n] = median_time(run, 3)
        step = (times[new_tokens] - times[1]) / (new_tokens - 1)
        ctx = prompt_len + new_tokens / 2  # mean context length over the timed steps
        kv_heads = m.num_kv_heads if m.residual != "rmt" else m.num_heads
        kv_bytes = B * ctx * m.num_layers * 2 * kv_heads * m.head_dim * 2  # bf16 keys and values
        out.append({"batch": B, "step_s": step, "tokens_per_s": B / step, "param_bytes": int(pbytes),
                    "kv_bytes_mean": float(kv_bytes), "hbm_bytes_per_s": (pbytes + kv_bytes) / step,
                    "generate_s": times[new_tokens], "compile_s": times[f"compile_{new_tokens}"]})
    return out


def markdown(res: dict) -> str:
    peak_f, peak_b = res["peak_flops"], res["peak_bytes_per_s"]
    lines = [f"# GPU benchmark ({res['device']})", "",
             f"`python -m benchmarks.gpu {res['args']}` on {res['date']}: {res['device']} "
             f"({res['backend']}), jax {res['jax']}; nominal peaks {peak_f / 1e12:.0f} TFLOP/s bf16 dense, "
             f"{peak_b / 1e12:.2f} TB/s HBM" + (" (none known for this device: the measured matmul rate "
                                                 "is the FLOP peak)" if not res["nominal"] else "")
             + f"; measured bf16 matmul {res['matmul_tflops']:.1f} TFLOP/s (n = {res['matmul_n']}). "
             f"Wall time {res['wall_s']:.0f} s of the {res['budget_s']:.0f} s budget"
             + (" (a dry run at tiny sizes on this machine: the numbers say nothing about a GPU)"
                if res["dry_run"] else "") + ".", "",
             "## Train step", "",
             "| model | params | batch × seq | compile s | step ms (min / median) | tokens/s | model TFLOP/s "
             "| MFU (nominal) | MFU (measured matmul) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in res["train"].items():
        if "skipped" in r or "error" in r:
            lines.append(f"| {name} | {r.get('skipped') or r.get('error')} |||||||| ")
            continue
        tf = r["model_tflops_per_s"] * 1e12
        lines.append(f"| {name} | {r['params'] / 1e6:.0f}M | {res['batch']} × {res['seq_len']} | {r['compile_s']:.1f} "
                     f"| {1e3 * r['step_s_min']:.1f} / {1e3 * r['step_s_median']:.1f} | {r['tokens_per_s']:,.0f} "
                     f"| {r['model_tflops_per_s']:.1f} | {tf / peak_f:.1%} | {tf / (res['matmul_tflops'] * 1e12):.1%} |")
    lines += ["", "FLOPs: `icml_jax.analysis.flops.train_flops_per_token` (exact: every matmul, causal "
              "attention counted as half). Target: ≥ 50% MFU for the 1B step.", "",
              "## Decode (greedy `generate`, bf16 params, per-token step without prefill)", "",
              "| model | batch | step ms | tokens/s | param + KV bytes / step | HBM GB/s | of nominal |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in res["decode"].items():
        if isinstance(rows, dict):
            lines.append(f"| {name} | {rows.get('skipped') or rows.get('error')} ||||||")
            continue
        for r in rows:
            lines.append(f"| {name} | {r['batch']} | {1e3 * r['step_s']:.2f} | {r['tokens_per_s']:,.0f} "
                         f"| {(r['param_bytes'] + r['kv_bytes_mean']) / 1e9:.2f} GB | {r['hbm_bytes_per_s'] / 1e9:.0f} "
                         f"| {r['hbm_bytes_per_s'] / peak_b:.1%} |")
    lines += ["", "Target: decode ≥ 70% of the nominal HBM bandwidth at batch 1.", ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="tiny sizes on whatever backend is here (CPU: attention through the XLA path)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--budget_s", type=float, default=480.0)
    p.add_argument("--out_dir", default=None, help="default: benchmarks/results (a dry run: no file unless given)")
    a = p.parse_args(argv)
    from icml_jax import xla_env
    xla_env.use_default_flags()
    import jax
    t0 = time.perf_counter()
    size = SIZES["dry" if a.dry_run else "full"]
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    if not a.dry_run and dev.platform != "gpu":
        raise SystemExit(f"error: no GPU here (jax sees {kind!r}); run with --dry-run to check the "
                         "script on this machine")
    mm = matmul_tflops(size["matmul"])
    nominal = next((v for k, v in PEAKS.items() if k in str(kind)), None)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(kind),
           "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
           "args": " ".join(argv if argv is not None else sys.argv[1:]), "dry_run": a.dry_run,
           "budget_s": a.budget_s, "batch": size["batch"], "seq_len": size["seq_len"],
           "matmul_tflops": mm, "matmul_n": size["matmul"], "nominal": nominal is not None,
           "peak_flops": nominal[0] if nominal else mm * 1e12, "peak_bytes_per_s": nominal[1] if nominal else
           float("nan"), "train": {}, "decode": {}}
    names = [n for n in a.models.split(",") if n]
    bad = [n for n in names if n not in MODELS]
    if bad:
        raise SystemExit(f"error: --models takes a subset of {list(MODELS)}, got {bad}")
    for part in ("train", "decode"):
        for name in names:
            if time.perf_counter() - t0 > a.budget_s:
                res[part][name] = {"skipped": "budget spent"}
                continue
            c = model_config(name, size)
            if a.dry_run and c.model.dtype == "bfloat16" and jax.default_backend() == "cpu":
                c.model.dtype = "float32"  # bf16 dots are emulated (slow) on a CPU
            try:
                res[part][name] = (bench_train(c, size["steps"]) if part == "train" else
                                   bench_decode(c, size["decode_batches"], size["prompt_len"], size["new_tokens"]))
            except Exception as e:  # one model's failure must not lose the others' numbers
                res[part][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{part} {name}: {json.dumps(res[part][name], default=str)[:300]}", flush=True)
    res["wall_s"] = time.perf_counter() - t0
    md = markdown(res)
    out_dir = a.out_dir or (None if a.dry_run else RESULTS_DIR)
    if out_dir:
        tag = "dryrun" if a.dry_run else "".join(ch if ch.isalnum() else "_" for ch in str(kind)).strip("_").lower()
        write_report(out_dir, f"gpu_{tag}", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
