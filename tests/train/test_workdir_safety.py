"""Nothing a user types, and no fault, loses a good checkpoint or trains on silently wrong state
(issue 15): changed configs, a second run on the workdir, non-finite updates, partial param trees,
flipped bytes, rewound iterator state, signals, unwritable checkpoint folders.

One uninterrupted 12-step run (checkpoints every 2 steps) is trained once; each test copies it
with step 12 removed (a run stopped after step 10), does the hostile thing, checks that the good
checkpoints are untouched, and where it matters reruns correctly and compares the losses with the
uninterrupted run's."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from icml_jax import sharding as mesh_lib
from icml_jax import tasks
from icml_jax.config_utils import REPO_ROOT
from icml_jax.tasks.lm import LMTask
from icml_jax.train import checkpoint as ckpt_lib
from icml_jax.train import trainer
from icml_jax.train import workdir as workdir_lib
from icml_jax.train.metrics import write_json
from icml_jax.train.optimizer import make_optimizer
from tests.train.helpers import (cli_config, env, main_cmd, run_main, train_in_process,
                                 train_losses)

SHORT = ("--config.train.steps=12", "--config.train.checkpoint_every=2",
         "--config.train.keep_checkpoints=10", "--config.train.log_every=1",
         "--config.train.eval_every=12", "--config.train.samples=0")


@pytest.fixture(scope="module")
def data_dir(session_tfds_dir):
    return session_tfds_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """The uninterrupted run: its workdir and its losses by step."""
    wd = tmp_path_factory.mktemp("reference") / "w"
    state, summary = train_in_process(wd, *SHORT, data_dir=data_dir, with_state=True)
    assert isinstance(state, trainer.TrainState) and int(state.step) == 12
    assert "state" not in summary and json.loads(json.dumps(summary)) == summary  # JSON-able
    with open(wd / "summary.json") as f:
        assert json.load(f) == summary
    losses = train_losses(wd)
    assert sorted(losses) == list(range(1, 13))
    steps = sorted(int(s) for s in os.listdir(wd / "checkpoints"))
    assert steps == [2, 4, 6, 8, 10, 12]
    for s in steps:  # every committed step is sealed, and its checksums hold
        assert workdir_lib.has_manifest(str(wd / "checkpoints" / str(s)))
        assert workdir_lib.verify_manifest(str(wd / "checkpoints" / str(s))) is None
    return wd, losses


@pytest.fixture
def stopped(reference, tmp_path):
    """A copy of the reference stopped after step 10 (its step-12 checkpoint removed)."""
    wd = tmp_path / "w"
    shutil.copytree(reference[0], wd)
    shutil.rmtree(wd / "checkpoints" / "12")
    metrics = wd / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 10))
    return wd


def _snapshot(wd):
    """Every file under the workdir (except the lock file) -> its bytes."""
    out = {}
    for root, _, files in os.walk(wd):
        for name in files:
            path = os.path.join(root, name)
            if name != workdir_lib.LOCK_FILE:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, wd)] = f.read()
    return out


def _steps(wd):
    return sorted(os.listdir(os.path.join(wd, "checkpoints")))


def _resume_matches(wd, reference, data_dir, start):
    """A correct rerun resumes from ``start`` and repeats the uninterrupted run's losses."""
    summary = train_in_process(wd, *SHORT, data_dir=data_dir)
    assert summary["start_step"] == start
    got, want = train_losses(wd), reference[1]
    assert sorted(got) == list(range(1, 13))
    np.testing.assert_allclose([got[s] for s in range(start + 1, 13)],
                               [want[s] for s in range(start + 1, 13)], rtol=1e-6)


