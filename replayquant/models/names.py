"""Short model names users type, and their Hugging Face hub ids.

=====================  ==========================================  =========================
short name             hub id                                      recurrent layers
=====================  ==========================================  =========================
Qwen3.5-0.8B           Qwen/Qwen3.5-0.8B                           Gated DeltaNet (dense)
Qwen3.5-2B             Qwen/Qwen3.5-2B                             Gated DeltaNet (dense)
Qwen3.5-4B             Qwen/Qwen3.5-4B                             Gated DeltaNet (dense)
Qwen3.5-9B             Qwen/Qwen3.5-9B                             Gated DeltaNet (dense)
Qwen3.5-27B            Qwen/Qwen3.5-27B                            Gated DeltaNet (dense)
Qwen3.5-35B-A3B        Qwen/Qwen3.5-35B-A3B                        Gated DeltaNet (MoE)
Qwen3.5-122B-A10B      Qwen/Qwen3.5-122B-A10B                      Gated DeltaNet (MoE)
Qwen3-Next-80B-A3B     Qwen/Qwen3-Next-80B-A3B-Instruct            Gated DeltaNet (MoE)
Qwen3-Next-80B-A3B-Thinking  Qwen/Qwen3-Next-80B-A3B-Thinking      Gated DeltaNet (MoE)
Nemotron-H-4B          nvidia/Nemotron-H-4B-Base-8K                Mamba-2
Nemotron-H-8B          nvidia/Nemotron-H-8B-Base-8K                Mamba-2
Nemotron-Nano-9B-v2    nvidia/NVIDIA-Nemotron-Nano-9B-v2           Mamba-2
Nemotron-Nano-12B-v2   nvidia/NVIDIA-Nemotron-Nano-12B-v2          Mamba-2
Mamba-Codestral-7B     mistralai/Mamba-Codestral-7B-v0.1           Mamba-2 (pure)
tiny-qwen3.5           replayquant/assets/tiny-qwen3.5 (shipped)   Gated DeltaNet (dense)
tiny-mamba2            replayquant/assets/tiny-mamba2 (shipped)    Mamba-2 (pure)
=====================  ==========================================  =========================

Matching is case-insensitive; a name not in the table is used as given (a hub id or a local
path). The ids were not checked against the hub from this machine (no hub access).
"""

from __future__ import annotations

import os
import re

__all__ = ["SHORT_NAMES", "looks_like_path", "resolve_model_name"]

SHORT_NAMES: dict[str, str] = {
    "Qwen3.5-0.8B": "Qwen/Qwen3.5-0.8B",
    "Qwen3.5-2B": "Qwen/Qwen3.5-2B",
    "Qwen3.5-4B": "Qwen/Qwen3.5-4B",
    "Qwen3.5-9B": "Qwen/Qwen3.5-9B",
    "Qwen3.5-27B": "Qwen/Qwen3.5-27B",
    "Qwen3.5-35B-A3B": "Qwen/Qwen3.5-35B-A3B",
    "Qwen3.5-122B-A10B": "Qwen/Qwen3.5-122B-A10B",
    "Qwen3-Next-80B-A3B": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "Qwen3-Next-80B-A3B-Thinking": "Qwen/Qwen3-Next-80B-A3B-Thinking",
    "Nemotron-H-4B": "nvidia/Nemotron-H-4B-Base-8K",
    "Nemotron-H-8B": "nvidia/Nemotron-H-8B-Base-8K",
    "Nemotron-Nano-9B-v2": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
    "Nemotron-Nano-12B-v2": "nvidia/NVIDIA-Nemotron-Nano-12B-v2",
    "Mamba-Codestral-7B": "mistralai/Mamba-Codestral-7B-v0.1",
    # embedded tiny models trained on the KJV (package data; evals/train_tiny.py)
    "tiny-qwen3.5": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "assets", "tiny-qwen3.5"),
    "tiny-mamba2": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "assets", "tiny-mamba2"),
}


# what the hub accepts as a repository id: owner/name of letters, digits, '-', '_', '.'
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")


def looks_like_path(name: str) -> bool:
    """True for a name that can only be a local path (not a short name, not a hub id owner/name):
    it starts with '.', '/' or '~', holds a backslash or more than one '/', or ends with '/'."""
    return (name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1
            or name.endswith("/") or ("/" in name and not _HUB_ID.fullmatch(name)))


def resolve_model_name(name_or_path) -> str:
    """A short name -> its hub id; an existing local folder or a hub id (owner/name) ->
    unchanged (a leading ~ expanded). A path that is not there ("folder not found"), a file
    instead of a folder, or a name that is none of these is one ValueError."""
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"model name must be a non-empty string (a short name such as "
                         f"'Qwen3.5-4B', a hub id or a local path), got {name_or_path!r}")
    lower = {k.lower(): v for k, v in SHORT_NAMES.items()}
    if name_or_path.lower() in lower:
        return lower[name_or_path.lower()]
    local = os.path.expanduser(name_or_path)
    what = ("a local model folder (config.json, weights and a tokenizer), a hub id (owner/name) "
            f"or a short name ({', '.join(SHORT_NAMES)})")
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise ValueError(f"model {name_or_path!r} is a file, not a model folder; give {what}")
    if looks_like_path(name_or_path):
        raise ValueError(f"unknown or unreachable model {name_or_path!r}: folder not found; "
                         f"give {what}")
    if "/" in name_or_path:
        return name_or_path
    raise ValueError(f"unknown model {name_or_path!r}: not a short name, not a local folder and not "
                     f"a hub id (owner/name); give {what}")
