"""The decode kernels against their torch references on the GPU at the real head shapes (the
comparisons of the CPU tests), and the reference casts on the device against the CPU: the
`checks` section of `replayquant bench kernels` and evals/gpu_checks.py."""

from __future__ import annotations

import torch

from replayquant.testing import cpu_generator, random_state
from replayquant.bench.kernels.grid import SHAPES, kernel_fns, kernel_inputs
from replayquant.formats import as_bits
from replayquant.formats import casts as qref
from replayquant.kernels.replay.decode import advance_pointers
from replayquant.kernels.replay.reference import replay_accept_ref
from replayquant.kernels.conventional.reference import conventional_accept_ref
from replayquant.replay.stores import ConventionalStore, ReplayStore, make_snapshots
from replayquant.kernels.conventional.verify import conventional_accept
from replayquant.kernels.replay.verify import replay_accept
from replayquant.pairs import PrecisionPair


def max_rel(a, b) -> float:
    """Largest absolute difference of a from b over b's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def state_diff(a, b) -> dict:
    """A state against its reference: largest relative difference, and the fraction of entries
    off by more than 1e-5 of the reference's largest magnitude."""
    d = (a - b).abs()
    scale = b.abs().max().clamp(min=1e-30)
    return {"max_rel": float(d.max() / scale), "frac_gt_1e-5": float((d > 1e-5 * scale).float().mean())}


def _ref_cast_device_vs_cpu(device) -> dict:
    """The torch reference casts (the specification) run on the device against the same casts
    on the CPU, bit for bit; for each format, the fraction of payload codes that differ."""
    g = cpu_generator(11)
    x = torch.randn(256, 128, 128, generator=g) * 10 ** torch.randn(256, 128, 1, generator=g)
    res = {}
    for name, fn in (("fp8", qref.fp8_quantize_ref), ("nvfp4", qref.nvfp4_quantize_ref)):
        got = [t.cpu() for t in fn(x.to(device))]
        want = fn(x)
        bits = [tuple(as_bits(t) for t in ts) for ts in (got, want)]
        res[name] = {"equal": all(torch.equal(a, b) for a, b in zip(*bits)),
                     "payload_codes_differing": float((bits[0][0] != bits[1][0]).float().mean())}
    return res


# the slots of the checks' batch: padding (-1) among them, out of order
_CHECK_SLOTS = (5, -1, 0, 3, 1, 2, 4)


