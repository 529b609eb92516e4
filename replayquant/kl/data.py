"""Documents for the KL harness: any dataset `datasets` reads, or local text files.

Sources, chosen by what `dataset` names (`--dataset`):
* `heldout`: the held-out books shipped with replayquant (`replayquant.data.heldout_path()`, seven
  books of the King James Version the tiny models never saw; a .jsonl, read as below), no network
  needed;
* a folder holding only `*.txt` files: every file (sorted by name) is one document;
* a `.txt` file: the whole file is one document;
* a `.jsonl` file: one document per line, the text in field `text_field` ("text", `--text-column`);
  the document id is the line's "id" field if it has one, else its line number;
* a `.parquet`, `.arrow`, `.json` or `.csv` file: read by `datasets`' builder of that name, one
  document per row;
* a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk` (`datasets.load_from_disk`;
  a DatasetDict gives the split `split`);
* a folder laid out as a hub dataset (data files such as `data/test-00000-of-00001.parquet`, as
  `hf download --local-dir` writes): `datasets.load_dataset(folder, ...)`, which finds the splits
  from the file names or the README's `configs`;
* a `datasets` builder name (`parquet`, `json`, `csv`, `arrow`, `text`, ...) with `data_files`
  (`--data-files`): the builder over those files;
* anything else is a hub dataset name for `datasets.load_dataset(name, config, split=split,
  data_files=..., streaming=True)`; "pg19" means the parquet mirror `emozilla/pg19`
  (`deepmind/pg19` is script-based and no longer loads). Streaming reads only the documents
  needed, in the dataset's own order. Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE set, as HF
  asks of a machine that downloads on one host and runs on another) the dataset is read from the
  local caches: a snapshot in the hub cache with its data files (what `hf download --repo-type
  dataset NAME` writes), else `datasets`' own cache (what `datasets.load_dataset(NAME)` writes
  where the hub can be reached); a dataset in neither is one error at once saying how to download
  it. Online, no connection to the hub within a few seconds (`check_hub_reachable`) is one error
  at once, not after `datasets`' retries.
`data_files` are patterns `datasets` resolves (relative to the working folder or the dataset);
plain patterns are the split `split`, `SPLIT=PATTERN` names the split.

Every text must be a string (UTF-8 for local text files): binary or undecodable files, and rows
whose text is null or not a string, are errors naming the file and line (or row).

Each text is tokenised with the model's tokenizer (`add_special_tokens=True`, so a model that
wants a BOS token gets one). The first `n_docs` documents with at least `context` tokens are used,
in the source's fixed order, each cut to its first `context` tokens; shorter documents are
skipped and counted. With `pack=True` documents are instead concatenated in order, separated by
the tokenizer's EOS token (if it has one), and the stream is cut into consecutive pieces of
`context` tokens (the remainder at the end is dropped); a piece's id lists the documents it spans.

The document set records its source and two fingerprints: `text_sha256` over the id and text of
every document read from the source (in order), and `tokens_sha256` over the tokens of the
documents used, so a results file says exactly which data it measured.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import torch

from replayquant.data import heldout_path

DATASET_ALIASES = {"pg19": "emozilla/pg19"}
HELDOUT = "heldout"       # --dataset short name of the shipped held-out books (replayquant.data)
# local data files read through `datasets`' builder of that name (suffix -> builder)
DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".csv": "csv"}
LOCAL_SUFFIXES = (".txt", ".jsonl", *DATA_FILE_BUILDERS)
# files that make a folder a dataset `datasets.load_dataset(folder)` reads
_FOLDER_DATA_SUFFIXES = (".parquet", ".arrow", ".json", ".jsonl", ".csv", ".tsv")
ACCEPTED = ("heldout (the held-out books shipped with replayquant), a folder of .txt files, a .txt / .jsonl / .parquet / .arrow / .json / .csv file, a "
            "save_to_disk folder, a folder laid out as a hub dataset (data/*.parquet), a builder "
            "name with --data-files (e.g. --dataset parquet --data-files 'data/*.parquet'), or a "
            "hub dataset name such as pg19")


@dataclass
class Document:
    index: int          # position in the run's fixed order (0-based)
    id: str             # source id(s)
    tokens: torch.Tensor  # int64 [context]


@dataclass
class DocumentSet:
    documents: list[Document]
    source: str                      # resolved dataset name or absolute path
    kind: str                        # see `resolve_source`
    split: str | None
    skipped_short: int = 0           # documents shorter than the context (not packed)
    scanned: int = 0                 # documents read from the source
    pack: bool = False
    notes: list[str] = field(default_factory=list)
    config: str | None = None        # the dataset's configuration (hub datasets)
    data_files: list | dict | None = None
    text_column: str = "text"
    text_sha256: str | None = None   # over (id, text) of every document read, in order

    def tokens_sha256(self) -> str:
        h = hashlib.sha256()
        for d in self.documents:
            h.update(d.tokens.to(torch.int64).contiguous().numpy().tobytes())
        return h.hexdigest()

    def record(self) -> dict:
        return {"source": self.source, "kind": self.kind, "split": self.split,
                "config": self.config, "data_files": self.data_files,
                "text_column": self.text_column, "pack": self.pack,
                "documents_scanned": self.scanned, "skipped_short": self.skipped_short,
                "text_sha256": self.text_sha256, "tokens_sha256": self.tokens_sha256(),
                "document_ids": [d.id for d in self.documents]}


# ----------------------------------------------------------------------------------------------
# Where the documents come from.

def builder_names() -> set[str]:
    """`datasets`' packaged builders (parquet, json, csv, arrow, text, ...)."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
        return set(_PACKAGED_DATASETS_MODULES)
    except ImportError:   # a datasets without that table: the builders this module names
        return {"parquet", "json", "csv", "arrow", "text", "pandas"}


