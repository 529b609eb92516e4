"""What every command shares: the Typer apps, the fixed choices, the options the KL family (kl,
sweep, sensitivity, gpqa) declares once, and the one error handler every command runs under."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Literal

import click
import typer
import typer.core

from replayquant import __version__
from replayquant.bench.targets import PRESETS
from replayquant.choices import DTYPE_NAMES, PREFILLS, REFERENCES
from replayquant.kl.settings import KLSettings
from replayquant.options import check_backend
from replayquant.outputs import parse_json

# Options with a fixed set of values: typer checks them and `--help` lists them.
Dtype = Literal[("auto", *DTYPE_NAMES)]
Prefill = Literal[PREFILLS]
Reference = Literal[REFERENCES]
Scoring = Literal["all", "llama"]
TableFormat = Literal["md", "csv", "llama"]
TableOrder = Literal["pair", "model"]
LayerKind = Literal["gdn", "kda", "mamba2"]
BenchShape = Literal["qwen3.5-4b", "tiny"]
BenchPart = Literal["model", "layer", "all"]
KernelPreset = Literal[tuple(PRESETS)]
BenchFormat = Enum("BenchFormat", {f: f for f in ("fp16", "bf16", "fp8", "nvfp4")}, type=str)
# (an Enum: typer takes no list of a Literal; the formats replayquant/bench/formats.py times)

# Plain help (not rich's panels, whose first column cuts long option names at 80 columns): option
# names are always whole, the text wraps at the terminal's width up to 120 columns; -h or --help.
_HELP = {"max_content_width": 120, "help_option_names": ["-h", "--help"]}


class _Command(typer.core.TyperCommand):
    """A command whose `--help` names each option's value by what it is (`--pair PAIR`,
    `--context CONTEXT`, a short set of choices as `<a|b>`) where typer names its Python type
    (`<list[str]>`, `<str>`, and every dtype name on one line of 82 columns)."""

    def format_options(self, ctx, formatter):
        sections = {"argument": [], "option": []}
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is not None:
                sections[p.param_type_name].append((_value_names(p, record[0]), record[1]))
        for title, kind in (("Arguments", "argument"), ("Options", "option")):
            if sections[kind]:
                with formatter.section(title):
                    formatter.write_dl(sections[kind])


def _value_names(p, typer_names: str) -> str:
    """How `--help` shows parameter `p`: flags as typer does (`--pack / --no-pack`), an argument
    by its name (FILES...), an option by its names and its value's name."""
    if getattr(p, "is_flag", False) or getattr(p, "count", False):
        return typer_names
    desc = p.type_descriptor
    choices = [str(getattr(c, "value", c)) for c in desc.choices or ()] if desc.is_choice else []
    if choices and len("|".join(choices)) <= 24:
        value = "<" + "|".join(choices) + ">"
    else:
        long = next((o for o in p.opts if o.startswith("--")), p.opts[0])
        value = long.lstrip("-").replace("-", "_").upper() + ("..." if p.nargs != 1 else "")
    if p.param_type_name == "argument":
        return value
    return f"{click.formatting.join_options(p.opts)[0]} {value}"


class _Typer(typer.Typer):
    """typer.Typer whose commands are `_Command`s."""

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


@contextmanager
def user_errors():
    """Bad input (a ValueError from the library): one line on stderr, exit code 2, no traceback.
    An interrupt (Ctrl-C, or the KeyboardInterrupt a run raises with how to resume): its message
    and exit code 130. A context manager, and as `@user_errors()` a command's whole body."""
    try:
        yield
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt as e:
        typer.echo(f"\n{e or 'interrupted'}", err=True)
        raise typer.Exit(130) from None


