"""Training throughput of our jitted train step vs. the same-size PyTorch ``LlamaForCausalLM``.

Run (``make bench``):
  python -m benchmarks.train_throughput [--presets=small,20m] [--steps=5] [--skip_default_flags]

What it measures, on this machine, in one run:
  * ``matmul``: the dense fp32 GEMM GFLOP/s jax and torch reach (2048^3 and the model's own
    shapes); the best of all is the "peak" that MFU is measured against. Also the attention
    core's batched matmuls (``BMM_SHAPES``), and jax's again under each of ``BMM_FLAG_VARIANTS``
    (other XLA:CPU dot back ends and schedulers) and split into independent dots
    (``--skip_bmm_variants`` leaves those out).
  * ``ours``: tokens/s of the trainer's step (``make_train_step`` + ``create_sharded_state`` +
    ``LMTask.loss`` + the config's AdamW, donated state) on a synthetic batch, with the XLA CPU
    flags in ``RECOMMENDED_XLA_FLAGS`` and, for comparison, with jax's default flags; with
    malloc's huge pages where our entry points restart with them (``xla_env.hugepage_environ``),
    and without them (``ours_no_hugepages``). Torch runs as its users run it, and with huge pages
    as a control (``torch_sdpa_hugepages``). Each child reports its minor page faults per step.
  * ``torch``: ``transformers.LlamaForCausalLM`` of the same dimensions (fp32, tied embeddings,
    same rope theta) trained with ``torch.optim.AdamW`` + grad clipping on the same tokens,
    ``torch.set_num_threads(cores)``, attention ``sdpa`` and ``eager``.
Model FLOPs use ``icml_jax.analysis.flops.train_flops_per_token`` (MaxText's convention: 6 x
matmul params per token + causal attention counted as half), for both frameworks.

Each measurement runs in its own child process (XLA flags are per process, and peak RSS must not
mix frameworks); a child warms up (compiles) first and then times ``--steps`` steps, each ended by
``block_until_ready`` (jax) or a synchronous torch step. Step time = the minimum over the timed
steps (the machine may be shared; the median is reported too, with the load average).
``AB_VARIANTS`` are our step with one change turned off (config.model overrides), the A/B
of each optimisation we keep. Memory, comparable across frameworks: the RSS high-water mark over
the timed steps (reset after the warm-up) minus the RSS before the model was built ("steady").
Also: ``ru_maxrss`` growth of the child from just before the model is built to after the
last step (params + optimizer state + activations + allocator slack; for jax also the XLA
compiler's own memory), and for jax XLA's static ``memory_analysis`` of the compiled step
(arguments + outputs - aliased + temporaries).
The benchmark only reports; it asserts no targets. Results: benchmarks/results/train_throughput.{json,md}.
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.common import time_calls, write_report
from icml_jax import xla_env

# XLA CPU flags of our entry points (see the report's `ours_default_flags` row): without them
# jax 0.10.2 routes dots through YNNPACK fusions. In the 2026-12-01 step those ran on one thread
# and made it ~1.9x slower on 2 cores; with the causal query blocks (2026-12-03) the two paths are
# within ~5% in time, but the YNN program's temporaries are larger (small: 615 vs 518 MiB), so the
# flag stays. Disabling the YNN fusion types sends dots to XLA's multi-threaded Eigen runtime.
RECOMMENDED_XLA_FLAGS = " ".join(xla_env.CPU_FLAGS)  # what icml_jax's entry points set
from benchmarks.common import RESULTS_DIR  # noqa: E402
# A/B of our step: name -> config.model overrides, each timed like ``ours`` (the report's
# "Other variants" table); what each row turns off is the change it measures.
AB_VARIANTS = {"ours_attention_block=0": {"attention_block": 0}}  # causal query blocks off
MATMUL_SHAPES = ((2048, 2048, 2048), (4096, 256, 704), (4096, 512, 1408), (4096, 1408, 512),
                 (4096, 512, 512))
# batched matmuls (batch, M, K, N) of the attention core's shape on `20m` (B·G = 32 matrices of a
# 64-query block's 2 heads x 64 dims against 256 keys): reported beside the peak, not part of it
BMM_SHAPES = ((32, 128, 64, 256), (32, 128, 256, 64))
# the batched matmuls again under other XLA:CPU settings (each in its own process: XLA_FLAGS are
# read once), and split into 2 independent dots over the batch (which the thunk executor could
# run on both cores at once): whether any of them gets the batched dot off one core
BMM_FLAG_VARIANTS = {
    "concurrency-optimized scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "oneDNN": "--xla_cpu_use_onednn=true",
    "oneDNN custom call": "--xla_cpu_experimental_onednn_custom_call=true",
    "XNNPACK": "--xla_cpu_use_xnnpack=true",
    "XNN dot fusion": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "YNN dot fusion": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
BMM_SPLIT = 2


# ----------------------------------------------------------------------------- helpers

def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _status_kib(field: str):
    """A ``/proc/self/status`` size in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Resets the process's RSS high-water mark (VmHWM) to its current RSS (Linux clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim(spec: dict) -> None:
    """Both children, after their warm-up: freed heap pages back to the OS, as our train loop does
    after its first step (``xla_env.release_host_memory``); ``spec["trim"] = False`` skips it."""
    if spec.get("trim", True):
        from icml_jax import xla_env
        xla_env.release_host_memory()


