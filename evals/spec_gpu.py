"""Tokens per second of speculative decoding against plain decode on the Qwen3.5-4B shape (GPU):
what speculation costs and, with oracle drafts, the most it buys on this path.

    python evals/spec_gpu.py OUT.json [--pairs s32_rs,tp4_hi16_sr] [--prompt-tokens 512]
        [--new-tokens 96] [--draft-tokens 4] [--paths eager,compiled] [--repeats 3]
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
* `oracle_eager`: HF's assisted generation on the dynamic cache whose drafts are the pair's own
  plain greedy tokens (the first, untimed plain generate's), `--draft-tokens` a round
  (`replayquant.spec.replayed_drafts` in place of prompt lookup's, through `counted_rounds`):
  every draft is right where the pair's verify forward is exact (`agree_plain`: its tokens
  against plain decode's; `acceptance` 1), so its rate is the ceiling of speculation here;
* `lookup_eager`: prompt lookup (`prompt_lookup_num_tokens=--draft-tokens`) on the dynamic cache:
  its acceptance is what a real prompt lookup gets on this model, and that is honest but near 0:
  a random-weight model's greedy continuation does not repeat the prompt, so lookup seldom finds
  an n-gram to draft from, and its rate is plain decode's on the assisted loop.
HF compiles no step of assisted generation, and the patched model refuses the static cache with
it (`lookup_static`: the refusal, recorded before any forward), so speculation runs eager only:
the compiled path's figures are plain decode's.

Warm-ups meet every shape the timed runs meet: per pair a plain eager generate of the timed
length (the step's kernels, the flush at each window's end, the CUDA graphs), the static path's
own generate of that length (its compile), and one assisted generate of that length whose
drafts mix right and wrong ones (`replayed_drafts(mix=True)`: every verify length T = 1 ..
draft_tokens + 1 and every acceptance of it, the first round's prompt with draft_tokens drafts).
Each timed run counts the compiles that happened in it (new specializations in the caches of
replayquant's Triton kernels, torch.compile's graphs: `compiles()`); `compiles_in_timed_runs`
(per way and in all) should be 0. Then `--repeats` timed generates per way (3 at least for a
median): the median decode rate, the run nearest to it, and every run (`runs`). The decode rate
is the new tokens after the first forward (which holds the prompt) over the wall time from the
end of that forward to the last token, read where HF asks its stopping criteria once a step or
round (synchronised there). Every forward of the target is timed on the GPU apart (CUDA events
around it; perf_counter on the CPU) with its token count T: `step_ms`, a 1-token decode forward;
`verify_ms` (and `verify_ms_by_t`), a verify forward of T > 1 tokens (the last accepted token and
its drafts); `verify_share`, the verify forwards' share of the decode wall time (the rest:
1-token rounds, drafting, HF's acceptance and the cache's crop). Rounds, drafts and accepted
drafts are counted through HF's candidate generator (`replayquant.spec.counted_rounds`).
`break_even`: the accepted drafts a round at which speculation decodes as fast as plain eager
decode: from the forwards, verify_ms at T / plain eager's step_ms - 1 (per T, and at T =
draft_tokens + 1), and from the oracle's wall time a round against plain eager's a token.

The JSON at OUT carries provenance (`replayquant.provenance`); a short table is printed last.
The record is written after every way that finishes (a run cut short keeps what it measured),
with a progress line for each. Time: on one H100 the s32_rs pair alone took 214 s at
`--new-tokens 64` with both paths (the warm-ups' Triton compiles of each verify length and the
static path's compile most of it), so give each 10-minute device call one pair
(`--pairs s32_rs`, then `--pairs tp4_hi16_sr`). """

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
from replayquant.spec import agreement, counted_rounds, replayed_drafts  # noqa: E402

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


def compiles() -> int:
    """Compiles so far in this process: the specializations in the cache of every Triton kernel
    of replayquant's modules (a new one is a compile) and torch.compile's graphs (dynamo's
    unique_graphs)."""
    n = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return n
    seen = set()
    for mod in [m for k, m in list(sys.modules.items()) if k.startswith("replayquant")]:
        for f in list(vars(mod).values()):
            while not isinstance(f, JITFunction) and hasattr(f, "fn"):   # autotuner, heuristics
                f = f.fn
            if isinstance(f, JITFunction) and id(f) not in seen:
                seen.add(id(f))
                n += sum(len(c[0]) for c in f.device_caches.values())
    return n


