"""Greedy decoding speed: our KV-cache ``generate`` vs ``transformers`` ``generate`` on this CPU.

Run:
  python -m benchmarks.decode_speed [--presets=tiny,20m] [--batches=1,8] [--repeats=5]

For each preset of ``configs/lm.py`` (its model dimensions), an HF ``LlamaForCausalLM`` with random
weights is built with those dimensions, saved with ``save_pretrained`` and imported with
``icml_jax.interop.load_hf``, so both sides run the SAME weights (the benchmark checks that their
greedy tokens agree). Each batch row gets a random 64-token prompt (no padding) and 128 new tokens
are decoded greedily with no stop token (HF: ``do_sample=False, use_cache=True``, eos disabled,
``torch.set_num_threads(cores)``). Every measurement runs in its own child process, so jax's and
torch's thread pools never share one process.

Timing: every path is warmed up once first (for us that is the XLA compile, which is excluded from
all numbers), then run ``--repeats`` times; we report the median.
  * tokens/s = B * 128 / (wall time of one whole ``generate`` call, host-side padding included);
  * prefill latency = one forward over the [B, 64] prompt that fills a fresh cache and returns the
    last logits (ours: a jitted prefill built from the same model; HF: ``model(ids, use_cache=True)``);
  * per-token latency = (generate time - prefill time) / 127 (our decode loop runs inside one
    ``jax.lax.while_loop``, so single steps cannot be timed from Python; the same formula is used
    for HF).
Results: benchmarks/results/decode_speed.{json,md} (written atomically).
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
import types

import numpy as np

from benchmarks.common import median_time, write_report
from icml_jax import xla_env

from benchmarks.common import RESULTS_DIR  # noqa: E402
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT_LEN, NEW_TOKENS = 64, 128
PASSES = 16  # matmul passes per timed call of our floor program



def build_hf(model_cfg, folder: str, seed: int = 0):
    """A random-weight LlamaForCausalLM with ``model_cfg``'s dims, saved to ``folder``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model,
        intermediate_size=model_cfg.ffn_dim, num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads, num_key_value_heads=model_cfg.num_kv_heads,
        head_dim=model_cfg.head_dim, max_position_embeddings=model_cfg.max_seq_len,
        rms_norm_eps=model_cfg.norm_eps, rope_theta=model_cfg.rope_theta,
        tie_word_embeddings=model_cfg.tie_embeddings, initializer_range=0.1)
    model = transformers.LlamaForCausalLM(hf_cfg).eval()
    model.generation_config.eos_token_id = None  # never stop early: always 128 new tokens
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model


def bench_ours(model_cfg, params, prompts: np.ndarray, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from icml_jax.inference import decode
    from icml_jax.models.decoder import build_model

    rows = prompts.tolist()
    run = lambda: decode.generate(model_cfg, params, rows, key=jax.random.key(0),
                                  max_new_tokens=NEW_TOKENS, temperature=0)
    t0 = time.perf_counter()
    out = run()  # warm-up = compile
    compile_s = time.perf_counter() - t0
    gen_s = median_time(run, repeats)

    model = build_model(model_cfg, decode=True)
    B, P = prompts.shape

    @xla_env.decode_jit  # compiled as generate's own prefill is (per-token = generate - prefill)
    def prefill(params, tokens):
        cache = decode.init_cache(model, B, P + NEW_TOKENS)
        positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
        logits, mut = model.apply({"params": params, "cache": cache}, tokens, positions,
                                  jnp.ones((B, P), jnp.int32), mutable=["cache"])
        return logits[:, -1], mut["cache"]

    tokens = jnp.asarray(prompts, jnp.int32)
    jax.block_until_ready(prefill(params, tokens))
    prefill_s = median_time(lambda: jax.block_until_ready(prefill(params, tokens)), repeats)
    return dict(tokens=out.tokens, compile_s=compile_s, generate_s=gen_s, prefill_s=prefill_s)


def bench_hf(model, prompts: np.ndarray, repeats: int) -> dict:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, do_sample=False, use_cache=True,
                                  max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)

    out = run()  # warm-up
    gen_s = median_time(run, repeats)

    def prefill():
        with torch.no_grad():
            return model(ids, attention_mask=mask, use_cache=True).logits[:, -1]

    prefill()
    prefill_s = median_time(prefill, repeats)
    return dict(tokens=out[:, PROMPT_LEN:].numpy(), generate_s=gen_s, prefill_s=prefill_s)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """This machine's memory bandwidth over ``mib`` MiB of float32, GB/s: ``copy`` = numpy copy,
    (bytes read + written) / median time (the STREAM convention); ``read`` = a jitted sum, bytes
    read / median time of a jitted matrix-vector product (a batch-1 decode step's main op: what a
    memory-bound decode can reach)."""
    import jax
    import jax.numpy as jnp
    a = np.ones(mib << 18, np.float32)
    b = np.empty_like(a)
    copy = 2 * a.nbytes / median_time(lambda: np.copyto(b, a), repeats) / 1e9
    W = jnp.asarray(a).reshape(mib << 4, 1 << 14)
    v = jnp.ones((1 << 14,), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(W, v))
    read = a.nbytes / median_time(lambda: jax.block_until_ready(f(W, v)), repeats) / 1e9
    return dict(copy=copy, read=read)


