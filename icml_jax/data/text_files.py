"""TFDS builder for your own text: a folder of ``.txt`` files or a ``.jsonl`` file.

* Folder (``config.data.name='text_files'``, ``config.data.path=DIR``): every ``*.txt`` below DIR
  (recursively, sorted) is one document; its key and title are the path relative to DIR. Bytes
  that are not UTF-8 are read as U+FFFD, with a warning naming the file and the count.
* JSONL (``config.data.name='jsonl'``, or ``'text_files'`` with a ``.jsonl`` path): every non-blank
  line is a JSON object whose ``config.data.text_key`` field (default ``"text"``) is a string; one
  document per line, keyed by its 1-based line number. A malformed row (not UTF-8, not JSON, no
  such string field) raises a ValueError naming the file, the line and the field. Blank lines are skipped; empty documents are dropped.

Split (deterministic, stable when documents are added): u = sha256(key) as a number in [0, 1);
``validation`` if u < 0.05, ``test`` if 0.05 <= u < 0.10, else ``train``. Tiny corpora are then
repaired: with < 3 documents there is no test split (its documents go to validation); train gets
>= 1 document, validation >= 1 and (from 3 documents on) test >= 1, each time moving the document
with the smallest u out of a split that has >= 2. A corpus with a single document is rejected
(split the file). Empty splits are not written, so a 2-document corpus has no 'test' split.

Data is written as array_record under ``{data_dir}/text_files/<kind>_<fingerprint>/1.0.0/``, where the
fingerprint covers the absolute path, text_key and every file's size and mtime, so editing the data
rebuilds it (old versions stay on disk; delete them freely).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import warnings
from collections.abc import Iterator

import tensorflow_datasets as tfds

from icml_jax.data import _tfds_common

VALIDATION_FRACTION = 0.05
TEST_FRACTION = 0.05


def _key_uniform(key: str) -> float:
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:16], 16) / 2.0**64


def assign_splits(keys: list[str]) -> dict[str, str]:
    """key -> 'train' | 'validation' | 'test' (rule in the module docstring)."""
    if len(keys) < 2:
        raise ValueError(
            f"the corpus has {len(keys)} document(s); at least 2 are needed so that validation "
            "gets one. Split your text into several .txt files (or JSONL rows).")
    u = {k: _key_uniform(k) for k in keys}
    out = {}
    for k in keys:
        if u[k] < VALIDATION_FRACTION:
            out[k] = "validation"
        elif u[k] < VALIDATION_FRACTION + TEST_FRACTION:
            out[k] = "test"
        else:
            out[k] = "train"

    def members(split):
        return sorted((k for k in keys if out[k] == split), key=lambda k: u[k])

    if len(keys) < 3:  # too small for a test split
        out.update({k: "validation" for k in members("test")})
    if not members("train"):
        out[members("validation")[-1] if members("validation") else members("test")[-1]] = "train"
    for split, min_docs in (("validation", 2), ("test", 3)):
        if members(split) or len(keys) < min_docs:
            continue
        donor = next(d for d in ("train", "validation", "test")
                     if d != split and len(members(d)) >= 2)
        out[members(donor)[0]] = split
    return out


@dataclasses.dataclass(frozen=True)
class _Doc:
    key: str
    title: str


def _resolve(path: str, kind: str) -> str:
    if not path:
        raise ValueError(
            f"config.data.name={kind!r} needs config.data.path: a folder of .txt files or a .jsonl "
            "file (e.g. --config.data.path=/data/my_corpus).")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"config.data.path={path!r} does not exist; point it at a folder of .txt files or a "
            ".jsonl file.")
    if kind == "jsonl" and not os.path.isfile(path):
        raise ValueError(f"config.data.name='jsonl' needs config.data.path to be a .jsonl file, "
                         f"got the folder {path!r} (use config.data.name='text_files' for folders).")
    return path


def _txt_files(folder: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(glob.escape(folder), "**", "*.txt"), recursive=True))
    if not files:
        raise ValueError(
            f"config.data.path={folder!r} contains no .txt files (searched recursively); put one "
            "document per .txt file there, or point config.data.path at a .jsonl file with "
            "config.data.name='jsonl'.")
    return files


def _read_txt(path: str) -> str:
    """The file as UTF-8 with universal newlines; undecodable bytes become U+FFFD (``_scan``
    warns about them)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _undecodable(path: str) -> int:
    """How many bytes of the file are not valid UTF-8."""
    with open(path, "rb") as f:
        data = f.read()
    return len(data) - len(data.decode("utf-8", errors="ignore").encode("utf-8"))


