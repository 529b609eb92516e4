"""`spec`: speculative decoding (HF's prompt lookup, optionally a draft model) on the model
patched with each pair beside the FP32 reference; acceptance, agreement and speed per pair
(replayquant/spec)."""

from typing import Annotated

import typer

from replayquant.cli.common import (KL_FLAGS, DeviceOpt, DtypeOpt, ModelOpt, PrefillOpt, app,
                                    library_logs_above_bars, pair_option, user_errors,
                                    with_settings)
from replayquant.spec.settings import SpecSettings

# the data options as `replayquant kl` declares them (KL_FLAGS), so that both take one --dataset
DatasetOpt, SplitOpt, ConfigOpt = (KL_FLAGS[k] for k in ("dataset", "split", "dataset_config"))
DataFilesOpt, TextOpt, PackOpt = (KL_FLAGS[k] for k in ("data_files", "text_field", "pack"))
RevisionOpt, ProgressOpt = (KL_FLAGS[k] for k in ("revision", "progress"))
SpecPairs = pair_option("repeatable; the reference, s32_rs with exact prefill, runs beside them",
                        policies=False)

# the options of SpecSettings' fields, in the order the help lists them
SPEC_FLAGS = {
    "assistant": Annotated[str | None, typer.Option(
        "--assistant", help="a draft model of the same tokenizer (hub id, short name or folder) "
                            "measured beside prompt lookup; patched with s32_rs where it has "
                            "recurrent layers")],
    "lookup": Annotated[bool, typer.Option("--lookup/--no-lookup",
                                           help="prompt-lookup speculation")],
    "draft_tokens": Annotated[int, typer.Option(
        "--draft-tokens", help="drafts per verify round (prompt_lookup_num_tokens, the "
                               "assistant's num_assistant_tokens); at most each pair's L")],
    "context": Annotated[int, typer.Option(
        help="prompt tokens per document (shorter documents are skipped)")],
    "new_tokens": Annotated[int, typer.Option("--new-tokens",
                                              help="tokens generated per document")],
    "temperature": Annotated[float, typer.Option(
        "--temperature", help="0: greedy; above 0: sampled (HF's do_sample), seeded by --seed "
                              "per document")],
    "top_p": Annotated[float, typer.Option(
        "--top-p", help="nucleus sampling's mass (with --temperature)")],
    "top_k": Annotated[int, typer.Option(
        "--top-k", help="sample among the K likeliest tokens (0: all; with --temperature)")],
    "docs": Annotated[int, typer.Option(
        help="number of documents, the first ones in the dataset's order")],
    "buffer_len": Annotated[int | None, typer.Option(
        "--buffer-len", help="L of every pair (default: each pair's own); a pair given another "
                             "L is named PAIR@LL")],
    "dataset": DatasetOpt,
    "split": SplitOpt,
    "dataset_config": ConfigOpt,
    "data_files": DataFilesOpt,
    "text_field": TextOpt,
    "pack": PackOpt,
    "prefill": PrefillOpt,
    "dtype": DtypeOpt,
    "device": DeviceOpt,
    "seed": Annotated[int, typer.Option("--seed",
                                        help="stochastic rounding's seed, and sampling's")],
    "revision": RevisionOpt,
}                                # --progress: after --out, the command's own


def _finish(spec: SpecSettings, _) -> None:
    spec.data_files = spec.data_files or None      # typer gives [] for none
    library_logs_above_bars()


@app.command("spec")
@user_errors()
@with_settings("spec", SpecSettings, SPEC_FLAGS, finish=_finish)
def spec_cmd(
    model: ModelOpt,
    pair: SpecPairs,
    *,
    spec: SpecSettings,
    out: str = typer.Option(None, help="results JSON (default build/spec/MODEL_PAIRS_ctxN_newM."
                            "json; the plot goes beside it as .png; the same run resumes there, a "
                            "file of another kind or configuration is refused)"),
    progress: ProgressOpt = True,
):
    """Speculative decoding per pair: HF's prompt lookup (and --assistant) on the patched model,
    greedy or sampled (--temperature); accepted drafts per round, tokens per forward, acceptance
    by draft position, agreement with the reference's tokens, tokens/s against plain decode.
    Batch 1 (HF's assisted generation)."""
    from replayquant.spec import spec_command     # transformers: by the command only
    spec.progress = progress
    spec_command(model, pair, spec, out=out)
    return out
