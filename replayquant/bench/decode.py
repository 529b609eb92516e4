"""Decode-kernel benchmark (`replayquant bench decode`, GPU) and the random inputs it shares with
the kernel tests.

Inputs look like a real model's: bf16 activations, raw gate logits in FP32, decays a in
(0.9, 1) on average (GDN A_log / dt_bias, Mamba-2 A / dt ranges as in the released checkpoints).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------- shapes

SHAPES = {
    # Qwen3.5-4B Gated DeltaNet layer: 32 value heads, 16 key heads, d_k = d_v = 128
    "gdn": dict(kind="gdn", H=32, HK=16, dv=128, dk=128),
    # Nemotron-H Mamba-2 layer: 128 heads, head dim 64, state 128, 8 groups
    "mamba2": dict(kind="mamba2", H=128, HK=8, dv=64, dk=128),
}


def _gen(seed, device):
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def gdn_step_inputs(B, HK, H, dk, dv, T=None, seed=0, device="cpu"):
    """(q, k, v, a, b) of one step ([B, ...]) or T drafts ([B, T, ...]); q, k, v bf16."""
    g = _gen(seed, device)
    lead = (B,) if T is None else (B, T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = r(*lead, HK, dk).bfloat16()
    k = r(*lead, HK, dk).bfloat16()
    v = r(*lead, H, dv).bfloat16()
    a = r(*lead, H) * 0.5
    b = r(*lead, H)
    return tuple(t.to(device) for t in (q, k, v, a, b))


def gdn_params(H, seed=0, device="cpu"):
    """(A_log, dt_bias) [H]: -exp(A_log) softplus(a + dt_bias) gives decays mostly in (0.9, 1)."""
    g = _gen(seed + 7919, device)
    A_log = torch.rand(H, generator=g) * 1.5 - 4.0
    dt_bias = torch.rand(H, generator=g) * 0.5
    return A_log.to(device), dt_bias.to(device)


def mamba2_step_inputs(B, G, H, N, P, T=None, seed=0, device="cpu", z=True):
    """(x, dt, Bm, C, z) of one step or T drafts; x, B, C, z bf16, dt raw FP32."""
    g = _gen(seed, device)
    lead = (B,) if T is None else (B, T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(*lead, H, P).bfloat16()
    dt = r(*lead, H) * 0.5 - 2.0
    Bm = r(*lead, G, N).bfloat16()
    C = r(*lead, G, N).bfloat16()
    zz = r(*lead, H, P).bfloat16() if z else None
    return tuple(None if t is None else t.to(device) for t in (x, dt, Bm, C, zz))


def mamba2_params(H, seed=0, device="cpu"):
    """(A, D, dt_bias) [H]: A < 0."""
    g = _gen(seed + 104729, device)
    A = -(torch.rand(H, generator=g) * 2.0 + 0.5)
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) * 0.5 - 1.0
    return A.to(device), D.to(device), dt_bias.to(device)


def random_state(N, H, dv, dk, seed=0, device="cpu", scale=0.3):
    if str(device).startswith("cuda"):          # large states: draw on the device
        g = torch.Generator(device=device)
        g.manual_seed(seed + 15485863)
        return torch.randn(N, H, dv, dk, generator=g, device=device) * scale
    g = _gen(seed + 15485863, device)
    return torch.randn(N, H, dv, dk, generator=g) * scale


# ---------------------------------------------------------------------------- bytes moved

def state_bytes(fmt: str, dv: int, dk: int) -> float:
    """Physical bytes of one d_v x d_k matrix stored in `fmt` (payload + scales)."""
    n = dv * dk
    return {"fp32": 4.0 * n, "fp16": 2.0 * n, "bf16": 2.0 * n, "fp8": n + 4.0 * dv,
            "nvfp4": n / 2 + n / 16 + 4.0}[fmt]


def _io_bytes(kind, H, HK, dv, dk):
    """Inputs + output of one (row, head) per step: bf16 activations, fp32 gates, fp32 out."""
    r = H / HK
    if kind == "gdn":
        return 2 * dk * 2 / r + dv * 2 + 8 + dv * 4          # q, k (shared by r heads), v, a, b; y
    return 2 * dk * 2 / r + 2 * dv * 2 + 4 + dv * 4          # B, C (per group), x, z, dt; y


def conventional_bytes(kind, fmt, B, H, HK, dv, dk):
    """HBM bytes of one conventional step: read + write the state, inputs, output."""
    return B * H * (2 * state_bytes(fmt, dv, dk) + _io_bytes(kind, H, HK, dv, dk))


def _entry_bytes(kind, H, HK, dv, dk, u_bytes):
    r = H / HK
    kb = dk * 2 / r                                          # k / B per head (shared by the group)
    if kind == "gdn":
        read_nf = kb + dv * u_bytes + 8                      # k, u, G, beta (outputs)
        write = kb + dv * 2 + dv * u_bytes + 8               # k, v, u, G, beta
        read_fl = kb + dv * 2 + 8                            # k, v, G, beta (rebuild)
    else:
        read_nf = read_fl = kb + dv * 2 + 8                  # B, x, G, dt
        write = kb + dv * 2 + 8
    return read_nf, write, read_fl


def replay_window_bytes(kind, anchor_fmt, read_fmt, L, B, H, HK, dv, dk, u_bytes=2):
    """Mean HBM bytes per step over a window of L steps (L - 1 read steps at h = 0..L-2, then one
    flush), as the kernel moves them. read_fmt None: shared pair."""
    io = _io_bytes(kind, H, HK, dv, dk)
    rd_nf, wr, rd_fl = _entry_bytes(kind, H, HK, dv, dk, u_bytes)
    R = state_bytes(read_fmt or anchor_fmt, dv, dk)
    A = state_bytes(anchor_fmt, dv, dk)
    total = sum(R + h * rd_nf + wr + io for h in range(L - 1))
    total += 2 * A + (0 if read_fmt is None else R) + (L - 1) * rd_fl + io
    return B * H * total / L


def replay_read_step_bytes(kind, read_fmt, h, B, H, HK, dv, dk, u_bytes=2):
    """HBM bytes of one non-flush step at committed length h."""
    rd_nf, wr, _ = _entry_bytes(kind, H, HK, dv, dk, u_bytes)
    return B * H * (state_bytes(read_fmt, dv, dk) + h * rd_nf + wr + _io_bytes(kind, H, HK, dv, dk))


def replay_flush_step_bytes(kind, anchor_fmt, read_fmt, L, B, H, HK, dv, dk):
    _, _, rd_fl = _entry_bytes(kind, H, HK, dv, dk, 2)
    A = state_bytes(anchor_fmt, dv, dk)
    R = 0 if read_fmt is None else state_bytes(read_fmt, dv, dk)
    return B * H * (2 * A + R + (L - 1) * rd_fl + _io_bytes(kind, H, HK, dv, dk))


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


def plain_ms(fn) -> float:
    """do_bench median of fn without a graph (Python launch overhead included; the peer table of
    DESIGN section 6 was measured this way)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# ---------------------------------------------------------------------------- the run

