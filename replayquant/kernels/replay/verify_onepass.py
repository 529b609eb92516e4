"""The speculative verify of GDN and Mamba-2 drafts in one pass over the read copy (Triton):
the same outputs and the same store as decode's verify (`verify.replay_gdn_verify` /
`replay_mamba2_verify` with design='onepass' select it; the torch references are
`reference.replay_gdn_verify_ref` / `replay_mamba2_verify_ref`).

A program takes a [BV, d_k] tile of one (batch row, value head), as the read launch does:

* every input of the T drafts is read before any store (the compiler cannot move a load
  above a store that may alias it);
* each chunk of CK columns of the read copy is read once and multiplied with all the drafts'
  vectors at once, as the N columns of one tensor-core product (padded to 16): GDN's raw
  bf16 k and q of every draft, Mamba-2's C. The copy enters in bf16 parts whose products are
  exact: an FP32 copy in three parts (hi + mid + lo), FP16 in two, BF16 as it is, FP8 / NVFP4
  codes decoded to bf16 (an NVFP4 code times its E4M3 block scale is exact in bf16); the FP8
  row scale / NVFP4 matrix scale and the key norms multiply the float32 sums. A q that is not
  bf16 enters as three bf16 parts, columns of their own (at T = 4 the 16 columns hold them);
* the same loop forms the ring's dot products: the committed keys and the drafts' keys as the
  rows of two more products with the same columns, and the squared norms of both;
* the committed entries' terms of every column then come from one product (their u / dt x
  against the weights e^{G_p - G_j} (k_j . x)), the drafts' own terms from a [BV, NCOL] x
  [NCOL, NCOL] product with the drafts' u, which GDN solves by forward substitution over the
  drafts (T sweeps, each leaving one more draft's u final; float32 products as sums of
  exact bf16 products, _dot32); the outputs are columns of the result;
* every store (outputs, ring entries, GDN key-factor rows) after that, then the pointer move
  by the row's last program (decode._advance_row).

A row whose committed entries would not leave T free slots (h + T > L) is folded into its
roles first by decode's flush launch, as in decode's verify: one launch for the
pre-flushes, then this kernel's, where a role is NVFP4 (cast a whole matrix at a time) or
override_replay_launch({'fused': False}) asks. Otherwise (launch.ONEPASS_TABLE, measured faster
on an H100 for GDN and Mamba-2, s32_rs and tp8_hi32) each program of such a row pre-flushes its
own tile first, on sub-tiles of the flush launch's rows (whole rows: an FP8 read copy's per-row
scale needs no other program), and the round is one launch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional.kernel import (_L2_EPS, _kernel_inputs, _program_tile,
                                                     _softplus)
from replayquant.kernels.quant.kernel import decode_bf16, decode_fp16, small_float_at
from replayquant.kernels.replay.decode import (_advance_row, _entry, _flush_flags, _flush_grid,
                                               _flush_tile, _fused_tiles, _mm, _read_setup,
                                               _replay_kernel)
from replayquant.kernels.replay.launch import (_max_regs, given_launch, onepass_launch_config,
                                              onepass_preflush, replay_launch_config)
from replayquant.kernels.quant.roles import split_key
from replayquant.replay.stores import (ReplayStore, StepTensors, _begin, _check_buffered, _indices,
                                        dt_limit_args, folds_u, solves_u, step_inputs)

__all__ = ["onepass_verify"]


# ============================================================================ Triton

@triton.jit
def _columns(NCOL: tl.constexpr, T: tl.constexpr, NKC: tl.constexpr, NQ: tl.constexpr):
    """The drafts' columns of the product's N operand: (is_k, is_q, draft, part) [NCOL]:
    columns 0..NKC-1 draft t's k (GDN), then NQ columns a draft's q (its bf16 parts)."""
    n = tl.arange(0, NCOL)
    qi = n - NKC
    is_k = n < NKC
    is_q = (qi >= 0) & (qi < T * NQ)
    draft = tl.where(is_k, n, tl.where(is_q, qi // NQ, 0))
    return is_k, is_q, draft, tl.where(is_q, qi % NQ, 0)


@triton.jit
def _copy_chunk(pay, sc, mat, rows, c, CK: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr,
                FMT: tl.constexpr):
    """Chunk c [BV, CK] of the read copy: FP32 / FP16 / BF16 values in float32; FP8 codes in
    bf16 (the row scale multiplies the sums); NVFP4 codes times their block scales in float32
    (times 2^-22: small_float_at; the matrix scale multiplies the sums), exact in bf16."""
    if FMT == 4:
        CK2: tl.constexpr = CK // 2
        NB: tl.constexpr = CK // 16
        hc = c * CK2 + tl.arange(0, CK2)
        p = tl.load(pay + mat * (DV * (DK // 2)) + rows[:, None] * (DK // 2)
                    + hc[None, :]).to(tl.int32)
        nb = c * NB + tl.arange(0, NB)
        bs = small_float_at(tl.load(sc + mat * (DV * (DK // 16)) + rows[:, None] * (DK // 16)
                                    + nb[None, :]).to(tl.int32), 0, 4, 3)
        v = tl.reshape(tl.join(small_float_at(p, 0, 2, 1), small_float_at(p, 4, 2, 1)),
                       (rows.shape[0], NB, 16))
        x = tl.reshape(v * bs[:, :, None], (rows.shape[0], CK))
    else:
        cc = c * CK + tl.arange(0, CK)
        x = tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cc[None, :])
        if FMT == 1:
            x = decode_fp16(x)
        elif FMT == 2:
            x = decode_bf16(x)
        elif FMT == 3:                  # E4M3 codes to bf16 (exact), two a conversion
            x = x.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return x


@triton.jit
def _copy_factor(sc, gs, mat, rows, DV: tl.constexpr, FMT: tl.constexpr):
    """What multiplies a row's sums of _copy_chunk's values: the FP8 row scale, the NVFP4
    matrix scale times 2^22, else 1."""
    if FMT == 3:
        return tl.load(sc + mat * DV + rows)
    if FMT == 4:
        return tl.load(gs + mat) * 2.0 ** 22 + tl.zeros([rows.shape[0]], tl.float32)
    return tl.zeros([rows.shape[0]], tl.float32) + 1.0


@triton.jit
def _split_dot(x, b, acc, NP: tl.constexpr, ON_GPU: tl.constexpr):
    """acc + x @ b for float32 x split into NP bf16 parts (each product exact: _dot3) and b
    bf16."""
    for i in tl.static_range(NP):
        p = x.to(tl.bfloat16)
        if i < NP - 1:
            x = x - p.to(tl.float32)
        acc = _mm(p, b, acc, ON_GPU)
    return acc


@triton.jit
def _split3(x):
    """float32 x as three bf16 parts (hi + mid + lo = x to ~2^-24)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    return hi, mid, (r - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot32(a, b0, b1, b2, acc, A_BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """acc + a @ b for float32 a and b given as _split3's parts, in bf16 products (exact) with
    float32 sums: a in one part where its values are bf16 (A_BF16), else in three, the six
    products of weight above 2^-24. Cheaper than tf32x3, whose float32 -> tf32 conversions
    (both operands, every product) took most of the solve's instructions."""
    if A_BF16:
        a0 = a.to(tl.bfloat16)
        return _mm(a0, b2, _mm(a0, b1, _mm(a0, b0, acc, ON_GPU), ON_GPU), ON_GPU)
    a0, a1, a2 = _split3(a)
    acc = _mm(a2, b0, _mm(a1, b1, _mm(a0, b2, acc, ON_GPU), ON_GPU), ON_GPU)
    return _mm(a0, b0, _mm(a1, b0, _mm(a0, b1, acc, ON_GPU), ON_GPU), ON_GPU)


@triton.jit
def _part(x, part, NQ: tl.constexpr):
    """Part `part` [N] (0 hi, 1 mid, 2 lo) of the float32 columns of x [CK, N] in bf16
    (NQ 1: x, exact already)."""
    if NQ > 1:
        hi = x.to(tl.bfloat16).to(tl.float32)
        r = x - hi
        mid = r.to(tl.bfloat16).to(tl.float32)
        x = tl.where(part[None, :] == 0, hi, tl.where(part[None, :] == 1, mid, r - mid))
    return x.to(tl.bfloat16)


@triton.jit
def _pass(R_pay, R_sc, kbuf, k_ptr, q_ptr, mat, row, hk, rows, slot, start, h, jj,
          HK: tl.constexpr, DV: tl.constexpr, DK: tl.constexpr, CAPACITY: tl.constexpr,
          T: tl.constexpr, NCOL: tl.constexpr, NKC: tl.constexpr, NQ: tl.constexpr,
          CK: tl.constexpr, STAGES: tl.constexpr, RFMT: tl.constexpr, ON_GPU: tl.constexpr):
    """One pass over the read copy tile, raw values (no norm, scale or copy factor): accR
    [BV, NCOL] = R X, accK [BUFFER_TILE, NCOL] = K X (K: the committed keys, ring entries
    0..h-1), accD [NCOL, NCOL] = Kd X (Kd: row s the key of draft s < T), and the squared
    norms ssK, ssD of their rows and ssX of X's columns; X [d_k, NCOL] the drafts' columns
    (_columns)."""
    NP: tl.constexpr = 3 if RFMT == 0 else 2 if RFMT == 1 else 1
    is_k, is_q, draft, part = _columns(NCOL, T, NKC, NQ)
    tok_n = row * T + draft
    e = _entry(slot, start, jj, CAPACITY)
    ring = jj < h
    ss = tl.arange(0, NCOL)
    accR = tl.zeros([rows.shape[0], NCOL], tl.float32)
    accK = tl.zeros([jj.shape[0], NCOL], tl.float32)
    accD = tl.zeros([NCOL, NCOL], tl.float32)
    ssK = tl.zeros([jj.shape[0]], tl.float32)
    ssD = tl.zeros([NCOL], tl.float32)
    ssX = tl.zeros([NCOL], tl.float32)
    for c in tl.range(0, DK // CK, num_stages=STAGES):
        cc = c * CK + tl.arange(0, CK)
        xo = (tok_n[None, :] * HK + hk) * DK + cc[:, None]
        x = tl.load(q_ptr + xo, mask=is_q[None, :], other=0.0).to(tl.float32)
        if NKC > 0:
            x += tl.load(k_ptr + xo, mask=is_k[None, :], other=0.0).to(tl.float32)
        ssX += tl.sum(x * x, axis=0)
        X = _part(x, part, NQ)
        Kc = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cc[None, :], mask=ring[:, None],
                     other=0.0)
        Kd = tl.load(k_ptr + ((row * T + ss[:, None]) * HK + hk) * DK + cc[None, :],
                     mask=(ss < T)[:, None], other=0.0)
        Kf = Kc.to(tl.float32)
        ssK += tl.sum(Kf * Kf, axis=1)
        Kf = Kd.to(tl.float32)
        ssD += tl.sum(Kf * Kf, axis=1)
        accK = _mm(Kc, X, accK, ON_GPU)
        accD = _mm(Kd, X, accD, ON_GPU)
        accR = _split_dot(_copy_chunk(R_pay, R_sc, mat, rows, c, CK, DV, DK, RFMT), X, accR,
                          NP, ON_GPU)
    return accR, accK, accD, ssK, ssD, ssX


@triton.jit
def _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, Gbuf, slot, start, h, row, hv, beta_scale, dt_lo,
           dt_hi, HV: tl.constexpr, CAPACITY: tl.constexpr, T: tl.constexpr,
           NCOL: tl.constexpr, NKC: tl.constexpr, NQ: tl.constexpr, DELTA: tl.constexpr,
           HAS_DTB: tl.constexpr, DT_CLAMP: tl.constexpr):
    """The drafts' gates as conventional._front_end computes them, draft by draft (scalar
    loads), the cumulative log gate G_p = G_{h-1} + sum of the drafts' log_a up to p added in
    order: (Gd, bd [NCOL]: G_p and beta (GDN times beta_scale; Mamba-2 dt) of draft d at index
    d < T; Gn [NCOL]: G_p of the draft of column n, _columns)."""
    _, _, draft, _ = _columns(NCOL, T, NKC, NQ)
    d = tl.arange(0, NCOL)
    Gp = tl.load(Gbuf + _entry(slot, start, h - 1, CAPACITY) * HV + hv, mask=h > 0, other=0.0)
    A = tl.load(A_ptr + hv).to(tl.float32)
    Gd = tl.zeros([NCOL], tl.float32)
    bd = tl.zeros([NCOL], tl.float32)
    Gn = tl.zeros([NCOL], tl.float32)
    for t in tl.static_range(T):
        tok = row * T + t
        a = tl.load(a_ptr + tok * HV + hv).to(tl.float32)
        if HAS_DTB:
            a = a + tl.load(dtb_ptr + hv).to(tl.float32)
        if DELTA:
            la = -tl.exp(A) * _softplus(a)
            be = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + tok * HV + hv).to(tl.float32)))
            be = be * beta_scale
        else:
            be = _softplus(a)
            if DT_CLAMP:
                be = tl.minimum(tl.maximum(be, dt_lo), dt_hi)
            la = be * A
        Gp = Gp + la
        Gd = tl.where(d == t, Gp, Gd)
        bd = tl.where(d == t, be, bd)
        Gn = tl.where(draft == t, Gp, Gn)
    return Gd, bd, Gn


