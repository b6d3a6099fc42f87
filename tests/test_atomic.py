"""``icml_jax.atomic``: the one atomic-write helper every layer uses."""
import os

import pytest

from icml_jax.atomic import atomic_path, write_atomic


def test_write_replace_permissions_and_no_leftovers(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    path = tmp_path / "sub" / "out.json"  # the folder is created
    write_atomic(str(path), "old")
    write_atomic(str(path), lambda f: f.write("new ü"))
    assert path.read_text(encoding="utf-8") == "new ü"
    assert os.stat(path).st_mode & 0o777 == os.stat(plain).st_mode & 0o777  # not mkstemp's 0600
    write_atomic(str(tmp_path / "b.bin"), b"\x00\x01", mode="wb", fsync=True)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path / "sub")) == ["out.json"]


def test_a_failed_write_leaves_the_target_and_removes_its_temp_file(tmp_path):
    path = tmp_path / "r.md"
    write_atomic(str(path), "good")

    def half(f):
        f.write("half")
        raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError):
        write_atomic(str(path), half)
    with pytest.raises(ValueError):
        with atomic_path(str(path), suffix=".tmp.png") as tmp:
            assert tmp.endswith(".tmp.png") and os.path.dirname(tmp) == str(tmp_path)
            raise ValueError
    assert path.read_text() == "good" and os.listdir(tmp_path) == ["r.md"]
