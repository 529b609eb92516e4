"""`formats`, `bench formats`, `pairs` and `drift`: the storage formats, the shipped precision
pairs and their random-input drift (replayquant/formats, replayquant/pairs.py,
replayquant/drift.py, replayquant/bench/formats.py)."""

from __future__ import annotations

import typer
from rich.console import Console

from replayquant.cli.common import BenchFormat, LayerKind, app, bench_app, user_errors
from replayquant import drift
from replayquant.formats import report
from replayquant.pairs import pairs_table
from replayquant.streams import check_seed


@app.command("formats")
@user_errors()
def formats_cmd(
    heads: int = typer.Option(8, help="matrices in the state-like test tensor"),
    d: int = typer.Option(128, help="rows and columns of each matrix"),
    seed: int = typer.Option(0, help="seed of the test tensor"),
):
    """Every format and rounding: bytes/element, RMSE and max relative error on a state-like tensor."""
    report.print_formats_table((heads, d, d), seed)


@bench_app.command("formats")
@user_errors()
def bench_formats_cmd(
    mbytes: int = typer.Option(512, help="input size in MB of float32 [N, 128, 128] matrices (>= 256)"),
    out: str = typer.Option("build/bench", help="folder for formats.json and formats.md"),
    formats: list[BenchFormat] = typer.Option(None, "--format", help="formats to time (repeatable; default: all)"),
):
    """GPU: quantize / dequantize GB/s per format and rounding against the device copy bandwidth."""
    # Triton (Linux only): loaded where a kernel runs
    from replayquant.bench.formats import run_formats_bench
    run_formats_bench(mbytes=mbytes, out=out, formats=[f.value for f in formats or ()] or None)


@app.command("pairs")
@user_errors()
def pairs_cmd(
    d_k: int = typer.Option(128, help="state columns (key dim) for the bytes per element"),
    d_v: int = typer.Option(128, help="state rows (value dim)"),
):
    """The shipped precision pairs (configs/pairs/) with read / anchor bytes per state element."""
    report.check_dims({"--d-v": d_v}, {"--d-k": d_k})
    Console(width=max(Console().width, 110)).print(pairs_table(d_k, d_v))


@app.command("docs")
@user_errors()
def docs_cmd():
    """Print the folder of the documentation the README links (usage.md, DESIGN.md, kernels.md,
    gpqa.md), installed with the package."""
    from importlib.resources import files
    typer.echo(files("replayquant") / "docs")


@app.command("drift")
@user_errors()
def drift_cmd(
    kind: LayerKind = typer.Option(..., "--kind", help="layer kind"),
    pair: list[str] = typer.Option(None, "--pair", help="pair name or YAML path (repeatable; default: all shipped)"),
    steps: int = typer.Option(4096, "--steps", help="decode steps"),
    seeds: str = typer.Option("42,43,44", "--seeds", help="comma-separated seeds"),
    batch: int = typer.Option(2, help="sequences"),
    heads: int = typer.Option(4, help="heads"),
    d_k: int = typer.Option(64, help="key dim (state columns)"),
    d_v: int = typer.Option(32, help="value dim (state rows)"),
    conventional: bool = typer.Option(True, help="also run shared pairs as ConventionalState (L=1)"),
    out: str = typer.Option("build/drift", help="folder for KIND_NsSteps.json and .md"),
):
    """Random-input drift of outputs and anchor against the FP32 recurrence, per pair."""
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    for s in seed_list:
        check_seed(s, "--seeds: seed")
    drift.drift_out_path(out, kind, steps)           # before any computing
    res = drift.run_drift(kind, pair or None, steps=steps, seeds=seed_list, batch=batch, heads=heads,
                    d_k=d_k, d_v=d_v, conventional=conventional, progress=True)
    path = drift.write_drift(res, out)
    drift.print_drift(res, md_path=path.with_suffix(".md"))
    typer.echo(f"wrote {path} and {path.with_suffix('.md')}")