def _steady_peak(run, steps: int, rss0) -> tuple:
    """Times ``steps`` calls of ``run`` with the RSS high-water mark reset before them: (times,
    peak RSS during the timed steps minus ``rss0``, the RSS before the model was built; None
    where the kernel does not allow the reset; the process's minor page faults per timed step)."""
    reset = _reset_peak_rss()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = time_calls(run, steps)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / max(steps, 1)
    hwm = _status_kib("VmHWM")
    return times, (hwm - rss0 if reset and hwm is not None and rss0 is not None else None), faults



def _timing(times: list, tokens_per_step: int, flops_per_token: float) -> dict:
    best = min(times)
    return {"step_s_min": best, "step_s_median": sorted(times)[len(times) // 2], "step_s_all": times,
            "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / best,
            "model_tflops_per_s": tokens_per_step / best * flops_per_token / 1e12}


def _preset_config(preset: str):
    from configs.lm import get_config
    return get_config(preset)


def _synthetic_tokens(batch: int, seq_len: int, vocab: int, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, min(vocab, 256), (batch, seq_len + 1)).astype("int32")


# ----------------------------------------------------------------------------- children

def _matmul_cases(bmm_only: bool = False):
    """(report key, shape of a, shape of b, FLOPs) per case: the 2-D ``MATMUL_SHAPES`` under
    "gflops" (the peak; not with ``bmm_only``) and the batched ``BMM_SHAPES`` under "bmm_gflops"."""
    for m, k, n in () if bmm_only else MATMUL_SHAPES:
        yield "gflops", f"{m}x{k}x{n}", (m, k), (k, n), 2 * m * k * n
    for nb, m, k, n in BMM_SHAPES:
        yield "bmm_gflops", f"{nb}x({m}x{k}x{n})", (nb, m, k), (nb, k, n), 2 * nb * m * k * n


def _time_matmuls(make, run, reps: int, bmm_only: bool = False) -> dict:
    """GFLOP/s per case of :func:`_matmul_cases`: ``make(shape, seed)`` builds an operand,
    ``run(a, b)`` multiplies and waits; best of ``reps`` after one warm-up call."""
    out = {"gflops": {}, "bmm_gflops": {}}
    for key, name, sa, sb, flops in _matmul_cases(bmm_only):
        a, b = make(sa, 0), make(sb, 1)
        run(a, b)
        out[key][name] = flops / min(time_calls(lambda: run(a, b), reps)) / 1e9
    return out


def split_matmul(a, b, parts: int):
    """``a @ b`` for batched [n, M, K] x [n, K, N] as ``parts`` independent dots over n (n
    divisible by ``parts``), concatenated."""
    import jax.numpy as jnp
    h = a.shape[0] // parts
    return jnp.concatenate([jnp.matmul(a[i * h:(i + 1) * h], b[i * h:(i + 1) * h]) for i in range(parts)])


def child_matmul_jax(spec: dict) -> dict:
    """The jitted matmuls' GFLOP/s; ``bmm_only``: the batched ones only; ``split``: each batched
    matmul as that many independent dots (:func:`split_matmul`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    split = spec.get("split", 1)
    f = jax.jit(jnp.matmul if split == 1 else (lambda a, b: split_matmul(a, b, split)))
    out = _time_matmuls(lambda shape, seed: jnp.asarray(
        np.random.default_rng(seed).standard_normal(shape, np.float32)),
        lambda a, b: f(a, b).block_until_ready(), spec["reps"], spec.get("bmm_only", False))
    return {**out, "jax_version": jax.__version__}


def child_matmul_torch(spec: dict) -> dict:
    import torch
    torch.set_num_threads(spec["threads"])
    out = _time_matmuls(lambda shape, seed: torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),
                        torch.matmul, spec["reps"])
    return {**out, "torch_version": torch.__version__, "threads": torch.get_num_threads()}


def _lm_task(config):
    """The trainer's LMTask; built without a tokenizer if the data layer is not importable."""
    try:
        from icml_jax.tasks.lm import LMTask
        return LMTask(config), True
    except ImportError:  # the data layer is optional for a synthetic benchmark
        import importlib
        from icml_jax.models import build_model
        lm = importlib.import_module("icml_jax.tasks.lm")
        task = lm.LMTask.__new__(lm.LMTask)
        task.config, task.model = config, build_model(config.model)
        return task, False


def compiled_train_step(config, B: int):
    """The trainer's step for ``config`` on a synthetic [B, seq_len] batch, compiled exactly as
    ``train_and_evaluate`` builds it (sharded state, donated): (compiled, state, batch, compile s)."""
    import warnings
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    from icml_jax import sharding as mesh_lib
    from icml_jax.train.optimizer import make_optimizer
    from icml_jax.train.trainer import create_sharded_state, make_train_step
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # `with mesh:` as the trainer does
    T = config.data.seq_len
    toks = _synthetic_tokens(B, T, config.model.vocab_size)
    batch = {"inputs": jnp.asarray(toks[:, :-1]), "targets": jnp.asarray(toks[:, 1:]),
             "segment_ids": jnp.ones((B, T), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))}
    task, _ = _lm_task(config)
    mesh, rules = mesh_lib.make_mesh(config.mesh), mesh_lib.logical_rules(config.mesh)
    tx = make_optimizer(config.train)
    state, shardings = create_sharded_state(task, tx, config, mesh, rules)
    batch_sharding = mesh_lib.batch_sharding(mesh)
    batch = jax.device_put(batch, batch_sharding)
    with mesh, nn.logical_axis_rules(rules):
        step = jax.jit(make_train_step(task, tx, 1), in_shardings=(shardings, batch_sharding),
                       out_shardings=(shardings, None), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    return compiled, state, batch, time.perf_counter() - t0


def child_ours(spec: dict) -> dict:
    import jax
    from icml_jax.analysis.flops import param_count, train_flops_per_token

    config = _preset_config(spec["preset"])
    config.model.update(spec.get("model_overrides", {}))
    B, T = spec["batch"], config.data.seq_len
    rss0, rss0_now = _maxrss_bytes(), _status_kib("VmRSS")
    with_tokenizer = _lm_task(config)[1]
    compiled, state, batch, compile_s = compiled_train_step(config, B)
    mem = compiled.memory_analysis()
    box = {"state": state}

    def run():
        box["state"], box["metrics"] = compiled(box["state"], batch)
        jax.block_until_ready((box["state"], box["metrics"]))

    run()  # warm-up step (allocations, thread pools)
    _trim(spec)
    times, steady, faults = _steady_peak(run, spec["steps"], rss0_now)
    n_params = sum(x.size for x in jax.tree.leaves(box["state"].params))
    out = _timing(times, B * T, train_flops_per_token(config.model, T))
    out.update(compile_s=compile_s, params=int(n_params), params_formula=param_count(config.model),
               loss=float(box["metrics"]["loss"]), rss_growth_bytes=_maxrss_bytes() - rss0,
               steady_peak_bytes=steady, model_overrides=spec.get("model_overrides", {}),
               with_tokenizer=with_tokenizer, jax_version=jax.__version__,
               xla_flags=os.environ.get("XLA_FLAGS", ""), page_faults_per_step=faults,
               glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""))
    if mem is not None:
        out["xla_step_bytes"] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                    - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
        out["xla_temp_bytes"] = int(mem.temp_size_in_bytes)
    return out


