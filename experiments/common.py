"""Helpers shared by the experiments: atomic result files, provenance, cached per-run results,
presets as ConfigDicts, timed stages, sequence-length rounding and mean ± spread formatting.

Every experiment writes through these so that a killed run never leaves a half-written
``results.csv``/``results.md``/``*.json`` behind, and a rerun with the same settings reuses what
is already computed instead of clobbering it (DESIGN.md, "Conventions").
"""
import csv
import functools
import hashlib
import json
import math
import os
import subprocess
import time
from typing import Callable, Iterable, Mapping, Sequence

import ml_collections
import numpy as np

from icml_jax.atomic import atomic_path, write_atomic  # noqa: F401  (write_atomic: for the experiments)


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2))


def write_csv(path: str, rows: Iterable[Mapping], fieldnames: Sequence[str]) -> None:
    """A CSV with a header row, written atomically."""
    def write(f):
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        w.writerows(rows)
    write_atomic(path, write, newline="")


@functools.cache
def git_commit() -> str:
    """Short hash of the checkout's HEAD (provenance line of results.md), ``+dirty`` when tracked
    files differ from it (the run used uncommitted code), or ``unknown``. Read once per process:
    ``start`` reads it when a run begins, so a commit made while a long run goes on is not
    credited with the run's results."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=here).stdout.strip()
    except OSError:
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def cached(path: str, key, compute: Callable[[], dict], *, seconds_key: str | None = None) -> dict:
    """Returns the JSON result stored at ``path`` if it was made with the same ``key`` (any
    JSON-able description of the run: config, experiment settings; a ConfigDict is read as its
    ``to_dict()``); otherwise runs ``compute()``, stores ``{"key": key, **result}`` atomically
    and returns it. With ``seconds_key`` the wall time of ``compute()`` is stored under that name
    too (a cache hit returns the time measured when it was computed)."""
    key = json.loads(json.dumps(key, default=_jsonable))
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("key") == key:
            return old
    elapsed = stopwatch()
    out = {"key": key, **compute()}
    if seconds_key:
        out[seconds_key] = elapsed()
    write_json(path, out)
    return out


def _jsonable(obj):
    if isinstance(obj, ml_collections.ConfigDict):
        return obj.to_dict()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def stopwatch() -> Callable[[], float]:
    """A function returning the seconds since this call (stage timing without t0 bookkeeping)."""
    t0 = time.time()
    return lambda: time.time() - t0


def preset(**fields) -> ml_collections.ConfigDict:
    """An experiment preset as a ConfigDict: typo-proof attribute access (``exp.seeds``; a missing
    key is an error naming it) and ``--key=value`` overrides through ``update_from_flattened_dict``.
    A run-config override section is a nested dict (``train=dict(train=dict(steps=15))``), since
    a ConfigDict key cannot hold a dot; ``run_overrides`` flattens it back to ``train.steps``."""
    return ml_collections.ConfigDict(fields)


def run_overrides(section) -> dict:
    """A preset's nested run-config section as flat ``a.b`` keys (``{"train.steps": 15}``) for
    ``ConfigDict.update_from_flattened_dict``: the inverse of writing it nested in ``preset``."""
    if isinstance(section, ml_collections.ConfigDict):
        section = section.to_dict()
    return flatten_overrides(section)


def record(exp, flat: Sequence[str] = ()) -> dict:
    """A preset (after the command line's changes) as plain JSON for config.json and cache keys:
    lists for tuples, and the run-config sections named in ``flat`` (a section, or a list of
    sections) as flat override keys (``{"train.steps": 15}``), the form they are applied in.
    Keys come in the ConfigDict's (sorted) order; cache keys compare as dicts, so order is moot."""
    d = exp.to_dict() if isinstance(exp, ml_collections.ConfigDict) else dict(exp)
    for k in flat:
        if k in d:
            v = d[k]
            d[k] = ([run_overrides(s) for s in v] if isinstance(v, (list, tuple))
                    else run_overrides(v))
    return json.loads(json.dumps(d))


def round_up(n: int, multiple: int = 8) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (sequence lengths: one compiled shape for
    nearby lengths)."""
    return -(-int(n) // int(multiple)) * int(multiple)


SPREADS = ("std", "se", "half_range")


def mean_spread(xs: Iterable[float], spread: str = "se") -> tuple[float, float, int]:
    """(mean, spread, n) of the finite-or-inf values of ``xs`` (NaNs, e.g. a metric a run could
    not compute, are dropped). ``spread``: ``std`` (sample std, ddof = 1), ``se`` (std / sqrt n)
    or ``half_range`` ((max - min) / 2, for two or three seeds). One value has spread 0, none
    gives (nan, nan, 0)."""
    if spread not in SPREADS:
        raise ValueError(f"spread={spread!r}; choose one of {SPREADS}")
    v = np.asarray([x for x in xs if x == x], np.float64)  # numpy's sums: the numbers of before
    n = len(v)
    if not n:
        return float("nan"), float("nan"), 0
    if n == 1:
        return float(v[0]), 0.0, 1
    if spread == "half_range":
        return float(v.mean()), float(v.max() - v.min()) / 2, n
    std = float(v.std(ddof=1))
    return float(v.mean()), (std if spread == "std" else std / math.sqrt(n)), n


def pm(mean: float, spread: float, nd: int = 3, na: str = "n/a") -> str:
    """``mean ± spread`` at ``nd`` decimals; ``na`` when the mean is NaN."""
    if mean != mean:
        return na
    return f"{mean:.{nd}f} ± {spread:.{nd}f}"


def gate_lines(gates: Mapping[str, bool], on_fail: str | None = None) -> list[str]:
    """results.md lines: "Gates: name: pass; ...", then ``on_fail`` in bold when a gate failed."""
    out = ["Gates: " + "; ".join(f"{k}: {'pass' if v else 'FAIL'}" for k, v in gates.items()) + ".", ""]
    if on_fail and not all(gates.values()):
        out += [f"**{on_fail}**", ""]
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub-style Markdown table; floats get 4 significant digits."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def digest(obj, length: int = 16) -> str:
    """A short, stable hash of any JSON-able ``obj`` (cache keys, run-folder names)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:length]


