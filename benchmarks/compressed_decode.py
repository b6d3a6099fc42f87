"""Greedy decoding speed and parameter memory of TLR-pruned models beside their dense parent.

  python -m benchmarks.compressed_decode [--preset=20m] [--batches=1,8] [--repeats=3]

The parent is ``configs/lm.py``'s preset with random weights (decoding speed does not depend on
what the weights learned). From it: magnitude 50% per row, prune only (the same shapes as the
parent: S is stored dense with zeros) and TLR-style sparse + low-rank at k = 16 (one-shot SVD
factors: the same shapes and cost as TLR's). Each path runs ``decode.generate`` on random 64-token
prompts for 128 new tokens, warmed up once (compile excluded), median of ``--repeats``.
Parameter memory: the bytes stored (S dense + factors) and what a sparse format would need
(nnz(S) + factors, values only, float32).
Results: benchmarks/results/compressed_decode.{json,md}.
"""
import argparse
import json
import os
import time

import numpy as np

from benchmarks.common import RESULTS_DIR, median_time, write_report

NEW_TOKENS, PROMPT = 128, 64


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="20m")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    from icml_jax import xla_env
    xla_env.use_defaults()
    import jax
    import flax.linen as nn

    from icml_jax.compress import prune
    from icml_jax.config_utils import load_config
    from icml_jax.inference import decode
    from icml_jax.models import build_model

    cfg = load_config(f"configs/lm.py:{args.preset}", unlocked=True).model
    cfg.max_seq_len = max(cfg.max_seq_len, PROMPT + NEW_TOKENS)
    params = nn.meta.unbox(build_model(cfg).init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"])
    params = jax.tree.map(np.asarray, params)
    variants = {"dense parent": (params, cfg)}
    variants["magnitude 50%, prune only"] = prune.prune_model(params, cfg, sparsity=0.5)[:2]
    variants["magnitude 50% + rank-16 factors"] = prune.prune_model(params, cfg, sparsity=0.5,
                                                                    refine="svd", rank=16)[:2]
    rng = np.random.default_rng(0)
    rows = []
    for name, (p, c) in variants.items():
        count = prune.sparse_param_count(p, c)
        stored = sum(np.asarray(x).size for x in jax.tree.leaves(p)) * 4
        for B in (int(b) for b in args.batches.split(",")):
            prompts = rng.integers(3, c.vocab_size, (B, PROMPT)).tolist()
            run = lambda: decode.generate(c, p, prompts, key=jax.random.key(0),  # noqa: E731
                                          max_new_tokens=NEW_TOKENS, temperature=0)
            t0 = time.perf_counter()
            run()
            compile_s = time.perf_counter() - t0
            sec = median_time(run, args.repeats)
            rows.append(dict(variant=name, batch=B, tokens_per_s=B * NEW_TOKENS / sec, compile_s=compile_s,
                             stored_mib=stored / 2**20, block_nonzero=count["nonzero"],
                             block_dense=count["dense"]))
            print(rows[-1], flush=True)
    dense = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"] == "dense parent"}
    md = ["# Decoding TLR-pruned models beside the dense parent", "",
          f"`configs/lm.py:{args.preset}` dimensions, random weights; {PROMPT}-token prompts, {NEW_TOKENS} new "
          f"tokens, greedy; median of {args.repeats} after a warm-up; one run on this CPU "
          f"({os.environ.get('BENCH_NOTE', 'idle')}). Stored = every param as float32 (S is kept dense with "
          "zeros); sparse need = non-zero block weights + factor entries over the dense block projections.", "",
          "| variant | batch | tokens/s | vs parent | stored MiB | sparse need (block projections) |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['variant']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / dense[r['batch']]:.2f}x | "
           f"{r['stored_mib']:.1f} | {r['block_nonzero'] / r['block_dense']:.3f} |" for r in rows]
    md += ["", "Pruned weights are zeros in dense kernels, so pruning alone saves no time or memory here; the "
           "factors add two thin matmuls per projection. The sparse need is what a sparse kernel could "
           "store; none is used on this CPU."]
    result = {"preset": args.preset, "rows": rows}
    write_report(args.out, "compressed_decode", result, "\n".join(md) + "\n")
    return result


if __name__ == "__main__":
    main()