def random_prompts(B: int, vocab: int) -> np.ndarray:
    """B random PROMPT_LEN-token prompts (ids >= 3: no special tokens), the same for a given B."""
    return np.random.default_rng(B).integers(3, vocab, (B, PROMPT_LEN))


def matmul_shapes(model_cfg, side: str) -> list:
    """(in, out) of every weight matmul one decode step runs, in ``side``'s own layout: ours fuses
    q/k/v into one projection and gate/up into another; transformers' Llama runs them separately.
    The head is [d, V] on both sides."""
    m = model_cfg
    d, F, q, kv = m.d_model, m.ffn_dim, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer = ([(d, q + 2 * kv), (q, d), (d, 2 * F), (F, d)] if side == "ours"
             else [(d, q), (d, kv), (d, kv), (q, d), (d, F), (d, F), (F, d)])
    return layer * m.num_layers + [(d, m.vocab_size)]


def matmul_floor(model_cfg, side: str, B: int, repeats: int) -> float:
    """Seconds for one pass of a decode step's weight matmuls at batch ``B`` (``matmul_shapes``),
    each over its own weight as in the model (so the weights stream from memory as in ``generate``,
    not from cache). Ours: one ``decode_jit`` program, compiled as the decode loop is, that runs
    ``PASSES`` passes in a loop (no dispatch per pass, as in ``generate``'s loop); each pass reads
    the last pass's output sum, so none is hoisted, and the outputs are summed whole, so none is
    sliced away. Transformers: ``F.linear`` over [out, in] weights, as ``nn.Linear`` runs them from
    Python in its ``generate``. Median of ``repeats`` calls."""
    rng = np.random.default_rng(0)
    shapes = matmul_shapes(model_cfg, side)
    xs = [rng.standard_normal((B, i), np.float32) for i, _ in shapes]
    ws = [rng.standard_normal((i, o), np.float32) for i, o in shapes]
    if side == "ours":
        import jax

        @xla_env.decode_jit
        def passes(xs, ws):  # PASSES passes in a loop, as in the decode loop (no dispatch per pass)
            def body(_, c):  # each pass's inputs depend on the last, so no pass is hoisted or skipped
                return c + 1e-30 * sum(((x + c) @ w).sum() for x, w in zip(xs, ws))
            return jax.lax.fori_loop(0, PASSES, body, np.float32(0))

        xs, ws = jax.device_put(xs), jax.device_put(ws)
        run = lambda: jax.block_until_ready(passes(xs, ws))
    else:
        import torch
        xs = [torch.from_numpy(x) for x in xs]
        ws = [torch.from_numpy(np.ascontiguousarray(w.T)) for w in ws]

        def run():
            with torch.no_grad():
                return [torch.nn.functional.linear(x, w) for x, w in zip(xs, ws)]
    run()
    return median_time(run, repeats) / (PASSES if side == "ours" else 1)