def _generate(model, ids, n: int, device: str, static: bool, lookup: int | None,
              timed_forwards: bool, propose=None) -> dict:
    """One generate of exactly n new tokens, measured (module docstring); `propose`: the drafts
    that replace prompt lookup's (`replayed_drafts`)."""
    from transformers import CompileConfig, StoppingCriteriaList
    clock, rounds = _Clock(device), []
    before = compiles()
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              stopping_criteria=StoppingCriteriaList([clock]))
    if static:
        kw.update(cache_implementation="static", compile_config=CompileConfig())
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    times = _ForwardTimes(model, device) if timed_forwards else None
    try:
        counting = (counted_rounds(model, rounds, propose) if lookup
                    else contextlib.nullcontext())
        with torch.inference_mode(), counting:       # (the compiled path: the model untouched)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    finally:
        forwards = times.remove() if times else None
    rec = {"tokens": out.shape[1] - ids.shape[1], "decode_tok_s": clock.decode_rate(),
           "decode_s": clock.decode_s(), "checks": len(clock.marks),
           "compiles": compiles() - before, "new": out[0, ids.shape[1]:].tolist()}
    if lookup:
        drafted = [(d, a) for d, a in rounds if d > 0]
        rec.update(rounds=len(rounds), rounds_with_drafts=len(drafted),
                   drafted=sum(d for d, _ in rounds), accepted=sum(a for _, a in rounds),
                   acceptance=(sum(a for _, a in rounds) / sum(d for d, _ in rounds)
                               if drafted else None),
                   mean_accepted=(sum(a for _, a in drafted) / len(drafted)) if drafted else None)
    if forwards is not None:
        decode = forwards[1:]                         # after the prompt's forward
        one = [ms for t, ms in decode if t == 1]
        verify = [ms for t, ms in decode if t > 1]
        rec.update(forwards=len(forwards), prefill_ms=forwards[0][1],
                   tokens_per_forward=rec["tokens"] / len(forwards),
                   step_ms=statistics.mean(one) if one else None,
                   verify_ms=statistics.mean(verify) if verify else None,
                   verify_ms_by_t={t: statistics.mean(ms for u, ms in decode if u == t)
                                   for t in sorted({t for t, _ in decode if t > 1})},
                   verify_tokens=statistics.mean(t for t, _ in decode if t > 1) if verify else None,
                   verify_share=sum(verify) / (1e3 * rec["decode_s"]) if verify else None,
                   forward_share=sum(ms for _, ms in decode) / (1e3 * rec["decode_s"]))
    return rec


def _way(model, ids, args, device: str, static: bool, lookup: int | None, warm: bool,
         propose=None, plain: list[int] | None = None) -> dict:
    """`--repeats` timed generates (after a warm-up generate of the same length where `warm`):
    the median decode rate, the run nearest to it, every run, and the compiles that happened in
    the timed runs (0 where the warm-ups met every shape). `propose()` makes each run's drafts;
    `plain`: the pair's plain greedy tokens, to count agreement with."""
    if warm:
        _generate(model, ids, args.new_tokens, device, static, lookup, False,
                  propose() if propose else None)
    runs = [_generate(model, ids, args.new_tokens, device, static, lookup, not static,
                      propose() if propose else None) for _ in range(args.repeats)]
    for r in runs:
        new = r.pop("new")
        if plain is not None:
            r["agree_plain"] = list(agreement(new, plain))
    rates = [r["decode_tok_s"] for r in runs]
    mid = statistics.median(rates)
    best = min(runs, key=lambda r: abs(r["decode_tok_s"] - mid))
    return {**best, "decode_tok_s": mid, "decode_tok_s_runs": rates,
            "compiles_in_timed_runs": sum(r["compiles"] for r in runs), "runs": runs}


def break_even(row: dict, drafts: int) -> dict:
    """The accepted drafts per round at which speculation's decode equals plain eager decode's:
    from the forwards (a round of T tokens costs its verify forward, verify_ms at T, against
    plain decode's step_ms a token: T - 1 drafts pay off at verify_ms / step_ms - 1 accepted),
    per T the oracle or lookup measured, and from the oracle's wall time per round (HF's
    drafting, acceptance and crop included) against plain eager's wall time per token."""
    step = row["plain_eager"]["step_ms"]
    by_t = {**row["lookup_eager"].get("verify_ms_by_t", {}),
            **row["oracle_eager"].get("verify_ms_by_t", {})}
    o = row["oracle_eager"]
    plain_ms = 1e3 / row["plain_eager"]["decode_tok_s"]
    oracle_round_ms = 1e3 * o["decode_s"] / (o["rounds"] - 1) if o["rounds"] > 1 else None
    return {"by_t": {t: ms / step - 1 for t, ms in sorted(by_t.items())},
            "at_full_drafts": by_t[drafts + 1] / step - 1 if drafts + 1 in by_t else None,
            "wall_at_oracle_rounds": oracle_round_ms / plain_ms - 1 if oracle_round_ms else None,
            "plain_step_ms": step, "oracle_round_ms": oracle_round_ms}