def flatten_overrides(d: Mapping, prefix: str = "") -> dict:
    """A nested config dict (e.g. a run's saved config.json section) as flat ``a.b.c`` override
    keys for ``ConfigDict.update_from_flattened_dict``; JSON lists become tuples."""
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten_overrides(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


class FrozenPolicy:
    """A trained decoder workdir (e.g. the SFT policy: the reference) loaded once, with a jitted
    per-token log-prob function ``token_logps(params, batch)`` (token-aligned, masked by the
    batch's ``response_mask``) and ``params_of(workdir)`` for other runs of the same model."""

    def __init__(self, workdir: str):
        import jax

        from icml_jax.losses import response_token_logps
        from icml_jax.models.decoder import build_model
        from icml_jax.train.workdir import load_workdir
        self.model_cfg, self.ref_params, self.tok, _ = load_workdir(workdir)
        self.model = build_model(self.model_cfg)

        @jax.jit
        def token_logps(params, b):
            logits = self.model.apply({"params": params}, b["inputs"], b["positions"],
                                      b["segment_ids"])
            return response_token_logps(logits, b["inputs"], b["response_mask"])
        self.token_logps = token_logps

    def params_of(self, workdir: str):
        from icml_jax.train.checkpoint import restore_model_params
        return restore_model_params(workdir, self.model_cfg)[0]


def train_run(cfg, workdir: str, init=None, init_key: str = ""):
    """Trains (or resumes) ``cfg`` in ``workdir`` with ``train_and_evaluate``; a workdir trained
    with another config is wiped first (its state must not be resumed into this run). ``init``
    (optional, () -> params) gives the starting params of a new run (``trainer.save_initial``
    writes them as step 0); a run that holds checkpoints resumes instead. ``init_key`` names the
    init in the workdir's key, so a run started from another init is wiped too. Returns (summary,
    the metrics.jsonl rows of train steps, seconds spent)."""
    import shutil

    from icml_jax.train import workdir as workdir_lib
    from icml_jax.train.metrics import read_metrics
    from icml_jax.train.trainer import save_initial, train_and_evaluate
    key_path = os.path.join(workdir, "train_key.json")
    cfg_dict = json.loads(cfg.to_json_best_effort())
    if init is not None:
        cfg_dict = {"config": cfg_dict, "init": init_key}
    if os.path.exists(key_path):
        with open(key_path) as f:
            if json.load(f) != cfg_dict:
                shutil.rmtree(workdir)
    os.makedirs(workdir, exist_ok=True)
    if init is not None and not workdir_lib.committed_steps(os.path.join(workdir, "checkpoints")):
        save_initial(cfg, workdir, init())
    write_json(key_path, cfg_dict)
    elapsed = stopwatch()
    summary = train_and_evaluate(cfg, workdir)
    rows = [r for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]
    return summary, rows, elapsed()


def start(doc: str, presets: Mapping, argv=None):
    """The usual experiment entry: parses ``--workdir`` (created) and ``--preset`` (one of
    ``presets``, default "default"), applies our XLA defaults; returns (args, preset, stopwatch)."""
    import argparse

    from icml_jax import xla_env
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--preset", default="default", choices=sorted(presets))
    args = ap.parse_args(argv)
    xla_env.use_defaults()
    git_commit()  # the provenance is the code the run starts with
    elapsed = stopwatch()
    os.makedirs(args.workdir, exist_ok=True)
    return args, presets[args.preset], elapsed


def save_figure(fig, path: str, dpi: int = 110) -> None:
    """Saves a matplotlib figure atomically (temp file + rename) and closes it."""
    import matplotlib.pyplot as plt
    try:
        with atomic_path(path, suffix=".tmp.png") as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)


def unigram_entropy(task) -> float:
    """Entropy (nats) of the byte frequencies of a few training batches: a model below it learned
    more than letter frequencies."""
    it = task.train_iterator(seed=0, shard=(0, 1))
    counts = np.zeros(task.config.model.vocab_size)
    for _ in range(8):
        b = next(it)
        np.add.at(counts, b["targets"][b["segment_ids"] > 0], 1)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
