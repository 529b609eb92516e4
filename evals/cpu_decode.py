"""Decode of the patched embedded models on the CPU: ms and host synchronisations per decode forward.

    python evals/cpu_decode.py OUT.json [--pairs s32_rs,tp4_hi16_sr] [--batch 4] [--steps 24]

Each embedded model (tiny-qwen3.5, tiny-mamba2, tiny-kimi-linear) is patched with each pair at
L = 16 (float32, the torch path: REPLAYQUANT_BACKEND=torch, one intra-op thread), prefills a
64-token random prompt per row into a DynamicCache, takes one decode step (the hand-off into the
decode store), then `--steps` decode forwards, timed and counted with
`replayquant.hostsync.HostSyncCounter`. The figure is the median over three prompts. This is
what a CPU user of `generate` waits per token, and what docs/usage.md quotes; it runs in a few
minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time
import warnings

import torch


def _one(model, kw, B, steps, seed):
    from transformers import DynamicCache

    from replayquant.hostsync import HostSyncCounter
    ids = torch.randint(3, 200, (B, 64), generator=torch.Generator().manual_seed(seed))
    args = {kw: DynamicCache(config=model.config), "use_cache": True}
    tok = model(ids, **args).logits[:, -1:].argmax(-1)
    tok = model(tok, **args).logits[:, -1:].argmax(-1)       # the hand-off into the store
    with HostSyncCounter() as c:
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = model(tok, **args).logits[:, -1:].argmax(-1)
        ms = (time.perf_counter() - t0) / steps * 1e3
    return ms, c.syncs / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--pairs", default="s32_rs,tp4_hi16_sr")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args(argv)
    import replayquant
    from replayquant import options
    from replayquant.outputs import write_json
    from replayquant.provenance import provenance
    torch.set_num_threads(1)
    rows = []
    for name in ("tiny-qwen3.5", "tiny-mamba2", "tiny-kimi-linear"):
        for pair in a.pairs.split(","):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = replayquant.load_model(name, pair=pair, dtype="float32",
                                               device_map="cpu", buffer_len=16)
            kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
                else "past_key_values"
            with torch.no_grad(), options.override(backend="torch"):
                runs = [_one(model, kw, a.batch, a.steps, seed) for seed in range(3)]
            row = {"model": name, "pair": pair,
                   "ms_per_decode_forward": round(statistics.median(r[0] for r in runs), 2),
                   "host_syncs_per_decode_forward": runs[-1][1]}
            print(row, flush=True)
            rows.append(row)
    write_json(a.out, {"kind": "replayquant.evals.cpu_decode", "rows": rows, "batch": a.batch,
                       "steps": a.steps, "buffer_len": 16, "prompt_tokens": 64, "threads": 1,
                       "provenance": provenance(device="cpu", check="cpu_decode")})


if __name__ == "__main__":
    main()
