"""``python -m icml_jax.sample``: restores a trainer-style workdir and prints continuations."""
import json
import os
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from icml_jax.config_utils import REPO_ROOT, load_config
from icml_jax.models.decoder import build_model
from icml_jax.train import checkpoint as ckpt_lib
from icml_jax.train.optimizer import make_optimizer
from icml_jax.train.trainer import TrainState, _TrainStateWithKey, _config_dict

# the module's workdir fixture is built once, on one xdist worker
pytestmark = pytest.mark.xdist_group("sample_cli_workdir")


# runs the CLI and, as the interpreter exits, says whether JAX was ever imported
_REPORT_JAX = ("import atexit, runpy, sys; atexit.register(lambda: print('jax imported:', 'jax' in "
               "sys.modules, file=sys.stderr)); runpy.run_module('icml_jax.sample', "
               "run_name='__main__', alter_sys=True)")


def _cli(*args, report_jax=False):
    head = ["-c", _REPORT_JAX] if report_jax else ["-m", "icml_jax.sample"]
    return subprocess.run([sys.executable, *head, *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A workdir laid out as the trainer writes it: config.json + orbax steps 1 and 2."""
    wd = tmp_path_factory.mktemp("run")
    config = load_config("configs/lm.py:tiny", unlocked=True)
    with open(wd / "config.json", "w") as f:
        json.dump(_config_dict(config), f, indent=2)
    tx = make_optimizer(config.train)
    ckpt = ckpt_lib.Checkpointer(str(wd / "checkpoints"), async_save=False)
    init = jax.jit(lambda key: nn.meta.unbox(build_model(config.model).init(
        key, jnp.zeros((1, 8), jnp.int32))["params"]))  # unboxed, as the trainer stores them
    for step in (1, 2):
        params = init(jax.random.key(step))
        if step == 1:  # the layout of checkpoints written before 2026-12-02 (with a PRNG key)
            state = _TrainStateWithKey(jnp.asarray(step, jnp.int32), params, tx.init(params),
                                       jax.random.key_data(jax.random.key(0)))
        else:
            state = TrainState(jnp.asarray(step, jnp.int32), params, tx.init(params))
        ckpt.save(step, state, None, _config_dict(config))
    ckpt.close()
    return wd


def test_cli_prints_continuations(workdir):
    r = _cli(f"--checkpoint={workdir}", "--prompt=ROMEO.", "--prompt=To be", "--max_new_tokens=20",
             "--num_samples=2", "--seed=3")
    assert r.returncode == 0, r.stderr
    assert "step 2" in r.stdout
    assert r.stdout.count("--- sample") == 4
    assert "ROMEO." in r.stdout and "To be" in r.stdout
    samples = [t.split("---\n", 1)[1] for t in r.stdout.split("--- sample ")[1:]]
    assert samples[0] != samples[1]  # two samples of one prompt draw different tokens


def test_cli_greedy_is_deterministic_and_falls_back_to_previous_step(workdir, tmp_path):
    """temperature=0: every sample of a prompt is the same continuation (sampled rows of one
    batch draw different tokens, as test_cli_prints_continuations' do). One run checks both: its
    workdir's latest step is corrupt, so the CLI falls back to step 1."""
    wd = tmp_path / "copy"
    shutil.copytree(workdir, wd)
    for root, _, files in os.walk(wd / "checkpoints" / "2" / "state"):
        for name in files:  # corrupt every file of the latest step's state
            with open(os.path.join(root, name), "wb") as f:
                f.write(b"garbage")
    r = _cli(f"--checkpoint={wd}", "--prompt=KING", "--max_new_tokens=12", "--temperature=0",
             "--num_samples=3", "--seed=9")
    assert r.returncode == 0, r.stderr
    assert "checkpoints/2 could not be restored" in r.stderr and "step 1" in r.stdout
    texts = r.stdout.split("--- sample ")[1:]
    assert len(texts) == 3 and len({t.split("---\n", 1)[1] for t in texts}) == 1


def test_cli_errors(workdir, tmp_path):
    """Bad input is one line on stderr and exit 1, found before JAX is even imported."""
    def fails(*args):
        r = _cli(*args, report_jax=True)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "jax imported: False" in r.stderr, r.stderr
        return r.stderr

    assert "no such folder" in fails(f"--checkpoint={tmp_path / 'nope'}", "--prompt=x")
    (tmp_path / "empty").mkdir()
    assert "no config.json" in fails(f"--checkpoint={tmp_path / 'empty'}", "--prompt=x")
    shutil.copy(workdir / "config.json", tmp_path / "empty" / "config.json")
    assert "no checkpoints/" in fails(f"--checkpoint={tmp_path / 'empty'}", "--prompt=x")
    err = fails(f"--checkpoint={workdir}", "--prompt=" + "a" * 120, "--max_new_tokens=20")
    assert "max_seq_len=128" in err
    assert "exactly one of" in fails("--prompt=x")
    (tmp_path / "empty" / "config.json").write_bytes(b'{"model": {"d_model": 3')  # cut short
    assert "config.json: not a trainer config (JSONDecodeError" in fails(
        f"--checkpoint={tmp_path / 'empty'}", "--prompt=x")


def test_cli_refuses_params_of_another_tree(workdir, tmp_path):
    """A workdir whose checkpoint lacks a param the model needs (here its config.json claims an
    untied lm_head): one line naming the leaf, no placeholder params reaching the decoder."""
    wd = tmp_path / "copy"
    shutil.copytree(workdir, wd)
    cfg = json.loads((wd / "config.json").read_text())
    cfg["model"]["tie_embeddings"] = False
    (wd / "config.json").write_text(json.dumps(cfg))
    r = _cli(f"--checkpoint={wd}", "--prompt=x", "--max_new_tokens=4")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "its params do not fit the model asked for (missing from the checkpoint: " \
           "params.io.lm_head)" in r.stderr.strip().splitlines()[-1]


def test_hf_folder_errors_are_one_line(workdir, tmp_path):
    """--hf with a truncated or garbage model.safetensors, or a missing tensor: one line naming
    the file (and the tensor)."""
    from icml_jax.interop import save_hf
    from icml_jax.sample import SampleError, load_hf_folder
    config = load_config("configs/lm.py:tiny", unlocked=True)
    params, _ = ckpt_lib.restore_model_params(str(workdir), config.model)
    folder = save_hf(str(tmp_path / "hf"), config.model, jax.device_get(params))
    weights = os.path.join(folder, "model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) - 100])
    with pytest.raises(SampleError, match=r"model\.safetensors: tensor '\S+' lies at bytes .* the "
                       "file is truncated"):
        load_hf_folder(folder)
    open(weights, "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(SampleError, match=r"model\.safetensors: corrupt safetensors header"):
        load_hf_folder(folder)
    r = _cli(f"--hf={folder}", "--prompt=x")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "corrupt safetensors header" in r.stderr
