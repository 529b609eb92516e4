"""Whether an NVFP4 role's global scale can be chosen before its flush sees the whole matrix.

    PYTHONPATH=. python evals/nvfp4_headroom.py OUT.json [--steps 1024] [--L 16] [--seeds 42,43,44]

A flush inside the read program (a program per row tile) writes its tile of the new anchor or
read copy without the rest of the matrix, so it cannot take today's global scale, the new
matrix's amax / 2688 (448 E4M3 x 6 E2M1). The candidate that keeps the format: the previous
flush's amax times a power-of-two headroom 2^k, rounded up to a power of two,
gs = 2^ceil(log2(amax_prev 2^k / 2688)), with a check for the elements that pass 2688 gs
(they saturate; a kernel would redo such a matrix on the whole-matrix path). This measures, on
the CPU, how far a matrix's amax moves from one flush to the next and what each choice costs.

Inputs: `replayquant drift`'s protocol for GDN, KDA and Mamba-2 (`drift.make_inputs`: random
inputs, GDN decays U[0.9, 1) per step), and GDN with long memory (each sequence's and head's
decay rate log-uniform in [1e-4, 1e-1], held over the run), B = 2, H = 8, d_k = d_v = 128, zero
initial state; the unrounded FP32 state S at every flush (every L steps) from
`replay.recurrent_reference`. Per matrix (sequence, head) and flush w >= 2:
* growth r = amax(S_w) / amax(S_{w-1});
* the NVFP4 cast of S_w (`formats.casts.nvfp4_quantize_ref`, nearest) with its own global scale
  and with the headroom scale for k = 0, 1, 2: relative RMS error against S_w, and the share of
  matrices with an element past 2688 gs.
Writes OUT.json (provenance, per kind and choice the quantiles and shares) and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from replayquant.drift import make_inputs
from replayquant.formats.casts import nvfp4_dequantize_ref, nvfp4_quantize_ref
from replayquant.formats.constants import NVFP4_GLOBAL_DIVISOR
from replayquant.outputs import write_json
from replayquant.provenance import provenance
from replayquant.replay import gdn_inputs, recurrent_reference

SHAPE = dict(batch=2, heads=8, d_k=128, d_v=128)
HEADROOM = (0, 1, 2)


def long_memory_gdn(steps: int, seed: int, batch: int, heads: int, d_k: int, d_v: int):
    """GDN inputs as drift's, the decay rate of each sequence and head log-uniform in
    [1e-4, 1e-1] and held over the run."""
    g = torch.Generator().manual_seed(int(seed))
    B, T, H = batch, steps, heads
    q, k = (torch.randn(B, T, H, d_k, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, d_v, generator=g)
    b = torch.randn(B, T, H, generator=g)
    rate = torch.exp(math.log(1e-4) + math.log(1e3) * torch.rand(B, 1, H, generator=g))
    return gdn_inputs(q, k, v, (-rate).expand(B, T, H), b)


def flush_states(inp, steps: int, L: int) -> list[torch.Tensor]:
    """The unrounded state [B, H, d_v, d_k] at steps L, 2L, ..., steps."""
    q = inp[0]
    B, _, H, dk = q.shape
    S = torch.zeros(B, H, inp[2].shape[-1], dk)
    out = []
    for t in range(0, steps - L + 1, L):
        _, S = recurrent_reference(S, *(None if x is None else x[:, t:t + L] for x in inp))
        out.append(S.clone())
    return out


def cast_error(S: torch.Tensor, gs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(relative RMS error, saturated) per matrix of S [M, d_v, d_k] cast to NVFP4 with global
    scale gs [M] (None: its own)."""
    packed, bs, g = nvfp4_quantize_ref(S, None, gs)
    d = nvfp4_dequantize_ref(packed, bs, g) - S
    rel = d.pow(2).mean((-2, -1)).sqrt() / S.pow(2).mean((-2, -1)).sqrt().clamp_min(1e-30)
    sat = S.abs().amax((-2, -1)) > NVFP4_GLOBAL_DIVISOR * g
    return rel, sat


def measure(states: list[torch.Tensor]) -> dict:
    """Growth and cast errors over consecutive flushes (module docstring)."""
    growth, err = [], {"own": []}
    sat = {}
    for k in HEADROOM:
        err[f"k={k}"], sat[f"k={k}"] = [], []
    for prev, cur in zip(states[1:-1], states[2:]):
        P, C = (s.reshape(-1, *s.shape[-2:]) for s in (prev, cur))
        a_prev, a_cur = P.abs().amax((-2, -1)), C.abs().amax((-2, -1))
        growth.append(a_cur / a_prev)
        err["own"].append(cast_error(C, None)[0])
        for k in HEADROOM:
            gs = torch.exp2(torch.ceil(torch.log2(a_prev * 2.0 ** k / NVFP4_GLOBAL_DIVISOR)))
            e, s = cast_error(C, gs)
            err[f"k={k}"].append(e)
            sat[f"k={k}"].append(s.float())
    r = torch.cat(growth)
    qs = torch.tensor([0.5, 0.99, 1.0])
    return {"flush_pairs": len(growth), "matrices": int(r.numel()),
            "growth": dict(zip(("median", "q99", "max"), torch.quantile(r, qs).tolist())),
            "growth_over": {f"2^{k}": float((r > 2.0 ** k).float().mean()) for k in HEADROOM},
            "rel_rms": {c: float(torch.cat(v).mean()) for c, v in err.items()},
            "saturated_share": {c: float(torch.cat(v).mean()) for c, v in sat.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="results JSON")
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--L", type=int, default=16)
    p.add_argument("--seeds", default="42,43,44")
    a = p.parse_args(argv)
    if not a.out.endswith(".json"):
        p.error("give a results file ending in .json")
    if a.L < 1 or a.steps < 3 * a.L:
        p.error("--steps must hold at least three windows of --L >= 1")
    seeds = [int(s) for s in a.seeds.split(",") if s]
    res = dict(provenance("cpu", steps=a.steps, L=a.L, seeds=seeds, shape=SHAPE,
                          headroom=list(HEADROOM)), kinds={})
    cases = {"gdn": lambda s: make_inputs("gdn", a.steps, s, **SHAPE),
             "gdn long memory": lambda s: long_memory_gdn(a.steps, s, **SHAPE),
             "kda": lambda s: make_inputs("kda", a.steps, s, **SHAPE),
             "mamba2": lambda s: make_inputs("mamba2", a.steps, s, **SHAPE)}
    for name, make in cases.items():
        states = [flush_states(make(s), a.steps, a.L) for s in seeds]
        res["kinds"][name] = measure([torch.cat(w) for w in zip(*states)])
        write_json(a.out, res)
        m = res["kinds"][name]
        print(f"{name:16s} growth median {m['growth']['median']:.3f} q99 {m['growth']['q99']:.3f} "
              f"max {m['growth']['max']:.3f}; rel RMS own {m['rel_rms']['own']:.4f} "
              + " ".join(f"{c} {m['rel_rms'][c]:.4f} (sat {m['saturated_share'][c]:.1%})"
                         for c in m["saturated_share"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
