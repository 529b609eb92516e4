"""The KL run: reference and test models in lockstep over the planned documents, with resume.

`run_kl` checks the settings, builds the variants (`lockstep`), plans the documents earlier runs
did not finish (`resume`), scores this process's share of them one document at a time, writing
each document's files and progress record (`files`) as it finishes, and merges every progress
file into NAME.json and NAME.png (`results`).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn,
                           TimeElapsedColumn)
from rich.text import Text

from replayquant.policy import resolve_pair
from replayquant.provenance import local_fingerprint

from . import stats as S
from .data import Document, DocumentSet, load_documents
from .files import append_record, held_out, read_progress, run_paths, save_document
from .lockstep import (SegmentRunner, Variant, check_pair_names, patch_variant, reference_variant,
                       score_document)
from .results import write_results
from .resume import code_version, document_fingerprint, finished_documents
from .settings import KLSettings

# ----------------------------------------------------------------------------------------------
# Model identity.

def model_record(model, name: str | None = None, dtype: str | None = None) -> dict:
    """Model id, hub revision or a local fingerprint, class and dtype, for the config and provenance."""
    cfg = model.config
    path = getattr(cfg, "_name_or_path", "") or ""
    # a local folder by its real path: named relative or absolute, it is the same model
    path = os.path.realpath(path) if path and os.path.isdir(path) else path
    name = os.path.realpath(name) if name and os.path.isdir(name) else name
    rec = {"id": name or path or type(model).__name__, "path": path, "class": type(model).__name__,
           "dtype": dtype or str(next(model.parameters()).dtype).replace("torch.", "")}
    rev = getattr(cfg, "_commit_hash", None)
    if rev:
        rec["revision"] = rev
    if path and Path(path).is_dir():
        rec["local_hash"] = local_fingerprint(Path(path))
    return rec


def max_context(model) -> int | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    m = getattr(cfg, "max_position_embeddings", None)
    return int(m) if m else None


# ----------------------------------------------------------------------------------------------
# The run.

@dataclasses.dataclass
class RunParts:
    """What a caller holding the model adds to a KL run beside its settings.

    make_variant(model, pair, prefill, seed) -> Variant builds the test variants (default:
    `replayquant.patch`, `lockstep.patch_variant`); model_info: the model's record (default:
    `model_record`); bucket_base: the first bucket of KL by position; lm_chunk: positions per LM
    head call (default about 2^28 / vocab); console: where notes go; state: an accelerate
    PartialState for data-parallel runs (documents are split round-robin between processes;
    process 0 merges the results); plot: write NAME.png; extra_params: recorded in the
    provenance."""
    make_variant: Callable | None = None
    model_info: dict | None = None
    bucket_base: int = 1024
    lm_chunk: int | None = None
    console: object = None
    state: object = None
    plot: bool = True
    extra_params: dict | None = None


def run_kl(model, tokenizer, pairs: list, settings: KLSettings | None = None, *,
           out: str | os.PathLike, scoring: str = "all", documents: DocumentSet | None = None,
           parts: RunParts | None = None) -> dict | None:
    """Run (or resume) a KL measurement with `settings` (default: KLSettings(); its dtype,
    device_map and revision are the loaded model's business, not this function's); returns the
    results dict (on the main process). `out` is checked and held by the main process for the
    whole run (`files.held_out`): a second run into the same output is refused.

    pairs: pair names / YAML paths / pair objects. The reference is `settings.reference`:
    "exact" (s32_rs patched with prefill="exact") or "hf" (the unpatched model).
    `documents`: a DocumentSet already loaded (by `load_documents` with the same settings).
    scoring: "all" (every position) or "llama" (the second half of each document, as llama.cpp's
    `--kl-divergence`; `stats.scored_range`); recorded in the results, and a resume with another
    scoring is refused.
    """
    settings = settings or KLSettings()
    settings.check()
    parts = parts or RunParts()
    main = parts.state is None or parts.state.is_main_process
    with held_out(out, main) as out:
        return run_checked_kl(model, tokenizer, pairs, settings, out=out, scoring=scoring,
                              documents=documents, parts=parts)


def run_checked_kl(model, tokenizer, pairs: list, settings: KLSettings, *, out: Path,
                   scoring: str, documents: DocumentSet | None, parts: RunParts) -> dict | None:
    """`run_kl` after its checks: `settings` checked, `out` checked and held by the main
    process (as `kl_command` holds its own)."""
    t_start = time.time()
    kl, state = settings, parts.state
    first = _check_model(model, pairs, kl.context, scoring)
    tests, reference = _variants(model, pairs, parts.make_variant or patch_variant, kl)
    runner = SegmentRunner(model)
    docs = documents or load_documents(kl.dataset, tokenizer, kl.context, kl.docs, split=kl.split,
                                       text_field=kl.text_field, pack=kl.pack,
                                       dataset_config=kl.dataset_config,
                                       data_files=kl.data_files)
    if any(d.tokens.numel() != kl.context for d in docs.documents):
        raise ValueError(f"the documents given are not all {kl.context} tokens long")
    config = _run_config(parts.model_info or model_record(model), reference, tests, docs, kl,
                         bucket_base=parts.bucket_base, scoring=scoring)
    run = _Run(out=out, config=config, docs=docs,
               fingerprints={d.index: document_fingerprint(d.tokens) for d in docs.documents},
               code=code_version(), rank=state.process_index if state is not None else 0,
               world=state.num_processes if state is not None else 1, t_start=t_start,
               extra_params=parts.extra_params)
    mine = _documents_to_score(run, state, parts.console)
    progress_log = _progress_log(run)
    bar = _Progress(kl.progress and run.is_main, total=len(mine) * kl.context,
                    label=f"KL {len(mine)} docs x {kl.context} tok, {len(tests)} pair(s)",
                    console=parts.console)
    summary = _score_documents(run, mine, progress_log, bar, runner, reference, tests,
                               segment=kl.segment, lm_chunk=parts.lm_chunk, first=first)
    if state is not None:
        state.wait_for_everyone()
    if run.is_main:
        summary = run.write_results(plot=parts.plot)
    return summary


def _check_model(model, pairs: list, context: int, scoring: str) -> int:
    """One ValueError for pairs or a context the model cannot run; returns the first scored
    position."""
    first, _ = S.scored_range(context, scoring)
    if not pairs:
        raise ValueError("give at least one --pair")
    limit = max_context(model)
    if limit is not None and context > limit:
        raise ValueError(f"--context {context} is longer than the model supports "
                         f"(max_position_embeddings = {limit}); lower --context")
    return first


def _variants(model, pairs: list, make_variant: Callable,
              kl: KLSettings) -> tuple[list[Variant], Variant]:
    """(the test variants of `pairs`, the reference variant)."""
    resolved = [resolve_pair(p) for p in pairs]
    check_pair_names(resolved)
    tests = [make_variant(model, p, kl.prefill, kl.seed) for p in resolved]
    names = [v.name for v in tests]
    if len(set(names)) != len(names) or "reference" in names:
        raise ValueError(f"pair names must be distinct and not 'reference': {names}")
    return tests, reference_variant(model, kl.reference, kl.seed)


def _run_config(model_info: dict, reference: Variant, tests: list[Variant], docs: DocumentSet,
                kl: KLSettings, *, bucket_base: int, scoring: str) -> dict:
    """The configuration of a run: what its results depend on, compared on resume."""
    prefill, text_field, pack = kl.prefill, kl.text_field, kl.pack
    context, segment, seed = kl.context, kl.segment, kl.seed
    return {
        "model": model_info,
        "reference": reference.record,
        "pairs": [{"name": v.name, **v.record} for v in tests],
        "prefill": prefill,
        # canonical values only, so that one dataset named two ways (a relative or an absolute
        # path, pg19 or emozilla/pg19) is one configuration
        "dataset": {"name": docs.source, "source": docs.source, "kind": docs.kind,
                    "split": docs.split, "pack": pack,
                    "text_field": None if docs.kind in ("folder", "txt") else text_field},
        "context": context, "segment": segment, "seed": seed, "bucket_base": bucket_base,
        "scoring": scoring,
    }


@dataclasses.dataclass
class _Run:
    """What the steps of one process of a run share."""
    out: Path
    config: dict
    docs: DocumentSet
    fingerprints: dict[int, str]      # per document index, `resume.document_fingerprint`
    code: dict                        # `resume.code_version`
    rank: int
    world: int
    t_start: float
    extra_params: dict | None

    @property
    def run_dir(self) -> Path:
        return run_paths(self.out)[0]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def write_results(self, plot: bool) -> dict:
        return write_results(self.out, self.config, self.docs, self.t_start, self.extra_params,
                             plot=plot, fingerprints=self.fingerprints)


def _documents_to_score(run: _Run, state, console) -> list[Document]:
    """This process's share (round-robin) of the documents earlier runs did not finish; the main
    process says what it found done and kept."""
    done = finished_documents(run.out, run.config, run.docs, run.code, run.fingerprints,
                              report=(lambda msg: _say(console, msg)) if run.is_main else None)
    pending = [d for d in run.docs.documents if d.index not in done]
    if run.is_main and done:
        _say(console, f"resuming {run.out}: {len(done)} of {len(run.docs.documents)} document(s) already "
                      f"done and kept (in {run.run_dir}/); " +
                      (f"computing the other {len(pending)}" if pending else "nothing left to compute"))
    mine = pending[run.rank::run.world]
    if state is not None:
        state.wait_for_everyone()   # every process has read the same finished set before any writes
    return mine


def _progress_log(run: _Run) -> Path:
    """This process's progress log, begun with the configuration line when new or empty."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    prog_file = run.run_dir / f"progress.rank{run.rank}.jsonl"
    if not prog_file.exists() or prog_file.stat().st_size == 0:
        append_record(prog_file, {"type": "config", "config": run.config})
    return prog_file


