"""Questions per minute of GPQA-Diamond with chain of thought on the Qwen3.5-4B shape, on CUDA.

    python evals/gpqa_cot_timing.py OUT.json [--before DIR] [--before-commit SHA]
        [--pair tp4_hi16_sr] [--questions 16] [--batch-size 8] [--ways eager,compiled,...]
        [--shape tiny --device cpu]

The model is `bench kl`'s Qwen3.5-4B shape (32 layers, random bf16 weights, replayquant.bench.kl)
saved with save_pretrained beside the tokenizer of the embedded tiny-qwen3.5; the data is a CSV
of made-up questions in GPQA's columns (marked synthetic). Each way runs `replayquant.gpqa.run_gpqa`
(what `replayquant gpqa --task gpqa_diamond_cot_zeroshot --gpqa-csv CSV --batch-size 8` runs) in a
process of its own, with a fresh model load, and times every `generate` of lm-eval's
`generate_until` (GPU synchronised):

* `before`: the package at DIR (an older tree: `git archive REV replayquant | tar -x -C DIR`);
* `eager`: this tree, the eager decode steps (`compile_generate=false`);
* `compiled`: this tree, HF's static cache compiled with torch.compile (`compile_generate=auto`);
* `hf_compiled`: the unpatched model through lm-eval's own `hf` model with HF's static cache
  (`--gen_kwargs cache_implementation=static`, which HF compiles on its own): the same lm-eval
  loop around HF's fastest decode, the ceiling for the patched model.

Per way: the whole run's seconds (model load, every batch, compiles included), the seconds of
each batch with its prefill apart (GenerationMixin._prefill, synchronised) and the decode steps'
mean, dynamo's compiled frames (guards and the guard latency it measured when it built them),
and questions per minute over the batches after the first (the first compiles; a
full GPQA-Diamond run of 198 questions has 24 more batches of 8). lm-eval's default generation
budget (256 tokens) holds; random weights rarely stop earlier. Writes OUT with provenance.
`--shape tiny --device cpu` runs the same steps on a small model, to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TASK = "gpqa_diamond_cot_zeroshot"
WAYS = {"before", "eager", "compiled", "hf_compiled"}
DTYPE = {"cuda": "bfloat16", "cpu": "float32"}      # the model's dtype on each device


def write_questions(path: Path, n: int) -> None:
    """n made-up multiple-choice questions in GPQA's columns, of a few different lengths."""
    topics = ["a gas in a sealed vessel", "a protein folding step", "a planet's orbit",
              "an organic reaction", "a quantum harmonic oscillator", "a cell membrane"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                    "Incorrect Answer 3"])
        for i in range(n):
            detail = " It is measured twice, and the second reading is higher." * (i % 4)
            w.writerow([f"[SYNTHETIC TIMING ITEM, NOT FROM GPQA] Question {i}: what limits "
                        f"{topics[i % len(topics)]} as its temperature rises?{detail}",
                        f"the first answer {i}", f"the second answer {i}", f"the third answer {i}",
                        f"the fourth answer {i}"])


def save_model(folder: Path, shape: str, device: str) -> dict:
    """The shape's random model, saved with the tokenizer of tiny-qwen3.5 (4096 tokens; the
    model's vocabulary is at least as large)."""
    from replayquant.bench.kl import SHAPES, build_model
    vocab = max(SHAPES[shape]["vocab_size"], 4096)
    dtype = getattr(torch, DTYPE[device])
    model = build_model(shape, dtype, device, vocab_size=vocab)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "replayquant" / "assets" / "tiny-qwen3.5" / f, folder / f)
    del model
    return {"shape": shape, **SHAPES[shape], "vocab_size": vocab, "dtype": str(dtype),
            "tokenizer": "tiny-qwen3.5's (4096 tokens)"}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def child(way: str, model: str, csv_path: str, out: str, pair: str, batch_size: int, res: str,
          device: str):
    """One way, in this process: run_gpqa with every generate timed."""
    t_start = time.perf_counter()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    import replayquant.gpqa.lm_eval_model as lmm
    from replayquant.gpqa import GPQASettings, run_gpqa, write_task_dir
    from transformers.generation.utils import GenerationMixin
    batches, prefills = [], []
    cls = HFLM if way == "hf_compiled" else lmm.ReplayQuantLM
    orig, orig_prefill = cls._model_generate, GenerationMixin._prefill

    def timed_prefill(self, *a, **kw):
        _sync(device)
        t0 = time.perf_counter()
        out = orig_prefill(self, *a, **kw)
        _sync(device)
        prefills.append(time.perf_counter() - t0)
        return out

    def timed(self, context, max_length, stop, **kw):
        prefills.clear()
        _sync(device)
        t0 = time.perf_counter()
        out = orig(self, context, max_length, stop, **kw)
        _sync(device)
        s, new = time.perf_counter() - t0, int(out.shape[1] - context.shape[1])
        pre = sum(prefills)
        batches.append({"rows": int(context.shape[0]), "prompt": int(context.shape[1]),
                        "new_tokens": new, "s": s, "prefill_s": pre,
                        "decode_ms_per_step": 1e3 * (s - pre) / max(new - 1, 1)})
        return out

    cls._model_generate = timed
    GenerationMixin._prefill = timed_prefill
    dtype = DTYPE[device]
    t_run = time.perf_counter()
    if way == "hf_compiled":
        tasks = TaskManager(include_path=str(write_task_dir(csv_path, Path(out) / "_tasks", [TASK])))
        lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model},dtype={dtype}",
                                tasks=[TASK], task_manager=tasks, batch_size=batch_size, device=device,
                                gen_kwargs="cache_implementation=static")
    else:
        args = {"compile_generate": "false"} if way == "eager" else {}
        run_gpqa(model, [pair], GPQASettings(tasks=[TASK], gpqa_csv=csv_path, batch_size=batch_size,
                                             device=device, dtype=dtype, model_args=args), out=out)
    end = time.perf_counter()
    from torch._dynamo.utils import get_compilation_metrics
    frames = [{"frame": m.co_name, "guards": m.guard_count, "guard_latency_us": m.guard_latency_us,
               "graph_nodes": m.graph_node_count} for m in get_compilation_metrics()
              if m.guard_count is not None]
    Path(res).write_text(json.dumps({"batches": batches, "run_gpqa_s": end - t_run,
                                     "process_s": end - t_start, "compiled_frames": frames,
                                     "replayquant_from": str(Path(lmm.__file__).parent)}))


