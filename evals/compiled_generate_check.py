"""HF's compiled static-cache generate on patched models against their eager generate, on CUDA.

    python evals/compiled_generate_check.py OUT.json [--backend inductor] [--new-tokens 24]
        [--models tiny-qwen3.5,...] [--pairs s32_rs,...]

For each embedded model (tiny-qwen3.5: Gated DeltaNet, tiny-mamba2: Mamba-2, tiny-kimi-linear:
Kimi Delta Attention) and each shipped pair, the same random prompts are generated greedily with
the patched model twice: `generate(use_cache=True)` (DynamicCache, eager) and `generate(...,
cache_implementation="static", compile_config=CompileConfig(backend, mode="reduce-overhead"))`,
and the tokens are compared. The decode kernel runs in both; the compiled one through CUDA graphs.
Also: host syncs of an eager decode forward on the stores (replayquant.hostsync) and whether it
runs under torch.cuda.set_sync_debug_mode("error"). Writes one JSON file with provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--pairs", default=None, help="comma-separated (default every shipped pair)")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--models", default="tiny-qwen3.5,tiny-mamba2,tiny-kimi-linear")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("compiled_generate_check needs a CUDA device")
    import replayquant
    from replayquant.bench.generate import _decode_forward_syncs
    from replayquant.outputs import write_json
    from replayquant.pairs import list_pairs
    from replayquant.provenance import provenance
    from transformers import CompileConfig
    warnings.filterwarnings("ignore")
    rows = []
    g = torch.Generator().manual_seed(0)
    for name in a.models.split(","):
        for pair in (a.pairs.split(",") if a.pairs else list_pairs()):
            m = replayquant.load_model(name, pair=pair, dtype="float32", device_map="cuda",
                                       buffer_len=8)
            ids = torch.randint(3, 200, (3, 12), generator=g).cuda()
            kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(ids), pad_token_id=0)
            row = {"model": name, "pair": pair}
            try:
                with torch.inference_mode():
                    eager = m.generate(ids, **kw)
                    torch._dynamo.reset()
                    t0 = time.perf_counter()
                    comp = m.generate(ids, cache_implementation="static",
                                      compile_config=CompileConfig(backend=a.backend,
                                                                   mode="reduce-overhead"), **kw)
                    row["compile_and_generate_s"] = time.perf_counter() - t0
                row["tokens_equal"] = bool(torch.equal(eager, comp))
                if not row["tokens_equal"]:
                    d = (eager != comp).nonzero()
                    row["first_difference"] = d[0].tolist()
                row["host_syncs"], row["sync_debug_ok"] = _decode_forward_syncs(m, ids)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            del m
    write_json(a.out, {"kind": "replayquant.evals.compiled_generate_check", "rows": rows,
                       "backend": a.backend, "new_tokens": a.new_tokens,
                       "provenance": provenance(device="cuda", check="compiled_generate")})


if __name__ == "__main__":
    main()
