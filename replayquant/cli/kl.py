"""`kl`, `table` and `bench kl`: the KL harness, tables of its results, and its benchmark
(replayquant/kl)."""

from __future__ import annotations

import os

import typer

from replayquant.cli.common import (BenchShape, ModelOpt, Prefill, Scoring, TableFormat,
                                    TableOrder, app, bench_app, json_kind, pair_option,
                                    user_errors, with_kl_options)
from replayquant.gpqa.summary import table_for_files
from replayquant.bench.kl import bench_kl
from replayquant.kl.report import render_table
from replayquant.kl.results import load_scored, running_statistics
from replayquant.kl.settings import KLSettings
from replayquant.launch import single_process_warning
from replayquant.policy import resolve_pair
from replayquant.sweep.command import SWEEP_KIND, render_sweep
from replayquant.sweep.recommend import load_sweep

KLPairs = pair_option("repeatable")


@app.command("kl")
@user_errors()
@with_kl_options
def kl_cmd(
    model: ModelOpt,
    pair: KLPairs,
    buffer_len: int = typer.Option(None, "--buffer-len", help="L of every pair (default: each "
                                   "pair's own); a pair given another L is named PAIR@LL"),
    *,
    kl: KLSettings,
    out: str = typer.Option(None, help="results JSON (default build/kl/MODEL_PAIRS_ctxN_PREFILL.json; "
                            "the same run resumes there, a file of another kind or configuration is "
                            "refused, and so is a second run while one runs)"),
    scoring: Scoring = typer.Option("all", help="positions scored: all | llama (positions n/2 ... "
                                    "n-2 of each n-token document, as llama.cpp's --kl-divergence)"),
):
    """KL(reference || pair) over long documents, reference and pairs in lockstep; resumable."""
    # transformers: loaded by the commands that use it
    from replayquant.kl.command import default_out, kl_command
    if buffer_len is not None:
        pair = [resolve_pair(p, buffer_len) for p in pair]          # named PAIR@LL
        out = out or str(default_out(model, [p.label() for p in pair], kl.context, kl.prefill,
                                     scoring))
    warning = single_process_warning("kl")
    if warning:
        typer.echo(warning, err=True)
    kl_command(model, pair, kl, out=out, scoring=scoring)


@app.command("table")
@user_errors()
def table_cmd(
    files: list[str] = typer.Argument(..., help="results files (build/kl/*.json), GPQA summaries, "
                                      "lm-eval results or sweep files"),
    format: TableFormat = typer.Option("md", "--format", help="md | csv (values and uncertainties in "
                                       "separate numeric columns) | llama (KL results: llama-perplexity "
                                       "--kl-divergence's text block per pair; its numbers where the "
                                       "run had --scoring llama)"),
    by: TableOrder = typer.Option("pair", "--by", help="row order"),
    scoring: Scoring = typer.Option(None, "--scoring", help="KL results: re-score to llama (positions "
                                    "n/2 ... n-2 of each document, as llama.cpp) from a run's "
                                    "per-token values (default: as each run scored)"),
):
    """One table from KL results files, GPQA summaries (build/gpqa/*/SUMMARY.json) or the lm-eval
    results `replayquant lm-eval` / `replayquant gpqa` write: pairs as rows; or a sweep file
    (`replayquant sweep`) with every column its terminal table leaves out."""
    seen = {}
    for f in files:
        key = os.path.realpath(f)
        if key in seen:
            raise ValueError(f"{f} is given more than once (as {seen[key]} too); a table shows "
                             f"each results file once")
        seen[key] = f
    sweeps = [f for f in files if json_kind(f) == SWEEP_KIND]
    if sweeps:
        if len(sweeps) < len(files) or scoring is not None:
            raise ValueError("a sweep file renders alone or with other sweep files, without "
                             "--scoring; give its KL run (NAME_kl.json beside it) for KL tables")
        typer.echo("\n".join(render_sweep(load_sweep(f), format) for f in files), nl=False)
        return
    gpqa_table = table_for_files(files, fmt=format)
    if gpqa_table is not None:
        if scoring is not None:
            raise ValueError("--scoring applies to KL results files, not to GPQA or lm-eval results")
        typer.echo(gpqa_table, nl=False)
        return
    loaded = load_scored(files, scoring)
    running = {src: running_statistics(res, src) for src, res in loaded} if format == "llama" \
        else None
    typer.echo(render_table(loaded, fmt=format, by=by, running=running), nl=False)


@bench_app.command("kl")
@user_errors()
def bench_kl_cmd(
    context: int = typer.Option(131072, help="tokens of the one random document"),
    segment: int = typer.Option(8192, help="tokens per forward"),
    pair: list[str] = typer.Option(None, "--pair", help="pairs (default f4_sr_rs and tp4_hi32)"),
    prefill: Prefill = typer.Option("replay", help="prefill of the pairs"),
    shape: BenchShape = typer.Option("qwen3.5-4b", help="model shape (random weights)"),
    out: str = typer.Option("build/bench/kl_128k.json", help="results JSON"),
):
    """GPU: wall time and peak memory of the KL harness on one long document vs plain HF forwards."""
    r = bench_kl(shape=shape, context=context, segment=segment, pairs=pair or ("f4_sr_rs", "tp4_hi32"),
                 prefill=prefill, out=out)
    typer.echo(f"KL {r['kl_wall_time_s']:.1f} s, HF forward {r['hf_forward_s']:.1f} s, time per plain forward pass "
               f"{r['slowdown_vs_plain_forwards']:.2f}x (target <= 1.5), peak {r['peak_gpu_gib_kl']} GiB -> {out}")