def parse_data_files(data_files, split: str | None) -> dict | None:
    """`--data-files` values (a pattern, or SPLIT=PATTERN; a str or a list) as datasets' dict form
    {split: [patterns]}; plain patterns belong to `split` (default "train")."""
    if data_files is None or data_files == [] or data_files == ():
        return None
    if isinstance(data_files, dict):
        return {str(k): (list(v) if isinstance(v, (list, tuple)) else [v]) for k, v in data_files.items()}
    items = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    out: dict[str, list[str]] = {}
    for it in items:
        it = str(it)
        if not it.strip():
            raise ValueError("--data-files got an empty value; give a file, a glob pattern or SPLIT=PATTERN")
        key, sep, pat = it.partition("=")
        if sep and key and "/" not in key and os.sep not in key and not Path(it).exists():
            out.setdefault(key, []).append(pat)
        else:
            out.setdefault(split or "train", []).append(it)
    return out


def _has_data_files(p: Path) -> bool:
    """Whether folder `p` holds data files `datasets.load_dataset(p)` reads (hidden ones aside)."""
    return any(f.suffix in _FOLDER_DATA_SUFFIXES and f.is_file()
               and not any(part.startswith(".") for part in f.relative_to(p).parts)
               for f in p.rglob("*"))


def _folder_kind(p: Path) -> str:
    if (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
        return "saved"
    if _has_data_files(p):
        return "hub-folder"
    if any(p.glob("*.txt")) or not (p / "README.md").is_file():
        return "folder"
    return "hub-folder"      # a README with `configs` and data files elsewhere


def resolve_source(dataset: str, data_files=None) -> tuple[str, str]:
    """(kind, resolved) for a --dataset value. Kinds: "folder" (of .txt files), "txt", "jsonl",
    "file" (a .parquet / .arrow / .json / .csv file), "saved" (save_to_disk folder), "hub-folder"
    (a folder `datasets.load_dataset` reads), "builder" (a builder name with data files), "hub".
    A path-like value that does not exist is an error. `HELDOUT` is the shipped held-out books
    (a local folder or file of that name comes first)."""
    p = Path(os.path.expanduser(dataset))
    if dataset == HELDOUT and not p.exists():
        return "jsonl", str(heldout_path())
    if p.is_dir():
        return _folder_kind(p), str(p.resolve())
    if p.is_file():
        if p.suffix == ".txt":
            return "txt", str(p.resolve())
        if p.suffix == ".jsonl":
            return "jsonl", str(p.resolve())
        if p.suffix in DATA_FILE_BUILDERS:
            return "file", str(p.resolve())
        raise ValueError(f"dataset file {dataset!r} has a suffix ({p.suffix or 'none'}) no reader "
                         f"takes; give {ACCEPTED}")
    if dataset in builder_names():
        if not data_files:
            raise ValueError(f"--dataset {dataset} is a `datasets` builder, not a dataset: pass the "
                             f"files it should read with --data-files (e.g. --dataset {dataset} "
                             f"--data-files 'data/*.{dataset}'), or give the file or folder itself "
                             f"as --dataset")
        return "builder", dataset
    looks_local = (dataset.startswith((".", "/", "~")) or dataset.endswith(LOCAL_SUFFIXES)
                   or os.sep + os.sep in dataset or dataset.count("/") > 1)
    if looks_local:
        raise ValueError(f"dataset path {dataset!r} does not exist; give {ACCEPTED}")
    return "hub", DATASET_ALIASES.get(dataset, dataset)


# ----------------------------------------------------------------------------------------------
# Reading texts.

def _decode(data: bytes, where: str) -> str:
    """Strict UTF-8: binary data (a NUL byte) or invalid bytes are an error naming `where`."""
    nul = data.find(b"\x00")
    if nul >= 0:
        raise ValueError(f"{where} is binary, not text (NUL byte at offset {nul}); give a UTF-8 "
                         f"text file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _describe(v) -> str:
    if v is None:
        return "null"
    r, t = repr(v), type(v).__name__
    return f"{'an' if t[0] in 'aeiou' else 'a'} {t} ({r[:40] + '...' if len(r) > 40 else r})"


def _iter_jsonl(source: str, text_field: str) -> Iterator[tuple[str, str]]:
    with open(source, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{source}:{lineno}"
            line = _decode(raw, f"{where} (a .jsonl line)")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON ({e.msg}); each line of a .jsonl "
                                 f"dataset must be one JSON object") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where} is {_describe(obj)}, not a JSON object with a "
                                 f"{text_field!r} field")
            if text_field not in obj:
                raise ValueError(f"{where} has no {text_field!r} field (fields: {sorted(obj)}); "
                                 f"pass --text-column NAME to name the field holding the text")
            text = obj[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: {text_field!r} is {_describe(text)}, not a string; "
                                 f"every line needs its text as a JSON string")
            yield str(obj.get("id", f"line{lineno}")), text