def _rewrite_in_the_older_prng_key_layout(wd, c):
    """Rewrites ``wd``'s step 10 as a run wrote it while the train state still held a PRNG key
    (advanced, never read); a restore without that layout then names the leaf."""
    import orbax.checkpoint as ocp
    abstract = trainer.setup(c, tasks.TASKS.get("lm")(c)).abstract
    ckpt = ckpt_lib.Checkpointer(str(wd / "checkpoints"), async_save=False)
    try:
        state, step = ckpt.restore_latest(abstract, None)
        items = ckpt.manager.restore(step, args=ocp.args.Composite(
            data_state=ocp.args.JsonRestore(), config=ocp.args.JsonRestore()))
    finally:
        ckpt.close()
    assert step == 10
    shutil.rmtree(wd / "checkpoints" / "10")
    old = trainer._TrainStateWithKey(state.step, state.params, state.opt_state,
                                     jnp.asarray([0, 7], jnp.uint32))
    manager = ocp.CheckpointManager(str(wd / "checkpoints"), item_handlers={
        "state": ocp.StandardCheckpointHandler(), "data_state": ocp.JsonCheckpointHandler(),
        "config": ocp.JsonCheckpointHandler()})
    manager.save(10, args=ocp.args.Composite(state=ocp.args.StandardSave(old),
                                             data_state=ocp.args.JsonSave(items["data_state"]),
                                             config=ocp.args.JsonSave(items["config"])))
    manager.wait_until_finished()
    manager.close()
    ckpt = ckpt_lib.Checkpointer(str(wd / "checkpoints"), async_save=False)
    try:
        with pytest.raises(ckpt_lib.CheckpointMismatchError, match=r"in the checkpoint but not in this model: rng"):
            ckpt.restore_latest(abstract, None)
    finally:
        ckpt.close()