@triton.jit
def _ring_in(ubuf, vbuf, Gbuf, bbuf, Tbuf, slot, start, h, hv, rows, jj, lead,
             HV: tl.constexpr, DV: tl.constexpr, CAPACITY: tl.constexpr,
             BUFFER_LEN: tl.constexpr, DELTA: tl.constexpr, KF: tl.constexpr):
    """The committed entries 0..h-1 (rows >= h zero): X [BUFFER_TILE, BV] (GDN u, Mamba-2
    dt x), G [BUFFER_TILE] cumulative log gates, Tm [BUFFER_TILE, BUFFER_TILE] their key-factor
    rows (KF, the lead program only; else 0)."""
    m = jj < h
    e = _entry(slot, start, jj, CAPACITY)
    xo = (e[:, None] * HV + hv) * DV + rows[None, :]
    G = tl.load(Gbuf + e * HV + hv, mask=m, other=0.0)
    if DELTA:
        X = tl.load(ubuf + xo, mask=m[:, None], other=0.0).to(tl.float32)
    else:
        X = tl.load(vbuf + xo, mask=m[:, None], other=0.0).to(tl.float32) \
            * tl.load(bbuf + e * HV + hv, mask=m, other=0.0)[:, None]
    Tm = 0.0
    if KF:
        hl = tl.where(lead, h, 0)
        Tm = tl.load(Tbuf + (e[:, None] * HV + hv) * BUFFER_LEN + jj[None, :],
                     mask=(jj < hl)[:, None] & (jj < hl)[None, :], other=0.0)
    return X, G, Tm


