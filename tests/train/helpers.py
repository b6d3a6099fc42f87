"""Runs the real entry point in a subprocess (fresh JAX, optional fake devices), or its training
in this process when one CPU device will do (no JAX start-up, compiles shared with the worker)."""
import json
import os
import subprocess
import sys

from icml_jax.config_utils import REPO_ROOT, load_config
from tests.jax_env import subprocess_env


def main_cmd(workdir, *overrides, preset="tiny"):
    return [sys.executable, "-m", "icml_jax.main", f"--config=configs/lm.py:{preset}",
            f"--workdir={workdir}", *overrides]


def env(devices: int = 1, data_dir: str = None):
    return subprocess_env(devices, **({"TFDS_DATA_DIR": data_dir} if data_dir else {}))


def run_main(workdir, *overrides, devices=1, timeout=300, check=True, data_dir=None):
    p = subprocess.run(main_cmd(workdir, *overrides), cwd=REPO_ROOT, env=env(devices, data_dir),
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"main failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def cli_config(config, *overrides):
    """The config ``python -m icml_jax.main --config=CONFIG OVERRIDES`` trains, parsed by the same
    absl/ml_collections flag as the entry point (so overrides mean exactly what they mean there)."""
    from absl import flags
    from ml_collections import config_flags
    path, _, preset = config.partition(":")
    spec = os.path.join(REPO_ROOT, path) + (f":{preset}" if preset else "")
    argv = ["icml_jax.main", f"--config={spec}", *overrides]
    fv = flags.FlagValues()  # the overrides are read from sys_argv, not sys.argv
    config_flags.DEFINE_config_file("config", None, flag_values=fv, lock_config=True,
                                    sys_argv=argv)
    fv(argv)
    return fv.config


def train_in_process(workdir, *overrides, config="configs/lm.py:tiny", data_dir=None,
                     with_state=False):
    """What ``python -m icml_jax.main --config=CONFIG --workdir=WORKDIR OVERRIDES`` trains, run by
    ``train_and_evaluate`` in this process (one CPU device) -> its summary. ``data_dir`` (the
    subprocesses' $TFDS_DATA_DIR) goes in as ``config.data.data_dir``: TFDS reads the variable
    once, when it is first imported, so setting it now would not reach this process."""
    from icml_jax.train import trainer
    cfg = cli_config(config, *overrides)
    if data_dir:
        cfg.data.data_dir = data_dir
    state, summary = trainer.train(cfg, str(workdir))
    return (state, summary) if with_state else summary


def sharding_digest(state, summary) -> dict:
    """JSON-able {"devices", "eval_loss", "shardings": {param path: [spec, shape, shard shape]}}
    of what ``trainer.train`` returned."""
    import jax
    return {"devices": jax.device_count(), "eval_loss": summary["eval_loss"], "shardings": {
        jax.tree_util.keystr(path): [str(x.sharding.spec), list(x.shape),
                                     list(x.addressable_shards[0].data.shape)]
        for path, x in jax.tree_util.tree_leaves_with_path(state.params)}}


def restore_digest(workdir, out, mesh) -> dict:
    """Loads ``workdir``'s checkpoint onto this process's devices with ``config.mesh`` = ``mesh``;
    writes its params and optimizer state to ``out`` (npz) -> {"step", "devices", "split": the
    params split over more than one device}."""
    import jax
    import numpy as np
    from icml_jax.train import trainer
    c = load_config("configs/lm.py:tiny", unlocked=True)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    state, step = trainer.load_state(c, workdir)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(state.params)}
    split = sorted(k for k, v in flat.items()
                   if len({str(i) for i in v.sharding.devices_indices_map(v.shape).values()}) > 1)
    np.savez(out, **{k: np.asarray(v) for k, v in flat.items()},
             **{"opt/" + jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(state.opt_state)})
    return {"step": int(step), "devices": jax.device_count(), "split": split}


def train_losses(workdir) -> dict:
    """step -> loss from metrics.jsonl (the last line per step wins)."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
    return out
