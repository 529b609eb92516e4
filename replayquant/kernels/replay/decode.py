"""Replay decode step and speculative verify (ReplaySSM) in Triton, one kernel for GDN, Mamba-2
and KDA (DESIGN sections 3 and 4; the torch references with the same signatures are in
`replayquant.kernels.replay.reference`; what each design choice measured is in docs/kernels.md).

The store of one layer (`stores.ReplayStore`) holds the anchor, the read copy and the ring.

A step runs, per row with committed fill h: a pre-flush when the committed entries would not
leave T free slots (fold them into the anchor, cast both roles); a flush step when this step
fills the buffer or is forced (rebuild the unrounded state, apply the step, output S q, cast
anchor and read copy independently from S, each with its own SR stream); else a read (outputs
from the packed read copy, decoded in registers, and the buffer; the step's entry appended).
The flush launch runs the first two, the read launch the reads and, in its last program of a
row, the pointer moves (a flush writing an NVFP4 role takes whole matrices: one scale per
matrix); at small batch one launch does both (_fused). The rebuild uses the
WY form of the chunked delta rule with tensor-core products (_rebuild); a shared FP32 pair
folds its cached u as it is (folds_u); KDA solving for u folds entry by entry (_rebuild_vec).
Layers sharing one pair of pointer tensors pass advance=False to all but their last.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replayquant.formats.constants import BF16, FP16
from replayquant.kernels.conventional.kernel import (_L2_EPS, _front_end, _gate_out, _gated_step,
                                                     _kernel_inputs, _l2norm, _program_tile)
from replayquant.kernels.quant.kernel import (decode_bf16, decode_fp16, encode_bf16, encode_fp16,
                                              small_float_at, small_float_pair_at)
from replayquant.kernels.replay.launch import (LAUNCHES, _max_regs, _table, fused_where,
                                              given_launch, replay_launch_config)
from replayquant.kernels.quant.roles import (_role_bits, _tile_load, _tile_store,
                                             nv_carried_scale, nv_store, split_key)
from replayquant.replay.stores import (NO_DT_LIMIT, ReplayStore, StepTensors, _begin,
                                        _default_force, _check_buffered, _indices, dt_limit_args,
                                        folds_u, solves_u, step_inputs)

__all__ = ["replay_gdn_step", "replay_mamba2_step", "replay_kda_step", "advance_pointers"]


# ============================================================================ Triton

# A read copy with a chunk in LAUNCH_TABLE is read in chunks of columns, READ_STAGES chunks' loads
# in flight (one stage is slower in every kind, docs/kernels.md)
READ_STAGES = tl.constexpr(3)
# the infinity codes of the role formats whose casts overflow (stores.cast_overflows)
_FP16_INF = tl.constexpr(FP16.inf_code)
_BF16_INF = tl.constexpr(BF16.inf_code)


@triton.jit
def _entry(slot, start, j, CAPACITY: tl.constexpr):
    return slot * CAPACITY + (start + j) % CAPACITY


@triton.jit
def _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk, rows, cols, jj, n,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  CAPACITY: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
                  WANT_U: tl.constexpr, VEC: tl.constexpr):
    """Buffer entries 0..n-1 of one (slot, head) as tiles (rows >= n are zero): Kb [BUFFER_TILE,
    DK] the raw bf16 k / B, r [BUFFER_TILE] its row factor (GDN with L2NORM: 1 / |k|, the
    re-normalisation, applied to the products; else 1), X [BUFFER_TILE, BV] float32 (GDN: raw v,
    or u when WANT_U; Mamba-2: v = dt x), G [BUFFER_TILE] cumulative log gate (VEC: [BUFFER_TILE,
    DK]), Bt [BUFFER_TILE] (beta / dt)."""
    m = jj < n
    e = _entry(slot, start, jj, CAPACITY)
    Kb = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cols[None, :], mask=m[:, None], other=0.0)
    r = tl.where(m, 1.0, 0.0)
    if DELTA:
        if L2NORM:
            Kf = Kb.to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(Kf * Kf, axis=1) + _L2_EPS)
    if VEC:
        G = tl.load(Gbuf + (e[:, None] * HV + hv) * DK + cols[None, :], mask=m[:, None],
                    other=0.0)
    else:
        G = tl.load(Gbuf + e * HV + hv, mask=m, other=0.0)
    Bt = tl.load(bbuf + e * HV + hv, mask=m, other=0.0)
    xo = (e[:, None] * HV + hv) * DV + rows[None, :]
    if WANT_U:
        X = tl.load(ubuf + xo, mask=m[:, None], other=0.0).to(tl.float32)
    else:
        X = tl.load(vbuf + xo, mask=m[:, None], other=0.0).to(tl.float32)
        if not DELTA:
            X = Bt[:, None] * X
    return Kb, r, X, G, Bt


@triton.jit
def _mm(a, b, acc, ON_GPU: tl.constexpr):
    """acc + a @ b for bf16 a, b with float32 accumulation. ON_GPU False (the interpreter, whose
    dot multiplies bf16 operands' bits, not their values): the same values in float32, exact
    (compile_check compiles ON_GPU as True)."""
    if ON_GPU:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _dot3(a, b, acc, SPLIT_B: tl.constexpr, ON_GPU: tl.constexpr):
    """acc + a @ b where one operand is bf16 (the raw k entries, exact) and the other float32,
    split into three bf16 parts (hi + mid + lo = the float32 value to ~2^-24): products exact,
    float32 accumulation, so as accurate as float32 FMAs, on tensor cores, with the bf16
    operand held once (3xTF32 would hold both operands twice)."""
    x = b if SPLIT_B else a
    for i in tl.static_range(3):              # hi, mid, lo: one part live at a time
        p = x.to(tl.bfloat16)
        if i < 2:
            x = x - p.to(tl.float32)
        if SPLIT_B:
            acc = _mm(a, p, acc, ON_GPU)
        else:
            acc = _mm(p, b, acc, ON_GPU)
    return acc


@triton.jit
def _rebuild(S0, Kb, r, X, G, Bt, jj, n, A_pay, A_sc, A_gs, mat, rows, kbuf, Tbuf, e, hk, hv,
             HK: tl.constexpr, HV: tl.constexpr, BUFFER_LEN: tl.constexpr, DK: tl.constexpr,
             DV: tl.constexpr, AFMT: tl.constexpr,
             DELTA: tl.constexpr, PREC: tl.constexpr, ON_GPU: tl.constexpr,
             FOLD_U: tl.constexpr):
    """The unrounded state after n > 0 entries (_load_entries' Kb, r, X, G, Bt, at ring
    entries e; rows >= n zero) from the checkpoint tile S0 [BV, DK] (the anchor's rows `rows`),
    with tensor-core products (module docstring). FOLD_U: X is the cached FP32 u (a shared
    pair, whose read steps computed it against the anchor itself), folded as it is. Else GDN:
    u solves the unit lower triangular
    system of DESIGN section 3 against S0; W = K S0^T and K K^T are formed over 32-column
    pieces of the anchor and the k entries, reloaded (cache hits), so that no full-width dot
    operand is held beside S0 (an NVFP4 anchor, whose blocks decode whole rows, in one piece)."""
    m = jj < n
    Gn = tl.sum(tl.where(jj == n - 1, G, 0.0), axis=0)
    U = X
    if DELTA and not FOLD_U:
        CW: tl.constexpr = DK if (AFMT == 4) or (DK < 32) else 32      # NVFP4: whole rows
        W = tl.zeros_like(X)                                                # [BUFFER_TILE, BV]: S0 k_j
        for c0 in range(0, DK, CW):
            cc = c0 + tl.arange(0, CW)
            Kc = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cc[None, :], mask=m[:, None],
                         other=0.0)
            W = _dot3(Kc, tl.trans(_tile_load(A_pay, A_sc, A_gs, mat, rows, cc, DV, DK,
                                              rows.shape[0], AFMT)), W, True, ON_GPU)
        R = Bt[:, None] * (X - tl.where(m, tl.exp(G), 0.0)[:, None] * (r[:, None] * W))
        Tm = tl.load(Tbuf + (e[:, None] * HV + hv) * BUFFER_LEN + jj[None, :],      # (I + A)^-1, rows
                     mask=m[:, None] & m[None, :], other=0.0)              # of the ring
        U = tl.dot(Tm, R, input_precision=PREC)
    w = tl.where(m, tl.exp(tl.where(m, Gn - G, 0.0)), 0.0) * r
    return _dot3(tl.trans(U * w[:, None]), Kb, tl.exp(Gn) * S0, False, ON_GPU)


@triton.jit
def _rebuild_vec(S0, kbuf, vbuf, Gbuf, bbuf, e, jj, n, hk, hv, rows, cols, HK: tl.constexpr,
                 HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr):
    """KDA: the unrounded state after n > 0 entries (at ring entries e) from the checkpoint tile
    S0 [BV, DK], the recurrence entry by entry (S <- S Diag(exp(G_j - G_{j-1})), u_j = beta_j
    (v_j - S k_j), S <- S + u_j k_j^T; G per key channel, v raw), entry j's vectors loaded from
    the ring (cache hits) rather than picked from the entries' tiles, whose reductions across
    rows cross warps in a whole-matrix tile. The WY form would need e^{G_j - G_i} per pair and
    channel ([BUFFER_TILE, BUFFER_TILE, DK]) or e^{-G_j}, which overflows for a channel that
    forgets fast, so the fold stays sequential."""
    S = S0
    Gprev = tl.zeros([DK], tl.float32)
    for j in range(0, n):
        ej = tl.sum(tl.where(jj == j, e, 0), axis=0)
        kj = tl.load(kbuf + (ej * HK + hk) * DK + cols).to(tl.float32)
        if L2NORM:
            kj = _l2norm(kj)
        Gj = tl.load(Gbuf + (ej * HV + hv) * DK + cols)
        vj = tl.load(vbuf + (ej * HV + hv) * DV + rows).to(tl.float32)
        bj = tl.load(bbuf + ej * HV + hv)
        S = S * tl.exp(Gj - Gprev)[None, :]
        u = bj * (vj - tl.sum(S * kj[None, :], axis=1))
        S = S + u[:, None] * kj[None, :]
        Gprev = Gj
    return S


@triton.jit
def _fold_vec_u(S0, Kb, r, U, G, jj, n, PREC: tl.constexpr):
    """KDA with the cached FP32 u (FOLD_U): S = S0 Diag(e^{G_n}) + U^T (K * e^{G_n - G}), one
    product (3xTF32: both operands float32), every exponential in (0, 1]."""
    m = jj < n
    Gn = tl.sum(tl.where((jj == n - 1)[:, None], G, 0.0), axis=0)
    Kw = tl.where(m[:, None], tl.exp(tl.where(m[:, None], Gn[None, :] - G, 0.0)), 0.0) \
        * (Kb.to(tl.float32) * r[:, None])
    return tl.dot(tl.trans(U), Kw, S0 * tl.exp(Gn)[None, :], input_precision=PREC)


@triton.jit
def _fold(S0, Kb, r, X, G, Bt, jj, n, A_pay, A_sc, A_gs, mat, rows, cols, kbuf, vbuf, Gbuf, bbuf,
          Tbuf, e, hk, hv, HK: tl.constexpr, HV: tl.constexpr, BUFFER_LEN: tl.constexpr, DK: tl.constexpr,
          DV: tl.constexpr, AFMT: tl.constexpr, DELTA: tl.constexpr, PREC: tl.constexpr,
          ON_GPU: tl.constexpr, VEC: tl.constexpr, FOLD_U: tl.constexpr, L2NORM: tl.constexpr):
    """_rebuild, or for a gate per key channel (VEC) _fold_vec_u (FOLD_U) / _rebuild_vec."""
    if VEC:
        if FOLD_U:
            S = _fold_vec_u(S0, Kb, r, X, G, jj, n, PREC)
        else:
            S = _rebuild_vec(S0, kbuf, vbuf, Gbuf, bbuf, e, jj, n, hk, hv, rows, cols, HK, HV, DK,
                             DV, L2NORM)
    else:
        S = _rebuild(S0, Kb, r, X, G, Bt, jj, n, A_pay, A_sc, A_gs, mat, rows, kbuf, Tbuf, e, hk,
                     hv, HK, HV, BUFFER_LEN, DK, DV, AFMT, DELTA, PREC, ON_GPU, FOLD_U)
    return S


@triton.jit
def _half_codes(S, rows, cols, key_lo, key_hi, fi, slot, hv, DK: tl.constexpr,
                FMT: tl.constexpr, SR: tl.constexpr, ROLE: tl.constexpr):
    """(the fp16 / bf16 (FMT 1 / 2) bit patterns of the cast of tile S into role ROLE, with
    _tile_store's rounding bits, 1 (int32) where one is infinite, else 0); for any other format,
    whose cast of a finite state is finite (stores.cast_overflows), (0, 0) and no cast here."""
    codes = 0
    over = 0
    if (FMT == 1) or (FMT == 2):
        rb = _role_bits(rows[:, None] * DK + cols[None, :], SR, key_lo, key_hi, fi, ROLE, slot,
                        hv)
        if FMT == 1:
            codes = encode_fp16(S, rb, SR)
            over = tl.max(tl.max(((codes & 0x7FFF) == _FP16_INF).to(tl.int32), axis=1), axis=0)
        else:
            codes = encode_bf16(S, rb, SR)
            over = tl.max(tl.max(((codes & 0x7FFF) == _BF16_INF).to(tl.int32), axis=1), axis=0)
    return codes, over


@triton.jit
def _store_role(S, codes, pay, sc, gs, mat, rows, cols, key_lo, key_hi, fi, slot, hv,
                DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, FMT: tl.constexpr,
                SR: tl.constexpr, ROLE: tl.constexpr, rec, CARRY: tl.constexpr, back):
    """Role <- the cast of S: an fp16 / bf16 role its codes from _half_codes (the bit patterns
    _tile_store stores), any other _tile_store; with CARRY (an NVFP4 read copy) cast with the
    scale carried from the amax of flush fi - 1 - back (record rec, stores.ReplayStore.carried;
    back 1: a flush step after this launch's pre-flush), noting S's amax as flush fi's."""
    if (FMT == 1) or (FMT == 2):
        tl.store(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :], codes.to(tl.int16))
    elif CARRY:
        prev = tl.load(rec + mat * 3 + (fi - 1 - back) % 3)
        amax = tl.max(tl.max(tl.abs(S), axis=1), axis=0)
        tl.atomic_max(rec + mat * 3 + fi % 3,
                      amax.to(tl.int32, bitcast=True).to(tl.int64) | (fi.to(tl.int64) << 32))
        rb = _role_bits(rows[:, None] * DK + cols[None, :], SR, key_lo, key_hi, fi, ROLE, slot,
                        hv)
        nv_store(S, nv_carried_scale((prev & 0xFFFFFFFF).to(tl.int32).to(tl.float32,
                                                                         bitcast=True)),
                 pay, sc, gs, mat, rows, rb, DV, DK, BV, SR)
    else:
        _tile_store(S, pay, sc, gs, mat, rows, cols, key_lo, key_hi, fi, slot, hv, DV, DK, BV,
                    FMT, SR, ROLE)


@triton.jit
def _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, fi,
                 slot, hv, flag_ptr, row, DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
                 AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
                 SHARED: tl.constexpr, DELTA: tl.constexpr, RECORD: tl.constexpr, rec,
                 CARRY: tl.constexpr, back):
    """anchor <- Q_anchor(S), read <- Q_read(S): two independent casts of the same S (a role in
    NVFP4 takes the whole matrix, BV = DV: one scale per matrix; not with CARRY). A tile holding
    NaN or infinity (a non-finite input; the host names it, models.runtime) keeps both roles as
    they were, and
    so does a finite tile whose cast into either role is not (an FP16 role past 65504: an fp16
    or bf16 cast is encoded first, checked, then stored, _half_codes; the other formats' casts
    of a finite state are finite); RECORD: that overflow noted in batch row `row`'s flag, the
    bit after its inputs' (stores.FAULT_COLUMNS' flush cast). CARRY: the read copy's carried
    scale, of flush fi - 1 - back (_store_role)."""
    bad = tl.sum(tl.sum(((S != S) | (tl.abs(S) == float("inf"))).to(tl.int32), axis=1), axis=0)
    if bad == 0:
        ca, over = _half_codes(S, rows, cols, key_lo, key_hi, fi, slot, hv, DK, AFMT, ASR, 0)
        cr = 0
        if not SHARED:
            cr, over_r = _half_codes(S, rows, cols, key_lo, key_hi, fi, slot, hv, DK, RFMT, RSR,
                                     1)
            over = over | over_r
        if over == 0:
            _store_role(S, ca, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi, fi, slot, hv,
                        DV, DK, BV, AFMT, ASR, 0, rec, False, back)
            if not SHARED:
                _store_role(S, cr, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, fi, slot,
                            hv, DV, DK, BV, RFMT, RSR, 1, rec, CARRY, back)
        else:
            if RECORD:
                CAST_BIT: tl.constexpr = 5 if DELTA else 4
                tl.atomic_or(flag_ptr + row, 1 << CAST_BIT)


@triton.jit
def _row_ptrs(pay, sc, mat, rows, DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr,
              PCK: tl.constexpr):
    """The read copy's tile as _tile_mv takes it: row pointers (payload, scales), or with PCK 0
    (one chunk, LAUNCH_TABLE) the chunk's loads, issued here, before the row's pointers are read
    (Mamba-2 FP8 / NVFP4 read steps 136.5 / 148.8 us against 146.2 / 159.3 loading at the pass).
    NVFP4: int32 words (column 8w+i in bits 4i..4i+3) and the E4M3 block scale bytes (one a 16
    columns); FP8: int32 words (column 4w+i in byte i) and the row scales, loaded; FP32 / FP16 /
    BF16: the values. Codes packed four or eight to a register keep a chunk in few registers."""
    if FMT == 4:
        p = pay.to(tl.pointer_type(tl.int32)) + mat * (DV * (DK // 8)) + rows * (DK // 8)
        b = sc + mat * (DV * (DK // 16)) + rows * (DK // 16)
    elif FMT == 3:
        p = pay.to(tl.pointer_type(tl.int32)) + mat * (DV * (DK // 4)) + rows * (DK // 4)
        b = tl.load(sc + mat * DV + rows)
    else:
        p = pay + mat * (DV * DK) + rows * DK
        b = tl.zeros([1], tl.float32)
    if PCK == 0:
        p, b = _chunk(p, b, 0, DK // (8 if FMT == 4 else 4 if FMT == 3 else 1), FMT)
    return p, b


@triton.jit
def _chunk(p, b, c, NWC: tl.constexpr, FMT: tl.constexpr):
    """The loads of chunk c (NWC words of each row) from row pointers p (NVFP4: and b)."""
    w = c * NWC + tl.arange(0, NWC)
    if FMT == 4:
        b = tl.load(b[:, None] + (w // 2)[None, :])
    return tl.load(p[:, None] + w[None, :]), b


@triton.jit
def _split4(x, N: tl.constexpr):
    """x [4N] -> its elements 4w, 4w+1, 4w+2, 4w+3 as four [N] vectors."""
    e, o = tl.split(tl.reshape(x, (N, 2, 2)))
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def _nib_pair(p, I: tl.constexpr, xa, xb, ya, yb, TWO: tl.constexpr, ax=None, ay=None):
    """Accumulators (ax, ay) plus the E2M1 codes I and I + 4 of the words p (decoded as a pair)
    times the columns they hold, xa and xb (and ya, yb with TWO)."""
    lo, hi = small_float_pair_at(p, 4 * I, 2, 1)
    if ax is None:
        ax = lo * xa[None, :]
        ay = ax
        if TWO:
            ay = lo * ya[None, :]
    else:
        ax += lo * xa[None, :]
        if TWO:
            ay += lo * ya[None, :]
    ax += hi * xb[None, :]
    if TWO:
        ay += hi * yb[None, :]
    return ax, ay


@triton.jit
def _words_mv(p, b, s, x, y, TWO: tl.constexpr, NW: tl.constexpr, FMT: tl.constexpr):
    """(rows of words p [BV, NW]) @ x and @ y (x, y [8 NW] NVFP4 / [4 NW] FP8 / [NW] FP32, FP16,
    BF16 columns): the codes decoded once each, in registers; b the words' block scale bytes
    (NVFP4) / the row scales (FP8)."""
    if FMT < 3:
        if FMT == 1:
            p = decode_fp16(p)
        elif FMT == 2:
            p = decode_bf16(p)
        rx = tl.sum(p * x[None, :], axis=1)
        ry = rx
        if TWO:
            ry = tl.sum(p * y[None, :], axis=1)
    elif FMT == 4:
        xe, xo = tl.split(tl.reshape(x, (NW * 4, 2)))       # columns 8w + 2j, 8w + 2j + 1
        x0, x2, x4, x6 = _split4(xe, NW)
        x1, x3, x5, x7 = _split4(xo, NW)
        if TWO:
            ye, yo = tl.split(tl.reshape(y, (NW * 4, 2)))
            y0, y2, y4, y6 = _split4(ye, NW)
            y1, y3, y5, y7 = _split4(yo, NW)
        else:
            y0, y1, y2, y3, y4, y5, y6, y7 = x0, x1, x2, x3, x4, x5, x6, x7
        ax, ay = _nib_pair(p, 0, x0, x4, y0, y4, TWO)
        ax, ay = _nib_pair(p, 1, x1, x5, y1, y5, TWO, ax, ay)
        ax, ay = _nib_pair(p, 2, x2, x6, y2, y6, TWO, ax, ay)
        ax, ay = _nib_pair(p, 3, x3, x7, y3, y7, TWO, ax, ay)
        bs = small_float_at(b.to(tl.int32), 0, 4, 3) * (s * 2.0 ** 14 * 2.0 ** 8)
        rx = tl.sum(ax * bs, axis=1)
        ry = rx
        if TWO:
            ry = tl.sum(ay * bs, axis=1)
    elif FMT == 3:
        x0, x1, x2, x3 = _split4(x, NW)
        c0, c2 = small_float_pair_at(p, 0, 4, 3)
        c1, c3 = small_float_pair_at(p, 8, 4, 3)
        sc = b * 2.0 ** 8
        rx = tl.sum(c0 * x0[None, :] + c1 * x1[None, :] + c2 * x2[None, :] + c3 * x3[None, :],
                    axis=1) * sc
        ry = rx
        if TWO:
            y0, y1, y2, y3 = _split4(y, NW)
            ry = tl.sum(c0 * y0[None, :] + c1 * y1[None, :] + c2 * y2[None, :]
                        + c3 * y3[None, :], axis=1) * sc
    return rx, ry


@triton.jit
def _row_of(M, t):
    """Row t of M [R, N] (t a scalar, e.g. a loop index)."""
    return tl.sum(tl.where((tl.arange(0, M.shape[0]) == t)[:, None], M, 0.0), axis=0)


@triton.jit
def _tile_mv(p, b, s, x, y, TWO: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr,
             PCK: tl.constexpr):
    """(read copy) @ x and, with TWO, (read copy) @ y (x, y [DK] float32) from _row_ptrs' tile,
    PCK columns a chunk (LAUNCH_TABLE; 0: one chunk, loaded; >= DK: one chunk loaded here), the
    next chunks' loads in flight (READ_STAGES), each code decoded once, in registers, as it is
    used (one pass serves both vectors); without TWO the second value is the first. NVFP4: sums
    over each word's 8 columns, times the word's block scale, summed over the row, times the
    matrix scale (and the decode's 2^14 2^8); FP8: the row's sum times its scale (and 2^8)."""
    CPW: tl.constexpr = 8 if FMT == 4 else 4 if FMT == 3 else 1       # columns a word
    if PCK == 0:
        rx, ry = _words_mv(p, b, s, x, y, TWO, DK // CPW, FMT)
    else:
        CK: tl.constexpr = PCK if PCK < DK else DK
        NC: tl.constexpr = DK // CK
        rx = tl.zeros([p.shape[0]], tl.float32)
        ry = tl.zeros([p.shape[0]], tl.float32)
        for c in tl.range(0, NC, num_stages=READ_STAGES):
            pc, bc = _chunk(p, b, c, CK // CPW, FMT)
            xc = x
            yc = y
            if NC > 1:
                xc = _row_of(tl.reshape(x, (NC, CK)), c)
                yc = xc
                if TWO:
                    yc = _row_of(tl.reshape(y, (NC, CK)), c)
            ax, ay = _words_mv(pc, bc, s, xc, yc, TWO, CK // CPW, FMT)
            rx += ax
            ry += ay
    return rx, ry


@triton.jit
def _tile_mv_t(p, b, s, Y, DK: tl.constexpr, FMT: tl.constexpr, PCK: tl.constexpr,
               T: tl.constexpr):
    """R Y^T [BV, TP] of a Mamba-2 verify's T drafts (Y [TP, DK], row t: draft t's C) in one pass
    over the read copy, each chunk loaded once and read T times from registers (GDN, whose
    drafts need R k and R q, keeps T passes: docs/kernels.md)."""
    CPW: tl.constexpr = 8 if FMT == 4 else 4 if FMT == 3 else 1       # columns a word
    CK: tl.constexpr = DK if (PCK == 0) or (PCK >= DK) else PCK
    NC: tl.constexpr = DK // CK
    tt = tl.arange(0, Y.shape[0])
    RY = tl.zeros([p.shape[0], Y.shape[0]], tl.float32)
    for c in tl.range(0, NC, num_stages=READ_STAGES):
        pc, bc = p, b
        if PCK != 0:
            pc, bc = _chunk(p, b, c, CK // CPW, FMT)
        for t in tl.static_range(T):
            yc = _row_of(Y, t)
            if NC > 1:
                yc = _row_of(tl.reshape(yc, (NC, CK)), c)
            ay, _ = _words_mv(pc, bc, s, yc, yc, False, CK // CPW, FMT)
            RY += tl.where((tt == t)[None, :], ay[:, None], 0.0)
    return RY


@triton.jit
def _flush_flags(h, T: tl.constexpr, BUFFER_LEN: tl.constexpr, STEP: tl.constexpr):
    """A row's flushes at committed fill h (a scalar or a block), the one definition that the
    kernel and the pointer moves share: (pre, fill). pre: the committed entries would not leave
    T free slots (h + T > L, h > 0; T = 1 in a step), so they fold into the anchor first; fill:
    in a step (STEP), the step's entry fills the buffer (h + 1 == L, from the fill left after
    pre). A forced step flushes whatever these say."""
    pre = (h + T > BUFFER_LEN) & (h > 0)
    fill = pre & (h < 0)                        # False, shaped as h
    if STEP:
        fill = tl.where(pre, 0, h) + 1 == BUFFER_LEN
    return pre, fill


@triton.jit
def _moved_pointers(h, st, nf, force, BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr, T: tl.constexpr,
                    STEP: tl.constexpr):
    """(committed, start, n_flush) after a step (STEP) or a verify of T drafts, from the values
    the kernel read (scalars or blocks): the kernel's flush decisions."""
    pre, fill = _flush_flags(h, T, BUFFER_LEN, STEP)
    nf = tl.where(pre, nf + 1, nf)
    st = tl.where(pre, (st + h) % CAPACITY, st)
    h = tl.where(pre, 0, h)
    if STEP:
        fl = fill | (force != 0)
        nf = tl.where(fl, nf + 1, nf)
        h = tl.where(fl, 0, h + 1)
    return h, st, nf


@triton.jit
def _nonfinite(x):
    """1 (int32) per element of float32 x that is NaN or infinite, else 0."""
    return ((x != x) | (tl.abs(x) > 3.4028234663852886e38)).to(tl.int32)


@triton.jit
def _faulty(x):
    """1 (int32) where the float32 block x holds NaN or infinity, else 0."""
    return tl.max(_nonfinite(x), axis=0)


@triton.jit
def _note_inputs(flag_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, tok, hv, hk, rows, cols,
                 HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DELTA: tl.constexpr, VEC: tl.constexpr):
    """ORs into flag[tok] the bits of the raw inputs _front_end reads for token tok and value
    head hv that hold NaN or infinity (bits 0-4: q, k of key head hk, v on `rows`, a, b; the
    kind's names in stores.FAULT_INPUTS): an atomic only where one does."""
    f = _faulty(tl.load(q_ptr + (tok * HK + hk) * DK + cols).to(tl.float32))
    f = f | (_faulty(tl.load(k_ptr + (tok * HK + hk) * DK + cols).to(tl.float32)) << 1)
    f = f | (_faulty(tl.load(v_ptr + (tok * HV + hv) * DV + rows).to(tl.float32)) << 2)
    if VEC:
        f = f | (_faulty(tl.load(a_ptr + (tok * HV + hv) * DK + cols).to(tl.float32)) << 3)
    else:
        f = f | (_nonfinite(tl.load(a_ptr + tok * HV + hv).to(tl.float32)) << 3)
    if DELTA:
        f = f | (_nonfinite(tl.load(b_ptr + tok * HV + hv).to(tl.float32)) << 4)
    if f != 0:
        tl.atomic_or(flag_ptr + tok, f)


@triton.jit
def _note_step(flag_ptr, bad_ptr, stp_ptr, row, DELTA: tl.constexpr):
    """The row's last program of a step: steps[row] += 1, and bad[row, i] = that count for each
    input i whose bit the row's programs set in flag[row] and that held no earlier fault; the
    flag cleared (an atomic read: other programs' ORs went to L2). Its columns and bits are
    stores.FAULT_COLUMNS': the inputs', then the flush's cast (_store_roles)."""
    NB: tl.constexpr = 6 if DELTA else 5
    n = tl.load(stp_ptr + row) + 1
    tl.store(stp_ptr + row, n)
    f = tl.atomic_xchg(flag_ptr + row, 0)
    if f != 0:
        ii = tl.arange(0, 8)
        m = ii < NB
        old = tl.load(bad_ptr + row * NB + ii, mask=m, other=0)
        hit = ((f >> ii) & 1) != 0
        tl.store(bad_ptr + row * NB + ii, tl.where(hit & (old < 0), n, old), mask=m)


@triton.jit
def _read_drafts(P, Pb, s, kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, out_ptr, q_ptr, k_ptr, v_ptr,
                 a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, beta_scale, dt_lo, dt_hi, row, hv,
                 hk, rows, cols, slot, start, h, jj, lead, HK: tl.constexpr, HV: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, CAPACITY: tl.constexpr, T: tl.constexpr,
                 RFMT: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
                 HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                 U_BF16: tl.constexpr, DT_CLAMP: tl.constexpr, VEC: tl.constexpr,
                 PCK: tl.constexpr, KF: tl.constexpr, BUFFER_LEN: tl.constexpr, flag_ptr,
                 RECORD: tl.constexpr):
    """Outputs of T entries from the read copy tile (P, Pb, s) and the h committed entries,
    output-only: y = e^{G_p} (R q) + sum_j e^{G_p - G_j} (k_j . q) u_j + (k . q) u, draft t
    seeing the drafts before it; GDN u = beta (v - e^{G_p} R k - sum_j e^{G_p - G_j}
    (k_j . k) u_j), R k and R q in one pass over the tile. Appends each entry at h + t (raw k and
    v / x in bf16, u, G, beta / dt; lead: the one block of the head that writes its k, G and
    beta). VEC (KDA, G [BUFFER_TILE, DK] per key channel): the decays enter the keys, e^{G_p} on R's
    columns (R (e^{G_p} * k), R (e^{G_p} * q)) and e^{G_p - G_j} on k_j. KF (GDN whose flush
    solves for u): lead also appends the entry's row of the key factors (I + A)^{-1} (DESIGN
    section 4), T_p = e_p - sum_{j<p} A_pj T_j with A_pj = beta e^{G_p - G_j} (k_j . k): the
    solve's forward substitution, one row a step, so that the flush only multiplies. RECORD (a
    step): the inputs' faults noted in flag_ptr (_note_inputs)."""
    Kb, r, X, G, Bt = _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk, rows,
                                    cols, jj, h, HK, HV, DK, DV, CAPACITY, DELTA, L2NORM, DELTA, VEC)
    Tm = 0.0                        # (no key factors)
    if KF:                          # the key factors of the committed entries (lead only)
        hl = tl.where(lead, h, 0)
        Tm = tl.load(Tbuf + (_entry(slot, start, jj, CAPACITY)[:, None] * HV + hv) * BUFFER_LEN + jj[None, :],
                     mask=(jj < hl)[:, None] & (jj < hl)[None, :], other=0.0)
    if VEC:
        Gp = tl.sum(tl.where((jj == h - 1)[:, None], G, 0.0), axis=0)
    else:
        Gp = tl.sum(tl.where(jj == h - 1, G, 0.0), axis=0)   # the last committed gate
    RQ = 0.0                        # (a single step, or not Mamba-2)
    if (T > 1) and not DELTA:       # Mamba-2: the drafts' R q in one pass (_tile_mv_t)
        RQ = _drafts_rq(P, Pb, s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv,
                        hk, rows, cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB,
                        HAS_D, DT_CLAMP, VEC, RFMT, PCK, T)
    for t in tl.static_range(T):
        tok = row * T + t
        q, k, v, log_a, beta, skip = _front_end(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, tok, hv, hk, rows, cols,
            scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D, DT_CLAMP, VEC)
        p = h + t
        Gp = Gp + log_a
        trow = 0.0
        if VEC:
            y, u = _draft_vec(P, Pb, s, Kb, r, X, G, q, k, v, beta, Gp, jj < p, DK, RFMT, PCK, U_BF16)
        else:
            y, u, trow, beta = _draft_scalar(P, Pb, s, Kb, r, X, G, Tm, RQ, q, k, v, beta, beta_scale,
                                             Gp, p, t, jj, DK, RFMT, PCK, U_BF16, DELTA, KF, T)
        y = _gate_out(y + skip, z_ptr, tok, hv, rows, HV, DV, HAS_Z)
        tl.store(out_ptr + (tok * HV + hv) * DV + rows, y)
        e = _entry(slot, start, p, CAPACITY)
        kraw = tl.load(k_ptr + (tok * HK + hk) * DK + cols)
        if KF:
            if lead:
                tl.store(Tbuf + (e * HV + hv) * BUFFER_LEN + jj, trow, mask=jj < BUFFER_LEN)
        if T > 1:                   # draft t is entry p of the drafts after it
            cur = jj == p
            if KF:
                Tm = tl.where(cur[:, None], trow[None, :], Tm)
            Kb = tl.where(cur[:, None], kraw.to(tl.bfloat16)[None, :], Kb)
            rk_ = 1.0
            if DELTA:
                if L2NORM:
                    kf = kraw.to(tl.float32)
                    rk_ = 1.0 / tl.sqrt(tl.sum(kf * kf, axis=0) + _L2_EPS)
            r = tl.where(cur, rk_, r)
            X = tl.where(cur[:, None], u[None, :], X)
            if VEC:
                G = tl.where(cur[:, None], Gp[None, :], G)
            else:
                G = tl.where(cur, Gp, G)
        _append_entry(kbuf, vbuf, ubuf, Gbuf, bbuf, v_ptr, kraw, u, Gp, beta, e, tok, hv, hk, rows,
                      cols, lead, HK, HV, DK, DV, DELTA, VEC)
        if RECORD:      # last, where the tiles are dead: its loads add no register pressure
            _note_inputs(flag_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, tok, hv, hk, rows, cols,
                         HK, HV, DK, DV, DELTA, VEC)


@triton.jit
def _drafts_rq(P, Pb, s, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk,
               rows, cols, scale, dt_lo, dt_hi, HK: tl.constexpr, HV: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
               HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, DT_CLAMP: tl.constexpr,
               VEC: tl.constexpr, RFMT: tl.constexpr, PCK: tl.constexpr, T: tl.constexpr):
    """Mamba-2's verify: R q of the T drafts in one pass over the read copy tile (_tile_mv_t),
    [BV, TP] with TP the power of two at or above T (column t: draft t)."""
    TP: tl.constexpr = 2 if T <= 2 else 4 if T <= 4 else 8 if T <= 8 else 16 if T <= 16 else 32
    tt = tl.arange(0, TP)
    Ym = tl.zeros([TP, DK], tl.float32)
    for t in tl.static_range(T):
        q, k, v, log_a, beta, skip = _front_end(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row * T + t, hv, hk,
            rows, cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D,
            DT_CLAMP, VEC)
        Ym = tl.where((tt == t)[:, None], q[None, :], Ym)
    return _tile_mv_t(P, Pb, s, Ym, DK, RFMT, PCK, T)


@triton.jit
def _draft_vec(P, Pb, s, Kb, r, X, G, q, k, v, beta, Gp, prev, DK: tl.constexpr,
               RFMT: tl.constexpr, PCK: tl.constexpr, U_BF16: tl.constexpr):
    """KDA's output y and u of one draft (_read_drafts, VEC): the decays per key channel enter
    the keys. The buffer's terms come before the read copy's pass (_tile_mv), so that the
    entries' tiles are dead during it."""
    wdec = tl.where(prev[:, None], tl.exp(tl.where(prev[:, None], Gp[None, :] - G, 0.0)), 0.0)
    eG = tl.exp(Gp)
    Kw = Kb.to(tl.float32) * wdec
    corr = tl.sum((r * tl.sum(Kw * k[None, :], axis=1))[:, None] * X, axis=0)
    yb = tl.sum((r * tl.sum(Kw * q[None, :], axis=1))[:, None] * X, axis=0)
    rk, rq = _tile_mv(P, Pb, s, eG * k, eG * q, True, DK, RFMT, PCK)
    u = beta * (v - rk) - beta * corr
    if U_BF16:
        u = u.to(tl.bfloat16).to(tl.float32)
    return rq + yb + tl.sum(k * q, axis=0) * u, u


@triton.jit
def _draft_scalar(P, Pb, s, Kb, r, X, G, Tm, RQ, q, k, v, beta, beta_scale, Gp, p, t, jj,
                  DK: tl.constexpr, RFMT: tl.constexpr, PCK: tl.constexpr, U_BF16: tl.constexpr,
                  DELTA: tl.constexpr, KF: tl.constexpr, T: tl.constexpr):
    """GDN's (DELTA) or Mamba-2's output y, u, key-factor row (KF) and beta of draft t at entry p
    (_read_drafts). The buffer's terms come before the read copy's pass (_tile_mv), so that the
    entries' tiles are dead during it: GDN's NVFP4 read fits 168 registers without spills (255
    and 52 spilled bytes before) and LAUNCH_TABLE's 128 with 152 bytes."""
    prev = jj < p
    wdec = tl.where(prev, tl.exp(tl.where(prev, Gp - G, 0.0)), 0.0)
    eG = tl.exp(Gp)
    qk = r * tl.sum(Kb.to(tl.float32) * q[None, :], axis=1)
    yb = tl.sum((wdec * qk)[:, None] * X, axis=0)
    trow = 0.0
    if DELTA:
        beta = beta * beta_scale
        kk = r * tl.sum(Kb.to(tl.float32) * k[None, :], axis=1)
        corr = tl.sum((wdec * kk)[:, None] * X, axis=0)
        if KF:
            trow = tl.where(jj == p, 1.0, 0.0) - tl.sum((beta * wdec * kk)[:, None] * Tm, axis=0)
        rk, rq = _tile_mv(P, Pb, s, k, q, True, DK, RFMT, PCK)
        u = beta * (v - eG * rk) - beta * corr
        if U_BF16:
            u = u.to(tl.bfloat16).to(tl.float32)
    else:
        if T > 1:
            rq = tl.sum(tl.where((tl.arange(0, RQ.shape[1]) == t)[None, :], RQ, 0.0), axis=1)
        else:
            rq, _ = _tile_mv(P, Pb, s, q, q, False, DK, RFMT, PCK)
        u = v
    return eG * rq + yb + tl.sum(k * q, axis=0) * u, u, trow, beta


@triton.jit
def _append_entry(kbuf, vbuf, ubuf, Gbuf, bbuf, v_ptr, kraw, u, Gp, beta, e, tok, hv, hk, rows,
                  cols, lead, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                  DV: tl.constexpr, DELTA: tl.constexpr, VEC: tl.constexpr):
    """Entry e of the ring from draft tok: raw v in bf16, u (DELTA); lead, the one block of the
    head that writes them: G, beta / dt, and raw k in bf16 (the key head's first value head)."""
    tl.store(vbuf + (e * HV + hv) * DV + rows,
             tl.load(v_ptr + (tok * HV + hv) * DV + rows).to(tl.bfloat16))
    if DELTA:
        tl.store(ubuf + (e * HV + hv) * DV + rows, u.to(ubuf.dtype.element_ty))
    if lead:
        if VEC:
            tl.store(Gbuf + (e * HV + hv) * DK + cols, Gp)
        else:
            tl.store(Gbuf + e * HV + hv, Gp)
        tl.store(bbuf + e * HV + hv, beta)
        if hv % (HV // HK) == 0:
            tl.store(kbuf + (e * HK + hk) * DK + cols, kraw.to(tl.bfloat16))


@triton.jit
def _flush_tile_at(tile, n_rows, HV: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """(batch row, value head, row block) of flush-launch tile `tile` (a scalar or a block). The
    tiles of one (value head, row block) are consecutive over the batch rows, so that the tiles
    of a program belong to different rows and rows flushing out of phase spread over the
    programs (docs/kernels.md, flush tiles' order)."""
    hb = tile // n_rows
    return tile % n_rows, hb // (DV // BV), hb % (DV // BV)


@triton.jit
def _flush_tile(tile, n_rows, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, ubuf, Gbuf, bbuf,
                Tbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                A_ptr, dtb_ptr, D_ptr, z_ptr, scale, beta_scale, key_lo, key_hi, dt_lo, dt_hi,
                HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BV: tl.constexpr, BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr,
                BUFFER_TILE: tl.constexpr, T: tl.constexpr, STEP: tl.constexpr, FORCE: tl.constexpr,
                AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
                SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
                HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
                DT_CLAMP: tl.constexpr, PREC: tl.constexpr, ON_GPU: tl.constexpr,
                VEC: tl.constexpr, FOLD_U: tl.constexpr, flag_ptr, RECORD: tl.constexpr, rec,
                CARRY: tl.constexpr):
    """The flush launch's work on one tile (batch row, value head, BV rows) of a row that
    pre-flushes or flushes: the pre-flush (fold the h committed entries, cast both roles), then
    in a step the flush step (rebuild, this step, output S q, cast both roles; RECORD: its
    inputs' faults noted, _note_inputs, and a cast that overflowed, _store_roles)."""
    row, hv, blk = _flush_tile_at(tile, n_rows, HV, DV, BV)
    hk = hv // (HV // HK)
    rows = blk * BV + tl.arange(0, BV)
    cols = tl.arange(0, DK)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    mat = slot * HV + hv
    jj = tl.arange(0, BUFFER_TILE)
    h = tl.load(h_ptr + slot)
    start = tl.load(st_ptr + slot)
    nf = tl.load(nf_ptr + slot)
    pre, fill = _flush_flags(h, T, BUFFER_LEN, STEP)
    if pre:
        Kb, r, X, G, Bt = _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk, rows,
                                        cols, jj, h, HK, HV, DK, DV, CAPACITY, DELTA, L2NORM, FOLD_U,
                                        VEC)
        S = _fold(_tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT), Kb, r, X, G,
                  Bt, jj, h, A_pay, A_sc, A_gs, mat, rows, cols, kbuf, vbuf, Gbuf, bbuf, Tbuf,
                  _entry(slot, start, jj, CAPACITY), hk, hv, HK, HV, BUFFER_LEN, DK, DV, AFMT, DELTA, PREC,
                  ON_GPU, VEC, FOLD_U, L2NORM)
        nf = nf + 1
        _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi,
                     nf, slot, hv, flag_ptr, row, DV, DK, BV, AFMT, ASR, RFMT, RSR, SHARED, DELTA,
                     RECORD, rec, CARRY, 0)
        start = (start + h) % CAPACITY
        h = h * 0
        tl.debug_barrier()          # a flush step after it reads the anchor just written
    if STEP:
        if fill | FORCE:
            q, k, v, log_a, beta, skip = _front_end(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk, rows,
                cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D,
                DT_CLAMP, VEC)
            S = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
            if h > 0:
                Kb, r, X, G, Bt = _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv,
                                                hk, rows, cols, jj, h, HK, HV, DK, DV, CAPACITY,
                                                DELTA, L2NORM, FOLD_U, VEC)
                S = _fold(S, Kb, r, X, G, Bt, jj, h, A_pay, A_sc, A_gs, mat, rows, cols, kbuf,
                          vbuf, Gbuf, bbuf, Tbuf, _entry(slot, start, jj, CAPACITY), hk, hv, HK, HV,
                          BUFFER_LEN, DK, DV, AFMT, DELTA, PREC, ON_GPU, VEC, FOLD_U, L2NORM)
            # this step on the rebuilt state: the conventional step's arithmetic (L = 1 and a
            # forced step on empty buffers are the conventional kernel)
            S, y = _gated_step(S, q, k, v, log_a, beta * beta_scale if DELTA else beta, DELTA,
                               VEC)
            _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo,
                         key_hi, nf + 1, slot, hv, flag_ptr, row, DV, DK, BV, AFMT, ASR, RFMT,
                         RSR, SHARED, DELTA, RECORD, rec, CARRY, pre.to(tl.int64))
            y = _gate_out(y + skip, z_ptr, row, hv, rows, HV, DV, HAS_Z)
            tl.store(out_ptr + (row * HV + hv) * DV + rows, y)
            if RECORD:  # last, where the tiles are dead (see _read_drafts)
                _note_inputs(flag_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, row, hv, hk, rows,
                             cols, HK, HV, DK, DV, DELTA, VEC)


@triton.jit
def _read_setup(R_gs, mat, start, h, pre, fill, FORCE: tl.constexpr, CAPACITY: tl.constexpr,
                RFMT: tl.constexpr, STEP: tl.constexpr):
    """A read program's global scale s of its read copy (NVFP4), its row's start and committed
    count h after a pre-flush (folded by the flush launch), and whether it reads (a step that
    flushes does not; a verify always reads)."""
    s = 1.0
    if RFMT == 4:
        s = tl.load(R_gs + mat)
    if pre:
        start = (start + h) % CAPACITY
        h = h * 0
    go = True
    if STEP:
        go = ~(fill | FORCE)
    return s, start, h, go


@triton.jit
def _advance_row(h_ptr, st_ptr, nf_ptr, cnt_ptr, flag_ptr, bad_ptr, stp_ptr, slot, row,
                 PROGRAMS: tl.constexpr, FORCE: tl.constexpr, BUFFER_LEN: tl.constexpr,
                 CAPACITY: tl.constexpr, T: tl.constexpr, STEP: tl.constexpr,
                 DELTA: tl.constexpr, RECORD: tl.constexpr):
    """The pointer moves of a row by the last of its PROGRAMS read programs to arrive (arrival
    counter cnt_ptr, reset for the next step): committed / start / n_flush (_moved_pointers),
    and with RECORD the step's faults (_note_step)."""
    tl.debug_barrier()                  # every thread of the program is past its loads
    arrived = tl.atomic_add(cnt_ptr + slot, 1)          # acq_rel, gpu scope
    if arrived == PROGRAMS - 1:                         # the row's last program
        h, st, nf = _moved_pointers(tl.load(h_ptr + slot), tl.load(st_ptr + slot),
                                    tl.load(nf_ptr + slot), FORCE, BUFFER_LEN, CAPACITY, T, STEP)
        tl.store(h_ptr + slot, h)
        tl.store(st_ptr + slot, st)
        tl.store(nf_ptr + slot, nf)
        tl.store(cnt_ptr + slot, 0)
        if RECORD:
            _note_step(flag_ptr, bad_ptr, stp_ptr, row, DELTA)


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi", "n_rows"])
def _replay_kernel(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, h_ptr, st_ptr, nf_ptr, cnt_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, flag_ptr, bad_ptr, stp_ptr,
        rec, scale, beta_scale, key_lo, key_hi, dt_lo, dt_hi, n_rows,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr,
        BUFFER_TILE: tl.constexpr, T: tl.constexpr, STEP: tl.constexpr, FORCE: tl.constexpr,
        ADVANCE: tl.constexpr,
        AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
        SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr, HAS_DTB: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, U_BF16: tl.constexpr, DT_CLAMP: tl.constexpr,
        PREC: tl.constexpr, ON_GPU: tl.constexpr, VEC: tl.constexpr, FLUSHES: tl.constexpr,
        TPP: tl.constexpr, FOLD_U: tl.constexpr, PCK: tl.constexpr,
        KF: tl.constexpr, FUSED: tl.constexpr, FBV: tl.constexpr, RECORD: tl.constexpr,
        CARRY: tl.constexpr):
    """A decode step (STEP, T = 1) or a verify of T drafts, in launches that make the same
    per-row decisions from the same pointers. FLUSHES, the flush launch: program p takes the
    TPP tiles from p TPP on (_flush_tile_at's order, _flush_grid), reads their rows' pointers at
    once and runs _flush_tile on those whose row pre-flushes or flushes (on a read step it
    returns after that one round of loads). Else the read launch, a program per [BV, d_k] tile:
    the reads (_read_drafts), and with ADVANCE the row's pointer moves (_advance_row). FUSED
    (_fused): the read launch alone, a program whose row flushes running _flush_tile on its
    tile's BV / FBV sub-tiles of FBV rows first (BV = FBV: on the flush's tiles; BV > FBV: on the
    read's tiles, the flush inside the read program), then reading.
    Each launch compiles its own path only. VEC: KDA (a_ptr the log decay per key channel, b_ptr beta).
    RECORD (a step with ADVANCE): the step notes its inputs' faults and its flush's casts that
    overflowed in a stores.FaultRecord (flag_ptr, bad_ptr, stp_ptr; _note_inputs, _store_roles,
    _note_step)."""
    if FLUSHES:
        NT = n_rows * (HV * (DV // BV))
        tiles = tl.program_id(0) * TPP + tl.arange(0, TPP)
        okt = tiles < NT
        trow, _, _ = _flush_tile_at(tiles, n_rows, HV, DV, BV)
        tslot = tl.load(idx_ptr + trow, mask=okt, other=-1)
        th = tl.load(h_ptr + tslot, mask=tslot >= 0, other=0)
        tpre, tfill = _flush_flags(th, T, BUFFER_LEN, STEP)
        need = ((tpre | tfill | FORCE) & (tslot >= 0)).to(tl.int32)
        rank = tl.cumsum(need, axis=0)
        for i in range(tl.sum(need, axis=0)):
            tile = tl.sum(tl.where((need > 0) & (rank == i + 1), tiles, 0), axis=0)
            _flush_tile(tile, n_rows, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, ubuf,
                        Gbuf, bbuf, Tbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr,
                        v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, beta_scale,
                        key_lo, key_hi, dt_lo, dt_hi, HK, HV, DK, DV, BV, BUFFER_LEN, CAPACITY,
                        BUFFER_TILE, T, STEP, FORCE, AFMT, ASR, RFMT, RSR, SHARED, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z,
                        DT_CLAMP, PREC, ON_GPU, VEC, FOLD_U, flag_ptr, RECORD, rec, CARRY)
    else:
        row, hv, hk, rows0, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
        if slot >= 0:
            mat = slot * HV + hv
            jj = tl.arange(0, BUFFER_TILE)
            if not FUSED:           # (with one chunk its loads before the pointers')
                P, Pb = _row_ptrs(R_pay, R_sc, mat, rows0, DV, DK, RFMT, PCK)
            h = tl.load(h_ptr + slot)
            start = tl.load(st_ptr + slot)
            pre, fill = _flush_flags(h, T, BUFFER_LEN, STEP)
            if FUSED:                       # this tile's own flush first, then its read copy
                if pre | fill | FORCE:
                    for sb in range(BV // FBV):   # FBV-row sub-tiles, whole rows; a loop: one copy
                        _flush_tile(
                            (hv * (DV // FBV) + tl.program_id(1) * (BV // FBV) + sb) * n_rows
                            + row, n_rows, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf,
                            ubuf, Gbuf, bbuf, Tbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr,
                            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
                            scale, beta_scale, key_lo, key_hi, dt_lo, dt_hi, HK, HV, DK, DV, FBV,
                            BUFFER_LEN, CAPACITY, BUFFER_TILE, T, STEP, FORCE, AFMT, ASR, RFMT,
                            RSR, SHARED, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP, PREC,
                            ON_GPU, VEC, FOLD_U, flag_ptr, RECORD, rec, CARRY)
                    tl.debug_barrier()      # the tile's roles are written
                P, Pb = _row_ptrs(R_pay, R_sc, mat, rows0, DV, DK, RFMT, PCK)
            s, start, h, go = _read_setup(R_gs, mat, start, h, pre, fill, FORCE, CAPACITY, RFMT, STEP)
            if go:
                _read_drafts(P, Pb, s, kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, out_ptr, q_ptr, k_ptr,
                             v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, beta_scale, dt_lo,
                             dt_hi, row, hv, hk, rows0, cols, slot, start, h, jj,
                             tl.program_id(1) == 0, HK, HV, DK, DV, CAPACITY,
                             T, RFMT, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z,
                             U_BF16, DT_CLAMP, VEC, PCK, KF, BUFFER_LEN, flag_ptr, RECORD)
            if ADVANCE:
                _advance_row(h_ptr, st_ptr, nf_ptr, cnt_ptr, flag_ptr, bad_ptr, stp_ptr, slot, row,
                             HV * (DV // BV), FORCE, BUFFER_LEN, CAPACITY, T, STEP, DELTA, RECORD)
        else:
            for t in tl.static_range(T):
                tl.store(out_ptr + ((row * T + t) * HV + hv) * DV + rows0,
                         tl.zeros([BV], tl.float32))


@triton.jit
def _advance_kernel(h_ptr, st_ptr, nf_ptr, idx_ptr, acc_ptr, B, BUFFER_LEN: tl.constexpr,
                    CAPACITY: tl.constexpr, T: tl.constexpr,
                    STEP: tl.constexpr, force, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Pointer moves after a step / verify launch without ADVANCE (the kernel's decisions), or
    after accept (committed += accepted)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < B
    s = tl.load(idx_ptr + offs, mask=m, other=-1)
    ok = m & (s >= 0)
    h = tl.load(h_ptr + s, mask=ok, other=0)
    st = tl.load(st_ptr + s, mask=ok, other=0)
    nf = tl.load(nf_ptr + s, mask=ok, other=0)
    if HAS_ACC:
        h = h + tl.load(acc_ptr + offs, mask=ok, other=0).to(h.dtype)
    else:
        h, st, nf = _moved_pointers(h, st, nf, force, BUFFER_LEN, CAPACITY, T, STEP)
    tl.store(h_ptr + s, h, mask=ok)
    tl.store(st_ptr + s, st, mask=ok)
    tl.store(nf_ptr + s, nf, mask=ok)


# ============================================================================ host side

# The flush launch's grid: a program takes TPP tiles (a power of two, _flush_tile_at's order), as
# few as keep FLUSH_PROGRAMS_PER_SM programs an SM busy (the one-warp flush tile of 255 registers
# fits 8), at most FLUSH_MAX_TILES, so that a read step's flush launch, whose programs return,
# stays small (docs/kernels.md)
FLUSH_PROGRAMS_PER_SM = 8
FLUSH_MAX_TILES = 8


def _flush_grid(n_tiles: int, device):
    """(tiles a program TPP, grid) of the flush launch for n_tiles tiles. On the CPU (the
    interpreter) every program takes FLUSH_MAX_TILES, so that one program meets tiles of rows
    that flush, rows that do not and padding rows."""
    device = torch.device(device)
    sms = 0
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return flush_grid_on(n_tiles, sms)


def flush_grid_on(n_tiles: int, sms: int):
    """_flush_grid on a GPU of `sms` SMs (0: the interpreter's grid)."""
    target = sms * FLUSH_PROGRAMS_PER_SM if sms else 1
    tpp = min(FLUSH_MAX_TILES, triton.next_power_of_2(max(1, -(-n_tiles // target))))
    return tpp, (-(-n_tiles // tpp),)


def _fused(T: int, step: bool, n_warps: int, device, where: str = "") -> str:
    """Which tiles a decode step's one launch runs on ('flush' / 'read'), or '' for two launches
    (the flush launch, then the read launch). FUSED on the flush's tiles: each program, whole
    matrices where a role is NVFP4, flushes its own tile if its row flushes, then reads; on the
    read's tiles: a program whose row flushes runs the flush on its tile's sub-tiles of the
    flush's rows, one after another, then reads (no flush launch at any batch; an NVFP4 role,
    flushed a whole matrix at a time, cannot). override_replay_launch({'fused': True (the
    flush's tiles) / 'read' / False}) decides; by default a step on the GPU fuses on the flush's
    tiles when they, n_warps warps in all, fit one wave of the flush launch
    (FLUSH_PROGRAMS_PER_SM one-warp programs an SM), where a step is its launches' latency
    (docs/kernels.md, one launch at small batch), and above that runs `where`
    (launch.fused_where: FUSED_TABLE); the interpreter runs two launches unless asked."""
    ok = step and T == 1
    want = given_launch().get("fused")
    if want is None:
        device = torch.device(device)
        if not (ok and device.type == "cuda"):
            return ""
        one = n_warps <= FLUSH_PROGRAMS_PER_SM * \
            torch.cuda.get_device_properties(device).multi_processor_count
        return "flush" if one else where
    if want not in (True, False, "read"):
        raise ValueError(f"launch['fused'] must be True (one launch on the flush's tiles), "
                         f"'read' (one launch on the read's tiles) or False, got {want!r}")
    if want is not False and not ok:
        raise ValueError(f"override_replay_launch({{'fused': {want!r}}}) takes a decode step, "
                         f"not a verify")
    return "flush" if want is True else want or ""


def _fused_tiles(store: ReplayStore, fused: str, configs) -> int | None:
    """The rows FBV of the flush's sub-tiles in a launch on the read's tiles (fused 'read'): the
    flush launch's tile rows, which must divide the read's; None for any other launch, whose
    flush (if any) works on the launch's own tiles."""
    fbv, bv = configs[0][0], configs[1][0]
    if fused != "read":
        return None
    if "nvfp4" in (store.anchor.fmt, store.read_role.fmt) and store.carried is None:
        raise ValueError("a flush inside the read launch ({'fused': 'read'}) takes pairs without "
                         "an NVFP4 role: an NVFP4 role is cast a whole matrix at a time (one FP32 "
                         "scale per matrix; ReplayStore.from_state(..., nvfp4_scale='carried') "
                         "casts it in any tile); use {'fused': True} or two launches")
    if fbv > bv:
        raise ValueError(f"a flush inside the read launch ({{'fused': 'read'}}) needs flush "
                         f"tiles of at most the read's {bv} rows, got {fbv}")
    return fbv


def advance_pointers(store: ReplayStore, state_indices, T: int = 1, step: bool = True,
                     force_flush: bool | None = None, accepted=None):
    """Move committed / start / n_flush after a step (step=True) or a verify of T drafts
    (step=False) launched with advance=False, or after accept (accepted: int tensor [B] of
    accepted drafts). force_flush None: the path the store's last step took."""
    force_flush = _default_force(store, step, accepted, force_flush)
    B = state_indices.shape[0]
    idx = _indices(state_indices, B, store.committed.device)
    acc = None
    if accepted is not None:
        acc = accepted.to(device=idx.device, dtype=torch.int32).contiguous()
    BLOCK = 256
    _advance_kernel[(triton.cdiv(B, BLOCK),)](
        store.committed, store.start, store.n_flush, idx, acc if acc is not None else idx, B,
        BUFFER_LEN=store.buffer_len, CAPACITY=store.capacity, T=T,
        STEP=step, force=int(force_flush), HAS_ACC=acc is not None, BLOCK=BLOCK)


def _launch(store: ReplayStore, kind, q, k, v, a, b, A, dt_bias, D, z, state_indices, out,
            scale, use_qk_l2norm, step, path="replay", dt_limit=None, advance=True,
            beta_scale=1.0, record=None):
    """A step (step True; path as resolve_path) or a verify of the drafts on axis 1 of the
    inputs (then replay_accept) of a `kind` store: _replay_kernel's flush launch, then its read
    launch, or one launch (_fused); returns out. With advance
    the read launch moves the pointers (the last program of each row). KDA: a is the log decay
    g per key channel, b beta, A None. record: a stores.FaultRecord the step notes its inputs'
    faults and its flush's casts that overflowed in (a step with advance only)."""
    delta = kind != "mamba2"
    N, HV, dv, dk = store.shape
    HK = store.key_heads
    force = _begin(store, kind, step, path)
    lead, hk = step_inputs(kind, store.shape, not step,
                            StepTensors(q, k, v, a, b, A, dt_bias, D, z))
    if hk != HK:
        raise ValueError(f"the inputs have {hk} key heads, the store {HK} (key_heads)")
    B, T = lead[0], 1 if step else lead[1]
    if not step and T > store.max_drafts:
        raise ValueError(f"T={T} drafts, but the store was built with max_drafts="
                         f"{store.max_drafts} (ReplayStore.from_state(..., max_drafts=T))")
    _check_buffered(store, delta, k, v, kernel=True)
    beta_scale = float(beta_scale)
    if not (math.isfinite(beta_scale) and beta_scale > 0):
        raise ValueError(f"beta_scale must be a finite number > 0, got {beta_scale}")
    dt_lo, dt_hi, dt_clamp = dt_limit_args(dt_limit)
    if record is not None:
        record.check(kind, B, q.device, step and advance)
    configs = [replay_launch_config(store, w) for w in LAUNCHES]
    fused = _fused(T, step, B * HV * (dv // configs[0][0]) * configs[0][1], q.device,
                   fused_where(store))
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(*lead, HV, dv, dtype=torch.float32, device=q.device)
    if store.arrive is None or store.arrive.shape[0] != N:
        store.arrive = torch.zeros(N, dtype=torch.int32, device=store.committed.device)
    kf = solves_u(store)
    if kf and (store.Tbuf is None or store.Tbuf.shape != (N, store.capacity, HV, store.buffer_len)):
        raise ValueError(f"a GDN store whose flush solves for u needs its key factors: Tbuf "
                         f"float32 [{N}, {store.capacity}, {HV}, {store.buffer_len}] (ReplayStore.from_state "
                         f"allocates it), got "
                         f"{None if store.Tbuf is None else list(store.Tbuf.shape)}")
    Ap, As, Ag, afid = store.anchor.kernel_args()
    Rp, Rs, Rg, rfid = store.read_role.kernel_args()
    inputs = _kernel_inputs(q, k, v, a, b, A, dt_bias, D, z)
    pck = _table(store, "read")[3]
    fbv = _fused_tiles(store, fused, configs)
    runs = [(fused, False, configs[LAUNCHES.index(fused)])] if fused else \
        list(zip(LAUNCHES, (True, False), configs))
    for which, flushes, (BV, nw) in runs:       # fused: one launch on `fused`'s tiles
        regs = _max_regs(store, which, T)
        tpp, grid = 1, (B * HV, dv // BV)
        if flushes:
            tpp, grid = _flush_grid(B * HV * (dv // BV), q.device)
        _replay_kernel[grid](
            Ap, As, Ag, Rp, Rs, Rg, store.kbuf, store.vbuf,
            store.ubuf if store.ubuf is not None else store.vbuf, store.Gbuf, store.bbuf,
            store.Tbuf if kf else store.bbuf, store.committed, store.start, store.n_flush,
            store.arrive, idx, out, *inputs,
            *((record.flag, record.bad, record.steps) if record is not None else (idx,) * 3),
            store.carried if store.carried is not None else idx,
            float(scale if scale is not None else 1.0 / math.sqrt(dk)), beta_scale,
            *split_key(store.key), dt_lo, dt_hi, B,
            HK=HK, HV=HV, DK=dk, DV=dv, BV=BV, BUFFER_LEN=store.buffer_len, CAPACITY=store.capacity,
            BUFFER_TILE=max(16, triton.next_power_of_2(store.buffer_len)), T=T, STEP=step, FORCE=bool(force),
            ADVANCE=bool(advance) and not flushes, AFMT=afid, FUSED=bool(fused), FBV=fbv or BV,
            ASR=store.anchor.rounding == "stochastic", RFMT=rfid,
            RSR=store.read_role.rounding == "stochastic", SHARED=store.shared, DELTA=delta,
            L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None, HAS_D=D is not None,
            HAS_Z=z is not None,
            U_BF16=store.ubuf is not None and store.ubuf.dtype == torch.bfloat16,
            DT_CLAMP=dt_clamp, PREC="tf32x3", ON_GPU=q.is_cuda, VEC=kind == "kda", FLUSHES=flushes,
            TPP=tpp, FOLD_U=folds_u(store), KF=kf,
            PCK=pck, RECORD=record is not None, CARRY=store.carried is not None, num_warps=nw,
            **({} if regs is None else {"maxnreg": regs}))
    if step:
        store.last_force = force
    else:
        store.pending_T = T
    return out


def replay_gdn_step(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                    scale=None, out=None, use_qk_l2norm=True, path="auto", advance=True,
                    beta_scale=1.0, record=None):
    """One GDN replay decode step for a batch (Triton, _launch): q, k [B, HK, d_k], v [B, H, d_v]
    (k, v bf16), a, b [B, H], A_log, dt_bias [H]; beta = beta_scale sigmoid(b). path
    (resolve_path): 'auto' / 'replay' or 'flush'. Returns y float32 [B, H, d_v]; with
    advance=False the caller moves the pointers (advance_pointers). The launches' tiles come
    from the launch table (launch.replay_launch_config; launch.override_replay_launch tries
    others), one launch a step or two from _fused's choice by batch. record: a
    stores.FaultRecord in which the step notes which inputs of which rows held NaN or infinity
    and which rows' flush kept its roles because a cast overflowed (no host read; its torch
    twins are FaultRecord.note and note_cast)."""
    return _launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices, out,
                   scale, use_qk_l2norm, True, path, advance=advance,
                   beta_scale=beta_scale, record=record)


def replay_mamba2_step(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                       dt_bias=None, out=None, path="auto", advance=True,
                       dt_limit=NO_DT_LIMIT, record=None):
    """One Mamba-2 replay decode step (Triton, as replay_gdn_step), inputs as
    conventional_mamba2_step (x, B bf16; dt_limit = (lo, hi) clamps softplus(dt + dt_bias),
    (0, inf): no clamp); path, advance, record as replay_gdn_step."""
    return _launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                   None, False, True, path, dt_limit=dt_limit, advance=advance,
                   record=record)


def replay_kda_step(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                    out=None, use_qk_l2norm=True, path="auto", advance=True,
                    record=None):
    """One Kimi Delta Attention replay decode step (Triton, as replay_gdn_step), inputs as
    conventional_kda_step: q, k [B, HK, d_k] (k bf16), v [B, H, d_v] (bf16), g [B, H, d_k] the
    log decay per key channel, beta [B, H] (after its sigmoid); path, advance, record as
    replay_gdn_step. Returns y float32 [B, H, d_v]."""
    return _launch(store, "kda", q, k, v, g, beta, None, None, None, None, state_indices, out,
                   scale, use_qk_l2norm, True, path, advance=advance, record=record)
