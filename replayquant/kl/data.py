"""Documents for the KL harness: PG-19 (or any dataset) through `datasets`, or local text files.

Sources, chosen by what `dataset` names:
* an existing folder: every `*.txt` file in it (sorted by name) is one document;
* an existing `.txt` file: the whole file is one document;
* an existing `.jsonl` file: one document per line, the text in field `text_field` ("text");
  the document id is the line's "id" field if it has one, else its line number;
* anything else is a dataset name for `datasets.load_dataset(name, split=split, streaming=True)`;
  "pg19" means the parquet mirror `emozilla/pg19` (`deepmind/pg19` is script-based and no longer
  loads). Streaming reads only the documents needed, in the dataset's own order.

Each text is tokenised with the model's tokenizer (`add_special_tokens=True`, so a model that
wants a BOS token gets one). The first `n_docs` documents with at least `context` tokens are used,
in the source's fixed order, each cut to its first `context` tokens; shorter documents are
skipped and counted. With `pack=True` documents are instead concatenated in order, separated by
the tokenizer's EOS token (if it has one), and the stream is cut into consecutive pieces of
`context` tokens (the remainder at the end is dropped); a piece's id lists the documents it spans.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

DATASET_ALIASES = {"pg19": "emozilla/pg19"}
LOCAL_SUFFIXES = (".txt", ".jsonl")


@dataclass
class Document:
    index: int          # position in the run's fixed order (0-based)
    id: str             # source id(s)
    tokens: torch.Tensor  # int64 [context]


@dataclass
class DocumentSet:
    documents: list[Document]
    source: str                      # resolved dataset name or absolute path
    kind: str                        # "hub", "folder", "txt", "jsonl"
    split: str | None
    skipped_short: int = 0           # documents shorter than the context (not packed)
    scanned: int = 0                 # documents read from the source
    pack: bool = False
    notes: list[str] = field(default_factory=list)

    def record(self) -> dict:
        return {"source": self.source, "kind": self.kind, "split": self.split, "pack": self.pack,
                "documents_scanned": self.scanned, "skipped_short": self.skipped_short,
                "document_ids": [d.id for d in self.documents]}


def resolve_source(dataset: str) -> tuple[str, str]:
    """(kind, resolved) for a --dataset value; a path-like value that does not exist is an error."""
    p = Path(os.path.expanduser(dataset))
    if p.is_dir():
        return "folder", str(p.resolve())
    if p.is_file():
        if p.suffix == ".txt":
            return "txt", str(p.resolve())
        if p.suffix == ".jsonl":
            return "jsonl", str(p.resolve())
        raise ValueError(f"dataset file {dataset!r} is neither .txt nor .jsonl; give a .txt file, a "
                         f".jsonl file (one JSON object with a 'text' field per line), a folder of "
                         f".txt files, or a dataset name such as pg19")
    looks_local = (dataset.startswith((".", "/", "~")) or dataset.endswith(LOCAL_SUFFIXES)
                   or os.sep + os.sep in dataset or dataset.count("/") > 1)
    if looks_local:
        raise ValueError(f"dataset path {dataset!r} does not exist; give an existing folder of .txt "
                         f"files, a .txt or .jsonl file, or a dataset name such as pg19")
    return "hub", DATASET_ALIASES.get(dataset, dataset)


def iter_texts(kind: str, source: str, split: str | None, text_field: str = "text") -> Iterator[tuple[str, str]]:
    """Yield (doc id, text) in the source's fixed order."""
    if kind == "folder":
        files = sorted(Path(source).glob("*.txt"))
        if not files:
            raise ValueError(f"dataset folder {source!r} has no .txt files (empty dataset)")
        for f in files:
            yield f.name, f.read_text(encoding="utf-8", errors="replace")
    elif kind == "txt":
        yield Path(source).name, Path(source).read_text(encoding="utf-8", errors="replace")
    elif kind == "jsonl":
        with open(source, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}:{lineno} is not valid JSON ({e.msg}); each line of a "
                                     f".jsonl dataset must be one JSON object") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise ValueError(f"{source}:{lineno} has no {text_field!r} field; pass "
                                     f"--text-field NAME to name the field holding the text")
                yield str(obj.get("id", f"line{lineno}")), str(obj[text_field])
    else:
        yield from _iter_hub(source, split, text_field)


def _iter_hub(name: str, split: str | None, text_field: str) -> Iterator[tuple[str, str]]:
    try:
        import datasets
        ds = datasets.load_dataset(name, split=split or "test", streaming=True)
    except Exception as e:  # the datasets library raises many types: not found, gated, offline, ...
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        raise ValueError(
            f"could not load dataset {name!r} (split {split or 'test'!r}) through `datasets`: {msg}. "
            f"Check the name and split; for a gated dataset log in (`huggingface-cli login` or "
            f"HF_TOKEN); offline, pass a local folder of .txt files or a .txt/.jsonl file instead"
        ) from None
    for i, row in enumerate(ds):
        if text_field not in row:
            raise ValueError(f"dataset {name!r} has no {text_field!r} column (columns: "
                             f"{sorted(row)}); pass --text-field NAME")
        title = row.get("short_book_title") or row.get("title") or row.get("id")
        yield (f"{i}:{title}" if title else str(i)), row[text_field]


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


def load_documents(dataset: str, tokenizer, context: int, n_docs: int, *, split: str | None = "test",
                   text_field: str = "text", pack: bool = False) -> DocumentSet:
    """The run's documents, each `context` tokens long, in fixed order (see the module docstring)."""
    if context < 2:
        raise ValueError(f"--context must be at least 2 tokens, got {context}")
    if n_docs < 1:
        raise ValueError(f"--docs must be at least 1, got {n_docs}")
    kind, source = resolve_source(dataset)
    out = DocumentSet([], source, kind, split if kind == "hub" else None, pack=pack)
    longest = 0
    if not pack:
        for doc_id, text in iter_texts(kind, source, split, text_field):
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
        for doc_id, text in iter_texts(kind, source, split, text_field):
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
