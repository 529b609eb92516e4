"""The bench's GPU checks alone (kernels against their torch references at the real head
shapes, the reference casts on the device against the CPU), with provenance:

    python evals/gpu_checks.py OUT.json

`replayquant bench kernels` runs the same checks as the first part of its grid; the Kimi Delta
Attention checks (`kda_checks`: the conventional step and the chunked teacher-forcing scan with
per-channel gates) are added here."""

from __future__ import annotations

import json
import sys

import torch

from replayquant.bench.kernels.checks import gpu_checks, max_rel, state_diff
from replayquant.bench.kernels.timing import no_gpu
from replayquant.provenance import provenance

# a Kimi-Linear-48B-A3B KDA layer: transformers' KimiLinearConfig defaults linear_num_heads = 32,
# linear_head_dim = 128 (the published checkpoint's linear_attn_config), d_k = d_v = head dim
KDA_SHAPE = {"H": 32, "HK": 32, "dk": 128, "dv": 128}


def _rel64(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def kda_conventional_checks(device="cuda") -> dict:
    """conventional_kda_step against its reference at the KDA shape: 3 steps of 7 rows (one a
    padding row) on 6 slots, per stored format. max_rel_y_one_call: each step's reference run
    from the kernel's own store (what one call must match); max_rel_y: the reference's own
    chain of steps (rounding flips of low-precision formats may make it drift apart)."""
    from replayquant.testing import kda_step_inputs, random_state
    from replayquant.kernels.conventional.kernel import conventional_kda_step
    from replayquant.kernels.conventional.reference import conventional_kda_step_ref
    from replayquant.replay.stores import ConventionalStore
    H, HK, dk, dv = (KDA_SHAPE[n] for n in ("H", "HK", "dk", "dv"))
    idx = torch.tensor([5, -1, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)
    B = idx.shape[0]
    init = random_state(6, H, dv, dk, seed=1, device=device)
    out = {}
    for fmt, rounding in (("fp32", "nearest"), ("bf16", "stochastic"), ("nvfp4", "stochastic")):
        st = ConventionalStore.from_state(init, fmt, rounding, seed=3, layer=1)
        ref = st.clone()
        errs, errs1 = [], []
        for i in range(3):
            q, k, v, g, beta = kda_step_inputs(B, HK, H, dk, dv, seed=50 + i, device=device)
            one = st.clone()
            y = conventional_kda_step(st, q, k, v, g, beta, state_indices=idx,
                                      out=torch.full((B, H, dv), float("nan"), device=device))
            errs.append(max_rel(y, conventional_kda_step_ref(ref, q, k, v, g, beta,
                                                             state_indices=idx)))
            errs1.append(max_rel(y, conventional_kda_step_ref(one, q, k, v, g, beta,
                                                              state_indices=idx)))
        out[f"kda/conventional/{fmt}"] = {
            "max_rel_y": max(errs), "max_rel_y_one_call": max(errs1),
            "padding_row_zero": bool((y[1] == 0).all()), "finite": bool(torch.isfinite(y).all()),
            "state": state_diff(st.state.dequantize(), ref.state.dequantize())}
    return out


def kda_chunk_checks(device="cuda") -> dict:
    """The chunk scan with per-channel gates against chunk_scan_ref at the KDA shape: 2 rows,
    two segments of 150 and 57 tokens (L = 16: partial windows carried over), per pair; outputs
    (max_rel_y_one_call: each segment's reference run from the kernel's own state; max_rel_y:
    the reference's own chain, where a rounding flip of a low-precision role propagates;
    frac_y_gt_1e-4: the outputs off by more than 1e-4 of the largest), the carried state and,
    for s32_rs, both against the float64 per-channel recurrence."""
    from replayquant.testing import kda_step_inputs, random_state
    from replayquant.kernels.chunk import kernel as chunk
    from replayquant.kernels.chunk.reference import (chunk_scan_ref, initial_scan_state,
                                                     rebuild_state)
    from replayquant.pairs import PrecisionPair
    from replayquant.replay import kda_inputs, recurrent_reference
    H, HK, dk, dv = (KDA_SHAPE[n] for n in ("H", "HK", "dk", "dv"))
    B, cuts = 2, (0, 150, 207)
    q, k, v, g, beta = kda_step_inputs(B, HK, H, dk, dv, T=cuts[-1], seed=7, device=device)
    q, k, v, la, beta = kda_inputs(q, k, v, g, beta=beta)        # L2 norm and scale, in FP32
    S0 = random_state(B, H, dv, dk, seed=2, device=device)
    out = {}
    for name in ("s32_rs", "tp4_hi16_sr", "f4_sr_rs"):
        pair = PrecisionPair.load(name).with_buffer_len(16)
        ss = initial_scan_state(S0, pair, delta=True, seed=5, layer=2, vector_gate=True)
        got, ref, errs, errs1, far, ys = ss, ss, [], [], [], []
        for a, b in zip(cuts[:-1], cuts[1:]):
            args = [t[:, a:b].contiguous() for t in (q, k, v, la, beta)]
            y1, _ = chunk_scan_ref(got, *args, pair=pair, seed=5, layer=2)
            y, got = chunk.chunk_scan(got, *args, pair=pair, seed=5, layer=2)
            y_ref, ref = chunk_scan_ref(ref, *args, pair=pair, seed=5, layer=2)
            errs.append(max_rel(y, y_ref))
            errs1.append(max_rel(y, y1))
            far.append(float(((y - y1).abs() > 1e-4 * y1.abs().max()).float().mean()))
            ys.append(y)
        spec = pair.anchor.fmt
        row = {"max_rel_y": max(errs), "max_rel_y_one_call": max(errs1),
               "frac_y_gt_1e-4_one_call": max(far),
               "finite": bool(torch.isfinite(torch.cat(ys, 1)).all()),
               "counts_flushes_equal": bool(torch.equal(got.committed, ref.committed)
                                            and torch.equal(got.n_flush, ref.n_flush)),
               "G_max_abs_diff": float((got.G - ref.G).abs().max()),
               "anchor": state_diff(spec.dequantize(got.anchor), spec.dequantize(ref.anchor))}
        if name == "s32_rs":
            Y, S = recurrent_reference(S0, q, k, v, la, beta, dtype=torch.float64)
            row["max_rel_y_vs_float64"] = _rel64(torch.cat(ys, 1), Y)
            row["max_rel_state_vs_float64"] = _rel64(rebuild_state(got, pair), S)
        out[f"kda/chunk/{name}"] = row
    return out


def kda_checks(device="cuda") -> dict:
    """The KDA kernels against their references at a Kimi-Linear-48B layer shape."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return {"kda/shape": dict(KDA_SHAPE, source="KimiLinearConfig defaults (Kimi-Linear-48B-A3B)"),
            **kda_conventional_checks(device), **kda_chunk_checks(device)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python evals/gpu_checks.py OUT.json", file=sys.stderr)
        return 2
    if no_gpu("gpu_checks"):
        return 2
    checks = gpu_checks("cuda")
    checks.update(kda_checks("cuda"))
    res = {"provenance": provenance("cuda", script="evals/gpu_checks.py"), "checks": checks}
    with open(argv[0], "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(checks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