def json_kind(path) -> str | None:
    """The "kind" of a JSON results file (None where it has none or cannot be read: the command
    then reads it and names what is wrong)."""
    try:
        d = parse_json(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d.get("kind") if isinstance(d, dict) else None


app = _Typer(no_args_is_help=True, rich_markup_mode=None, context_settings=_HELP,
             help="Low-precision SSM state for hybrid models (ReplaySSM).")
bench_app = _Typer(no_args_is_help=True, rich_markup_mode=None, context_settings=_HELP,
                   help="GPU benchmarks (not run in CI).")
app.add_typer(bench_app, name="bench")


def _print_version(value: bool):
    if value:
        typer.echo(f"replayquant {__version__}")
        raise typer.Exit()


@app.callback()
@user_errors()                      # the run-time options, before any command does work
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print replayquant's version and exit")):
    """Low-precision SSM state for hybrid models (ReplaySSM)."""
    check_backend()


# --- the KL family's options ----------------------------------------------------------------
# Options of kl, sweep, sensitivity and gpqa with the same meaning in each: name, help and
# choices here, the default where the command declares the parameter (KLSettings for the
# options of a KL run, KL_FLAGS below).
ModelOpt = Annotated[str, typer.Option("--model", help="hub id, short name (Qwen3.5-4B) or local folder")]
PrefillOpt = Annotated[Prefill, typer.Option("--prefill", help="prefill of the pairs: replay (every "
                                             "token through the step semantics) | exact")]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="weights and activations: auto (the "
                                         f"model's own) or {', '.join(DTYPE_NAMES)}")]
DeviceOpt = Annotated[str | None, typer.Option(
    "--device", help="where the model runs: cpu, cuda, cuda:N (default: CUDA when present, else "
                     "the CPU)")]
# the spelling of --device in earlier versions, still taken (`device_option`)
OldDeviceOpt = Annotated[str | None, typer.Option("--device-map", hidden=True)]


def device_option(device: str | None, old: str | None) -> str | None:
    """--device, or the value given to its earlier spelling --device-map (with a note on
    stderr); both at once is one ValueError."""
    if old is None:
        return device
    if device is not None:
        raise ValueError("--device and --device-map (its earlier spelling) are both given; give "
                         "--device alone")
    typer.echo("note: --device-map is deprecated; give --device (it takes the same values)",
               err=True)
    return old


def pair_option(repeated: str, policies: bool = True):
    """--pair (required, repeatable): `repeated` says what the command does with several;
    `policies`: whether it takes a layer policy YAML as well as a pair."""
    what = ("precision pair name, pair YAML or layer policy YAML (replayquant.policy; " if policies
            else "precision pair name or YAML (")
    return Annotated[list[str], typer.Option("--pair", help=f"{what}{repeated})")]


# The command line of each KLSettings field (replayquant.kl.settings: its default is there); a
# command takes them all through a parameter `kl: KLSettings` and `with_kl_options`.
KL_FLAGS = {
    "dataset": Annotated[str, typer.Option(
        help="heldout (the held-out books shipped with replayquant), pg19 (emozilla/pg19), a hub "
             "dataset name, a folder of .txt, a .txt / .jsonl / .parquet / .arrow / .json / .csv "
             "file, a save_to_disk folder, a hub-layout folder (data/*.parquet), or a builder "
             "name (parquet, json, csv, ...) with --data-files")],
    "split": Annotated[str, typer.Option(
        help="dataset split (hub datasets, dataset folders, --data-files)")],
    "dataset_config": Annotated[str | None, typer.Option(
        "--dataset-config", help="the dataset's configuration (hub datasets, a folder's README "
                                 "configs)")],
    "data_files": Annotated[list[str] | None, typer.Option(
        "--data-files", help="data files or glob patterns for datasets (repeatable; PATTERN is "
                             "the --split, SPLIT=PATTERN names the split)")],
    "text_field": Annotated[str, typer.Option(
        "--text-column", "--text-field", help="column (field) holding the text")],
    "context": Annotated[int, typer.Option(
        help="tokens per document (shorter documents are skipped)")],
    "docs": Annotated[int, typer.Option(
        help="number of documents, the first ones in the dataset's order")],
    "segment": Annotated[int, typer.Option(
        help="tokens per forward (caches carry state between segments)")],
    "prefill": PrefillOpt,
    "dtype": DtypeOpt,
    "device_map": Annotated[str | None, typer.Option(
        "--device", help="where the model runs: cpu, cuda, cuda:N, or auto / balanced / "
                         "balanced_low_0 / sequential (accelerate spreads the model over the GPUs; "
                         "default: auto on CUDA, else the CPU)")],
    "seed": Annotated[int, typer.Option(help="stochastic-rounding seed")],
    "pack": Annotated[bool, typer.Option(
        help="concatenate documents (EOS between) instead of skipping short ones")],
    "revision": Annotated[str | None, typer.Option(help="model revision on the hub")],
    "reference": Annotated[Reference, typer.Option(
        help="exact (s32_rs, FP32 prefill: exact FP32 state) | hf (the unpatched model)")],
    "progress": Annotated[bool, typer.Option(help="progress bar")],
}


