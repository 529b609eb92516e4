"""The files of a KL run: where each goes, and how each is written and read back.

Files of a run with `out = build/kl/NAME.json` (checked before any work, `check_out`: a .json
name in a writable folder, not holding a file of another kind), each written through
`replayquant.outputs` (a temporary file of its own, fsync, rename; a failed write keeps the
earlier file); NAME.lock beside them while the run holds the output (a second run into it is
refused):
* `NAME.json`: the results (statistics per pair, per bucket, per document, provenance); rewritten
  after every finished document (`"complete": false` until the last one);
* `NAME.kl/docNNNNN.npy`: per-token KL of one document, float32 [n_pairs, n_scored] (the scored
  positions, `stats.scored_range`: context - 1 of them under --scoring all, the second half under
  llama); float32 as llama.cpp keeps them, so percentiles and medians are those of the values
  computed (float16 would move them by up to 2^-11 of their size);
* `NAME.kl/docNNNNN.dp.npy`: per-token delta-p of one document, float32 [n_pairs, n_scored];
* `NAME.kl/docNNNNN.nll.npy`: per-token NLL, float32 [1 + n_pairs, n_scored] (row 0 the
  reference's, row 1 + j pair j's), and `docNNNNN.top.npy`, whether the top tokens agree, bool
  [n_pairs, n_scored]: with the KL and delta-p, every per-token value the statistics are made of,
  so a run that scored every position can be re-scored to llama.cpp's window (`results.rescore`);
* `NAME.kl/progress.rankR.jsonl`: append-only log, a config line then one line per finished
  document with exact float64 sums, the sha256 of its tokens and the code version; resume reads
  these and skips finished documents, recomputes (saying so) a document whose tokens or id
  changed, and refuses another configuration or another code version
  (`resume.finished_documents`);
* `NAME.png`: KL against position (log x), one line per pair.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from replayquant.outputs import (append_line, check_owned, check_writable_folder, diff_records,
                                 output_lock, parse_json, save_npy)

from . import stats as S
from .report import RESULTS_KIND


def run_paths(out: Path) -> tuple[Path, Path]:
    """(NAME.kl/, NAME.png) of the results file `out` = NAME.json."""
    return out.with_suffix(".kl"), out.with_suffix(".png")


def check_out(out: str | os.PathLike) -> Path:
    """The results path of a run, checked before any work: a file name ending in .json (the
    plot goes beside it as NAME.png and the per-document files into NAME.kl/, so no other
    suffix can share a name with them), not a folder, in a folder that can be written (created
    if missing). What a run folder already there holds is read first (`read_progress`), then
    `replayquant.outputs` says whether the run may write and replace its files there. Returns it
    as a Path; raises one ValueError saying what to give instead."""
    out = Path(os.path.expanduser(str(out)))
    if out.is_dir():
        raise ValueError(f"--out {out} is a folder; give the results file's name, e.g. "
                         f"--out {out / 'results.json'}")
    if out.suffix.lower() != ".json":
        raise ValueError(f"--out {out}: the results file must end in .json (the plot is written "
                         f"beside it as NAME.png, the per-document files into NAME.kl/); give e.g. "
                         f"--out {out.with_suffix('.json')}")
    if out.exists() and not out.is_file():
        raise ValueError(f"--out {out} exists and is not a regular file; give another --out")
    run_dir, png = run_paths(out)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--out {out}: {run_dir} (where the per-document files go) exists and is "
                         f"not a folder; move it away or give another --out")
    if png.is_dir():
        raise ValueError(f"--out {out}: {png} (where the plot goes) is a folder; move it away or "
                         f"give another --out")
    resumes = run_dir.is_dir()
    if resumes:
        read_progress(run_dir)                # damaged logs: one error before any work
    # then whether the run may write there; a file there is replaced only when it is a KL results
    # file (the configuration is compared with the run's in `resume.finished_documents`); the plot
    # only with it or with its run's folder
    check_writable_folder(out.parent, out)
    if resumes:
        check_writable_folder(run_dir, out)
    check_owned(out, RESULTS_KIND, "replayquant kl", beside=() if resumes else (png,),
                rebuilt_from=f"{run_dir}/" if resumes else None)
    return out


@contextlib.contextmanager
def held_out(out: str | os.PathLike, main: bool = True):
    """The results path of a run, checked (`check_out`) and, on the main process, held for the
    `with` block (`replayquant.outputs.output_lock`: a second run into it is refused); yields it
    as a Path. The other processes of a data-parallel run work under the main process's hold."""
    out = check_out(out)
    with output_lock(out) if main else contextlib.nullcontext():
        yield out


