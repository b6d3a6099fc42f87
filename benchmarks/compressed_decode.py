"""Greedy decoding speed and memory of TLR-pruned models and Puzzle children beside their dense parent.

  python -m benchmarks.compressed_decode [--preset=20m] [--batches=1,8] [--repeats=3]
      [--new_tokens=128] [--prompt=64]

The parent is ``configs/lm.py``'s preset with random weights (decoding speed does not depend on
what the weights learned). From it: magnitude 50% per row, prune only (the same shapes as the
parent: S is stored dense with zeros) and TLR-style sparse + low-rank at k = 16 (one-shot SVD
factors: the same shapes and cost as TLR's). Each path runs ``decode.generate`` on random 64-token
prompts for 128 new tokens, warmed up once (compile excluded), median of ``--repeats`` (the
timed runs go round-robin over the models, the same prompts for all).
Parameter memory: the bytes stored (S dense + factors) and what a sparse format would need
(nnz(S) + factors, values only, float32).

Puzzle children (``config.model.blocks``, models/hetero.py) of the same parent, random weights, at
about half its block parameters and KV cache: every layer with half the KV heads and FFN 4/11 wide;
a mixed layout (every other layer's attention a no-op, FFNs F, F/2, ..., F/4); the last half of
the layers dropped (no-op attention and FFN). Per model: params, KV-cache bytes per token
(``hetero.kv_bytes_per_token`` at the compute dtype) and tokens/s, each also as a ratio to the
parent measured in the same run.
Results: benchmarks/results/compressed_decode.{json,md}.
"""
import argparse
import json
import os
import statistics

import numpy as np

from benchmarks.common import RESULTS_DIR, time_calls, write_report

NEW_TOKENS, PROMPT = 128, 64


