"""`replayquant kl`: load the model once, run the KL harness, print and save the results."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import torch
from accelerate import PartialState
from rich.console import Console
from transformers import AutoTokenizer

from replayquant.memory import check_kl_sizes
from replayquant.models.device import check_device_map, describe_devices
from replayquant.models.names import resolve_model_name
from replayquant.models.patching import load_config, load_model
from replayquant.models.shapes import config_shapes
from replayquant.launch import process_rank
from replayquant.outputs import check_out_given
from replayquant.policy import EXACT, LayerPolicy, quantized_layers, resolve_pair

from .data import load_documents
from .files import held_out
from .lockstep import check_pair_names
from .report import print_summary
from .run import RunParts, model_record, run_checked_kl
from .settings import KLSettings, check_dtype
from .stats import scored_range


def _model_error(model, resolved, e):
    first = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    return ValueError(f"unknown or unreachable model {model!r} (resolved to {resolved!r}): {first}. "
                      f"Give a hub id, a short name from the model table, or a local folder with "
                      f"config.json, weights and a tokenizer")


def load_tokenizer_and_config(model: str, revision: str | None = None):
    """(tokenizer, config, resolved name): everything but the weights, so that bad input fails
    before gigabytes are loaded."""
    resolved = resolve_model_name(model)   # a path that is not there: one ValueError
    kw = {"revision": revision} if revision else {}
    try:
        cfg = load_config(resolved, **kw)
        tok = AutoTokenizer.from_pretrained(resolved, **kw)
    except ValueError:
        raise
    except (OSError, KeyError) as e:
        raise _model_error(model, resolved, e) from None
    return tok, cfg, resolved


def load_weights(resolved: str, dtype: str = "bfloat16", device_map=None, revision: str | None = None):
    """The model in eval mode (unpatched), through `replayquant.load_model`.
    dtype "auto": the dtype the model's config names (its own)."""
    check_dtype(dtype)
    try:
        m = load_model(resolved, dtype=dtype, device_map=device_map,
                       **({"revision": revision} if revision else {}))
    except ValueError:
        raise
    except (OSError, KeyError) as e:
        raise _model_error(resolved, resolved, e) from None
    return m.eval()


def load_model_and_tokenizer(model: str, dtype: str = "bfloat16", device_map=None, revision: str | None = None):
    """(model, tokenizer, resolved name) with one clear error for an unknown model."""
    check_dtype(dtype)
    tok, _, resolved = load_tokenizer_and_config(model, revision)
    return load_weights(resolved, dtype, device_map, revision), tok, resolved


def default_out(model: str, pairs: list[str], context: int, prefill: str, scoring: str = "all") -> Path:
    def clean(s):
        return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(s)).stem if str(s).endswith((".yaml", ".yml")) else str(s)).strip("-")
    name = f"{clean(Path(model).name)}_{'+'.join(clean(p) for p in pairs)}_ctx{context}_{prefill}"
    if scoring != "all":
        name += f"_{scoring}"
    return Path("build/kl") / f"{name}.json"


def kl_command(model: str, pairs: list, settings: KLSettings | None = None, *,
               out: str | None = None, scoring: str = "all",
               same_documents_as: tuple[str, dict] | None = None) -> dict | None:
    """Everything `replayquant kl` does with `settings` (default: KLSettings()); returns the
    results dict on the main process. A second run into the same --out while one runs is refused
    (`files.held_out`). same_documents_as: (a results file, its record of the documents it
    measured, `DocumentSet.record()`): this run measures those documents, or one ValueError names
    both before the weights load (`check_same_documents`)."""
    # cheap checks first, once: no weights are loaded for a run that cannot start
    settings = settings or KLSettings()
    settings.check()
    first, stop = scored_range(settings.context, scoring)
    if stop - first < 1:
        raise ValueError(f"--scoring {scoring} scores no position of a --context "
                         f"{settings.context} document; give a longer --context")
    check_out_given(out)
    # the main process holds the output for the whole run
    with held_out(out if out is not None else
                  default_out(model, pairs, settings.context, settings.prefill, scoring),
                  main=process_rank() == 0) as out_path:
        return _checked_kl(model, pairs, out_path, settings, scoring, same_documents_as)


