"""Helpers shared by the experiments: atomic result files, provenance, cached per-run results.

Every experiment writes through these so that a killed run never leaves a half-written
``results.csv``/``results.md``/``*.json`` behind, and a rerun with the same settings reuses what
is already computed instead of clobbering it (DESIGN.md, "Conventions").
"""
import csv
import json
import os
import subprocess
import tempfile
from typing import Callable, Iterable, Mapping, Sequence


def _replace_atomic(path: str, write, newline=None) -> None:
    """``write(file)`` into a temp file of this process beside ``path``, then rename it over
    ``path`` (two writers never share a temp file; a failed write leaves ``path`` untouched)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline=newline) as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` via a temp file + rename."""
    _replace_atomic(path, lambda f: f.write(text))


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2))


def write_csv(path: str, rows: Iterable[Mapping], fieldnames: Sequence[str]) -> None:
    """A CSV with a header row, written atomically."""
    def write(f):
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        w.writerows(rows)
    _replace_atomic(path, write, newline="")


def git_commit() -> str:
    """Short hash of the checkout's HEAD (provenance line of results.md), or ``unknown``."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def cached(path: str, key, compute: Callable[[], dict]) -> dict:
    """Returns the JSON result stored at ``path`` if it was made with the same ``key`` (any
    JSON-able description of the run: config, experiment settings); otherwise runs ``compute()``,
    stores ``{"key": key, **result}`` atomically and returns it."""
    key = json.loads(json.dumps(key))
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("key") == key:
            return old
    out = {"key": key, **compute()}
    write_json(path, out)
    return out


def markdown_table(header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """A GitHub-style Markdown table; floats get 4 significant digits."""
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"