@triton.jit
def _coefficients(accK, accD, G, Gd, Gn, h, jj, T: tl.constexpr, NCOL: tl.constexpr,
                  NKC: tl.constexpr, NQ: tl.constexpr):
    """The entries' weights in each column's sum, e^{G_p - G_j} times the (normalised) dot of
    entry j's key with the column's vector: W [BUFFER_TILE, NCOL] for the committed entries
    j < h; Dm [NCOL, NCOL] for draft s's u (row s) in the columns of the drafts after it (k
    columns) and of itself and after (q columns: the term (k . q) u of the draft itself)."""
    is_k, is_q, draft, _ = _columns(NCOL, T, NKC, NQ)
    s = tl.arange(0, NCOL)
    low = (jj < h)[:, None]
    W = tl.where(low, tl.exp(tl.where(low, Gn[None, :] - G[:, None], 0.0)), 0.0) * accK
    sees = (s[:, None] < draft[None, :]) | ((s[:, None] == draft[None, :]) & is_q[None, :])
    sees = sees & (s < T)[:, None] & (is_k | is_q)[None, :]
    Dm = tl.where(sees, tl.exp(tl.where(sees, Gn[None, :] - Gd[:, None], 0.0)), 0.0) * accD
    return W, Dm


@triton.jit
def _solve(P, C, V, Dm, bd, T: tl.constexpr, NCOL: tl.constexpr, DELTA: tl.constexpr,
           U_BF16: tl.constexpr, ON_GPU: tl.constexpr):
    """The drafts' u [BV, NCOL] (column d: draft d < T) and the columns' sums P + C + U Dm
    (P = e^{G_p} R x, C the committed entries' terms). GDN: u_t = beta_t (v_t - (P + C +
    U Dm) in k column t), each u_t rounded to bf16 with U_BF16, U Dm strictly lower triangular
    over the drafts: T sweeps over all columns give each column its sequential value (sweep
    t + 1 leaves u_t final, the same operations in the same order). Mamba-2: u = dt x."""
    d = tl.arange(0, NCOL)
    D0, D1, D2 = _split3(Dm)
    U = V
    if DELTA:
        U = tl.zeros_like(V)
        for _ in tl.static_range(T):
            u = bd[None, :] * (V - _dot32(U, D0, D1, D2, P + C, U_BF16, ON_GPU))
            if U_BF16:
                u = u.to(tl.bfloat16).to(tl.float32)
            U = tl.where((d < T)[None, :], u, 0.0)
    return U, _dot32(U, D0, D1, D2, P + C, U_BF16 and DELTA, ON_GPU)


