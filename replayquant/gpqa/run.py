"""`replayquant gpqa`: lm-eval's GPQA-Diamond tasks for several precision pairs of one model.

One model load; for each pair in turn the pair is patched in (replacing the previous one) and
lm-eval's `simple_evaluate` runs the same tasks with the same seeds and limit, so every pair sees
the same questions with the same answer order (checked: the per-question hashes must agree), and
every pass lm-eval makes over a task's documents (requests, scoring) sees that one order
(`replayquant.gpqa.lm_task.GPQATask`), so the targets scored are the letters of the prompts.
Outputs in `out/`: `<pair>.json` (lm-eval's results dict plus a `replayquant` block with the pair,
provenance and per-question scores), `<pair>.samples.<task>.jsonl` with --log-samples, and
`SUMMARY.json` (accuracy +- stderr per pair and task, difference from the first pair with a paired
stderr, provenance).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import sys
from pathlib import Path

import datasets
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, hash_string, simple_parse_args_string

from replayquant.gpqa.settings import GPQASettings
from replayquant.gpqa.summary import SUMMARY_KIND, build_summary
from replayquant.gpqa.tasks import (HUB_CONFIG, HUB_DATASET, check_csv, check_hub_access,
                                    check_task_dir, check_tasks, file_sha256, write_task_dir)
from replayquant.gpqa.lm_eval_model import PREFILLS, ReplayQuantLM, lm_eval_logs_to_stderr
from replayquant.policy import resolve_pair
from replayquant.models.device import check_device, default_device, describe_device
from replayquant.models.names import resolve_model_name
from replayquant.models.patching import resolve_dtype
from replayquant.launch import process_rank
from replayquant.outputs import (check_out_given, check_owned, check_writable_folder, output_lock,
                                 write_json, write_text)
from replayquant.streams import check_seed
from replayquant.provenance import provenance

__all__ = ["run_gpqa", "check_out", "default_out_dir", "per_doc_scores", "questions_digest",
           "parse_model_args"]

log = logging.getLogger(__name__)


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(s).rstrip("/").split("/")[-1]) or "model"


def default_out_dir(model: str) -> Path:
    return Path("build") / "gpqa" / _slug(model)


def _reset_task_modules():
    """lm-eval caches each task's utils module; gpqa n_shot's utils seeds a module-level RNG at
    import. Dropping the cached modules makes every pair start from the state a fresh `lm_eval`
    process would have, so all pairs get the same answer order."""
    for name in [m for m in sys.modules if m.startswith("lm_eval.tasks.gpqa.")]:
        del sys.modules[name]


def per_doc_scores(samples: list[dict]) -> dict[str, dict[str, float]]:
    """{"metric,filter": {doc_id: value}} from lm-eval's logged samples of one task."""
    out: dict[str, dict[str, float]] = {}
    for s in samples:
        for m in s.get("metrics", []):
            v = s.get(m)
            if isinstance(v, (int, float)):
                out.setdefault(f"{m},{s.get('filter', 'none')}", {})[str(s["doc_id"])] = float(v)
    return out


def questions_digest(samples: list[dict]) -> str:
    """Hash of (doc_id, doc, prompt, target) over the questions of one task: equal for two runs iff
    they asked the same questions with the same answer order and few-shot context."""
    keys = sorted({(int(s["doc_id"]), s.get("doc_hash", ""), s.get("prompt_hash", ""),
                    s.get("target_hash", "")) for s in samples})
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()


PAIR_KIND = "replayquant/gpqa-pair"     # a pair's results file: lm-eval's results dict, no "kind"


def _is_pair_file(old: dict) -> bool:
    """lm-eval's results dict with the `replayquant` block `replayquant gpqa` adds."""
    return isinstance(old.get("results"), dict) and isinstance(old.get("replayquant"), dict)


def check_out(out: Path, labels, tasks, log_samples: bool) -> None:
    """Refuse, before any work, a folder `out` holding, where this run writes, anything but the
    files of `replayquant gpqa` (`replayquant.outputs.check_owned`): a pair's results file,
    its samples (replaced only with it), SUMMARY.json, and the task files in _tasks/
    (`tasks.check_task_dir`)."""
    writer = "replayquant gpqa"
    check_task_dir(out / "_tasks")
    for label in labels:
        path = out / f"{_slug(label)}.json"
        samples = [out / f"{_slug(label)}.samples.{t}.jsonl" for t in tasks] if log_samples else ()
        check_owned(path, PAIR_KIND, writer, beside=samples, unkinded=_is_pair_file)
    check_owned(out / "SUMMARY.json", SUMMARY_KIND, writer)


