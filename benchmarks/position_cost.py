"""Train-step time of each position embedding (rope, fope, alibi, nope) at the same dims.

Run:
  python -m benchmarks.position_cost [--preset=small] [--steps=10] [--rounds=3] [--batch=16]

For every method it builds the trainer's own jitted, donated step (``create_sharded_state`` +
``make_train_step`` + ``LMTask.loss`` + AdamW with the frozen FoPE mask, exactly as
``train_and_evaluate``) on ``configs/lm.py:PRESET`` with only ``config.model.position`` changed
(FoPE: fixed coefficients, ``train_seq_len`` = the preset's seq_len), on one synthetic batch.
All four steps are compiled first; then ``--rounds`` rounds each time ``--steps`` steps of every
method in turn (interleaved, so a load change on a shared machine hits all methods alike). The
step time is the minimum over all timed steps (median reported too) and the ratio is against RoPE.
The XLA CPU flags are ``icml_jax.xla_env.use_default_flags()``'s, appended to any XLA_FLAGS set.
Results: benchmarks/results/position_cost.{json,md} (written atomically).
"""
import argparse
import datetime
import os
import platform
import sys
import time

from benchmarks.common import RESULTS_DIR, write_report
from icml_jax import xla_env

METHODS = ("rope", "fope", "alibi", "nope")
def build_step(preset: str, position: str, batch: int):
    """(compiled step, state, batch, tokens per step) for one method."""
    import warnings
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from icml_jax.config_utils import load_config
    from icml_jax.tasks import TASKS
    from icml_jax import sharding as mesh_lib
    from icml_jax.train.optimizer import make_optimizer
    from icml_jax.train.trainer import create_sharded_state, make_train_step
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    config = load_config(f"configs/lm.py:{preset}", unlocked=True)
    config.model.position = position
    config.model.train_seq_len = config.data.seq_len
    config.train.batch_size = batch
    T = config.data.seq_len
    toks = np.random.default_rng(0).integers(3, 259, (batch, T + 1)).astype(np.int32)
    data = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": np.ones((batch, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (batch, T)).copy()}
    task = TASKS.get("lm")(config)
    mesh, rules = mesh_lib.make_mesh(config.mesh), mesh_lib.logical_rules(config.mesh)
    tx = make_optimizer(config.train, model_cfg=config.model)
    state, shardings = create_sharded_state(task, tx, config, mesh, rules)
    bs = mesh_lib.batch_sharding(mesh)
    data = jax.device_put({k: jnp.asarray(v) for k, v in data.items()}, bs)
    with mesh, nn.logical_axis_rules(rules):
        step = jax.jit(make_train_step(task, tx, 1), in_shardings=(shardings, bs),
                       out_shardings=(shardings, None), donate_argnums=0)
        compiled = step.lower(state, data).compile()
    return compiled, state, data, batch * T, config


def run(preset: str, steps: int, rounds: int, batch: int) -> dict:
    import jax
    built = {m: build_step(preset, m, batch) for m in METHODS}
    states = {m: built[m][1] for m in METHODS}
    times = {m: [] for m in METHODS}

    def one(m):
        compiled, _, data, _, _ = built[m]
        t0 = time.perf_counter()
        states[m], metrics = compiled(states[m], data)
        jax.block_until_ready((states[m], metrics))
        return time.perf_counter() - t0

    for m in METHODS:
        one(m)  # warm-up
    for _ in range(rounds):
        for m in METHODS:
            times[m] += [one(m) for _ in range(steps)]
    cfg = built["rope"][4]
    rope_min = min(times["rope"])
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "loadavg": os.getloadavg(), "jax": jax.__version__,
                       "xla_flags": os.environ.get("XLA_FLAGS", "")},
           "dims": {"preset": preset, "batch": batch, "seq_len": cfg.data.seq_len,
                    "d_model": cfg.model.d_model, "num_layers": cfg.model.num_layers,
                    "num_heads": cfg.model.num_heads, "num_kv_heads": cfg.model.num_kv_heads,
                    "head_dim": cfg.model.head_dim, "max_seq_len": cfg.model.max_seq_len},
           "steps_per_round": steps, "rounds": rounds, "methods": {}}
    for m in METHODS:
        t = sorted(times[m])
        res["methods"][m] = {"step_s_min": t[0], "step_s_median": t[len(t) // 2], "step_s_all": times[m],
                             "tokens_per_s": built[m][3] / t[0], "vs_rope_min": t[0] / rope_min,
                             "vs_rope_median": t[len(t) // 2] / sorted(times["rope"])[len(t) // 2]}
    return res


def markdown(res: dict) -> str:
    d = res["dims"]
    lines = ["# Train-step cost per position embedding", "",
             f"`python -m benchmarks.position_cost --preset={d['preset']}` on {res['date']}; "
             f"{res['machine']['cpus']} CPUs, load average {res['machine']['loadavg'][0]:.1f} at the end, "
             f"jax {res['machine']['jax']}, XLA_FLAGS=`{res['machine']['xla_flags']}`.", "",
             f"Dims: batch {d['batch']} x seq {d['seq_len']}, d_model {d['d_model']}, {d['num_layers']} "
             f"layers, {d['num_heads']} heads ({d['num_kv_heads']} kv) of {d['head_dim']}, FoPE tables "
             f"for max_seq_len {d['max_seq_len']}. {res['rounds']} interleaved rounds x "
             f"{res['steps_per_round']} steps per method.", "",
             "| method | step (min) ms | step (median) ms | tokens/s | min vs RoPE | median vs RoPE |",
             "|---|---|---|---|---|---|"]
    for m, r in res["methods"].items():
        lines.append(f"| {m} | {r['step_s_min'] * 1e3:.1f} | {r['step_s_median'] * 1e3:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['vs_rope_min']:.3f} | {r['vs_rope_median']:.3f} |")
    lines += ["", "FoPE computes its sin/cos tables [max_seq_len, kv heads, head_dim/2] once per layer "
              "and step from the (fixed) coefficients and gathers them per token; the target is "
              "FoPE within 10% of RoPE.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=RESULTS_DIR)
    a = p.parse_args(argv)
    xla_env.use_default_flags()  # before the first JAX computation
    res = run(a.preset, a.steps, a.rounds, a.batch)
    md = markdown(res)
    write_report(a.out, "position_cost", res, md)
    print(md)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
