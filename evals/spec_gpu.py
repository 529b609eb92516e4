"""Tokens per second of prompt-lookup decoding against plain decode on the Qwen3.5-4B shape (GPU).

    python evals/spec_gpu.py OUT.json [--pairs s32_rs,tp4_hi16_sr] [--prompt-tokens 512]
        [--new-tokens 128] [--draft-tokens 4] [--paths eager,compiled] [--repeats 2]
    python evals/spec_gpu.py OUT.json --smoke-cpu      # a tiny model on the CPU, to try it

The model is `bench kl`'s Qwen3.5-4B shape (32 layers, random bf16 weights, all on the GPU), its
Gated DeltaNet decay gates set to long memory (`long_memory_gates`: each layer's heads' decay
rates spread log-uniformly over [1e-4, 1] per token). The prompt is `--prompt-tokens` tokens of a
held-out book (replayquant/data) in tiny-qwen3.5's tokenizer: one excerpt said four times, so
that prompt lookup finds n-grams to draft from. Batch 1 (HF's assisted generation decodes one
sequence). Per pair, generating exactly `--new-tokens` tokens greedily:

* `plain_eager`: plain decode on HF's dynamic cache (each patched layer's eager step replays its
  recorded CUDA graph);
* `plain_compiled`: plain decode on HF's static cache compiled with torch.compile
  (`cache_implementation="static"`, `CompileConfig()`: CUDA graphs), where `--paths` has compiled;
* `lookup_eager`: prompt lookup (`prompt_lookup_num_tokens=--draft-tokens`) on the dynamic cache.
  HF compiles no step of assisted generation, and the patched model refuses the static cache
  with it (`lookup_static`: the refusal, recorded before any forward), so this is the one path
  speculation runs: the compiled path's figures are plain decode's only.

Each way: one warm-up generate (which compiles the static path, at the timed runs' length), then
`--repeats` timed ones; the median of their decode rates. The decode rate is the new tokens after
the first forward (which holds the prompt) over the wall time from the end of that forward to the
last token, read where HF asks its stopping criteria once a step or round (synchronised there). On
the eager paths every forward of the target is timed on the GPU apart (CUDA events around it;
perf_counter on the CPU) with its token count T: `step_ms`, a plain decode forward of 1 token;
`verify_ms`, a verify forward of T > 1 tokens (the last accepted token and its drafts);
`verify_share`, the verify forwards' share of the decode wall time (the rest: 1-token rounds where
lookup found no n-gram, drafting, HF's acceptance and the cache's crop). Rounds and accepted drafts
are counted through HF's candidate generator (`replayquant.spec.counted_rounds`). The JSON at OUT
carries provenance (`replayquant.provenance`); a short table is printed last. With the defaults, an
estimated 200 s on an H100 (`bench generate`'s B = 1 figures: a patched eager step ~25 ms, a
compile ~55 s per pair). """

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replayquant.bench.kl import SHAPES, build_model  # noqa: E402
from replayquant.models import patch, recurrent_layers, unpatch  # noqa: E402
from replayquant.provenance import provenance  # noqa: E402
from replayquant.spec import counted_rounds  # noqa: E402

KIND = "replayquant-spec-gpu"
REPEATS_OF_EXCERPT = 4


def long_memory_gates(model, lo: float = 1e-4, hi: float = 1.0) -> list[list[float]]:
    """Set each Gated DeltaNet layer's A_log so that its heads' decay rates at zero input,
    exp(A_log) * softplus(dt_bias), spread log-uniformly over [lo, hi] per token (a state that
    remembers up to ~1 / lo tokens, as trained models' slowest heads do; random weights decay in
    a few tokens, which would hide the state's rounding). Returns the rates per layer."""
    rates = []
    with torch.no_grad():
        for _, mod, kind in recurrent_layers(model):
            if kind != "gdn":
                continue
            h = mod.A_log.numel()
            r = torch.logspace(math.log10(lo), math.log10(hi), h, dtype=torch.float64)
            sp = torch.nn.functional.softplus(mod.dt_bias.detach().double().cpu())
            mod.A_log.copy_(torch.log(r / sp).to(mod.A_log.dtype))
            rates.append([float(f"{x:.3g}") for x in r])
    return rates


