"""The decode-kernel benchmark's clock: the device copy bandwidth, GPU time per call of a CUDA
graph of calls (triton.testing.do_bench median, L2 flushed before each replay), state copies
rotated so that every step finds its state cold in L2, and one row of the table per timing."""

from __future__ import annotations

import contextlib
import math
import sys
import time

import torch
import triton.testing

_CPU_TIMING = {"on": False}


@contextlib.contextmanager
def cpu_timing(on: bool):
    """Within the block time_calls times with perf_counter when `on` (a CPU smoke run of the
    benchmark's code in the Triton interpreter, never results), and rotations is 1."""
    _CPU_TIMING["on"] = on
    try:
        yield
    finally:
        _CPU_TIMING["on"] = False


def copy_bandwidth_GBps(device="cuda") -> float:
    """Device copy bandwidth (bytes read + written) of a 1 GiB float32 copy, do_bench median."""
    x = torch.randn(2 ** 28, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
    del x, y
    return 2 * 2 ** 28 * 4 / ms / 1e6


def graph_ms(fn, n_calls: int, warmup: int = 2) -> float:
    """GPU time per call of `fn` (ms): warm up (compiles), capture n_calls into a CUDA graph, time
    its replays with triton.testing.do_bench (median; L2 flushed before each replay)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_calls):
            fn()
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")
    del g
    return ms / n_calls


def time_calls(fn, n_calls: int) -> float:
    """ms per call: graph_ms on a GPU; on the CPU (smoke runs of the benchmark's code in the
    Triton interpreter, never results) at most two calls timed with perf_counter."""
    if not _CPU_TIMING["on"]:
        return graph_ms(fn, n_calls)
    n = min(n_calls, 2)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e3 / n


def plain_ms(fn) -> float:
    """do_bench median of fn without a graph (Python launch overhead included; the peer table of
    DESIGN section 6 was measured this way)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rotations(nbytes: float, device) -> int:
    """Copies of a state to cycle through so that every step finds its state cold in L2: enough
    copies to cover twice the L2 (1 on the CPU; at most 64)."""
    if _CPU_TIMING["on"] or not str(device).startswith("cuda"):
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2 ** 20)
    return int(min(64, max(1, math.ceil(2 * l2 / max(nbytes, 1.0)))))


def timed_row(kind, kernel, variant, B, ms, nbytes, copy_bw, **extra) -> dict:
    """One row of the table (us per step, bytes moved, GB/s and % of the copy bandwidth), printed
    as it is measured."""
    us = ms * 1e3
    gbps = nbytes / ms / 1e6 if nbytes else None
    r = dict(kind=kind, kernel=kernel, variant=variant, B=B, us=us, bytes=nbytes, GBps=gbps,
             pct_copy=None if gbps is None else 100 * gbps / copy_bw)
    r.update(extra)
    print(f"  {kind:6s} {kernel:24s} {variant:10s} B={B:4d} {us:9.1f} us"
          + (f" {gbps:7.0f} GB/s {r['pct_copy']:5.1f}%" if gbps else ""), flush=True)
    return r


def no_gpu(script: str) -> bool:
    """True, after one clear error on stderr, where there is no CUDA GPU: the guard of the GPU
    scripts under evals/ (their checks and times need the device)."""
    if torch.cuda.is_available():
        return False
    print(f"{script}: needs a CUDA GPU; run it on a machine with one (evals/gpu_runs.sh)",
          file=sys.stderr)
    return True
