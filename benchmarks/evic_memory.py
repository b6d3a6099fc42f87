"""EVIC's per-example gradients: peak memory and time against the chunk size, on a ~5.6M-parameter
decoder (6 layers, d = 256, byte vocabulary), 256 examples of 64 tokens, countsketch k = 4096 and
the Adam preconditioner.

  python -m benchmarks.evic_memory      -> benchmarks/results/evic_memory.{json,md}

Each chunk size runs in its own process (peak RSS = ``ru_maxrss`` of that process, so it covers
the compile too); the time is the second call's (compiled). Memory grows with the chunk
(~2 x chunk x params floats of gradients and their preconditioned copies, plus the activations of
chunk examples), time falls with it while the vmapped matmuls grow."""
import json
import os
import subprocess
import sys

from benchmarks.common import RESULTS_DIR, write_report

CHUNKS = (1, 4, 16, 64)
N, T = 256, 64

_WORKER = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp, ml_collections, optax
from icml_jax.config_utils import load_config
from icml_jax.models import build_model
from icml_jax.losses import response_token_logps
from icml_jax.train import evic
chunk, n, t = (int(x) for x in sys.argv[1:4])
c = load_config("configs/lm.py:tiny", unlocked=True).model
c.update(dict(d_model=256, num_layers=6, num_heads=8, num_kv_heads=8, head_dim=32, ffn_dim=1024,
              max_seq_len=t))
model = build_model(c)
params = model.init(jax.random.key(0), jnp.zeros((1, t), jnp.int32))["params"]
n_params = sum(x.size for x in jax.tree.leaves(params))
st = evic.adam_state(optax.adam(1e-3).init(params))
direction = lambda g: evic.adam_direction(g, st, 0.9, 0.999, 1e-8)
def loss(p, ex):
    b = {k: v[None] for k, v in ex.items()}
    lp = response_token_logps(model.apply({"params": p}, b["inputs"], b["positions"], b["segment_ids"]),
                              b["inputs"], b["response_mask"])
    return -lp.sum() / b["response_mask"].sum()
key = jax.random.key(1)
ex = {"inputs": jax.random.randint(key, (n, t), 3, 200), "positions": jnp.tile(jnp.arange(t), (n, 1)),
      "segment_ids": jnp.ones((n, t), jnp.int32), "response_mask": jnp.ones((n, t), jnp.int32).at[:, :8].set(0)}
sk = evic.make_sketch(params, "countsketch", 4096)
f = jax.jit(lambda p, e: evic.features(loss, p, e, sk, direction=direction, chunk=chunk))
jax.block_until_ready(f(params, ex))
t0 = time.perf_counter(); jax.block_until_ready(f(params, ex)); sec = time.perf_counter() - t0
print("RESULT" + json.dumps({"chunk": chunk, "params": int(n_params), "seconds": sec,
      "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""


def main():
    rows = []
    for chunk in CHUNKS:
        p = subprocess.run([sys.executable, "-c", _WORKER, str(chunk), str(N), str(T)],
                           capture_output=True, text=True, timeout=1200)
        if p.returncode:
            raise SystemExit(f"chunk {chunk} failed:\n{p.stderr[-2000:]}")
        rows.append(json.loads([x for x in p.stdout.splitlines() if x.startswith("RESULT")][-1][6:]))
        print(rows[-1], flush=True)
    md = ["# EVIC per-example gradients: memory and time vs chunk size", "",
          f"{rows[0]['params']:,}-parameter decoder (6 layers, d = 256), {N} examples x {T} tokens, "
          "Adam direction + countsketch (k = 4096); one process per chunk size (peak RSS includes "
          "JAX, XLA and the compile); time of the second, compiled call. One run on this 2-core CPU "
          f"({os.environ.get('BENCH_NOTE', 'idle')}).",
          "", "| chunk | peak RSS (GiB) | seconds | ms per example |", "|---|---|---|---|"]
    md += [f"| {r['chunk']} | {r['peak_rss_gib']:.2f} | {r['seconds']:.2f} | "
           f"{1000 * r['seconds'] / N:.1f} |" for r in rows]
    write_report(RESULTS_DIR, "evic_memory", {"n": N, "seq_len": T, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