def _score_documents(run: _Run, mine: list[Document], progress_log: Path, bar: _Progress,
                     runner: SegmentRunner, reference: Variant, tests: list[Variant], *,
                     segment: int, lm_chunk: int | None, first: int) -> dict | None:
    """Scores `mine` one document at a time, writing its files and its progress record (and, run
    by one process, NAME.json after each); returns the last results written (None: none). An
    interrupt says how many documents are finished and kept."""
    summary = None
    try:
        with bar, torch.inference_mode():
            for doc in mine:
                t0 = time.time()
                _reset_peak_memory()
                metrics = score_document(runner, doc, reference, tests, segment, lm_chunk,
                                         on_segment=bar.advance, first=first)
                npy = save_document(run.run_dir, doc.index, metrics, [v.name for v in tests])
                append_record(progress_log, {
                    "type": "document", "index": doc.index, "id": doc.id,
                    "n_tokens": run.config["context"], "tokens": run.fingerprints[doc.index],
                    "code": run.code, "npy": npy, "wall_s": time.time() - t0, "rank": run.rank,
                    **_peak_memory(),
                    "pairs": {v.name: S.document_sums(metrics[v.name], run.config["bucket_base"], first)
                              for v in tests}})
                if run.is_main and run.world == 1:
                    summary = run.write_results(plot=False)
    except KeyboardInterrupt:
        _, recs = read_progress(run.run_dir)
        raise KeyboardInterrupt(f"interrupted: {len({r['index'] for r in recs})} of {len(run.docs.documents)} "
                                f"documents are finished and kept in {run.run_dir}/; re-run the same "
                                f"command to resume") from None
    return summary


