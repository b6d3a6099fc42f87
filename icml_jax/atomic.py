"""Atomic file writes, for every layer: a temp file of this process beside the target, renamed
over it. A reader sees the old file or the new one, never half of one; a failed write leaves the
target untouched and removes its temp file (only a killed process can leave a
``<name>.<random>.tmp`` behind, which no reader opens)."""
import contextlib
import os
import tempfile


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".tmp"):
    """Yields a temp path beside ``path`` (its folder is created if missing) with the permissions
    a plain ``open`` would give; renames it over ``path`` when the block ends normally, removes it
    otherwise. ``suffix``: the temp name's ending (e.g. ``.tmp.png`` for matplotlib)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=suffix)
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's files are 0600
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_atomic(path: str, content, *, mode: str = "w", encoding: str | None = "utf-8",
                 newline: str | None = None, fsync: bool = False) -> None:
    """Writes ``content`` (a str, bytes with ``mode="wb"``, or a function of the open file) to
    ``path`` atomically; ``fsync`` also flushes it to the disk before the rename."""
    if "b" in mode:
        encoding = None
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding, newline=newline) as f:
            if callable(content):
                content(f)
            else:
                f.write(content)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
