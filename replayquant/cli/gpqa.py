"""`gpqa` and `lm-eval`: GPQA-Diamond and lm-eval's own command line with the patched model
(replayquant/gpqa, replayquant/gpqa/lm_eval_model.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from replayquant.cli.common import (DeviceOpt, DtypeOpt, ModelOpt, PrefillOpt, app, pair_option,
                                    user_errors, with_settings)
from replayquant import gpqa
from replayquant.extras import require

GPQAPairs = pair_option("repeatable; differences are taken from the first")


# the options of GPQASettings' fields and of two that become fields (batch_size: an integer or
# auto; max_gen_toks: gen_kwargs), in the order the help lists them
GPQA_FLAGS = {
    "gpqa_csv": Annotated[str | None, typer.Option(
        "--gpqa-csv", help="local gpqa_diamond.csv instead of the gated hub dataset")],
    "limit": Annotated[int | None, typer.Option("--limit",
                                                help="only the first N questions of each task")],
    "seed": Annotated[int, typer.Option(
        "--seed", help="stochastic-rounding seed and lm-eval's python seed (answer order)")],
    "prefill": PrefillOpt,
    "dtype": DtypeOpt,
    "device": DeviceOpt,
    "batch_size": Annotated[str, typer.Option("--batch-size", "--batch_size",
                                              help="integer or auto")],
    "num_fewshot": Annotated[int | None, typer.Option(
        "--num-fewshot", "--num_fewshot", help="few-shot examples (n_shot tasks)")],
    "max_gen_toks": Annotated[int | None, typer.Option(
        "--max-gen-toks", help="generation budget of generative tasks")],
    "apply_chat_template": Annotated[bool, typer.Option(
        "--apply-chat-template", "--apply_chat_template", help="lm-eval's chat template")],
    "log_samples": Annotated[bool, typer.Option(
        "--log-samples", "--log_samples", help="also write every sample (.jsonl)")],
}


def _finish(settings: gpqa.GPQASettings, more: dict) -> None:
    b, toks = more["batch_size"], more["max_gen_toks"]
    settings.batch_size = int(b) if b.isdigit() else b
    settings.gen_kwargs = None if toks is None else {"max_gen_toks": toks}


@app.command("gpqa")
@user_errors()
@with_settings("settings", gpqa.GPQASettings, GPQA_FLAGS,
               extra={"batch_size": "1", "max_gen_toks": None}, finish=_finish)
def gpqa_cmd(
    model: ModelOpt,
    pair: GPQAPairs,
    task: list[str] = typer.Option(None, "--task", "--tasks", help="gpqa_diamond_cot_zeroshot (default), "
                                   "gpqa_diamond_zeroshot, gpqa_diamond_n_shot, gpqa_diamond_generative_n_shot; "
                                   "repeatable or comma-separated (lm-eval's --tasks)"),
    *,
    settings: gpqa.GPQASettings,
    out: str = typer.Option(None, "--out", "--output_path", help="output folder (default build/gpqa/MODEL)"),
    model_args: str = typer.Option(None, "--model-args", "--model_args", help="more lm-eval hf model args, k=v,k=v"),
):
    """GPQA-Diamond through lm-eval for every pair: one results file per pair and SUMMARY.json."""
    require("lm_eval")      # the lm-eval extra, before any work
    # lm-eval / datasets: loaded by the commands that use them
    from replayquant.gpqa.run import parse_model_args
    settings.model_args = parse_model_args(model_args)
    tasks = [t.strip() for v in (task or []) for t in v.split(",") if t.strip()]
    settings.tasks = tasks or None
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