def with_settings(name: str, cls, flags: dict, extra: dict | None = None, finish=None):
    """A decorator: the command's parameter `name` (a `cls` dataclass) replaced, where it stands,
    by the options of `flags` ({parameter: its Annotated option}, in the order the help lists
    them): a field of cls defaults to the field's default, another parameter to its default in
    `extra`. The command is then called with one `cls` of the fields' options, after
    `finish(settings, {the other options})` where given, so that the library takes the settings
    whole."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    extra = extra or {}
    fields = [f for f in flags if f not in extra]
    missing = [f for f in fields if f not in defaults]
    if missing:
        raise TypeError(f"{cls.__name__} has no fields {missing}; give their defaults in extra")

    def wrap(command):
        kw_only = inspect.Parameter.KEYWORD_ONLY          # typer passes every option by name
        params = []
        for p in inspect.signature(command, eval_str=True).parameters.values():
            if p.name == name:
                params += [inspect.Parameter(f, kw_only, annotation=a,
                                             default=extra[f] if f in extra else defaults[f])
                           for f, a in flags.items()]
            else:
                params.append(p.replace(kind=kw_only))

        @functools.wraps(command)
        def run(**options):
            settings = cls(**{f: options.pop(f) for f in fields})
            more = {e: options.pop(e) for e in extra}
            if finish is not None:
                finish(settings, more)
            return command(**{name: settings}, **options)
        run.__signature__ = inspect.Signature(params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run
    return wrap


def _finish_kl(kl: KLSettings, more: dict) -> None:
    kl.device_map = device_option(kl.device_map, more["old_device_map"])
    library_logs_above_bars()                       # a KL run shows a progress bar


# `command` with its parameter `kl: KLSettings` replaced, where it stands, by one option per
# KLSettings field (as KL_FLAGS declares it) and the earlier spelling of --device
with_kl_options = with_settings(
    "kl", KLSettings, {**{f.name: KL_FLAGS[f.name] for f in dataclasses.fields(KLSettings)},
                       "old_device_map": OldDeviceOpt},
    extra={"old_device_map": None}, finish=_finish_kl)


class _CurrentStderr:
    """sys.stderr as it is at each write. While a rich progress bar runs in a terminal it swaps
    sys.stderr for a proxy that prints above the bar; a stream taken at import writes through
    the bar instead."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()


def library_logs_above_bars() -> None:
    """transformers' log lines (its warning, at the first forward, that a kernel falls back to
    PyTorch) go to stderr as it is at each line, so that they print above a progress bar, not
    through it. Called by the commands that load transformers anyway."""
    from transformers.utils import logging as hf_logging
    for handler in hf_logging.get_logger().handlers:
        # its own (not a subclass a caller added), once: setStream flushes the stream it
        # replaces, which a second command in one process (a test's CliRunner) has closed
        if type(handler) is logging.StreamHandler and not isinstance(handler.stream,
                                                                     _CurrentStderr):
            handler.setStream(_CurrentStderr())
