"""replayquant command line: a thin layer over the library (each command calls one function)."""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from typing import Literal

import typer

# Options with a fixed set of values: typer checks them and `--help` lists them.
# Dtype: replayquant.models.patching.DTYPES (Hugging Face's names and the short ones) and auto.
Dtype = Literal["auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32", "half", "float",
                "float64", "double"]
Prefill = Literal["replay", "exact"]
Reference = Literal["exact", "hf"]
Scoring = Literal["all", "llama"]
TableFormat = Literal["md", "csv", "llama"]
TableOrder = Literal["pair", "model"]
LayerKind = Literal["gdn", "kda", "mamba2"]
BenchShape = Literal["qwen3.5-4b", "tiny"]
BenchPart = Literal["model", "layer", "all"]
KernelPreset = Literal["targets", "probe"]
BenchFormat = Enum("BenchFormat", {f: f for f in ("fp16", "bf16", "fp8", "nvfp4")}, type=str)
# (an Enum: typer takes no list of a Literal; the formats replayquant/bench/formats.py times)

# Plain help (not rich's panels, whose first column cuts long option names at 80 columns): option
# names are always whole, the text wraps at up to 120 columns.
_HELP = {"max_content_width": 120}


@contextmanager
def _user_errors():
    """Bad input (a ValueError from the library): one line on stderr, exit code 2, no traceback."""
    try:
        yield
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  context_settings=_HELP,
                  help="Low-precision SSM state for hybrid models (ReplaySSM).")


def _print_version(value: bool):
    if value:
        from replayquant import __version__
        typer.echo(f"replayquant {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print replayquant's version and exit")):
    """Low-precision SSM state for hybrid models (ReplaySSM)."""
    from replayquant.options import check_backend
    with _user_errors():                  # the run-time options, before any command does work
        check_backend()


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, context_settings=_HELP,
                        help="GPU benchmarks (not run in CI).")
app.add_typer(bench_app, name="bench")


# --- formats (replayquant/formats/report.py, replayquant/bench/formats.py) ---------------------
@app.command("formats")
def formats_cmd(
    heads: int = typer.Option(8, help="matrices in the state-like test tensor"),
    d: int = typer.Option(128, help="rows and columns of each matrix"),
    seed: int = typer.Option(0, help="seed of the test tensor"),
):
    """Every format and rounding: bytes/element, RMSE and max relative error on a state-like tensor."""
    from replayquant.formats.report import print_formats_table
    with _user_errors():
        print_formats_table((heads, d, d), seed)


@bench_app.command("formats")
def bench_formats_cmd(
    mbytes: int = typer.Option(512, help="input size in MB of float32 [N, 128, 128] matrices (>= 256)"),
    out: str = typer.Option("build/bench", help="folder for formats.json and formats.md"),
    formats: list[BenchFormat] = typer.Option(None, "--format", help="formats to time (repeatable; default: all)"),
):
    """GPU: quantize / dequantize GB/s per format and rounding against the device copy bandwidth."""
    from replayquant.bench.formats import run_formats_bench
    with _user_errors():
        run_formats_bench(mbytes=mbytes, out=out, formats=[f.value for f in formats or ()] or None)
# --- end formats -------------------------------------------------------------------------------


# --- precision pairs and drift (replayquant/pairs.py, replayquant/drift.py) -------------------
@app.command("pairs")
def pairs_cmd(
    d_k: int = typer.Option(128, help="state columns (key dim) for the bytes per element"),
    d_v: int = typer.Option(128, help="state rows (value dim)"),
):
    """The shipped precision pairs (configs/pairs/) with read / anchor bytes per state element."""
    from rich.console import Console

    from replayquant.formats.report import check_dims
    from replayquant.pairs import pairs_table
    with _user_errors():
        check_dims({"--d-v": d_v}, {"--d-k": d_k})
    Console(width=max(Console().width, 110)).print(pairs_table(d_k, d_v))


