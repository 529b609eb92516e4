"""Decode-kernel benchmark (`replayquant bench kernels`, GPU). Its random inputs are
replayquant.bench.inputs, which the kernel tests draw from too."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import torch

from replayquant.bench.inputs import (cpu_generator, gdn_params, gdn_step_inputs,
                                      kda_step_inputs, mamba2_params, mamba2_step_inputs,
                                      random_state)
from replayquant.outputs import (check_out_folder, check_owned, output_lock, save_figure,
                                 write_json, write_text)

# ---------------------------------------------------------------------------- shapes

SHAPES = {
    # Qwen3.5-4B Gated DeltaNet layer: 32 value heads, 16 key heads, d_k = d_v = 128
    "gdn": dict(kind="gdn", H=32, HK=16, dv=128, dk=128),
    # Nemotron-H Mamba-2 layer: 128 heads, head dim 64, state 128, 8 groups
    "mamba2": dict(kind="mamba2", H=128, HK=8, dv=64, dk=128),
    # Kimi-Linear-48B Kimi Delta Attention layer (transformers' KimiLinearConfig: 32 linear heads,
    # head dim 128; q, k, v heads equal)
    "kda": dict(kind="kda", H=32, HK=32, dv=128, dk=128),
}
# speculative rounds, the authors' kernels and the float64 accuracy comparison cover GDN and
# Mamba-2 (KDA has no conventional verify kernel, the authors none for KDA)
SPEC_KINDS = ("gdn", "mamba2")
PEERS = {"gdn": ("peer:fla", "fla fused_recurrent_gated_delta_rule"),
         "mamba2": ("peer:mamba_ssm", "mamba_ssm selective_state_update"),
         "kda": ("peer:fla", "fla fused_recurrent_kda")}


# ---------------------------------------------------------------------------- bytes moved

# The byte model is shared with the sweep (replayquant.statebytes): one count of what a
# decode step moves, for the rows' `bytes`, byte ratios and copy-bandwidth ceilings here.
from replayquant.statebytes import (conventional_bytes, replay_flush_step_bytes,  # noqa: E402,F401
                                    replay_read_step_bytes, replay_window_bytes, ring_u_bytes,
                                    state_bytes)
from replayquant.statebytes import entry_bytes as _entry_bytes  # noqa: E402,F401
from replayquant.statebytes import io_bytes as _io_bytes  # noqa: E402

# the targets of the decode kernels, from the rows of a run (replayquant.bench.targets)
from replayquant.bench.targets import targets  # noqa: E402,F401


# ---------------------------------------------------------------------------- timing

def copy_bandwidth_GBps(device="cuda") -> float:
    """Device copy bandwidth (bytes read + written) of a 1 GiB float32 copy, do_bench median."""
    import triton.testing
    x = torch.randn(2 ** 28, device=device)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
    del x, y
    return 2 * 2 ** 28 * 4 / ms / 1e6


def graph_ms(fn, n_calls: int, warmup: int = 2) -> float:
    """GPU time per call of `fn` (ms): warm up (compiles), capture n_calls into a CUDA graph, time
    its replays with triton.testing.do_bench (median; L2 flushed before each replay)."""
    import triton.testing
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


_CPU_TIMING = {"on": False}


def time_calls(fn, n_calls: int) -> float:
    """ms per call: graph_ms on a GPU; on the CPU (smoke runs of the benchmark's code in the
    Triton interpreter, never results) at most two calls timed with perf_counter."""
    if not _CPU_TIMING["on"]:
        return graph_ms(fn, n_calls)
    import time
    n = min(n_calls, 2)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) * 1e3 / n


def _empty_cache():
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plain_ms(fn) -> float:
    """do_bench median of fn without a graph (Python launch overhead included; the peer table of
    DESIGN section 6 was measured this way)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# ---------------------------------------------------------------------------- the run

PAIR_L = {"gdn": 16, "mamba2": 8, "kda": 16}