def check_run_folder(path: Path, res: dict, run_dir: Path) -> None:
    """One ValueError naming both when `run_dir` is not the per-token folder of the results file
    `path` (`res`), as where a results file was copied beside another run's folder of the name
    it records: the folder's progress logs hold another run's configuration (model with its
    fingerprint, data, pairs, settings), or a document's per-token KL is not the one the results
    recorded (its length and largest value per pair, both exact)."""
    cfg = res["config"]
    headers, _ = read_progress(run_dir) if run_dir.is_dir() else ([], [])
    if not headers:
        raise ValueError(f"{run_dir}/, where {path} keeps its per-token values, holds no progress "
                         f"log of a KL run; re-score the results file beside its own run's folder, "
                         f"or run `replayquant kl` again")
    for h in headers:
        diffs = [d.split(":")[0] for d in diff_records(h["config"], cfg)]
        if diffs:
            raise ValueError(f"{run_dir}/ holds the per-token values of another run than {path} "
                             f"(pairs {_pair_names(h['config'])} there, {_pair_names(cfg)} in "
                             f"{path}; they differ in {', '.join(diffs)}): re-score a results "
                             f"file beside its own run's folder")
    shape = kl_shape(cfg)
    for j, p in enumerate(cfg["pairs"]):
        for d in (res["results"].get(p["name"]) or {}).get("per_document", []):
            npy = run_dir / f"doc{d['index']:05d}.npy"
            row = load_document_kl(npy, shape, d["index"])[j]
            if row.size != d["n_tokens"] or not np.array_equal(row.max(), d["kl_max"],
                                                               equal_nan=True):
                raise ValueError(f"{npy} is not the per-token KL {path} recorded for pair "
                                 f"{p['name']} on document {d['index']} (largest value "
                                 f"{float(row.max()):.6g} there, {d['kl_max']:.6g} in {path}): "
                                 f"{run_dir}/ holds another run's values; re-score a results file "
                                 f"beside its own run's folder")


def _pair_names(config: dict) -> str:
    return ", ".join(p.get("name", "?") for p in config.get("pairs", []))


def fresh_names(out: Path) -> list[str]:
    """The files of a run besides NAME.json, named where a message says how to start fresh."""
    run_dir, png = run_paths(out)
    return [str(png), f"{run_dir}/"]


def config_scoring(config: dict) -> str:
    """The scoring of a configuration; files written before scorings existed scored every position."""
    return config.get("scoring", "all")


def kl_shape(config: dict) -> tuple[int, int]:
    """The shape of a document's per-token KL under `config`: [n_pairs, n_scored]."""
    first, stop = S.scored_range(config["context"], config_scoring(config))
    return len(config["pairs"]), stop - first