@app.command("drift")
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
    from rich.console import Console

    from replayquant.drift import drift_out_path, drift_table, run_drift, write_drift
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        typer.echo(f"error: --seeds must be comma-separated integers, got {seeds!r}", err=True)
        raise typer.Exit(2)
    con = Console(stderr=True)
    with _user_errors():
        drift_out_path(out, kind, steps)           # before any computing
        res = run_drift(kind, pair or None, steps=steps, seeds=seed_list, batch=batch, heads=heads,
                        d_k=d_k, d_v=d_v, conventional=conventional, progress=con.log)
    with _user_errors():
        path = write_drift(res, out)
    Console(width=max(Console().width, 170)).print(drift_table(res))
    typer.echo(f"wrote {path} and {path.with_suffix('.md')}")
# --- end pairs and drift -----------------------------------------------------------------------

# --- KL harness (replayquant/kl) ---------------------------------------------------------------
@app.command("kl")
def kl_cmd(
    model: str = typer.Option(..., "--model", help="hub id, short name (Qwen3.5-4B) or local folder"),
    pair: list[str] = typer.Option(..., "--pair", help="precision pair name, pair YAML or layer policy "
                                   "YAML (replayquant.policy; repeatable)"),
    dataset: str = typer.Option("pg19", help="heldout (the held-out books shipped with replayquant), "
                                "pg19 (emozilla/pg19), a hub dataset name, a folder of .txt, "
                                "a .txt / .jsonl / .parquet / .arrow / .json / .csv file, a save_to_disk "
                                "folder, a hub-layout folder (data/*.parquet), or a builder name "
                                "(parquet, json, csv, ...) with --data-files"),
    split: str = typer.Option("test", help="dataset split (hub datasets, dataset folders, --data-files)"),
    dataset_config: str = typer.Option(None, "--dataset-config", help="the dataset's configuration "
                                       "(hub datasets, a folder's README configs)"),
    data_files: list[str] = typer.Option(None, "--data-files", help="data files or glob patterns for "
                                         "datasets (repeatable; PATTERN is the --split, SPLIT=PATTERN "
                                         "names the split)"),
    text_field: str = typer.Option("text", "--text-column", "--text-field",
                                   help="column (field) holding the text"),
    context: int = typer.Option(131072, help="tokens per document (shorter documents are skipped)"),
    docs: int = typer.Option(10, help="number of documents, the first ones in the dataset's order"),
    segment: int = typer.Option(8192, help="tokens per forward (caches carry state between segments)"),
    prefill: Prefill = typer.Option("replay", help="replay (every token through the step semantics) | exact"),
    dtype: Dtype = typer.Option("bfloat16", help="weights and activations (auto: the model's own)"),
    device_map: str = typer.Option(None, help="e.g. auto (default on CUDA), cpu, cuda:0"),
    seed: int = typer.Option(0, help="stochastic-rounding seed"),
    out: str = typer.Option(None, help="results JSON (default build/kl/MODEL_PAIRS_ctxN_PREFILL.json; "
                            "the same run resumes there, a file of another kind or configuration is "
                            "refused, and so is a second run while one runs)"),
    pack: bool = typer.Option(False, help="concatenate documents (EOS between) instead of skipping short ones"),
    revision: str = typer.Option(None, help="model revision on the hub"),
    reference: Reference = typer.Option("exact", help="exact (s32_rs, FP32 prefill: exact FP32 state) | hf (the unpatched model)"),
    scoring: Scoring = typer.Option("all", help="positions scored: all | llama (positions n/2 ... "
                                    "n-2 of each n-token document, as llama.cpp's --kl-divergence)"),
    progress: bool = typer.Option(True, help="progress bar"),
):
    """KL(reference || pair) over long documents, reference and pairs in lockstep; resumable."""
    from replayquant.kl.command import kl_command
    from replayquant.launch import single_process_warning
    warning = single_process_warning("kl")
    if warning:
        typer.echo(warning, err=True)
    try:
        kl_command(model, pair, dataset=dataset, split=split, text_field=text_field, context=context,
                   docs=docs, segment=segment, prefill=prefill, dtype=dtype, device_map=device_map,
                   seed=seed, out=out, pack=pack, revision=revision, reference=reference,
                   progress=progress, dataset_config=dataset_config, data_files=data_files or None,
                   scoring=scoring)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as e:
        typer.echo(f"\n{e or 'interrupted'}", err=True)
        raise typer.Exit(130)