def _kw(kind, S, B, T=None, seed=0, device="cuda"):
    """Kernel keyword arguments of one step (T None) or T drafts."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
        A_log, dtb = gdn_params(H, seed, device)
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dtb)
    if kind == "kda":
        q, k, v, g, beta = kda_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
        return dict(q=q, k=k, v=v, g=g, beta=beta)
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
    A, D, dtb = mamba2_params(H, seed, device)
    return dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D, z=z, dt_bias=dtb)


def _fns(kind):
    from replayquant.kernels import conventional as cv
    from replayquant.kernels import replay_decode as rd
    from replayquant.kernels import replay_ref as rr
    from replayquant.kernels import verify as vf
    if kind == "gdn":
        return dict(conv=cv.conventional_gdn_step, conv_ref=cv.conventional_gdn_step_ref,
                    step=rd.replay_gdn_step, step_ref=rr.replay_gdn_step_ref,
                    verify=vf.replay_gdn_verify, verify_ref=rr.replay_gdn_verify_ref,
                    cverify=vf.conventional_gdn_verify, cverify_ref=vf.conventional_gdn_verify_ref)
    if kind == "kda":                       # no conventional KDA verify kernel
        return dict(conv=cv.conventional_kda_step, conv_ref=cv.conventional_kda_step_ref,
                    step=rd.replay_kda_step, step_ref=rr.replay_kda_step_ref,
                    verify=vf.replay_kda_verify, verify_ref=rr.replay_kda_verify_ref)
    return dict(conv=cv.conventional_mamba2_step, conv_ref=cv.conventional_mamba2_step_ref,
                step=rd.replay_mamba2_step, step_ref=rr.replay_mamba2_step_ref,
                verify=vf.replay_mamba2_verify, verify_ref=rr.replay_mamba2_verify_ref,
                cverify=vf.conventional_mamba2_verify, cverify_ref=vf.conventional_mamba2_verify_ref)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def _state_cmp(a, b):
    d = (a - b).abs()
    scale = b.abs().max().clamp(min=1e-30)
    return {"max_rel": float(d.max() / scale), "frac_gt_1e-5": float((d > 1e-5 * scale).float().mean())}


def _ref_cast_device_vs_cpu(device) -> dict:
    """The torch reference casts (the specification) run on the device against the same casts
    on the CPU, bit for bit; for each format, the fraction of payload codes that differ."""
    from replayquant.kernels import quant_ref as qref
    g = cpu_generator(11)
    x = torch.randn(256, 128, 128, generator=g) * 10 ** torch.randn(256, 128, 1, generator=g)
    res = {}
    for name, fn in (("fp8", qref.fp8_quantize_ref), ("nvfp4", qref.nvfp4_quantize_ref)):
        got = [t.cpu() for t in fn(x.to(device))]
        want = fn(x)
        bits = [tuple(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in ts)
                for ts in (got, want)]
        res[name] = {"equal": all(torch.equal(a, b) for a, b in zip(*bits)),
                     "payload_codes_differing": float((bits[0][0] != bits[1][0]).float().mean())}
    return res


def gpu_checks(device="cuda") -> dict:
    """The kernel-vs-reference comparisons of the CPU tests, on the GPU at the real head shapes."""
    from replayquant.kernels.replay_decode import advance_pointers
    from replayquant.kernels.stores import ConventionalStore, ReplayStore
    from replayquant.kernels.replay_ref import replay_accept_ref
    from replayquant.kernels.verify import (conventional_accept, conventional_accept_ref,
                                            make_snapshots, replay_accept)
    from replayquant.pairs import PrecisionPair
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"reference_cast_device_equals_cpu": _ref_cast_device_vs_cpu(device)}
    N = 6
    idx = torch.tensor([5, -1, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)
    B = idx.shape[0]
    for kind, S in SHAPES.items():
        f = _fns(kind)
        H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
        init = random_state(N, H, dv, dk, seed=1, device=device)
        for pair, ud in (("s32_rs", torch.float32), ("tp4_hi32", torch.float32),
                         ("tp4_hi16_sr", torch.bfloat16)):
            P = PrecisionPair.load(pair).with_buffer_len(4)
            st = ReplayStore.from_state(init, P, kind, key_heads=HK, seed=3, u_dtype=ud,
                                        max_drafts=2)
            ref = st.clone()
            errs, errs1, later_vs_kernel, later_same = [], [], [], True
            for i in range(9):
                one = st.clone()            # the reference from the kernel's own store: one call
                if i % 3 == 2:
                    kw = _kw(kind, S, B, T=2, seed=i, device=device)
                    y = f["verify"](st, **kw, state_indices=idx)
                    y2 = f["verify_ref"](ref, **kw, state_indices=idx)
                    y1 = f["verify_ref"](one, **kw, state_indices=idx)
                    n = torch.tensor([2, 0, 1, 2, 0, 1, 2], device=device)
                    replay_accept(st, n, idx)
                    replay_accept_ref(ref, n, idx)
                else:
                    kw = _kw(kind, S, B, seed=i, device=device)
                    out_t = torch.full((B, H, dv), float("nan"), device=device)
                    sp = st.clone()
                    y = f["step"](st, **kw, state_indices=idx, out=out_t, path="replay")
                    y2 = f["step_ref"](ref, **kw, state_indices=idx, path="replay")
                    y1 = f["step_ref"](one, **kw, state_indices=idx, path="replay")
                    ys = f["step"](sp, **kw, state_indices=idx, path="replay", advance=False)
                    advance_pointers(sp, idx)
                    later_vs_kernel.append(_rel(y, ys))
                    later_same &= bool(torch.equal(sp.committed, st.committed)
                                       and torch.equal(sp.n_flush, st.n_flush)
                                       and torch.equal(sp.anchor.payload, st.anchor.payload)
                                       and not st.arrive.any())
                    del sp
                finite = bool(torch.isfinite(y).all())
                errs.append(_rel(y, y2) if finite else float("nan"))
                errs1.append(_rel(y, y1) if finite else float("nan"))
                del one
            out[f"{kind}/replay/{pair}"] = {
                "max_rel_y": max(errs), "max_rel_y_one_call": max(errs1),
                "pointers_equal": bool(torch.equal(st.committed, ref.committed)
                                       and torch.equal(st.n_flush, ref.n_flush)),
                "anchor": _state_cmp(st.anchor.dequantize(), ref.anchor.dequantize()),
                "read": _state_cmp(st.read_role.dequantize(), ref.read_role.dequantize()),
                "n_flush": st.n_flush.tolist(),
                "advance_later_vs_in_kernel_max_rel_y": max(later_vs_kernel),
                "advance_later_pointers_anchor_equal": later_same}
            del st, ref
        if "cverify" not in f:                  # KDA: the conventional step alone
            out.update(conventional_checks(kind, S, idx, device))
            continue
        for fmt, rnd in (("fp32", "nearest"), ("fp16", "stochastic")):
            cs = ConventionalStore.from_state(init, fmt, rnd, seed=2)
            ref = cs.clone()
            errs = []
            for i in range(3):
                kw = _kw(kind, S, B, seed=20 + i, device=device)
                errs.append(_rel(f["conv"](cs, **kw, state_indices=idx),
                                 f["conv_ref"](ref, **kw, state_indices=idx)))
            snaps, snaps_ref = make_snapshots(cs, 3), make_snapshots(ref, 3)
            kw = _kw(kind, S, B, T=3, seed=30, device=device)
            errs.append(_rel(f["cverify"](cs, snaps, **kw, state_indices=idx),
                             f["cverify_ref"](ref, snaps_ref, **kw, state_indices=idx)))
            n = torch.tensor([3, 0, 1, 2, 0, 3, 1], device=device)
            conventional_accept(cs, snaps, n, idx)
            conventional_accept_ref(ref, snaps_ref, n, idx)
            out[f"{kind}/conventional/{fmt}-{rnd}"] = {
                "max_rel_y": max(errs), "state": _state_cmp(cs.state.dequantize(), ref.state.dequantize())}
            del cs, ref, snaps, snaps_ref
    return out


def conventional_checks(kind, S, idx, device, N=6, steps=3) -> dict:
    """gpu_checks for a kind with a conventional step only (KDA): the kernel against its torch
    reference over `steps` steps on padded slot indices, FP32 and FP16 with stochastic rounding."""
    from replayquant.kernels.stores import ConventionalStore
    f = _fns(kind)
    init = random_state(N, S["H"], S["dv"], S["dk"], seed=1, device=device)
    out = {}
    for fmt, rnd in (("fp32", "nearest"), ("fp16", "stochastic")):
        cs = ConventionalStore.from_state(init, fmt, rnd, seed=2)
        ref = cs.clone()
        errs = []
        for i in range(steps):
            kw = _kw(kind, S, idx.shape[0], seed=20 + i, device=device)
            y = torch.full((idx.shape[0], S["H"], S["dv"]), float("nan"), device=device)
            errs.append(_rel(f["conv"](cs, **kw, state_indices=idx, out=y),
                             f["conv_ref"](ref, **kw, state_indices=idx)))
        out[f"{kind}/conventional/{fmt}-{rnd}"] = {
            "max_rel_y": max(errs), "state": _state_cmp(cs.state.dequantize(), ref.state.dequantize()),
            "n_casts_equal": bool(torch.equal(cs.n_casts, ref.n_casts))}
        del cs, ref
    return out


def _peer_gdn():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return fused_recurrent_gated_delta_rule


def _mamba_ssm_commit():
    """The state-spaces/mamba commit of the importable mamba_ssm: a COMMIT file at the top of the
    package (the device carries only its selective_state_update modules), else its version."""
    try:
        import mamba_ssm
    except Exception:  # noqa: BLE001 (peers are optional)
        return None
    from pathlib import Path
    f = Path(mamba_ssm.__file__).parent / "COMMIT"
    return f.read_text().strip() if f.is_file() else getattr(mamba_ssm, "__version__", "?")


def _peer_mamba():
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return selective_state_update


def peer_call(kind, S, kw, state):
    """One decode step of the peer kernel on our inputs (state layout [B, H, d_v, d_k])."""
    if kind == "gdn":
        fn = _peer_gdn()
        o, fs = fn(kw["q"].unsqueeze(1), kw["k"].unsqueeze(1), kw["v"].unsqueeze(1),
                   g=kw["a"].unsqueeze(1), beta=kw["b"].unsqueeze(1),
                   scale=S["dk"] ** -0.5, initial_state=state, output_final_state=True,
                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=kw["A_log"],
                   dt_bias=kw["dt_bias"], use_beta_sigmoid_in_kernel=True, state_v_first=True)
        return o[:, 0], fs
    if kind == "kda":       # the layer's call: log decay g and beta after the gate and sigmoid
        from fla.ops.kda import fused_recurrent_kda
        o, fs = fused_recurrent_kda(kw["q"].unsqueeze(1), kw["k"].unsqueeze(1),
                                    kw["v"].unsqueeze(1), g=kw["g"].unsqueeze(1),
                                    beta=kw["beta"].unsqueeze(1), scale=S["dk"] ** -0.5,
                                    initial_state=state, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, state_v_first=True)
        return o[:, 0], fs
    fn = _peer_mamba()
    B, H, P = kw["x"].shape
    N = S["dk"]
    y = fn(state, kw["x"], kw["dt"].unsqueeze(-1).expand(B, H, P), kw["A"][:, None, None].expand(H, P, N),
           kw["B"], kw["C"], D=kw["D"][:, None].expand(H, P), z=kw["z"],
           dt_bias=kw["dt_bias"][:, None].expand(H, P), dt_softplus=True)
    return y, state


def peer_comparison(device="cuda") -> dict:
    """Our conventional FP32 step vs the peer on identical inputs: max abs difference."""
    from replayquant.kernels.stores import ConventionalStore
    out = {}
    B = 32
    for kind, S in SHAPES.items():
        try:
            f = _fns(kind)
            init = random_state(B, S["H"], S["dv"], S["dk"], seed=4, device=device)
            kw = _kw(kind, S, B, seed=5, device=device)
            cs = ConventionalStore.from_state(init, "fp32")
            y = f["conv"](cs, **kw)
            peer_state = init.clone()
            yp, sp = peer_call(kind, S, kw, peer_state)
            out[kind] = {"peer": PEERS[kind][1],
                         "max_abs_y": float((y - yp.float()).abs().max()),
                         "max_abs_y_ref_scale": float(y.abs().max()),
                         "peer_out_dtype": str(yp.dtype),
                         "max_abs_state": float((cs.state.payload - sp.float()).abs().max()),
                         "state_scale": float(sp.float().abs().max())}
        except Exception as e:  # noqa: BLE001 (peers are optional)
            out[kind] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _try(fn, errors: dict, key: str, default=None):
    import traceback
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (one failing section must not lose the rest)
        errors[key] = f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-2000:]
        print(f"[bench kernels] {key} failed: {type(e).__name__}: {e}", flush=True)
        return default


def _row(kind, kernel, variant, B, ms, nbytes, copy_bw, **extra):
    us = ms * 1e3
    gbps = nbytes / ms / 1e6 if nbytes else None
    r = dict(kind=kind, kernel=kernel, variant=variant, B=B, us=us, bytes=nbytes, GBps=gbps,
             pct_copy=None if gbps is None else 100 * gbps / copy_bw)
    r.update(extra)
    print(f"  {kind:6s} {kernel:24s} {variant:10s} B={B:4d} {us:9.1f} us"
          + (f" {gbps:7.0f} GB/s {r['pct_copy']:5.1f}%" if gbps else ""), flush=True)
    return r


PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32", "tp4_hi16_sr")      # the benchmark's pairs
GRID = dict(batches=(1, 8, 32, 128, 256, 512), Ls=(4, 8, 16, 32), pairs=PAIRS, Ts=(2, 4),
            spec_batches=(32, 256, 512))


def _pair(name, L):
    from replayquant.pairs import PrecisionPair
    P = PrecisionPair.load(name).with_buffer_len(L)
    return P, P.anchor.format, None if P.read is None else P.read.format


def _rotations(nbytes: float, device) -> int:
    """Copies of a state to cycle through so that every step finds its state cold in L2: enough
    copies to cover twice the L2 (1 on the CPU; at most 64)."""
    if _CPU_TIMING["on"] or not str(device).startswith("cuda"):
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2 ** 20)
    return int(min(64, max(1, math.ceil(2 * l2 / max(nbytes, 1.0)))))


# Launch-config candidates of the sweep, (rows, warps[, register cap]): the read launch (any
# tile), the flush launch of pairs that write no NVFP4 role, and of those that do (whole matrices)
READ_CANDIDATES = ((16, 1), (32, 1), (32, 2), (32, 4), (64, 2), (64, 2, 168), (64, 4), (128, 4))
FLUSH_CANDIDATES = {"plain": ((16, 1), (16, 2), (32, 2), (32, 4), (64, 4)),
                    "whole": ((None, 4), (None, 8), (None, 4, 168))}


def config_sweep(kind, B, device, copy_bw, pairs=PAIRS, L=None, S=None):
    """Launch configs timed at batch B on fresh stores (never by re-running a live in-place
    state): the conventional step (block_v, num_warps); per pair the replay read launch on a read
    step (h = L/2, pointers held) and the flush launch on a flush step (h = L - 1), each with the
    other launch at the table's config (on a read step the flush launch only reads pointers).
    Returns (rows, best config per kernel: 'conventional/fp32' and 'replay/PAIR' {'launch':
    {'read', 'flush'}})."""
    from replayquant.kernels.stores import ConventionalStore, ReplayStore
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    L = L or PAIR_L[kind]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    rows, cfg = [], {}

    cs = ConventionalStore.from_state(init, "fp32")
    cands = []
    # candidates: the (rows, warps) of an earlier, wider H200 sweep less those that never won
    for bv, nw in [(16, 1), (32, 4), (64, 8)]:
        if bv > dv:
            continue
        c = dict(block_v=bv, num_warps=nw)
        ms = time_calls(lambda: f["conv"](cs, **kw, state_indices=idx, out=out, advance=False, **c), 8)
        cands.append(_row(kind, "sweep/conventional", "fp32", B, ms,
                          conventional_bytes(kind, "fp32", B, H, HK, dv, dk), copy_bw, cfg=c))
    cfg["conventional/fp32"] = min(cands, key=lambda r: r["us"])["cfg"]
    rows += cands
    del cs
    for pair in pairs:
        P, af, rf = _pair(pair, L)
        st = ReplayStore.from_state(init, P, kind, key_heads=HK)
        nv = "nvfp4" in (af, rf)
        flush_c = FLUSH_CANDIDATES["whole" if nv else "plain"]
        pick = {}
        for which, h, cands_w, nbytes in (
                ("read", L // 2, READ_CANDIDATES,
                 replay_read_step_bytes(kind, rf or af, L // 2, B, H, HK, dv, dk,
                                        ring_u_bytes(af, rf), L)),
                ("flush", L - 1, flush_c,
                 replay_flush_step_bytes(kind, af, rf, L, B, H, HK, dv, dk))):
            cands = []
            for c in cands_w:
                if (c[0] or dv) > dv:
                    continue
                launch = {which: tuple(c)}
                st.committed.fill_(h)
                ms = time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out,
                                                  path="replay", advance=False, launch=launch),
                                8 if which == "read" else 4)
                cands.append(_row(kind, f"sweep/replay-{which}-step", pair, B, ms, nbytes,
                                  copy_bw, cfg={"launch": launch}, h=h, L=L))
            pick[which] = min(cands, key=lambda r: r["us"])["cfg"]["launch"][which]
            rows += cands
        cfg[f"replay/{pair}"] = {"launch": pick}
        del st
    _empty_cache()
    return rows, cfg


def _cfg(cfg, pair):
    """A pair's replay launch config, {'launch': ...} as picked by the sweep (step and verify
    alike), or {} (the launch table's)."""
    return dict(cfg.get(f"replay/{pair}", {}))


def bench_conventional(kind, B, device, copy_bw, cfg=None, S=None):
    """Conventional FP32 and BF16 steps at batch B (cold L2: state copies rotated)."""
    from replayquant.kernels.stores import ConventionalStore
    cfg = cfg or {}
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    rows = []
    for fmt in ("fp32", "bf16"):
        c = cfg.get("conventional/fp32", {})
        R = _rotations(B * H * state_bytes(fmt, dv, dk), device)
        css = [ConventionalStore.from_state(init, fmt) for _ in range(R)]
        calls = conv_calls(f, kw, idx, out, css, **c)
        ms = time_calls(lambda: [g() for g in calls], 8) / R
        rows.append(_row(kind, "conventional", fmt, B, ms,
                         conventional_bytes(kind, fmt, B, H, HK, dv, dk), copy_bw, config=c, rot=R))
        del css, calls
    del init
    _empty_cache()
    return rows


def _replay_setup(kind, B, pair, L, device, cfg, S):
    """Inputs, output buffer and R rotated ReplayStore copies (cold L2) of one (pair, L) at
    batch B: (H, HK, dv, dk, step functions, idx, inputs, out, anchor fmt, read fmt, config, R,
    stores)."""
    from replayquant.kernels.stores import ReplayStore
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    P, af, rf = _pair(pair, L)
    c = _cfg(cfg or {}, pair)
    per = B * H * (state_bytes(af, dv, dk) + (state_bytes(rf, dv, dk) if rf else 0))
    R = _rotations(per, device)
    sts = [ReplayStore.from_state(init, P, kind, key_heads=HK) for _ in range(R)]
    return H, HK, dv, dk, _fns(kind), idx, kw, out, af, rf, c, R, sts


def bench_replay(kind, B, pair, L, device, copy_bw, cfg=None, detail=False, forced=False,
                 pointer=False, S=None):
    """Replay rows of one (pair, L) at batch B, a step's two launches (pointer move inside): the
    mean step of a whole window of L steps (one flush per row; state copies rotated for a cold
    L2); with detail the read step (h = L/2) and the flush step alone; with forced the
    path='flush' step (every step flushes); with pointer the pointer kernel alone."""
    from replayquant.kernels.replay_decode import advance_pointers
    H, HK, dv, dk, f, idx, kw, out, af, rf, c, R, sts = _replay_setup(kind, B, pair, L, device,
                                                                     cfg, S)
    calls = [lambda st=st: f["step"](st, **kw, state_indices=idx, out=out, path="replay", **c)
             for st in sts]
    ms = time_calls(lambda: [g() for g in calls], L) / R
    rows = [_row(kind, "replay-window", pair, B, ms,
                 replay_window_bytes(kind, af, rf, L, B, H, HK, dv, dk), copy_bw, L=L, config=c,
                 rot=R, note="mean step over a window of L steps (one flush per row), pointer "
                             "move included")]
    st = sts[0]
    if detail:
        h = L // 2
        st.committed.fill_(h)
        ms = time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                          advance=False, **c), 8)
        rows.append(_row(kind, "replay-read-step", pair, B, ms,
                         replay_read_step_bytes(kind, rf or af, h, B, H, HK, dv, dk,
                                                ring_u_bytes(af, rf), L), copy_bw,
                         L=L, h=h, config=c))
        # the same read step with the read launch's registers capped (more programs an SM,
        # ptxas spilling what does not fit): occupancy against spills, side by side
        base = (c.get("launch") or {}).get("read") or (None, None)
        for regs in READ_REG_CAPS:
            lc = {**(c.get("launch") or {}), "read": (*base[:2], regs)}
            ms = time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out,
                                              path="replay", advance=False, launch=lc), 8)
            rows.append(_row(kind, f"replay-read-step-regs{regs}", pair, B, ms,
                             replay_read_step_bytes(kind, rf or af, h, B, H, HK, dv, dk,
                                                    ring_u_bytes(af, rf), L),
                             copy_bw, L=L, h=h, config={"launch": lc}))
        st.committed.fill_(L - 1)
        ms = time_calls(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                          advance=False, **c), 4)
        rows.append(_row(kind, "replay-flush-step", pair, B, ms,
                         replay_flush_step_bytes(kind, af, rf, L, B, H, HK, dv, dk), copy_bw,
                         L=L, config=c))
        st.committed.zero_()
    if forced:
        for kernel, opts, note in (
                ("replay-forced-flush", c, "path='flush': every step flushes, pointer move "
                 "included"),
                ("replay-forced-flush-layer", {**c, "advance": False}, "path='flush' without the "
                 "pointer move (a model advances the pointers once per token for all its "
                 "layers)")):
            calls = [lambda st=st, o=opts: f["step"](st, **kw, state_indices=idx, out=out,
                                                     path="flush", **o) for st in sts]
            ms = time_calls(lambda: [g() for g in calls], 8) / R
            rows.append(_row(kind, kernel, pair, B, ms, None, copy_bw, L=L, rot=R, note=note))
        if B <= ALTERNATE_MAX_B:
            rows += _alternated(kind, B, pair, L, f, kw, idx, out, sts, R, copy_bw)
    if pointer:
        ms = time_calls(lambda: advance_pointers(st, idx), 8)
        rows.append(_row(kind, "pointer-advance", "-", B, ms, None, copy_bw,
                         note="once per token for all layers of a model"))
    del sts, calls
    _empty_cache()
    return rows


