"""``get_split_source``: one random-access source of ``{'text': str, 'title': str}`` per split.

``data_cfg`` is ``config.data`` (configs/lm.py); the keys used here are ``name``, ``path``,
``text_key`` and ``data_dir``. ``data_cfg.name`` selects the corpus:

* ``shakespeare`` — the embedded corpus (``icml_jax.data.shakespeare``); no network.
* ``text_files`` — a folder of ``.txt`` files (or a ``.jsonl`` file) at ``data_cfg.path``.
* ``jsonl`` — a ``.jsonl`` file at ``data_cfg.path`` with the text in ``data_cfg.text_key``.
* ``tfds:<name>[:<version>]`` — any TFDS dataset with a text feature ``data_cfg.text_key``, read
  through ``tfds.data_source`` (array_record). If it is not yet prepared in the data dir, TFDS
  downloads and prepares it, which needs network access and, for many catalogue datasets, the
  dataset's own extra dependencies (some need TensorFlow or Apache Beam to prepare; prepare those
  once on a machine that has them, with ``file_format='array_record'``, then copy the data dir).

Everything is written to / read from ``data_cfg.data_dir`` ('' = $TFDS_DATA_DIR or
~/tensorflow_datasets).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from icml_jax.data import _tfds_common

SPLITS = _tfds_common.SPLITS
NAMES = ("shakespeare", "text_files", "jsonl", "tfds:<name>[:<version>]")


class TextSource(Sequence):
    """Wraps a TFDS data source; items are ``{'text': str, 'title': str}``.

    ``title`` is the document's title / file name / line reference ('' if the dataset has none).
    """

    def __init__(self, source: Any, text_key: str, description: str):
        self._source = source
        self._text_key = text_key
        self.description = description

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> dict[str, str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        record = self._source[index]
        title = record.get("title", b"")
        return {"text": _tfds_common.record_text(record[self._text_key]),
                "title": _tfds_common.record_text(title)}

    def __repr__(self) -> str:
        return f"TextSource({self.description}, {len(self)} documents)"


def _check_split(split: str, available: Sequence[str], what: str) -> None:
    if split not in available:
        raise ValueError(f"{what} has no split {split!r}; available splits: {sorted(available)}. "
                         "(Tiny corpora may have no 'test' split; add documents.)")


def _tfds_source(spec: str, split: str, text_key: str, data_dir: str | None) -> TextSource:
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise ValueError(f"config.data.name={spec!r}: expected 'tfds:<name>' or "
                         "'tfds:<name>:<version>', e.g. 'tfds:lm1b' or 'tfds:lm1b:1.1.0'.")
    name = parts[1] + (f":{parts[2]}" if len(parts) == 3 and parts[2] else "")
    try:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except Exception as e:  # DatasetNotFoundError, missing builder dependencies, ...
        raise ValueError(f"config.data.name={spec!r}: TFDS could not load the builder of {name!r} "
                         f"({type(e).__name__}: {e}).") from e
    if not builder.is_prepared():
        _tfds_common.prepare(builder)
    _check_split(split, list(builder.info.splits.keys()), f"TFDS dataset {name!r}")
    features = builder.info.features
    keys = list(features.keys()) if hasattr(features, "keys") else []
    if text_key not in keys:
        raise ValueError(f"TFDS dataset {name!r} has no feature {text_key!r} (features: {keys}); "
                         "set config.data.text_key to the text feature.")
    return TextSource(builder.as_data_source(split=split), text_key, f"{spec}/{split}")


def get_split_source(data_cfg: Any, split: str) -> TextSource:
    """Returns the random-access source of ``split`` ('train' | 'validation' | 'test').

    Prepares the TFDS array_record files on first use (Shakespeare: well under a second).

    Raises:
      ValueError: unknown name / split, missing or empty corpus, malformed JSONL rows.
      FileNotFoundError: ``config.data.path`` does not exist, or the corpus package is missing.
    """
    name = getattr(data_cfg, "name", "")
    data_dir = _tfds_common.resolve_data_dir(getattr(data_cfg, "data_dir", ""))
    text_key = getattr(data_cfg, "text_key", "") or "text"
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; choose one of {SPLITS}.")
    if name == "shakespeare":
        from icml_jax.data import shakespeare  # pylint: disable=g-import-not-at-top

        builder = shakespeare.build(data_dir)
        return TextSource(builder.as_data_source(split=split), "text", f"shakespeare/{split}")
    if name in ("text_files", "jsonl"):
        from icml_jax.data import text_files  # pylint: disable=g-import-not-at-top

        builder = text_files.build(getattr(data_cfg, "path", ""), kind=name, text_key=text_key,
                                   data_dir=data_dir)
        _check_split(split, list(builder.info.splits.keys()),
                     f"the corpus at config.data.path={builder.builder_config.path!r}")
        # The builder stores the text under 'text' whatever the JSONL field was called.
        return TextSource(builder.as_data_source(split=split), "text",
                          f"{name}:{builder.builder_config.path}/{split}")
    if name.startswith("tfds:"):
        return _tfds_source(name, split, text_key, data_dir)
    raise ValueError(f"config.data.name={name!r} is unknown; choose one of {NAMES}.")