def run_gpqa(model: str, pairs: list, settings: GPQASettings | None = None, *,
             out=None) -> dict | None:
    """Run lm-eval's GPQA-Diamond tasks of `settings` (default: GPQASettings()) for every pair
    into the folder `out`; return the summary (None on ranks > 0).

    The settings' `seed` is the stochastic-rounding seed of every pair and lm-eval's python seed
    (answer order); lm-eval's numpy / torch / few-shot seeds stay at lm-eval's defaults, so seed
    0 asks the questions a plain `lm_eval` process with an empty `datasets` cache asks (see
    below). Their `device`: cpu, cuda, cuda:N (None: a device in `model_args`, else CUDA when
    present, else the CPU); a device this machine does not have is a ValueError before anything
    loads."""
    # -- every check before any weights are loaded, once: the settings are read from here on
    s = dataclasses.replace(settings or GPQASettings())      # a copy, as checked and resolved
    resolved, labels = _resolve_pairs(pairs)
    s.tasks, s.dtype, s.device = _check_settings(model, s.tasks, s.prefill, s.limit, s.dtype,
                                                 s.device, s.model_args)
    _check_counts(s.batch_size, s.num_fewshot, s.gen_kwargs)
    check_seed(s.seed, "--seed")
    tasks, limit, seed, prefill, dtype = s.tasks, s.limit, s.seed, s.prefill, s.dtype
    gpqa_csv, log_samples, batch_size = s.gpqa_csv, s.log_samples, s.batch_size
    out = _check_out_folder(model, out, labels, tasks, log_samples)
    data = _data_source(gpqa_csv)

    # the main process holds the folder (its lock: SUMMARY.lock) until SUMMARY.json is written
    main = process_rank() == 0
    with output_lock(out / "SUMMARY.json") if main else contextlib.nullcontext():
        check_out(out, labels, tasks, log_samples)      # again, holding the lock
        # lm-eval's tasks, answers shuffled once per task (GPQATask), from gpqa_csv or the hub
        include_path = str(write_task_dir(gpqa_csv, out / "_tasks", tasks))

        lm_kwargs = dict(s.model_args or {})
        lm_kwargs.update(dtype=dtype, batch_size=batch_size, device=s.device)
        print(f"gpqa: {model} on {describe_device(s.device)}", file=sys.stderr)
        lm = _load_lm(model, resolved[0], prefill, seed, lm_kwargs)

        # the index of the task files written above only: lm-eval's index of all its tasks took
        # 30 s to build on a 2-core machine, this one 0.14 s
        task_manager = TaskManager(include_path=include_path, include_defaults=False)
        with _datasets_cache_off():
            per_pair = _run_pairs(lm, resolved, labels, task_manager, out, model=model, s=s,
                                  data=data)
        if not per_pair:
            return None
        summary = build_summary(per_pair, model=model, tasks=list(tasks), limit=limit, seed=seed,
                                prefill=prefill, data=data,
                                provenance=provenance(device=str(lm.device), model=model,
                                                      pairs=[p.to_dict() for p in resolved], prefill=prefill,
                                                      seed=seed, tasks=list(tasks), limit=limit, data=data,
                                                      batch_size=batch_size, dtype=str(dtype),
                                                      num_fewshot=s.num_fewshot,
                                                      gen_kwargs=s.gen_kwargs,
                                                      apply_chat_template=s.apply_chat_template,
                                                      world_size=lm.world_size))
        write_json(out / "SUMMARY.json", summary, indent=2, default=handle_non_serializable)
        return summary


def _load_lm(model: str, pair, prefill: str, seed: int, lm_kwargs: dict):
    """The lm-eval model; an argument of --model-args that the model class does not take (lm-eval
    passes those it does not know to from_pretrained) is one ValueError saying which."""
    try:
        return ReplayQuantLM(pretrained=model, pair=pair, prefill=prefill, seed=seed, **lm_kwargs)
    except TypeError as e:
        if "unexpected keyword argument" not in str(e):
            raise
        raise ValueError(f"--model-args: {e} (lm-eval's hf model passes the arguments it does not "
                         f"take itself to the model's from_pretrained); remove it") from None