READ_REG_CAPS = (168, 128)  # registers a thread of the read launch's capped variants (detail rows)
ALTERNATE_MAX_B = 8         # the forced step is timed alternately with the conventional one up to here
ALTERNATE_REPEATS = 3


def conv_calls(f, kw, idx, out, stores, **cfg) -> list:
    """One conventional step per (rotated) store, as calls of no arguments, pointers held."""
    return [lambda c=c: f["conv"](c, **kw, state_indices=idx, out=out, advance=False, **cfg)
            for c in stores]


def anchor_ways(f, kw, idx, out, sts) -> dict:
    """The two ways of running one compiled launch at small batch, each a list of calls over
    the rotated ReplayStores `sts`: the conventional FP32 kernel on ConventionalStore views of
    their anchors ('conv-on-anchor') and the replay step with path='flush' on empty buffers and
    no pointer move ('replay-forced-auto-layer')."""
    from replayquant.kernels.stores import ConventionalStore
    views = [ConventionalStore(s.anchor, s.n_flush, s.key) for s in sts]
    return {"conv-on-anchor": conv_calls(f, kw, idx, out, views),
            "replay-forced-auto-layer": [
                lambda st=st: f["step"](st, **kw, state_indices=idx, out=out, path="flush",
                                        advance=False) for st in sts]}


