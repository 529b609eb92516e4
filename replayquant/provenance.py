"""Provenance of a results file: who, what, where, when; and the identity of a local model.

A local model folder is named by `local_fingerprint`: the sha256 of every byte of every file that
Hugging Face reads from it (`file_digests`, cached by path, size and times so that a second run
does not read the weights again). `model_mismatch` says why two model records
(`kl.run.model_record`, `model_identity`) name different models; every command that uses a file
written by another refuses a mismatch with one error naming both.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

import replayquant
from replayquant.data import _cache_dir
from replayquant.outputs import WriteError, write_json


def _own_checkout() -> Path | None:
    """The root of replayquant's own source checkout when this package runs from one, else None.

    Only a work tree whose top level holds this very package counts: a virtual environment or a
    plain copy inside some other repository must not record that repository's commit."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return root if Path(top).resolve() == root else None


def git_commit() -> str:
    """What code produced a result.

    * REPLAYQUANT_GIT_COMMIT when set: the sender of a source tree copied to another machine (a GPU
      machine) names the commit it copied; the copy's own git metadata, if any came along, can
      name an older commit than its files hold (it then reads as that commit + dirty).
    * Else, in replayquant's own checkout: its HEAD commit ('+dirty' if tracked files have changes).
    * Else an installed package: 'replayquant==VERSION'.
    """
    if os.environ.get("REPLAYQUANT_GIT_COMMIT"):
        return os.environ["REPLAYQUANT_GIT_COMMIT"]
    root = _own_checkout()
    if root is not None:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                 text=True, check=True).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=root, capture_output=True, text=True).stdout.strip()
            return sha + ("+dirty" if dirty else "")
        except (OSError, subprocess.CalledProcessError):
            pass
    return f"replayquant=={replayquant.__version__}"


def device_name(device=None) -> str:
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return torch.cuda.get_device_name(device if device is not None else 0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "datasets", "lm_eval"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed on this machine
            out[mod] = None
    out["replayquant"] = replayquant.__version__
    return out


def provenance(device=None, **params) -> dict:
    """A dict to embed in every results file; `params` records the run's own settings."""
    return {
        "git_commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "host": platform.node(),
        "versions": versions(),
        **params,
    }


# ----------------------------------------------------------------------------------------------
# The identity of a model.

# the files of a model folder that Hugging Face reads (configuration, weights, tokenizer, remote
# code): by suffix, and by exact name for the .json / .txt ones (a results file written into the
# folder is not part of the model)
_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".py", ".model", ".tiktoken", ".jinja")
_MODEL_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                "merges.txt", "chat_template.json", "preprocessor_config.json")
_HASH_CACHE = "file_sha256.json"     # in `replayquant.data._cache_dir()`
_CHUNK = 1 << 20
# the fingerprint of earlier versions: config.json and the first and last MiB of each weight file
_PARTIAL = re.compile(r"sha256:[0-9a-f]{32}")


def _model_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".") and
                  (p.name in _MODEL_NAMES or p.name.endswith(".index.json")
                   or p.suffix in _MODEL_SUFFIXES))