def _resolve_pairs(pairs: list) -> tuple[list, list[str]]:
    """(the resolved pairs, their labels); none, or two with one label, is one ValueError."""
    if not pairs:
        raise ValueError("give at least one --pair (e.g. --pair s32_rs --pair f4_sr_rs)")
    resolved = [resolve_pair(p) for p in pairs]
    labels = [p.label() for p in resolved]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"pair(s) {dup} given more than once")
    return resolved, labels


# lm-eval hf model arguments that an option of `gpqa` sets: in --model-args they would be
# overridden, clash with it, or (buffer_len) hold for the first pair only
_OWN_ARGS = {"pretrained": "--model", "pair": "--pair", "prefill": "--prefill", "seed": "--seed",
             "dtype": "--dtype", "batch_size": "--batch-size",
             "buffer_len": "--pair with a pair YAML that has buffer_len:"}


def parse_model_args(text: str | None) -> dict:
    """lm-eval's hf model arguments from --model-args 'k=v,k=v' (values typed as lm-eval types
    them); an item that is not key=value is one ValueError."""
    items = [x for x in (text or "").split(",") if x.strip()]
    bad = [x for x in items if "=" not in x or not x.split("=", 1)[0].strip()]
    if bad:
        raise ValueError(f"--model-args {text!r}: {bad[0]!r} is not key=value; give lm-eval's hf "
                         f"model arguments as key=value pairs separated by commas (e.g. "
                         f"trust_remote_code=True,max_length=4096)")
    return simple_parse_args_string(text)


def _check_model_args(model_args: dict, device: str | None) -> None:
    """One ValueError for --model-args that an option of `gpqa` sets (`_OWN_ARGS`), or a device
    there that --device contradicts."""
    own = [k for k in model_args if k in _OWN_ARGS]
    if own:
        k = own[0]
        raise ValueError(f"--model-args {k}={model_args[k]}: gpqa sets {k} from {_OWN_ARGS[k]}; "
                         f"give it there, not in --model-args")
    there = model_args.get("device")
    if device is not None and there is not None and str(there) != str(device):
        raise ValueError(f"--model-args device={there} and --device {device} name two devices; "
                         f"give one")


def _check_counts(batch_size, num_fewshot, gen_kwargs) -> None:
    """One ValueError for a batch size (an integer >= 1, auto, or auto:N as lm-eval takes it),
    few-shot count (>= 0) or generation budget (>= 1) lm-eval would fail on or take as nothing."""
    def whole(v, lo):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo
    auto = isinstance(batch_size, str) and re.fullmatch(r"auto(:[1-9][0-9]*)?", batch_size)
    if not (whole(batch_size, 1) or auto):
        shown = batch_size if isinstance(batch_size, int) else repr(batch_size)
        raise ValueError(f"--batch-size {shown}: give an integer at least 1, auto (the largest "
                         f"that fits) or auto:N (lm-eval finds it again N times)")
    if num_fewshot is not None and not whole(num_fewshot, 0):
        raise ValueError(f"--num-fewshot {num_fewshot}: give a number of examples >= 0")
    gen = (gen_kwargs or {}).get("max_gen_toks")
    if gen is not None and not whole(gen, 1):
        raise ValueError(f"--max-gen-toks {gen}: give a number of tokens >= 1")


def _check_settings(model: str, tasks, prefill: str, limit, dtype: str, device: str | None,
                    model_args: dict | None) -> tuple[list, str, str]:
    """(tasks, dtype as lm-eval names it, device), each checked (one ValueError); the model's
    name resolves (a folder that is not there fails here, before lm-eval runs)."""
    tasks = check_tasks(tasks)
    if prefill not in PREFILLS:
        raise ValueError(f"--prefill {prefill!r}: use one of {', '.join(PREFILLS)}")
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"--limit {limit}: must be a positive integer")
    if dtype != "auto":       # lm-eval takes torch's names: bf16 / fp16 / fp32 as bfloat16 / ...
        dtype = str(resolve_dtype(dtype)).removeprefix("torch.")
    _check_model_args(model_args or {}, device)
    if device is None and (model_args or {}).get("device") is not None:
        device = check_device(model_args["device"], "--model-args device=")
    device = default_device() if device is None else check_device(device)
    resolve_model_name(model)
    return tasks, dtype, device


