"""Corpus and tokenizer for the embedded tiny models.

The text is the King James Version of the Bible as Debian's `bible-kjv-text` package carries it
(`/usr/lib/bible.data`, the Bible Retrieval System's file). This module reads that file straight
from the .deb, in Python: an `ar` archive holding `data.tar.xz`; inside, `bible.data` is a header,
a table of window offsets and 64 KiB windows of text, each compressed on its own with the LZW
coding of Unix `compress` (16-bit codes, block mode). No `bible` program is needed.

Everything here is deterministic: the same .deb gives the same documents, the same split, the same
tokenizer and the same token arrays.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import tarfile
from pathlib import Path

import numpy as np

DEB_PACKAGE = "bible-kjv-text"
DEB_VERSION = "4.38"
DEB_SHA256 = "d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a"
DATA_MEMBER = "usr/lib/bible.data"
COPYRIGHT_MEMBER = "usr/share/doc/bible-kjv-text/copyright"
# sha256 of the uncompressed bible.data in version 4.38; another version is refused (the split and
# tokenizer would silently change).
DATA_SHA256 = "6c746c2acc8a34bfded980883ff1701a5d68934a1c853ebf88a07b978fe0ae0e"

# (abbreviation used in bible.data, full name), canonical order.
BOOKS = [
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"),
    ("Deu", "Deuteronomy"), ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"),
    ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"), ("1Ki", "1 Kings"), ("2Ki", "2 Kings"),
    ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"), ("Ezra", "Ezra"), ("Neh", "Nehemiah"),
    ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"), ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"),
    ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"),
    ("Nahum", "Nahum"), ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"),
    ("Zec", "Zechariah"), ("Mal", "Malachi"), ("Mat", "Matthew"), ("Mark", "Mark"),
    ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"), ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"), ("Gal", "Galatians"),
    ("Eph", "Ephesians"), ("Phi", "Philippians"), ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"), ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"), ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"), ("1Jn", "1 John"),
    ("2Jn", "2 John"), ("3Jn", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
]
# Held out for evaluation (never seen by the tokenizer or the models): poetry, prophecy, narrative,
# a gospel, a letter and apocalyptic, about 190K tokens in all.
HELDOUT_BOOKS = ["Job", "Isaiah", "Daniel", "John", "Acts", "Romans", "Revelation"]
# Held out from training to pick the checkpoint (so the evaluation books are never used for that).
VAL_BOOKS = ["Esther", "Galatians"]

EOS = "<|endoftext|>"

_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


# --------------------------------------------------------------------------------------- the .deb
def find_or_download_deb(cache_dir: str | os.PathLike, deb: str | os.PathLike | None = None) -> Path:
    """The .deb to read: `deb` if given, else one already in `cache_dir`, else `apt-get download`."""
    if deb is not None:
        p = Path(deb)
        if not p.is_file():
            raise FileNotFoundError(f"--deb {p} does not exist")
        return p
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    name = f"{DEB_PACKAGE}_{DEB_VERSION}_all.deb"
    if (cache / name).is_file():
        return cache / name
    if shutil.which("apt-get") is None:
        raise RuntimeError(
            f"{name} is not in {cache} and apt-get is not available to download it. Download it "
            f"by hand (https://packages.debian.org/{DEB_PACKAGE}, any Debian or Ubuntu mirror: "
            f"pool/main/b/bible-kjv/{name}, sha256 {DEB_SHA256}) and pass --deb PATH.")
    print(f"[tiny_data] downloading {DEB_PACKAGE} with `apt-get download` into {cache}")
    res = subprocess.run(["apt-get", "download", f"{DEB_PACKAGE}={DEB_VERSION}"], cwd=cache,
                         capture_output=True, text=True)
    if res.returncode != 0 or not (cache / name).is_file():
        raise RuntimeError(
            f"`apt-get download {DEB_PACKAGE}={DEB_VERSION}` failed (exit {res.returncode}): "
            f"{res.stderr.strip()[-500:]}\nDownload {name} by hand (sha256 {DEB_SHA256}) and pass "
            f"--deb PATH.")
    return cache / name


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def read_deb_members(deb_path: str | os.PathLike) -> dict[str, bytes]:
    """{path: bytes} of the regular files in the .deb's data archive (an `ar` archive, parsed here)."""
    raw = Path(deb_path).read_bytes()
    if raw[:8] != b"!<arch>\n":
        raise ValueError(f"{deb_path} is not a Debian package (no ar magic)")
    pos, data_tar = 8, None
    while pos + 60 <= len(raw):
        header = raw[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        body = raw[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            data_tar = body
        pos += 60 + size + (size & 1)
    if data_tar is None:
        raise ValueError(f"{deb_path} has no data.tar member")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data_tar), mode="r:*") as tf:
        for m in tf.getmembers():
            if m.isfile():
                out[m.name.lstrip("./")] = tf.extractfile(m).read()
    return out