def _stat_key(st: os.stat_result) -> list:
    """What says a file is unchanged since it was hashed: size, modification and change times
    (the change time moves on every write, even one that sets the modification time back)."""
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _read_hash_cache(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _write_hash_cache(path: Path, cache: dict) -> None:
    """Written atomically (`outputs.write_json`); a cache folder that cannot be written leaves
    every hash exact and only costs the next run a rehash, so it is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, cache, indent=None)
    except (OSError, WriteError):
        pass


def file_digests(paths) -> dict[str, str]:
    """{path: sha256 hex of its whole content} for `paths` (as given), each read once: the hash
    of a file whose real path, size, modification and change times (ns) are those recorded in
    the cache ($REPLAYQUANT_CACHE, else $XDG_CACHE_HOME/replayquant, else ~/.cache/replayquant:
    file_sha256.json) is taken from there.

    Measured on a 2 GB file on this project's 2-core CPU machine (sha256 with SHA-NI, 1 MiB
    reads): 1.5-2.6 s the first time from the page cache (blake2b: 2.9-3.5 s), 4.5-7.3 s from its
    disk (which the model's load then finds cached), and 0.2-0.6 ms from the hash cache after
    that: a model's weights are read once per change of their files."""
    cache_file = _cache_dir() / _HASH_CACHE
    cache = _read_hash_cache(cache_file)
    out, changed = {}, False
    for p in paths:
        real = os.path.realpath(p)
        key = _stat_key(os.stat(real))
        hit = cache.get(real)
        if isinstance(hit, dict) and hit.get("stat") == key and isinstance(hit.get("sha256"), str):
            out[str(p)] = hit["sha256"]
            continue
        out[str(p)] = _sha256_file(real)
        # stat again: a file written while it was read is not cached under the earlier times
        if _stat_key(os.stat(real)) == key:
            cache[real] = {"stat": key, "sha256": out[str(p)]}
            changed = True
    if changed:
        _write_hash_cache(cache_file, {k: v for k, v in cache.items() if os.path.exists(k)})
    return out


def local_fingerprint(folder: Path) -> str:
    """sha256 over the name, size and sha256 of every file Hugging Face reads from a model folder
    (configuration, weights, tokenizer, remote code: `_model_files`): a change of any byte of
    them changes it. The whole files are hashed (`file_digests`: once per change)."""
    files = _model_files(Path(folder))
    digests = file_digests(files)
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\t{p.stat().st_size}\t{digests[str(p)]}\n".encode())
    return "sha256:" + h.hexdigest()


def model_identity(name: str, revision: str | None = None) -> dict:
    """The identity of the model `name` (a short name, hub id or local folder) names now: a local
    folder by its real path and `local_fingerprint`; a hub model by its id and the commit its
    revision (default: main) resolves to in the local hub cache (None where it is not cached, or
    where `name` names no model: nothing can then be shown to be it, `model_mismatch`)."""
    # transformers: reading results does not load it
    from replayquant.models.names import resolve_model_name
    try:
        resolved = resolve_model_name(name)
    except ValueError:
        return {"id": name, "revision": None}
    if os.path.isdir(resolved):
        real = os.path.realpath(resolved)
        return {"id": real, "path": real, "local_hash": local_fingerprint(Path(real))}
    return {"id": resolved, "revision": _hub_commit(resolved, revision)}


def _hub_commit(repo: str, revision: str | None) -> str | None:
    """The commit `revision` of hub model `repo` resolves to in the local hub cache, or None."""
    if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
        return revision
    from huggingface_hub import try_to_load_from_cache   # loaded by the commands that use it
    try:
        found = try_to_load_from_cache(repo, "config.json", revision=revision or "main")
    except ValueError:          # not a hub id (huggingface_hub's validation error)
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def describe_model(rec: dict) -> str:
    """A model record in a message: its id, and its fingerprint or revision."""
    tag = rec.get("local_hash") or (f"revision {rec['revision']}" if rec.get("revision")
                                    else "no revision recorded")
    return f"{rec.get('id') or rec.get('path') or '?'} ({tag})"


def model_mismatch(recorded: dict, now: dict) -> str | None:
    """Why two model records do not name the same model (a few words for a message that names
    both, `describe_model`), or None when they do. Local folders are compared by fingerprint (a
    copy elsewhere is the same model), hub models by id and commit; a local folder and a hub id,
    or hub records without a commit, cannot be shown to be the same."""
    a, b = recorded.get("local_hash"), now.get("local_hash")
    if a or b:
        if a == b:
            return None
        if not (a and b):
            return "a local folder and a hub model"
        old = [h for h in (a, b) if _PARTIAL.fullmatch(h)]
        return ("other fingerprints" if not old else
                f"other fingerprints: {old[0]} was recorded by an earlier replayquant, which "
                f"hashed only the first and last MiB of each weight file")
    if recorded.get("id") != now.get("id"):
        return "other models"
    if not recorded.get("revision") or not now.get("revision"):
        return "no commit recorded for both, so they cannot be shown to be one revision"
    return None if recorded["revision"] == now["revision"] else "other revisions"
