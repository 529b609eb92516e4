"""`bench generate`, `bench teacher-forcing`, `bench kernels` and `bench merge`: GPU benchmarks of
decoding, teacher forcing and the decode kernels (replayquant/bench)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from replayquant.bench.targets import PRESETS
from replayquant.cli.common import (BenchPart, BenchShape, KernelPreset, Prefill, bench_app,
                                    json_kind, user_errors)


@bench_app.command("generate")
@user_errors()
def bench_generate_cmd(
    batch: str = typer.Option("1,32,256", help="batch sizes, comma-separated"),
    pair: list[str] = typer.Option(None, "--pair", help="pairs (default s32_rs and tp4_hi16_sr)"),
    prompt: int = typer.Option(64, help="prompt tokens"),
    shape: BenchShape = typer.Option("qwen3.5-4b", help="model shape (random weights)"),
    compile_backend: str = typer.Option("inductor", help="torch.compile backend of the static ways"),
    budget_s: float = typer.Option(None, help="skip the batches left after this many seconds"),
    out: str = typer.Option("build/bench/generate.json", help="results JSON"),
    add: bool = typer.Option(False, "--add", help="add these batches to --out, a file of the same "
                             "run (shape, pairs, prompt, compile config, git commit)"),
):
    """GPU: ms per decode step of generate, HF and patched, eager and static cache + compile, with
    GPU busy time, kernel launches and host syncs per step."""
    # transformers: loaded by the commands that use it
    from replayquant.bench.generate import GenerateSettings, run_generate_bench
    try:
        batches = tuple(int(x) for x in batch.split(","))
    except ValueError:
        raise ValueError(f"--batch takes comma-separated integers, got {batch!r}") from None
    settings = GenerateSettings(shape=shape, batches=batches,
                                pairs=tuple(pair or ("s32_rs", "tp4_hi16_sr")), prompt=prompt,
                                compile_backend=compile_backend, budget_s=budget_s)
    r = run_generate_bench(out=out, settings=settings, add=add,
                           progress=lambda m: typer.echo(m, err=True))
    for t in r["targets"]:
        typer.echo(_target_line(t))
    typer.echo(f"-> {out}")


@bench_app.command("teacher-forcing")
@user_errors()
def bench_teacher_forcing_cmd(
    part: BenchPart = typer.Option("model", help="model (patched vs unpatched whole model) | layer "
                                   "(kernel check and per-layer timing) | all"),
    context: int = typer.Option(131072, help="tokens of the one random document (model)"),
    segment: int = typer.Option(8192, help="tokens per forward (model)"),
    pair: str = typer.Option("tp4_hi16_sr", help="precision pair of the patched model (model)"),
    prefill: Prefill = typer.Option("replay", help="prefill of the patched model (model)"),
    shape: BenchShape = typer.Option("qwen3.5-4b", help="model shape (random weights)"),
    device: str = typer.Option(None, help="cuda (default when available) or cpu (model)"),
    lengths: str = typer.Option("8192,32768", help="tokens of the per-layer timing (layer)"),
    out: str = typer.Option("build/bench/teacher_forcing.json", help="results JSON (each part "
                            "replaces its own section)"),
):
    """GPU: teacher forcing through the chunk kernel: the patched vs the unpatched HF forward of
    a Qwen3.5-4B-shape model over one long document (target <= 2x, <= 40 GiB), and/or the
    kernel check and per-layer timing."""
    # transformers: loaded by the commands that use it
    from replayquant.bench import teacher_forcing as tf
    if device is not None:
        # transformers: loaded by the commands that use it
        from replayquant.models.device import check_device
        check_device(device)
    if part in ("layer", "all"):
        tf.run_layer(out, tuple(int(x) for x in lengths.split(",") if x))
    if part in ("model", "all"):
        r = tf.run_model(out, shape=shape, context=context, segment=segment, pair=pair,
                         prefill=prefill, device=device)
        typer.echo(f"patched {r['patched_forward_s']:.1f} s, HF {r['hf_forward_s']:.1f} s: "
                   f"{r['ratio_patched_over_hf']:.2f}x (target <= 2), peak "
                   f"{r['peak_gpu_gib_patched']} GiB, replay path {r['teacher_force_path']} -> {out}")


@bench_app.command("kernels")
@user_errors()
def bench_kernels_cmd(
    out: str = typer.Option("build/bench", help="folder for kernels.json, kernels.md, kernels_speedup.png"),
    batches: str = typer.Option("1,8,32,128,256,512", help="batch sizes of the decode steps"),
    buffer_lens: str = typer.Option("4,8,16,32", "--L", help="buffer lengths L of the replay windows"),
    pairs: str = typer.Option("s32_rs,tp8_hi32,tp4_hi32,tp4_hi16_sr", help="precision pairs"),
    drafts: str = typer.Option("2,4", "--T", help="drafts per speculative round"),
    spec_batches: str = typer.Option("32,256,512", help="batch sizes of the speculative rounds"),
    kinds: str = typer.Option("gdn,mamba2,kda", help="layer kinds (Qwen3.5-4B GDN, Nemotron-H Mamba-2, Kimi-Linear-48B KDA: conventional and peer rows only)"),
    peers: bool = typer.Option(True, help="also time fla / mamba_ssm (skipped if not importable)"),
    checks: bool = typer.Option(True, help="kernel-vs-reference checks at the real head shapes first"),
    sweep: bool = typer.Option(True, help="launch-config sweep at batch 256"),
    budget_s: float = typer.Option(500.0, help="skip sections (lowest priority first) past this many seconds"),
    estimate_only: bool = typer.Option(False, help="print the plan and its runtime estimate, run nothing"),
    name: str = typer.Option("kernels", help="output file stem"),
    authors: str = typer.Option(None, help="checkout of the ReplaySSM authors' fork (Johnny-Liou/ReplaySSM): time their kernels beside ours on the same inputs"),
    authors_commit: str = typer.Option(None, help="the fork's commit, where PATH is neither a git checkout nor holds a COMMIT file"),
    staggered_batches: str = typer.Option("256", help="batches whose windows are also timed with rows out of phase"),
    accuracy: bool = typer.Option(True, help="errors against a float64 recurrence over three windows (ours; the authors' with --authors)"),
    preset: KernelPreset = typer.Option(None, help="a grid replacing the grid options: 'targets' (every row the targets read, in one run) or 'probe'"),
):
    """GPU: conventional vs replay decode kernels over the benchmark grid (B x L x pair, T),
    peers, speculative verify, against the copy bandwidth measured in the same run. Prints a
    runtime estimate first (the whole grid, checks and sweep included: about 9 minutes on an
    H200); sections past --budget-s (default 500) are skipped
    from the end of the plan and listed, so split the grid with --kinds / --pairs / --batches
    over two or more runs. With --authors PATH the ReplaySSM authors' kernels run beside ours on
    the same inputs; --preset targets measures every target of the decode kernels in one run
    (kernels.json `targets`)."""
    # Triton (Linux only): loaded where a kernel runs
    from replayquant.bench.authors import checkout_commit
    from replayquant.bench.kernels.grid import KernelGrid
    from replayquant.bench.kernels.plan import estimate_s, plan
    from replayquant.bench.kernels.run import run_kernels_bench
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    grid = KernelGrid(batches=ints(batches), Ls=ints(buffer_lens), pairs=strs(pairs),
                      Ts=ints(drafts), spec_batches=ints(spec_batches), kinds=strs(kinds),
                      peers=peers, checks=checks, sweep=sweep,
                      staggered_batches=ints(staggered_batches), accuracy=accuracy)
    if preset is not None:
        grid = dataclasses.replace(grid, **PRESETS[preset])
    if authors is not None:
        checkout_commit(authors, authors_commit)        # a bad PATH fails before anything runs
    if estimate_only:
        sec = plan(grid, authors=authors is not None)
        for key, est, _ in sec:
            typer.echo(f"{est:7.1f} s  {key}")
        typer.echo(f"{len(sec)} sections, estimated {estimate_s(sec):.0f} s (budget {budget_s:.0f} s)")
        return
    run_kernels_bench(out=out, name=name, grid=grid, budget_s=budget_s, authors=authors,
                      authors_commit=authors_commit)


bench_app.command("decode", hidden=True, help="alias of 'bench kernels'")(bench_kernels_cmd)


@bench_app.command("merge")
@user_errors()
def bench_merge_cmd(
    parts: list[str] = typer.Argument(..., help="JSON files of one commit, all of `bench kernels` "
                                      "(the grid split over runs) or all of `bench generate` "
                                      "(the batches split over runs)"),
    out: str = typer.Option("build/bench", help="folder for NAME.json (and, for kernels, NAME.md, NAME_speedup.png)"),
    name: str = typer.Option(None, help="output file stem (default: kernels, or generate for bench generate files)"),
):
    """One results file from several runs of one commit (a grid too long for one run, or runs in
    separate processes or on separate machines): `bench kernels` runs (split by --kinds /
    --spec-batches) give one kernels table, rows kept with their run, speedups derived within a
    run, targets from the merged rows; `bench generate` files (each with other batches) give one
    generate.json, each batch's rows as its run measured them, targets from the merged rows."""
    from replayquant.bench.generate import GENERATE_KIND, merge_generate
    if parts and all(json_kind(p) == GENERATE_KIND for p in parts):
        path = Path(out) / f"{name or 'generate'}.json"
        res = merge_generate(parts, out=path)
        typer.echo(f"batches {res['batches']} from {len(parts)} runs -> {path}")
        for t in res["targets"]:
            typer.echo(_target_line(t))
        return
    # Triton (Linux only): loaded where a kernel runs
    from replayquant.bench.kernels.merge import merge_kernels
    res = merge_kernels(parts, out=out, name=name or "kernels")
    typer.echo(f"{len(res['rows'])} rows from {len(parts)} runs -> {out}/{name or 'kernels'}.json, .md, _speedup.png")


def _target_line(t: dict) -> str:
    hf = "" if t.get("unpatched") is None else f"  (HF unpatched: {t['unpatched']:.3g})"
    return f"{'met ' if t['met'] else 'MISS'} {t['measured']:.3g}  {t['name']}{hf}"