# ------------------------------------------------------------------------------------- bible.data
def unlzw(data: bytes, maxbits: int = 16) -> bytes:
    """Decode a Unix `compress` (LZW, block mode) code stream that has no 3-byte header.

    Codes are LSB-first, 9 bits growing to `maxbits`; code 256 clears the table. `compress` writes
    codes in groups of eight, so when the width changes (or after a clear) the rest of the current
    group of eight codes is padding and is skipped.
    """
    table = [bytes([i]) for i in range(256)] + [b""]     # 256 = CLEAR
    out = bytearray()
    nbits, maxmax = 9, 1 << maxbits
    maxcode = (1 << nbits) - 1
    pos, total_bits, count = 0, len(data) * 8, 0
    prev = None
    padded = data + b"\0\0\0\0"
    while True:
        if len(table) > maxcode and nbits < maxbits:
            pos += ((8 - count % 8) % 8) * nbits
            count = 0
            nbits += 1
            maxcode = maxmax - 1 if nbits == maxbits else (1 << nbits) - 1
        if pos + nbits > total_bits:
            break
        word = int.from_bytes(padded[pos >> 3:(pos >> 3) + 4], "little")
        code = (word >> (pos & 7)) & ((1 << nbits) - 1)
        pos += nbits
        count += 1
        if prev is None:
            if code > 255:
                raise ValueError(f"corrupt LZW stream: first code {code} at bit {pos}")
            out += table[code]
            prev = table[code]
            continue
        if code == 256:
            pos += ((8 - count % 8) % 8) * nbits
            count, nbits, prev = 0, 9, None
            maxcode = (1 << nbits) - 1
            del table[257:]
            continue
        if code < len(table):
            entry = table[code]
        elif code == len(table):
            entry = prev + prev[:1]
        else:
            raise ValueError(f"corrupt LZW stream: code {code} > table size {len(table)}")
        out += entry
        if len(table) < maxmax:
            table.append(prev + entry[:1])
        prev = entry
    return bytes(out)


def decode_bible_data(raw: bytes) -> str:
    """The plain text of BRS's `bible.data`: header + window table + LZW-compressed 64 KiB windows."""
    if not raw.startswith(b"EC02Compressed Data File"):
        raise ValueError("bible.data: unknown header (expected 'EC02Compressed Data File')")
    # After the 72-byte magic: 5 big-endian uint32 (the last two: window size, window count),
    # then window count + 1 offsets (the last one is the file size).
    fields = struct.unpack(">5I", raw[0x48:0x5C])
    wsize, nwin = fields[3], fields[4]
    offs = struct.unpack(f">{nwin + 1}I", raw[0x5C:0x5C + 4 * (nwin + 1)])
    if offs[-1] != len(raw):
        raise ValueError("bible.data: window table does not end at the file size")
    parts = []
    for i in range(nwin):
        chunk = unlzw(raw[offs[i]:offs[i + 1]])
        if i < nwin - 1 and len(chunk) != wsize:
            raise ValueError(f"bible.data: window {i} decodes to {len(chunk)} bytes, not {wsize}")
        parts.append(chunk)
    return b"".join(parts).decode("ascii")


def parse_verses(text: str) -> list[tuple[str, int, int, str]]:
    """[(abbrev, chapter, verse, text)] in file order; the first line is a title and is skipped."""
    lines = text.split("\n")
    if not lines[0].startswith("Holy Bible"):
        raise ValueError("bible.data: unexpected first line")
    out = []
    for line in lines[1:]:
        if not line:
            continue
        m = _VERSE.match(line)
        if m is None:
            raise ValueError(f"bible.data: cannot parse line {line[:60]!r}")
        out.append((m[1], int(m[2]), int(m[3]), m[4]))
    return out


def book_documents(verses, require_all: bool = True) -> list[dict]:
    """One document per book: its name, a blank line, then 'chapter:verse text' lines.
    `require_all=False` (tests on a fragment) keeps only the books that have verses."""
    abbrevs = [a for a, _ in BOOKS]
    by_book: dict[str, list[str]] = {a: [] for a in abbrevs}
    for abbrev, ch, vs, txt in verses:
        if abbrev not in by_book:
            raise ValueError(f"bible.data: unknown book abbreviation {abbrev!r}")
        by_book[abbrev].append(f"{ch}:{vs} {txt}")
    docs = []
    for abbrev, name in BOOKS:
        if not by_book[abbrev]:
            if not require_all:
                continue
            raise ValueError(f"bible.data: book {name} has no verses")
        docs.append({"id": "kjv-" + name.lower().replace(" ", "-"), "book": name,
                     "text": name + "\n\n" + "\n".join(by_book[abbrev]) + "\n"})
    return docs