def _static_lookup_refusal(model, ids, draft_tokens: int) -> str | None:
    """The patched model's refusal of prompt lookup on the static cache (before any forward), or
    None where it ran."""
    try:
        _generate(model, ids, 2, "cpu", True, draft_tokens, False)
    except ValueError as e:
        return str(e).split(";")[0]
    return None


def run(args, save=None) -> dict:
    """The results record; save(record), where given, after every way that finished (a run
    cut short keeps what it measured)."""
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
    D = args.draft_tokens
    rec = lambda: _record(args, shape, vocab, dtype, device, source, rates, compiled,  # noqa: E731
                          results, refusal, t0)

    def done(name, what):
        print(f"[spec_gpu] {name}: {what} at {time.perf_counter() - t0:.0f} s", flush=True)
        if save is not None:
            save(rec())

    for name in args.pairs:
        patch(model, name)
        try:
            # the first generate: plain eager decode's warm-up, and the oracle's drafts
            plain = _generate(model, ids, args.new_tokens, device, False, None, False)["new"]
            row = results[name] = {}
            done(name, "warm-up")
            if "eager" in args.paths:
                row["plain_eager"] = _way(model, ids, args, device, False, None, False)
                done(name, "plain_eager")
            if compiled:
                torch._dynamo.reset()
                row["plain_compiled"] = _way(model, ids, args, device, True, None, True)
                done(name, "plain_compiled")
            # every verify length 1 .. D + 1 and acceptance of it, before any timed speculation
            _generate(model, ids, args.new_tokens, device, False, D, False,
                      replayed_drafts(plain, ids.shape[1], D, vocab, mix=True))
            done(name, "speculation's warm-up")
            row["oracle_eager"] = _way(model, ids, args, device, False, D, False, plain=plain,
                                       propose=lambda: replayed_drafts(plain, ids.shape[1], D,
                                                                       vocab))
            done(name, "oracle_eager")
            row["lookup_eager"] = _way(model, ids, args, device, False, D, False, plain=plain)
            if refusal is None:
                refusal = _static_lookup_refusal(model, ids, D)
            for way in ("oracle_eager", "lookup_eager"):
                for key in ("plain_eager", "plain_compiled"):
                    if key in row:
                        row[way][f"speedup_vs_{key}"] = (row[way]["decode_tok_s"]
                                                         / row[key]["decode_tok_s"])
            if "plain_eager" in row:
                row["break_even"] = break_even(row, D)
        finally:
            unpatch(model)
        done(name, "lookup_eager, pair done")
    return rec()


def _record(args, shape, vocab, dtype, device, source, rates, compiled, results, refusal,
            t0) -> dict:
    """The results record of what `run` measured so far."""
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
           "results": results,
           "compiles_in_timed_runs": sum(w.get("compiles_in_timed_runs", 0)
                                         for row in results.values() for w in row.values()),
           "wall_s": time.perf_counter() - t0}
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
        for way, r in ((w, r) for w, r in row.items() if w != "break_even"):
            x = r["decode_tok_s"] / base if base else None
            lines.append(" ".join([pair[:12].ljust(12), way.ljust(14),
                                   f(r["decode_tok_s"], ".1f", 6), f(x, ".2f", 7),
                                   f(r.get("mean_accepted"), ".2f", 6),
                                   f(r.get("tokens_per_forward"), ".2f", 6),
                                   f(r.get("step_ms"), ".2f", 7), f(r.get("verify_ms"), ".2f", 7),
                                   f(r.get("verify_share"), ".2f", 7)]))
    d = res["config"]["draft_tokens"]
    lines.append(f"break-even: accepted drafts a round (of {d}) at plain eager's tok/s")
    for pair, row in res["results"].items():
        be = row.get("break_even")
        if be:
            lines.append(f"  {pair[:12]:<12} from forwards (T = {d + 1}) "
                         f"{f(be['at_full_drafts'], '.2f', 5)}, from the oracle's wall "
                         f"{f(be['wall_at_oracle_rounds'], '.2f', 5)}")
    lines.append(f"compiles in timed runs: {res['compiles_in_timed_runs']}")
    st = res["lookup_static"]
    lines.append("lookup on the static cache: " + ("ran" if st["runs"] else "refused (eager only)"))
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="results JSON")
    p.add_argument("--pairs", default="s32_rs,tp4_hi16_sr", help="comma-separated pair names")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--draft-tokens", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--paths", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--repeats", type=int, default=3, help="timed generates per way")
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

    def save(rec):
        out.write_text(json.dumps(rec, indent=1, default=str) + "\n")

    res = run(args, save)
    save(res)
    print(f"wrote {out} ({res['wall_s']:.0f} s)")
    print(table(res))


if __name__ == "__main__":
    main()
