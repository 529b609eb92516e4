"""replayquant command line: a thin layer over the library (each command calls one function)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Low-precision SSM state for hybrid models (ReplaySSM).")
bench_app = typer.Typer(no_args_is_help=True, help="GPU benchmarks (not run in CI).")
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
