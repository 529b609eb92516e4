"""Provenance of a results file: who, what, where, when."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path

import torch

import replayquant


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