def summarise(r: dict, questions: int) -> dict:
    warm = r["batches"][1:]
    rows, s = sum(b["rows"] for b in warm), sum(b["s"] for b in warm)
    pre = sum(b["prefill_s"] for b in warm)
    steps = sum(b["new_tokens"] - 1 for b in warm)
    return {**r, "questions_per_min_run": 60 * questions / r["run_gpqa_s"],
            "prefill_s_after_first_batch": pre,
            "decode_ms_per_step_after_first_batch": 1e3 * (s - pre) / steps if steps else None,
            "questions_per_min_after_first_batch": 60 * rows / s if s else None,
            "ms_per_step_after_first_batch": 1e3 * s / sum(b["new_tokens"] for b in warm) if warm else None}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--before", default=None, help="an older tree's folder holding replayquant/")
    ap.add_argument("--before-commit", default=None)
    ap.add_argument("--pair", default="tp4_hi16_sr")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--shape", default="qwen3.5-4b", choices=["qwen3.5-4b", "tiny"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--ways", default=None,
                    help="the ways to run, comma-separated (default: before where --before is given, "
                         "eager, compiled, hf_compiled)")
    ap.add_argument("--timeout-s", type=int, default=240, help="the most one way may take")
    ap.add_argument("--child", nargs=5, metavar=("WAY", "MODEL", "CSV", "OUTDIR", "RESULT"))
    a = ap.parse_args(argv)
    if a.child:
        way, model, csv_path, out, res = a.child
        return child(way, model, csv_path, out, a.pair, a.batch_size, res, a.device)
    if not a.out:
        ap.error("give OUT.json")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpqa_cot_timing needs a CUDA device (or --shape tiny --device cpu)")
    from replayquant.gpqa.tasks import file_sha256
    from replayquant.outputs import write_json
    from replayquant.provenance import provenance
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "rq_gpqa_timing"
    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    t0 = time.perf_counter()
    shape = save_model(work / "model", a.shape, a.device)
    print(f"model saved in {time.perf_counter() - t0:.0f} s", flush=True)
    write_questions(work / "questions.csv", a.questions)
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    chosen = a.ways.split(",") if a.ways else \
        ["before"] * bool(a.before) + ["eager", "compiled", "hf_compiled"]
    if set(chosen) - WAYS:
        ap.error(f"unknown ways {sorted(set(chosen) - WAYS)}; choose from {', '.join(sorted(WAYS))}")
    if "before" in chosen and not a.before:
        ap.error("the way 'before' needs --before DIR")
    ways = [(w, a.before if w == "before" else str(ROOT)) for w in chosen]
    result = {"kind": "replayquant.eval.gpqa_cot_timing", "task": TASK, "pair": a.pair,
              "questions": a.questions, "batch_size": a.batch_size, "model": shape, "ways": {},
              "provenance": provenance(device=a.device, before_commit=a.before_commit,
                                       data="made-up questions (write_questions)",
                                       data_sha256=file_sha256(work / "questions.csv"))}
    for way, tree in ways:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(tree).resolve()), *site]),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        res = work / f"{way}.json"
        cmd = [sys.executable, __file__, "--child", way, str(work / "model"), str(work / "questions.csv"),
               str(work / f"out_{way}"), str(res), "--pair", a.pair, "--batch-size", str(a.batch_size),
               "--device", a.device]
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, timeout=a.timeout_s, capture_output=True, text=True)
            err = None if p.returncode == 0 else f"exit {p.returncode}: {p.stderr[-1500:]}"
        except subprocess.TimeoutExpired:
            err = f"over {a.timeout_s} s"
        wall = time.perf_counter() - t
        row = summarise(json.loads(res.read_text()), a.questions) if err is None else {"error": err}
        result["ways"][way] = {**row, "wall_s": wall}
        print(f"{way}: {json.dumps(result['ways'][way])[:1500]}", flush=True)
        write_json(a.out, result, indent=2)
    q = {w: r.get("questions_per_min_after_first_batch") for w, r in result["ways"].items()}
    if q.get("before") and q.get("compiled"):
        result["compiled_over_before"] = q["compiled"] / q["before"]
        result["targets"] = [{"name": "GPQA CoT questions per minute, compiled >= 10x before",
                              "measured": result["compiled_over_before"],
                              "met": result["compiled_over_before"] >= 10}]
    if q.get("hf_compiled") and q.get("compiled"):
        result["compiled_over_hf_compiled"] = q["compiled"] / q["hf_compiled"]
    write_json(a.out, result, indent=2)


if __name__ == "__main__":
    main()