def load_kjv(deb_path) -> tuple[list[dict], dict]:
    """(documents, source info) from the .deb."""
    deb_bytes = Path(deb_path).read_bytes()
    members = read_deb_members(deb_path)
    if DATA_MEMBER not in members:
        raise ValueError(f"{deb_path} has no {DATA_MEMBER}: not the {DEB_PACKAGE} package?")
    raw = members[DATA_MEMBER]
    if sha256_bytes(raw) != DATA_SHA256:
        raise ValueError(
            f"{DATA_MEMBER} in {deb_path} differs from {DEB_PACKAGE} {DEB_VERSION}'s (sha256 "
            f"{sha256_bytes(raw)} != {DATA_SHA256}); the corpus would not be the one the shipped "
            f"models were trained on. Use {DEB_PACKAGE}_{DEB_VERSION}_all.deb.")
    docs = book_documents(parse_verses(decode_bible_data(raw)))
    info = {"package": f"{DEB_PACKAGE} {DEB_VERSION} (Debian, source package bible-kjv)",
            "deb_sha256": sha256_bytes(deb_bytes), "bible_data_sha256": DATA_SHA256,
            "copyright": members.get(COPYRIGHT_MEMBER, b"").decode("utf-8", "replace")}
    return docs, info


def split_documents(docs: list[dict]) -> dict[str, list[dict]]:
    names = {d["book"] for d in docs}
    for b in HELDOUT_BOOKS + VAL_BOOKS:
        if b not in names:
            raise ValueError(f"split: book {b!r} missing from the corpus")
    split = {"train": [], "val": [], "heldout": []}
    for d in docs:
        key = "heldout" if d["book"] in HELDOUT_BOOKS else "val" if d["book"] in VAL_BOOKS else "train"
        split[key].append(d)
    return split


# -------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """Byte-level BPE (GPT-2 style pre-tokenization) with one special token, EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_hf_tokenizer(tok, out_dir: str | os.PathLike, model_max_length: int = 131072):
    """Save as a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                 pad_token=EOS, model_max_length=model_max_length)
    hf.save_pretrained(str(out_dir))
    return hf


def encode_docs(tok, docs: list[dict]) -> list[np.ndarray]:
    return [np.asarray(tok.encode(d["text"]).ids, dtype=np.uint16) for d in docs]


def join_with_eos(arrays: list[np.ndarray], eos_id: int) -> np.ndarray:
    """EOS before every document: the stream the models see (documents separated by EOS)."""
    parts = []
    for a in arrays:
        parts += [np.array([eos_id], dtype=np.uint16), a]
    return np.concatenate(parts)


def prepare(out_dir: str | os.PathLike, deb: str | None = None, cache_dir: str | None = None,
            vocab_size: int = 4096, heldout_out: str | None = None) -> dict:
    """Build everything training needs into `out_dir`:
    tokenizer/ (HF files), train.npy, val.npy, heldout.npy (uint16 token streams, EOS-separated),
    heldout_docs.json (book, token count), corpus.json (source, split, counts, hashes).
    `heldout_out`: also write the held-out documents as gzip JSONL there (the file shipped in the
    package), byte-for-byte reproducible (gzip mtime 0).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deb_path = find_or_download_deb(cache_dir or out.parent / "deb", deb)
    docs, info = load_kjv(deb_path)
    split = split_documents(docs)
    tok = train_tokenizer([d["text"] for d in split["train"]], vocab_size)
    tok_dir = out / "tokenizer"
    save_hf_tokenizer(tok, tok_dir)
    eos_id = tok.token_to_id(EOS)
    counts = {}
    for key in ("train", "val", "heldout"):
        arrs = encode_docs(tok, split[key])
        np.save(out / f"{key}.npy", join_with_eos(arrs, eos_id))
        counts[key] = {"books": [d["book"] for d in split[key]],
                       "tokens": int(sum(len(a) for a in arrs)),
                       "words": int(sum(len(d["text"].split()) for d in split[key]))}
        if key == "heldout":
            (out / "heldout_docs.json").write_text(json.dumps(
                [{"id": d["id"], "book": d["book"], "tokens": int(len(a))}
                 for d, a in zip(split[key], arrs)], indent=1))
    meta = {"source": info, "vocab_size": tok.get_vocab_size(), "eos_id": eos_id,
            "split": counts,
            "tokenizer_sha256": sha256_bytes((tok_dir / "tokenizer.json").read_bytes()),
            "train_sha256": sha256_bytes((out / "train.npy").read_bytes())}
    (out / "corpus.json").write_text(json.dumps(meta, indent=1))
    if heldout_out is not None:
        write_jsonl_gz(split["heldout"], heldout_out)
    return meta


def write_jsonl_gz(docs: list[dict], path: str | os.PathLike) -> None:
    import gzip
    body = "".join(json.dumps({"id": d["id"], "book": d["book"], "text": d["text"]},
                              ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0,
                                              filename="") as gz:
        gz.write(body)
