"""Short model names users type, and their Hugging Face hub ids.

============================  =========================================  ============================
short name                    hub id                                     recurrent layers
============================  =========================================  ============================
Qwen3.5-0.8B                  Qwen/Qwen3.5-0.8B                          Gated DeltaNet (dense)
Qwen3.5-2B                    Qwen/Qwen3.5-2B                            Gated DeltaNet (dense)
Qwen3.5-4B                    Qwen/Qwen3.5-4B                            Gated DeltaNet (dense)
Qwen3.5-9B                    Qwen/Qwen3.5-9B                            Gated DeltaNet (dense)
Qwen3.5-27B                   Qwen/Qwen3.5-27B                           Gated DeltaNet (dense)
Qwen3.5-35B-A3B               Qwen/Qwen3.5-35B-A3B                       Gated DeltaNet (MoE)
Qwen3.5-122B-A10B             Qwen/Qwen3.5-122B-A10B                     Gated DeltaNet (MoE)
Qwen3-Next-80B-A3B            Qwen/Qwen3-Next-80B-A3B-Instruct           Gated DeltaNet (MoE)
Qwen3-Next-80B-A3B-Thinking   Qwen/Qwen3-Next-80B-A3B-Thinking           Gated DeltaNet (MoE)
Nemotron-H-4B                 nvidia/Nemotron-H-4B-Base-8K               Mamba-2
Nemotron-H-8B                 nvidia/Nemotron-H-8B-Base-8K               Mamba-2
Nemotron-Nano-9B-v2           nvidia/NVIDIA-Nemotron-Nano-9B-v2          Mamba-2
Nemotron-Nano-12B-v2          nvidia/NVIDIA-Nemotron-Nano-12B-v2         Mamba-2
Mamba-Codestral-7B            mistralai/Mamba-Codestral-7B-v0.1          Mamba-2 (pure)
Falcon-H1-0.5B-Base           tiiuae/Falcon-H1-0.5B-Base                 Mamba-2 (parallel attention)
Falcon-H1-0.5B-Instruct       tiiuae/Falcon-H1-0.5B-Instruct             Mamba-2 (parallel attention)
Falcon-H1-1.5B-Base           tiiuae/Falcon-H1-1.5B-Base                 Mamba-2 (parallel attention)
Falcon-H1-1.5B-Instruct       tiiuae/Falcon-H1-1.5B-Instruct             Mamba-2 (parallel attention)
Falcon-H1-1.5B-Deep-Base      tiiuae/Falcon-H1-1.5B-Deep-Base            Mamba-2 (parallel attention)
Falcon-H1-1.5B-Deep-Instruct  tiiuae/Falcon-H1-1.5B-Deep-Instruct        Mamba-2 (parallel attention)
Falcon-H1-3B-Base             tiiuae/Falcon-H1-3B-Base                   Mamba-2 (parallel attention)
Falcon-H1-3B-Instruct         tiiuae/Falcon-H1-3B-Instruct               Mamba-2 (parallel attention)
Falcon-H1-7B-Base             tiiuae/Falcon-H1-7B-Base                   Mamba-2 (parallel attention)
Falcon-H1-7B-Instruct         tiiuae/Falcon-H1-7B-Instruct               Mamba-2 (parallel attention)
Falcon-H1-34B-Base            tiiuae/Falcon-H1-34B-Base                  Mamba-2 (parallel attention)
Falcon-H1-34B-Instruct        tiiuae/Falcon-H1-34B-Instruct              Mamba-2 (parallel attention)
granite-4.0-h-small           ibm-granite/granite-4.0-h-small            Mamba-2 (MoE)
granite-4.0-h-small-base      ibm-granite/granite-4.0-h-small-base       Mamba-2 (MoE)
granite-4.0-h-tiny            ibm-granite/granite-4.0-h-tiny             Mamba-2 (MoE)
granite-4.0-h-tiny-base       ibm-granite/granite-4.0-h-tiny-base        Mamba-2 (MoE)
granite-4.0-h-micro           ibm-granite/granite-4.0-h-micro            Mamba-2
granite-4.0-h-micro-base      ibm-granite/granite-4.0-h-micro-base       Mamba-2
granite-4.0-h-1b              ibm-granite/granite-4.0-h-1b               Mamba-2
granite-4.0-h-1b-base         ibm-granite/granite-4.0-h-1b-base          Mamba-2
granite-4.0-h-350m            ibm-granite/granite-4.0-h-350m             Mamba-2
granite-4.0-h-350m-base       ibm-granite/granite-4.0-h-350m-base        Mamba-2
Bamba-9B-v1                   ibm-ai-platform/Bamba-9B-v1                Mamba-2
Bamba-9B-v2                   ibm-ai-platform/Bamba-9B-v2                Mamba-2
Zamba2-1.2B                   Zyphra/Zamba2-1.2B                         Mamba-2 (shared attention)
Zamba2-2.7B                   Zyphra/Zamba2-2.7B                         Mamba-2 (shared attention)
Zamba2-7B                     Zyphra/Zamba2-7B                           Mamba-2 (shared attention)
Zamba2-1.2B-Instruct          Zyphra/Zamba2-1.2B-instruct                Mamba-2 (shared attention)
Zamba2-2.7B-Instruct          Zyphra/Zamba2-2.7B-instruct                Mamba-2 (shared attention)
Zamba2-7B-Instruct            Zyphra/Zamba2-7B-Instruct                  Mamba-2 (shared attention)
Zamba2-1.2B-Instruct-v2       Zyphra/Zamba2-1.2B-Instruct-v2             Mamba-2 (shared attention)
Zamba2-2.7B-Instruct-v2       Zyphra/Zamba2-2.7B-Instruct-v2             Mamba-2 (shared attention)
Zamba2-7B-Instruct-v2         Zyphra/Zamba2-7B-Instruct-v2               Mamba-2 (shared attention)
Olmo-Hybrid-7B                allenai/Olmo-Hybrid-7B                     Gated DeltaNet
Kimi-Linear-48B-A3B-Instruct  moonshotai/Kimi-Linear-48B-A3B-Instruct    Kimi Delta Attention (MoE)
Kimi-Linear-48B-A3B-Base      moonshotai/Kimi-Linear-48B-A3B-Base        Kimi Delta Attention (MoE)
GLM-5.3-Flash                 zai-org/GLM-5.3-Flash                      Kimi Delta Attention (MoE)
tiny-qwen3.5                  replayquant/assets/tiny-qwen3.5            Gated DeltaNet (dense)
tiny-mamba2                   replayquant/assets/tiny-mamba2             Mamba-2 (pure)
tiny-kimi-linear              replayquant/assets/tiny-kimi-linear        Kimi Delta Attention (dense)
============================  =========================================  ============================

Matching is case-insensitive; a name not in the table is used as given (a hub id or a local
path). The ids are the checkpoints as their publishers name them; they were not checked against
the hub from this machine (no hub access). The tiny-* models ship inside the package (trained by
evals/train_tiny.py on the KJV; replayquant/assets/README.md).
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
    "Falcon-H1-0.5B-Base": "tiiuae/Falcon-H1-0.5B-Base",
    "Falcon-H1-0.5B-Instruct": "tiiuae/Falcon-H1-0.5B-Instruct",
    "Falcon-H1-1.5B-Base": "tiiuae/Falcon-H1-1.5B-Base",
    "Falcon-H1-1.5B-Instruct": "tiiuae/Falcon-H1-1.5B-Instruct",
    "Falcon-H1-1.5B-Deep-Base": "tiiuae/Falcon-H1-1.5B-Deep-Base",
    "Falcon-H1-1.5B-Deep-Instruct": "tiiuae/Falcon-H1-1.5B-Deep-Instruct",
    "Falcon-H1-3B-Base": "tiiuae/Falcon-H1-3B-Base",
    "Falcon-H1-3B-Instruct": "tiiuae/Falcon-H1-3B-Instruct",
    "Falcon-H1-7B-Base": "tiiuae/Falcon-H1-7B-Base",
    "Falcon-H1-7B-Instruct": "tiiuae/Falcon-H1-7B-Instruct",
    "Falcon-H1-34B-Base": "tiiuae/Falcon-H1-34B-Base",
    "Falcon-H1-34B-Instruct": "tiiuae/Falcon-H1-34B-Instruct",
    "granite-4.0-h-small": "ibm-granite/granite-4.0-h-small",
    "granite-4.0-h-small-base": "ibm-granite/granite-4.0-h-small-base",
    "granite-4.0-h-tiny": "ibm-granite/granite-4.0-h-tiny",
    "granite-4.0-h-tiny-base": "ibm-granite/granite-4.0-h-tiny-base",
    "granite-4.0-h-micro": "ibm-granite/granite-4.0-h-micro",
    "granite-4.0-h-micro-base": "ibm-granite/granite-4.0-h-micro-base",
    "granite-4.0-h-1b": "ibm-granite/granite-4.0-h-1b",
    "granite-4.0-h-1b-base": "ibm-granite/granite-4.0-h-1b-base",
    "granite-4.0-h-350m": "ibm-granite/granite-4.0-h-350m",
    "granite-4.0-h-350m-base": "ibm-granite/granite-4.0-h-350m-base",
    "Bamba-9B-v1": "ibm-ai-platform/Bamba-9B-v1",
    "Bamba-9B-v2": "ibm-ai-platform/Bamba-9B-v2",
    "Zamba2-1.2B": "Zyphra/Zamba2-1.2B",
    "Zamba2-2.7B": "Zyphra/Zamba2-2.7B",
    "Zamba2-7B": "Zyphra/Zamba2-7B",
    "Zamba2-1.2B-Instruct": "Zyphra/Zamba2-1.2B-instruct",
    "Zamba2-2.7B-Instruct": "Zyphra/Zamba2-2.7B-instruct",
    "Zamba2-7B-Instruct": "Zyphra/Zamba2-7B-Instruct",
    "Zamba2-1.2B-Instruct-v2": "Zyphra/Zamba2-1.2B-Instruct-v2",
    "Zamba2-2.7B-Instruct-v2": "Zyphra/Zamba2-2.7B-Instruct-v2",
    "Zamba2-7B-Instruct-v2": "Zyphra/Zamba2-7B-Instruct-v2",
    "Olmo-Hybrid-7B": "allenai/Olmo-Hybrid-7B",
    "Kimi-Linear-48B-A3B-Instruct": "moonshotai/Kimi-Linear-48B-A3B-Instruct",
    "Kimi-Linear-48B-A3B-Base": "moonshotai/Kimi-Linear-48B-A3B-Base",
    "GLM-5.3-Flash": "zai-org/GLM-5.3-Flash",
    # embedded tiny models trained on the KJV (package data; evals/train_tiny.py)
    "tiny-qwen3.5": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "assets", "tiny-qwen3.5"),
    "tiny-mamba2": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "assets", "tiny-mamba2"),
    "tiny-kimi-linear": os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     "assets", "tiny-kimi-linear"),
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
