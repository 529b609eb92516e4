"""Generation through the Triton replay decode kernel on CUDA, against the torch path on the CPU.

    python evals/cuda_generate_check.py OUT.json [--new-tokens 64] [--pairs s32_rs,tp4_hi32,f4_sr_rs]

A patched model's `model.generate(use_cache=True)` puts every decode step of every recurrent
layer through the replay state machine, with the GPU kernels on CUDA. The CPU tests cover that
path in the Triton interpreter on tiny random models; this script runs it compiled, on the
shipped trained models (tiny-qwen3.5: Gated DeltaNet, tiny-mamba2: Mamba-2), in float32.
tiny-kimi-linear is not among the defaults: its decode kernel, replay_kda_step, is checked in the
interpreter only (tests/kernels/replay/test_kernel_kda_replay.py) and has not run compiled yet.

* the same ragged batch of held-out prompts (left padding) is generated greedily on CUDA
  (decode kernel: `decode_path` must say 'triton') and on the CPU (the torch engine on a
  float32 ring, which equals ReplayState.step within float32 reassociation), for each pair;
* reported per pair: whether the greedy tokens agree, the first position where they differ,
  the largest logit difference relative to the largest logit over the steps before that
  position (the kernel's bf16 ring buffer bounds it, see tests/models/test_models_decode_kernel.py),
  decode tokens/s on CUDA for the patched model and for the unpatched HF model.

Writes one JSON file with provenance. Needs a CUDA device (exits with a message otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch


def _prompts(tok, B: int, lengths: list[int]):
    from replayquant.data import heldout_documents
    text = next(iter(heldout_documents()))["text"]
    ids = tok(text, return_tensors="pt").input_ids[0]
    T = max(lengths)
    batch = torch.full((B, T), tok.pad_token_id if tok.pad_token_id is not None else 0)
    mask = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        start = 1000 * i
        batch[i, T - n:] = ids[start:start + n]
        mask[i, T - n:] = 1
    return batch, mask


def _generate(model, ids, mask, new_tokens):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, use_cache=True)
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits, 1).float().cpu()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(model, ids, mask, new_tokens, device):
    _generate(model, ids, mask, 4)                       # warm-up: compile, allocator
    _sync(device)
    t0 = time.perf_counter()
    _generate(model, ids, mask, new_tokens)
    _sync(device)
    return time.perf_counter() - t0


def _count_kernel_steps():
    """Wrap the decode kernels' entry points: returns the call counter."""
    from replayquant.kernels.replay import decode as rd
    calls = {"n": 0}
    for name in ("replay_gdn_step", "replay_mamba2_step"):
        orig = getattr(rd, name)

        def f(*a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(*a, **k)
        setattr(rd, name, f)
    return calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pairs", default="s32_rs,tp4_hi32,f4_sr_rs,tp4_hi16_sr")
    ap.add_argument("--models", default="tiny-qwen3.5,tiny-mamba2")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run the 'GPU' side on the CPU through the Triton interpreter "
                         "(TRITON_INTERPRET=1 REPLAYQUANT_BACKEND=triton): checks the script, not a result")
    args = ap.parse_args(argv)
    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("cuda_generate_check: no CUDA device here; this check runs the compiled decode "
              "kernel and needs a GPU", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    import replayquant
    from replayquant.data import tiny_model_path
    from replayquant.models import decode_path, recurrent_layers
    from replayquant.provenance import provenance

    dev = torch.device("cpu" if args.dry_run_cpu else "cuda")
    calls = _count_kernel_steps()
    lengths = [96, 57, 130]
    rows = []
    for name in args.models.split(","):
        tok = AutoTokenizer.from_pretrained(tiny_model_path(name))
        ids, mask = _prompts(tok, len(lengths), lengths)
        base = replayquant.load_model(name, dtype="float32").to(dev)
        t_plain = _timed(base, ids.to(dev), mask.to(dev), args.new_tokens, dev)
        del base
        for pair in args.pairs.split(","):
            gpu = replayquant.load_model(name, pair, dtype="float32").to(dev)
            cpu = replayquant.load_model(name, pair, dtype="float32")
            path = decode_path(torch.empty(0, device=dev))
            calls["n"] = 0
            tok_g, sc_g = _generate(gpu, ids.to(dev), mask.to(dev), args.new_tokens)
            kernel_steps = calls["n"]
            calls["n"] = -10 ** 9            # the CPU reference must not reach the kernel
            with mock.patch.dict(os.environ, {"REPLAYQUANT_BACKEND": "torch"}):
                tok_c, sc_c = _generate(cpu, ids, mask, args.new_tokens)
            if calls["n"] != -10 ** 9:
                raise RuntimeError("the CPU reference generate reached the decode kernel")
            same = tok_g == tok_c
            first = [int((~r).nonzero()[0]) if (~r).any() else None for r in same]
            upto = min([f for f in first if f is not None], default=args.new_tokens)
            rel = float(((sc_g[:, :upto] - sc_c[:, :upto]).abs().amax()
                         / sc_c[:, :upto].abs().amax()).item()) if upto else None
            t_rep = _timed(gpu, ids.to(dev), mask.to(dev), args.new_tokens, dev)
            rows.append({"model": name, "pair": pair, "decode_path_cuda": path,
                         "kernel_decode_calls": kernel_steps,
                         "recurrent_layers": len(recurrent_layers(gpu)),
                         "tokens_equal_frac": float(same.float().mean()),
                         "first_difference_per_row": first,
                         "max_rel_logit_diff_before_first_difference": rel,
                         "cuda_tokens_per_s_patched": len(lengths) * args.new_tokens / t_rep,
                         "cuda_tokens_per_s_unpatched": len(lengths) * args.new_tokens / t_plain})
            print(json.dumps(rows[-1]), flush=True)
            del gpu, cpu
    out = {"provenance": provenance(dev, script="evals/cuda_generate_check.py",
                                    models=args.models.split(","), pairs=args.pairs.split(","),
                                    prompt_lengths=lengths, new_tokens=args.new_tokens,
                                    dtype="float32", data="replayquant/data kjv_heldout (Job)"),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