@triton.jit
def _key_factor_rows(W, Dm, Tm, bd, h, jj, T: tl.constexpr, NCOL: tl.constexpr,
                     ON_GPU: tl.constexpr):
    """GDN's key-factor rows of the drafts [NCOL, BUFFER_TILE] (row t: draft t at entry
    p = h + t): T_p = e_p - sum_{j < p} beta_t e^{G_p - G_j} (k_j . k_t) T_j over the committed
    rows Tm and the drafts' own rows, by T sweeps as _solve's."""
    d = tl.arange(0, NCOL)
    kc = (d < T)[None, :]
    E = tl.where(((jj[None, :] == h + d[:, None]) & (d < T)[:, None]), 1.0, 0.0)
    M0, M1, M2 = _split3(Tm)
    base = E - _dot32(tl.trans(tl.where(kc, bd[None, :] * W, 0.0)), M0, M1, M2,
                      tl.zeros_like(E), False, ON_GPU)
    Ca = tl.trans(tl.where(kc, bd[None, :] * Dm, 0.0))
    Tr = tl.zeros_like(base)
    for _ in tl.static_range(T):
        M0, M1, M2 = _split3(Tr)
        Tr = tl.where((d < T)[:, None], base - _dot32(Ca, M0, M1, M2, tl.zeros_like(E), False,
                                                       ON_GPU), 0.0)
    return Tr


