"""`gpqa` and `lm-eval`: GPQA-Diamond and lm-eval's own command line with the patched model
(replayquant/gpqa, replayquant/gpqa/lm_eval_model.py)."""

from __future__ import annotations

import typer

from replayquant.cli.common import (DeviceOpt, DtypeOpt, ModelOpt, PrefillOpt, app, pair_option,
                                    user_errors)
from replayquant import gpqa
from replayquant.extras import require

GPQAPairs = pair_option("repeatable; differences are taken from the first")


@app.command("gpqa")
@user_errors()
def gpqa_cmd(
    model: ModelOpt,
    pair: GPQAPairs,
    task: list[str] = typer.Option(None, "--task", "--tasks", help="gpqa_diamond_cot_zeroshot (default), "
                                   "gpqa_diamond_zeroshot, gpqa_diamond_n_shot, gpqa_diamond_generative_n_shot; "
                                   "repeatable or comma-separated (lm-eval's --tasks)"),
    gpqa_csv: str = typer.Option(None, "--gpqa-csv", help="local gpqa_diamond.csv instead of the gated hub dataset"),
    limit: int = typer.Option(None, "--limit", help="only the first N questions of each task"),
    seed: int = typer.Option(0, "--seed", help="stochastic-rounding seed and lm-eval's python seed (answer order)"),
    prefill: PrefillOpt = "replay",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
    batch_size: str = typer.Option("1", "--batch-size", "--batch_size", help="integer or auto"),
    num_fewshot: int = typer.Option(None, "--num-fewshot", "--num_fewshot", help="few-shot examples (n_shot tasks)"),
    max_gen_toks: int = typer.Option(None, "--max-gen-toks", help="generation budget of generative tasks"),
    apply_chat_template: bool = typer.Option(False, "--apply-chat-template", "--apply_chat_template",
                                             help="lm-eval's chat template"),
    log_samples: bool = typer.Option(False, "--log-samples", "--log_samples", help="also write every sample (.jsonl)"),
    out: str = typer.Option(None, "--out", "--output_path", help="output folder (default build/gpqa/MODEL)"),
    model_args: str = typer.Option(None, "--model-args", "--model_args", help="more lm-eval hf model args, k=v,k=v"),
):
    """GPQA-Diamond through lm-eval for every pair: one results file per pair and SUMMARY.json."""
    require("lm_eval")      # the lm-eval extra, before any work
    # lm-eval / datasets: loaded by the commands that use them
    from replayquant.gpqa.run import parse_model_args
    extra = parse_model_args(model_args)
    tasks = [t.strip() for v in (task or []) for t in v.split(",") if t.strip()]
    settings = gpqa.GPQASettings(
        tasks=tasks or None, gpqa_csv=gpqa_csv, limit=limit, seed=seed, prefill=prefill,
        dtype=dtype, device=device,
        batch_size=int(batch_size) if batch_size.isdigit() else batch_size,
        num_fewshot=num_fewshot,
        gen_kwargs=None if max_gen_toks is None else {"max_gen_toks": max_gen_toks},
        apply_chat_template=apply_chat_template, log_samples=log_samples, model_args=extra)
    summary = gpqa.run_gpqa(model, pair, settings, out=out)
    if summary is not None:
        typer.echo(gpqa.render_table([summary]))


@app.command("lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@user_errors()
def lm_eval_cmd(ctx: typer.Context):
    """lm-eval's own command line with `--model replayquant` registered (all arguments pass through;
    `--gpqa-csv PATH` reads GPQA-Diamond from a local CSV)."""
    require("lm_eval")      # the lm-eval extra, whether or not the module was imported before
    from replayquant.gpqa.lm_eval_model import lm_eval_main  # checks lm-eval's internals first
    lm_eval_main(list(ctx.args))