def alternate_ms(ways: dict, R: int, repeats: int, report=None) -> dict:
    """ms per step of each way (a list of R rotated calls, 8 steps each), the ways timed one
    after the other `repeats` times; report(way, repeat, ms) after each timing."""
    times = {k: [] for k in ways}
    for rep in range(repeats):
        for k, calls in ways.items():
            times[k].append(time_calls(lambda: [g() for g in calls], 8) / R)
            if report is not None:
                report(k, rep, times[k][-1])
    return times


def _alternated(kind, B, pair, L, f, kw, idx, out, sts, R, copy_bw):
    """anchor_ways timed alternately ALTERNATE_REPEATS times (medians): at small batch the same
    kernel timed later in one bench call read up to 11% slower on the H200 (the one kernel read
    3.07 us, then 3.42 us, in consecutive repetitions), so the batch-1 target compares these two
    rather than rows timed minutes apart."""
    kernels = {"conv-on-anchor": "conventional-alternated",
               "replay-forced-auto-layer": "replay-forced-auto-layer-alternated"}
    times = alternate_ms(anchor_ways(f, kw, idx, out, sts), R, ALTERNATE_REPEATS)
    conv = statistics.median(times["conv-on-anchor"])
    rows = []
    for way, ts in times.items():
        ms = statistics.median(ts)
        rows.append(_row(kind, kernels[way], "fp32" if way == "conv-on-anchor" else pair, B, ms,
                         None, copy_bw, L=L, rot=R, us_each=[t * 1e3 for t in ts],
                         speedup_vs_alternated_conv=conv / ms,
                         note="median of alternated timings (conventional kernel on the same "
                              "anchors / replay-forced-auto-layer)"))
    return rows


def bench_peers(kind, B, device, copy_bw, S=None):
    """Peer kernels (fla / mamba_ssm) on our inputs, FP32 and BF16 states: in a graph with the
    states rotated (cold L2, as our rows), and FP32 without a graph on one state."""
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    rows = []
    label = PEERS[kind][0]
    for sd in (torch.float32, torch.bfloat16):
        name = str(sd).split(".")[-1]
        esz = torch.finfo(sd).bits // 8
        io = B * H * _io_bytes(kind, H, HK, dv, dk)
        if label == "peer:fla":   # fla reads the state in its dtype and writes a new fp32 state
            nb = B * H * dv * dk * (esz + 4) + io
        else:
            nb = 2 * B * H * dv * dk * esz + io
        R = _rotations(B * H * dv * dk * esz, device)
        states = [init.to(sd) for _ in range(R)]
        ms = graph_ms(lambda: [peer_call(kind, S, kw, st) for st in states], 8) / R
        rows.append(_row(kind, label, name, B, ms, nb, copy_bw, rot=R))
        if sd == torch.float32:
            ms = plain_ms(lambda: peer_call(kind, S, kw, states[0]))
            rows.append(_row(kind, label + "(no graph)", name, B, ms, nb, copy_bw))
        del states
    del init
    _empty_cache()
    return rows


def bench_spec(kind, B, T, device, copy_bw, cfg=None, pairs=PAIRS, L=None, S=None):
    """Speculative rounds: replay verify + accept vs conventional per-draft snapshots + accept."""
    from replayquant.kernels.stores import ConventionalStore, ReplayStore
    from replayquant.kernels.verify import conventional_accept, make_snapshots, replay_accept
    cfg = cfg or {}
    S = S or SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    L = L or PAIR_L[kind]
    init = random_state(B, H, dv, dk, seed=B + 1, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, T=T, seed=3, device=device)
    g = torch.Generator().manual_seed(B)
    n = torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32).to(device)
    tokens = B * (float(n.float().mean()) + 1.0)       # accepted drafts + the bonus token
    out = torch.empty(B, T, H, dv, device=device)
    rows = []
    # the measured round, and the same round with every draft rejected: nothing is committed,
    # so no row ever flushes; the difference between the two is what the flushes cost
    rounds = (("spec-replay-round", n), ("spec-replay-round-no-flush", torch.zeros_like(n)))
    for pair in pairs:
        c = _cfg(cfg, pair)
        for kernel, acc in rounds:
            st = ReplayStore.from_state(init, _pair(pair, L)[0], kind, key_heads=HK, max_drafts=T)

            def rnd():
                f["verify"](st, **kw, state_indices=idx, out=out, **c)
                replay_accept(st, acc, idx, check=False)
            ms = time_calls(rnd, 8)
            if acc is n:
                extra = dict(tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()))
            else:
                extra = dict(note="every draft rejected: verify + pointer move, never a flush")
            rows.append(_row(kind, kernel, pair, B, ms, None, copy_bw, T=T, L=L, **extra))
            del st
    cs = ConventionalStore.from_state(init, "fp32")
    snaps = make_snapshots(cs, T)
    c = cfg.get("conventional/fp32", {})
    ms = time_calls(lambda: f["cverify"](cs, snaps, **kw, state_indices=idx, out=out, **c), 8)
    sb = state_bytes("fp32", dv, dk)
    nbv = B * H * ((1 + T) * sb + T * _io_bytes(kind, H, HK, dv, dk))
    rows.append(_row(kind, "spec-snapshot-verify", "fp32", B, ms, nbv, copy_bw, T=T))

    def rndc():
        f["cverify"](cs, snaps, **kw, state_indices=idx, out=out, **c)
        conventional_accept(cs, snaps, n, idx, check=False)
    ms = time_calls(rndc, 8)
    frac = float((n > 0).float().mean())
    rows.append(_row(kind, "spec-snapshot-round", "fp32", B, ms, nbv + B * H * 2 * sb * frac, copy_bw,
                     T=T, tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()),
                     note="verify + restore of snapshot n (a copy) for rows with n > 0"))
    del cs, snaps, init
    _empty_cache()
    return rows


