"""Runs the real entry point in a subprocess (fresh JAX, optional fake devices)."""
import json
import os
import subprocess
import sys

from icml_jax.config_utils import REPO_ROOT
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


def train_losses(workdir) -> dict:
    """step -> loss from metrics.jsonl (the last line per step wins)."""
    out = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                out[r["step"]] = r["loss"]
    return out
