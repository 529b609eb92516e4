"""Chunked teacher-forcing scan in Triton (DESIGN section 7): the torch reference is
`replayquant.kernels.chunk_ref.chunk_scan_ref`, with the same signature and effect.

    from replayquant.kernels.chunk import chunk_scan
    y, new_state = chunk_scan(state, q, k, v, log_a, beta, pair=pair, seed=seed, layer=layer,
                              valid=valid, exact=False)

One program per (sequence, head, block of d_v rows) scans that row's windows in order. The
windows are the flush schedule: the row's buffered steps (state.count of them, from the
previous segment) followed by its valid tokens, cut every L entries, so a segment continues
the schedule of the previous one (position modulo L carries over) and padding takes no slot.
In each window:

* every token but the window's L-th reads the read copy R of the window's checkpoint, decoded
  in registers from its packed storage: y_t = exp(G_t) R q_t + sum_{j<=t} exp(G_t - G_j)
  (k_j . q_t) u_j, with GDN's u from R (u = (I + T)^-1 beta (v - exp(G) R k), T the strictly
  lower decayed beta k k^T matrix; Mamba-2: u = v);
* the L-th token (the flush) reads the unrounded state S = exp(G_L) A + sum_j exp(G_L - G_j)
  u_j k_j^T rebuilt from the dequantized anchor A (GDN: u recomputed from A);
* S is cast independently into the anchor and the read copy (`_tile_store`: formats bit-exact
  with quant_ref, SR bits from Philox keyed by layer_seed(seed, layer) and
  sr_stream(flush index, role, sequence id, head) as `ReplayState`), then read back.

A row's last, partial window gives outputs from R and becomes the new buffer. exact=True:
the segment in FP32 (outputs from the running unrounded state) and one cast at its end.
An NVFP4 role has one scale per matrix, so a program then holds whole matrices (block = d_v).
Shapes: d_k and d_v powers of two >= 16 (`supports` says whether a call can run here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replayquant.formats import QTensor
from replayquant.kernels.chunk_ref import ScanState, _check_inputs, cpu_threads
from replayquant.kernels.conventional import FMT_IDS, _tile_load, _tile_store, split_key
from replayquant.replay import core
from replayquant.streams import layer_seed

__all__ = ["chunk_scan", "chunk_launch_config", "supports", "teacher_force"]


# ============================================================================ Triton

@triton.jit
def _load_window(tok_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bk_ptr, bv_ptr, bG_ptr, bb_ptr,
                 b, h, w, h0, T, WIDTH, rows, cols, jj,
                 H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L: tl.constexpr,
                 DELTA: tl.constexpr):
    """Entries of window w of row b, head h, as float32 tiles over LP slots (slots >= L and
    null steps are zero): K, Q [LP, DK]; V [LP, BV] (rows `rows`); G [LP] cumulative log gate
    since the checkpoint; Bt [LP] beta (GDN); is_tok [LP] (slot holds a token of the segment);
    tok_row [LP] int64 (b * T + t) * H + h of that token."""
    inwin = (jj < L) & (w * L + jj < WIDTH)
    idx = tl.load(tok_ptr + b.to(tl.int64) * WIDTH + w * L + jj, mask=inwin, other=-1)
    is_tok = idx >= 0
    is_buf = idx <= -2
    t = tl.where(is_tok, idx, 0).to(tl.int64)
    s = tl.where(is_buf, -2 - idx, 0).to(tl.int64)
    tok_row = (b.to(tl.int64) * T + t) * H + h
    buf_row = (b.to(tl.int64) * H + h) * L + s
    mt = is_tok[:, None]
    mb = is_buf[:, None]
    K = tl.where(mt, tl.load(k_ptr + tok_row[:, None] * DK + cols[None, :], mask=mt, other=0.0).to(tl.float32),
                 tl.load(bk_ptr + buf_row[:, None] * DK + cols[None, :], mask=mb, other=0.0))
    Q = tl.load(q_ptr + tok_row[:, None] * DK + cols[None, :], mask=mt, other=0.0).to(tl.float32)
    V = tl.where(mt, tl.load(v_ptr + tok_row[:, None] * DV + rows[None, :], mask=mt, other=0.0).to(tl.float32),
                 tl.load(bv_ptr + buf_row[:, None] * DV + rows[None, :], mask=mb, other=0.0))
    la = tl.load(a_ptr + tok_row, mask=is_tok, other=0.0).to(tl.float32)
    Gb = tl.load(bG_ptr + buf_row, mask=is_buf, other=0.0)
    if DELTA:
        Bt = tl.where(is_tok, tl.load(b_ptr + tok_row, mask=is_tok, other=0.0).to(tl.float32),
                      tl.load(bb_ptr + buf_row, mask=is_buf, other=0.0))
    else:
        Bt = la * 0.0
    # buffered slots (window 0 only) keep their stored G; new entries continue from the last one
    g0 = tl.sum(tl.where(is_buf & (jj == h0 - 1), Gb, 0.0), axis=0)
    G = tl.where(is_buf, Gb, g0 + tl.cumsum(la, axis=0))
    return K, Q, V, G, Bt, is_tok, tok_row


@triton.jit
def _window_terms(K, Q, G, Bt, jj, L: tl.constexpr, DELTA: tl.constexpr):
    """State-independent terms: Aqk [LP, LP] = exp(G_t - G_j) (q_t . k_j) for j <= t, and for
    GDN Tinv = (I + T)^-1 with T[t, j] = beta_t exp(G_t - G_j) (k_t . k_j) for j < t."""
    causal = jj[None, :] <= jj[:, None]
    D = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
    Aqk = tl.dot(Q, tl.trans(K), input_precision="ieee") * D
    if DELTA:
        strict = jj[None, :] < jj[:, None]
        KK = tl.dot(K, tl.trans(K), input_precision="ieee")
        Tm = tl.where(strict, Bt[:, None] * KK * D, 0.0)
        eye = tl.where(jj[:, None] == jj[None, :], 1.0, 0.0)
        Tinv = eye
        for i in range(1, L):                     # forward substitution, row by row
            sel = jj == i
            ti = tl.sum(tl.where(sel[:, None], Tm, 0.0), axis=0)              # T[i, :]
            row = tl.sum(ti[:, None] * Tinv, axis=0)                           # T[i, :] Tinv
            Tinv = tl.where(sel[:, None], Tinv - row[None, :], Tinv)
    else:
        Tinv = Aqk
    return Aqk, Tinv


@triton.jit
def _corrections(X, K, V, G, Bt, Tinv, DELTA: tl.constexpr):
    """u [LP, BV] against checkpoint rows X [BV, DK]: GDN Tinv beta (v - exp(G) X k); Mamba-2 v."""
    if DELTA:
        Xk = tl.dot(K, tl.trans(X), input_precision="ieee")                     # [LP, BV]
        rhs = Bt[:, None] * (V - tl.exp(G)[:, None] * Xk)
        u = tl.dot(Tinv, rhs, input_precision="ieee")
    else:
        u = V
    return u


@triton.jit
def _read_outputs(X, Q, G, Aqk, u):
    """y [LP, BV] = exp(G_t) X q_t + sum_j Aqk[t, j] u_j."""
    Xq = tl.dot(Q, tl.trans(X), input_precision="ieee")
    return tl.exp(G)[:, None] * Xq + tl.dot(Aqk, u, input_precision="ieee")


@triton.jit
def _fold(X, K, G, u, jj, L: tl.constexpr):
    """Unrounded state after the window from checkpoint rows X: exp(G_L) X + sum_j
    exp(G_L - G_j) u_j k_j^T (slots >= L hold null steps: u = 0)."""
    GL = tl.sum(tl.where(jj == L - 1, G, 0.0), axis=0)
    inw = jj < L
    wL = tl.where(inw, tl.exp(tl.where(inw, GL - G, 0.0)), 0.0)
    return tl.exp(GL) * X + tl.dot(tl.trans(u * wL[:, None]), K, input_precision="ieee")


@triton.jit(do_not_specialize=["T", "WIDTH", "key_lo", "key_hi"])
def _chunk_kernel(
        tok_ptr, valid_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
        bk_ptr, bv_ptr, bG_ptr, bb_ptr, h0_ptr, nf_ptr, seq_ptr, nwin_ptr, nfull_ptr,
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        y_ptr, nk_ptr, nv_ptr, nG_ptr, nb_ptr,
        T, WIDTH, key_lo, key_hi,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        L: tl.constexpr, LP: tl.constexpr, BT: tl.constexpr,
        AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
        SHARED: tl.constexpr, DELTA: tl.constexpr, EXACT: tl.constexpr, HAS_VALID: tl.constexpr):
    pid = tl.program_id(0)
    vb = tl.program_id(1)
    b = pid // H
    h = pid % H
    mat = pid.to(tl.int64)                       # = b * H + h: the matrix of both roles
    rows = vb * BV + tl.arange(0, BV)
    cols = tl.arange(0, DK)
    jj = tl.arange(0, LP)
    h0 = tl.load(h0_ptr + b)
    nf = tl.load(nf_ptr + b)
    seq = tl.load(seq_ptr + b)
    nwin = tl.load(nwin_ptr + b)
    nfull = tl.load(nfull_ptr + b)

    # padding tokens: output 0
    if HAS_VALID:
        tt = tl.arange(0, BT)
        for t0 in range(0, T, BT):
            tm = (t0 + tt) < T
            ok = tl.load(valid_ptr + b.to(tl.int64) * T + t0 + tt, mask=tm, other=1)
            pad = tm & (ok == 0)
            yr = (b.to(tl.int64) * T + t0 + tt) * H + h
            tl.store(y_ptr + yr[:, None] * DV + rows[None, :], tl.zeros([BT, BV], tl.float32),
                     mask=pad[:, None])

    if EXACT:
        A = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)   # runs unrounded
    for w in range(0, nwin):
        K, Q, V, G, Bt, is_tok, tok_row = _load_window(
            tok_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bk_ptr, bv_ptr, bG_ptr, bb_ptr,
            b, h, w, h0, T, WIDTH, rows, cols, jj, H, DK, DV, L, DELTA)
        Aqk, Tinv = _window_terms(K, Q, G, Bt, jj, L, DELTA)
        y_ptrs = y_ptr + tok_row[:, None] * DV + rows[None, :]
        if EXACT:
            u = _corrections(A, K, V, G, Bt, Tinv, DELTA)
            tl.store(y_ptrs, _read_outputs(A, Q, G, Aqk, u), mask=is_tok[:, None])
            A = _fold(A, K, G, u, jj, L)
        else:
            # the checkpoint's read copy, decoded from its packed storage (written by the
            # previous flush of this program, or the state's own)
            if SHARED:
                R = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
            else:
                R = _tile_load(R_pay, R_sc, R_gs, mat, rows, cols, DV, DK, BV, RFMT)
            uR = _corrections(R, K, V, G, Bt, Tinv, DELTA)
            y = _read_outputs(R, Q, G, Aqk, uR)
            if w < nfull:
                # the flush: rebuild from the anchor, the L-th token reads it, cast both roles
                if SHARED:
                    S = _fold(R, K, G, uR, jj, L)
                else:
                    A = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
                    S = _fold(A, K, G, _corrections(A, K, V, G, Bt, Tinv, DELTA), jj, L)
                qL = tl.sum(tl.where((jj == L - 1)[:, None], Q, 0.0), axis=0)
                yF = tl.sum(S * qL[None, :], axis=1)
                y = tl.where((jj == L - 1)[:, None], yF[None, :], y)
                fi = nf + w + 1
                tl.debug_barrier()                   # every thread has read the old roles
                _tile_store(S, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi, fi, seq, h,
                            DV, DK, BV, AFMT, ASR, 0)
                if not SHARED:
                    _tile_store(S, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, fi, seq,
                                h, DV, DK, BV, RFMT, RSR, 1)
                tl.debug_barrier()                   # the roles just written are read next
            tl.store(y_ptrs, y, mask=is_tok[:, None])

    buf = (b.to(tl.int64) * H + h) * L + jj
    inw = jj < L
    if EXACT:
        # one cast of the unrounded FP32 state after every entry; the buffer empties
        _tile_store(A, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi, nf + 1, seq, h,
                    DV, DK, BV, AFMT, ASR, 0)
        if not SHARED:
            _tile_store(A, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, nf + 1, seq, h,
                        DV, DK, BV, RFMT, RSR, 1)
        K = tl.zeros([LP, DK], tl.float32)
        V = tl.zeros([LP, BV], tl.float32)
        G = tl.zeros([LP], tl.float32)
        Bt = G
        keep = jj < 0
    else:
        # the new buffer: the entries of the row's last, partial window (window nfull)
        K, Q, V, G, Bt, is_tok, tok_row = _load_window(
            tok_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bk_ptr, bv_ptr, bG_ptr, bb_ptr,
            b, h, nfull, h0, T, WIDTH, rows, cols, jj, H, DK, DV, L, DELTA)
        keep = tl.load(tok_ptr + b.to(tl.int64) * WIDTH + nfull * L + jj,
                       mask=inw & (nfull * L + jj < WIDTH), other=-1) != -1
    tl.store(nv_ptr + buf[:, None] * DV + rows[None, :], tl.where(keep[:, None], V, 0.0),
             mask=inw[:, None])
    if vb == 0:
        tl.store(nk_ptr + buf[:, None] * DK + cols[None, :], tl.where(keep[:, None], K, 0.0),
                 mask=inw[:, None])
        tl.store(nG_ptr + buf, tl.where(keep, G, 0.0), mask=inw)
        if DELTA:
            tl.store(nb_ptr + buf, tl.where(keep, Bt, 0.0), mask=inw)


# ============================================================================ host side

def supports(d_k: int, d_v: int) -> bool:
    """Whether the kernel handles these state dimensions (powers of two >= 16)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (d_k, d_v))