def _torch_llama(model_cfg, attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    m = model_cfg
    hf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                     num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                     num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim,
                     max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                     rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
                     attention_bias=False, mlp_bias=False, hidden_act="silu",
                     initializer_range=m.init_std)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(hf, attn_implementation=attn, dtype=torch.float32)


def child_torch(spec: dict) -> dict:
    import torch
    import transformers
    from icml_jax.analysis.flops import train_flops_per_token
    torch.set_num_threads(spec["threads"])
    config = _preset_config(spec["preset"])
    B, T, t = spec["batch"], config.data.seq_len, config.train
    toks = torch.from_numpy(_synthetic_tokens(B, T, config.model.vocab_size)).long()
    inputs, targets = toks[:, :-1], toks[:, 1:]
    rss0, rss0_now = _maxrss_bytes(), _status_kib("VmRSS")
    model = _torch_llama(config.model, spec["attn"])
    model.train()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.b1, t.b2), eps=t.eps)
    box = {}

    def run():
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        box["loss"] = float(loss.detach())

    run()
    run()
    _trim(spec)
    times, steady, faults = _steady_peak(run, spec["steps"], rss0_now)
    out = _timing(times, B * T, train_flops_per_token(config.model, T))
    out.update(params=int(sum(p.numel() for p in params)), loss=box["loss"],
               page_faults_per_step=faults, glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
               rss_growth_bytes=_maxrss_bytes() - rss0, steady_peak_bytes=steady, torch_version=torch.__version__,
               transformers_version=transformers.__version__, threads=torch.get_num_threads())
    return out