def segment_note(pairs, segment: int, context: int) -> str | None:
    """A note where --segment splits replay windows: shorter than --context and not a multiple
    of a pair's buffer length L, so that a window straddles two segments and is computed in
    another order than where every segment starts a window. The KL then differs from such a
    run by more than float noise, within its uncertainty: on tiny-qwen3.5 (--context 256, one
    document) tp4_hi16_sr's mean KL moved 1.3% at --segment 100 or 7 against 128, 0.07% at 64,
    against an uncertainty of 8%."""
    if segment >= context:
        return None
    held = [q for p in pairs for q in (p.pairs() if isinstance(p, LayerPolicy) else [p])
            if q != EXACT]
    Ls = sorted({q.buffer_len for q in held})
    off = [L for L in Ls if segment % L]
    if not off:
        return None
    step = math.lcm(*Ls)
    return (f"note: --segment {segment} is not a multiple of the buffer length "
            f"{', '.join(map(str, off))}, so replay windows straddle segments and are computed in "
            f"another order than in a run whose segments start windows: its KL differs from such "
            f"a run by more than float noise, within its uncertainty (1.3% of the mean KL on "
            f"tiny-qwen3.5). Compare runs of one --segment, or give a multiple of {step} (e.g. "
            f"{max(step, segment - segment % step)})")


def check_same_documents(documents, same_documents_as: tuple[str, dict]) -> None:
    """One ValueError naming both when `documents` (a DocumentSet) are not the documents the
    results file `same_documents_as[0]` recorded (`same_documents_as[1]`: the sha256 of their
    tokens, which covers their text, their order and the tokenizer)."""
    where, then = same_documents_as
    now = documents.record()
    if now["tokens_sha256"] != then.get("tokens_sha256"):
        raise ValueError(
            f"{where} measured {len(then.get('document_ids') or [])} document(s) of "
            f"{then.get('source')} (tokens sha256 {then.get('tokens_sha256')}); the dataset gives "
            f"{len(now['document_ids'])} other document(s) of {now['source']} now (tokens sha256 "
            f"{now['tokens_sha256']}): the data changed or is another. Put those documents back, "
            f"or measure again on these")


def _checked_kl(model, pairs, out_path: Path, settings: KLSettings, scoring: str,
                same_documents_as) -> dict | None:
    """`kl_command` after its checks of `settings` and `out_path`, which it holds."""
    kl = settings
    device_map = check_device_map(kl.device_map, "--device")
    pairs = [resolve_pair(p) for p in pairs]          # once: everything below takes the objects
    check_pair_names(pairs)
    note = segment_note(pairs, kl.segment, kl.context)
    if note:
        Console(stderr=True).print(note, markup=False, highlight=False, soft_wrap=True)
    tok, cfg, resolved = load_tokenizer_and_config(model, kl.revision)
    if os.path.isdir(resolved):
        resolved = os.path.realpath(resolved)     # the same folder names the same model
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    limit = getattr(text_cfg, "max_position_embeddings", None)
    if limit and kl.context > limit:
        raise ValueError(f"--context {kl.context} is longer than the model supports "
                         f"(max_position_embeddings = {limit}); lower --context")
    shapes = config_shapes(cfg)[0]
    quantized = [quantized_layers(p, shapes) for p in pairs]
    check_kl_sizes([p.label() for p in pairs], quantized, len(shapes), kl.context, kl.prefill,
                   device_map)
    documents = load_documents(kl.dataset, tok, kl.context, kl.docs, split=kl.split,
                               text_field=kl.text_field, pack=kl.pack,
                               dataset_config=kl.dataset_config, data_files=kl.data_files)
    if same_documents_as is not None:
        check_same_documents(documents, same_documents_as)

    # CPU processes (e.g. `accelerate launch --multi_gpu --num_processes 2` or torchrun on a machine
    # without CUDA) only form a process group (gloo) when the state is told it runs on CPU.
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes > 1:
        dm = {"": str(state.device)}          # data-parallel: one whole model per process
    elif device_map is not None:
        dm = device_map
    else:
        dm = "auto" if torch.cuda.is_available() else None
    m = load_weights(resolved, kl.dtype, dm, kl.revision)
    info = model_record(m, name=resolved,
                        dtype=None if kl.dtype == "auto" else kl.dtype)   # auto: as loaded
    console = Console(stderr=True)
    if state.is_main_process:
        each = f" in each of {state.num_processes} processes" if state.num_processes > 1 else ""
        console.print(f"device: {describe_devices(m)}{each}", markup=False, highlight=False)
    parts = RunParts(model_info=info, console=console,
                     state=state if state.num_processes > 1 else None,
                     extra_params={"device_map": str(dm), "num_processes": state.num_processes})
    res = run_checked_kl(m, tok, pairs, kl, out=out_path, scoring=scoring, documents=documents,
                         parts=parts)
    if res is not None:
        print_summary(res, Console())
        Console(stderr=True).print(f"wrote {out_path}, {out_path.with_suffix('.png')} and "
                                   f"{out_path.with_suffix('.kl')}/")
    return res