def repeated_prompt(n: int) -> tuple[torch.Tensor, dict]:
    """n tokens (tiny-qwen3.5's tokenizer) of the first held-out book: an excerpt of n / 4 tokens
    from its middle, said four times; and the record of where they came from."""
    from transformers import AutoTokenizer

    from replayquant.data import heldout_documents, tiny_model_path
    tok = AutoTokenizer.from_pretrained(tiny_model_path("tiny-qwen3.5"))
    doc = heldout_documents()[0]
    ids = tok(doc["text"], add_special_tokens=False).input_ids
    piece = -(-n // REPEATS_OF_EXCERPT)
    start = max(0, len(ids) // 2 - piece // 2)
    excerpt = ids[start:start + piece]
    if len(excerpt) < piece:
        raise ValueError(f"held-out book {doc['id']} has {len(ids)} tokens, fewer than an excerpt "
                         f"of {piece}; give a smaller --prompt-tokens")
    prompt = (excerpt * REPEATS_OF_EXCERPT)[:n]
    return torch.tensor([prompt]), {"book": doc["id"], "excerpt_start_token": start,
                                    "excerpt_tokens": piece, "repeats": REPEATS_OF_EXCERPT,
                                    "tokenizer": "tiny-qwen3.5"}


class _Clock:
    """A stopping criterion that never stops: the wall time and sequence length at each of HF's
    checks (once a decode step or verify round), the device synchronised first."""

    def __init__(self, device: str):
        self.device, self.marks = device, []

    def __call__(self, input_ids, scores, **kwargs):
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.marks.append((time.perf_counter(), int(input_ids.shape[1])))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def decode_rate(self) -> float:
        """Tokens per second after the first check (the prompt's forward and first token)."""
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else float("nan")

    def decode_s(self) -> float:
        return self.marks[-1][0] - self.marks[0][0]


class _ForwardTimes:
    """Every forward of `model` while installed: (tokens T, milliseconds), timed by CUDA events
    on the GPU (read after the generate) or perf_counter on the CPU."""

    def __init__(self, model, device: str):
        self.device, self.pending, self.done = device, [], []
        self.handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                        model.register_forward_hook(self._post)]

    def _now(self):
        if self.device == "cuda":
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.pending.append([int(ids.shape[1]) if ids is not None else 0, self._now(), None])

    def _post(self, module, args, output):
        self.pending[-1][2] = self._now()

    def remove(self) -> list[tuple[int, float]]:
        for h in self.handles:
            h.remove()
        if self.device == "cuda":
            torch.cuda.synchronize()
            return [(t, a.elapsed_time(b)) for t, a, b in self.pending]
        return [(t, 1e3 * (b - a)) for t, a, b in self.pending]


def _generate(model, ids, n: int, device: str, static: bool, lookup: int | None,
              timed_forwards: bool) -> dict:
    """One generate of exactly n new tokens, measured (module docstring)."""
    from transformers import CompileConfig, StoppingCriteriaList
    clock, rounds = _Clock(device), []
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              stopping_criteria=StoppingCriteriaList([clock]))
    if static:
        kw.update(cache_implementation="static", compile_config=CompileConfig())
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    times = _ForwardTimes(model, device) if timed_forwards else None
    try:
        counting = counted_rounds(model, rounds) if lookup else contextlib.nullcontext()
        with torch.inference_mode(), counting:       # (the compiled path: the model untouched)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    finally:
        forwards = times.remove() if times else None
    rec = {"tokens": out.shape[1] - ids.shape[1], "decode_tok_s": clock.decode_rate(),
           "decode_s": clock.decode_s(), "checks": len(clock.marks)}
    if lookup:
        drafted = [(d, a) for d, a in rounds if d > 0]
        rec.update(rounds=len(rounds), rounds_with_drafts=len(drafted),
                   accepted=sum(a for _, a in rounds),
                   mean_accepted=(sum(a for _, a in drafted) / len(drafted)) if drafted else None)
    if forwards is not None:
        decode = forwards[1:]                         # after the prompt's forward
        one = [ms for t, ms in decode if t == 1]
        verify = [ms for t, ms in decode if t > 1]
        rec.update(forwards=len(forwards), prefill_ms=forwards[0][1],
                   tokens_per_forward=rec["tokens"] / len(forwards),
                   step_ms=statistics.mean(one) if one else None,
                   verify_ms=statistics.mean(verify) if verify else None,
                   verify_tokens=statistics.mean(t for t, _ in decode if t > 1) if verify else None,
                   verify_share=sum(verify) / (1e3 * rec["decode_s"]) if verify else None,
                   forward_share=sum(ms for _, ms in decode) / (1e3 * rec["decode_s"]))
    return rec