def no_gpu(script: str) -> bool:
    """True, after one clear error on stderr, where there is no CUDA GPU: the guard of the GPU
    scripts under evals/ (their checks and times need the device)."""
    if torch.cuda.is_available():
        return False
    print(f"{script}: needs a CUDA GPU; run it on a machine with one (evals/gpu_runs.sh)",
          file=sys.stderr)
    return True


def _derive(rows):
    """Speedups over our conventional FP32 step and the peer at the same (kind, B), and of each
    speculative replay round over the snapshot round at the same (kind, B, T)."""
    base = {(r["kind"], r["B"]): r["us"] for r in rows
            if r["kernel"] == "conventional" and r["variant"] == "fp32"}
    peer = {(r["kind"], r["B"], r["variant"]): r["us"] for r in rows
            if r["kernel"] in ("peer:fla", "peer:mamba_ssm")}
    snap = {(r["kind"], r["B"], r.get("T")): r["us"] for r in rows
            if r["kernel"] == "spec-snapshot-round"}
    for r in rows:
        k = (r["kind"], r["B"])
        if r["kernel"] in ("conventional", "replay-window", "replay-read-step", "replay-forced-flush",
                           "replay-forced-flush-layer", "replay-forced-auto-layer",
                           "replay-window-staggered", "authors", "authors-staggered",
                           "sweep/conventional", "sweep/replay-read-step") and k in base:
            r["speedup_vs_conv_fp32"] = base[k] / r["us"]
            p = peer.get((r["kind"], r["B"], "float32"))
            if p:
                r["speedup_vs_peer_fp32"] = p / r["us"]
        if r["kernel"] == "spec-replay-round" and (*k, r.get("T")) in snap:
            r["speedup_vs_snapshot_round"] = snap[(*k, r.get("T"))] / r["us"]
    return rows


def _find(rows, **kv):
    return [r for r in rows if all(r.get(k) == v for k, v in kv.items())]


