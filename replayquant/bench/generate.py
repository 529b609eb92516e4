"""`replayquant bench generate` (GPU, not in CI): what a user of `generate` waits per token.

The Qwen3.5-4B-shape model of `bench kl` (random weights, bf16, all 32 layers) generates greedily
from random prompts at each batch size, four ways: Hugging Face unpatched and eager
(DynamicCache), Hugging Face unpatched with its static cache compiled
(`cache_implementation="static"`, `compile_config`: CUDA graphs), and patched with each pair, eager
and static + compiled (the same compile config). Per way and batch:

* `ms_per_step`: wall time of a decode step, (t(n2 tokens) - t(n1 tokens)) / (n2 - n1) of two
  generates, so that the prompt and the compile are not in it (a warm-up generate compiles);
* `gpu_busy_ms_per_step`: the GPU kernels' time in a decode step (torch.profiler, the same
  difference of two generates), and `launches_per_step`, the kernels it counted;
* `host_syncs_per_step` (eager ways): host synchronisations of one decode forward after the
  first (replayquant.hostsync; HF's generate adds its own stopping check per step, not counted),
  and `sync_debug_ok`: whether that forward ran under torch.cuda.set_sync_debug_mode("error").

The ratios the targets need are formed within the run; `targets` lists each with its measure and
whether it is met. Writes one JSON file with provenance.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = ["run_generate_bench", "WAYS"]

WAYS = ("hf_eager", "hf_static", "patched_eager", "patched_static")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate(model, ids, n: int, static: bool, compile_config):
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if static:
        kw.update(cache_implementation="static", compile_config=compile_config)
    with torch.inference_mode():
        return model.generate(ids, **kw)


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _profiled(fn) -> tuple[float | None, int | None]:
    """(GPU kernel milliseconds, kernel count) of fn(); (None, None) without a GPU."""
    from torch.profiler import ProfilerActivity, profile
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
    import inspect

    from transformers import DynamicCache

    from replayquant.hostsync import HostSyncCounter
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
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


def _measure(model, ids, static: bool, compile_config, n1: int, n2: int, eager_syncs: bool):
    _generate(model, ids, n1, static, compile_config)               # warm-up: compiles
    t1 = _timed(lambda: _generate(model, ids, n1, static, compile_config))
    t2 = _timed(lambda: _generate(model, ids, n2, static, compile_config))
    g1, k1 = _profiled(lambda: _generate(model, ids, n1, static, compile_config))
    g2, k2 = _profiled(lambda: _generate(model, ids, n2, static, compile_config))
    steps = n2 - n1
    tokens = _generate(model, ids, n2, static, compile_config)[:, ids.shape[1]:].cpu()
    row = {"tokens": tokens, "ms_per_step": 1e3 * (t2 - t1) / steps,
           "gpu_busy_ms_per_step": None if g1 is None else (g2 - g1) / steps,
           "launches_per_step": None if k1 is None else (k2 - k1) / steps}
    if eager_syncs:
        row["host_syncs_per_step"], row["sync_debug_ok"] = _decode_forward_syncs(model, ids)
    return row


def _fla_version():
    try:
        import fla
        return fla.__version__
    except ImportError:
        return None


def _targets(rows: dict, pairs, batches) -> list[dict]:
    out = []

    def get(way, b, key):
        return rows.get(f"{way}@B{b}", {}).get(key)

    for pair in pairs:
        for b in batches:
            eq = get(f"patched_static:{pair}", b, "tokens_equal_eager")
            if eq is not None:
                out.append({"name": f"{pair} static+compile tokens equal patched eager, B = {b}",
                            "measured": float(eq), "met": eq})
            ps, hs = get(f"patched_static:{pair}", b, "ms_per_step"), get("hf_static", b, "ms_per_step")
            lim = 1.0 if b >= 256 else 1.1
            if ps is not None and hs is not None:
                out.append({"name": f"{pair} static+compile vs HF static+compile, B = {b} (<= {lim}x)",
                            "measured": ps / hs, "met": ps / hs <= lim})
            busy = get(f"patched_static:{pair}", b, "gpu_busy_ms_per_step")
            if ps is not None and busy:
                out.append({"name": f"{pair} static+compile wall / its GPU busy time, B = {b} (<= 1.3x)",
                            "measured": ps / busy, "met": ps / busy <= 1.3})
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


def run_generate_bench(out: str | Path = "build/bench/generate.json", **kw) -> dict:
    """`_run_generate_bench` (its options in `kw`) into `out`, which holds nothing but this
    benchmark's results (`replayquant.outputs.check_owned`, before any work) and is locked from
    the checks to the last write."""
    from replayquant.outputs import check_owned, output_lock
    check_owned(out, GENERATE_KIND, "replayquant bench generate")
    with output_lock(out):
        check_owned(out, GENERATE_KIND, "replayquant bench generate")
        return _run_generate_bench(out, **kw)


def _run_generate_bench(out: str | Path = "build/bench/generate.json", shape: str = "qwen3.5-4b",
                       batches=(1, 32, 256), pairs=("s32_rs", "tp4_hi16_sr"), prompt: int = 64,
                       n1: int = 4, n2: int = 20, ways=WAYS, compile_backend: str = "inductor",
                       compile_mode: str = "reduce-overhead", budget_s: float | None = None,
                       progress=print, device: str = "cuda", n_layers: int | None = None) -> dict:
    """Every (way, batch) of the module docstring; with budget_s, the batches left when the
    budget is spent are skipped (listed in `skipped`). Writes `out` after every batch.
    device 'cpu' (the tests: shape 'tiny', the static ways compiled through
    CompileConfig._compile_all_devices) leaves the GPU figures None."""
    from transformers import CompileConfig

    import replayquant
    from replayquant.kl.bench import SHAPES, build_model
    from replayquant.outputs import write_json
    from replayquant.provenance import provenance

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench generate needs a CUDA GPU (it times the compiled static cache); "
                         "there is none here")
    bad = set(ways) - set(WAYS)
    if bad:
        raise ValueError(f"unknown ways {sorted(bad)}; use some of {', '.join(WAYS)}")
    copy_gbps = copy_bandwidth_gbps()
    model = build_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    cc = CompileConfig(backend=compile_backend, mode=compile_mode)
    cc._compile_all_devices = device != "cuda"
    g = torch.Generator().manual_seed(0)
    rows, skipped, t_start, eager_tokens = {}, [], time.perf_counter(), {}
    res = {}
    for b in batches:
        if budget_s is not None and time.perf_counter() - t_start > budget_s:
            skipped.append(b)
            continue
        ids = torch.randint(1, model.config.vocab_size, (b, prompt), generator=g).to(device)
        plan = [(w, None) for w in ways if w.startswith("hf")] + \
            [(w, p) for p in pairs for w in ways if w.startswith("patched")]
        for way, pair in plan:
            key = f"{way}{'' if pair is None else ':' + pair}@B{b}"
            t0 = time.perf_counter()
            if pair is not None:
                replayquant.patch(model, pair)
            try:
                torch._dynamo.reset()
                rows[key] = _measure(model, ids, way.endswith("static"), cc, n1, n2,
                                     eager_syncs=way.endswith("eager"))
            except Exception as e:          # a way that fails is reported, the others still run
                rows[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            finally:
                if pair is not None:
                    replayquant.unpatch(model)
            rows[key]["wall_s"] = time.perf_counter() - t0
            toks = rows[key].pop("tokens", None)
            if way == "patched_eager":
                eager_tokens[pair] = toks
            elif way == "patched_static" and toks is not None and eager_tokens.get(pair) is not None:
                # greedy tokens of the compiled generate against the patched eager generate's
                rows[key]["tokens_equal_eager"] = bool(torch.equal(toks, eager_tokens[pair]))
            progress(f"{key}: {rows[key]}")
        res = {"kind": GENERATE_KIND, "shape": shape, "model_config": SHAPES[shape],
               "dtype": "bfloat16", "prompt_tokens": prompt, "steps_timed": [n1, n2],
               "compile_config": {"backend": compile_backend, "mode": compile_mode},
               "copy_bandwidth_gbps": copy_gbps, "flash_linear_attention": _fla_version(),
               "batches": list(batches), "pairs": list(pairs), "rows": rows,
               "targets": _targets(rows, pairs, batches), "skipped_batches": skipped,
               "complete": False,
               "provenance": provenance(device=device, bench="generate", shape=shape,
                                        batches=list(batches), pairs=list(pairs), prompt=prompt)}
        write_json(out, res)
    res["skipped_batches"] = skipped
    res["complete"] = not skipped
    write_json(out, res)
    return res