def test_refused_runs_touch_nothing_and_a_correct_rerun_resumes(stopped, reference, data_dir,
                                                                tiny_config):
    """Through the CLI: a changed model (point 1: not corruption) and a second run while the
    workdir is locked (point 2) stop in one line with every file as it was; a run killed while
    holding the lock leaves none behind. Then step 10 is rewritten as a checkpoint of the older
    layout with a PRNG key: the correct rerun resumes from it (one resume checks both: the
    refused runs left a resumable run, and the older layout restores and resumes exactly)."""
    before = _snapshot(stopped)
    p = run_main(str(stopped), *SHORT, "--config.model.d_model=64", "--config.seed=3",
                 check=False, data_dir=data_dir, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "model.d_model: 32 -> 64" in p.stderr and "seed: 0 -> 3" in p.stderr
    assert "start_over=True" in p.stderr
    assert _snapshot(stopped) == before  # config.json, metrics and every checkpoint as they were
    with workdir_lib.WorkdirLock(str(stopped)):  # a live run
        p = run_main(str(stopped), *SHORT, check=False, data_dir=data_dir, timeout=120)
    assert p.returncode == 1 and "is in use by another run (pid" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert _snapshot(stopped) == before
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from icml_jax.train.workdir import WorkdirLock; "
         "WorkdirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)",
         str(stopped)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(workdir_lib.WorkdirError, match=f"pid {holder.pid}"):
        workdir_lib.WorkdirLock(str(stopped)).acquire()
    holder.kill()
    holder.wait()
    _rewrite_in_the_older_prng_key_layout(stopped, tiny_config)
    _resume_matches(stopped, reference, data_dir, start=10)  # takes the lock itself


@pytest.mark.parametrize("override,key", [
    ("--config.model.tie_embeddings=False", "model.tie_embeddings: True -> False"),
    ("--config.train.batch_size=16", "train.batch_size: 8 -> 16"),
    ("--config.data.seq_len=16", "data.seq_len: 32 -> 16"),
])
def test_changed_state_or_data_keys_are_refused(stopped, data_dir, override, key):
    before = _snapshot(stopped)
    with pytest.raises(ValueError, match="holds checkpoints of another run") as e:
        train_in_process(stopped, *SHORT, override, data_dir=data_dir)
    assert key in str(e.value)
    assert _snapshot(stopped) == before


def test_structure_mismatch_found_by_the_checkpoint_itself(stopped, tiny_config):
    """Even with no config to compare, a checkpoint of another tree stops the restore by name
    (not "corrupt"); a permission error also moves nothing."""
    c = tiny_config
    c.model.tie_embeddings = False
    abstract = trainer.setup(c, tasks.TASKS.get("lm")(c)).abstract
    steps = _steps(stopped)
    ckpt = ckpt_lib.Checkpointer(str(stopped / "checkpoints"), async_save=False)
    try:
        with pytest.raises(ckpt_lib.CheckpointMismatchError,
                           match=r"missing from the checkpoint: .*params\.io\.lm_head"):
            ckpt.restore_latest(abstract, None)
        c.model.tie_embeddings = True
        abstract = trainer.setup(c, tasks.TASKS.get("lm")(c)).abstract

        def denied(*a, **k):
            raise PermissionError(13, "Permission denied", str(stopped / "checkpoints" / "10"))
        ckpt.manager.restore = denied
        with pytest.raises(ckpt_lib.CheckpointError, match="a file-system or memory error. "
                           "Nothing was moved"):
            ckpt.restore_latest(abstract, None)

        def fails(*a, **k):
            raise ValueError("an orbax that cannot read this format")
        ckpt.manager.restore = fails  # the files match their checksums: not corruption either
        with pytest.raises(ckpt_lib.CheckpointError, match="its files match their checksums"):
            ckpt.restore_latest(abstract, None)
    finally:
        ckpt.close()
    assert _steps(stopped) == steps


class _NaNGradAfterFirstMove(LMTask):
    """The LM loss plus 0 * sqrt(0 * sum(final-norm scale)) once that scale has moved from 1:
    the loss stays finite, its gradient is NaN."""

    def loss(self, params, batch):
        lsum, n, metrics = super().loss(params, batch)
        scale = params["io"]["final_norm"]["scale"]
        bad = jax.lax.cond(jnp.any(scale != 1.0), lambda v: 0.0 * jnp.sqrt(jnp.sum(v) * 0.0),
                           lambda v: 0.0 * jnp.sum(v), scale)
        return lsum + bad, n, metrics


if "test_nan_grad_lm" not in tasks.TASKS:
    tasks.TASKS.register("test_nan_grad_lm")(_NaNGradAfterFirstMove)


def test_non_finite_update_with_finite_loss_is_never_saved(tmp_path, data_dir):
    """Point 3: the tiny preset's lr is 0 at step 1, so the scale moves at step 2 and the
    gradient of step 3 (the last) is NaN while its loss is finite."""
    cfg = cli_config("configs/lm.py:tiny", "--config.train.steps=3",
                     "--config.train.checkpoint_every=1", "--config.train.samples=0")
    cfg.task, cfg.data.data_dir = "test_nan_grad_lm", data_dir
    wd = tmp_path / "w"
    with pytest.raises(trainer.NonFiniteLossError) as e:
        trainer.train_and_evaluate(cfg, str(wd))
    msg = str(e.value)
    assert msg.startswith("the update was not finite (loss ") and "gradient norm nan" in msg
    assert "at step 3" in msg and "last good checkpoint is step 2" in msg
    assert _steps(wd) == ["1", "2"]
    assert not (wd / "summary.json").exists()
    params, step = ckpt_lib.restore_model_params(str(wd), cfg.model)
    assert step == 2 and all(np.isfinite(x).all() for x in jax.tree.leaves(params))
    for line in (wd / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON


def test_summary_json_stays_valid_with_non_finite_values(tmp_path):
    path = str(tmp_path / "s.json")
    write_json(path, {"eval_loss": float("nan"), "x": [float("inf"), 1.0]})
    assert json.loads(open(path).read(), parse_constant=lambda c: pytest.fail(c)) == {
        "eval_loss": None, "x": [None, 1.0]}


def _flip_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def _largest_array_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(r, f) + os.sep]
    return max(files, key=os.path.getsize)


def _rewind_counter(step_dir):
    path = os.path.join(step_dir, "data_state", "metadata")
    text = open(path).read()
    assert '"counter": 64' in text  # 8 steps of 8 rows
    open(path, "w").write(text.replace('"counter": 64', '"counter": 8'))


def _swap_step_and_reseal(step_dir):
    """A data state claiming another step, with the checksums rewritten to match it: only the
    consistency check can catch it."""
    path = os.path.join(step_dir, "data_state", "metadata")
    state = json.load(open(path))
    assert state["step"] == 6
    state["step"] = 4
    json.dump(state, open(path, "w"))
    workdir_lib.write_manifest(step_dir)


def test_damaged_steps_are_set_aside_and_the_previous_one_resumes(stopped, reference, data_dir,
                                                                 caplog):
    """Point 6: a flipped byte in an array file (step 10), a rewound iterator counter (step 8)
    and an iterator state of another step with checksums to match (step 6) are each found on
    restore and set aside, one by one; step 4 resumes with the uninterrupted losses."""
    ckpts = stopped / "checkpoints"
    _flip_byte(_largest_array_file(str(ckpts / "10")))
    _rewind_counter(str(ckpts / "8"))
    _swap_step_and_reseal(str(ckpts / "6"))
    steps = _steps(stopped)
    _, step = trainer.load_state(cli_config("configs/lm.py:tiny", *SHORT), str(stopped))
    # a reader skips 10 and 8 and moves nothing; it reads no data state, so step 6 serves it
    assert step == 6 and _steps(stopped) == steps
    _resume_matches(stopped, reference, data_dir, start=4)
    out = caplog.text
    for step, why in ((10, "checksum differs"), (8, "data_state/metadata: size"),
                      (6, "its data-iterator state is the one of step 4")):
        assert re.search(rf"checkpoints/{step} is unreadable \([^\n]*{re.escape(why)}", out), out
        assert [d for d in _steps(stopped) if d.startswith(f"corrupt_{step}_")]
    assert "2" in _steps(stopped) and "4" in _steps(stopped)


def test_partial_param_restores_name_the_leaves(reference, tiny_config):
    """Point 5: params of another tree are refused by name, in both directions."""
    c = tiny_config
    c.model.tie_embeddings = False
    with pytest.raises(ckpt_lib.CheckpointMismatchError,
                       match=r"missing from the checkpoint: params\.io\.lm_head.*task 'lm'"):
        ckpt_lib.restore_model_params(str(reference[0]), c.model)
    c.model.tie_embeddings = True
    params, _ = ckpt_lib.restore_model_params(str(reference[0]), c.model)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target():
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            params)
    bigger = target()
    bigger["io"]["lm_head"] = jax.ShapeDtypeStruct((32, 384), jnp.float32, sharding=device)
    del bigger["io"]["embedding"]
    with pytest.raises(ckpt_lib.CheckpointMismatchError) as e:
        ckpt_lib.restore_params(str(reference[0]), bigger)
    assert "missing from the checkpoint: params.io.lm_head" in str(e.value)
    assert "in the checkpoint but not in this model: params.io.embedding" in str(e.value)
    smaller = target()
    del smaller["layer_1"]
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="params.layer_1"):
        ckpt_lib.restore_params(str(reference[0]), smaller)
    loaded, _ = ckpt_lib.restore_params(str(reference[0]), smaller, ignore=("layer_1",))
    assert set(loaded) == set(smaller)  # a declared mapping loads