def puzzle_layouts(m) -> dict[str, tuple[str, str]]:
    """name -> (config.model.blocks.attention, .ffn): children at about half of ``m``'s block
    params and KV cache (exactly half the KV cache; 49-50% of the block params at 20m dims)."""
    L, G, F = int(m.num_layers), int(m.num_kv_heads), int(m.ffn_dim)
    join = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    ffn = [F if i == 0 else F // 4 if i >= L - L // 3 else F // 2 for i in range(L)]
    keep = L - L // 2
    return {
        f"puzzle: KV {G // 2}/{G}, FFN {F * 4 // 11}/{F} everywhere": (
            join([G // 2] * L), join([F * 4 // 11] * L)),
        "puzzle: attention no-op in odd layers, FFN F..F/4": (
            join(["noop" if i % 2 else G for i in range(L)]), join(ffn)),
        f"puzzle: last {L - keep} of {L} layers no-op": (
            join([G] * keep + ["noop"] * (L - keep)), join([F] * keep + ["noop"] * (L - keep))),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new_tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--prompt", type=int, default=PROMPT)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from icml_jax import xla_env
    xla_env.use_defaults()
    import jax
    import flax.linen as nn

    from icml_jax.compress import prune
    from icml_jax.config_utils import load_config
    from icml_jax.inference import decode
    from icml_jax.models import build_model, hetero

    NEW, PROMPT_LEN = args.new_tokens, args.prompt
    cfg = load_config(f"configs/lm.py:{args.preset}", unlocked=True).model
    cfg.max_seq_len = max(cfg.max_seq_len, PROMPT_LEN + NEW)
    init = lambda c: jax.tree.map(np.asarray, nn.meta.unbox(  # noqa: E731
        build_model(c).init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]))
    params = init(cfg)
    variants = {"dense parent": (params, cfg)}
    variants["magnitude 50%, prune only"] = prune.prune_model(params, cfg, sparsity=0.5)[:2]
    variants["magnitude 50% + rank-16 factors"] = prune.prune_model(params, cfg, sparsity=0.5,
                                                                    refine="svd", rank=16)[:2]
    puzzle = {}
    for name, (attention, ffn) in puzzle_layouts(cfg).items():
        c = load_config(f"configs/lm.py:{args.preset}", unlocked=True).model
        c.max_seq_len = cfg.max_seq_len
        c.blocks.attention, c.blocks.ffn = attention, ffn
        variants[name] = (init(c), c)
        puzzle[name] = dict(attention=attention, ffn=ffn)
    value_bytes = np.dtype(cfg.dtype).itemsize  # the KV cache is stored at the compute dtype
    rng = np.random.default_rng(0)
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        # the same prompts for every model; one warm-up (compile) each, then the timed runs taken
        # round-robin over the models, so that load from other processes falls on all of them alike
        prompts = rng.integers(3, cfg.vocab_size, (B, PROMPT_LEN)).tolist()
        runs, compile_s, times = {}, {}, {name: [] for name in variants}
        for name, (p, c) in variants.items():
            runs[name] = lambda p=p, c=c: decode.generate(c, p, prompts, key=jax.random.key(0),
                                                          max_new_tokens=NEW, temperature=0)
            compile_s[name] = time_calls(runs[name], 1)[0]
        for _ in range(args.repeats):
            for name in variants:
                times[name] += time_calls(runs[name], 1)
        for name, (p, c) in variants.items():
            count = prune.sparse_param_count(p, c) if name not in puzzle else dict(nonzero=0, dense=1)
            n_params = sum(np.asarray(x).size for x in jax.tree.leaves(p))
            rows.append(dict(variant=name, batch=B, tokens_per_s=B * NEW / statistics.median(times[name]),
                             compile_s=compile_s[name], stored_mib=n_params * 4 / 2**20, params=n_params,
                             kv_bytes_per_token=hetero.kv_bytes_per_token(c, value_bytes),
                             block_nonzero=count["nonzero"], block_dense=count["dense"],
                             **({"blocks": puzzle[name]} if name in puzzle else {})))
            print(rows[-1], flush=True)
    base = {r["batch"]: r for r in rows if r["variant"] == "dense parent"}
    for r in rows:
        ref = base[r["batch"]]
        r.update(speed_vs_parent=r["tokens_per_s"] / ref["tokens_per_s"],
                 params_vs_parent=r["params"] / ref["params"],
                 kv_vs_parent=r["kv_bytes_per_token"] / ref["kv_bytes_per_token"])
    md = ["# Decoding TLR-pruned models and Puzzle children beside the dense parent", "",
          f"`configs/lm.py:{args.preset}` dimensions, random weights; {PROMPT_LEN}-token prompts, {NEW} "
          f"new tokens, greedy; median of {args.repeats} after a warm-up, runs round-robin over the "
          f"models; one run on this CPU ({os.environ.get('BENCH_NOTE', 'idle')}). Stored = every param as float32 (S is kept dense with "
          "zeros); sparse need = non-zero block weights + factor entries over the dense block projections.", "",
          "| variant | batch | tokens/s | vs parent | stored MiB | sparse need (block projections) |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['speed_vs_parent']:.2f}x | "
           f"{r['stored_mib']:.1f} | {r['block_nonzero'] / r['block_dense']:.3f} |"
           for r in rows if r["variant"] not in puzzle]
    md += ["", "Pruned weights are zeros in dense kernels, so pruning alone saves no time or memory here; the "
           "factors add two thin matmuls per projection. The sparse need is what a sparse kernel could "
           "store; none is used on this CPU.", "",
           "## Puzzle children (heterogeneous layouts, `config.model.blocks`)", "",
           f"Same parent and prompts; KV bytes per token at the compute dtype ({cfg.dtype}). Layouts "
           "(attention; FFN per layer): " + "; ".join(
               f"{n.split(': ', 1)[1]}: `{b['attention']}`; `{b['ffn']}`" for n, b in puzzle.items()) + ".", "",
           "| model | params | vs parent | KV bytes/token | vs parent | batch | tokens/s | vs parent |",
           "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['params']:,} | {r['params_vs_parent']:.2f}x | {r['kv_bytes_per_token']:,} | "
           f"{r['kv_vs_parent']:.2f}x | {r['batch']} | {r['tokens_per_s']:.1f} | {r['speed_vs_parent']:.2f}x |"
           for r in rows if r["variant"] in puzzle or r["variant"] == "dense parent"]
    result = {"preset": args.preset, "new_tokens": NEW, "prompt": PROMPT_LEN, "rows": rows}
    write_report(args.out, "compressed_decode", result, "\n".join(md) + "\n")
    return result


if __name__ == "__main__":
    main()
