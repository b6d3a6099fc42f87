"""Helpers shared by the experiments: atomic result files, provenance, cached per-run results.

Every experiment writes through these so that a killed run never leaves a half-written
``results.csv``/``results.md``/``*.json`` behind, and a rerun with the same settings reuses what
is already computed instead of clobbering it (DESIGN.md, "Conventions").
"""
import csv
import json
import os
import subprocess
from typing import Callable, Iterable, Mapping, Sequence


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` via a temp file + rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_json(path: str, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2))


def write_csv(path: str, rows: Iterable[Mapping], fieldnames: Sequence[str]) -> None:
    """A CSV with a header row, written atomically."""
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fieldnames))
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


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