@triton.jit
def _drafts_v(v_ptr, D_ptr, z_ptr, bd, row, hv, rows, HV: tl.constexpr, DV: tl.constexpr,
              T: tl.constexpr, NCOL: tl.constexpr, NKC: tl.constexpr, NQ: tl.constexpr,
              DELTA: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """The drafts' v / x [BV, NCOL] (column d: draft d < T): (Vraw as the ring keeps it, V: GDN
    v, Mamba-2 dt x), and for the q columns Mamba-2's skip D x and the gate z (zeros without)."""
    _, is_q, draft, part = _columns(NCOL, T, NKC, NQ)
    d = tl.arange(0, NCOL)
    Vraw = tl.load(v_ptr + ((row * T + d[None, :]) * HV + hv) * DV + rows[:, None],
                   mask=(d < T)[None, :], other=0.0)
    V = Vraw.to(tl.float32)
    skip = V * 0.0
    Z = skip
    yo = ((row * T + draft[None, :]) * HV + hv) * DV + rows[:, None]
    ym = (is_q & (part == 0))[None, :]
    if not DELTA:
        V = bd[None, :] * V
        if HAS_D:
            skip = tl.load(D_ptr + hv).to(tl.float32) \
                * tl.load(v_ptr + yo, mask=ym, other=0.0).to(tl.float32)
    if HAS_Z:
        Z = tl.load(z_ptr + yo, mask=ym, other=0.0).to(tl.float32)
    return Vraw, V, skip, Z


@triton.jit
def _store_drafts(out_ptr, kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, Y, U, Gd, bd, Vraw, Kraw, W,
                  Dm, Tm, slot, start, h, row, hv, hk, rows, cols, jj, lead, HK: tl.constexpr,
                  HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  CAPACITY: tl.constexpr, BUFFER_LEN: tl.constexpr, T: tl.constexpr,
                  NCOL: tl.constexpr, NKC: tl.constexpr, NQ: tl.constexpr,
                  DELTA: tl.constexpr, KF: tl.constexpr, ON_GPU: tl.constexpr):
    """The drafts' outputs (the q columns of Y, a draft's parts summed) and ring entries
    h..h+T-1 (decode._append_entry's fields: v / x and u of the tile's rows; lead: G,
    beta / dt, the key-factor rows, and raw k from the key head's first value head)."""
    _, is_q, draft, part = _columns(NCOL, T, NKC, NQ)
    d = tl.arange(0, NCOL)
    live = d < T
    e = _entry(slot, start, h + d, CAPACITY)
    if NQ > 1:                    # a draft's q parts: their sums into its first part's column
        Y = tl.dot(Y, tl.where((draft[:, None] == draft[None, :]) & is_q[:, None], 1.0, 0.0),
                   input_precision="ieee")
    tl.store(out_ptr + ((row * T + draft[None, :]) * HV + hv) * DV + rows[:, None], Y,
             mask=(is_q & (part == 0))[None, :])
    xo = (e[None, :] * HV + hv) * DV + rows[:, None]
    tl.store(vbuf + xo, Vraw.to(tl.bfloat16), mask=live[None, :])
    if DELTA:
        tl.store(ubuf + xo, U.to(ubuf.dtype.element_ty), mask=live[None, :])
    if lead:
        tl.store(Gbuf + e * HV + hv, Gd, mask=live)
        tl.store(bbuf + e * HV + hv, bd, mask=live)
        if KF:                    # the key factors: the row's first block alone
            Tr = _key_factor_rows(W, Dm, Tm, bd, h, jj, T, NCOL, ON_GPU)
            tl.store(Tbuf + (e[:, None] * HV + hv) * BUFFER_LEN + jj[None, :], Tr,
                     mask=live[:, None] & (jj < BUFFER_LEN)[None, :])
        tt = tl.arange(0, Kraw.shape[0])
        if hv % (HV // HK) == 0:
            tl.store(kbuf + (_entry(slot, start, h + tt, CAPACITY)[:, None] * HK + hk) * DK
                     + cols[None, :], Kraw, mask=(tt < T)[:, None])


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi", "n_rows"])
def _onepass_kernel(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, h_ptr, st_ptr,
        nf_ptr, cnt_ptr, idx_ptr, out_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr,
        D_ptr, z_ptr, rec, scale, beta_scale, key_lo, key_hi, dt_lo, dt_hi, n_rows,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr,
        BUFFER_TILE: tl.constexpr, T: tl.constexpr, TP: tl.constexpr, NCOL: tl.constexpr,
        NQ: tl.constexpr, CK: tl.constexpr, STAGES: tl.constexpr, AFMT: tl.constexpr,
        ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr, SHARED: tl.constexpr,
        DELTA: tl.constexpr, L2NORM: tl.constexpr, HAS_DTB: tl.constexpr, HAS_D: tl.constexpr,
        HAS_Z: tl.constexpr, U_BF16: tl.constexpr, DT_CLAMP: tl.constexpr, KF: tl.constexpr,
        FOLD_U: tl.constexpr, FUSED: tl.constexpr, FBV: tl.constexpr, ON_GPU: tl.constexpr,
        CARRY: tl.constexpr):
    """A verify of T drafts, a program per [BV, d_k] tile of one (batch row, value head) (module
    docstring): the row's pointers after its pre-flush (folded by the flush launch before; with
    FUSED by this program first, decode._flush_tile on its BV / FBV sub-tiles of FBV rows), the
    drafts' inputs, the committed entries, the one pass, the drafts' solve, the stores and the
    row's pointer move."""
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
    tt = tl.arange(0, TP)
    if slot >= 0:
        NKC: tl.constexpr = T if DELTA else 0
        mat = slot * HV + hv
        jj = tl.arange(0, BUFFER_TILE)
        lead = tl.program_id(1) == 0
        pre, fill = _flush_flags(tl.load(h_ptr + slot), T, BUFFER_LEN, False)
        if FUSED:                   # this tile's own pre-flush first: whole rows, a loop
            if pre:
                for sb in range(BV // FBV):
                    _flush_tile(
                        (hv * (DV // FBV) + tl.program_id(1) * (BV // FBV) + sb) * n_rows + row,
                        n_rows, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, ubuf, Gbuf,
                        bbuf, Tbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr,
                        v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, beta_scale,
                        key_lo, key_hi, dt_lo, dt_hi, HK, HV, DK, DV, FBV, BUFFER_LEN,
                        CAPACITY, BUFFER_TILE, T, False, False, AFMT, ASR, RFMT, RSR, SHARED,
                        DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP, "tf32x3", ON_GPU, False,
                        FOLD_U, idx_ptr, False, rec, CARRY)
                tl.debug_barrier()  # the tile's roles are written
        _, start, h, _ = _read_setup(R_gs, mat, tl.load(st_ptr + slot), tl.load(h_ptr + slot),
                                     pre, fill, False, CAPACITY, RFMT, False)
        Gd, bd, Gn = _gates(a_ptr, b_ptr, A_ptr, dtb_ptr, Gbuf, slot, start, h, row, hv,
                            beta_scale, dt_lo, dt_hi, HV, CAPACITY, T, NCOL, NKC, NQ, DELTA,
                            HAS_DTB, DT_CLAMP)
        accR, accK, accD, ssK, ssD, ssX = _pass(
            R_pay, R_sc, kbuf, k_ptr, q_ptr, mat, row, hk, rows, slot, start, h, jj, HK, DV, DK,
            CAPACITY, T, NCOL, NKC, NQ, CK, STAGES, RFMT, ON_GPU)
        # the rest of the inputs after the pass (still before any store): not live during it
        Vraw, V, skip, Z = _drafts_v(v_ptr, D_ptr, z_ptr, bd, row, hv, rows, HV, DV, T, NCOL,
                                     NKC, NQ, DELTA, HAS_D, HAS_Z)
        kl = tt < tl.where(lead & (hv % (HV // HK) == 0), T, 0)     # k, where it is stored
        Kraw = tl.load(k_ptr + (((row * T + tt)[:, None]) * HK + hk) * DK + cols[None, :],
                       mask=kl[:, None] & (cols < DK)[None, :], other=0.0)
        X, G, Tm = _ring_in(ubuf, vbuf, Gbuf, bbuf, Tbuf, slot, start, h, hv, rows, jj, lead,
                            HV, DV, CAPACITY, BUFFER_LEN, DELTA, KF)
        is_k, is_q, _, _ = _columns(NCOL, T, NKC, NQ)
        fac = tl.zeros_like(ssX) + 1.0
        if DELTA:                               # GDN's q scale and L2 norms of k and q
            fac = tl.where(is_q, scale, 1.0)
            if L2NORM:
                fac = fac / tl.sqrt(ssX + _L2_EPS)
                accK = accK / tl.sqrt(ssK + _L2_EPS)[:, None]
                accD = accD / tl.sqrt(ssD + _L2_EPS)[:, None]
        W, Dm = _coefficients(accK * fac[None, :], accD * fac[None, :], G, Gd, Gn, h, jj, T,
                              NCOL, NKC, NQ)
        P = tl.exp(Gn)[None, :] * accR * fac[None, :] \
            * _copy_factor(R_sc, R_gs, mat, rows, DV, RFMT)[:, None]
        W0, W1, W2 = _split3(W)
        C = _dot32(tl.trans(X), W0, W1, W2, tl.zeros_like(P), U_BF16 and DELTA, ON_GPU)
        U, Y = _solve(P, C, V, Dm, bd, T, NCOL, DELTA, U_BF16, ON_GPU)
        Y = Y + skip
        if HAS_Z:
            Y = Y * Z / (1.0 + tl.exp(-Z))
        _store_drafts(out_ptr, kbuf, vbuf, ubuf, Gbuf, bbuf, Tbuf, Y, U, Gd, bd, Vraw, Kraw, W,
                      Dm, Tm, slot, start, h, row, hv, hk, rows, cols, jj, lead, HK, HV, DK,
                      DV, CAPACITY, BUFFER_LEN, T, NCOL, NKC, NQ, DELTA, KF, ON_GPU)
        _advance_row(h_ptr, st_ptr, nf_ptr, cnt_ptr, idx_ptr, idx_ptr, idx_ptr, slot, row,
                     HV * (DV // BV), False, BUFFER_LEN, CAPACITY, T, False, DELTA, False)
    else:
        tl.store(out_ptr + (((row * T + tt)[:, None]) * HV + hv) * DV + rows[None, :],
                 tl.zeros([TP, BV], tl.float32), mask=(tt < T)[:, None])


# ============================================================================ host side

def _checks(store: ReplayStore, kind, q, k, v, a, b, A, dt_bias, D, z, beta_scale):
    """decode._launch's checks of a verify, in its order -> (B, T)."""
    _begin(store, kind, False, None)
    lead, hk = step_inputs(kind, store.shape, True,
                            StepTensors(q, k, v, a, b, A, dt_bias, D, z))
    if hk != store.key_heads:
        raise ValueError(f"the inputs have {hk} key heads, the store {store.key_heads} "
                         f"(key_heads)")
    B, T = lead
    if T > store.max_drafts:
        raise ValueError(f"T={T} drafts, but the store was built with max_drafts="
                         f"{store.max_drafts} (ReplayStore.from_state(..., max_drafts=T))")
    _check_buffered(store, kind != "mamba2", k, v, kernel=True)
    if not (math.isfinite(beta_scale) and beta_scale > 0):
        raise ValueError(f"beta_scale must be a finite number > 0, got {beta_scale}")
    N, HV = store.shape[:2]
    if solves_u(store) and (store.Tbuf is None or store.Tbuf.shape
                            != (N, store.capacity, HV, store.buffer_len)):
        raise ValueError(f"a GDN store whose flush solves for u needs its key factors: Tbuf "
                         f"float32 [{N}, {store.capacity}, {HV}, {store.buffer_len}] "
                         f"(ReplayStore.from_state allocates it)")
    return B, T


def _pre_flush(store, kind, idx, out, inputs, has, scale, beta_scale, dt_args, use_qk_l2norm,
               T):
    """decode's flush launch of a verify: the rows that pre-flush fold their committed
    entries into both roles (nothing else is written)."""
    N, HV, dv, dk = store.shape
    B = idx.shape[0]
    BV, nw = replay_launch_config(store, "flush")
    regs = _max_regs(store, "flush", T)
    tpp, grid = _flush_grid(B * HV * (dv // BV), idx.device)
    Ap, As, Ag, afid = store.anchor.kernel_args()
    Rp, Rs, Rg, rfid = store.read_role.kernel_args()
    kf = solves_u(store)
    _replay_kernel[grid](
        Ap, As, Ag, Rp, Rs, Rg, store.kbuf, store.vbuf,
        store.ubuf if store.ubuf is not None else store.vbuf, store.Gbuf, store.bbuf,
        store.Tbuf if kf else store.bbuf, store.committed, store.start, store.n_flush,
        store.arrive, idx, out, *inputs, idx, idx, idx,
        store.carried if store.carried is not None else idx, scale, beta_scale,
        *split_key(store.key), dt_args[0], dt_args[1], B,
        HK=store.key_heads, HV=HV, DK=dk, DV=dv, BV=BV, BUFFER_LEN=store.buffer_len,
        CAPACITY=store.capacity, BUFFER_TILE=max(16, triton.next_power_of_2(store.buffer_len)),
        T=T, STEP=False, FORCE=False, ADVANCE=False, AFMT=afid, FUSED=False, FBV=BV,
        ASR=store.anchor.rounding == "stochastic", RFMT=rfid,
        RSR=store.read_role.rounding == "stochastic", SHARED=store.shared,
        DELTA=kind != "mamba2", L2NORM=use_qk_l2norm, HAS_DTB=has[0], HAS_D=has[1],
        HAS_Z=has[2], U_BF16=False,
        DT_CLAMP=dt_args[2], PREC="tf32x3", ON_GPU=idx.is_cuda, VEC=False, FLUSHES=True,
        TPP=tpp, FOLD_U=folds_u(store), KF=kf, PCK=0, RECORD=False,
        CARRY=store.carried is not None, num_warps=nw,
        **({} if regs is None else {"maxnreg": regs}))


def _inside(store: ReplayStore, BV: int, nw: int) -> tuple:
    """(FBV, regs): the rows of the sub-tiles on which a program runs its row's pre-flush itself
    (the flush launch's tile rows, whole rows of the roles, so no other program's rows are
    needed), or None: the pre-flushes in decode's flush launch first; and the launch's register
    cap. override_replay_launch's 'fused' decides ('read': inside, False: the flush launch,
    both uncapped unless 'read' gives regs), else ONEPASS_TABLE (onepass_preflush)."""
    want = given_launch().get("fused")
    if want is None:
        inside, regs = onepass_preflush(store)
    elif want is False or want == "read":
        inside, regs = want == "read", None
    else:
        raise ValueError(f"the one-pass verify takes launch['fused'] 'read' (its pre-flushes "
                         f"inside its read program) or False (in a flush launch first), got "
                         f"{want!r}; True, one launch on the flush's tiles, is a decode step's")
    if not inside:
        return None, regs
    return _fused_tiles(store, "read", [replay_launch_config(store, "flush"), (BV, nw)]), regs


def onepass_verify(store: ReplayStore, kind, q, k, v, a, b, A, dt_bias, D, z, state_indices,
                   out, scale, use_qk_l2norm, dt_limit=None, beta_scale=1.0):
    """Outputs [B, T, H, d_v] of the T drafts on axis 1 of the inputs of a `kind` ('gdn' or
    'mamba2') store, as decode._launch's verify (arguments in its order; Mamba-2: q = C,
    k = B, v = x, a = dt): the flush launch for the rows that pre-flush, then _onepass_kernel,
    which moves the pointers. Then call replay_accept. Launch configs: replay_launch_config,
    onepass_launch_config (launch.override_replay_launch tries others)."""
    if kind not in ("gdn", "mamba2"):
        raise ValueError(f"the one-pass verify takes a 'gdn' or 'mamba2' store, got {kind!r}")
    beta_scale = float(beta_scale)
    B, T = _checks(store, kind, q, k, v, a, b, A, dt_bias, D, z, beta_scale)
    N, HV, dv, dk = store.shape
    dt_args = dt_limit_args(dt_limit)
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(B, T, HV, dv, dtype=torch.float32, device=q.device)
    if store.arrive is None or store.arrive.shape[0] != N:
        store.arrive = torch.zeros(N, dtype=torch.int32, device=store.committed.device)
    inputs = _kernel_inputs(q, k, v, a, b, A, dt_bias, D, z)
    scale = float(scale if scale is not None else 1.0 / math.sqrt(dk))
    has = (dt_bias is not None, D is not None, z is not None)
    BV, nw, CK, stages = onepass_launch_config(store)
    fbv, regs = _inside(store, BV, nw)
    given = _max_regs(store, "read", T)             # None unless given
    regs = regs if given is None else given
    if fbv is None:
        _pre_flush(store, kind, idx, out, inputs, has, scale, beta_scale, dt_args,
                   use_qk_l2norm, T)
    NQ = 1 if q.dtype == torch.bfloat16 else 3
    delta = kind != "mamba2"
    Ap, As, Ag, afid = store.anchor.kernel_args()
    Rp, Rs, Rg, rfid = store.read_role.kernel_args()
    kf = solves_u(store)
    _onepass_kernel[(B * HV, dv // BV)](
        Ap, As, Ag, Rp, Rs, Rg, store.kbuf, store.vbuf,
        store.ubuf if store.ubuf is not None else store.vbuf, store.Gbuf, store.bbuf,
        store.Tbuf if kf else store.bbuf, store.committed, store.start, store.n_flush,
        store.arrive, idx, out, *inputs, store.carried if store.carried is not None else idx,
        scale, beta_scale, *split_key(store.key), dt_args[0],
        dt_args[1], B,
        HK=store.key_heads, HV=HV, DK=dk, DV=dv, BV=BV, BUFFER_LEN=store.buffer_len,
        CAPACITY=store.capacity, BUFFER_TILE=max(16, triton.next_power_of_2(store.buffer_len)),
        T=T, TP=triton.next_power_of_2(T),
        NCOL=max(16, triton.next_power_of_2((T if delta else 0) + T * NQ)), NQ=NQ, CK=CK,
        STAGES=stages, AFMT=afid, ASR=store.anchor.rounding == "stochastic", RFMT=rfid,
        RSR=store.read_role.rounding == "stochastic", SHARED=store.shared, DELTA=delta,
        L2NORM=use_qk_l2norm, HAS_DTB=has[0], HAS_D=has[1], HAS_Z=has[2],
        U_BF16=store.ubuf is not None and store.ubuf.dtype == torch.bfloat16,
        DT_CLAMP=dt_args[2], KF=kf, FOLD_U=folds_u(store), FUSED=fbv is not None,
        FBV=fbv or BV, ON_GPU=q.is_cuda, CARRY=store.carried is not None, num_warps=nw,
        **({} if regs is None else {"maxnreg": regs}))
    store.pending_T = T
    return out