def _reset_peak_memory() -> None:
    if torch.cuda.is_available():
        for d in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(d)


def _peak_memory() -> dict:
    out = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if torch.cuda.is_available():
        out["peak_gpu_bytes"] = max(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    return out


def _say(console, msg: str) -> None:
    if console is not None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)   # paths stay whole
    else:
        print(msg, file=sys.stderr)


class _Progress:
    """A rich progress bar with tokens/s and ETA (or nothing when disabled)."""

    def __init__(self, enabled: bool, total: int, label: str, console=None):
        self.enabled = enabled and total > 0
        if self.enabled:
            def rate(task):
                # rich's speed needs two samples within its window; one segment per document
                # (or segments longer than the window) give one: then the mean since the start
                if task.speed:
                    return task.speed
                return task.completed / task.elapsed if task.completed and task.elapsed else None

            class _Speed(ProgressColumn):
                def render(self, task):
                    r = rate(task)
                    return Text(f"{r:,.0f} tok/s" if r else "-- tok/s")

            class _Eta(ProgressColumn):
                def render(self, task):
                    r = rate(task)
                    if not r or task.total is None:
                        return Text("-:--:--")
                    s = int(max(task.total - task.completed, 0) / r)
                    return Text(f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}")

            self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              _Speed(), TimeElapsedColumn(), TextColumn("ETA"), _Eta(),
                              console=console, transient=False)
            self.task = self.p.add_task(label, total=total)

    def __enter__(self):
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *a):
        if self.enabled:
            self.p.__exit__(*a)

    def advance(self, n: int):
        if self.enabled:
            self.p.advance(self.task, n)