@app.command("table")
def table_cmd(
    files: list[str] = typer.Argument(..., help="results files (build/kl/*.json)"),
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
    results `replayquant lm-eval` / `replayquant gpqa` write: pairs as rows."""
    from replayquant.kl.report import render_table
    from replayquant.kl.runner import load_scored
    with _user_errors():
        from replayquant.gpqa.summary import table_for_files  # GPQA summaries (build/gpqa/*/SUMMARY.json)
        gpqa_table = table_for_files(files, fmt=format)
        if gpqa_table is not None:
            if scoring is not None:
                raise ValueError("--scoring applies to KL results files, not to GPQA or lm-eval results")
            typer.echo(gpqa_table, nl=False)
            return
        typer.echo(render_table(load_scored(files, scoring), fmt=format, by=by), nl=False)


@bench_app.command("kl")
def bench_kl_cmd(
    context: int = typer.Option(131072, help="tokens of the one random document"),
    segment: int = typer.Option(8192, help="tokens per forward"),
    pair: list[str] = typer.Option(None, "--pair", help="pairs (default f4_sr_rs and tp4_hi32)"),
    prefill: Prefill = typer.Option("replay", help="prefill of the pairs"),
    shape: BenchShape = typer.Option("qwen3.5-4b", help="model shape (random weights)"),
    out: str = typer.Option("build/bench/kl_128k.json", help="results JSON"),
):
    """GPU: wall time and peak memory of the KL harness on one long document vs plain HF forwards."""
    from replayquant.kl.bench import bench_kl
    with _user_errors():
        r = bench_kl(shape=shape, context=context, segment=segment, pairs=pair or ("f4_sr_rs", "tp4_hi32"),
                     prefill=prefill, out=out)
    typer.echo(f"KL {r['kl_wall_time_s']:.1f} s, HF forward {r['hf_forward_s']:.1f} s, time per plain forward pass "
               f"{r['slowdown_vs_plain_forwards']:.2f}x (target <= 1.5), peak {r['peak_gpu_gib_kl']} GiB -> {out}")
# --- end KL harness ----------------------------------------------------------------------------


# --- generate (replayquant/bench/generate.py) ----------------------------------------------------
@bench_app.command("generate")
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
    from replayquant.bench.generate import run_generate_bench
    with _user_errors():
        try:
            batches = tuple(int(x) for x in batch.split(","))
        except ValueError:
            raise ValueError(f"--batch takes comma-separated integers, got {batch!r}") from None
        r = run_generate_bench(out=out, shape=shape, batches=batches,
                               pairs=tuple(pair or ("s32_rs", "tp4_hi16_sr")), prompt=prompt,
                               compile_backend=compile_backend, budget_s=budget_s, add=add,
                               progress=lambda m: typer.echo(m, err=True))
    for t in r["targets"]:
        typer.echo(f"{'met ' if t['met'] else 'MISS'} {t['measured']:.3g}  {t['name']}")
    typer.echo(f"-> {out}")


# --- teacher forcing (replayquant/bench/teacher_forcing.py) --------------------------------------
@bench_app.command("teacher-forcing")
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
    from replayquant.bench import teacher_forcing as tf
    if part not in ("model", "layer", "all"):
        raise typer.BadParameter("--part must be model, layer or all")
    with _user_errors():
        if device is not None:
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
# --- end teacher forcing -----------------------------------------------------------------------


# --- GPQA through lm-eval (replayquant/gpqa, replayquant/lm_eval_model.py) ---------------------
@app.command("gpqa")
def gpqa_cmd(
    model: str = typer.Option(..., "--model", help="hub id, short name (Qwen3.5-4B) or local folder"),
    pair: list[str] = typer.Option(..., "--pair", help="precision pair name, pair YAML or layer policy "
                                   "YAML (repeatable; differences are taken from the first)"),
    task: list[str] = typer.Option(None, "--task", "--tasks", help="gpqa_diamond_cot_zeroshot (default), "
                                   "gpqa_diamond_zeroshot, gpqa_diamond_n_shot, gpqa_diamond_generative_n_shot; "
                                   "repeatable or comma-separated (lm-eval's --tasks)"),
    gpqa_csv: str = typer.Option(None, "--gpqa-csv", help="local gpqa_diamond.csv instead of the gated hub dataset"),
    limit: int = typer.Option(None, "--limit", help="only the first N questions of each task"),
    seed: int = typer.Option(0, "--seed", help="stochastic-rounding seed and lm-eval's python seed (answer order)"),
    prefill: Prefill = typer.Option("replay", "--prefill", help="prefill of the pairs"),
    dtype: Dtype = typer.Option("auto", "--dtype", help="weights and activations (auto: the model's own)"),
    device: str = typer.Option(None, "--device", help="cuda, cuda:0, cpu (default: CUDA when present, "
                               "else the CPU)"),
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
    from replayquant.gpqa import render_table, run_gpqa
    with _user_errors():
        extra = {}
        if model_args:
            from lm_eval.utils import simple_parse_args_string
            extra = simple_parse_args_string(model_args)
        tasks = [t.strip() for v in (task or []) for t in v.split(",") if t.strip()]
        summary = run_gpqa(model, pair, tasks=tasks or None, gpqa_csv=gpqa_csv, limit=limit, seed=seed,
                           prefill=prefill, out=out, dtype=dtype, device=device,
                           batch_size=int(batch_size) if batch_size.isdigit() else batch_size,
                           num_fewshot=num_fewshot,
                           gen_kwargs={"max_gen_toks": max_gen_toks} if max_gen_toks else None,
                           apply_chat_template=apply_chat_template, log_samples=log_samples,
                           model_args=extra)
    if summary is not None:
        typer.echo(render_table([summary]))


@app.command("lm-eval", add_help_option=False,
             context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def lm_eval_cmd(ctx: typer.Context):
    """lm-eval's own command line with `--model replayquant` registered (all arguments pass through;
    `--gpqa-csv PATH` reads GPQA-Diamond from a local CSV)."""
    with _user_errors():
        from replayquant.lm_eval_model import lm_eval_main   # checks lm-eval's internals first
        lm_eval_main(list(ctx.args))
# --- end GPQA ----------------------------------------------------------------------------------


# --- decode kernels (replayquant/kernels/{conventional,replay_decode,verify}.py) --------------
@bench_app.command("kernels")
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
    preset: KernelPreset = typer.Option(None, help="a grid replacing the grid options: 'targets' (every row the targets read, one device call) or 'probe'"),
):
    """GPU: conventional vs replay decode kernels over the benchmark grid (B x L x pair, T),
    peers, speculative verify, against the copy bandwidth measured in the same call. Prints a
    runtime estimate first (the whole grid, checks and sweep included: about 9 minutes on an
    H200); sections past --budget-s (default 500) are skipped
    from the end of the plan and listed, so split the grid with --kinds / --pairs / --batches
    over two or more calls. With --authors PATH the ReplaySSM authors' kernels run beside ours on
    the same inputs; --preset targets measures every target of the decode kernels in one call
    (kernels.json `targets`)."""
    from replayquant.bench.authors import checkout_commit
    from replayquant.bench.kernels_plan import estimate_s, plan
    from replayquant.bench.kernels_run import run_kernels_bench
    from replayquant.bench.targets import PRESETS
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    grid = dict(batches=ints(batches), Ls=ints(buffer_lens), pairs=strs(pairs), Ts=ints(drafts),
                spec_batches=ints(spec_batches), peers=peers, checks=checks, sweep=sweep,
                staggered_batches=ints(staggered_batches), main_L_only=False, accuracy=accuracy,
                kinds=strs(kinds))
    with _user_errors():
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"--preset {preset!r}: choose from {', '.join(PRESETS)}")
            grid.update(PRESETS[preset])
        if authors is not None:
            checkout_commit(authors, authors_commit)        # a bad PATH fails before anything runs
    if estimate_only:
        with _user_errors():
            sec = plan(grid["batches"], grid["Ls"], grid["pairs"], grid["Ts"],
                       grid["spec_batches"], grid["kinds"], grid["peers"], grid["checks"],
                       grid["sweep"], authors=authors is not None,
                       staggered_batches=grid["staggered_batches"],
                       main_L_only=grid["main_L_only"], accuracy=grid["accuracy"])
        for key, est, _ in sec:
            typer.echo(f"{est:7.1f} s  {key}")
        typer.echo(f"{len(sec)} sections, estimated {estimate_s(sec):.0f} s (budget {budget_s:.0f} s)")
        return
    with _user_errors():
        run_kernels_bench(out=out, budget_s=budget_s, name=name,
                          authors=authors, authors_commit=authors_commit, **grid)


bench_app.command("decode", hidden=True, help="alias of 'bench kernels'")(bench_kernels_cmd)


@bench_app.command("merge")
def bench_merge_cmd(
    parts: list[str] = typer.Argument(..., help="kernels JSON files of one commit (the grid split over calls)"),
    out: str = typer.Option("build/bench", help="folder for NAME.json, NAME.md, NAME_speedup.png"),
    name: str = typer.Option("kernels", help="output file stem"),
):
    """One kernels table from several `bench kernels` runs of one commit (split by --kinds /
    --spec-batches over device calls): rows kept with their run, speedups derived within a run,
    targets from the merged rows."""
    from replayquant.bench.kernels_merge import merge_kernels
    with _user_errors():
        res = merge_kernels(parts, out=out, name=name)
    typer.echo(f"{len(res['rows'])} rows from {len(parts)} runs -> {out}/{name}.json, .md, _speedup.png")
# --- end decode kernels ------------------------------------------------------------------------


# --- sweep, recommend, sensitivity (replayquant/sweep) ------------------------------------------
def _kl_options(dataset, split, dataset_config, data_files, text_field, context, docs, segment,
                prefill, dtype, device_map, seed, pack, revision, reference, progress) -> dict:
    """The `replayquant kl` options a sweep or sensitivity run passes to its KL run."""
    return dict(dataset=dataset, split=split, dataset_config=dataset_config,
                data_files=data_files or None, text_field=text_field, context=context, docs=docs,
                segment=segment, prefill=prefill, dtype=dtype, device_map=device_map, seed=seed,
                pack=pack, revision=revision, reference=reference, progress=progress)


_DATASET_HELP = "as `replayquant kl --dataset`: heldout, pg19, a hub dataset, a folder or file of texts"


@app.command("sweep")
def sweep_cmd(
    model: str = typer.Option(..., "--model", help="hub id, short name (Qwen3.5-4B) or local folder"),
    pair: list[str] = typer.Option(..., "--pair", help="precision pair name, pair YAML or layer "
                                   "policy YAML (repeatable)"),
    buffer_len: str = typer.Option(None, "--buffer-len", help="buffer lengths L, comma-separated "
                                   "(e.g. 4,8,16,32; default: each pair's own)"),
    kernels: str = typer.Option(None, "--kernels", help="a kernels grid (results/bench/kernels.json) "
                                "for measured microseconds per step"),
    batch: int = typer.Option(256, "--batch", help="batch whose measured times to report (the "
                              "nearest the grid timed)"),
    dataset: str = typer.Option("pg19", help=_DATASET_HELP),
    split: str = typer.Option("test", help="dataset split"),
    dataset_config: str = typer.Option(None, "--dataset-config", help="the dataset's configuration"),
    data_files: list[str] = typer.Option(None, "--data-files", help="data files for datasets (repeatable)"),
    text_field: str = typer.Option("text", "--text-column", "--text-field", help="column holding the text"),
    context: int = typer.Option(131072, help="tokens per document"),
    docs: int = typer.Option(10, help="number of documents"),
    segment: int = typer.Option(8192, help="tokens per forward"),
    prefill: Prefill = typer.Option("replay", help="prefill of the pairs (as `replayquant kl`)"),
    dtype: Dtype = typer.Option("bfloat16", help="weights and activations (auto: the model's own)"),
    device_map: str = typer.Option(None, help="e.g. auto (default on CUDA), cpu, cuda:0"),
    seed: int = typer.Option(0, help="stochastic-rounding seed"),
    pack: bool = typer.Option(False, help="concatenate documents instead of skipping short ones"),
    revision: str = typer.Option(None, help="model revision on the hub"),
    reference: Reference = typer.Option("exact", help="as `replayquant kl`"),
    out: str = typer.Option(None, help="sweep JSON (default build/sweep/MODEL_PAIRS_LLS_ctxN.json; the "
                            "plot and the KL run's NAME_kl.* go beside it; the same variants resume "
                            "there, a file of another kind or run is refused, and so is a second "
                            "run while one runs)"),
    progress: bool = typer.Option(True, help="progress bar"),
):
    """Every (pair, L) in one KL run against the FP32-state reference, with the state bytes per
    decode step and the memory each costs; Pareto front of bytes against KL. Resumable."""
    from replayquant.sweep.command import sweep_command
    try:
        sweep_command(model, pair, buffer_len, kernels=kernels, batch=batch, out=out,
                      **_kl_options(dataset, split, dataset_config, data_files, text_field, context,
                                    docs, segment, prefill, dtype, device_map, seed, pack, revision,
                                    reference, progress))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as e:
        typer.echo(f"\n{e or 'interrupted'}", err=True)
        raise typer.Exit(130)


@app.command("recommend")
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
    device_map: str = typer.Option(None, help="--per-layer: device map of the KL run (default: the "
                                   "sensitivity run's)"),
    out: str = typer.Option(None, help="JSON to write (default: none for a sweep; "
                            "build/recommend/NAME.json with --per-layer); it replaces only a "
                            "recommendation of the same budgets (--per-layer: the same policy); "
                            "anything else, an input, or a second run while one runs is refused"),
    progress: bool = typer.Option(True, help="progress bar (--per-layer)"),
):
    """The cheapest variant of a sweep within the budgets, its savings against the FP32
    conventional step and the runner-up (exit 1 when nothing fits); or, with --per-layer, a layer
    policy from a sensitivity run, measured with the KL harness beside its prediction."""
    from replayquant.sweep import recommend as R
    from replayquant.sweep.common import load_json_kind
    try:
        if per_layer is not None:
            if sweep is not None or gpqa is not None or max_bytes is not None or max_memory is not None:
                raise ValueError("--per-layer takes a sensitivity file and --kl-budget (with --low / "
                                 "--high); give a sweep file, --max-bytes, --max-memory or --gpqa "
                                 "without --per-layer")
            res = R.recommend_per_layer(per_layer, kl_budget, low=low, high=high, out=out,
                                        progress=progress, device_map=device_map)
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
        out_path = None if out is None else R.check_recommendation_out(out, (sweep, gpqa))
        from replayquant.sweep.command import SWEEP_KIND
        sw = load_json_kind(sweep, SWEEP_KIND, "replayquant sweep")
        summary = None
        if gpqa is not None:
            from replayquant.gpqa.summary import load_summary
            summary = load_summary(gpqa)
        rec = R.recommend(sw, kl_budget, max_bytes=max_bytes, max_memory=max_memory, gpqa=summary,
                          gpqa_budget=gpqa_budget, source=sweep)
        R.print_recommendation(rec)
        if out_path is not None:
            R.write_recommendation(out_path, rec, (sweep, gpqa))
            typer.echo(f"wrote {out_path}", err=True)
    except R.NoFit as e:
        typer.echo(f"no fit: {e}", err=True)
        raise typer.Exit(1)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as e:
        typer.echo(f"\n{e or 'interrupted'}", err=True)
        raise typer.Exit(130)


@app.command("sensitivity")
def sensitivity_cmd(
    model: str = typer.Option(..., "--model", help="hub id, short name (Qwen3.5-4B) or local folder"),
    pair: list[str] = typer.Option(..., "--pair", help="precision pair name or YAML (repeatable: "
                                   "give two for `recommend --per-layer`)"),
    buffer_len: int = typer.Option(None, "--buffer-len", help="L of every pair (default: each pair's own)"),
    layers: str = typer.Option(None, "--layers", help="only these recurrent layers (indices, comma-separated)"),
    per_pass: int = typer.Option(0, "--per-pass", help="variants per KL pass (0: all in one lockstep "
                                 "pass; fewer where their caches do not fit in memory)"),
    dataset: str = typer.Option("pg19", help=_DATASET_HELP),
    split: str = typer.Option("test", help="dataset split"),
    dataset_config: str = typer.Option(None, "--dataset-config", help="the dataset's configuration"),
    data_files: list[str] = typer.Option(None, "--data-files", help="data files for datasets (repeatable)"),
    text_field: str = typer.Option("text", "--text-column", "--text-field", help="column holding the text"),
    context: int = typer.Option(131072, help="tokens per document"),
    docs: int = typer.Option(10, help="number of documents"),
    segment: int = typer.Option(8192, help="tokens per forward"),
    prefill: Prefill = typer.Option("replay", help="prefill of the pairs (as `replayquant kl`)"),
    dtype: Dtype = typer.Option("bfloat16", help="weights and activations (auto: the model's own)"),
    device_map: str = typer.Option(None, help="e.g. auto (default on CUDA), cpu, cuda:0"),
    seed: int = typer.Option(0, help="stochastic-rounding seed"),
    pack: bool = typer.Option(False, help="concatenate documents instead of skipping short ones"),
    revision: str = typer.Option(None, help="model revision on the hub"),
    reference: Reference = typer.Option("exact", help="as `replayquant kl`"),
    out: str = typer.Option(None, help="sensitivity JSON (default build/sensitivity/MODEL_PAIRS_ctxN.json; "
                            "the same pairs and layers resume there, a file of another kind or run "
                            "is refused, and so is a second run while one runs)"),
    progress: bool = typer.Option(True, help="progress bar"),
):
    """Per recurrent layer, the KL when only that layer holds the pair (every other layer exact
    FP32), all layers in one lockstep pass, ranked; bar plot and the sum against all layers."""
    from replayquant.sweep.sensitivity import sensitivity_command
    try:
        sensitivity_command(model, pair, buffer_len=buffer_len, layers=layers, per_pass=per_pass,
                            out=out, **_kl_options(dataset, split, dataset_config, data_files,
                                                   text_field, context, docs, segment, prefill, dtype,
                                                   device_map, seed, pack, revision, reference,
                                                   progress))
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt as e:
        typer.echo(f"\n{e or 'interrupted'}", err=True)
        raise typer.Exit(130)
# --- end sweep, recommend, sensitivity ---------------------------------------------------------


if __name__ == "__main__":
    app()