def render_markdown(res) -> str:
    pv = res["provenance"]
    fmt = lambda v, p=".2f": "" if v is None else format(v, p)  # noqa: E731
    rows = res["rows"]
    lines = [f"# Decode kernels on {pv['device']}", "",
             f"git {pv['git_commit']}, {pv['date']}; device copy bandwidth {res['copy_GBps']:.0f} "
             "GB/s (read + write, measured in this run). Times: CUDA graph of the steps, "
             "`triton.testing.do_bench` median, L2 flushed before each replay, and state copies "
             "rotated inside the graph so that every step finds its state cold (`rot` copies, "
             "2x L2). Bytes: what each kernel must move (state, buffer, inputs, output) as counted "
             "in `replayquant/bench/decode.py`. Speedups are over our conventional FP32 step at "
             "the same batch.", ""]
    if res.get("copy_GBps_parts"):
        lines += [f"Merged from {len(pv['parts'])} runs of this commit (`replayquant bench merge`),"
                  " one device call each; the copy bandwidth above is their mean, each row's % of "
                  "copy uses its own run's, and speedups compare rows of one run:", ""]
        lines += [f"* part {i}: {p['file']}, {p['date']}, kinds {p['kinds']}, copy "
                  f"{fmt(p['copy_GBps'], '.0f')} GB/s" for i, p in enumerate(pv["parts"])]
        lines.append("")
    if res.get("skipped"):
        lines += ["Not measured (time budget, or the reason given): " + ", ".join(res["skipped"]),
                  ""]
    tg = res.get("targets") or []
    if tg:
        lines += ["## Targets", "", "Ratios: the baseline's time over ours (the smallest over "
                  "the entry's rows); floor: the counted bytes at this run's copy bandwidth.", "",
                  "| target | measured | met | floor (us) |", "| --- | --- | --- | --- |"]
        for t in tg:
            m = (t.get("reason") or "not measured") if t["met"] is None else \
                ("yes" if t["met"] else "no")
            v = "" if t["measured"] is None else f"{t['measured']:.4g} {t['unit']}"
            lines.append(f"| {t['target']} | {v} | {m} | {t.get('floor_us', '')} |")
        lines.append("")
    for kind, a in (res.get("accuracy") or {}).items():
        lines += [f"## {kind}: relative Frobenius error after {a['windows']} windows (B = "
                  f"{a['B']}, L = {a['L']}) against a float64 recurrence", "",
                  "| kernel | variant | state / anchor | outputs |", "| --- | --- | ---: | ---: |"]
        for who in ("ours", "authors", "ours_vs_authors"):
            for v, d in a.get(who, {}).items():
                st = d.get("anchor", d.get("state"))
                lines.append(f"| {who} | {v} | {st:.2e} | {d['outputs']:.2e} |")
        lines.append("")
    for kind in SHAPES:
        Bs = sorted({r["B"] for r in _find(rows, kind=kind) if not r["kernel"].startswith(("sweep", "spec"))})
        if not Bs:
            continue
        lines += [f"## {kind}: us per step (x conventional FP32)", "",
                  "| kernel | variant | L | " + " | ".join(f"B={B}" for B in Bs) + " |",
                  "| --- | --- | ---: | " + " | ".join("---:" for _ in Bs) + " |"]
        keys = []
        for r in _find(rows, kind=kind):
            if r["kernel"].startswith(("sweep", "spec")):
                continue
            k = (r["kernel"], r["variant"], r.get("L"))
            if k not in keys:
                keys.append(k)
        for k in keys:
            cells = []
            for B in Bs:
                m = [r for r in _find(rows, kind=kind, kernel=k[0], variant=k[1], B=B)
                     if r.get("L") == k[2]]
                if not m:
                    cells.append("")
                    continue
                r = m[0]
                c = f"{r['us']:.1f}"
                if r.get("speedup_vs_conv_fp32") is not None:
                    c += f" ({r['speedup_vs_conv_fp32']:.2f}x)"
                if r.get("pct_copy") is not None and k[0].startswith(
                        ("conventional", "replay-read-step", "replay-flush-step")) \
                        or k[0].startswith("peer"):
                    c += f" {fmt(r.get('pct_copy'), '.0f')}%"
                cells.append(c)
            lines.append(f"| {k[0]} | {k[1]} | {'' if k[2] is None else k[2]} | " + " | ".join(cells) + " |")
        lines.append("")
    spec = [r for r in rows if r["kernel"].startswith("spec")]
    if spec:
        lines += ["## Speculative decoding (T drafts per round, fixed random accept counts)", "",
                  "| kind | kernel | variant | B | T | L | us/round | tokens/s | x snapshot round |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in spec:
            lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {r['T']} | "
                         f"{r.get('L', '')} | {r['us']:.1f} | {fmt(r.get('tokens_per_s'), '.3g')} | "
                         f"{fmt(r.get('speedup_vs_snapshot_round'))} |")
        lines.append("")
    sweep = [r for r in rows if r["kernel"].startswith("sweep")]
    if sweep:
        lines += ["## Launch-config sweep", "", "| kind | kernel | variant | B | block_v | warps | us/step |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in sweep:
            c = r["cfg"]
            bv, nw = (tuple(next(iter(c["launch"].values())))[:2] if "launch" in c
                      else (c.get("block_v"), c.get("num_warps")))
            lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {bv} | "
                         f"{nw} | {r['us']:.1f} |")
    if res.get("errors"):
        lines += ["", "Sections that failed: " + ", ".join(res["errors"])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- plan and run

# Seconds per timed measurement: a fixed cost (do_bench warmup + reps, graph capture), a compile
# per new kernel specialization, setup + timed replays that grow with the bytes of the states,
# and Python launches of the rotated small-batch windows (captured, warmed up twice), and the
# casts of stores with a stochastic-rounding role (sr_per_GB). The GPU checks compile every
# kernel on a fresh machine. Fitted by non-negative least squares to the section_s times of 470
# sections (868 s) of H200 grids on fresh machines (cold-L2 rotations): the grid in four calls
# (333 s, nothing skipped) and in one call with checks and sweep (535 s of sections). A store
# built on a GPU draws its Philox bits there (philox.random_bits_torch), so the SR casts cost
# nothing measurable (sr_per_GB 0; the term stays for the model's shape), nor do the Python
# launches of the small-batch windows (launch 0). The whole grid, checks and sweep included,
# is ~520 s by this fit: two device calls (e.g. --kinds gdn / --kinds mamba2), not one.
_EST = dict(fixed=0.26, compile=1.46, per_GB=0.098, checks=49.0, copy=3.0, peer=0.12, launch=0.0,
            sr_per_GB=0.0)


def _sr_pair(name) -> bool:
    """Whether pair `name` has a role with stochastic rounding."""
    from replayquant.pairs import PrecisionPair
    P = PrecisionPair.load(name)
    return any(r is not None and r.rounding == "stochastic" for r in (P.anchor, P.read))


def _launches(kind, B, L, S, rot=True):
    """Python kernel launches of one rotated window measurement (3 passes: 2 warm-ups, capture)."""
    if not rot:
        return 0
    gb = _gb(kind, B, S)
    R = min(64, max(1, math.ceil(0.1 / max(gb, 1e-9))))      # 2x a 50 MB L2
    return 3 * 3 * R * L


def _gb(kind, B, S=None):
    S = S or SHAPES[kind]
    return B * S["H"] * S["dv"] * S["dk"] * 4 / 1e9


def _check_names(pairs, kinds) -> None:
    """One clear error for a pair or layer kind the benchmark does not know."""
    bad = [p for p in pairs if p not in PAIRS]
    if bad:
        raise ValueError(f"pairs {bad}: choose from {list(PAIRS)}")
    bad = [k for k in kinds if k not in SHAPES]
    if bad:
        raise ValueError(f"kinds {bad}: choose from {', '.join(SHAPES)}")


def plan(batches=GRID["batches"], Ls=GRID["Ls"], pairs=PAIRS, Ts=GRID["Ts"],
         spec_batches=GRID["spec_batches"], kinds=None, peers=True, checks=True,
         sweep=True, detail_batches=(256,), shapes=None, authors=False, staggered_batches=(), main_L_only=False, accuracy=False):
    """The benchmark's sections in priority order, each (key, estimated seconds, what): the
    targets first (conventional, every pair at the kind's main L, the authors' windows and the
    staggered windows, T = 4 at the largest spec batch), then the peers, the other L values (none with
    main_L_only) and the other T values. authors: the authors' rows (bench.authors);
    staggered_batches: where the windows are also timed with rows out of phase; accuracy: the
    float64 comparison after the checks. kinds: default every kind of `shapes`; speculative
    rounds, the authors' rows and the accuracy comparison for SPEC_KINDS only."""
    shapes = shapes or SHAPES
    kinds = tuple(shapes) if kinds is None else tuple(kinds)
    _check_names(pairs, kinds)
    kinds_all = kinds
    E = _EST
    P = len(pairs)
    sr = {p: _sr_pair(p) for p in pairs}       # stores of these pairs are slow to build
    sec = []
    if checks:
        sec.append(("checks", E["checks"], ("checks",)))
    for kind in [k for k in kinds if k in SPEC_KINDS] if accuracy else ():   # against float64: ours, the authors' (bench.authors)
        sec.append((f"accuracy/{kind}", E["compile"] * (2 * len(pairs) + 4 * authors) + 2.0,
                    ("accuracy", kind)))
    for kind in kinds:
        if sweep:
            n = 3 + P * (len(READ_CANDIDATES) + 5)
            sec.append((f"sweep/{kind}", n * (E["fixed"] + E["compile"] * 0.6)
                        + n * 1.5 * _gb(kind, 256, shapes[kind]) * E["per_GB"], ("sweep", kind)))
    mainL = {k: (PAIR_L[k] if PAIR_L[k] in Ls else Ls[0]) for k in kinds}
    for kind in kinds_all:
        for B in batches:
            gb = _gb(kind, B, shapes[kind])
            sec.append((f"{kind}/B{B}/conventional", 2 * (E["fixed"] + gb * E["per_GB"])
                        + 2 * E["launch"] * _launches(kind, B, 8, shapes[kind])
                        + 2 * E["compile"] * (kind == "kda" and B == batches[0]),
                        ("conv", kind, B)))
            for pair in pairs if kind in kinds else ():
                det = B in detail_batches
                forced = pair == "s32_rs"
                alt = 2 * ALTERNATE_REPEATS * (forced and B <= ALTERNATE_MAX_B)
                n = 1 + (2 + len(READ_REG_CAPS)) * det + 2 * forced + (pair == pairs[0]) + alt
                sec.append((f"{kind}/B{B}/{pair}/L{mainL[kind]}",
                            n * E["fixed"] + (1 + det) * gb * E["per_GB"] * (mainL[kind] / 8)
                            + (E["compile"] * 2 if B == batches[0] else 0)
                            + (1 + 2 * forced + alt) * E["launch"]
                            * _launches(kind, B, mainL[kind], shapes[kind])
                            + sr[pair] * E["sr_per_GB"] * gb,
                            ("replay", kind, B, pair, mainL[kind], det, forced, pair == pairs[0],
                             )))
    n_sr = sum(sr.values())

    def spec_sections(T):
        for kind in [k for k in kinds if k in SPEC_KINDS]:
            for B in sorted(spec_batches, reverse=True):
                gb = _gb(kind, B, shapes[kind])
                rounds = (2 + (B >= 128)) * P + 2       # + the block-read round at B >= 128
                sec.append((f"spec/{kind}/B{B}/T{T}",
                            rounds * (E["fixed"] + gb * E["per_GB"] * (1 + T / 2))
                            + P * E["compile"] + 2 * n_sr * E["sr_per_GB"] * gb,
                            ("spec", kind, B, T)))
    # beside the authors' kernels (replayquant.bench.authors): their windows and our staggered
    # windows, then (below) their GDN speculative round
    for kind in [k for k in kinds if k in SPEC_KINDS]:
        L = mainL[kind]
        for B in batches:
            gb = _gb(kind, B, shapes[kind])
            stag = B in staggered_batches
            if authors:
                sec.append((f"authors/{kind}/B{B}", (1 + stag) * (E["fixed"] + gb * E["per_GB"]
                                                                  * (L / 8))
                            + (2 * E["compile"] if B == batches[0] else 0),
                            ("authors", kind, B, stag)))
            for pair in pairs if stag else ():
                sec.append((f"staggered/{kind}/B{B}/{pair}", E["fixed"] + gb * E["per_GB"]
                            * (L / 8), ("staggered", kind, B, pair)))
    bigT = max(Ts) if Ts else None
    if bigT:
        spec_sections(bigT)
        for kind in [k for k in kinds if k in SPEC_KINDS] if authors else ():
            for B in sorted(spec_batches, reverse=True):
                sec.append((f"spec-authors/{kind}/B{B}/T{bigT}", E["compile"] * 2 + E["fixed"]
                            + _gb(kind, B, shapes[kind]) * E["per_GB"] * (1 + bigT / 2),
                            ("spec-authors", kind, B, bigT)))
    if peers:                           # fla / mamba_ssm: before the other L values
        for kind in kinds_all:
            for B in batches:
                sec.append((f"peers/{kind}/B{B}", 3 * (E["peer"] + _gb(kind, B, shapes[kind])
                                                       * E["per_GB"])
                            + E["compile"] * (kind == "kda" and B == batches[0]),
                            ("peers", kind, B)))
    for kind in kinds:
        for L in Ls:
            if L == mainL[kind] or main_L_only:
                continue
            for B in batches:
                gb = _gb(kind, B, shapes[kind])
                for pair in pairs:          # the forced flush does not depend on L: main L only
                    sec.append((f"{kind}/B{B}/{pair}/L{L}",
                                E["fixed"] + gb * E["per_GB"] * (L / 8)
                                + (E["compile"] * 2 if B == batches[0] else 0)
                                + E["launch"] * _launches(kind, B, L, shapes[kind])
                                + sr[pair] * E["sr_per_GB"] * gb,
                                ("replay", kind, B, pair, L, False, False, False, False)))
    for T in Ts:
        if T != bigT:
            spec_sections(T)
    return sec


def estimate_s(sections) -> float:
    return _EST["copy"] + sum(s[1] for s in sections)


KERNELS_KIND = "replayquant.bench.kernels"   # the "kind" of NAME.json of bench kernels / merge


def _is_kernels(old: dict) -> bool:
    """A kernels JSON written before they carried a "kind"."""
    return {"provenance", "rows", "errors", "skipped", "copy_GBps"} <= set(old)


def check_kernels_out(out, name: str, writer: str, inputs=()) -> Path:
    """OUT/NAME.json, checked before any work: OUT is a folder that can be written, and NAME.json
    / .md / _speedup.png there are a kernels table's or absent (`replayquant.outputs.check_owned`;
    `inputs`: the files the command reads, never replaced)."""
    outp = check_out_folder(out, f"{writer} writes {name}.json, {name}.md and {name}_speedup.png")
    path = outp / f"{name}.json"
    check_owned(path, KERNELS_KIND, writer, inputs=inputs, unkinded=_is_kernels,
                beside=(outp / f"{name}.md", outp / f"{name}_speedup.png"))
    return path


def run_kernels_bench(out: str = "build/bench", name: str = "kernels", **kw) -> dict:
    """`_run_kernels_bench` (its options in `kw`) into the folder `out`, its NAME.json checked
    first (`check_kernels_out`) and locked from the checks to the last write."""
    path = check_kernels_out(out, name, "replayquant bench kernels")
    with output_lock(path):
        check_kernels_out(out, name, "replayquant bench kernels")     # again, holding the lock
        return _run_kernels_bench(out=out, name=name, **kw)


def _run_kernels_bench(out: str = "build/bench", batches=GRID["batches"], Ls=GRID["Ls"],
                      pairs=PAIRS, Ts=GRID["Ts"], spec_batches=GRID["spec_batches"],
                      kinds=None, peers: bool = True, checks: bool = True,
                      sweep: bool = True, detail_batches=(256,), budget_s: float = 500.0,
                      device: str = "cuda", name: str = "kernels", plot: bool = True,
                      shapes=None, authors=None,
                      authors_commit=None, staggered_batches=(256,), main_L_only=False,
                      accuracy=True) -> dict:
    """`replayquant bench kernels`: copy bandwidth, GPU checks, launch-config sweep, conventional
    / replay / peer decode steps over the grid (B x L x pair) and speculative rounds
    (T), in priority order (plan) under a time budget: sections whose estimate would pass
    budget_s are skipped and listed. Writes {name}.json (after every section), {name}.md and
    {name}_speedup.png. authors: a checkout of the ReplaySSM authors' fork, whose kernels are
    timed beside ours (replayquant.bench.authors; its commit from the checkout, or
    authors_commit); kinds (default: every kind of `shapes`), staggered_batches, main_L_only,
    accuracy: as plan.

    device 'cpu' is a smoke run of this code (tiny `shapes`, Triton interpreter, wall-clock
    timing): never a result."""
    import time
    from pathlib import Path

    from replayquant.provenance import provenance
    global SHAPES
    cpu = not str(device).startswith("cuda")
    if not cpu and not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU (device='cpu' only smoke-tests the code)")
    if cpu and shapes is None:
        raise ValueError("a CPU run needs tiny `shapes` (it only smoke-tests the benchmark code)")
    kinds = tuple(SHAPES if shapes is None else shapes) if kinds is None else tuple(kinds)
    _check_names(pairs, kinds)
    if any(T < 1 for T in Ts) or any(L < 1 for L in Ls) or not Ls \
            or not (batches or spec_batches):
        raise ValueError(f"need batches or spec batches, L >= 1 and T >= 1 (got "
                         f"{list(batches)}, {list(spec_batches)}, {list(Ls)}, {list(Ts)}); a "
                         "speculative T larger than the kind's L is skipped")
    from replayquant.bench import authors as side
    A = side.load(authors, authors_commit) if authors else None   # bad PATH: before measuring
    t0 = time.time()
    saved_shapes = SHAPES
    if shapes is not None:
        SHAPES = {k: shapes[k] for k in kinds}
    else:
        SHAPES = {k: saved_shapes[k] for k in kinds}
    _CPU_TIMING["on"] = cpu
    try:
        sections = plan(batches, Ls, pairs, Ts, spec_batches, tuple(SHAPES), peers and not cpu,
                        checks and not cpu, sweep, detail_batches, SHAPES, A is not None, staggered_batches, main_L_only, accuracy)
        est = estimate_s(sections)
        print(f"[bench kernels] {len(sections)} sections, estimated {est:.0f} s "
              f"(budget {budget_s:.0f} s"
              + ("; the full plan fits)" if est <= budget_s else
                 "; sections past the budget are skipped, lowest priority first: "
                 "pass a subset (--batches/--L/--pairs/--T) to choose)"), flush=True)
        params = dict(batches=list(batches), L=list(Ls), pairs=list(pairs), T=list(Ts),
                      spec_batches=list(spec_batches), main_L=dict(PAIR_L), shapes=SHAPES,
                      peers=peers, checks=checks, sweep=sweep, detail_batches=list(detail_batches),
                      budget_s=budget_s, estimate_s=est, smoke_cpu=cpu,
                      staggered_batches=list(staggered_batches), main_L_only=main_L_only,
                      accuracy=accuracy)
        res = {"kind": KERNELS_KIND, "provenance": provenance(device, **params), "rows": [], "errors": {},
               "skipped": [], "copy_GBps": None}
        if cpu:
            res["provenance"]["note"] = "CPU smoke run of the benchmark code: not a result"
        if A is not None:
            res["provenance"]["authors"] = A.provenance()
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)

        def save():
            write_json(outp / f"{name}.json", res, default=str)
        if peers and not cpu:
            try:
                import fla
                res["provenance"]["versions"]["fla"] = getattr(fla, "__version__", "?")
            except Exception:  # noqa: BLE001
                pass
            res["provenance"]["versions"]["mamba_ssm"] = _mamba_ssm_commit()
        copy_bw = 1.0 if cpu else copy_bandwidth_GBps(device)
        res["copy_GBps"] = copy_bw
        print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
        E = res["errors"]
        cfgs = {}
        res["section_s"] = {}
        for key, est_s, what in sections:
            el = time.time() - t0
            if el + est_s > budget_s:
                res["skipped"].append(key)
                continue
            op = what[0]
            if op == "checks":
                res["checks"] = _try(lambda: gpu_checks(device), E, "checks")
                if peers:
                    res["peer_comparison"] = _try(lambda: peer_comparison(device), E,
                                                  "peer_comparison")
            elif op == "sweep":
                got = _try(lambda: config_sweep(what[1], 256 if not cpu else 2, device, copy_bw,
                                                pairs, S=SHAPES[what[1]]), E, key)
                if got:
                    res["rows"] += got[0]
                    cfgs[what[1]] = got[1]
            elif op == "conv":
                kind, B = what[1:]
                res["rows"] += _try(lambda: bench_conventional(
                    kind, B, device, copy_bw, cfgs.get(kind) if B >= 128 else None,
                    S=SHAPES[kind]), E, key, [])
            elif op == "replay":
                kind, B, pair, L, det, forced, ptr = what[1:]
                res["rows"] += _try(lambda: bench_replay(
                    kind, B, pair, L, device, copy_bw, cfgs.get(kind) if B >= 128 else None,
                    detail=det, forced=forced, pointer=ptr, S=SHAPES[kind]), E, key, [])
            elif op == "spec":
                kind, B, T = what[1:]
                L = PAIR_L[kind] if PAIR_L[kind] in Ls else Ls[0]
                if T > L:
                    res["skipped"].append(key + " (T > L)")
                    continue
                res["rows"] += _try(lambda: bench_spec(
                    kind, B, T, device, copy_bw, cfgs.get(kind) if B >= 128 else None, pairs, L,
                    S=SHAPES[kind]), E, key, [])
            elif op == "accuracy":
                kind = what[1]
                acc = _try(lambda: side.accuracy(kind, SHAPES[kind], 8 if not cpu else 2,
                                                 PAIR_L[kind] if PAIR_L[kind] in Ls else Ls[0],
                                                 device, A, pairs=[p for p in pairs
                                                                   if p in side.ACC_PAIRS]),
                           E, key)
                if acc:
                    res.setdefault("accuracy", {})[kind] = acc
                    side.print_accuracy(kind, acc)
            elif op in ("authors", "staggered", "spec-authors"):
                kind, B = what[1:3]
                L = PAIR_L[kind] if PAIR_L[kind] in Ls else Ls[0]
                sk = SHAPES[kind]
                run = {"authors": lambda: side.bench_window(kind, B, L, device, copy_bw, sk, A,
                                                            what[3]),
                       "staggered": lambda: side.bench_ours_staggered(kind, B, what[3], L, device,
                                                                      copy_bw, sk),
                       "spec-authors": lambda: side.bench_spec(kind, B, what[3], L, device,
                                                               copy_bw, sk, A)}[op]
                res["rows"] += _try(run, E, key, [])
            elif op == "peers":
                kind, B = what[1:]
                res["rows"] += _try(lambda: bench_peers(kind, B, device, copy_bw,
                                                        S=SHAPES[kind]), E, key, [])
            res["section_s"][key] = round(time.time() - t0 - el, 2)
            save()
        res["configs"] = cfgs
        _derive(res["rows"])
        res["targets"] = targets(res)
        res["wall_s"] = time.time() - t0
        save()
        md = render_markdown(res)
        write_text(outp / f"{name}.md", md)
        print(md, flush=True)
        if plot:
            _try(lambda: plot_kernels(res, str(outp / f"{name}_speedup.png")), E, "plot")
            save()
        return res
    finally:
        SHAPES = saved_shapes
        _CPU_TIMING["on"] = False