def _load_error(what: str, e: Exception, hint: str) -> ValueError:
    msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return ValueError(f"could not load {what} through `datasets`: {msg}. {hint}")


_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _hub_refusal(what: str, why: str, todo: str = "") -> ValueError:
    return ValueError(f"{what} is a Hugging Face hub dataset, and the hub cannot be reached "
                      f"({why}){todo}; give a local dataset instead: --dataset {HELDOUT} (the "
                      f"held-out books shipped with replayquant), or a file or folder of texts "
                      f"(see --help)")


def hub_offline() -> str | None:
    """The offline setting in force (e.g. "HF_HUB_OFFLINE=1 is set"), or None when online."""
    on = [v for v in _OFFLINE_VARS
          if os.environ.get(v, "").strip().lower() not in ("", "0", "false", "no", "off")]
    if on:
        return f"{on[0]}={os.environ[on[0]]} is set"
    try:
        import datasets.config
        import huggingface_hub.constants
        if huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
            return "offline mode is set: HF_HUB_OFFLINE"
    except (ImportError, AttributeError):
        pass
    return None


def offline_copy(name: str, what: str, offline: str) -> str | None:
    """Where hub dataset `name` is read from offline: the folder of its hub-cache snapshot when
    that holds data files (`hf download`; a snapshot holding only the README, as a streaming run
    leaves, does not count), None when `datasets`' own cache holds it (`datasets.load_dataset`
    reads it there). A dataset in neither cache is one ValueError saying how to download it."""
    import datasets.config
    import datasets.load
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        folder = Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
        if _has_data_files(folder):
            return str(folder)
    except LocalEntryNotFoundError:
        pass
    try:
        datasets.load.CachedDatasetModuleFactory(name).get_module()
        return None
    except FileNotFoundError:
        raise _hub_refusal(what, offline, (
            f" and it is in neither local cache (hub cache {constants.HF_HUB_CACHE}, datasets "
            f"cache {datasets.config.HF_DATASETS_CACHE}): download it where the hub can be "
            f"reached, with the same HF_HOME (`hf download --repo-type dataset {name}`), then "
            f"run offline again")) from None


def check_hub_reachable(what: str, timeout: float = 3.0) -> None:
    """One ValueError at once when the Hugging Face hub's host (HF_ENDPOINT) cannot be resolved
    or connected to within `timeout` seconds, saying that a dataset in the local cache is read
    with HF_HUB_OFFLINE=1. Behind a proxy the connection is left to `datasets`."""
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return
    try:
        from huggingface_hub import constants
        endpoint = constants.ENDPOINT
    except (ImportError, AttributeError):
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise _hub_refusal(what, f"no connection to {host}:{port}: {e.strerror or e}",
                           "; a dataset already in the local cache is read with HF_HUB_OFFLINE=1"
                           ) from None


