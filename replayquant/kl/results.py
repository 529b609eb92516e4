"""The results of a KL run: NAME.json (and NAME.png) merged from the per-document files, and
results re-scored from the per-token values they keep (`rescore`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from replayquant.outputs import write_json
from replayquant.provenance import provenance

from . import stats as S
from .data import DocumentSet
from .files import (check_run_folder, config_scoring, dp_name, kl_shape, load_document_dp,
                    load_document_kl, load_side, read_progress, run_paths, side_name)
from .plot import plot_kl_vs_position
from .report import RESULTS_KIND, load_results
from .resume import document_fingerprint

RESULTS_VERSION = 1


def write_results(out: Path, config: dict, docs: DocumentSet, t_start: float,
                  extra_params: dict | None = None, plot: bool = True,
                  fingerprints: dict[int, str] | None = None) -> dict:
    """Merge every progress file into NAME.json (and NAME.png)."""
    run_dir, png = run_paths(out)
    if fingerprints is None:
        fingerprints = {d.index: document_fingerprint(d.tokens) for d in docs.documents}
    recs = _planned_records(run_dir, docs, fingerprints)
    arrays = {r["index"]: load_document_kl(run_dir / r["npy"], kl_shape(config), r["index"])
              for r in recs}
    results = _pair_results(run_dir, config, recs, arrays)
    peak = {}
    for key in ("peak_gpu_bytes", "peak_rss_bytes"):
        vals = [r[key] for r in recs if key in r]
        if vals:
            peak[key] = max(vals)
    params = {
        "model": config["model"], "pairs": config["pairs"],
        "buffer_len": {p["name"]: p.get("buffer_len") for p in config["pairs"]},
        "prefill": config["prefill"], "scoring": config_scoring(config), "dataset": docs.record(),
        "context": config["context"],
        "segment": config["segment"], "seed": config["seed"],
        "document_ids": [r["id"] for r in recs],
        "wall_time_s": time.time() - t_start,
        "compute_time_s": sum(r["wall_s"] for r in recs),
        **peak, **(extra_params or {}),
    }
    res = {
        "kind": RESULTS_KIND, "version": RESULTS_VERSION,
        "complete": len(recs) == len(docs.documents),
        "documents_done": len(recs), "documents_planned": len(docs.documents),
        "notes": docs.notes,
        "config": config,
        "provenance": provenance(**params),
        "kl_tokens_dir": run_dir.name,
        "results": results,
    }
    write_json(out, res)
    if plot and recs:
        plot_kl_vs_position(res, arrays, [p["name"] for p in config["pairs"]], png,
                            first=S.scored_range(config["context"], config_scoring(config))[0])
    return res


def _planned_records(run_dir: Path, docs: DocumentSet, fingerprints: dict[int, str]) -> list[dict]:
    """The finished documents' records in the progress logs, by index: documents of this run's
    plan only (an earlier run may have had a larger --docs), computed on the tokens the dataset
    gives now (`fingerprints`), whose KL file exists."""
    _, records = read_progress(run_dir)
    by_index = {}
    planned = {d.index: (d.id, fingerprints[d.index]) for d in docs.documents}
    for r in records:
        if planned.get(r["index"]) == (r["id"], r.get("tokens")) and (run_dir / r["npy"]).exists():
            by_index[r["index"]] = r
    return [by_index[i] for i in sorted(by_index)]


def _pair_results(run_dir: Path, config: dict, recs: list[dict],
                  arrays: dict[int, np.ndarray]) -> dict[str, dict | None]:
    """Per pair, the statistics (`stats.summarize`) of the documents `recs` with their per-token
    KL `arrays`; None for every pair when no document is finished."""
    dps = load_document_dp(run_dir, recs, kl_shape(config))
    results = {}
    for j, p in enumerate(config["pairs"]):
        name = p["name"]
        doc_recs = [{"id": r["id"], "index": r["index"], **r["pairs"][name]} for r in recs]
        kl = np.concatenate([arrays[r["index"]][j] for r in recs]) if recs else None
        dp = np.concatenate([dps[r["index"]][j] for r in recs]) if recs and dps else None
        results[name] = S.summarize(doc_recs, kl, config["bucket_base"], dp_values=dp) if recs else None
    return results


def load_scored(paths, scoring: str | None = None) -> list[tuple[str, dict]]:
    """(source, results) of each KL results file (`report.load_results`), re-scored to
    `scoring` where one is given (`rescore`; None: as each file was scored)."""
    loaded = load_results(paths)
    if scoring is None:
        return loaded
    return [(src, rescore(res, src, scoring)) for src, res in loaded]


def document_metrics(res: dict, path: str | os.PathLike, scoring: str):
    """Per document of the results `res` of the file `path` (as written, or as `rescore` gave
    them), in order: (its per_document record, the first position scored, {pair: per-token
    metrics at `scoring`}, as `stats.token_metrics` gives them), read from the per-token values
    in its NAME.kl/ folder (checked to be this file's, `check_run_folder`, where `res` is as
    written; `rescore` checked it before re-scoring). A damaged or missing per-token file is one
    ValueError naming it."""
    cfg = res["config"]
    was = res.get("rescored_from") or config_scoring(cfg)       # the positions stored
    path = Path(path)
    run_dir = path.parent / res.get("kl_tokens_dir", path.with_suffix(".kl").name)
    if not res.get("rescored_from"):
        check_run_folder(path, res, run_dir)
    first = S.scored_range(cfg["context"], scoring)[0]
    skip = first - S.scored_range(cfg["context"], was)[0]       # stored positions before `first`
    shape = kl_shape({**cfg, "scoring": was})
    names = [p["name"] for p in cfg["pairs"]]
    docs = next((st["per_document"] for st in res["results"].values() if st), [])
    for d in docs:
        i = d["index"]
        npy = f"doc{i:05d}.npy"
        kl = load_document_kl(run_dir / npy, shape, i)
        dp = load_document_dp(run_dir, [{"index": i, "npy": npy}], shape)
        if dp is None:
            raise ValueError(f"{run_dir / dp_name(npy)} (the per-token delta-p of document {i}) "
                             f"is missing; run `replayquant kl --scoring {scoring}`")
        dp = dp[i]
        nll = load_side(run_dir / side_name(npy, "nll"), np.float32, (1 + shape[0], shape[1]), "NLL", i)
        top = load_side(run_dir / side_name(npy, "top"), np.bool_, shape, "top-token agreement", i)
        yield d, first, {n: {"kl": torch.from_numpy(kl[j, skip:]), "dp": torch.from_numpy(dp[j, skip:]),
                             "nll_ref": torch.from_numpy(nll[0, skip:]),
                             "nll_test": torch.from_numpy(nll[1 + j, skip:]),
                             "same_top": torch.from_numpy(top[j, skip:])}
                         for j, n in enumerate(names)}


def running_statistics(res: dict, path: str | os.PathLike) -> dict[str, list[dict]] | None:
    """Per pair, the statistics (`stats.summarize`) of the first 1, 2, ... documents of the
    results `res` of the file `path`, as scored there (llama.cpp's per-chunk table, a chunk being
    one document), from the per-token values in its NAME.kl/ folder; None where that folder is
    not beside the file."""
    path = Path(path)
    if not (path.parent / res.get("kl_tokens_dir", path.with_suffix(".kl").name)).is_dir():
        return None
    base = res["config"]["bucket_base"]
    docs: dict[str, list] = {p["name"]: [] for p in res["config"]["pairs"]}
    out: dict[str, list] = {n: [] for n in docs}
    for _, first, metrics in document_metrics(res, path, config_scoring(res["config"])):
        for n, m in metrics.items():
            docs[n].append(S.document_sums(m, base, first))
            out[n].append(S.summarize(docs[n], None, base))
    return out


def rescore(res: dict, path: str | os.PathLike, scoring: str) -> dict:
    """The results `res` of the results file `path` as `scoring` gives them, rebuilt from the
    per-token values in its NAME.kl/ folder (KL, delta-p, NLL, top-token agreement): a run that
    scored every position re-scored to llama.cpp's window, as `kl --scoring llama` over the same
    documents gives it. The same scoring returns `res`; a run that scored fewer positions than
    asked for is one ValueError."""
    cfg = res["config"]
    was = config_scoring(cfg)
    if scoring == was:
        return res
    if was != "all":
        raise ValueError(f"{path} scored only positions {S.scored_range(cfg['context'], was)[0]} "
                         f"... of each document (--scoring {was}); it cannot be re-scored with "
                         f"--scoring {scoring}: run `replayquant kl --scoring {scoring}`")
    names = [p["name"] for p in cfg["pairs"]]
    per_pair: dict[str, list] = {n: [] for n in names}
    kl_all: dict[str, list] = {n: [] for n in names}
    dp_all: dict[str, list] = {n: [] for n in names}
    for d, first, metrics in document_metrics(res, path, scoring):
        for n, m in metrics.items():
            per_pair[n].append({"id": d["id"], "index": d["index"],
                                **S.document_sums(m, cfg["bucket_base"], first)})
            kl_all[n].append(m["kl"].numpy())
            dp_all[n].append(m["dp"].numpy())
    results = {n: (S.summarize(per_pair[n], np.concatenate(kl_all[n]), cfg["bucket_base"],
                               dp_values=np.concatenate(dp_all[n])) if per_pair[n] else None)
               for n in names}
    return {**res, "config": {**cfg, "scoring": scoring}, "results": results, "rescored_from": was}