def _one_commit(commits) -> str | None:
    """The commit of parts that name one commit, some perhaps abbreviated (a device run is told
    its commit by REPLAYQUANT_GIT_COMMIT, full or short): the longest name, which every other
    starts with. Parts of different commits are an error."""
    names = sorted({str(c) for c in commits}, key=len)
    full = names[-1]
    if any(len(c) < 7 or not full.startswith(c) for c in names[:-1]):
        raise ValueError(f"bench merge: the parts differ in git_commit ({names}); merge only "
                         "runs of one commit on one device kind")
    return None if full == "None" else full


def merge_kernels(parts, out: str = "build/bench", name: str = "kernels",
                  plot: bool = True) -> dict:
    """`_merge_kernels` into the folder `out`, its NAME.json checked first (`check_kernels_out`:
    never one of the parts) and locked from the checks to the last write."""
    path = check_kernels_out(out, name, "replayquant bench merge", inputs=parts)
    with output_lock(path):
        check_kernels_out(out, name, "replayquant bench merge", inputs=parts)
        return _merge_kernels(parts, out, name, plot)


def _merge_kernels(parts, out: str = "build/bench", name: str = "kernels",
                   plot: bool = True) -> dict:
    """`replayquant bench merge`: one {name}.json / .md / _speedup.png from several `bench
    kernels` runs of one commit on one device kind (the grid split over calls of at most ten
    minutes). Speedups are derived within each part (a part is one call, perhaps one machine:
    split the grid by layer kind so that a kind's conventional and replay rows share a part);
    targets come from the merged rows; a section skipped by one part and run by
    another is not listed as skipped. Each row names its part; the provenance lists the parts."""
    import json
    from pathlib import Path

    from replayquant.provenance import provenance
    if len(parts) < 2:
        raise ValueError("bench merge needs at least two kernels JSON files (parts of one run)")
    runs = []
    for p in parts:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"bench merge: cannot read {p} as JSON ({e})") from None
        if "rows" not in runs[-1] or "provenance" not in runs[-1]:
            raise ValueError(f"bench merge: {p} is not a `bench kernels` result (no rows / "
                             "provenance)")
    commit = _one_commit([r["provenance"].get("git_commit") for r in runs])
    for key in ("device", "smoke_cpu"):
        vals = {str(r["provenance"].get(key)) for r in runs}
        if len(vals) > 1:
            raise ValueError(f"bench merge: the parts differ in {key} ({sorted(vals)}); merge "
                             "only runs of one commit on one device kind")
    ran = {}
    for i, r in enumerate(runs):
        for sec in r.get("section_s", {}):
            if sec in ran:
                raise ValueError(f"bench merge: section {sec} ran in both {parts[ran[sec]]} and "
                                 f"{parts[i]}; merge parts that split the grid")
            ran[sec] = i
    rows, errors, configs, skipped = [], {}, {}, []
    pv = dict(runs[0]["provenance"], git_commit=commit)
    listed = ("batches", "L", "pairs", "T", "spec_batches")
    for k in listed:
        pv[k] = sorted({x for r in runs for x in r["provenance"].get(k, [])})
    pv["shapes"] = {k: v for r in runs for k, v in r["provenance"].get("shapes", {}).items()}
    pv["parts"] = []
    res = {"kind": KERNELS_KIND, "provenance": pv, "rows": rows, "errors": errors,
           "skipped": skipped}
    for i, r in enumerate(runs):
        part_rows = [{**row, "part": i} for row in r["rows"]]
        _derive(part_rows)
        rows += part_rows
        errors.update({f"part {i}: {k}": v for k, v in r.get("errors", {}).items()})
        configs.update(r.get("configs") or {})
        skipped += [k for k in r.get("skipped", []) if k.split(" ")[0] not in ran]
        for k in ("checks", "peer_comparison", "accuracy"):
            if r.get(k) is not None and k not in res:
                res[k] = r[k]
        q = r["provenance"]
        pv["parts"].append(dict(file=str(parts[i]), date=q.get("date"), wall_s=r.get("wall_s"),
                                copy_GBps=r.get("copy_GBps"), host=q.get("host"),
                                **{k: q.get(k) for k in (*listed, "checks", "peers", "sweep")},
                                kinds=sorted(q.get("shapes", {}))))
    bws = [r["copy_GBps"] for r in runs if r.get("copy_GBps")]
    res["copy_GBps"] = sum(bws) / len(bws) if bws else None
    res["copy_GBps_parts"] = [r.get("copy_GBps") for r in runs]
    res["configs"] = configs
    me = provenance("cpu")
    pv["merged"] = dict(by="replayquant bench merge", date=me.get("date"),
                        git_commit=me.get("git_commit"))
    res["targets"] = targets(res)
    res["wall_s"] = sum(r.get("wall_s") or 0 for r in runs)
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    md = render_markdown(res)
    write_text(outp / f"{name}.md", md)
    if plot:
        plot_kernels(res, str(outp / f"{name}_speedup.png"))
    write_json(outp / f"{name}.json", res, default=str)
    return res