def _check_out_folder(model: str, out, labels: list[str], tasks, log_samples: bool) -> Path:
    """The output folder (default: `default_out_dir`), writable and holding nothing but files
    `replayquant gpqa` may replace (`check_out`)."""
    check_out_given(out)
    out = Path(out) if out is not None else default_out_dir(model)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; gpqa writes one results file per pair and "
                         f"SUMMARY.json into a folder: give a folder (created if missing)")
    check_writable_folder(out, out)
    check_out(out, labels, tasks, log_samples)
    return out


def _data_source(gpqa_csv) -> dict:
    """Where the questions come from: the CSV file given (checked, with its sha256) or the hub
    dataset (its access checked)."""
    if gpqa_csv is not None:
        n_questions = check_csv(gpqa_csv)
        return {"source": "csv", "path": str(Path(gpqa_csv).resolve()), "sha256": file_sha256(gpqa_csv),
                "questions": n_questions}
    check_hub_access()
    return {"source": "hub", "dataset": HUB_DATASET, "config": HUB_CONFIG}


@contextlib.contextmanager
def _datasets_cache_off():
    """`datasets` caches the result of lm-eval's process_docs (which shuffles the answers) under a
    fingerprint that ignores the state of Python's RNG, so with its cache the answer order would
    be whatever an earlier run computed, whatever the seed. Without it the first pass shuffles
    from the seed, and `GPQATask` hands that pass's documents to every later pass."""
    caching = datasets.is_caching_enabled()
    datasets.disable_caching()
    try:
        yield
    finally:
        if caching:
            datasets.enable_caching()


def _run_pairs(lm, resolved, labels, task_manager, out, *, model: str, s: GPQASettings,
               data: dict) -> list[dict]:
    """lm-eval's tasks for each pair in turn on the one model `lm`; each pair's results file
    (and samples), and the list of them (empty on ranks > 0). `s`: the checked settings."""
    tasks, limit, seed, prefill = s.tasks, s.limit, s.seed, s.prefill
    batch_size, dtype, device, log_samples = s.batch_size, s.dtype, s.device, s.log_samples
    num_fewshot, gen_kwargs = s.num_fewshot, s.gen_kwargs
    apply_chat_template = s.apply_chat_template
    per_pair = []
    for pair, label in zip(resolved, labels):
        lm.set_pair(pair, prefill=prefill, seed=seed)
        _reset_task_modules()
        lm_eval_logs_to_stderr()
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), task_manager=task_manager,
            limit=limit, random_seed=seed, num_fewshot=num_fewshot, gen_kwargs=gen_kwargs,
            apply_chat_template=apply_chat_template, log_samples=True, batch_size=batch_size,
            device=device)
        if results is None:          # not the main process of a data-parallel run
            continue
        samples = results.pop("samples")
        prov = provenance(device=str(lm.device), model=model, pair=pair.to_dict(), prefill=prefill,
                          seed=seed, tasks=list(tasks), limit=limit, data=data, batch_size=batch_size,
                          dtype=str(dtype), num_fewshot=num_fewshot, gen_kwargs=gen_kwargs,
                          apply_chat_template=apply_chat_template, world_size=lm.world_size)
        per_doc = {t: per_doc_scores(samples.get(t, [])) for t in tasks}
        digests = {t: questions_digest(samples.get(t, [])) for t in tasks}
        # as lm-eval's own results files have them, so runs compare across tools
        results["task_hashes"] = {t: hash_string("".join(x["doc_hash"] + x["prompt_hash"] + x["target_hash"]
                                                         for x in samples.get(t, []))) for t in tasks}
        results["replayquant"] = {"pair": pair.to_dict(), "pair_label": label, "prefill": prefill,
                                  "seed": seed, "data": data, "provenance": prov,
                                  "questions_digest": digests, "per_doc": per_doc}
        out.mkdir(parents=True, exist_ok=True)
        res_path = out / f"{_slug(label)}.json"
        write_json(res_path, results, indent=2, default=handle_non_serializable, ensure_ascii=False)
        if log_samples:
            for t in tasks:
                write_text(out / f"{_slug(label)}.samples.{t}.jsonl", "".join(
                    json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n"
                    for s in samples.get(t, [])))
        per_pair.append({"label": label, "file": res_path.name, "results": results})

    return per_pair
