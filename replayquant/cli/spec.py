"""`spec`: speculative decoding (HF's prompt lookup, optionally a draft model) on the model
patched with each pair beside the FP32 reference; acceptance, agreement and speed per pair
(replayquant/spec)."""

import typer

from replayquant.cli.common import (KL_FLAGS, DeviceOpt, DtypeOpt, ModelOpt, PrefillOpt, app,
                                    library_logs_above_bars, pair_option, user_errors)

# the data options as `replayquant kl` declares them (KL_FLAGS), so that both take one --dataset
DatasetOpt, SplitOpt, ConfigOpt = (KL_FLAGS[k] for k in ("dataset", "split", "dataset_config"))
DataFilesOpt, TextOpt, PackOpt = (KL_FLAGS[k] for k in ("data_files", "text_field", "pack"))
RevisionOpt, ProgressOpt = (KL_FLAGS[k] for k in ("revision", "progress"))
SpecPairs = pair_option("repeatable; the reference, s32_rs with exact prefill, runs beside them",
                        policies=False)


@app.command("spec")
@user_errors()
def spec_cmd(
    model: ModelOpt,
    pair: SpecPairs,
    assistant: str = typer.Option(None, "--assistant", help="a draft model of the same tokenizer "
                                  "(hub id, short name or folder) measured beside prompt lookup; "
                                  "patched with s32_rs where it has recurrent layers"),
    lookup: bool = typer.Option(True, "--lookup/--no-lookup", help="prompt-lookup speculation"),
    draft_tokens: int = typer.Option(4, "--draft-tokens", help="drafts per verify round "
                                     "(prompt_lookup_num_tokens, the assistant's "
                                     "num_assistant_tokens); at most each pair's L"),
    context: int = typer.Option(256, help="prompt tokens per document (shorter documents are "
                                "skipped)"),
    new_tokens: int = typer.Option(64, "--new-tokens", help="tokens generated per document"),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; above 0: sampled "
                                      "(HF's do_sample), seeded by --seed per document"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling's mass (with "
                                "--temperature)"),
    top_k: int = typer.Option(0, "--top-k", help="sample among the K likeliest tokens (0: all; "
                              "with --temperature)"),
    docs: int = typer.Option(4, help="number of documents, the first ones in the dataset's order"),
    buffer_len: int = typer.Option(None, "--buffer-len", help="L of every pair (default: each "
                                   "pair's own); a pair given another L is named PAIR@LL"),
    dataset: DatasetOpt = "heldout",
    split: SplitOpt = "test",
    dataset_config: ConfigOpt = None,
    data_files: DataFilesOpt = None,
    text_field: TextOpt = "text",
    pack: PackOpt = False,
    prefill: PrefillOpt = "replay",
    dtype: DtypeOpt = "auto",
    device: DeviceOpt = None,
    seed: int = typer.Option(0, "--seed", help="stochastic rounding's seed, and sampling's"),
    revision: RevisionOpt = None,
    out: str = typer.Option(None, help="results JSON (default build/spec/MODEL_PAIRS_ctxN_newM."
                            "json; the plot goes beside it as .png; the same run resumes there, a "
                            "file of another kind or configuration is refused)"),
    progress: ProgressOpt = True,
):
    """Speculative decoding per pair: HF's prompt lookup (and --assistant) on the patched model,
    greedy or sampled (--temperature); accepted drafts per round, tokens per forward, acceptance
    by draft position, agreement with the reference's tokens, tokens/s against plain decode.
    Batch 1 (HF's assisted generation)."""
    from replayquant.spec import SpecSettings, spec_command   # transformers: by the command only
    library_logs_above_bars()
    settings = SpecSettings(assistant=assistant, lookup=lookup, draft_tokens=draft_tokens,
                            dataset=dataset, split=split, dataset_config=dataset_config,
                            data_files=data_files or None, text_field=text_field,
                            context=context, new_tokens=new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, docs=docs, pack=pack,
                            prefill=prefill, dtype=dtype, device=device, seed=seed,
                            revision=revision, buffer_len=buffer_len, progress=progress)
    spec_command(model, pair, settings, out=out)
