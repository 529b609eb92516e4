"""replayquant command line: a thin layer over the library (each command calls one function)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Low-precision SSM state for hybrid models (ReplaySSM).")
bench_app = typer.Typer(no_args_is_help=True, help="GPU benchmarks (not run in CI).")
app.add_typer(bench_app, name="bench")


# --- precision pairs and drift (replayquant/pairs.py, replayquant/drift.py) -------------------
@app.command("pairs")
def pairs_cmd(
    d_k: int = typer.Option(128, help="state columns (key dim) for the bytes per element"),
    d_v: int = typer.Option(128, help="state rows (value dim)"),
):
    """The shipped precision pairs (configs/pairs/) with read / anchor bytes per state element."""
    from rich.console import Console

    from replayquant.pairs import pairs_table
    Console(width=max(Console().width, 110)).print(pairs_table(d_k, d_v))


@app.command("drift")
def drift_cmd(
    kind: str = typer.Option(..., "--kind", help="gdn | mamba2"),
    pair: list[str] = typer.Option(None, "--pair", help="pair name or YAML path (repeatable; default: all shipped)"),
    steps: int = typer.Option(4096, "--steps", help="decode steps"),
    seeds: str = typer.Option("42,43,44", "--seeds", help="comma-separated seeds"),
    batch: int = typer.Option(2, help="sequences"),
    heads: int = typer.Option(4, help="heads"),
    d_k: int = typer.Option(64, help="key dim (state columns)"),
    d_v: int = typer.Option(32, help="value dim (state rows)"),
    conventional: bool = typer.Option(True, help="also run shared pairs as ConventionalState (L=1)"),
    out: str = typer.Option("results/drift", help="folder for KIND_NsSteps.json and .md"),
):
    """Random-input drift of outputs and anchor against the FP32 recurrence, per pair."""
    from rich.console import Console

    from replayquant.drift import drift_table, run_drift, write_drift
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        typer.echo(f"error: --seeds must be comma-separated integers, got {seeds!r}", err=True)
        raise typer.Exit(2)
    con = Console(stderr=True)
    try:
        res = run_drift(kind, pair or None, steps=steps, seeds=seed_list, batch=batch, heads=heads,
                        d_k=d_k, d_v=d_v, conventional=conventional, progress=con.log)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    path = write_drift(res, out)
    Console(width=max(Console().width, 170)).print(drift_table(res))
    typer.echo(f"wrote {path} and {path.with_suffix('.md')}")
# --- end pairs and drift -----------------------------------------------------------------------

if __name__ == "__main__":
    app()