def _open_datasets(kind: str, source: str, split: str | None, config: str | None, data_files):
    """(iterable of rows, description for errors, split used, column names or None)."""
    import datasets   # lm-eval / datasets: loaded by the commands that use them
    offline = ("offline, pass a local file or folder instead (" + ACCEPTED + ")")
    if kind == "saved":
        try:
            ds = datasets.load_from_disk(source)
        except Exception as e:  # datasets raises several types for a damaged folder
            raise _load_error(f"the save_to_disk folder {source}", e,
                              "Check that the folder is what Dataset.save_to_disk wrote") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"the save_to_disk folder {source} has no split {split!r} "
                                 f"(splits: {sorted(ds)}); pass --split NAME")
            ds, used = ds[split], split
        else:
            used = None
        return ds, source, used, list(ds.column_names)
    if kind == "file":
        builder = DATA_FILE_BUILDERS[Path(source).suffix]
        what, used = f"{source} (builder {builder})", None
        args = dict(path=builder, data_files={"train": [source]}, split="train")
        hint = f"Check that {source} is a {builder} file"
    elif kind == "builder":
        what, used = f"builder {source!r} over {data_files}", split or "train"
        args = dict(path=source, data_files=data_files, split=used)
        hint = "Check the --data-files patterns (relative to the working folder) and --split"
    elif kind == "hub-folder":
        what, used = f"the dataset folder {source}", split or "test"
        args = dict(path=source, name=config, data_files=data_files, split=used)
        hint = "Check --split (the split names come from the data file names) and --dataset-config"
    else:
        what, used = f"dataset {source!r} (split {split or 'test'!r})", split or "test"
        args = dict(path=source, name=config, data_files=data_files, split=used)
        hint = (f"Check the name, --split and --dataset-config; for a gated dataset log in "
                f"(`hf auth login` or HF_TOKEN); {offline}")
        off = hub_offline()
        if off is None:
            check_hub_reachable(f"--dataset {source!r}")
        elif (snapshot := offline_copy(source, f"--dataset {source!r}", off)) is not None:
            args["path"], what = snapshot, f"{what} from the hub cache ({snapshot})"
    try:
        ds = datasets.load_dataset(**args, streaming=True)
    except Exception as e:  # the datasets library raises many types: not found, gated, offline, ...
        raise _load_error(what, e, hint) from None
    cols = getattr(ds, "column_names", None)
    return ds, what, used, (list(cols) if cols else None)


def _iter_datasets(kind: str, source: str, split, config, data_files, text_field: str,
                   info: dict) -> Iterator[tuple[str, str]]:
    ds, what, used, cols = _open_datasets(kind, source, split, config, data_files)
    info["split"] = used

    def missing(columns):
        return ValueError(f"{what} has no {text_field!r} column (columns: {sorted(columns)}); "
                          f"pass --text-column NAME")
    if cols is not None and text_field not in cols:
        raise missing(cols)
    it = iter(ds)
    i = 0
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:  # a damaged file shows up only when its rows are read
            raise _load_error(what, e, f"reading row {i} failed; check the data files") from None
        if text_field not in row:
            raise missing(row)
        text = row[text_field]
        if not isinstance(text, str):
            raise ValueError(f"{what}, row {i}: {text_field!r} is {_describe(text)}, not a string; "
                             f"every row needs its text as a string (filter or fill such rows first)")
        title = row.get("short_book_title") or row.get("title") or row.get("id")
        yield (f"{i}:{title}" if title else str(i)), text
        i += 1


def iter_texts(kind: str, source: str, split: str | None, text_field: str = "text", *,
               config: str | None = None, data_files=None, info: dict | None = None
               ) -> Iterator[tuple[str, str]]:
    """Yield (doc id, text) in the source's fixed order. `info` receives the split used."""
    info = {} if info is None else info
    if kind == "folder":
        files = sorted(Path(source).glob("*.txt"))
        if not files:
            raise ValueError(f"dataset folder {source!r} has no .txt files and no data files "
                             f"(empty dataset); give {ACCEPTED}")
        for f in files:
            yield f.name, _decode(f.read_bytes(), str(f))
    elif kind == "txt":
        yield Path(source).name, _decode(Path(source).read_bytes(), source)
    elif kind == "jsonl":
        yield from _iter_jsonl(source, text_field)
    else:
        yield from _iter_datasets(kind, source, split, config, data_files, text_field, info)