PAIR_L = {"gdn": 16, "mamba2": 8}


def _kw(kind, S, B, T=None, seed=0, device="cuda"):
    """Kernel keyword arguments of one step (T None) or T drafts."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
        A_log, dtb = gdn_params(H, seed, device)
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dtb)
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
    A, D, dtb = mamba2_params(H, seed, device)
    return dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D, z=z, dt_bias=dtb)


def _fns(kind):
    from replayquant.kernels import conventional as cv
    from replayquant.kernels import replay_decode as rd
    from replayquant.kernels import verify as vf
    if kind == "gdn":
        return dict(conv=cv.conventional_gdn_step, conv_ref=cv.conventional_gdn_step_ref,
                    step=rd.replay_gdn_step, step_ref=rd.replay_gdn_step_ref,
                    verify=vf.replay_gdn_verify, verify_ref=vf.replay_gdn_verify_ref,
                    cverify=vf.conventional_gdn_verify, cverify_ref=vf.conventional_gdn_verify_ref)
    return dict(conv=cv.conventional_mamba2_step, conv_ref=cv.conventional_mamba2_step_ref,
                step=rd.replay_mamba2_step, step_ref=rd.replay_mamba2_step_ref,
                verify=vf.replay_mamba2_verify, verify_ref=vf.replay_mamba2_verify_ref,
                cverify=vf.conventional_mamba2_verify, cverify_ref=vf.conventional_mamba2_verify_ref)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def _state_cmp(a, b):
    d = (a - b).abs()
    scale = b.abs().max().clamp(min=1e-30)
    return {"max_rel": float(d.max() / scale), "frac_gt_1e-5": float((d > 1e-5 * scale).float().mean())}


def gpu_checks(device="cuda") -> dict:
    """The kernel-vs-reference comparisons of the CPU tests, on the GPU at the real head shapes."""
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.kernels.verify import (conventional_accept, conventional_accept_ref,
                                            make_snapshots, replay_accept, replay_accept_ref)
    from replayquant.pairs import PrecisionPair
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    N = 6
    idx = torch.tensor([5, -1, 0, 3, 1, 2, 4], dtype=torch.int32, device=device)
    B = idx.shape[0]
    for kind, S in SHAPES.items():
        f = _fns(kind)
        H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
        init = random_state(N, H, dv, dk, seed=1, device=device)
        for pair, ud in (("s32_rs", torch.float32), ("tp4_hi16_sr", torch.bfloat16)):
            P = PrecisionPair.load(pair).with_buffer_len(4)
            st = ReplayStore.from_state(init, P, kind, key_heads=HK, seed=3, u_dtype=ud,
                                        max_drafts=2)
            ref = st.clone()
            errs = []
            for i in range(9):
                if i % 3 == 2:
                    kw = _kw(kind, S, B, T=2, seed=i, device=device)
                    y = f["verify"](st, **kw, state_indices=idx)
                    y2 = f["verify_ref"](ref, **kw, state_indices=idx)
                    n = torch.tensor([2, 0, 1, 2, 0, 1, 2], device=device)
                    replay_accept(st, n, idx)
                    replay_accept_ref(ref, n, idx)
                else:
                    kw = _kw(kind, S, B, seed=i, device=device)
                    out_t = torch.full((B, H, dv), float("nan"), device=device)
                    y = f["step"](st, **kw, state_indices=idx, out=out_t, path="replay")
                    y2 = f["step_ref"](ref, **kw, state_indices=idx, path="replay")
                errs.append(_rel(y, y2) if torch.isfinite(y).all() else float("nan"))
            out[f"{kind}/replay/{pair}"] = {
                "max_rel_y": max(errs), "pointers_equal": bool(torch.equal(st.committed, ref.committed)
                                                               and torch.equal(st.n_flush, ref.n_flush)),
                "anchor": _state_cmp(st.anchor.dequantize(), ref.anchor.dequantize()),
                "read": _state_cmp(st.read_role.dequantize(), ref.read_role.dequantize()),
                "n_flush": st.n_flush.tolist()}
            del st, ref
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


def _peer_gdn():
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    return fused_recurrent_gated_delta_rule


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
    fn = _peer_mamba()
    B, H, P = kw["x"].shape
    N = S["dk"]
    y = fn(state, kw["x"], kw["dt"].unsqueeze(-1).expand(B, H, P), kw["A"][:, None, None].expand(H, P, N),
           kw["B"], kw["C"], D=kw["D"][:, None].expand(H, P), z=kw["z"],
           dt_bias=kw["dt_bias"][:, None].expand(H, P), dt_softplus=True)
    return y, state


def peer_comparison(device="cuda") -> dict:
    """Our conventional FP32 step vs the peer on identical inputs: max abs difference."""
    from replayquant.kernels.conventional import ConventionalStore
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
            out[kind] = {"peer": "fla fused_recurrent_gated_delta_rule" if kind == "gdn"
                         else "mamba_ssm selective_state_update",
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
        print(f"[bench decode] {key} failed: {type(e).__name__}: {e}", flush=True)
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


def config_sweep(kind, B, device, copy_bw):
    """Launch configs (block_v, num_warps) timed at batch B on fresh stores (never by re-running
    a live in-place state): the conventional step, the replay read step (h = L/2, pointers held)
    and the replay flush step (h = L - 1). Returns (rows, best config per kernel variant)."""
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.pairs import PrecisionPair
    S = SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    L = PAIR_L[kind]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    rows, cfg = [], {}

    def pick(key, cands):
        best = min(cands, key=lambda r: r["us"])
        cfg[key] = best["cfg"]
        rows.extend(cands)

    cs = ConventionalStore.from_state(init, "fp32")
    cands = []
    for bv, nw in [(8, 1), (16, 1), (16, 2), (32, 4), (64, 8)]:
        if bv > dv:
            continue
        c = dict(block_v=bv, num_warps=nw)
        ms = graph_ms(lambda: f["conv"](cs, **kw, state_indices=idx, out=out, advance=False, **c), 8)
        cands.append(_row(kind, "sweep/conventional", "fp32", B, ms,
                          conventional_bytes(kind, "fp32", B, H, HK, dv, dk), copy_bw, cfg=c))
    pick("conventional/fp32", cands)
    del cs
    for pair in ("s32_rs", "tp4_hi32"):
        P = PrecisionPair.load(pair).with_buffer_len(L)
        rf = None if P.read is None else P.read.format
        st = ReplayStore.from_state(init, P, kind, key_heads=HK)
        cands = []
        h = L // 2
        for bv, nw in [(16, 1), (32, 2), (32, 4), (64, 4)]:
            if bv > dv:
                continue
            c = dict(block_v=bv, num_warps=nw)
            st.committed.fill_(h)
            ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                            advance=False, **c), 8)
            cands.append(_row(kind, "sweep/replay-read-step", pair, B, ms,
                              replay_read_step_bytes(kind, rf or "fp32", h, B, H, HK, dv, dk),
                              copy_bw, cfg=c, h=h))
        pick(f"read/{pair}", cands)
        cands = []
        fcs = [(dv, 4), (dv, 8), (dv, 16)] if rf == "nvfp4" else [(16, 2), (32, 4), (64, 8)]
        for bv, nw in fcs:
            if bv > dv:
                continue
            c = dict(flush_config=(bv, nw))
            st.committed.fill_(L - 1)
            ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                            advance=False, **c), 4)
            cands.append(_row(kind, "sweep/replay-flush-step", pair, B, ms,
                              replay_flush_step_bytes(kind, "fp32", rf, L, B, H, HK, dv, dk),
                              copy_bw, cfg=c))
        pick(f"flush/{pair}", cands)
        del st
    torch.cuda.empty_cache()
    return rows, cfg


def bench_batch(kind, B, device, copy_bw, cfg=None, detail=False, peers=True):
    """All decode-step rows of one kind at batch B."""
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore, advance_pointers
    from replayquant.pairs import PrecisionPair
    cfg = cfg or {}
    S = SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    L = PAIR_L[kind]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, seed=1, device=device)
    out = torch.empty(B, H, dv, device=device)
    rows = []
    for fmt in ("fp32", "bf16"):
        c = cfg.get("conventional/fp32", {})
        cs = ConventionalStore.from_state(init, fmt)
        ms = graph_ms(lambda: f["conv"](cs, **kw, state_indices=idx, out=out, advance=False, **c), 8)
        rows.append(_row(kind, "conventional", fmt, B, ms,
                         conventional_bytes(kind, fmt, B, H, HK, dv, dk), copy_bw, config=c))
        del cs
    for pair in ("s32_rs", "tp4_hi32"):
        c = {**cfg.get(f"read/{pair}", {}), **cfg.get(f"flush/{pair}", {})}
        P = PrecisionPair.load(pair).with_buffer_len(L)
        rf = None if P.read is None else P.read.format
        st = ReplayStore.from_state(init, P, kind, key_heads=HK)
        ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay", **c), L)
        rows.append(_row(kind, "replay-window", pair, B, ms,
                         replay_window_bytes(kind, "fp32", rf, L, B, H, HK, dv, dk), copy_bw,
                         L=L, config=c, note="mean step over a window of L steps (one flush per row), "
                                             "pointer kernel included"))
        if detail:
            h = L // 2
            st.committed.fill_(h)
            ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                            advance=False, **c), 8)
            rows.append(_row(kind, "replay-read-step", pair, B, ms,
                             replay_read_step_bytes(kind, rf or "fp32", h, B, H, HK, dv, dk), copy_bw,
                             L=L, h=h, config=c))
            st.committed.fill_(L - 1)
            ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="replay",
                                            advance=False, **c), 4)
            rows.append(_row(kind, "replay-flush-step", pair, B, ms,
                             replay_flush_step_bytes(kind, "fp32", rf, L, B, H, HK, dv, dk), copy_bw,
                             L=L, config=c))
            st.committed.zero_()
        ms = graph_ms(lambda: f["step"](st, **kw, state_indices=idx, out=out, path="flush", **c), 8)
        rows.append(_row(kind, "replay-forced-flush", pair, B, ms, None, copy_bw,
                         note="path='flush' (small-batch dispatch): every step flushes"))
        if pair == "s32_rs":
            ms = graph_ms(lambda: advance_pointers(st, idx), 8)
            rows.append(_row(kind, "pointer-advance", "-", B, ms, None, copy_bw,
                             note="once per token for all layers of a model"))
        del st
    if peers:
        for sd in (torch.float32, torch.bfloat16):
            name = str(sd).split(".")[-1]
            state = init.to(sd)
            esz = torch.finfo(sd).bits // 8
            io = B * H * _io_bytes(kind, H, HK, dv, dk)
            if kind == "gdn":   # fla reads the state in its dtype and writes a new fp32 state
                nb = B * H * dv * dk * (esz + 4) + io
            else:
                nb = 2 * B * H * dv * dk * esz + io
            label = "peer:fla" if kind == "gdn" else "peer:mamba_ssm"
            ms = graph_ms(lambda: peer_call(kind, S, kw, state), 8)
            rows.append(_row(kind, label, name, B, ms, nb, copy_bw))
            ms = plain_ms(lambda: peer_call(kind, S, kw, state))
            rows.append(_row(kind, label + "(no graph)", name, B, ms, nb, copy_bw))
            del state
    del init
    torch.cuda.empty_cache()
    return rows


def bench_spec(kind, B, T, device, copy_bw, cfg=None):
    """Speculative rounds: replay verify + accept vs conventional per-draft snapshots + accept."""
    from replayquant.kernels.conventional import ConventionalStore
    from replayquant.kernels.replay_decode import ReplayStore
    from replayquant.kernels.verify import conventional_accept, make_snapshots, replay_accept
    from replayquant.pairs import PrecisionPair
    cfg = cfg or {}
    S = SHAPES[kind]
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    f = _fns(kind)
    L = PAIR_L[kind]
    init = random_state(B, H, dv, dk, seed=B + 1, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    kw = _kw(kind, S, B, T=T, seed=3, device=device)
    g = torch.Generator().manual_seed(B)
    n = torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32).to(device)
    tokens = B * (float(n.float().mean()) + 1.0)       # accepted drafts + the bonus token
    out = torch.empty(B, T, H, dv, device=device)
    rows = []
    for pair in ("s32_rs", "tp4_hi32"):
        c = {**cfg.get(f"read/{pair}", {}), **cfg.get(f"flush/{pair}", {})}
        st = ReplayStore.from_state(init, PrecisionPair.load(pair).with_buffer_len(L), kind,
                                    key_heads=HK, max_drafts=T)

        def rnd():
            f["verify"](st, **kw, state_indices=idx, out=out, **c)
            replay_accept(st, n, idx, check=False)
        ms = graph_ms(rnd, 8)
        rows.append(_row(kind, "spec-replay-round", pair, B, ms, None, copy_bw, T=T, L=L,
                         tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean())))
        del st
    cs = ConventionalStore.from_state(init, "fp32")
    snaps = make_snapshots(cs, T)
    c = cfg.get("conventional/fp32", {})
    ms = graph_ms(lambda: f["cverify"](cs, snaps, **kw, state_indices=idx, out=out, **c), 8)
    sb = state_bytes("fp32", dv, dk)
    nbv = B * H * ((1 + T) * sb + T * _io_bytes(kind, H, HK, dv, dk))
    rows.append(_row(kind, "spec-snapshot-verify", "fp32", B, ms, nbv, copy_bw, T=T))

    def rndc():
        f["cverify"](cs, snaps, **kw, state_indices=idx, out=out, **c)
        conventional_accept(cs, snaps, n, idx, check=False)
    ms = graph_ms(rndc, 8)
    frac = float((n > 0).float().mean())
    rows.append(_row(kind, "spec-snapshot-round", "fp32", B, ms, nbv + B * H * 2 * sb * frac, copy_bw,
                     T=T, tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()),
                     note="verify + restore of snapshot n (a copy) for rows with n > 0"))
    del cs, snaps, init
    torch.cuda.empty_cache()
    return rows


def _derive(rows):
    """Speedups over our conventional FP32 step and ratios to the peer at the same (kind, B)."""
    base = {(r["kind"], r["B"]): r["us"] for r in rows
            if r["kernel"] == "conventional" and r["variant"] == "fp32"}
    peer = {(r["kind"], r["B"], r["variant"]): r["us"] for r in rows
            if r["kernel"] in ("peer:fla", "peer:mamba_ssm")}
    snap = {(r["kind"], r["B"]): r["us"] for r in rows if r["kernel"] == "spec-snapshot-round"}
    for r in rows:
        k = (r["kind"], r["B"])
        if r["kernel"] in ("conventional", "replay-window", "replay-read-step", "replay-forced-flush",
                           "sweep/conventional", "sweep/replay-read-step") and k in base:
            r["speedup_vs_conv_fp32"] = base[k] / r["us"]
            p = peer.get((r["kind"], r["B"], "float32"))
            if p:
                r["speedup_vs_peer_fp32"] = p / r["us"]
        if r["kernel"] == "spec-replay-round" and k in snap:
            r["speedup_vs_snapshot_round"] = snap[k] / r["us"]
    return rows


def render_markdown(res) -> str:
    lines = [f"# Decode kernels on {res['provenance']['device']}", "",
             f"git {res['provenance']['git_commit']}, {res['provenance']['date']}; "
             f"device copy bandwidth {res['copy_GBps']:.0f} GB/s (read + write, measured in this run). "
             "Times: CUDA graph of the steps, `triton.testing.do_bench` median, L2 flushed before each "
             "replay. Bytes: what each kernel must move (state, buffer, inputs, output) as counted in "
             "`replayquant/bench/decode.py`.", ""]
    lines += ["| kind | kernel | variant | B | us/step | GB/s | % copy | x conv FP32 | x peer FP32 |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    fmt = lambda v, p=".2f": "" if v is None else format(v, p)  # noqa: E731
    for r in res["rows"]:
        if r["kernel"].startswith("sweep") or r["kernel"].startswith("spec"):
            continue
        lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {r['us']:.1f} | "
                     f"{fmt(r.get('GBps'), '.0f')} | {fmt(r.get('pct_copy'), '.0f')} | "
                     f"{fmt(r.get('speedup_vs_conv_fp32'))} | {fmt(r.get('speedup_vs_peer_fp32'))} |")
    spec = [r for r in res["rows"] if r["kernel"].startswith("spec")]
    if spec:
        lines += ["", "Speculative decoding (T drafts per round, fixed random accept counts):", "",
                  "| kind | kernel | variant | B | T | us/round | tokens/s | x snapshot round |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in spec:
            lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {r['T']} | "
                         f"{r['us']:.1f} | {fmt(r.get('tokens_per_s'), '.3g')} | "
                         f"{fmt(r.get('speedup_vs_snapshot_round'))} |")
    sweep = [r for r in res["rows"] if r["kernel"].startswith("sweep")]
    if sweep:
        lines += ["", "Launch-config sweep:", "", "| kind | kernel | variant | B | block_v | warps | us/step |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for r in sweep:
            c = r["cfg"]
            bv, nw = c.get("flush_config") or (c.get("block_v"), c.get("num_warps"))
            lines.append(f"| {r['kind']} | {r['kernel']} | {r['variant']} | {r['B']} | {bv} | "
                         f"{nw} | {r['us']:.1f} |")
    if res.get("errors"):
        lines += ["", "Sections that failed: " + ", ".join(res["errors"])]
    return "\n".join(lines) + "\n"


def run_decode_bench(out: str = "results/bench", batches=(1, 8, 32, 128, 256, 512),
                     spec_batches=(32, 256, 512), T: int = 4, peers: bool = True,
                     checks: bool = True, sweep: bool = True, detail_batches=(256,),
                     device: str = "cuda", name: str = "decode") -> dict:
    """The whole benchmark in one run: copy bandwidth, GPU checks, launch-config sweep, decode
    steps of our kernels and the peers, speculative rounds. Writes {name}.json and {name}.md."""
    import json
    import os
    import time
    from pathlib import Path

    from replayquant.provenance import provenance
    if not torch.cuda.is_available():
        raise ValueError("bench decode needs a CUDA GPU")
    t0 = time.time()
    params = dict(batches=list(batches), spec_batches=list(spec_batches), T=T, L=PAIR_L,
                  shapes=SHAPES, peers=peers, pairs=["s32_rs", "tp4_hi32"])
    res = {"provenance": provenance(device, **params), "rows": [], "errors": {}}
    if os.environ.get("RQ_GIT_COMMIT"):          # the device copy of the tree has no .git
        res["provenance"]["git_commit"] = os.environ["RQ_GIT_COMMIT"]
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)

    def save():
        (outp / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    try:
        import fla
        res["provenance"]["versions"]["fla"] = getattr(fla, "__version__", "?")
    except Exception:  # noqa: BLE001
        pass
    copy_bw = copy_bandwidth_GBps(device)
    res["copy_GBps"] = copy_bw
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    E = res["errors"]
    if checks:
        res["checks"] = _try(lambda: gpu_checks(device), E, "checks")
        print(json.dumps(res["checks"], indent=1)[:3000], flush=True)
        if peers:
            res["peer_comparison"] = _try(lambda: peer_comparison(device), E, "peer_comparison")
            print(json.dumps(res["peer_comparison"]), flush=True)
        save()
    cfgs = {}
    for kind in SHAPES:
        if sweep:
            got = _try(lambda: config_sweep(kind, 256, device, copy_bw), E, f"sweep/{kind}")
            if got:
                res["rows"] += got[0]
                cfgs[kind] = got[1]
        for B in batches:
            cfg = cfgs.get(kind) if B >= 128 else None
            res["rows"] += _try(lambda: bench_batch(kind, B, device, copy_bw, cfg,
                                                    detail=B in detail_batches, peers=peers),
                                E, f"{kind}/B{B}", [])
            save()
        for B in spec_batches:
            res["rows"] += _try(lambda: bench_spec(kind, B, T, device, copy_bw,
                                                   cfgs.get(kind) if B >= 128 else None),
                                E, f"spec/{kind}/B{B}", [])
            save()
    res["configs"] = cfgs
    _derive(res["rows"])
    res["wall_s"] = time.time() - t0
    save()
    (outp / f"{name}.md").write_text(render_markdown(res))
    print(render_markdown(res), flush=True)
    return res


def plot_decode(json_path: str = "results/bench/decode.json",
                png: str = "results/bench/decode_speedup.png") -> None:
    """PNG of per-step speedup over our conventional FP32 kernel against batch, per pair."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    r = json.load(open(json_path))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, kind in zip(axes, ["gdn", "mamba2"]):
        for kernel, variant, label in [("replay-window", "s32_rs", "replay FP32 (s32_rs)"),
                                       ("replay-window", "tp4_hi32", "replay NVFP4 read / FP32 anchor"),
                                       ("conventional", "bf16", "conventional BF16"),
                                       ("replay-forced-flush", "s32_rs", "flush every step (s32_rs)")]:
            pts = sorted((x["B"], x["speedup_vs_conv_fp32"]) for x in r["rows"]
                         if x["kind"] == kind and x["kernel"] == kernel and x["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        peer = sorted((x["B"], [y for y in r["rows"] if y["kind"] == kind and y["kernel"] == "conventional"
                                and y["variant"] == "fp32" and y["B"] == x["B"]][0]["us"] / x["us"])
                      for x in r["rows"] if x["kind"] == kind and x["kernel"].startswith("peer:")
                      and "(no graph)" not in x["kernel"] and x["variant"] == "float32")
        ax.plot([p[0] for p in peer], [p[1] for p in peer], marker="x", ls="--",
                label="peer FP32 (fla / mamba_ssm)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_title(f"{kind}: speedup over our conventional FP32 step")
    axes[0].set_ylabel("x conventional FP32 (per step)")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{r['provenance']['device']}, git {r['provenance']['git_commit'][:8]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