def chunk_launch_config(pair, B: int, H: int, d_v: int, d_k: int, L: int):
    """(BV, num_warps, LP) from the shape: an NVFP4 role is cast a whole matrix at a time
    (one scale per matrix), so BV = d_v; otherwise smaller row blocks give more programs when
    B * H is small."""
    nv = pair.anchor.format == "nvfp4" or (pair.read is not None and pair.read.format == "nvfp4")
    if nv:
        BV = d_v
    elif B * H >= 256:
        BV = min(d_v, 64)
    else:
        BV = min(d_v, 32)
    num_warps = max(2, min(8, BV * d_k // 1024))
    LP = max(16, triton.next_power_of_2(L))
    return BV, num_warps, LP


def _role_args(q: QTensor | None):
    """(payload, scale, matrix scale, format id) of a packed role as the kernels take them."""
    pay = q.payload
    if q.format == "fp8":
        pay = pay.view(torch.uint8)
    elif q.format in ("fp16", "bf16"):
        pay = pay.view(torch.int16)
    if q.format == "fp8":
        sc, gs = q.scales["row"], pay
    elif q.format == "nvfp4":
        sc, gs = q.scales["block"].view(torch.uint8), q.scales["matrix"]
    else:
        sc, gs = pay, pay
    return pay, sc, gs, FMT_IDS[q.format]


def _empty(shape, dtype, device) -> torch.Tensor:
    """Output allocation (tests replace it to poison outputs before the kernel writes)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _token_map(state: ScanState, valid, B: int, T: int, L: int, width: int, dev):
    """int32 [B, width]: per window column, the token index t (>= 0), the buffered slot s
    (encoded -2 - s) or a null step (-1): each row is [its buffered steps][its valid tokens]."""
    col = torch.arange(width, device=dev)
    h0 = state.count.to(dev)
    tok = torch.where(col[None, :] < h0[:, None], -2 - col[None, :], torch.full((), -1, device=dev))
    bi, ti = valid.nonzero(as_tuple=True)
    cols = h0[bi] + (valid.long().cumsum(1) - 1)[bi, ti]
    tok[bi, cols] = ti
    return tok.to(torch.int32).contiguous()


def chunk_scan(state: ScanState, q, k, v, log_a, beta=None, *, pair, seed: int = 0,
               layer: int = 0, valid=None, exact: bool = False):
    """Triton version of `chunk_ref.chunk_scan_ref` (same arguments, same result within FP32
    reassociation, same SR bits): returns (y [B, T, H, d_v] float32, the ScanState after the
    segment). Inputs may be any float dtype (read as float32 in the kernel)."""
    _check_inputs(state, q, k, v, log_a, beta, valid)
    if pair.buffer_len != state.buffer_len:
        raise ValueError(f"pair {pair.label()} has buffer_len {pair.buffer_len} but the state was "
                         f"built with {state.buffer_len}; use the same pair")
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    if not supports(dk, dv):
        raise ValueError(f"the Triton chunk kernel needs d_k and d_v powers of two >= 16, got "
                         f"d_k={dk}, d_v={dv}; use chunk_ref.chunk_scan_ref for this shape")
    if (state.read is None) != (pair.read is None) or state.anchor.format != pair.anchor.format:
        raise ValueError(f"the state's roles ({state.anchor.format}, "
                         f"{None if state.read is None else state.read.format}) do not match the "
                         f"pair {pair.label()}")
    dev = q.device
    L = state.buffer_len
    valid_b = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.to(torch.bool)
    h0 = state.count
    m = h0 + valid_b.sum(1)
    M = int(m.max()) if B else 0
    if M == 0 or T == 0:
        return torch.zeros(B, T, H, dv, dtype=torch.float32, device=dev), state
    W = -(-M // L)
    width = W * L
    full = m // L
    nwin = -(-m // L)
    tok = _token_map(state, valid_b, B, T, L, width, dev)

    f32 = torch.float32
    q, k, v, log_a = (x.contiguous() for x in (q, k, v, log_a))
    beta = None if beta is None else beta.contiguous()
    anchor = core.qt_clone(state.anchor)
    read = None if state.read is None else core.qt_clone(state.read)
    Ap, As, Ag, afid = _role_args(anchor)
    Rp, Rs, Rg, rfid = _role_args(read if read is not None else anchor)
    y = _empty((B, T, H, dv), f32, dev)
    nk = _empty((B, H, L, dk), f32, dev)
    nv = _empty((B, H, L, dv), f32, dev)
    nG = _empty((B, H, L), f32, dev)
    nb = None if beta is None else _empty((B, H, L), f32, dev)
    bk, bv, bG = (t.to(f32).contiguous() for t in (state.k, state.v, state.G))
    bb = None if state.beta is None else state.beta.to(f32).contiguous()
    i64 = torch.int64
    h0k = h0.to(device=dev, dtype=torch.int32).contiguous()
    nfl = state.flushes.to(device=dev, dtype=i64).contiguous()
    seq = state.rows.to(device=dev, dtype=i64).contiguous()
    nw = nwin.to(torch.int32).contiguous()
    nfu = full.to(torch.int32).contiguous()
    BV, warps, LP = chunk_launch_config(pair, B, H, dv, dk, L)
    klo, khi = split_key(layer_seed(seed, layer))
    vmask = valid_b.to(torch.int8).contiguous()
    with cpu_threads(dev):
        _chunk_kernel[(B * H, dv // BV)](
            tok, vmask, q, k, v, log_a, beta if beta is not None else log_a,
            bk, bv, bG, bb if bb is not None else bG, h0k, nfl, seq, nw, nfu,
            Ap, As, Ag, Rp, Rs, Rg,
            y, nk, nv, nG, nb if nb is not None else nG,
            T, width, klo, khi,
            H=H, DK=dk, DV=dv, BV=BV, L=L, LP=LP, BT=64,
            AFMT=afid, ASR=pair.anchor.rounding == "stochastic",
            RFMT=rfid, RSR=pair.read_spec.rounding == "stochastic",
            SHARED=read is None, DELTA=beta is not None, EXACT=bool(exact),
            HAS_VALID=valid is not None, num_warps=warps)
    if exact:
        count = torch.zeros_like(state.count)
        flushes = state.flushes + 1
    else:
        count = m - full * L
        flushes = state.flushes + full
    new = ScanState(anchor=anchor, read=read, k=nk, v=nv, G=nG, beta=nb, count=count,
                    flushes=flushes, rows=state.rows)
    return y, new


def teacher_force(st, q, k, v, log_a, beta=None, *, valid=None, exact: bool = False):
    """`chunk_ref.teacher_force` through the Triton kernel: run a segment through ReplayState st
    (in place) -> y [B, T, H, d_v]."""
    from replayquant.kernels import chunk_ref
    return chunk_ref.teacher_force(st, q, k, v, log_a, beta, valid=valid, exact=exact,
                                   scan=chunk_scan)