def _way(model, ids, args, device: str, static: bool, lookup: int | None) -> dict:
    """A warm-up generate, then `--repeats` timed ones: the median decode rate and the run
    nearest to it. The static path warms up at the full length: HF sizes the static cache by
    the prompt and new tokens, and a cache of another length would compile again in a timed
    run."""
    warm = args.new_tokens if static else min(8, args.new_tokens)
    _generate(model, ids, warm, device, static, lookup, False)
    runs = [_generate(model, ids, args.new_tokens, device, static, lookup, not static)
            for _ in range(args.repeats)]
    rates = [r["decode_tok_s"] for r in runs]
    mid = statistics.median(rates)
    best = min(runs, key=lambda r: abs(r["decode_tok_s"] - mid))
    return {**best, "decode_tok_s": mid, "decode_tok_s_runs": rates}


def _static_lookup_refusal(model, ids, draft_tokens: int) -> str | None:
    """The patched model's refusal of prompt lookup on the static cache (before any forward), or
    None where it ran."""
    try:
        _generate(model, ids, 2, "cpu", True, draft_tokens, False)
    except ValueError as e:
        return str(e).split(";")[0]
    return None


def run(args) -> dict:
    device = "cpu" if args.smoke_cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("spec_gpu: no CUDA GPU here; --smoke-cpu runs a tiny model on the CPU")
    shape = "tiny" if args.smoke_cpu else "qwen3.5-4b"
    dtype = torch.float32 if args.smoke_cpu else torch.bfloat16
    vocab = max(SHAPES[shape]["vocab_size"], 4096)        # tiny-qwen3.5's tokenizer: 4096 tokens
    t0 = time.perf_counter()
    model = build_model(shape, dtype, device, vocab_size=vocab)
    rates = long_memory_gates(model)
    ids, source = repeated_prompt(args.prompt_tokens)
    ids = ids.to(device)
    compiled = "compiled" in args.paths
    results, refusal = {}, None
    for name in args.pairs:
        patch(model, name)
        try:
            row = {}
            if "eager" in args.paths:
                row["plain_eager"] = _way(model, ids, args, device, False, None)
            if compiled:
                torch._dynamo.reset()
                row["plain_compiled"] = _way(model, ids, args, device, True, None)
            row["lookup_eager"] = _way(model, ids, args, device, False, args.draft_tokens)
            if refusal is None:
                refusal = _static_lookup_refusal(model, ids, args.draft_tokens)
            for key in ("plain_eager", "plain_compiled"):
                if key in row:
                    row["lookup_eager"][f"speedup_vs_{key}"] = (
                        row["lookup_eager"]["decode_tok_s"] / row[key]["decode_tok_s"])
            results[name] = row
        finally:
            unpatch(model)
        print(f"[spec_gpu] {name} done at {time.perf_counter() - t0:.0f} s", flush=True)
    config = {"shape": shape, "model_config": SHAPES[shape], "vocab_size": vocab,
              "dtype": str(dtype), "device": device, "batch": 1, "pairs": args.pairs,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "draft_tokens": args.draft_tokens, "paths": args.paths, "repeats": args.repeats,
              "prompt": source,
              "gdn_decay_rates": {"lo": 1e-4, "hi": 1.0, "layers": len(rates),
                                  "spread": "log-uniform over each layer's heads"},
              "compiled_on_this_device": compiled and device == "cuda"}
    res = {"kind": KIND, "config": config,
           "provenance": provenance(device=device, torch_threads=torch.get_num_threads()),
           "lookup_static": {"runs": refusal is None, "refusal": refusal},
           "results": results, "wall_s": time.perf_counter() - t0}
    return res


