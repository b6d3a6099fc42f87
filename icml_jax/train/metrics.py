"""Metrics: ``WORKDIR/metrics.jsonl`` (one JSON object per line) + TensorBoard event files."""
import json
import math
import os
import sys

from icml_jax.atomic import atomic_path, write_atomic


def _summary_writer(logdir: str):
    """tensorboardX's SummaryWriter, imported without PyTorch.

    When torch is installed, ``import tensorboardX`` imports it (about 3 s of start-up per process)
    only to name ``torch.Tensor`` in type hints; we log Python floats only. While torch is not yet
    imported, a ``None`` entry in ``sys.modules`` makes that import fail fast, and is removed after.
    """
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None
    try:
        from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter(logdir)


def finite_or_none(obj):
    """``obj`` with every non-finite float (nested in dicts, lists, tuples) replaced by None, so
    that it is valid JSON."""
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj


def write_json(path: str, obj, indent: int | None = 2) -> None:
    """``obj`` as valid JSON (non-finite floats become null), written atomically."""
    write_atomic(path, json.dumps(finite_or_none(obj), indent=indent, allow_nan=False))


def read_metrics(path: str) -> list:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a killed run
    return rows


class MetricsWriter:
    """Appends metric lines; on resume drops lines after the restored step (they will be redone)."""

    def __init__(self, workdir: str, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        if not enabled:
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._f = open(self.path, "a")
        self._tb = _summary_writer(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step)}
        row.update({k: (float(v) if isinstance(v, (int, float)) or hasattr(v, "dtype") else v)
                    for k, v in metrics.items()})
        self._f.write(json.dumps(finite_or_none(row), allow_nan=False) + "\n")
        self._f.flush()
        for k, v in row.items():
            if k != "step" and isinstance(v, float) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)

    def close(self):
        if self.enabled:
            self._f.close()
            self._tb.close()


def plot_loss_curve(metrics_path: str, png_path: str) -> None:
    """Training loss (and eval loss where present) against step, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(png_path, suffix=".tmp.png") as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
