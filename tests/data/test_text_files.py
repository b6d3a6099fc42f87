"""User corpora: a folder of .txt files or a JSONL file -> array_record splits; clear errors."""
import os

import pytest

from icml_jax.data import get_split_source, text_files


def _all(cfg):
    out = {}
    for split in ("train", "validation", "test"):
        src = get_split_source(cfg, split)
        out[split] = {src[i]["title"]: src[i]["text"] for i in range(len(src))}
    return out


def test_txt_folder_one_document_per_file(txt_corpus, make_cfg, tmp_path):
    cfg = make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path / "tfds"))
    splits = _all(cfg)
    titles = [t for docs in splits.values() for t in docs]
    assert sorted(titles) == sorted(
        [f"sub/doc{i:02d}.txt" if i % 3 == 0 else f"doc{i:02d}.txt" for i in range(11)])
    assert all(len(docs) >= 1 for docs in splits.values())  # tiny corpus still gets val + test
    for docs in splits.values():
        for title, text in docs.items():
            assert text == (txt_corpus / title).read_text()
    # array_record files under {data_dir}/text_files/<config>/1.0.0/
    root = tmp_path / "tfds" / "text_files"
    (config_dir,) = os.listdir(root)
    assert config_dir.startswith("txt_")
    assert any(f.startswith("text_files-train.array_record")
               for f in os.listdir(root / config_dir / "1.0.0"))
    # Deterministic: a rebuild elsewhere gives the same assignment.
    again = _all(make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path / "b")))
    assert again == splits


def test_a_first_build_leaves_nothing_in_the_temp_folder(txt_corpus, make_cfg, tmp_path,
                                                         monkeypatch):
    """TFDS makes a tmp*tfds folder for bucket metadata on a builder's first construction and
    never removes it; our locally generated corpora skip that step (LocalDatasetInfo)."""
    import tempfile
    scratch = tmp_path / "system_tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    _all(make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path / "tfds")))
    assert os.listdir(tmp_path / "tfds" / "text_files")  # it was built
    assert os.listdir(scratch) == []


def test_jsonl_rows_and_text_key(jsonl_corpus, make_cfg, tmp_path):
    cfg = make_cfg(name="jsonl", path=str(jsonl_corpus), text_key="body",
                   data_dir=str(tmp_path / "tfds"))
    splits = _all(cfg)
    texts = sorted(t for docs in splits.values() for t in docs.values())
    assert texts == sorted(f"row {i}: " + "the quick brown fox " * (i + 1) for i in range(9))
    assert len(splits["validation"]) >= 1 and len(splits["test"]) >= 1
    # Titles name the file and the (1-based) line, counting the blank line.
    titles = {t for docs in splits.values() for t in docs}
    assert "docs.jsonl:1" in titles and "docs.jsonl:6" in titles and "docs.jsonl:5" not in titles
    # text_files accepts a .jsonl path too.
    same = _all(make_cfg(name="text_files", path=str(jsonl_corpus), text_key="body",
                         data_dir=str(tmp_path / "tfds")))
    assert same == splits


@pytest.mark.parametrize("line, message", [
    ('{"text": "ok"}\n{"body": "no text"}\n', r"docs\.jsonl:2: missing field 'text'"),
    ('{"text": "ok"}\n\n{"text": 3}\n', r"docs\.jsonl:3: field 'text' must be a string"),
    ('{"text": "ok"}\n{"text": "unterminated}\n', r"docs\.jsonl:2: not valid JSON"),
    ('["a list"]\n{"text": "ok"}\n', r"docs\.jsonl:1: expected a JSON object"),
])
def test_bad_jsonl_row_names_file_line_and_field(tmp_path, make_cfg, line, message):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(line.encode("utf-8") if isinstance(line, str) else line)
    with pytest.raises(ValueError, match=message):
        get_split_source(make_cfg(name="jsonl", path=str(path), data_dir=str(tmp_path)), "train")