def _iter_jsonl(path: str, text_key: str) -> Iterator[tuple[int, str]]:
    """Yields (line_number, text) for every non-blank line; raises ValueError on bad rows."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line); "
                                 "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8).") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                 "each line must be one JSON object.") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with field "
                                 f"{text_key!r}, got {type(row).__name__}.")
            if text_key not in row:
                raise ValueError(
                    f"{path}:{lineno}: missing field {text_key!r} (fields: {sorted(row)}); set "
                    "config.data.text_key to the field that holds the text.")
            text = row[text_key]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_key!r} must be a string, got "
                                 f"{type(text).__name__}.")
            yield lineno, text


def _scan(path: str, text_key: str) -> list[_Doc]:
    """Validates the corpus and lists its non-empty documents."""
    if os.path.isdir(path):
        root = path
        docs = [_Doc(os.path.relpath(f, root), os.path.relpath(f, root))
                for f in _txt_files(path) if _read_txt(f).strip()]
        for f in _txt_files(path):
            bad = _undecodable(f)
            if bad:
                warnings.warn(f"{f}: {bad} byte(s) are not valid UTF-8 and are read as U+FFFD; "
                              "save the file as UTF-8 to keep them", UnicodeWarning, stacklevel=2)
    else:
        name = os.path.basename(path)
        docs = [_Doc(str(lineno), f"{name}:{lineno}")
                for lineno, text in _iter_jsonl(path, text_key) if text.strip()]
    if not docs:
        raise ValueError(f"config.data.path={path!r} holds no non-empty documents.")
    return docs


def _fingerprint(path: str, text_key: str) -> str:
    h = hashlib.sha256(f"{path}\0{text_key}".encode())
    files = _txt_files(path) if os.path.isdir(path) else [path]
    for f in files:
        st = os.stat(f)
        h.update(f"\0{os.path.relpath(f, path)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


class TextFilesConfig(tfds.core.BuilderConfig):
    """One config per corpus (path + text_key + file fingerprint)."""

    def __init__(self, *, path: str, text_key: str, **kwargs):
        super().__init__(**kwargs)
        self.path = path
        self.text_key = text_key


class TextFiles(_tfds_common.LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """A user corpus: one document per .txt file or per JSONL row."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        return _tfds_common.LocalDatasetInfo(
            builder=self,
            description=f"Text corpus from {self.builder_config.path}",
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "title": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        cfg = self.builder_config
        docs = _scan(cfg.path, cfg.text_key)
        splits = assign_splits([d.key for d in docs])
        return {s: self._generate_examples(cfg.path, cfg.text_key,
                                           {d.key: d for d in docs if splits[d.key] == s})
                for s in _tfds_common.SPLITS if s in splits.values()}

    def _generate_examples(self, path, text_key, docs):
        if os.path.isdir(path):
            for key, doc in docs.items():
                yield key, {"text": _read_txt(os.path.join(path, key)), "title": doc.title}
        else:
            for lineno, text in _iter_jsonl(path, text_key):
                doc = docs.get(str(lineno))
                if doc is not None:
                    yield doc.key, {"text": text, "title": doc.title}


def build(path: str, *, kind: str = "text_files", text_key: str = "text",
          data_dir: str | None = None) -> TextFiles:
    """Validates, prepares (once per fingerprint) and returns the builder for a user corpus.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: no .txt files, a malformed JSONL row (file:line: field), fewer than 2 documents.
    """
    path = _resolve(path, kind)
    _scan(path, text_key)  # clean errors before TFDS gets involved
    kind_tag = "jsonl" if os.path.isfile(path) else "txt"
    config = TextFilesConfig(name=f"{kind_tag}_{_fingerprint(path, text_key)}",
                             version=TextFiles.VERSION, path=path, text_key=text_key,
                             description=path)
    builder = TextFiles(config=config, data_dir=_tfds_common.resolve_data_dir(data_dir),
                        file_format="array_record")
    return _tfds_common.prepare(builder)