def scan_cost(model_cfg, B: int, new_tokens: int, repeats: int) -> dict:
    """A ``scan_layers`` copy of ``model_cfg`` (random weights), greedy ``generate`` of
    ``new_tokens`` after a 64-token prompt at batch ``B``, decoded unrolled (the default,
    ``config.model.decode_unrolled``) and through the scanned loop, alternating in one process:
    median ms per new token of each (compile excluded) and whether the tokens agree."""
    import jax
    import jax.numpy as jnp
    import ml_collections

    from icml_jax.inference import decode
    from icml_jax.models.decoder import build_model
    cfg = ml_collections.ConfigDict(model_cfg.to_dict())
    cfg.scan_layers, cfg.max_seq_len = True, max(cfg.max_seq_len, PROMPT_LEN + new_tokens)
    params = jax.jit(build_model(cfg).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    prompts = random_prompts(B, cfg.vocab_size).tolist()
    variants = {}
    for unrolled in (True, False):
        c = ml_collections.ConfigDict(cfg.to_dict())
        c.decode_unrolled = unrolled
        variants["unrolled" if unrolled else "scanned"] = c
    run = lambda c: decode.generate(c, params, prompts, key=jax.random.key(0),  # noqa: E731
                                    max_new_tokens=new_tokens, temperature=0).tokens
    tokens = {k: np.asarray(run(c)) for k, c in variants.items()}  # warm-up = compile
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, c in variants.items():
            t0 = time.perf_counter()
            run(c)
            times[k].append(time.perf_counter() - t0)
    out = {k: 1e3 * float(np.median(v)) / new_tokens for k, v in times.items()}
    return dict(batch=B, slots=PROMPT_LEN + new_tokens, ms_per_token=out,
                ratio=out["scanned"] / out["unrolled"],
                tokens_agree=bool((tokens["scanned"] == tokens["unrolled"]).all()))


def _summary(r: dict, B: int) -> dict:
    per_token = (r["generate_s"] - r["prefill_s"]) / (NEW_TOKENS - 1)
    return dict(tokens_per_s=B * NEW_TOKENS / r["generate_s"], generate_s=r["generate_s"],
                prefill_ms=1e3 * r["prefill_s"], per_token_ms=1e3 * per_token,
                **({"compile_s": r["compile_s"]} if "compile_s" in r else {}),
                **({"matmul_floor_ms": 1e3 * r["matmul_floor_s"]} if "matmul_floor_s" in r else {}))


def _median_run(runs: list) -> dict:
    """One side's child results over rounds: the median of each timing, the first round's tokens
    (the same in every round: greedy, same weights) and load average."""
    out = dict(runs[0])
    for k in ("generate_s", "prefill_s", "compile_s", "matmul_floor_s"):
        if k in out:
            out[k] = float(np.median([r[k] for r in runs]))
    return out


def _child(args) -> None:
    """One measurement in a fresh process: ``--child=ours|hf`` on the model saved in ``--folder``."""
    import torch

    torch.set_num_threads(args.threads)
    prompts = random_prompts(args.batch, args.vocab)
    if args.child == "ours":
        from icml_jax.interop import load_hf
        cfg, params = load_hf(args.folder)
        r = bench_ours(cfg, params, prompts, args.repeats)
        r["matmul_floor_s"] = matmul_floor(cfg, "ours", args.batch, 3 * args.repeats)
    else:
        import transformers
        model = transformers.LlamaForCausalLM.from_pretrained(args.folder).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        r = bench_hf(model, prompts, args.repeats)
        h = model.config  # the same dimensions under our names
        dims = types.SimpleNamespace(d_model=h.hidden_size, ffn_dim=h.intermediate_size,
                                     num_heads=h.num_attention_heads, num_kv_heads=h.num_key_value_heads,
                                     head_dim=h.head_dim, num_layers=h.num_hidden_layers, vocab_size=h.vocab_size)
        r["matmul_floor_s"] = matmul_floor(dims, "hf", args.batch, 3 * args.repeats)
    r["tokens"] = np.asarray(r["tokens"]).tolist()
    r["loadavg"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(r))


def _run_child(kind, folder, vocab, batch, args) -> dict:
    return _run_process([f"--child={kind}", f"--folder={folder}", f"--vocab={vocab}", f"--batch={batch}",
                         f"--repeats={args.repeats}", f"--threads={args.threads}"])


def _run_process(flags) -> dict:
    """This module in a fresh process with ``flags``; its ``RESULT`` line as a dict."""
    cmd = [sys.executable, "-m", "benchmarks.decode_speed", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny,20m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="child-process pairs per case (alternating which side goes first); the report "
                         "takes each side's median over them and lists the per-round speedups")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--scan-cases", default="1:128,8:128,1:960",
                    help="batch:new_tokens cases of the scanned-model comparison on the last preset "
                         "('' = none)")
    ap.add_argument("--child", choices=["ours", "hf", "scan"], help=argparse.SUPPRESS)
    ap.add_argument("--preset", help=argparse.SUPPRESS)
    ap.add_argument("--new", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "scan":
        from icml_jax.config_utils import load_config
        cfg = load_config(f"configs/lm.py:{args.preset}", unlocked=True).model
        print("RESULT " + json.dumps(scan_cost(cfg, args.batch, args.new, args.repeats)))
        return None
    if args.child:
        return _child(args)
    if args.rounds < 1 or args.repeats < 1:
        ap.error(f"--rounds={args.rounds} and --repeats={args.repeats} must be >= 1")

    import jax
    import torch
    import transformers

    from icml_jax.config_utils import load_config

    rows = []
    for preset in args.presets.split(","):
        model_cfg = load_config(f"configs/lm.py:{preset}", unlocked=True).model
        # tiny's max_seq_len (128) is below 64 + 128; RoPE has no position params, so raising it
        # changes nothing else.
        model_cfg.max_seq_len = max(model_cfg.max_seq_len, PROMPT_LEN + NEW_TOKENS)
        with tempfile.TemporaryDirectory() as folder:
            hf_model = build_hf(model_cfg, folder)
            n_params = sum(p.numel() for p in hf_model.parameters())
            del hf_model
            for B in (int(b) for b in args.batches.split(",")):
                runs = []
                for r in range(args.rounds):  # alternate which side goes first, so load drift cancels
                    order = ("ours", "hf") if r % 2 == 0 else ("hf", "ours")
                    got = {k: _run_child(k, folder, model_cfg.vocab_size, B, args) for k in order}
                    runs.append((got["ours"], got["hf"]))
                for i, side in enumerate(("ours", "transformers")):  # greedy, same weights: same tokens
                    if any(r[i]["tokens"] != runs[0][i]["tokens"] for r in runs):
                        raise RuntimeError(f"{preset} B={B}: {side}' greedy tokens differ between rounds")
                ours, hf = (_median_run([r[i] for r in runs]) for i in (0, 1))
                same = float((np.asarray(ours["tokens"]) == np.asarray(hf["tokens"])).mean())
                o, h = _summary(ours, B), _summary(hf, B)
                per_round = [b["generate_s"] / a["generate_s"] for a, b in runs]  # tokens/s ratio
                # bytes a decode step reads: every weight once, plus the KV cache: ours attends over
                # its whole allocated cache (P + new slots, masked), transformers over its grown one
                kv_slot = B * model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 4
                for side, slots in ((o, PROMPT_LEN + NEW_TOKENS), (h, PROMPT_LEN + NEW_TOKENS / 2)):
                    side["bytes_per_step"] = 4 * n_params + kv_slot * slots
                    side["gb_per_s"] = side["bytes_per_step"] / (side["per_token_ms"] * 1e-3) / 1e9
                row = dict(preset=preset, params=n_params, batch=B, ours=o, transformers=h,
                           speedup=o["tokens_per_s"] / h["tokens_per_s"], greedy_tokens_agree=same,
                           speedup_per_round=per_round,
                           rounds=[{side: {k: v for k, v in r[i].items() if k != "tokens"}
                                    for i, side in enumerate(("ours", "transformers"))} for r in runs],
                           loadavg=dict(ours=ours["loadavg"], transformers=hf["loadavg"]))
                rows.append(row)
                print(f"{preset:>5} B={B}: ours {o['tokens_per_s']:8.0f} tok/s (prefill "
                      f"{o['prefill_ms']:.1f} ms, {o['per_token_ms']:.2f} ms/token, compile "
                      f"{o['compile_s']:.1f} s) | transformers {h['tokens_per_s']:8.0f} tok/s (prefill "
                      f"{h['prefill_ms']:.1f} ms, {h['per_token_ms']:.2f} ms/token) | "
                      f"{row['speedup']:.1f}x | tokens agree {same:.0%}", flush=True)

    scan = []  # a scanned copy of the last preset: unrolled vs scanned decode loop, own process each
    for case in filter(None, args.scan_cases.split(",")):
        B, new = (int(x) for x in case.split(":"))
        scan.append(_run_process(["--child=scan", f"--preset={preset}", f"--batch={B}", f"--new={new}",
                                  f"--repeats={args.repeats}"]))
        print(f"scanned {preset} B={B}, {scan[-1]['slots']} slots: unrolled "
              f"{scan[-1]['ms_per_token']['unrolled']:.2f} vs scanned loop "
              f"{scan[-1]['ms_per_token']['scanned']:.2f} ms/token", flush=True)

    env = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), memory_gb_per_s=memory_bandwidth(),
               machine=platform.machine(), cpus=os.cpu_count(), python=sys.version.split()[0],
               jax=jax.__version__, torch=torch.__version__, transformers=transformers.__version__,
               torch_threads=args.threads, xla_flags=os.environ.get("XLA_FLAGS", ""),
               loadavg=os.getloadavg(), prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
               repeats=args.repeats, rounds=args.rounds,
               decode_compiler_options=xla_env.decode_compiler_options())
    report = dict(env=env, results=rows, scan=scan, scan_preset=preset, notes=(
        "Greedy, float32, no stop tokens. Same random weights on both sides (HF LlamaForCausalLM "
        "saved with save_pretrained, imported with icml_jax.interop.load_hf). Each measurement runs "
        "in its own child process. Compile time is excluded (warm-up run) and listed separately. "
        "Medians over repeats, then over rounds (each round one child process per side). The tiny "
        "preset's max_seq_len is raised to 192 to fit 64 + 128."))
    os.makedirs(RESULTS_DIR, exist_ok=True)
    write_report(RESULTS_DIR, "decode_speed", report, _markdown(report))
    return report