def test_undecodable_bytes_warn_with_file_and_count(tmp_path):
    """A .txt file that is not UTF-8 is read with U+FFFD, and says so (file, count); a JSONL
    line that is not UTF-8 is refused with its file and line."""
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes("caf\u00e9 ok".encode("latin-1") + b" \xff\xfe end")
    (d / "b.txt").write_text("plain")
    with pytest.warns(UnicodeWarning, match=r"a\.txt: 3 byte\(s\) are not valid UTF-8") as rec:
        docs = text_files._scan(str(d), "text")
    assert len(docs) == 2 and len(rec) == 1
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: not valid UTF-8"):
        text_files._scan(str(path), "text")


def test_missing_and_empty_corpora_raise_helpful_errors(tmp_path, make_cfg):
    d = str(tmp_path / "tfds")
    with pytest.raises(ValueError, match=r"config\.data\.path"):
        get_split_source(make_cfg(name="text_files", path="", data_dir=d), "train")
    with pytest.raises(FileNotFoundError, match=r"config\.data\.path=.*does not exist"):
        get_split_source(make_cfg(name="text_files", path=str(tmp_path / "nope"), data_dir=d),
                         "train")
    (tmp_path / "no_txt").mkdir()
    (tmp_path / "no_txt" / "a.md").write_text("x")
    with pytest.raises(ValueError, match=r"no \.txt files"):
        get_split_source(make_cfg(name="text_files", path=str(tmp_path / "no_txt"), data_dir=d),
                         "train")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("   \n")
    with pytest.raises(ValueError, match="no non-empty documents"):
        get_split_source(make_cfg(name="text_files", path=str(tmp_path / "blank"), data_dir=d),
                         "train")
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("a single document")
    with pytest.raises(ValueError, match="at least 2"):
        get_split_source(make_cfg(name="text_files", path=str(tmp_path / "one"), data_dir=d),
                         "train")
    with pytest.raises(ValueError, match="jsonl file"):
        get_split_source(make_cfg(name="jsonl", path=str(tmp_path / "one"), data_dir=d), "train")


def test_assign_splits_rules():
    keys = [f"doc{i}" for i in range(2000)]
    splits = text_files.assign_splits(keys)
    counts = {s: sum(v == s for v in splits.values()) for s in ("train", "validation", "test")}
    assert 60 <= counts["validation"] <= 140 and 60 <= counts["test"] <= 140
    # Stable: a document keeps its split when others are added.
    more = text_files.assign_splits(keys + [f"new{i}" for i in range(100)])
    assert all(more[k] == splits[k] for k in keys)
    two = text_files.assign_splits(["a.txt", "b.txt"])
    assert sorted(two.values()) == ["train", "validation"]
    three = text_files.assign_splits(["a", "b", "c"])
    assert sorted(three.values()) == ["test", "train", "validation"]


def test_two_document_corpus_has_no_test_split(tmp_path, make_cfg):
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.txt").write_text("first")
    (tmp_path / "two" / "b.txt").write_text("second")
    cfg = make_cfg(name="text_files", path=str(tmp_path / "two"), data_dir=str(tmp_path / "d"))
    assert len(get_split_source(cfg, "train")) == 1
    assert len(get_split_source(cfg, "validation")) == 1
    with pytest.raises(ValueError, match="no split 'test'"):
        get_split_source(cfg, "test")


def test_editing_the_corpus_rebuilds_it(txt_corpus, make_cfg, tmp_path):
    cfg = make_cfg(name="text_files", path=str(txt_corpus), data_dir=str(tmp_path / "tfds"))
    before = _all(cfg)
    (txt_corpus / "doc01.txt").write_text("rewritten " * 50)
    after = _all(cfg)
    assert [t for d in after.values() for k, t in d.items() if k == "doc01.txt"] == \
        ["rewritten " * 50]
    assert before.keys() == after.keys()