def tokenize(tokenizer, text: str, need: int | None = None) -> torch.Tensor:
    """Token ids of `text`. With `need`, a long text (a PG-19 book can be megabytes) is first
    tokenised from a prefix of 8 characters per needed token; the prefix is used only if it gives
    at least `need` + 256 tokens, so the first `need` tokens are those of the whole text (BPE only
    changes tokens near the cut)."""
    def ids(t):
        return tokenizer(t, add_special_tokens=True, return_attention_mask=False,
                         verbose=False)["input_ids"]
    if need is not None and len(text) > 8 * (need + 256):
        head = ids(text[:8 * (need + 256)])
        if len(head) >= need + 256:
            return torch.tensor(head, dtype=torch.long)
    return torch.tensor(ids(text), dtype=torch.long)


def _hashed(texts: Iterator[tuple[str, str]], h) -> Iterator[tuple[str, str]]:
    for doc_id, text in texts:
        for part in (doc_id.encode("utf-8"), text.encode("utf-8")):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        yield doc_id, text


def load_documents(dataset: str, tokenizer, context: int, n_docs: int, *, split: str | None = "test",
                   text_field: str = "text", pack: bool = False, dataset_config: str | None = None,
                   data_files=None) -> DocumentSet:
    """The run's documents, each `context` tokens long, in fixed order (see the module docstring).
    `text_field` is the text column (`--text-column`)."""
    if context < 2:
        raise ValueError(f"--context must be at least 2 tokens, got {context}")
    if n_docs < 1:
        raise ValueError(f"--docs must be at least 1, got {n_docs}")
    files = parse_data_files(data_files, split)
    kind, source = resolve_source(dataset, files)
    if kind not in ("hub", "hub-folder"):
        if dataset_config:
            raise ValueError(f"--dataset-config applies to hub datasets and folders laid out as one; "
                             f"{dataset!r} is a {kind} source")
        if files and kind != "builder":
            raise ValueError(f"--data-files applies to hub datasets, dataset folders and builder "
                             f"names (e.g. --dataset parquet); {dataset!r} is a {kind} source: give "
                             f"either the file itself as --dataset or the builder with --data-files")
    out = DocumentSet([], source, kind, None, pack=pack, config=dataset_config, data_files=files,
                      text_column=text_field)
    info: dict = {}
    h = hashlib.sha256()
    texts = _hashed(iter_texts(kind, source, split, text_field, config=dataset_config,
                               data_files=files, info=info), h)
    longest = 0
    if not pack:
        for doc_id, text in texts:
            out.scanned += 1
            toks = tokenize(tokenizer, text, need=context)
            longest = max(longest, toks.numel())
            if toks.numel() < context:
                out.skipped_short += 1
                continue
            out.documents.append(Document(len(out.documents), doc_id, toks[:context].clone()))
            if len(out.documents) == n_docs:
                break
    else:
        eos = getattr(tokenizer, "eos_token_id", None)
        buf: list[torch.Tensor] = []
        ids: list[str] = []
        have = 0
        for doc_id, text in texts:
            out.scanned += 1
            toks = tokenize(tokenizer, text)
            if eos is not None and out.scanned > 1:
                toks = torch.cat([torch.tensor([eos]), toks])
            longest = max(longest, toks.numel())
            buf.append(toks)
            ids.append(doc_id)
            have += toks.numel()
            while have >= context and len(out.documents) < n_docs:
                stream = torch.cat(buf)
                out.documents.append(Document(len(out.documents), "+".join(ids), stream[:context].clone()))
                rest = stream[context:]
                buf, ids, have = ([rest], [ids[-1]], rest.numel()) if rest.numel() else ([], [], 0)
            if len(out.documents) == n_docs:
                break
    out.split = info.get("split")
    out.text_sha256 = h.hexdigest()
    if out.scanned == 0:
        raise ValueError(f"dataset {dataset!r} has no documents (empty dataset)")
    if not out.documents:
        if pack:
            raise ValueError(f"dataset {dataset!r} holds fewer than --context {context} tokens in all "
                             f"({out.scanned} documents); lower --context or use a larger dataset")
        raise ValueError(f"all {out.scanned} documents of {dataset!r} are shorter than --context "
                         f"{context} tokens (longest {longest}); lower --context or pass --pack to "
                         f"concatenate documents")
    if len(out.documents) < n_docs:
        out.notes.append(f"only {len(out.documents)} of the {n_docs} requested documents have "
                         f"{context} tokens (scanned {out.scanned}, skipped {out.skipped_short})")
    return out