def gpu_checks(device="cuda", shapes=None) -> dict:
    """The kernel-vs-reference comparisons of the CPU tests, on the GPU at the real head shapes
    (`shapes`, default SHAPES)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"reference_cast_device_equals_cpu": _ref_cast_device_vs_cpu(device)}
    N = 6
    idx = torch.tensor(_CHECK_SLOTS, dtype=torch.int32, device=device)
    for kind, S in (shapes or SHAPES).items():
        f = kernel_fns(kind)
        init = random_state(N, S["H"], S["dv"], S["dk"], seed=1, device=device)
        for pair, ud in (("s32_rs", torch.float32), ("tp4_hi32", torch.float32),
                         ("tp4_hi16_sr", torch.bfloat16)):
            out[f"{kind}/replay/{pair}"] = _replay_check(kind, S, f, init, pair, ud, idx, device)
        if "cverify" not in f:                  # KDA: the conventional step alone
            out.update(conventional_checks(kind, S, idx, device))
            continue
        for fmt, rnd in (("fp32", "nearest"), ("fp16", "stochastic")):
            out[f"{kind}/conventional/{fmt}-{rnd}"] = _conventional_check(kind, S, f, init, fmt,
                                                                          rnd, idx, device)
    return out


def _replay_check(kind, S, f, init, pair, ud, idx, device) -> dict:
    """Nine calls of the replay step and verify (every third a verify of 2 drafts and an accept)
    on a store of `pair` (u in `ud`), against the reference's chain of calls (max_rel_y) and the
    reference run from the kernel's own store (one call, max_rel_y_one_call); the step with the
    pointer move later (advance_pointers) against the step that moves them itself."""
    B = idx.shape[0]
    P = PrecisionPair.load(pair).with_buffer_len(4)
    st = ReplayStore.from_state(init, P, kind, key_heads=S["HK"], seed=3, u_dtype=ud,
                                max_drafts=2)
    ref = st.clone()
    errs, errs1, later_vs_kernel, later_same = [], [], [], True
    for i in range(9):
        one = st.clone()            # the reference from the kernel's own store: one call
        if i % 3 == 2:
            kw = kernel_inputs(kind, S, B, T=2, seed=i, device=device)
            y = f["verify"](st, **kw, state_indices=idx)
            y2 = f["verify_ref"](ref, **kw, state_indices=idx)
            y1 = f["verify_ref"](one, **kw, state_indices=idx)
            n = torch.tensor([2, 0, 1, 2, 0, 1, 2], device=device)
            replay_accept(st, n, idx)
            replay_accept_ref(ref, n, idx)
        else:
            kw = kernel_inputs(kind, S, B, seed=i, device=device)
            out_t = torch.full((B, S["H"], S["dv"]), float("nan"), device=device)
            sp = st.clone()
            y = f["step"](st, **kw, state_indices=idx, out=out_t, path="replay")
            y2 = f["step_ref"](ref, **kw, state_indices=idx, path="replay")
            y1 = f["step_ref"](one, **kw, state_indices=idx, path="replay")
            ys = f["step"](sp, **kw, state_indices=idx, path="replay", advance=False)
            advance_pointers(sp, idx)
            later_vs_kernel.append(max_rel(y, ys))
            later_same &= bool(torch.equal(sp.committed, st.committed)
                               and torch.equal(sp.n_flush, st.n_flush)
                               and torch.equal(sp.anchor.payload, st.anchor.payload)
                               and not st.arrive.any())
            del sp
        finite = bool(torch.isfinite(y).all())
        errs.append(max_rel(y, y2) if finite else float("nan"))
        errs1.append(max_rel(y, y1) if finite else float("nan"))
        del one
    return {"max_rel_y": max(errs), "max_rel_y_one_call": max(errs1),
            "pointers_equal": bool(torch.equal(st.committed, ref.committed)
                                   and torch.equal(st.n_flush, ref.n_flush)),
            "anchor": state_diff(st.anchor.dequantize(), ref.anchor.dequantize()),
            "read": state_diff(st.read_role.dequantize(), ref.read_role.dequantize()),
            "n_flush": st.n_flush.tolist(),
            "advance_later_vs_in_kernel_max_rel_y": max(later_vs_kernel),
            "advance_later_pointers_anchor_equal": later_same}


def _conventional_check(kind, S, f, init, fmt, rnd, idx, device) -> dict:
    """Three conventional steps, then a conventional verify of 3 drafts with its snapshots and an
    accept, on a store in `fmt` rounded `rnd`, against the torch references."""
    B = idx.shape[0]
    cs = ConventionalStore.from_state(init, fmt, rnd, seed=2)
    ref = cs.clone()
    errs = []
    for i in range(3):
        kw = kernel_inputs(kind, S, B, seed=20 + i, device=device)
        errs.append(max_rel(f["conv"](cs, **kw, state_indices=idx),
                            f["conv_ref"](ref, **kw, state_indices=idx)))
    snaps, snaps_ref = make_snapshots(cs, 3), make_snapshots(ref, 3)
    kw = kernel_inputs(kind, S, B, T=3, seed=30, device=device)
    errs.append(max_rel(f["cverify"](cs, snaps, **kw, state_indices=idx),
                        f["cverify_ref"](ref, snaps_ref, **kw, state_indices=idx)))
    n = torch.tensor([3, 0, 1, 2, 0, 3, 1], device=device)
    conventional_accept(cs, snaps, n, idx)
    conventional_accept_ref(ref, snaps_ref, n, idx)
    return {"max_rel_y": max(errs), "state": state_diff(cs.state.dequantize(), ref.state.dequantize())}


def conventional_checks(kind, S, idx, device, N=6, steps=3) -> dict:
    """gpu_checks for a kind with a conventional step only (KDA): the kernel against its torch
    reference over `steps` steps on padded slot indices, FP32 and FP16 with stochastic rounding."""
    f = kernel_fns(kind)
    init = random_state(N, S["H"], S["dv"], S["dk"], seed=1, device=device)
    out = {}
    for fmt, rnd in (("fp32", "nearest"), ("fp16", "stochastic")):
        cs = ConventionalStore.from_state(init, fmt, rnd, seed=2)
        ref = cs.clone()
        errs = []
        for i in range(steps):
            kw = kernel_inputs(kind, S, idx.shape[0], seed=20 + i, device=device)
            y = torch.full((idx.shape[0], S["H"], S["dv"]), float("nan"), device=device)
            errs.append(max_rel(f["conv"](cs, **kw, state_indices=idx, out=y),
                                f["conv_ref"](ref, **kw, state_indices=idx)))
        out[f"{kind}/conventional/{fmt}-{rnd}"] = {
            "max_rel_y": max(errs), "state": state_diff(cs.state.dequantize(), ref.state.dequantize()),
            "n_casts_equal": bool(torch.equal(cs.n_flush, ref.n_flush))}
        del cs, ref
    return out
