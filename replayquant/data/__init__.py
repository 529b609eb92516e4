"""Data shipped with replayquant: held-out text and the embedded tiny models.

* `kjv_heldout.jsonl.gz`: seven books of the King James Version (Job, Isaiah, Daniel, John, Acts,
  Romans, Revelation; 193,254 tokens of the tiny models' tokenizer) that the tiny models never saw
  in training. One JSON object per line: {"id", "book", "text"}. Source and licence: SOURCE.md here.
* `replayquant/assets/tiny-qwen3.5`, `tiny-mamba2`, `tiny-kimi-linear`: Hugging Face model folders
  (config, bf16 safetensors, tokenizer) trained by `evals/train_tiny.py`; see the README there.

`heldout_path()` writes the held-out books once as a plain `.jsonl` (the KL harness reads .jsonl)
into a cache folder and returns its path (`python -m replayquant.data` prints it); `replayquant kl
--dataset heldout` reads it by that short name (`replayquant.kl.data.HELDOUT`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path

__all__ = ["HELDOUT_FILE", "HELDOUT_BOOKS", "TINY_MODELS", "heldout_documents", "heldout_path",
           "tiny_model_path"]

_HERE = Path(__file__).resolve().parent
HELDOUT_FILE = _HERE / "kjv_heldout.jsonl.gz"
HELDOUT_SHA256 = "25a87beb7519639351adf0c1ca58e136e4edfd383a0c652bc23af1ac34391b9f"  # uncompressed
HELDOUT_BOOKS = ["Job", "Isaiah", "Daniel", "John", "Acts", "Romans", "Revelation"]
ASSETS = _HERE.parent / "assets"
TINY_MODELS = {"tiny-qwen3.5": ASSETS / "tiny-qwen3.5", "tiny-mamba2": ASSETS / "tiny-mamba2",
               "tiny-kimi-linear": ASSETS / "tiny-kimi-linear"}


def _heldout_bytes() -> bytes:
    if not HELDOUT_FILE.is_file():
        raise FileNotFoundError(f"{HELDOUT_FILE} is missing: reinstall replayquant (it is package "
                                f"data) or rebuild it with `python evals/train_tiny.py prepare "
                                f"--heldout-out {HELDOUT_FILE}`")
    raw = gzip.decompress(HELDOUT_FILE.read_bytes())
    if hashlib.sha256(raw).hexdigest() != HELDOUT_SHA256:
        raise ValueError(f"{HELDOUT_FILE} is not the shipped held-out text (sha256 mismatch); "
                         f"rebuild it with `python evals/train_tiny.py prepare --heldout-out ...`")
    return raw


def heldout_documents() -> list[dict]:
    """The held-out books, in canonical order: [{"id", "book", "text"}]."""
    return [json.loads(line) for line in _heldout_bytes().decode("utf-8").splitlines() if line]


def _cache_dir() -> Path:
    if os.environ.get("REPLAYQUANT_CACHE"):
        return Path(os.environ["REPLAYQUANT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "replayquant"


def heldout_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the held-out books as plain JSONL (written once, checked by hash on every call).

    cache_dir: default $REPLAYQUANT_CACHE, else $XDG_CACHE_HOME/replayquant, else
    ~/.cache/replayquant; falls back to the system temp folder if that is not writable."""
    raw = _heldout_bytes()
    dirs = [Path(cache_dir)] if cache_dir is not None else [_cache_dir(),
                                                           Path(tempfile.gettempdir()) / "replayquant"]
    last_err = None
    for d in dirs:
        target = d / "kjv_heldout.jsonl"
        try:
            if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == HELDOUT_SHA256:
                return target
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".kjv_heldout.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, target)
            return target
        except OSError as e:
            last_err = e
    raise OSError(f"cannot write the held-out JSONL into {', '.join(map(str, dirs))}: {last_err}; "
                  f"pass cache_dir= or set REPLAYQUANT_CACHE to a writable folder")


def tiny_model_path(name: str) -> Path:
    """Folder of an embedded tiny model ('tiny-qwen3.5', 'tiny-mamba2' or 'tiny-kimi-linear')."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; the embedded ones are {', '.join(TINY_MODELS)}")
    path = TINY_MODELS[name]
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: reinstall replayquant (the tiny models "
                                f"are package data) or rebuild them with evals/train_tiny.py")
    return path
