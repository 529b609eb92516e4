"""Where the host's time goes in a decode step of generate (GPU, not in CI).

    python evals/decode_host_profile.py OUTDIR [--batch 1] [--pair s32_rs] [--ways ...]

The Qwen3.5-4B-shape model of `bench generate` (random weights, bf16) generates greedily from a
random prompt (64 tokens, --prompt); after warm-up generates (which compile the static ways),
cProfile records one generate of 20 new tokens per way (hf_eager, hf_static, patched_eager,
patched_static), and the top functions by own time and by cumulative time go into
OUTDIR/host_<way>.txt, with the wall time per generated token. Then torch.profiler records another
generate on the host side: the operators and regions with the most host time per generated token,
among them dynamo's guard evaluation ("TorchDynamo Cache Lookup"), the compiled region and the
CUDA graph replay; that table goes into the same file and, as JSON, into OUTDIR/host_regions.json.
A decode step is host-bound where the wall time per token is far above the GPU's busy time (bench
generate reports both); this says which code holds it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
from transformers import CompileConfig

from replayquant.bench.generate import _generate
from replayquant.bench.kl import build_model
from replayquant.models import patch, unpatch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pair", default="s32_rs")
    ap.add_argument("--ways", default="patched_eager,patched_static,hf_static")
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (the prefill is eager "
                    "in every way: a long prompt shows its host time beside the steps')")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model("qwen3.5-4b", torch.bfloat16, "cuda")
    ids = torch.randint(1, model.config.vocab_size, (a.batch, a.prompt),
                        generator=torch.Generator().manual_seed(a.batch)).cuda()
    cc = CompileConfig(backend="inductor", mode="reduce-overhead")
    regions = {}
    for way in a.ways.split(","):
        static = way.endswith("static")
        if way.startswith("patched"):
            patch(model, a.pair)
        try:
            torch._dynamo.reset()
            for _ in range(2):
                _generate(model, ids, a.new_tokens, static, cc)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            _generate(model, ids, a.new_tokens, static, cc)
            torch.cuda.synchronize()
            prof.disable()
            wall = time.perf_counter() - t0
            regions[way] = _host_regions(lambda: _generate(model, ids, a.new_tokens, static, cc),
                                         a.new_tokens)
        finally:
            if way.startswith("patched"):
                unpatch(model)
        buf = io.StringIO()
        buf.write(f"{way} B={a.batch} pair={a.pair}: {1e3 * wall / a.new_tokens:.2f} ms per "
                  f"generated token under cProfile (prompt included)\n")
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(30)
        st.sort_stats("cumulative").print_stats(45)
        buf.write("\nhost microseconds per generated token by profiler event (torch.profiler, CPU; "
                  "nested events overlap)\n")
        for name, us in regions[way].items():
            buf.write(f"{us:12.1f}  {name}\n")
        (out / f"host_{way}.txt").write_text(buf.getvalue())
        print(buf.getvalue().splitlines()[0], flush=True)
        for name in ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "CUDAGraphNode.replay"):
            hits = [(k, v) for k, v in regions[way].items() if k.startswith(name)]
            for k, v in hits[:2]:
                print(f"  {v:9.1f} us/token  {k}", flush=True)
    (out / "host_regions.json").write_text(json.dumps(
        {"batch": a.batch, "pair": a.pair, "prompt": a.prompt, "new_tokens": a.new_tokens,
         "us_per_token": regions}, indent=1))


def _host_regions(fn, n_tokens: int, top: int = 40) -> dict[str, float]:
    """Host microseconds per generated token of the `top` profiler events of one fn() by total
    CPU time (events nest: a region's time includes the operators inside it)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        totals[e.name] = totals.get(e.name, 0.0) + e.cpu_time_total
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {k: v / n_tokens for k, v in ranked}


if __name__ == "__main__":
    main()