def read_progress(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(config headers, document records) of every progress file. A line that is not JSON is
    one torn by an interrupted write (its document is computed again); a JSON line that is not
    a record `append_record` writes, or a log that is not a file, is one ValueError naming the
    file and line and what to delete (`_progress_problem`)."""
    headers, records = [], []
    for f in sorted(run_dir.glob("progress.rank*.jsonl")):
        if not f.is_file():
            raise ValueError(f"{f} is not a file; the progress log of a KL run's process goes "
                             f"there: move it away, then run the same command again")
        names = None                  # the pairs of this log's configuration
        with open(f, encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                try:
                    obj = parse_json(line)
                except json.JSONDecodeError:
                    continue   # interrupted mid-write: that document is redone
                why = _progress_problem(obj, names)
                if why:
                    fix = (f"delete {f} to compute its documents again (the other logs' "
                           f"documents are kept)" if why[1] else
                           "delete that line to compute its document again (the others are kept)")
                    raise ValueError(f"{f}: line {n} {why[0]}; the log is damaged: {fix}")
                if obj["type"] == "config":
                    headers.append(obj)
                    names = _pair_names_of(obj["config"])
                else:
                    records.append(obj)
    return headers, records


def _pair_names_of(config: dict) -> set | None:
    pairs = config.get("pairs")
    if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
        return None
    return {p.get("name") for p in pairs}


def _progress_problem(obj, names: set | None) -> tuple[str, bool] | None:
    """(what is wrong, whether the whole log is lost with it) for a JSON line of a progress log
    that is not a record `append_record` writes (`names`: the pairs of the log's configuration,
    None before its config line); None for one that is."""
    if not isinstance(obj, dict) or obj.get("type") not in ("config", "document"):
        return "is not a record of a KL run's progress log (type config or document)", False
    if obj["type"] == "config":
        if not isinstance(obj.get("config"), dict):
            return "is the log's configuration record with no configuration in it", True
        return None
    i = obj.get("index")
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        return f"is a document record whose index is {i!r}, not an integer >= 0", False
    if obj.get("npy") != f"doc{i:05d}.npy":
        return (f"is the record of document {i} with npy {obj.get('npy')!r}, not its file "
                f"doc{i:05d}.npy"), False
    for key, kind in (("id", str), ("pairs", dict), ("wall_s", (int, float))):
        if not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
            return f"is the record of document {i} with no {key} of the kind written", False
    if names is not None and set(obj["pairs"]) != names:
        return (f"is the record of document {i} with pairs {sorted(obj['pairs'])}, not its log's "
                f"{sorted(names, key=str)}"), False
    if not all(_pair_sums_whole(v) for v in obj["pairs"].values()):
        return f"is the record of document {i} with sums that are not all there", False
    return None


def _pair_sums_whole(rec) -> bool:
    """Whether a pair's part of a document record holds what `stats.document_sums` writes."""
    def numbers(d, keys):
        return isinstance(d, dict) and all(isinstance(d.get(k), (int, float))
                                           and not isinstance(d.get(k), bool) for k in keys)
    return (numbers(rec, ("kl_max", "kl_min")) and numbers(rec.get("sums"), S.SUM_KEYS)
            and isinstance(rec.get("buckets"), list)
            and all(numbers(b, ("lo", "hi", *S.BUCKET_KEYS)) for b in rec["buckets"]))


def append_record(path: Path, obj: dict):
    """One line of a progress log (`read_progress` reads them back)."""
    append_line(path, json.dumps(obj))


def save_document(run_dir: Path, index: int, metrics: dict[str, dict], names: list[str]) -> str:
    """Writes the per-token values of document `index` (`lockstep.score_document`'s metrics of the
    pairs `names`, in that order) into `run_dir`; returns the name of its KL file."""
    npy = f"doc{index:05d}.npy"
    save_npy(run_dir / npy, np.stack([metrics[n]["kl"].numpy().astype(np.float32) for n in names]))
    save_npy(run_dir / dp_name(npy), np.stack([metrics[n]["dp"].numpy().astype(np.float32)
                                                for n in names]))
    save_npy(run_dir / side_name(npy, "nll"), np.stack(
        [metrics[names[0]]["nll_ref"].numpy()] +
        [metrics[n]["nll_test"].numpy() for n in names]).astype(np.float32))
    save_npy(run_dir / side_name(npy, "top"), np.stack([metrics[n]["same_top"].numpy() for n in names]))
    return npy


def load_document_kl(path: Path, shape: tuple, index: int) -> np.ndarray:
    """A document's per-token KL file, float32 [n_pairs, n_scored]; a damaged or foreign one
    is one ValueError naming it and saying how to recompute that document."""
    what = (f"delete it and re-run the same command to recompute document {index} (the other "
            f"finished documents are kept)")
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}, the per-token KL of document {index}, is damaged "
                         f"({type(e).__name__}: {e}); {what}") from None
    if a.dtype != np.float32 or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{path}, the per-token KL of document {index}, holds {a.dtype} "
                         f"{list(a.shape)} where float32 {list(shape)} was written; {what}")
    return a


def dp_name(npy: str) -> str:
    """The per-token delta-p file beside the KL file `npy`."""
    return npy[:-len(".npy")] + ".dp.npy"


def side_name(npy: str, what: str) -> str:
    """The per-token `what` (nll, top) file beside the KL file `npy`."""
    return npy[:-len(".npy")] + f".{what}.npy"


def load_side(path: Path, dtype, shape: tuple, what: str, index: int) -> np.ndarray:
    """A per-token side file (NLL, top-token agreement) of document `index`, checked."""
    if not path.is_file():
        raise ValueError(f"{path} (the per-token {what} of document {index}) is missing: the run "
                         f"was written by an earlier replayquant, which kept no per-token {what}; "
                         f"run `replayquant kl --scoring llama` for llama.cpp's window")
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        a = e
    if not isinstance(a, np.ndarray) or a.dtype != dtype or tuple(a.shape) != tuple(shape):
        raise ValueError(f"{path}, the per-token {what} of document {index}, is damaged; delete it "
                         f"and {path.name.split('.')[0]}.npy and re-run the kl command to recompute "
                         f"that document")
    return a


def load_document_dp(run_dir: Path, recs: list[dict], shape: tuple) -> dict[int, np.ndarray] | None:
    """Per document, the per-token delta-p file (float32 [n_pairs, n_scored], for the delta-p
    percentiles); None when a document has none (computed by a version that did not write them).
    A damaged one is one ValueError naming it."""
    out = {}
    for r in recs:
        path = run_dir / dp_name(r["npy"])
        if not path.exists():
            return None
        try:
            a = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            a = e
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or tuple(a.shape) != tuple(shape):
            raise ValueError(f"{path}, the per-token delta-p of document {r['index']}, is damaged; "
                             f"delete it and {r['npy']} and re-run the same command to recompute "
                             f"that document")
        out[r["index"]] = a
    return out
