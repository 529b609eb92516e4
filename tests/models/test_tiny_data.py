"""The tiny models' corpus builder (evals/tiny_data.py): LZW decoding of Debian's bible.data,
verse parsing, per-book documents, and a deterministic tokenizer; with the .deb present, a full
rebuild reproduces the shipped held-out text and tokenizer byte for byte."""

import gzip
import hashlib
import importlib.util
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
WINDOW0 = Path(__file__).parents[1] / "data" / "kjv_bible_data_window0.lzw"   # bible.data's 1st window
WINDOW0_SHA256 = "67905173113cb501ef726b71c9056fa3804fa6e6a36e020ebee7e3c045531f8d"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


td = _load("tiny_data")


def test_unlzw_first_window():
    raw = WINDOW0.read_bytes()
    out = td.unlzw(raw)
    assert len(out) == 65536
    assert hashlib.sha256(out).hexdigest() == WINDOW0_SHA256
    assert out.startswith(b"Holy Bible, Authorized (King James) Version.")
    assert b"Ge1:1 In the beginning God created the heaven and the earth.\n" in out
    assert td.unlzw(raw) == out


def test_unlzw_corrupt_stream():
    with pytest.raises(ValueError, match="corrupt LZW"):
        td.unlzw(bytes([0xFF] * 64))


def _fake_bible_data(window: bytes, size: int) -> bytes:
    """A one-window bible.data in the real layout: magic, 5 header words, 2 offsets, data."""
    head = b"EC02Compressed Data File".ljust(0x48, b"\0")
    start = 0x5C + 8
    head += struct.pack(">5I", 0, 0, 0, size, 1)
    head += struct.pack(">2I", start, start + len(window))
    return head + window


def test_decode_and_documents_deterministic():
    window = WINDOW0.read_bytes()
    text = td.decode_bible_data(_fake_bible_data(window, 65536))
    verses = td.parse_verses(text[:text.rindex("\n") + 1])   # the window ends mid-verse
    assert verses[0] == ("Ge", 1, 1, "In the beginning God created the heaven and the earth.")
    assert all(v[0] == "Ge" for v in verses)
    docs = td.book_documents(verses, require_all=False)
    assert [d["book"] for d in docs] == ["Genesis"]
    assert docs[0]["text"].startswith("Genesis\n\n1:1 In the beginning")
    with pytest.raises(ValueError, match="has no verses"):
        td.book_documents(verses)
    # tokenizer and token streams: same input, same bytes
    texts = [d["text"] for d in docs]
    a, b = td.train_tokenizer(texts, 400), td.train_tokenizer(texts, 400)
    assert a.to_str() == b.to_str()
    assert a.get_vocab_size() == 400 and a.token_to_id(td.EOS) == 0
    sa = td.join_with_eos(td.encode_docs(a, docs), 0)
    sb = td.join_with_eos(td.encode_docs(b, docs), 0)
    assert sa.dtype == np.uint16 and sa[0] == 0 and np.array_equal(sa, sb)
    assert a.decode(sa[1:].tolist()) == docs[0]["text"]


def test_jsonl_gz_reproducible(tmp_path):
    docs = [{"id": "kjv-x", "book": "X", "text": "X\n\n1:1 Text.\n"}]
    td.write_jsonl_gz(docs, tmp_path / "a.jsonl.gz")
    td.write_jsonl_gz(docs, tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    assert json.loads(gzip.decompress((tmp_path / "a.jsonl.gz").read_bytes())) == docs[0]


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown header"):
        td.decode_bible_data(b"not a bible file" * 10)
    bad = tmp_path / "x.deb"
    bad.write_bytes(b"hello")
    with pytest.raises(ValueError, match="not a Debian package"):
        td.read_deb_members(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        td.find_or_download_deb(tmp_path, tmp_path / "missing.deb")
    with pytest.raises(ValueError, match="unknown book abbreviation"):
        td.book_documents([("Xx", 1, 1, "text")])


def _find_deb():
    name = f"{td.DEB_PACKAGE}_{td.DEB_VERSION}_all.deb"
    for p in [os.environ.get("REPLAYQUANT_KJV_DEB"), ROOT / ".gpu" / "deb" / name, Path("/tmp") / name]:
        if p and Path(p).is_file():
            return Path(p)
    return None


@pytest.mark.skipif(_find_deb() is None, reason="bible-kjv-text .deb not here (set REPLAYQUANT_KJV_DEB)")
def test_full_rebuild_matches_shipped(tmp_path):
    """prepare() from the .deb reproduces the shipped held-out text, tokenizer and training stream."""
    out = tmp_path / "tiny"
    meta = td.prepare(out, deb=_find_deb(), heldout_out=tmp_path / "heldout.jsonl.gz")
    shipped = ROOT / "replayquant"
    assert (tmp_path / "heldout.jsonl.gz").read_bytes() == (shipped / "data" / "kjv_heldout.jsonl.gz").read_bytes()
    for model in ("tiny-qwen3.5", "tiny-mamba2"):
        assert (out / "tokenizer" / "tokenizer.json").read_bytes() == \
            (shipped / "assets" / model / "tokenizer.json").read_bytes()
    log = json.loads((ROOT / "results" / "train_tiny" / "train_log.json").read_text())
    assert meta["train_sha256"] == log["corpus"]["train_sha256"]
    assert meta["split"]["heldout"]["tokens"] >= 150_000
    assert meta["split"]["heldout"]["books"] == td.HELDOUT_BOOKS
