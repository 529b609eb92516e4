"""Resume of a KL run: which documents earlier runs finished, and whether they may be kept.

Each finished document's record in the progress logs (`files.read_progress`) names its index, id,
the sha256 of its tokens (`document_fingerprint`) and the code that computed it (`code_version`).
A resumed run keeps the documents whose id and tokens are those the dataset gives now, recomputes
(saying so) the others, and refuses results of another model (`check_same_model`: the fingerprint
of every byte of a local folder), another configuration, another scoring or another code version
(`finished_documents`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import replayquant
from replayquant.outputs import check_owned, diff_records, other_run_error
from replayquant.provenance import describe_model, git_commit, model_mismatch

from .data import DocumentSet
from .files import config_scoring, fresh_names, kl_shape, load_document_kl, read_progress, run_paths
from .report import RESULTS_KIND

_SCORING_WORDS = {"all": "every position", "llama": "the second half of each window, as llama.cpp"}


def check_scoring(out: Path, run_dir: Path, old: dict, config: dict) -> None:
    """One ValueError when results on disk were scored another way than this run scores, or by
    a version that recorded no scoring (and kept per-token KL in float16)."""
    if not isinstance(old, dict) or "context" not in old:
        return
    if "scoring" not in old:
        raise ValueError(f"{out} holds results of an earlier replayquant, which recorded no "
                         f"scoring and kept per-token KL in float16 (this one keeps float32, so "
                         f"the percentiles would mix the two): refusing to resume it. Pass a new "
                         f"--out, or delete {out} and {run_dir}/ to recompute")
    was, now = config_scoring(old), config_scoring(config)
    if was != now:
        raise ValueError(f"{out} holds results scored with --scoring {was} ({_SCORING_WORDS.get(was, was)}); "
                         f"this run scores with --scoring {now} ({_SCORING_WORDS[now]}): refusing to "
                         f"mix them. Run with --scoring {was} to resume, pass a new --out, or delete "
                         f"{out} and {run_dir}/ to start fresh")


def check_same_model(out: Path, run_dir: Path, recorded: list, config: dict) -> None:
    """One ValueError naming both models when results on disk (the configurations `recorded` in
    NAME.json and the progress logs) were computed on another model than this run loads
    (`provenance.model_mismatch`: a local folder by the fingerprint of all its bytes)."""
    for old in recorded:
        if not isinstance(old, dict) or not isinstance(old.get("model"), dict):
            continue
        why = model_mismatch(old["model"], config["model"])
        if why:
            raise ValueError(f"{out} and {run_dir}/ hold results computed on the model "
                             f"{describe_model(old['model'])}; this run loads another model, "
                             f"{describe_model(config['model'])} ({why}): refusing to mix results "
                             f"of two models. Put that model back to resume, pass a new --out, or "
                             f"delete {out} and {run_dir}/ to recompute")


def document_fingerprint(tokens: torch.Tensor) -> str:
    """sha256 of a document's token ids (int64, little-endian): what its KL was computed on."""
    a = np.ascontiguousarray(tokens.detach().cpu().numpy().astype("<i8"))
    return "sha256:" + hashlib.sha256(a.tobytes()).hexdigest()[:32]


def code_version() -> dict:
    """The code that computes per-document results: replayquant's version and the git commit
    of the checkout it runs from (`provenance.git_commit`: '+dirty' with uncommitted edits,
    'unknown' outside a checkout)."""
    return {"replayquant": replayquant.__version__, "git_commit": git_commit()}


def same_code(a, b) -> bool:
    """Whether two `code_version` records name the same code: the same replayquant version and,
    where both runs came from clean checkouts, the same commit (a commit names the code exactly
    only without uncommitted edits; with them, or outside a checkout, the version is all that
    can be compared)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if a.get("replayquant") != b.get("replayquant"):
        return False
    ca, cb = str(a.get("git_commit")), str(b.get("git_commit"))
    exact = all(c != "unknown" and not c.endswith("+dirty") for c in (ca, cb))
    return ca == cb if exact else True


def _code_str(code) -> str:
    if not isinstance(code, dict):
        return "a replayquant that did not record its version"
    return f"replayquant {code.get('replayquant')} at commit {code.get('git_commit')}"


def finished_documents(out: Path, config: dict, docs: DocumentSet, code: dict | None = None,
                       fingerprints: dict[int, str] | None = None,
                       report: Callable[[str], None] | None = None) -> dict[int, dict]:
    """Records of documents already finished by earlier runs of this configuration and code.

    Refused (ValueError, saying what to do): results of another configuration, or per-document
    results of other code (`same_code`; code None: this code's `code_version()`). Recomputed, with one
    line through `report` naming the document and why: a finished document whose id or tokens
    (`document_fingerprint`) differ from the document the dataset now gives at its index."""
    run_dir, _ = run_paths(out)
    code = code_version() if code is None else code
    if fingerprints is None:
        fingerprints = {d.index: document_fingerprint(d.tokens) for d in docs.documents}
    headers, records = read_progress(run_dir) if run_dir.is_dir() else ([], [])
    for r in records:
        if not same_code(r.get("code"), code):
            raise ValueError(
                f"{run_dir}/ holds per-document results computed by {_code_str(r.get('code'))}; "
                f"this is {_code_str(code)}: refusing to mix results of two code versions. Resume "
                f"with that code, pass a new --out, or delete {out} and {run_dir}/ to recompute")
    recorded = [h["config"] for h in headers]
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            old = None
        if isinstance(old, dict) and old.get("kind") == RESULTS_KIND:
            check_scoring(out, run_dir, old.get("config", {}), config)
            recorded.insert(0, old.get("config", {}))
    check_same_model(out, run_dir, recorded, config)
    check_owned(out, RESULTS_KIND, "replayquant kl", identity=config,
                recorded=lambda old: old.get("config", {}),
                rebuilt_from=f"{run_dir}/" if run_dir.is_dir() else None,
                fresh=fresh_names(out))
    for h in headers:
        check_scoring(out, run_dir, h["config"], config)
        diffs = diff_records(h["config"], config)
        if diffs:
            raise other_run_error(out, diffs, fresh_names(out))
    planned = {d.index: d for d in docs.documents}
    done, stale = {}, {}
    for r in records:
        i = r["index"]
        if i not in planned:
            continue                  # beyond this run's --docs: kept for a larger one
        d = planned[i]
        if r["id"] != d.id or r.get("tokens") != fingerprints[i]:
            stale[i] = r
            continue
        if (run_dir / r["npy"]).exists():
            load_document_kl(run_dir / r["npy"], kl_shape(config), i)
            done[i] = r
    for i in sorted(set(stale) - set(done)):
        r, d = stale[i], planned[i]
        why = (f"the dataset now gives {d.id!r} at this index, {r['id']!r} was computed"
               if r["id"] != d.id else
               f"its tokens differ from those its KL was computed on ({r.get('tokens')} then, "
               f"{fingerprints[i]} now: the text or the tokenizer changed)")
        if report is not None:
            report(f"document {i} ({d.id!r}): {why}; recomputing it")
    return done
