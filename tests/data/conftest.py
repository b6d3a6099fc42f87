"""Fixtures for the data-layer tests: a Shakespeare build shared by the session, tiny corpora."""
import json

import ml_collections
import pytest

from icml_jax.data import shakespeare


def data_config(**overrides) -> ml_collections.ConfigDict:
    cfg = ml_collections.ConfigDict(dict(name="shakespeare", path="", text_key="text",
                                         data_dir="", seq_len=32))
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def make_cfg():
    """``make_cfg(**overrides)`` -> a config.data-like ConfigDict."""
    return data_config


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A TFDS data dir holding the Shakespeare array_record files (built once per session)."""
    path = tmp_path_factory.mktemp("tfds")
    shakespeare.build(str(path))
    return str(path)


@pytest.fixture(scope="session")
def shakespeare_cfg(tfds_dir):
    return data_config(data_dir=tfds_dir)


@pytest.fixture
def txt_corpus(tmp_path):
    """A folder of 12 small .txt documents of different lengths (one empty file, skipped)."""
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(11):
        target = folder / ("sub" if i % 3 == 0 else "") / f"doc{i:02d}.txt"
        target.write_text(f"Document {i}. " + "lorem ipsum dolor sit amet, " * (i * 3 + 1) + "é∑")
    (folder / "empty.txt").write_text("  \n")
    (folder / "notes.md").write_text("not a document")
    return folder


@pytest.fixture
def jsonl_corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": f"row {i}: " + "the quick brown fox " * (i + 1), "id": i} for i in range(9)]
    path.write_text("\n".join(json.dumps(r) for r in rows[:4]) + "\n\n"
                    + "\n".join(json.dumps(r) for r in rows[4:]) + "\n")
    return path