def plot_kernels(res, png: str) -> None:
    """PNG of per-step speedup over our conventional FP32 step against batch: one panel per
    (kind, pair), one line per L (replay window), plus the forced flush (s32_rs) and the peer;
    no PNG from a run of kinds without replay rows alone (KDA)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    # kinds with replay rows
    kinds = [k for k in SHAPES if _find(rows, kind=k, kernel="replay-window")]
    if not kinds:
        return
    pairs = list(res["provenance"].get("pairs") or PAIRS)
    fig, axes = plt.subplots(len(kinds), len(pairs), figsize=(3.2 * len(pairs), 3.0 * len(kinds)),
                             sharey=True, squeeze=False)
    for i, kind in enumerate(kinds):
        base = {r["B"]: r["us"] for r in _find(rows, kind=kind, kernel="conventional", variant="fp32")}
        for j, pair in enumerate(pairs):
            ax = axes[i][j]
            for L in sorted({r.get("L") for r in _find(rows, kind=kind, kernel="replay-window",
                                                        variant=pair)}):
                pts = sorted((r["B"], r["speedup_vs_conv_fp32"]) for r in
                             _find(rows, kind=kind, kernel="replay-window", variant=pair, L=L)
                             if "speedup_vs_conv_fp32" in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"L={L}")
            L0 = PAIR_L[kind]
            for kern, lab, ls, mk in (
                    ("replay-window-staggered", f"L={L0}, rows out of phase", "--", "d"),):
                pts = sorted((r["B"], r["speedup_vs_conv_fp32"]) for r in
                             _find(rows, kind=kind, kernel=kern, variant=pair, L=L0)
                             if "speedup_vs_conv_fp32" in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk, ms=3,
                            label=lab)
            for kern, lab in (("replay-forced-flush-layer", "flush every step"),):
                pts = sorted((r["B"], r["speedup_vs_conv_fp32"]) for r in
                             _find(rows, kind=kind, kernel=kern, variant=pair, L=L0)
                             if "speedup_vs_conv_fp32" in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=":", marker="s", ms=3,
                            label=lab)
            peer = sorted((r["B"], base[r["B"]] / r["us"]) for r in rows
                          if r["kind"] == kind and r["kernel"] in ("peer:fla", "peer:mamba_ssm")
                          and r["variant"] == "float32" and r["B"] in base)
            if peer:
                ax.plot([p[0] for p in peer], [p[1] for p in peer], ls="--", marker="x", ms=3,
                        color="gray", label="peer FP32")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{kind} {pair}", fontsize=9)
            if i == len(kinds) - 1:
                ax.set_xlabel("batch")
            if j == 0:
                ax.set_ylabel("x conventional FP32 (per step)")
            ax.legend(fontsize=6)
    pv = res["provenance"]
    fig.suptitle(f"{pv['device']}, git {str(pv['git_commit'])[:8]}", fontsize=9)
    fig.tight_layout()
    try:
        save_figure(fig, png, dpi=110)
    finally:
        plt.close(fig)