def _markdown(report: dict) -> str:
    e = report["env"]
    lines = [
        "# Decode speed: KV-cache `generate` vs transformers",
        "",
        f"`python -m benchmarks.decode_speed` on {e['date']}: {e['cpus']} CPU cores ({e['machine']}), "
        f"jax {e['jax']}, torch {e['torch']} ({e['torch_threads']} threads), transformers "
        f"{e['transformers']}, load average {tuple(round(x, 1) for x in e['loadavg'])}"
        + (f", XLA_FLAGS=`{e['xla_flags']}`" if e["xla_flags"] else "")
        + (f" (our decode loops compile with `{e['decode_compiler_options']}`: `xla_env.decode_jit`)"
           if e.get("decode_compiler_options") else "") + ".",
        "",
        f"Greedy decoding of {e['new_tokens']} new tokens after a {e['prompt_len']}-token prompt, "
        f"float32, same random Llama weights on both sides, each side in its own process; median of {e['repeats']} runs after one "
        "warm-up run (our XLA compile time is excluded from every number and shown on its own)"
        + (f"; {e['rounds']} rounds per case (a fresh child process per side each round, "
           "alternating which side goes first), each side's median over them (the speedup column is the "
           "ratio of the medians), and the per-round speedups"
           if e.get("rounds", 1) > 1 else "") + ".",
        "",
        "| model | params | batch | ours tok/s | HF tok/s | speedup | speedup per round | ours prefill ms | HF prefill ms "
        "| ours ms/token | HF ms/token | ours matmuls ms | HF matmuls ms | ours GB/s | HF GB/s | ours compile s "
        "| greedy tokens agree |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        o, h = r["ours"], r["transformers"]
        lines.append(
            f"| {r['preset']} | {r['params'] / 1e6:.2f}M | {r['batch']} | {o['tokens_per_s']:.0f} | "
            f"{h['tokens_per_s']:.0f} | {r['speedup']:.1f}x | "
            f"{', '.join(f'{x:.1f}x' for x in r.get('speedup_per_round', [r['speedup']]))} | {o['prefill_ms']:.1f} | "
            f"{h['prefill_ms']:.1f} | {o['per_token_ms']:.2f} | {h['per_token_ms']:.2f} | "
            f"{o.get('matmul_floor_ms', float('nan')):.2f} | {h.get('matmul_floor_ms', float('nan')):.2f} | "
            f"{o.get('gb_per_s', float('nan')):.1f} | {h.get('gb_per_s', float('nan')):.1f} | "
            f"{o['compile_s']:.1f} | {r['greedy_tokens_agree']:.0%} |")
    lines += ["", "tokens/s = batch x 128 / median wall time of one whole generate call. Per-token "
              "latency = (generate - prefill) / 127: our decode loop is one `jax.lax.while_loop`, so "
              "single steps are not timed from Python. 'greedy tokens agree' = fraction of generated "
              "tokens equal to transformers' (float32 rounding can flip a near-tie and the rows then "
              "diverge).", "",
              "GB/s = bytes a decode step reads (float32 weights once + the KV cache: ours its whole "
              f"allocated {e['prompt_len'] + e['new_tokens']} slots, transformers its mean length "
              f"{e['prompt_len'] + e['new_tokens'] // 2}) / per-token latency. The memory-bound limit on this "
              f"machine: read bandwidth {e['memory_gb_per_s']['read']:.1f} GB/s (jitted matrix-vector product over 512 MiB), copy "
              f"bandwidth {e['memory_gb_per_s']['copy']:.1f} GB/s (numpy copy, read + written bytes). Weights stream well at batch 1. At batch 8 "
              "the matmuls have 8 rows: see the matmuls below.", "",
              "Matmuls ms = one pass of the weight matmuls a decode step runs, at the row's batch, alone "
              "(each side in its own layout: ours fused q/k/v and gate/up, transformers' separate "
              "`nn.Linear`s; each matmul over its own weight, so the weights stream from memory as in "
              f"`generate`; median of {3 * e['repeats']} passes; ours compiled as the decode loop is). It is a floor for "
              "that side's per-token latency: no attention, norms or sampling. Where our floor is above "
              "half of transformers' per-token latency, a 2x speedup cannot come from the rest of the step:", ""]
    for r in report["results"]:
        o, h = r["ours"], r["transformers"]
        if "matmul_floor_ms" in o:
            lines.append(f"* {r['preset']}, batch {r['batch']}: 2x needs <= {h['per_token_ms'] / 2:.2f} ms/token; "
                         f"our matmuls alone take {o['matmul_floor_ms']:.2f} ms, transformers' "
                         f"{h.get('matmul_floor_ms', float('nan')):.2f} ms; the rest of our step "
                         f"{o['per_token_ms'] - o['matmul_floor_ms']:.2f} ms, of theirs "
                         f"{h['per_token_ms'] - h.get('matmul_floor_ms', float('nan')):.2f} ms")
    lines += [""]
    if report.get("scan"):
        lines += [f"Scanned layers: a `scan_layers=True` copy of `{report['scan_preset']}` (random weights, "
                  "greedy, 64-token prompt), decoded unrolled (the default: `config.model.decode_unrolled`, "
                  "the stacked params split per layer once per call) and through the scanned loop (each "
                  "layer's slice of the stacked KV cache copied out and written back every step), alternating in "
                  "one process, medians:", "",
                  "| batch | cache slots | unrolled ms/token | scanned loop ms/token | scanned / unrolled | same tokens |",
                  "|---:|---:|---:|---:|---:|---|"]
        for r in report["scan"]:
            lines.append(f"| {r['batch']} | {r['slots']} | {r['ms_per_token']['unrolled']:.2f} | "
                         f"{r['ms_per_token']['scanned']:.2f} | {r['ratio']:.2f}x | {r['tokens_agree']} |")
        lines += [""]
    return "\n".join(lines)


if __name__ == "__main__":
    xla_env.use_default_flags()  # before the first JAX computation
    main()