def test_sigterm_checkpoints_at_a_step_boundary_and_resumes_exactly(stopped, reference, data_dir,
                                                                    monkeypatch):
    """SIGTERM arriving while batch 9 is drawn (resumed from step 6): the run finishes step 9,
    saves it, raises Interrupted; the handler is the previous one again (a second signal acts at
    once); the rerun resumes from 9."""
    assert threading.current_thread() is threading.main_thread()  # where handlers can be set
    for step in ("8", "10"):
        shutil.rmtree(stopped / "checkpoints" / step)
    make = LMTask.train_iterator
    seen = {}

    def iterator_sending_sigterm(self, seed, shard=None):
        it = make(self, seed, shard)

        class Wrapped:
            def __init__(self):
                self.n = 6

            def __next__(self):
                self.n += 1
                if self.n == 9:
                    os.kill(os.getpid(), signal.SIGTERM)
                    seen["handler"] = signal.getsignal(signal.SIGTERM)
                return next(it)

            def get_state(self):
                return it.get_state()

            def set_state(self, state):
                it.set_state(state)
        return Wrapped()

    previous = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(LMTask, "train_iterator", iterator_sending_sigterm)
    with pytest.raises(trainer.Interrupted, match=r"stopped by SIGTERM after step 9; checkpoint "
                       r"\S+/checkpoints/9 is saved; rerun the same command") as e:
        train_in_process(stopped, *SHORT, data_dir=data_dir)
    assert e.value.signum == signal.SIGTERM and seen["handler"] == previous
    assert signal.getsignal(signal.SIGTERM) == previous
    assert "9" in _steps(stopped)
    monkeypatch.undo()
    _resume_matches(stopped, reference, data_dir, start=9)


