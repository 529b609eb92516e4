"""Provenance of a results file: who, what, where, when."""

from __future__ import annotations

import datetime as _dt
import platform
import subprocess
from pathlib import Path


def git_commit() -> str:
    """HEAD commit of the checkout this package runs from ('+dirty' if the tree has changes).

    A copy without .git (e.g. a tree sent to a GPU machine) reads REPLAYQUANT_GIT_COMMIT, which
    the sender sets to the commit it copied; else 'unknown'.
    """
    import os
    if os.environ.get("REPLAYQUANT_GIT_COMMIT"):
        return os.environ["REPLAYQUANT_GIT_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device=None) -> str:
    import torch
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        return torch.cuda.get_device_name(device if device is not None else 0)
    return f"cpu ({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores)"


def versions() -> dict:
    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("triton", "transformers", "datasets", "lm_eval"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # not installed on this machine
            out[mod] = None
    import replayquant
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