def table(res: dict) -> str:
    """One line per pair and way, at most 80 columns."""
    head = (f"{'pair':<12} {'way':<14} {'tok/s':>6} {'x eager':>7} {'acc/rd':>6} {'tok/fw':>6} "
            f"{'step ms':>7} {'verify':>7} {'v.share':>7}")
    lines = [head, "-" * len(head)]

    def f(x, spec, w):
        return ("-" if x is None or (isinstance(x, float) and math.isnan(x))
                else format(x, spec)).rjust(w)

    for pair, row in res["results"].items():
        base = row.get("plain_eager", {}).get("decode_tok_s")
        for way, r in row.items():
            x = r["decode_tok_s"] / base if base else None
            lines.append(" ".join([pair[:12].ljust(12), way.ljust(14),
                                   f(r["decode_tok_s"], ".1f", 6), f(x, ".2f", 7),
                                   f(r.get("mean_accepted"), ".2f", 6),
                                   f(r.get("tokens_per_forward"), ".2f", 6),
                                   f(r.get("step_ms"), ".2f", 7), f(r.get("verify_ms"), ".2f", 7),
                                   f(r.get("verify_share"), ".2f", 7)]))
    st = res["lookup_static"]
    lines.append("lookup on the static cache: " + ("ran" if st["runs"] else "refused (eager only)"))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="results JSON")
    p.add_argument("--pairs", default="s32_rs,tp4_hi16_sr", help="comma-separated pair names")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--paths", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--repeats", type=int, default=2, help="timed generates per way")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="a tiny model on the CPU (64-token prompt, 16 new tokens)")
    a = p.parse_args(argv)
    a.pairs = [x.strip() for x in a.pairs.split(",") if x.strip()]
    a.paths = [x.strip() for x in a.paths.split(",") if x.strip()]
    bad = [x for x in a.paths if x not in ("eager", "compiled")]
    if bad or not a.paths:
        p.error(f"--paths {','.join(a.paths)}: give eager, compiled or eager,compiled")
    for name in ("prompt_tokens", "new_tokens", "draft_tokens", "repeats"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.smoke_cpu:
        a.prompt_tokens, a.new_tokens = min(a.prompt_tokens, 64), min(a.new_tokens, 16)
    from replayquant.policy import resolve_pair
    for name in a.pairs:
        try:
            L = resolve_pair(name).buffer_len
        except ValueError as e:
            p.error(str(e))
        if L < a.draft_tokens:
            p.error(f"--draft-tokens {a.draft_tokens} is more than pair {name}'s L = {L}")
    return a


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out)
    if out.suffix != ".json" or out.is_dir():
        raise SystemExit(f"spec_gpu: {out}: give a results file ending in .json")
    out.parent.mkdir(parents=True, exist_ok=True)
    res = run(args)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {out} ({res['wall_s']:.0f} s)")
    print(table(res))


if __name__ == "__main__":
    main()
