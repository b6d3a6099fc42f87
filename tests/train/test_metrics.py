"""metrics.jsonl + TensorBoard events, and the writer's start-up cost (no PyTorch import)."""
import json
import os
import subprocess
import sys

from icml_jax.config_utils import REPO_ROOT

_SCRIPT = r"""
import json, sys
from icml_jax.train.metrics import MetricsWriter
w = MetricsWriter(sys.argv[1], 0)
w.write(1, {"loss": 1.5, "eval_loss": float("nan")})
w.close()
from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (tensorboardX is usable)
print(json.dumps({"torch_imported": "torch" in sys.modules}))
import torch  # still importable afterwards
print(json.dumps({"torch": torch.__version__}))
"""


def test_writer_logs_both_files_and_does_not_import_torch(tmp_path):
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    first, second = (json.loads(x) for x in p.stdout.strip().splitlines()[-2:])
    assert first == {"torch_imported": False}
    assert second["torch"]
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 1, "loss": 1.5, "eval_loss": None}]
    events = os.listdir(tmp_path / "tensorboard")
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    assert b"loss" in (tmp_path / "tensorboard" / events[0]).read_bytes()
