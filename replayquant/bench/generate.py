"""`replayquant bench generate` (GPU, not in CI): what a user of `generate` waits per token.

The Qwen3.5-4B-shape model of `bench kl` (random weights, bf16, all 32 layers) generates greedily
from random prompts at each batch size, four ways: Hugging Face unpatched and eager
(DynamicCache), Hugging Face unpatched with its static cache compiled
(`cache_implementation="static"`, `compile_config`: CUDA graphs), and patched with each pair, eager
and static + compiled (the same compile config). Per way and batch:

* `ms_per_step`: wall time of a decode step, the median of the intervals between successive
  decode steps of 5 generates of n2 tokens after a warm-up generate (which compiles), read on
  the host where HF's generate asks its stopping criteria once a step (`_StepClock`; HF reads the
  host there every step, so host and GPU go in step); the prompt and the first decode step are
  not among them. `ms_per_step_p10_p90` gives their 10th and 90th percentiles and
  `ms_per_step_mean` their mean, which the host's stalls raise: a host-bound step is at the mercy
  of a shared machine (HF's eager step at B = 32 took 39.0 and 55.6 ms in two calls on H100
  machines), and the median of a step's own intervals moves less than the difference of two
  generates' times did (a compiled patched step at B = 32 spread from 0.53 to 17.2 ms over 5
  such differences, its median 11.6);
* `gpu_busy_ms_per_step`: the GPU kernels' time in a decode step (torch.profiler, the same
  difference of two generates), and `launches_per_step`, the kernels it counted;
* `host_syncs_per_step` (eager ways): host synchronisations of one decode forward after the
  first (replayquant.hostsync; HF's generate adds its own stopping check per step, not counted),
  and `sync_debug_ok`: whether that forward ran under torch.cuda.set_sync_debug_mode("error");
* static ways: `logits_max_abs_diff_first_steps`, the largest difference of the next-token
  logits from the same model's eager generate at the prompt's step and the first decode step
  (the first compiled one; both read the same tokens there), `tokens_equal_eager` and, where the
  greedy tokens differ, `first_token_differing` and `eager_top2_margin_at_first_difference`
  (beside `eager_top2_margin_median`: HF's own pair tells how often Inductor's fused arithmetic
  alone flips a near-tied argmax of random weights), and `while_timed`, graphs compiled, graph
  breaks and CUDA-graph skips during the timed generates (all 0 where the timing is of replayed
  CUDA graphs).

The eager ways of a batch are timed side by side, their generates in turns, so that the host's
drift over a batch's minutes falls on each alike; the static ways one after the other, since each
compiles its own graphs (`torch._dynamo.reset()` between them).

The ratios the targets need are formed within the run; `targets` lists each with its measure,
whether it is met and, where HF unpatched has the same measure, HF's (`unpatched`). Writes one
JSON file with provenance.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile
from transformers import (CompileConfig, DynamicCache, LogitsProcessor, LogitsProcessorList,
                          StoppingCriteria, StoppingCriteriaList)

from replayquant.bench.timing import fla_version
from replayquant.hostsync import HostSyncCounter
from replayquant.bench.kl import SHAPES, build_model
from replayquant.kl.lockstep import cache_kwarg
from replayquant.models import patch, unpatch
from replayquant.outputs import check_owned, output_lock, write_json
from replayquant.provenance import git_commit, provenance

__all__ = ["run_generate_bench", "GenerateSettings", "merge_generate", "WAYS"]

WAYS = ("hf_eager", "hf_static", "patched_eager", "patched_static")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate(model, ids, n: int, static: bool, compile_config, clock=None, seen=None):
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if clock is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([clock])
    if seen is not None:
        kw["logits_processor"] = LogitsProcessorList([seen])
    if static:
        kw.update(cache_implementation="static", compile_config=compile_config)
    with torch.inference_mode():
        return model.generate(ids, **kw)


def _profiled(fn) -> tuple[float | None, int | None]:
    """(GPU kernel milliseconds, kernel count) of fn(); (None, None) without a GPU."""
    if not torch.cuda.is_available():
        fn()
        return None, None
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync()
    us, n = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us += e.device_time
            n += 1
    return us / 1e3, n


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float | None:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9), median of 10."""
    if not torch.cuda.is_available():
        return None
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * nbytes / sorted(ts[2:])[len(ts[2:]) // 2] / 1e9


def _decode_forward_syncs(model, ids) -> tuple[int, bool]:
    """Host syncs of one eager decode forward after the prompt and a first decode step, and
    whether that forward runs under sync debug mode 'error'."""
    kw = cache_kwarg(model)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        tok = model(ids, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        tok = model(tok, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        _sync()
        with HostSyncCounter() as c:
            tok = model(tok, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        _sync()
        if not torch.cuda.is_available():
            return c.syncs, None
        ok = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(tok, **{kw: cache}, use_cache=True)
        except RuntimeError:
            ok = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _sync()
    return c.syncs, ok


def _compile_counters() -> dict:
    """torch.compile's counters that say whether a timed generate compiled or left CUDA graphs:
    graphs compiled, graph breaks, CUDA-graph skips (each skip's reason is logged by Inductor;
    TORCH_LOGS=cudagraphs,recompiles prints them)."""
    return {"graphs_compiled": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


class _StepClock(StoppingCriteria):
    """A stopping criterion that stops nothing and notes the host's time at each call: HF's
    generate asks its stopping criteria once a step, after the step's token is chosen."""

    def __init__(self):
        self.t: list[float] = []
        self._never = None

    def __call__(self, input_ids, scores, **kwargs):
        self.t.append(time.perf_counter())
        if self._never is None or self._never.shape[0] != input_ids.shape[0]:
            self._never = torch.zeros(input_ids.shape[0], dtype=torch.bool,
                                      device=input_ids.device)
        return self._never

    def decode_intervals(self) -> list[float]:
        """Seconds between successive decode steps, from the second decode step on (t[0]
        follows the prompt, t[1] the first decode step)."""
        return [b - a for a, b in zip(self.t[1:], self.t[2:])]


class _LogitsSeen(LogitsProcessor):
    """A logits processor that changes nothing and notes, at each step, each row's margin between
    its two largest next-token logits, and keeps the first two steps' logits whole (the prompt's
    and the first decode step's: the steps where a compiled and an eager generate still read the
    same tokens)."""

    def __init__(self):
        self.margins: list[torch.Tensor] = []
        self.first: list[torch.Tensor] = []

    def __call__(self, input_ids, scores):
        x = scores.float()
        top = x.topk(2, dim=-1).values
        self.margins.append(top[:, 0] - top[:, 1])
        if len(self.first) < 2:
            self.first.append(x.clone())
        return scores


def _warm(model, ids, static: bool, compile_config, n1: int, n2: int) -> None:
    # the longer generate first: HF sizes a static cache for the longest generate so far
    # (GenerationMixin._prepare_static_cache), so that the timed ones reuse its shapes and
    # compile nothing (a shorter warm-up put a recompile into the timed n2 generate)
    _generate(model, ids, n2, static, compile_config)
    _generate(model, ids, n1, static, compile_config)


def _timed(model, ids, static: bool, compile_config, n2: int) -> list[float]:
    """The decode-step intervals (seconds) of one generate of n2 tokens."""
    clock = _StepClock()
    _sync()
    _generate(model, ids, n2, static, compile_config, clock)
    _sync()
    return clock.decode_intervals()


def _step_times(steps: list[float], n2: int) -> dict:
    if not steps:
        raise ValueError(f"bench generate: {n2} new tokens leave no decode step to time "
                         f"(the first two are not timed); give n2 >= 3")
    ms = torch.tensor(steps, dtype=torch.float64) * 1e3
    return {"ms_per_step": float(ms.median()),
            "ms_per_step_p10_p90": [float(ms.quantile(0.1)), float(ms.quantile(0.9))],
            "ms_per_step_mean": float(ms.mean()), "intervals_timed": len(steps)}


def _untimed(model, ids, static: bool, compile_config, n1: int, n2: int,
             eager_syncs: bool) -> dict:
    """What a way's timing does not hold: GPU busy time and launches a step (the profiler over
    generates of n1 and n2 tokens), its greedy tokens and the logits they came from (a generate
    with `_LogitsSeen`, kept under "tokens" and "seen" for the comparison of ways), and for eager
    ways the host syncs of a decode forward."""
    g1, k1 = _profiled(lambda: _generate(model, ids, n1, static, compile_config))
    g2, k2 = _profiled(lambda: _generate(model, ids, n2, static, compile_config))
    seen = _LogitsSeen()
    tokens = _generate(model, ids, n2, static, compile_config, seen=seen)
    n = n2 - n1
    row = {"tokens": tokens[:, ids.shape[1]:], "seen": seen,
           "gpu_busy_ms_per_step": None if g1 is None else (g2 - g1) / n,
           "launches_per_step": None if k1 is None else (k2 - k1) / n}
    if eager_syncs:
        row["host_syncs_per_step"], row["sync_debug_ok"] = _decode_forward_syncs(model, ids)
    return row


def _measure(model, ids, static: bool, compile_config, n1: int, n2: int, eager_syncs: bool,
             repeats: int = 5):
    """One way on its own: warm-up, `repeats` timed generates, then `_untimed`; a static way also
    says what compiled during its timed generates (0 each, or the timing holds a compile)."""
    _warm(model, ids, static, compile_config, n1, n2)
    before = _compile_counters()
    steps = []
    for _ in range(repeats):
        steps += _timed(model, ids, static, compile_config, n2)
    row = _step_times(steps, n2)
    after = _compile_counters()
    row |= _untimed(model, ids, static, compile_config, n1, n2, eager_syncs)
    if static:
        row["while_timed"] = {k: after[k] - before[k] for k in after}
    return row


def _in_turns(model, ids, plan, n1: int, n2: int, rows: dict, key, repeats: int = 5) -> None:
    """The eager ways of `plan` ((way, pair) each) measured side by side: each warmed up, then
    their timed generates in turns (way 1, way 2, ..., way 1, ...), so that the host's drift over
    the minutes of a batch falls on every way alike (one H100 machine's HF eager step at B = 32
    took 39.0 and 55.6 ms in two calls, and a patched one moved from 0.65x to 0.87x of HF's
    between two runs where the ways ran one after the other). A way that fails is reported as
    its row's error and leaves the turns."""
    steps, wall = {}, {}

    def attempt(w, p, fn):
        k = key(w, p)
        t0 = time.perf_counter()
        try:
            with _way(model, p):
                return fn()
        except Exception as e:          # a way that fails is reported, the others still run
            rows[k] = _error_row(e)
            steps.pop(k, None)
        finally:
            wall[k] = wall.get(k, 0.0) + time.perf_counter() - t0

    for w, p in plan:
        steps[key(w, p)] = []
        attempt(w, p, lambda: _warm(model, ids, False, None, n1, n2))
    for _ in range(repeats):
        for w, p in plan:
            if key(w, p) in steps:
                got = attempt(w, p, lambda: _timed(model, ids, False, None, n2))
                if got is not None:
                    steps[key(w, p)] += got
    for w, p in plan:
        k = key(w, p)
        if k in steps:
            row = attempt(w, p, lambda: _step_times(steps[k], n2)
                          | _untimed(model, ids, False, None, n1, n2, eager_syncs=True))
            if row is not None:
                rows[k] = row
        rows[k]["wall_s"] = wall[k]


def _error_row(e: Exception) -> dict:
    """The row of a way that failed: its error, named and cut to 400 characters."""
    return {"error": f"{type(e).__name__}: {str(e)[:400]}"}


class _way:
    """The model as `pair` patches it for the block (None: unpatched)."""

    def __init__(self, model, pair):
        self.model, self.pair = model, pair

    def __enter__(self):
        if self.pair is not None:
            patch(self.model, self.pair)

    def __exit__(self, *exc):
        if self.pair is not None:
            unpatch(self.model)


def _against_eager(toks, seen: _LogitsSeen, etoks, eseen: _LogitsSeen) -> dict:
    """A compiled way's greedy tokens and logits against its eager way's: whether the tokens are
    equal, the first step where they differ, the largest logit difference at each of the first
    two steps over the rows whose tokens before it are equal (the same inputs: the first decode
    step is the first compiled one), the eager margin between the two largest logits where each
    row first differs (its largest over such rows: every flip was a near-tie at most this wide)
    and the median eager margin (for scale)."""
    same = toks == etoks
    out = {"tokens_equal_eager": bool(same.all()),
           "first_token_differing": None if same.all() else int((~same).any(0).nonzero()[0])}
    diffs = []
    for t in range(min(2, len(seen.first), len(eseen.first))):
        keep = same[:, :t].all(1)
        diffs.append(float((seen.first[t][keep] - eseen.first[t][keep]).abs().max())
                     if keep.any() else None)
    out["logits_max_abs_diff_first_steps"] = diffs
    margins = torch.stack(eseen.margins, 1)                 # [B, steps]
    out["eager_top2_margin_median"] = float(margins.median())
    bad = (~same).any(1)
    if bad.any():
        first = (~same).int().argmax(1)
        out["eager_top2_margin_at_first_difference"] = float(
            margins[bad, first[bad]].max())
    return out


def _targets(rows: dict, pairs, batches) -> list[dict]:
    """Each target with its measure and whether it is met; where HF unpatched has the same
    measure in the run (its compiled logits against its eager ones, its compiled wall time over
    its own GPU busy time), `unpatched` gives it: what the static-cache generate itself attains
    on this model and host.

    The compiled generate's correctness is judged by its logits at the first compiled step (the
    first decode step: the prompt's tokens and the first token are the same for both), not by
    its greedy tokens: on random weights the two largest of 248320 logits are often closer than
    the difference Inductor's fused arithmetic makes, and HF's own compiled generate differs
    from its eager one within 1-5 tokens (two H100 calls, B = 1 and 32). The patched compiled
    step runs the same replay operator as the eager one; what differs is Inductor's code around
    it, as for HF, so its difference is held to twice HF's. The greedy tokens stay in each row
    (`tokens_equal_eager`, with the eager margin where they first differ); on the embedded models,
    whose logits are not near-tied, evals/compiled_generate_check.py requires them equal."""
    out = []

    def get(way, b, key):
        return rows.get(f"{way}@B{b}", {}).get(key)

    for pair in pairs:
        for b in batches:
            d = (get(f"patched_static:{pair}", b, "logits_max_abs_diff_first_steps") or [])[1:]
            hd = (get("hf_static", b, "logits_max_abs_diff_first_steps") or [])[1:]
            if d and hd and d[0] is not None and hd[0] is not None:
                out.append({"name": f"{pair} static+compile logits of the first compiled step "
                                    f"against patched eager, largest difference, B = {b} "
                                    f"(<= 2x HF's own)",
                            "measured": d[0], "met": d[0] <= 2 * hd[0], "unpatched": hd[0]})
            ps, hs = get(f"patched_static:{pair}", b, "ms_per_step"), get("hf_static", b, "ms_per_step")
            lim = 1.0 if b >= 256 else 1.1
            if ps is not None and hs is not None:
                out.append({"name": f"{pair} static+compile vs HF static+compile, B = {b} (<= {lim}x)",
                            "measured": ps / hs, "met": ps / hs <= lim})
            busy = get(f"patched_static:{pair}", b, "gpu_busy_ms_per_step")
            hbusy = get("hf_static", b, "gpu_busy_ms_per_step")
            if ps is not None and busy:
                out.append({"name": f"{pair} static+compile wall / its GPU busy time, B = {b} (<= 1.3x)",
                            "measured": ps / busy, "met": ps / busy <= 1.3,
                            "unpatched": hs / hbusy if hs is not None and hbusy else None})
            pe, he = get(f"patched_eager:{pair}", b, "ms_per_step"), get("hf_eager", b, "ms_per_step")
            if pe is not None and he is not None:
                out.append({"name": f"{pair} eager vs HF eager, B = {b} (<= 0.8x)",
                            "measured": pe / he, "met": pe / he <= 0.8})
            pl, hl = (get(f"patched_eager:{pair}", b, "launches_per_step"),
                      get("hf_eager", b, "launches_per_step"))
            if pl is not None and hl:
                out.append({"name": f"{pair} eager launches vs HF eager's, B = {b} (<= 1.15x)",
                            "measured": pl / hl, "met": pl / hl <= 1.15})
            sy = get(f"patched_eager:{pair}", b, "host_syncs_per_step")
            if sy is not None:
                out.append({"name": f"{pair} host syncs in a decode forward, B = {b} (0)",
                            "measured": sy, "met": sy == 0})
    return out


GENERATE_KIND = "replayquant.bench.generate"   # the "kind" of the results file


@dataclass(frozen=True)
class GenerateSettings:
    """What one `bench generate` call measures (defaults: the command's): the model `shape`
    (random weights), its batches, the pairs of the patched ways, prompt tokens, the tokens of
    the two generates whose difference gives the GPU figures (n1, n2; the step times are those
    of n2-token generates), the ways, the static ways' compile config, a time budget (the
    batches left once it is spent are skipped) and the device."""
    shape: str = "qwen3.5-4b"
    batches: tuple = (1, 32, 256)
    pairs: tuple = ("s32_rs", "tp4_hi16_sr")
    prompt: int = 64
    n1: int = 4
    n2: int = 20
    ways: tuple = WAYS
    compile_backend: str = "inductor"
    compile_mode: str = "reduce-overhead"
    budget_s: float | None = None
    device: str = "cuda"


def _identity(s: GenerateSettings) -> dict:
    """What the batches of one results file share (`run_generate_bench(add=True)`)."""
    return {"shape": s.shape, "pairs": list(s.pairs), "prompt_tokens": s.prompt,
            "steps_timed": [s.n1, s.n2],
            "compile_config": {"backend": s.compile_backend, "mode": s.compile_mode},
            "git_commit": git_commit()}


def _recorded(old: dict) -> dict:
    return {k: old[k] for k in ("shape", "pairs", "prompt_tokens", "steps_timed", "compile_config")} \
        | {"git_commit": old["provenance"]["git_commit"]}


def run_generate_bench(out: str | Path = "build/bench/generate.json",
                       settings: GenerateSettings = GenerateSettings(), add: bool = False,
                       progress=print) -> dict:
    """`_run_generate_bench` into `out`, which holds nothing but this benchmark's results
    (`replayquant.outputs.check_owned`, before any work) and is locked from the checks to the
    last write. With `add`, `out` must be a file of the same run (model shape, pairs, prompt,
    steps timed, compile config and git commit) and keeps its batches: this call measures the
    batches it is given and adds them (a batch measured again replaces its rows); a GPU call is
    capped in time, and the four static ways compile for minutes a batch."""
    own = dict(identity=_identity(settings), recorded=_recorded) if add else {}
    check_owned(out, GENERATE_KIND, "replayquant bench generate", **own)
    with output_lock(out):
        check_owned(out, GENERATE_KIND, "replayquant bench generate", **own)
        prior = None
        if add and Path(out).exists():
            prior = json.loads(Path(out).read_text(encoding="utf-8"))
        return _run_generate_bench(settings, out, progress, prior)


def _run_generate_bench(s: GenerateSettings, out: str | Path, progress=print,
                        prior: dict | None = None) -> dict:
    """Every (way, batch) of the module docstring; with s.budget_s, the batches left when the
    budget is spent are skipped (listed in `skipped`). Writes `out` after every batch, beside
    the batches of `prior` (the file of the same run an earlier call wrote); progress(line)
    after each way. Device 'cpu' (the tests: shape 'tiny', the static ways compiled through
    CompileConfig._compile_all_devices) leaves the GPU figures None."""
    device, batches, pairs = s.device, s.batches, s.pairs
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench generate needs a CUDA GPU (it times the compiled static cache); "
                         "there is none here")
    bad = set(s.ways) - set(WAYS)
    if bad:
        raise ValueError(f"unknown ways {sorted(bad)}; use some of {', '.join(WAYS)}")
    copy_gbps = copy_bandwidth_gbps()
    model = build_model(s.shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    cc = CompileConfig(backend=s.compile_backend, mode=s.compile_mode)
    cc._compile_all_devices = device != "cuda"
    prior = prior or {}
    rows = {k: v for k, v in prior.get("rows", {}).items()
            if int(k.rsplit("@B", 1)[1]) not in batches}
    calls = prior.get("calls", [])
    call = {"batches": [], "copy_bandwidth_gbps": copy_gbps,
            "provenance": provenance(device=device, bench="generate", shape=s.shape,
                                     batches=list(batches), pairs=list(pairs), prompt=s.prompt)}
    calls.append(call)
    run = _run_record(s.shape, pairs, s.prompt, s.n1, s.n2, s.compile_backend, s.compile_mode)
    skipped, t_start = [], time.perf_counter()
    for b in batches:
        if s.budget_s is not None and time.perf_counter() - t_start > s.budget_s:
            skipped.append(b)
            continue
        # the prompts of batch b depend on b alone, whichever call measures it
        g = torch.Generator().manual_seed(b)
        ids = torch.randint(1, model.config.vocab_size, (b, s.prompt), generator=g).to(device)
        _measure_batch(model, ids, b, s.ways, pairs, cc, s.n1, s.n2, rows, progress)
        call["batches"].append(b)
        res = _result(rows, calls, skipped, False, run)
        write_json(out, res)
    if not call["batches"]:
        raise ValueError(f"bench generate: --budget-s {s.budget_s} was spent before the first "
                         f"batch; nothing measured, {out} left as it was")
    res = _result(rows, calls, skipped, not skipped, run)
    write_json(out, res)
    return res


def _measure_batch(model, ids, b, ways, pairs, cc, n1, n2, rows, progress) -> None:
    """Every way of batch b into `rows`, each with its wall time: the eager ways side by side
    (`_in_turns`), then the static ways one after the other (each compiles its own graphs); a
    way that fails is reported as its row's error and the others still run. A static way's
    greedy tokens and logits are compared with the same model's eager ones (`_against_eager`)."""
    plan = [(w, None) for w in ways if w.startswith("hf")] + \
        [(w, p) for p in pairs for w in ways if w.startswith("patched")]

    def key(way, pair):
        return f"{way}{'' if pair is None else ':' + pair}@B{b}"

    eager = [(w, p) for w, p in plan if w.endswith("eager")]
    _in_turns(model, ids, eager, n1, n2, rows, key)
    seen = {p: (rows[key(w, p)].pop("tokens", None), rows[key(w, p)].pop("seen", None))
            for w, p in eager}                         # the eager tokens and logits, by pair
    for w, p in eager:
        progress(f"{key(w, p)}: {rows[key(w, p)]}")
    for way, pair in plan:
        if way.endswith("eager"):
            continue
        k = key(way, pair)
        t0 = time.perf_counter()
        try:
            with _way(model, pair):
                torch._dynamo.reset()
                rows[k] = _measure(model, ids, True, cc, n1, n2, eager_syncs=False)
        except Exception as e:          # a way that fails is reported, the others still run
            rows[k] = _error_row(e)
        rows[k]["wall_s"] = time.perf_counter() - t0
        toks, got = rows[k].pop("tokens", None), rows[k].pop("seen", None)
        etoks, eseen = seen.get(pair, (None, None))
        if toks is not None and etoks is not None:
            rows[k] |= _against_eager(toks, got, etoks, eseen)
        progress(f"{k}: {rows[k]}")


def _run_record(shape, pairs, prompt, n1, n2, compile_backend, compile_mode) -> dict:
    """What makes two calls' files one run's (`merge_generate` checks them alike)."""
    return {"shape": shape, "model_config": SHAPES[shape], "dtype": "bfloat16",
            "prompt_tokens": prompt, "steps_timed": [n1, n2],
            "compile_config": {"backend": compile_backend, "mode": compile_mode},
            "pairs": list(pairs)}


def _result(rows, calls, skipped, complete, run: dict) -> dict:
    """The results file of a run (`_run_record`) from its rows and calls."""
    done = sorted({int(k.rsplit("@B", 1)[1]) for k in rows})
    return {"kind": GENERATE_KIND, **run, "flash_linear_attention": fla_version(),
            "batches": done, "rows": rows, "targets": _targets(rows, run["pairs"], done),
            "skipped_batches": skipped, "complete": complete, "calls": calls,
            "provenance": calls[-1]["provenance"]}


def merge_generate(parts, out: str | Path = "build/bench/generate.json") -> dict:
    """`replayquant bench merge` of `bench generate` files: one results file from the calls of
    one run that each measured other batches (a device call is capped in time; `--add` gathers
    the batches in one file only where the earlier file travels with the call). The parts must
    share the run (model shape, pairs, prompt, steps timed, compile config, git commit) and
    measure disjoint batches; rows are kept as measured (each batch's ratios come from one call),
    the calls are listed with their provenance and the targets are formed from the merged rows.
    `out` is checked first (never one of the parts) and locked from the checks to the write."""
    if len(parts) < 2:
        raise ValueError("bench merge needs at least two bench generate files (calls of one run)")
    runs = []
    for p in parts:
        try:
            runs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise ValueError(f"bench merge: cannot read {p} as JSON ({e})") from None
        if not isinstance(runs[-1], dict) or runs[-1].get("kind") != GENERATE_KIND:
            raise ValueError(f"bench merge: {p} is not a `bench generate` file (kind "
                             f"{GENERATE_KIND!r})")
    ids = [_recorded(r) for r in runs]
    for p, i in zip(parts[1:], ids[1:]):
        if i != ids[0]:
            raise ValueError(f"bench merge: {p} is of a different run than {parts[0]} ({i} against "
                             f"{ids[0]}); merge the files of one commit and configuration")
    fla = {str(r.get("flash_linear_attention")) for r in runs}
    if len(fla) > 1:
        raise ValueError(f"bench merge: the parts ran with different fla versions ({sorted(fla)}); "
                         f"merge the files of one setup")
    seen: dict = {}
    for p, r in zip(parts, runs):
        for b in r["batches"]:
            if b in seen:
                raise ValueError(f"bench merge: batch {b} is in {seen[b]} and in {p}; keep one "
                                 f"of them")
            seen[b] = p
    check_owned(out, GENERATE_KIND, "replayquant bench merge", inputs=parts)
    with output_lock(out):
        check_owned(out, GENERATE_KIND, "replayquant bench merge", inputs=parts)
        rows = {k: v for r in runs for k, v in r["rows"].items()}
        calls = sorted((c for r in runs for c in r["calls"]),
                       key=lambda c: c["provenance"].get("date") or "")
        skipped = sorted({b for r in runs for b in r["skipped_batches"]} - set(seen))
        first = runs[0]
        cc = first["compile_config"]
        res = _result(rows, calls, skipped, not skipped,
                      _run_record(first["shape"], first["pairs"], first["prompt_tokens"],
                                  *first["steps_timed"], cc["backend"], cc["mode"]))
        res["flash_linear_attention"] = first["flash_linear_attention"]   # the device's, not ours
        write_json(out, res)
    return res