def test_sigint_through_the_cli_stops_with_one_line_and_a_checkpoint(stopped, data_dir):
    """Resuming with more steps warns that the schedule changes; SIGINT once the run trains
    stops it at a step boundary with a checkpoint there and exit status 130."""
    wd = stopped
    proc = subprocess.Popen(main_cmd(str(wd), *SHORT, "--config.train.steps=100000"),
                            cwd=REPO_ROOT, env=env(data_dir=data_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and max(train_losses(wd)) <= 10:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    assert "changed learning-rate schedule (train.steps: 12 -> 100000)" in err
    last = [line for line in err.splitlines() if line.strip()][-1]
    step = int(last.split("after step ")[1].split(";")[0])
    assert last == (f"stopped by SIGINT after step {step}; checkpoint {wd}/checkpoints/{step} is "
                    "saved; rerun the same command to resume")
    assert step > 10 and str(step) in _steps(wd) and max(train_losses(wd)) == step


def test_start_over_moves_the_previous_run_aside(stopped, data_dir, caplog):
    old = _snapshot(stopped)
    summary = train_in_process(stopped, *SHORT, "--config.seed=5", "--config.train.steps=4",
                               "--config.train.start_over=True", data_dir=data_dir)
    assert summary["start_step"] == 0 and summary["step"] == 4
    (moved,) = os.listdir(stopped / "previous_runs")
    assert "moved the previous run to" in caplog.text
    kept = _snapshot(stopped / "previous_runs" / moved)
    assert {k: v for k, v in old.items() if k.startswith("checkpoints")} == {
        k: v for k, v in kept.items() if k.startswith("checkpoints")}
    assert _steps(stopped) == ["2", "4"]
    again = train_in_process(stopped, *SHORT, "--config.seed=5", "--config.train.steps=4",
                             "--config.train.start_over=True", data_dir=data_dir)
    assert again["start_step"] == 4  # the same command again resumes: start_over acts once
    assert os.listdir(stopped / "previous_runs") == [moved]


def test_lock_errors_are_one_line(tmp_path):
    (tmp_path / workdir_lib.LOCK_FILE).mkdir()  # cannot be opened as the lock file
    with pytest.raises(workdir_lib.WorkdirError, match=r"cannot write the lock file .*\.lock"):
        workdir_lib.WorkdirLock(str(tmp_path)).acquire()


def test_checkpoints_folder_that_cannot_be_written(tmp_path, data_dir):
    wd = tmp_path / "w"
    wd.mkdir()
    (wd / "checkpoints").write_text("not a folder")
    with pytest.raises(ValueError, match="checkpoints cannot be written to .*checkpoints"):
        train_in_process(wd, *SHORT, data_dir=data_dir)
    assert not (wd / "config.json").exists()