CHILDREN = {"matmul_jax": child_matmul_jax, "matmul_torch": child_matmul_torch, "ours": child_ours,
            "torch": child_torch}


def child_environ(environ, xla_flags: str | None = None, hugepages: bool | None = None) -> dict:
    """A child's environment: ``environ`` with ``XLA_FLAGS`` set (unless None) and malloc's huge
    pages (``xla_env.HUGEPAGE_TUNABLE`` in ``GLIBC_TUNABLES``) as our entry points' restart would
    set them (``True``: ``xla_env.hugepage_environ``'s rule, which keeps a value the user set),
    removed (``False``: any ``glibc.malloc.hugetlb``) or as inherited (None)."""
    env = dict(environ)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    if hugepages:
        env = xla_env.hugepage_environ(env) or env
    elif hugepages is False:
        name = xla_env.HUGEPAGE_TUNABLE.split("=", 1)[0]
        kept = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t.split("=", 1)[0] != name]
        env.pop("GLIBC_TUNABLES", None)
        if kept:
            env["GLIBC_TUNABLES"] = ":".join(kept)
    return env


def run_child(spec: dict, xla_flags: str | None = None, timeout: float = 600.0,
              hugepages: bool | None = None) -> dict:
    """Runs one measurement in a fresh interpreter (environment: :func:`child_environ`); returns
    its result dict (or an error)."""
    env = child_environ(os.environ, xla_flags, hugepages)
    cmd = [sys.executable, "-m", "benchmarks.train_throughput", "--child", json.dumps(spec)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s", "spec": spec}
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:], "spec": spec}
    out = json.loads(lines[-1][len("RESULT "):])
    out.update(spec=spec, wall_s=time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------- report

def machine_info() -> dict:
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "ram_gib": round(mem / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def _fmt_load(load) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def _fmt_count(x):
    return "" if x is None else f"{x:,.0f}"


def _hugepages_cell(r: dict) -> str:
    if "glibc_tunables" not in r:
        return ""
    name = xla_env.HUGEPAGE_TUNABLE.split("=", 1)[0]
    return "yes" if any(t == xla_env.HUGEPAGE_TUNABLE for t in r["glibc_tunables"].split(":")) else (
        "no" if name not in r["glibc_tunables"] else r["glibc_tunables"])


def _fmt_mb(x):
    return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"


def summarize(res: dict) -> dict:
    """Adds peaks, ratios and MFU to the raw results."""
    peaks = {fw: max(res["matmul"][fw]["gflops"].values()) for fw in ("jax", "torch")
             if "gflops" in res["matmul"].get(fw, {})}
    res["matmul_peak_gflops"] = max(peaks.values()) if peaks else None
    res["matmul_peak_by_framework"] = peaks
    for preset, row in res["presets"].items():
        ours, ref = row.get("ours", {}), row.get("torch_sdpa", {})
        if "tokens_per_s" in ours and "tokens_per_s" in ref:
            row["ratio_ours_over_torch_sdpa"] = ours["tokens_per_s"] / ref["tokens_per_s"]
        ratios = sorted(r["ours"] / r["torch_sdpa"] for r in row.get("rounds", [])
                        if r.get("ours") and r.get("torch_sdpa"))
        if ratios:
            row["round_ratios"] = ratios
            row["ratio_median_of_rounds"] = statistics.median(ratios)
        for key, r in row.items():
            if isinstance(r, dict) and "model_tflops_per_s" in r and res["matmul_peak_gflops"]:
                r["mfu_vs_measured_peak"] = r["model_tflops_per_s"] * 1e3 / res["matmul_peak_gflops"]
    return res


def markdown(res: dict) -> str:
    m, peak = res["machine"], res["matmul_peak_gflops"]
    lines = [
        "# Train-step throughput: icml_jax vs PyTorch `LlamaForCausalLM`", "",
        f"Date: {res['date']} · machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM · "
        f"jax {res['versions'].get('jax')} · torch {res['versions'].get('torch')} · "
        f"transformers {res['versions'].get('transformers')} · 1/5/15-min load average at start "
        f"{_fmt_load(res['loadavg_start'])}, at end {_fmt_load(res['loadavg_end'])} · run time "
        f"{res['runtime_s']:.0f} s", "",
        f"Command: `python -m benchmarks.train_throughput {' '.join(res['argv'])}`", "",
        f"Our XLA flags: `{res['xla_flags'] or '(none)'}`. FLOPs: MaxText convention "
        "(`icml_jax.analysis.flops.train_flops_per_token`: 6 × matmul params per token + causal "
        "attention counted as half; norms/softmax/optimizer not counted), the same count for both "
        f"frameworks. MFU = model FLOP/s ÷ best measured fp32 matmul ({peak:,.0f} GFLOP/s).", "",
        "| preset | params | batch×seq | ours tok/s | torch sdpa tok/s | ours/torch (median of rounds) | ours TFLOP/s | "
        "ours MFU | torch TFLOP/s | torch MFU | ours mem (XLA step / steady RSS / RSS growth) | "
        "torch mem (steady RSS / RSS growth) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # the load at the start only: by the end the benchmark's own children (2 busy threads for
    # ~2 minutes) have raised the 1-minute average by themselves
    busy = res["loadavg_start"][0] > 0.5 * m["cores"]
    if busy:
        lines[-2:-2] = [f"**Warning: the machine was busy (load average above {0.5 * m['cores']:.1f} on "
                        f"{m['cores']} cores) when this started; other processes competed for the cores, "
                        "which slows every measurement and torch's OpenMP threads more than XLA's, so "
                        "the numbers and especially the ratios are not representative. Rerun on an idle "
                        "machine.**", ""]
    for preset, row in res["presets"].items():
        o, t = row.get("ours", {}), row.get("torch_sdpa", {})
        if "tokens_per_s" not in o:
            lines.append(f"| {preset} | error: {str(o.get('error', t.get('error')))[:80]} |")
            continue
        tt = t.get("tokens_per_s")
        lines.append(
            f"| {preset} | {o['params'] / 1e6:.2f}M | {row['batch']}×{row['seq_len']} | "
            f"{o['tokens_per_s']:,.0f} | {tt and f'{tt:,.0f}'} | "
            f"{row.get('ratio_median_of_rounds', row.get('ratio_ours_over_torch_sdpa', float('nan'))):.2f}× | "
            f"{o['model_tflops_per_s']:.3f} | {o.get('mfu_vs_measured_peak', 0):.0%} | "
            f"{t.get('model_tflops_per_s', float('nan')):.3f} | {t.get('mfu_vs_measured_peak', 0):.0%} | "
            f"{_fmt_mb(o.get('xla_step_bytes'))} / {_fmt_mb(o.get('steady_peak_bytes'))} / "
            f"{_fmt_mb(o.get('rss_growth_bytes'))} | {_fmt_mb(t.get('steady_peak_bytes'))} / "
            f"{_fmt_mb(t.get('rss_growth_bytes'))} |")
    with_rounds = [(p, row) for p, row in res["presets"].items() if row.get("round_ratios")]
    if with_rounds:
        lines += ["", "The headline pair in interleaved rounds (each round: one `ours` and one `torch_sdpa` "
                  "child, the order alternating; the table above is round 1):", "",
                  "| preset | tok/s per round (ours / torch) | ours/torch per round | median | min–max |",
                  "|---|---|---|---|---|"]
        for preset, row in with_rounds:
            per = [(r.get("ours"), r.get("torch_sdpa")) for r in row["rounds"]]
            cells = ", ".join(f"{o:,.0f} / {t:,.0f}" if o and t else "error" for o, t in per)
            ratios = ", ".join(f"{o / t:.2f}×" if o and t else "–" for o, t in per)
            rr = row["round_ratios"]
            lines.append(f"| {preset} | {cells} | {ratios} | **{row['ratio_median_of_rounds']:.2f}×** | "
                         f"{rr[0]:.2f}–{rr[-1]:.2f}× |")
    lines += ["", "Other variants (tokens/s, step time min / median, steady RSS, minor page faults per "
              "timed step, whether malloc asked for huge pages):", "",
              "| preset | variant | tok/s | step min | step median | TFLOP/s | MFU | steady RSS | faults/step "
              "| huge pages |", "|---|---|---|---|---|---|---|---|---|---|"]
    for preset, row in res["presets"].items():
        for key, r in row.items():
            if isinstance(r, dict) and "tokens_per_s" in r:
                lines.append(f"| {preset} | {key} | {r['tokens_per_s']:,.0f} | {r['step_s_min'] * 1e3:,.0f} ms"
                             f" | {r['step_s_median'] * 1e3:,.0f} ms | {r['model_tflops_per_s']:.3f} | "
                             f"{r.get('mfu_vs_measured_peak', 0):.0%} | {_fmt_mb(r.get('steady_peak_bytes'))} | "
                             f"{_fmt_count(r.get('page_faults_per_step'))} | {_hugepages_cell(r)} |")
            elif isinstance(r, dict) and "error" in r:
                lines.append(f"| {preset} | {key} | error | {str(r['error'])[-120:]!r} | | | | | | |")
    lines += ["", "Dense fp32 matmul (GFLOP/s, best of the repetitions; M×K×N):", "",
              "| shape | jax | torch |", "|---|---|---|"]
    jg, tg = res["matmul"].get("jax", {}).get("gflops", {}), res["matmul"].get("torch", {}).get("gflops", {})
    for shape in jg.keys() | tg.keys():
        lines.append(f"| {shape} | {jg.get(shape, float('nan')):,.0f} | {tg.get(shape, float('nan')):,.0f} |")
    jb, tb = (res["matmul"].get(fw, {}).get("bmm_gflops", {}) for fw in ("jax", "torch"))
    if jb or tb:
        lines += ["", "Batched fp32 matmul (GFLOP/s; batch×(M×K×N), the attention core's dots on `20m`; "
                  "not part of the peak; XLA:CPU runs a batched dot on one core):", "",
                  "| shape | jax | torch |", "|---|---|---|"]
        for shape in jb.keys() | tb.keys():
            lines.append(f"| {shape} | {jb.get(shape, float('nan')):,.0f} | {tb.get(shape, float('nan')):,.0f} |")
    variants = res["matmul"].get("bmm_variants", {})
    if variants:
        shapes = [name for _, name, *_ in _matmul_cases(bmm_only=True)]
        lines += ["", "The batched matmuls of jax under other XLA:CPU settings (GFLOP/s; each row its own "
                  "process, our flags plus the row's; `split into N dots`: each batched matmul as N "
                  "independent dots over the batch, concatenated):", "",
                  "| variant | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
        for name, r in variants.items():
            g = r.get("bmm_gflops", {})
            cells = [f"{g[s]:,.0f}" if s in g else "error" for s in shapes]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Notes: step time is the minimum over the timed steps after a warm-up step "
              "(the machine may be shared, see the load average; the median is in the JSON). "
              "Peak memory: XLA step = `compiled.memory_analysis()` arguments + outputs − aliased + "
              "temporaries; steady RSS = the child's RSS high-water mark over the timed steps "
              "(reset after the warm-up with `/proc/self/clear_refs`) minus its RSS before the "
              "model was built: params, optimizer state, activations and whatever the runtime "
              "keeps, the number comparable across frameworks; RSS growth = `ru_maxrss` of the "
              "child from before the model is built to after the last step (for jax this "
              "includes the XLA compiler's peak). Both children return their freed heap pages to the "
              "OS after the warm-up (`xla_env.release_host_memory`, glibc `malloc_trim(0)`, which our "
              "train loop calls after its first step); the `*_no_trim` rows skip it. "
              f"A/B rows: {', '.join(f'`{k}` = ours with config.model {v}' for k, v in AB_VARIANTS.items())}. "
              f"Huge pages: `ours` runs with `GLIBC_TUNABLES={xla_env.HUGEPAGE_TUNABLE}` where our entry "
              "points restart with it (`xla_env.restart_with_hugepages`: glibc >= 2.35, kernel THP mode "
              "`madvise`; here: "
              f"{'yes' if res.get('hugepages', {}).get('applies') else 'no'}), so that the step's large "
              "temporary buffer, which XLA allocates afresh each step, is faulted in as 2 MiB pages; "
              "`ours_no_hugepages` without it; torch rows run without it, as its users run it, and "
              "`torch_sdpa_hugepages` with it (the control). "
              "`ours_default_flags` = the same step under jax's default XLA flags; `ours_vector256` "
              f"(on CPUs with AVX-512) = ours without `{xla_env.VECTOR_FLAG}`. Torch: "
              "`LlamaForCausalLM` fp32, AdamW (decay on matrices only, like ours) + grad-norm clip, "
              "cross-entropy on the same tokens/targets, `torch.set_num_threads(cores)`.", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- driver

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--presets", default="small,20m")
    p.add_argument("--batch", default="small=16,20m=8",
                   help="rows per step per preset (preset's own batch_size when not listed)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the headline pair (ours, torch_sdpa), alternating which goes first; "
                        "the ratio is the median of the per-round ratios")
    p.add_argument("--matmul_reps", type=int, default=8)
    p.add_argument("--xla_flags", default=RECOMMENDED_XLA_FLAGS, help="XLA_FLAGS for our step")
    p.add_argument("--skip_default_flags", action="store_true",
                   help="do not also time our step under jax's default XLA flags")
    p.add_argument("--skip_eager", action="store_true", help="do not time torch eager attention")
    p.add_argument("--skip_torch", action="store_true")
    p.add_argument("--skip_ab", action="store_true", help="do not time the AB_VARIANTS of our step")
    p.add_argument("--skip_bmm_variants", action="store_true",
                   help="do not time the batched matmuls under BMM_FLAG_VARIANTS and split")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: give at least 1 (round 1 is the main run of the pair)")
    return args


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        print("RESULT " + json.dumps(CHILDREN[spec["kind"]](spec)), flush=True)
        return {}
    t_start, threads = time.time(), len(os.sched_getaffinity(0))
    base_flags = os.environ.get("XLA_FLAGS", "")
    ours_flags = " ".join(x for x in (base_flags, args.xla_flags) if x)
    batches = dict(kv.split("=") for kv in args.batch.split(",") if kv)
    log = lambda msg: print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)  # noqa: E731

    res = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "argv": argv, "machine": machine_info(), "loadavg_start": os.getloadavg(),
           "xla_flags": ours_flags, "flop_convention": "MaxText: 6*matmul_params + causal attention/2",
           "matmul": {}, "presets": {}, "versions": {}}
    # whether our entry points would restart with malloc's huge pages on this machine (the A/B below)
    hugepages_apply = (xla_env.HUGEPAGE_TUNABLE in child_environ(os.environ, hugepages=True)
                       .get("GLIBC_TUNABLES", "").split(":"))
    res["glibc_tunables"] = "per child: each row's glibc_tunables"  # not this parent's
    res["hugepages"] = {"tunable": xla_env.HUGEPAGE_TUNABLE, "applies": hugepages_apply,
                        "thp_mode": xla_env.thp_mode(), "glibc": xla_env.glibc_version()}
    res["matmul"]["jax"] = run_child({"kind": "matmul_jax", "reps": args.matmul_reps}, ours_flags,
                                     hugepages=True)
    log(f"jax matmul: {res['matmul']['jax'].get('gflops', res['matmul']['jax'])}")
    if not args.skip_torch:
        res["matmul"]["torch"] = run_child({"kind": "matmul_torch", "reps": args.matmul_reps,
                                            "threads": threads}, hugepages=False)
        log(f"torch matmul: {res['matmul']['torch'].get('gflops', res['matmul']['torch'])}")
    if not args.skip_bmm_variants:
        bmm = {"kind": "matmul_jax", "reps": args.matmul_reps, "bmm_only": True}
        runs = [(name, bmm, f"{ours_flags} {flag}") for name, flag in BMM_FLAG_VARIANTS.items()]
        runs.append((f"split into {BMM_SPLIT} dots", {**bmm, "split": BMM_SPLIT}, ours_flags))
        v = res["matmul"]["bmm_variants"] = {}
        for name, spec, flags in runs:
            v[name] = run_child(spec, flags, hugepages=True)
            log(f"batched matmul, {name}: {v[name].get('bmm_gflops', v[name])}")
    for preset in [p for p in args.presets.split(",") if p]:
        config = _preset_config(preset)
        B = int(batches.get(preset, config.train.batch_size))
        row = res["presets"][preset] = {"batch": B, "seq_len": config.data.seq_len}
        common = {"preset": preset, "batch": B, "steps": args.steps}
        # (name, spec, XLA_FLAGS, huge pages): ours as the CLI runs it, torch as its users run it
        runs = [("ours", {"kind": "ours", **common}, ours_flags, True)]
        torch_spec = {"kind": "torch", "attn": "sdpa", "threads": threads, **common}
        if not args.skip_ab:
            runs += [(name, {"kind": "ours", "model_overrides": o, **common}, ours_flags, True)
                     for name, o in AB_VARIANTS.items()]
            runs.append(("ours_no_trim", {"kind": "ours", "trim": False, **common}, ours_flags, True))
            if hugepages_apply:
                runs.append(("ours_no_hugepages", {"kind": "ours", **common}, ours_flags, False))
            if xla_env.VECTOR_FLAG in ours_flags.split():
                runs.append(("ours_vector256", {"kind": "ours", **common},
                             " ".join(f for f in ours_flags.split() if f != xla_env.VECTOR_FLAG), True))
            if not args.skip_torch:
                runs.append(("torch_sdpa_no_trim", {**torch_spec, "trim": False}, None, False))
                if hugepages_apply:
                    runs.append(("torch_sdpa_hugepages", torch_spec, None, True))
        if not args.skip_torch:
            runs.append(("torch_sdpa", torch_spec, None, False))
        if not args.skip_default_flags:
            runs.append(("ours_default_flags", {"kind": "ours", **common}, base_flags, True))
        if not args.skip_torch and not args.skip_eager:
            runs.append(("torch_eager", {**torch_spec, "attn": "eager",
                                         "steps": max(2, args.steps // 2)}, None, False))
        def measure(name, spec, flags, hugepages):
            r = run_child(spec, flags, hugepages=hugepages)
            log(f"{preset} {name}: " + (f"{r['tokens_per_s']:,.0f} tok/s, step {r['step_s_min']:.3f}s "
                                        f"(median {r['step_s_median']:.3f}s)" if "tokens_per_s" in r
                                        else f"ERROR {r.get('error')}"))
            return r

        for name, spec, flags, hugepages in runs:
            row[name] = measure(name, spec, flags, hugepages)
        # more rounds of the headline pair, alternating which runs first (round 1 is the above)
        pair = {name: run for name, *run in runs if name in ("ours", "torch_sdpa")}
        if len(pair) == 2:
            row["rounds"] = [{k: row[k].get("tokens_per_s") for k in pair}]
            for i in range(1, args.rounds):
                order = list(pair) if i % 2 == 0 else list(pair)[::-1]
                got = {k: measure(f"{k} (round {i + 1})", *pair[k]) for k in order}
                row["rounds"].append({k: got[k].get("tokens_per_s") for k in pair})
    for r in [v for row in res["presets"].values() for v in row.values() if isinstance(v, dict)]:
        for k in ("jax", "torch", "transformers"):
            if f"{k}_version" in r:
                res["versions"][k] = r[f"{k}_version"]
    res["loadavg_end"] = os.getloadavg()
    res["runtime_s"] = time.time() - t_start
    summarize(res)
    md = markdown(res)
    write_report(args.out, "train_throughput", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main()
