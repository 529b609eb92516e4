"""`sweep`, `recommend` and `sensitivity`: precision pairs and buffer lengths against KL, the
cheapest that fits a budget, and the KL of each recurrent layer alone (replayquant/sweep)."""

from __future__ import annotations

import typer

from replayquant.cli.common import (ModelOpt, OldDeviceOpt, app, device_option,
                                    library_logs_above_bars, pair_option, user_errors,
                                    with_kl_options)
from replayquant.gpqa.summary import load_summary
from replayquant.kl.settings import KLSettings
from replayquant.sweep import recommend as R
from replayquant.sweep.command import SWEEP_KIND, sweep_command
from replayquant.sweep.common import load_json_kind
from replayquant.sweep.per_layer import recommend_per_layer
from replayquant.sweep.sensitivity import sensitivity_command

SweepPairs = pair_option("repeatable")
SensitivityPairs = pair_option("repeatable: give two for `recommend --per-layer`", policies=False)


@app.command("sweep")
@user_errors()
@with_kl_options
def sweep_cmd(
    model: ModelOpt,
    pair: SweepPairs,
    buffer_len: str = typer.Option(None, "--buffer-len", help="buffer lengths L, comma-separated "
                                   "(e.g. 4,8,16,32; default: each pair's own)"),
    kernels: str = typer.Option(None, "--kernels", help="a kernels grid (results/bench/kernels.json, "
                                "or h200: the one measured on an H200 that ships with replayquant) "
                                "for measured microseconds per step"),
    batch: int = typer.Option(256, "--batch", help="batch whose measured times to report (the "
                              "nearest the grid timed)"),
    *,
    kl: KLSettings,
    out: str = typer.Option(None, help="sweep JSON (default build/sweep/MODEL_PAIRS_LLS_ctxN.json; the "
                            "plot and the KL run's NAME_kl.* go beside it; the same variants resume "
                            "there, a file of another kind or run is refused, and so is a second "
                            "run while one runs)"),
):
    """Every (pair, L) in one KL run against the FP32-state reference, with the state bytes per
    decode step and the memory each costs; Pareto front of bytes against KL. Resumable."""
    sweep_command(model, pair, buffer_len, kl, kernels=kernels, batch=batch, out=out)


@app.command("recommend")
@user_errors()
def recommend_cmd(
    sweep: str = typer.Argument(None, help="a sweep JSON (`replayquant sweep`)"),
    kl_budget: float = typer.Option(..., "--kl-budget", help="largest KL upper bound (mean + "
                                    "uncertainty) accepted, e.g. 1e-3"),
    max_bytes: float = typer.Option(None, "--max-bytes", help="largest state bytes per decode step "
                                    "and sequence"),
    max_memory: float = typer.Option(None, "--max-memory", help="largest state memory per sequence (bytes)"),
    gpqa: str = typer.Option(None, "--gpqa", help="a GPQA summary (SUMMARY.json of `replayquant gpqa`)"),
    gpqa_budget: float = typer.Option(None, "--gpqa-budget", help="largest GPQA drop in points "
                                      "(upper end of its uncertainty) against the summary's first pair"),
    per_layer: str = typer.Option(None, "--per-layer", help="a sensitivity JSON (`replayquant "
                                  "sensitivity`): build a layer policy and measure it"),
    low: str = typer.Option(None, "--low", help="--per-layer: the cheaper pair (default: the "
                            "sensitivity file's cheapest)"),
    high: str = typer.Option(None, "--high", help="--per-layer: the pair the most sensitive layers get"),
    device: str = typer.Option(None, "--device", help="--per-layer: where the KL run's model "
                               "runs, as `kl --device` (default: the sensitivity run's)"),
    old_device_map: OldDeviceOpt = None,
    out: str = typer.Option(None, help="JSON to write (default: none for a sweep; "
                            "build/recommend/NAME.json with --per-layer); it replaces only a "
                            "recommendation of the same budgets (--per-layer: the same policy); "
                            "anything else, an input, or a second run while one runs is refused"),
    progress: bool = typer.Option(True, help="progress bar (--per-layer)"),
    spec: str = typer.Option(None, "--spec", help="a `replayquant spec` results file of the "
                             "sweep's model, for --min-accept"),
    min_accept: float = typer.Option(None, "--min-accept", help="fewest drafts accepted per "
                                     "verify round (--spec's prompt lookup) of a variant considered"),
):
    """The cheapest variant of a sweep within the budgets, its savings against the FP32
    conventional step and the runner-up (exit 1 when nothing fits); or, with --per-layer, a layer
    policy from a sensitivity run, measured with the KL harness beside its prediction."""
    try:
        if per_layer is not None:
            others = (sweep, gpqa, max_bytes, max_memory, spec, min_accept)
            if any(o is not None for o in others):
                raise ValueError("--per-layer takes a sensitivity file and --kl-budget (with --low / "
                                 "--high); give a sweep file, --max-bytes, --max-memory, --gpqa or "
                                 "--spec / --min-accept without --per-layer")
            library_logs_above_bars()               # its KL run shows a progress bar
            res = recommend_per_layer(per_layer, kl_budget, low=low, high=high, out=out,
                                      progress=progress,
                                      device_map=device_option(device, old_device_map))
            if res is not None and not res["measured_fits"]:
                typer.echo(f"the measured KL upper bound {res['measured']['kl_upper']:.3g} is over the "
                           f"budget {kl_budget:.3g}: the single-layer KLs do not add up to the "
                           f"policy's; lower --kl-budget for the prediction or measure more layers "
                           f"at --high", err=True)
                raise typer.Exit(1)
            return
        if sweep is None:
            raise ValueError("give a sweep JSON (replayquant recommend SWEEP.json --kl-budget B) or "
                             "--per-layer SENSITIVITY.json")
        if low is not None or high is not None:
            raise ValueError("--low / --high go with --per-layer")
        if (spec is None) != (min_accept is None):
            raise ValueError("--spec and --min-accept go together: give a `replayquant spec` "
                             "results file and the fewest drafts accepted per round")
        out_path = None if out is None else R.check_recommendation_out(out, (sweep, gpqa, spec))
        sw = load_json_kind(sweep, SWEEP_KIND, "replayquant sweep")
        sw, left_out = _accepting(sw, sweep, spec, min_accept)
        summary = None
        if gpqa is not None:
            summary = load_summary(gpqa)
        rec = R.recommend(sw, kl_budget, max_bytes=max_bytes, max_memory=max_memory, gpqa=summary,
                          gpqa_budget=gpqa_budget, source=sweep)
        if left_out is not None:
            rec["min_accept"] = {"spec": spec, "min_accept": min_accept, "left_out": left_out}
        R.print_recommendation(rec)
        if left_out:
            typer.echo(f"not considered (below --min-accept {min_accept:g} drafts per round in "
                       f"{spec}): " + ", ".join(f"{n} ({_accepted(a)})"
                                                for n, a in left_out.items()))
        if out_path is not None:
            R.write_recommendation(out_path, rec, (sweep, gpqa, spec))
            typer.echo(f"wrote {out_path}", err=True)
    except R.NoFit as e:
        typer.echo(f"no fit: {e}", err=True)
        raise typer.Exit(1)


def _accepting(sw: dict, sweep: str, spec: str | None, min_accept: float | None):
    """(the sweep dict with only the variants --min-accept lets through, {left-out variant:
    its acceptance}); the sweep as it is and None without --spec."""
    if spec is None:
        return sw, None
    from replayquant.spec.constraint import accepting_variants, load_spec
    sw, left_out = accepting_variants(sw, load_spec(spec), min_accept, (sweep, spec))
    if not sw["variants"]:
        raise R.NoFit(f"no variant of {sweep} accepts {min_accept:g} drafts per round in {spec}: "
                      + ", ".join(f"{n} {_accepted(a)}" for n, a in left_out.items()))
    return sw, left_out


def _accepted(a) -> str:
    """A variant's drafts accepted per round in a spec run, for `recommend --min-accept`."""
    return "not measured" if a is None else f"{a:.2f}"


@app.command("sensitivity")
@user_errors()
@with_kl_options
def sensitivity_cmd(
    model: ModelOpt,
    pair: SensitivityPairs,
    buffer_len: int = typer.Option(None, "--buffer-len", help="L of every pair (default: each pair's own)"),
    layers: str = typer.Option(None, "--layers", help="only these recurrent layers (indices, comma-separated)"),
    per_pass: int = typer.Option(0, "--per-pass", help="variants per KL pass (0: all in one lockstep "
                                 "pass; fewer where their caches do not fit in memory)"),
    *,
    kl: KLSettings,
    out: str = typer.Option(None, help="sensitivity JSON (default build/sensitivity/MODEL_PAIRS_ctxN.json; "
                            "the same pairs and layers resume there, a file of another kind or run "
                            "is refused, and so is a second run while one runs)"),
):
    """Per recurrent layer, the KL when only that layer holds the pair (every other layer exact
    FP32), all layers in one lockstep pass, ranked; bar plot and the sum against all layers."""
    sensitivity_command(model, pair, kl, buffer_len=buffer_len, layers=layers, per_pass=per_pass,
                        out=out)
