"""Chunked teacher-forcing scan in Triton (DESIGN section 7): the torch reference is
`replayquant.kernels.chunk.reference.chunk_scan_ref`, with the same signature and effect.

    from replayquant.kernels.chunk.kernel import chunk_scan
    y, new_state = chunk_scan(state, q, k, v, log_a, beta, pair=pair, seed=seed, layer=layer,
                              valid=valid, exact=False)

The windows are the flush schedule: each row's buffered steps (state.committed of them, from the
previous segment) followed by its valid tokens, cut every L entries, so a segment continues
the schedule of the previous one (position modulo L carries over) and padding takes no slot.
Semantics per window (DESIGN section 4): every token but the window's L-th reads the read copy
R of the window's checkpoint (GDN: its u from R too); the L-th token (the flush) reads the
unrounded state S = exp(G_L) A + sum_j exp(G_L - G_j) u_j k_j^T rebuilt from the dequantized
anchor A (GDN: u from A); S is cast independently into the anchor and the read copy
(formats bit-exact with formats/casts, SR bits from Philox keyed by layer_seed(seed, layer) and
sr_stream(flush index, role, sequence id, head), as `ReplayState`). A row's last, partial
window reads R and becomes the new buffer. exact=True: FP32 through the segment (outputs from
the running unrounded state) and one cast at its end.

Four launches per group of windows, only the second one sequential:

1. `_terms_kernel`, one program per (window, sequence x head): what does not depend on the
   state. With Aqk = exp(G_t - G_j) q_t.k_j (j <= t) and for GDN the WY form W = Tinv beta
   exp(G) k, U = Tinv beta v, Tinv = (I + T)^-1 (so that u(X) = U - W X^T for a checkpoint X;
   Mamba-2: U = v), the outputs from X are y = P X^T + C with P = exp(G) q - Aqk W, C = Aqk U.
2. `_chain_kernel`, one program per (sequence x head, row block): the flushes in order, u = U -
   W A^T, S = exp(G_L) A + (u w_L)^T K, the flush token's output S q_L, A = anchor cast of S,
   and S (or the anchor, shared pair) as the next window's checkpoint. An NVFP4 anchor (one
   scale per matrix) needs the matrix amax each window: where they fit on the GPU at once, the
   row blocks of a matrix run on several programs that exchange their amax through atomics
   (split chain); else one program per matrix casts in two passes over row blocks (amax, then
   quantize with the matrix scale) through an FP32 scratch (L2).
3. `_cast_kernel` (dual pairs, exact): each checkpoint S replaced in place by its read copy's
   values (the flush's SR stream; NVFP4 in two passes), codes stored for the last one; exact:
   the final state cast into both roles.
4. `_output_kernel`, one program per (window, sequence x head): y = P X^T + C for every token
   but the flushes, one dot per row block.
Window 0's checkpoint and the first anchor are dequantized on the host (the format's own
dequantize, the specification). After the launches one host read checks that the outputs and
the roles after the segment are finite; where they are not (an fp16 anchor or read copy that
overflowed at a flush, which the chain carries to the segment's end), the torch reference runs
the segment again to name the flush (layer, batch row, token, format) in its error.

Vector gates (KDA, a state built with vector_gate=True, log_a [B, T, H, d_k]): the decay
multiplies the state's key axis, so pass 1 forms the causal products q_t . (k_j * exp(G_t -
G_j)) and k_t . (k_j * exp(G_t - G_j)) a column j at a time (`_decayed_products`: every
exponent is a decay from an earlier step to a later one, <= 0, never exp(-G_j) alone), exp(G)
multiplies q and k per channel in P and W, and the sequential pass receives the decayed keys
k_j * exp(G_L - G_j) and G_L [d_k] instead of K and G: S = A Diag(exp(G_L)) + u^T K_decayed.
Passes 2 and 3 are otherwise the scalar ones.

Memory: the group scratch holds, per (sequence x head, window), the terms and one FP32
checkpoint (d_v * d_k * 4 bytes): ~105 KB at d_k = d_v = 128, L = 16. Windows are processed in
host-side groups of at most launch.MAX_GROUP_WINDOWS windows and launch.SCRATCH_BYTES of scratch
(at least one window per group), so the extra memory of a call is bounded by
max(SCRATCH_BYTES, one window's scratch) whatever the segment length.
Shapes: d_k and d_v powers of two >= 16 (`supports` says whether a call can run here).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from replayquant import options
from replayquant.formats import QTensor
from replayquant.kernels.chunk import reference as chunk_ref
from replayquant.kernels.chunk.launch import chunk_launch_config, device_sms, group_windows
from replayquant.kernels.chunk.reference import _check_inputs, cpu_threads
from replayquant.kernels.quant.kernel import (decode_bf16, decode_e2m1, decode_e4m3, decode_fp16,
                                              encode_bf16, encode_e4m3, encode_fp16)
from replayquant.kernels.quant.roles import (_FP8_DIV, _NV_DIV, _role_bits, _sr_bits,
                                             nv_block_encode, split_key)
from replayquant.replay.handoff import ScanState
from replayquant.replay import core
from replayquant.replay.roles import FMT_IDS
from replayquant.streams import layer_seed

__all__ = ["chunk_scan", "supports", "teacher_force"]

# input precision of the kernel's tl.dot products: "tf32x3" (the default: three TF32
# tensor-core products per dot, about FP32 accuracy) or "ieee" (FP32 FMAs); the interpreter
# computes in FP32 either way. H200 (the bench teacher-forcing check): both give the
# CPU reference's flush schedule, buffers and state (codes up to rounding flips); the largest
# output error, relative to the largest output, 1.0e-3 with tf32x3 against 4.2e-5 with ieee
# (tp8_hi32), alike elsewhere; a Qwen3.5-4B layer at 8K tokens 7.0 ms instead of 10.0.
# The option chunk_dot (REPLAYQUANT_CHUNK_DOT, replayquant.options) chooses it at each launch.


# ============================================================================ Triton

@triton.jit
def unit_lower_inverse(Tm, jj, N: tl.constexpr):
    """(I + Tm)^-1 for a strictly lower triangular Tm [BUFFER_TILE, BUFFER_TILE] whose rows >= N
    are zero, by forward substitution row by row (jj = arange(BUFFER_TILE))."""
    Tinv = tl.where(jj[:, None] == jj[None, :], 1.0, 0.0)
    for i in range(1, N):
        sel = jj == i
        ti = tl.sum(tl.where(sel[:, None], Tm, 0.0), axis=0)              # T[i, :]
        row = tl.sum(ti[:, None] * Tinv, axis=0)                           # T[i, :] Tinv
        Tinv = tl.where(sel[:, None], Tinv - row[None, :], Tinv)
    return Tinv


@triton.jit
def _slot_tokens(tok_ptr, b, h, w, T, WIDTH, jj, H: tl.constexpr, BUFFER_LEN: tl.constexpr):
    """Window w of row b: per slot (BUFFER_TILE of them) the raw token-map entry (token t >= 0, buffered
    slot -2 - s, null -1; slots >= L and past the row read -1), whether it is a token of the
    segment, and its output row (b * T + t) * H + h."""
    inwin = (jj < BUFFER_LEN) & (w * BUFFER_LEN + jj < WIDTH)
    idx = tl.load(tok_ptr + b.to(tl.int64) * WIDTH + w * BUFFER_LEN + jj, mask=inwin, other=-1)
    is_tok = idx >= 0
    tok_row = (b.to(tl.int64) * T + tl.where(is_tok, idx, 0).to(tl.int64)) * H + h
    return idx, is_tok, tok_row


@triton.jit
def _load_keys(tok_ptr, q_ptr, k_ptr, a_ptr, b_ptr, bk_ptr, bG_ptr, bb_ptr,
               b, h, w, h0, T, WIDTH, cols, jj,
               H: tl.constexpr, DK: tl.constexpr, BUFFER_LEN: tl.constexpr, DELTA: tl.constexpr,
               VEC: tl.constexpr):
    """Entries of window w of row b, head h, as float32 tiles over BUFFER_TILE slots (slots >= L
    and null steps are zero): K, Q [BUFFER_TILE, DK]; G [BUFFER_TILE] cumulative log gate since
    the checkpoint (VEC: [BUFFER_TILE, DK], per key channel); Bt [BUFFER_TILE] beta (GDN); idx
    [BUFFER_TILE] the token-map entries; tok_row / buf_row [BUFFER_TILE] where the slot's token /
    buffered entry lives (for `_load_values`)."""
    idx, is_tok, tok_row = _slot_tokens(tok_ptr, b, h, w, T, WIDTH, jj, H, BUFFER_LEN)
    is_buf = idx <= -2
    s = tl.where(is_buf, -2 - idx, 0).to(tl.int64)
    buf_row = (b.to(tl.int64) * H + h) * BUFFER_LEN + s
    mt = is_tok[:, None]
    mb = is_buf[:, None]
    K = tl.where(mt, tl.load(k_ptr + tok_row[:, None] * DK + cols[None, :], mask=mt, other=0.0).to(tl.float32),
                 tl.load(bk_ptr + buf_row[:, None] * DK + cols[None, :], mask=mb, other=0.0))
    Q = tl.load(q_ptr + tok_row[:, None] * DK + cols[None, :], mask=mt, other=0.0).to(tl.float32)
    if DELTA:
        Bt = tl.where(is_tok, tl.load(b_ptr + tok_row, mask=is_tok, other=0.0).to(tl.float32),
                      tl.load(bb_ptr + buf_row, mask=is_buf, other=0.0))
    else:
        Bt = jj.to(tl.float32) * 0.0
    # buffered slots (window 0 only) keep their stored G; new entries continue from the last one
    if VEC:
        la = tl.load(a_ptr + tok_row[:, None] * DK + cols[None, :], mask=mt, other=0.0).to(tl.float32)
        Gb = tl.load(bG_ptr + buf_row[:, None] * DK + cols[None, :], mask=mb, other=0.0)
        g0 = tl.sum(tl.where((is_buf & (jj == h0 - 1))[:, None], Gb, 0.0), axis=0)
        G = tl.where(mb, Gb, g0[None, :] + tl.cumsum(la, axis=0))
    else:
        la = tl.load(a_ptr + tok_row, mask=is_tok, other=0.0).to(tl.float32)
        Gb = tl.load(bG_ptr + buf_row, mask=is_buf, other=0.0)
        g0 = tl.sum(tl.where(is_buf & (jj == h0 - 1), Gb, 0.0), axis=0)
        G = tl.where(is_buf, Gb, g0 + tl.cumsum(la, axis=0))
    return K, Q, G, Bt, idx, tok_row, buf_row


@triton.jit
def _load_values(v_ptr, bv_ptr, idx, tok_row, buf_row, rows, DV: tl.constexpr):
    """V [BUFFER_TILE, len(rows)]: columns `rows` of the window's values (null slots zero)."""
    mt = (idx >= 0)[:, None]
    mb = (idx <= -2)[:, None]
    return tl.where(mt, tl.load(v_ptr + tok_row[:, None] * DV + rows[None, :], mask=mt, other=0.0).to(tl.float32),
                    tl.load(bv_ptr + buf_row[:, None] * DV + rows[None, :], mask=mb, other=0.0))


@triton.jit
def _decayed_products(K, Q, G, jj, BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr):
    """Per-channel gates G [BUFFER_TILE, DK]: the causal products Aqk[t, j] = q_t . (k_j * exp(G_t -
    G_j)) and KK[t, j] = k_t . (k_j * exp(G_t - G_j)) for j <= t (zero elsewhere), a column j
    at a time. Every exponent is G_t - G_j with t >= j (<= 0 for gates <= 1): the decay from
    step j to step t, so nothing overflows however much a channel forgets (a factored form
    q exp(G) . k exp(-G) would form exp(-G_j) alone)."""
    Aqk = tl.zeros([BUFFER_TILE, BUFFER_TILE], tl.float32)
    KK = tl.zeros([BUFFER_TILE, BUFFER_TILE], tl.float32)
    for j in range(BUFFER_LEN):
        sel = jj == j
        kj = tl.sum(tl.where(sel[:, None], K, 0.0), axis=0)                 # k_j [DK]
        gj = tl.sum(tl.where(sel[:, None], G, 0.0), axis=0)                 # G_j [DK]
        later = (jj >= j)[:, None]
        kd = tl.where(later, tl.exp(tl.where(later, G - gj[None, :], 0.0)), 0.0) * kj[None, :]
        Aqk = tl.where(sel[None, :], tl.sum(Q * kd, axis=1)[:, None], Aqk)
        KK = tl.where(sel[None, :], tl.sum(K * kd, axis=1)[:, None], KK)
    return Aqk, KK


@triton.jit
def _window_terms(K, Q, G, Bt, jj, BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, DELTA: tl.constexpr,
                  PREC: tl.constexpr, VEC: tl.constexpr):
    """State-independent terms: Aqk [BUFFER_TILE, BUFFER_TILE] = exp(G_t - G_j) (q_t . k_j) for
    j <= t, and for GDN Tinv = (I + T)^-1 with T[t, j] = beta_t exp(G_t - G_j) (k_t . k_j) for j < t (VEC:
    the decay per channel inside the dot products, `_decayed_products`)."""
    if VEC:
        Aqk, KKd = _decayed_products(K, Q, G, jj, BUFFER_LEN, BUFFER_TILE)
    else:
        causal = jj[None, :] <= jj[:, None]
        D = tl.where(causal, tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0)), 0.0)
        Aqk = tl.dot(Q, tl.trans(K), input_precision=PREC) * D
    if DELTA:
        strict = jj[None, :] < jj[:, None]
        if VEC:
            Tm = tl.where(strict, Bt[:, None] * KKd, 0.0)
        else:
            KK = tl.dot(K, tl.trans(K), input_precision=PREC)
            Tm = tl.where(strict, Bt[:, None] * KK * D, 0.0)
        Tinv = unit_lower_inverse(Tm, jj, BUFFER_LEN)
    else:
        Tinv = Aqk
    return Aqk, Tinv


@triton.jit
def _nv_scale(amax):
    """NVFP4 matrix scale from the matrix amax (as _tile_store computes it)."""
    g = tl.div_rn(amax, _NV_DIV)
    return tl.where(g > 0, g, 1.0)


@triton.jit
def _matrix_amax(local, mx, cn, err, spin_limit, NP: tl.constexpr):
    """The amax of a matrix whose rows are split over the NP programs of one (sequence x head)
    that run the chain together: each program folds its rows' amax `local` into mx (atomic max,
    zeroed by the host), counts itself in cn and waits until all NP have; mx then holds the
    matrix amax. The NP programs must be resident at once (the host launches at most one per
    SM); a wait longer than spin_limit polls sets err[0] = 1 (the host raises) instead of
    hanging. NP = 1 (the interpreter): no wait."""
    tl.atomic_max(mx, local, sem="release")
    n = tl.atomic_add(cn, 1, sem="acq_rel") + 1
    spins = tl.full([], 0, tl.int32)
    while (n < NP) & (spins < spin_limit):
        n = tl.atomic_add(cn, 0, sem="acquire")
        spins += 1
    tl.store(err, 1, mask=n < NP)
    return tl.atomic_max(mx, 0.0, sem="acquire")


@triton.jit
def _cast_tile(x, g, pay, sc, gs, mat, rows, cols, key_lo, key_hi, flush_index, slot, head, store,
               DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, FMT: tl.constexpr,
               SR: tl.constexpr, ROLE: tl.constexpr, rb_tile=None, PRE: tl.constexpr = False):
    """`_tile_store` of float32 rows x [BV, DK] of matrix `mat` that also returns the decoded
    tile (the values `_tile_load` reads back) and stores the codes only where `store` (a
    scalar). NVFP4 takes its matrix scale g from the caller (`_nv_scale` of the whole matrix's
    amax), so a matrix can be cast a row block at a time; every other format is per tile / row.
    Same arithmetic as `_tile_store`, so the same codes (and SR bits: element index in the
    matrix, flush index, ROLE, slot, head; PRE: those bits read from rb_tile + element index,
    where pass 1 stored them)."""
    offs = rows[:, None] * DK + cols[None, :]
    smask = tl.where(store, offs >= 0, False)   # (a scalar & a tensor: not in the interpreter)
    ptrs = pay + mat * (DV * DK) + offs
    if SR and PRE:
        rb = tl.load(rb_tile + offs).to(tl.uint32, bitcast=True)
    else:
        rb = _role_bits(offs, SR, key_lo, key_hi, flush_index, ROLE, slot, head)
    if FMT == 0:
        tl.store(ptrs, x, mask=smask)
        out = x
    elif FMT == 1:
        c = encode_fp16(x, rb, SR).to(tl.int16)
        tl.store(ptrs, c, mask=smask)
        out = decode_fp16(c)
    elif FMT == 2:
        c = encode_bf16(x, rb, SR).to(tl.int16)
        tl.store(ptrs, c, mask=smask)
        out = decode_bf16(c)
    elif FMT == 3:
        amax = tl.max(tl.abs(x), axis=1)
        s = tl.div_rn(amax, _FP8_DIV)
        s = tl.where(s > 0, s, 1.0)
        c = encode_e4m3(tl.div_rn(x, s[:, None]), rb, SR).to(tl.uint8)
        tl.store(ptrs, c, mask=smask)
        tl.store(sc + mat * DV + rows, s, mask=tl.where(store, rows >= 0, False))
        out = decode_e4m3(c) * s[:, None]
    else:
        DK2: tl.constexpr = DK // 2
        NB: tl.constexpr = DK // 16
        nibs, bcode = nv_block_encode(x, g, rb, BV, DK, SR)
        lo, hi = tl.split(tl.reshape(nibs, (BV, DK2, 2)))
        half = tl.arange(0, DK2)
        tl.store(pay + mat * (DV * DK2) + rows[:, None] * DK2 + half[None, :],
                 (lo | (hi << 4)).to(tl.uint8),
                 mask=tl.where(store, (half[None, :] >= 0) & (rows[:, None] >= 0), False))
        nb = tl.arange(0, NB)
        tl.store(sc + mat * (DV * NB) + rows[:, None] * NB + nb[None, :], bcode.to(tl.uint8),
                 mask=tl.where(store, (nb[None, :] >= 0) & (rows[:, None] >= 0), False))
        tl.store(gs + mat, g, mask=store)
        v = tl.reshape(decode_e2m1(nibs), (BV, NB, 16))
        out = tl.reshape(v * decode_e4m3(bcode)[:, :, None], (BV, DK)) * g
    return out


@triton.jit
def _window_program(w0, H: tl.constexpr):
    """Grid (window of the group, sequence x head) -> (window in group wl, sequence x head bh,
    sequence b, head h, window w, matrix index as int64)."""
    wl = tl.program_id(0)
    bh = tl.program_id(1)
    return wl, bh, bh // H, bh % H, w0 + wl, bh.to(tl.int64)


@triton.jit
def _store_key_terms(Kw, Ww, Pw, QLw, Gw, K, Q, G, Bt, Aqk, Tinv, eG, tb, kq, cols, jj,
                     DK: tl.constexpr, BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr,
                     DELTA: tl.constexpr, PREC: tl.constexpr, VEC: tl.constexpr):
    """Pass 1's key-side terms of one window into its scratch slot tb: q_L; K and G (VEC: the
    keys decayed to the window's end and G_L); for GDN W = Tinv (beta exp(G) k) and P = exp(G) q
    - Aqk W (Mamba-2: P = exp(G) q)."""
    tl.store(QLw + tb * DK + cols, tl.sum(tl.where((jj == BUFFER_LEN - 1)[:, None], Q, 0.0), axis=0))
    if VEC:
        GL = tl.sum(tl.where((jj == BUFFER_LEN - 1)[:, None], G, 0.0), axis=0)
        inw = (jj < BUFFER_LEN)[:, None]
        tl.store(Kw + kq, K * tl.where(inw, tl.exp(tl.where(inw, GL[None, :] - G, 0.0)), 0.0))
        tl.store(Gw + tb * DK + cols, GL)
        if DELTA:
            Wm = tl.dot(Tinv, Bt[:, None] * eG * K, input_precision=PREC)
            tl.store(Ww + kq, Wm)
            tl.store(Pw + kq, eG * Q - tl.dot(Aqk, Wm, input_precision=PREC))
        else:
            tl.store(Pw + kq, eG * Q)
    else:
        tl.store(Kw + kq, K)
        tl.store(Gw + tb * BUFFER_TILE + jj, G)
        if DELTA:
            Wm = tl.dot(Tinv, (Bt * eG)[:, None] * K, input_precision=PREC)
            tl.store(Ww + kq, Wm)
            tl.store(Pw + kq, eG[:, None] * Q - tl.dot(Aqk, Wm, input_precision=PREC))
        else:
            tl.store(Pw + kq, eG[:, None] * Q)


@triton.jit(do_not_specialize=["T", "WIDTH", "w0", "NWS", "key_lo", "key_hi"])
def _terms_kernel(
        tok_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, bk_ptr, bv_ptr, bG_ptr, bb_ptr, h0_ptr, nfull_ptr,
        Kw, Ww, Pw, QLw, Gw, Uw, Cw, nk_ptr, nv_ptr, nG_ptr, nb_ptr, Rb, nf_ptr, seq_ptr,
        T, WIDTH, w0, NWS, key_lo, key_hi,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, DELTA: tl.constexpr, EXACT: tl.constexpr,
        PRE: tl.constexpr, PREC: tl.constexpr, VEC: tl.constexpr = False):
    """Pass 1, one program per (window, sequence x head): the window's state-independent terms
    into the group scratch. With Aqk[t, j] = exp(G_t - G_j) q_t.k_j (j <= t) and, for GDN,
    Tinv = (I + T)^-1, W = Tinv (beta exp(G) k), U = Tinv (beta v) (so u(X) = U - W X^T for a
    checkpoint X; Mamba-2: W = 0, U = v), the outputs from X are y = P X^T + C with
    P = exp(G) q - Aqk W and C = Aqk U. Stores K, W, G, q_L (the sequential pass), P, C (the
    output pass), U; and the new buffer (the entries of the row's last, partial window) from
    the program of that window. V, U and C go a block of BV columns at a time.
    PRE (a stochastically rounded anchor): the SR bits of the flush that ends this window
    (flush index nf + w + 1, role ANCHOR), so the sequential pass reads them instead of running
    Philox on its critical path.
    VEC (gates per key channel, G [BUFFER_TILE, DK]): exp(G) multiplies q and k per channel (P =
    exp(G) * q - Aqk W, W = Tinv (beta exp(G) * k)), the sequential pass gets the window's
    decayed keys k_j * exp(G_L - G_j) in place of K and G_L [DK] in place of G, so that it
    forms S = A Diag(exp(G_L)) + u^T K_decayed."""
    wl, bh, b, h, w, _ = _window_program(w0, H)
    cols = tl.arange(0, DK)
    jj = tl.arange(0, BUFFER_TILE)
    h0 = tl.load(h0_ptr + b)
    nfull = tl.load(nfull_ptr + b)
    K, Q, G, Bt, idx, tok_row, buf_row = _load_keys(tok_ptr, q_ptr, k_ptr, a_ptr, b_ptr, bk_ptr,
                                                    bG_ptr, bb_ptr, b, h, w, h0, T, WIDTH, cols,
                                                    jj, H, DK, BUFFER_LEN, DELTA, VEC)
    Aqk, Tinv = _window_terms(K, Q, G, Bt, jj, BUFFER_LEN, BUFFER_TILE, DELTA, PREC, VEC)
    eG = tl.exp(G)
    tb = bh.to(tl.int64) * NWS + wl                      # window slot in the scratch
    kq = (tb * BUFFER_TILE + jj[:, None]) * DK + cols[None, :]
    _store_key_terms(Kw, Ww, Pw, QLw, Gw, K, Q, G, Bt, Aqk, Tinv, eG, tb, kq, cols, jj,
                     DK, BUFFER_LEN, BUFFER_TILE, DELTA, PREC, VEC)
    if EXACT:
        here = w == 0
        keep = jj < 0                                    # the buffer empties
    else:
        here = w == nfull
        keep = idx != -1
    inw = tl.where(here, jj < BUFFER_LEN, False)
    buf = (b.to(tl.int64) * H + h) * BUFFER_LEN + jj
    for rb in range(DV // BV):
        rows = rb * BV + tl.arange(0, BV)
        V = _load_values(v_ptr, bv_ptr, idx, tok_row, buf_row, rows, DV)
        if DELTA:
            U = tl.dot(Tinv, Bt[:, None] * V, input_precision=PREC)
        else:
            U = V
        uc = (tb * BUFFER_TILE + jj[:, None]) * DV + rows[None, :]
        tl.store(Uw + uc, U)
        tl.store(Cw + uc, tl.dot(Aqk, U, input_precision=PREC))
        tl.store(nv_ptr + buf[:, None] * DV + rows[None, :], tl.where(keep[:, None], V, 0.0),
                 mask=inw[:, None])
    tl.store(nk_ptr + buf[:, None] * DK + cols[None, :], tl.where(keep[:, None], K, 0.0),
             mask=inw[:, None])
    if VEC:
        tl.store(nG_ptr + buf[:, None] * DK + cols[None, :], tl.where(keep[:, None], G, 0.0),
                 mask=inw[:, None])
    else:
        tl.store(nG_ptr + buf, tl.where(keep, G, 0.0), mask=inw)
    if DELTA:
        tl.store(nb_ptr + buf, tl.where(keep, Bt, 0.0), mask=inw)
    if PRE:
        if w < nfull:                                   # a window that ends in a flush
            nf = tl.load(nf_ptr + b)
            seq = tl.load(seq_ptr + b)
            for rb in range(DV // BV):
                offs = (rb * BV + tl.arange(0, BV))[:, None] * DK + cols[None, :]
                bits = _sr_bits(offs, key_lo, key_hi, nf + w + 1, 0, seq, h)
                tl.store(Rb + tb * (DV * DK) + offs, bits.to(tl.int32, bitcast=True))


@triton.jit
def _chain_inputs(tok_ptr, Kw, Ww, QLw, Gw, b, mat, w, w0, cols, jj, WIDTH, NWS,
                  DK: tl.constexpr, BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, DELTA: tl.constexpr,
                  VEC: tl.constexpr):
    """The state-independent inputs of window w's flush that every row block shares (pass 1's
    scratch): K, W (GDN; else K again), G, q_L, and the flush token's index (-1: none).
    VEC: K holds the decayed keys and G is G_L [DK] (see _terms_kernel)."""
    tb = mat * NWS + (w - w0)
    kq = (tb * BUFFER_TILE + jj[:, None]) * DK + cols[None, :]
    Kt = tl.load(Kw + kq)
    if DELTA:
        Wm = tl.load(Ww + kq)
    else:
        Wm = Kt
    if VEC:
        G = tl.load(Gw + tb * DK + cols)
    else:
        G = tl.load(Gw + tb * BUFFER_TILE + jj)
    qL = tl.load(QLw + tb * DK + cols)
    last = w * BUFFER_LEN + BUFFER_LEN - 1                   # the window's last token map entry
    tokL = tl.load(tok_ptr + b.to(tl.int64) * WIDTH + last, mask=last < WIDTH, other=-1)
    return Kt, Wm, G, qL, tokL


@triton.jit
def _chain_U(Uw, mat, w, w0, rows, jj, NWS, DV: tl.constexpr, BUFFER_TILE: tl.constexpr):
    """U of window w for `rows` (pass 1's scratch)."""
    return tl.load(Uw + ((mat * NWS + (w - w0)) * BUFFER_TILE + jj[:, None]) * DV + rows[None, :])


@triton.jit
def _chain_state(A, U, Wm, Kt, G, jj, BUFFER_LEN: tl.constexpr, DELTA: tl.constexpr,
                 PREC: tl.constexpr, VEC: tl.constexpr):
    """The unrounded state after a window from checkpoint rows A: S = exp(G_L) A +
    (u w_L)^T K, u = U - W A^T (GDN) or U (Mamba-2), w_L[j] = exp(G_L - G_j). VEC: G is G_L
    [DK] and Kt the decayed keys k_j * exp(G_L - G_j): S = A Diag(exp(G_L)) + u^T Kt."""
    if DELTA:
        u = U - tl.dot(Wm, tl.trans(A), input_precision=PREC)
    else:
        u = U
    if VEC:
        S = tl.exp(G)[None, :] * A + tl.dot(tl.trans(u), Kt, input_precision=PREC)
    else:
        GL = tl.sum(tl.where(jj == BUFFER_LEN - 1, G, 0.0), axis=0)
        inw = jj < BUFFER_LEN
        wL = tl.where(inw, tl.exp(tl.where(inw, GL - G, 0.0)), 0.0)
        S = tl.exp(GL) * A + tl.dot(tl.trans(u * wL[:, None]), Kt, input_precision=PREC)
    return S


@triton.jit
def _chain_rows_in_registers(
        tok_ptr, y_ptr, Kw, Ww, QLw, Gw, Uw, Xs, a_tile, A_pay, A_sc, A_gs, Rb,
        Mx, Cn, err, spin_limit,
        b, h, mat, pb, cols, jj, br, nf, seq, nfull, w0, wend, T, WIDTH, NWS, key_lo, key_hi,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, AFMT: tl.constexpr, ASR: tl.constexpr,
        SHARED: tl.constexpr, DELTA: tl.constexpr, EXACT: tl.constexpr, PRE: tl.constexpr,
        PREC: tl.constexpr, SPLIT: tl.constexpr, VEC: tl.constexpr):
    """The sequential pass for a program of one row block: the anchor (exact: the running
    unrounded state) stays in registers from window to window, written to the As scratch once
    at the end, and each window's state-independent inputs are loaded one window ahead, so the
    chain's critical path holds no global round trip. An NVFP4 anchor (SPLIT, not exact) takes
    its matrix scale from the amax of every row block, exchanged between the programs of the
    matrix through Mx / Cn (one slot per window, _matrix_amax). Same arithmetic as the general
    loop in _chain_kernel."""
    rows = pb * BV + br
    A = tl.load(a_tile + rows[:, None] * DK)
    Kt, Wm, G, qL, tokL = _chain_inputs(tok_ptr, Kw, Ww, QLw, Gw, b, mat, w0, w0, cols, jj,
                                        WIDTH, NWS, DK, BUFFER_LEN, BUFFER_TILE, DELTA, VEC)
    U = _chain_U(Uw, mat, w0, w0, rows, jj, NWS, DV, BUFFER_TILE)
    for w in tl.range(w0, wend, num_stages=1):
        cK, cW, cG, cq, cU, ctok = Kt, Wm, G, qL, U, tokL
        wn = tl.minimum(w + 1, wend - 1)            # the next window's inputs, loaded ahead
        Kt, Wm, G, qL, tokL = _chain_inputs(tok_ptr, Kw, Ww, QLw, Gw, b, mat, wn, w0, cols, jj,
                                            WIDTH, NWS, DK, BUFFER_LEN, BUFFER_TILE, DELTA, VEC)
        U = _chain_U(Uw, mat, wn, w0, rows, jj, NWS, DV, BUFFER_TILE)
        tb = mat * NWS + (w - w0)
        x_tile = Xs + (mat * (NWS + 1) + (w - w0) + 1) * (DV * DK) + cols[None, :]
        S = _chain_state(A, cU, cW, cK, cG, jj, BUFFER_LEN, DELTA, PREC, VEC)
        if EXACT:
            tl.store(x_tile + rows[:, None] * DK, S)
            A = S
        else:
            # the flush step reads the unrounded state rebuilt from the anchor
            yrow = (b.to(tl.int64) * T + tl.maximum(ctok, 0)) * H + h
            tl.store(y_ptr + yrow * DV + rows, tl.sum(S * cq[None, :], axis=1),
                     mask=tl.where(ctok >= 0, rows >= 0, False))
            g = 1.0
            if SPLIT:                              # Mx / Cn: one slot per (matrix, window)
                g = _nv_scale(_matrix_amax(tl.max(tl.max(tl.abs(S), axis=1), axis=0), Mx + tb,
                                           Cn + tb, err, spin_limit, DV // BV))
            A = _cast_tile(S, g, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi,
                           nf + w + 1, seq, h, w == nfull - 1, DV, DK, BV, AFMT, ASR, 0,
                           Rb + tb * (DV * DK), PRE)
            if SHARED:
                tl.store(x_tile + rows[:, None] * DK, A)
            else:
                tl.store(x_tile + rows[:, None] * DK, S)
    tl.store(a_tile + rows[:, None] * DK, A)


@triton.jit
def _chain_rows_in_blocks(
        tok_ptr, y_ptr, Kw, Ww, QLw, Gw, Uw, Xs, a_tile, A_pay, A_sc, A_gs, Rb, b, h, mat, pb,
        cols, jj, br, nf, seq, nfull, w0, wend, T, WIDTH, NWS, key_lo, key_hi,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NRB: tl.constexpr,
        BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, AFMT: tl.constexpr, ASR: tl.constexpr,
        SHARED: tl.constexpr, DELTA: tl.constexpr, EXACT: tl.constexpr, PRE: tl.constexpr,
        PREC: tl.constexpr, VEC: tl.constexpr, TWO_PASS: tl.constexpr):
    """`_chain_kernel` with NRB row blocks in one program: an NVFP4 anchor (TWO_PASS: every row
    block's S first, then the matrix amax and the casts) or exact prefill (S is the state)."""
    # num_stages=1: no software pipelining of this loop, whose loads of As / Xs read what the
    # previous iteration stored (a prefetch would read the old values)
    for w in tl.range(w0, wend, num_stages=1):
        tb = mat * NWS + (w - w0)
        x_tile = Xs + (mat * (NWS + 1) + (w - w0) + 1) * (DV * DK) + cols[None, :]
        Kt, Wm, G, qL, tokL = _chain_inputs(tok_ptr, Kw, Ww, QLw, Gw, b, mat, w, w0, cols, jj,
                                            WIDTH, NWS, DK, BUFFER_LEN, BUFFER_TILE, DELTA, VEC)
        yrow = (b.to(tl.int64) * T + tl.maximum(tokL, 0)) * H + h
        fi = nf + w + 1
        last = w == nfull - 1
        rb_tile = Rb + tb * (DV * DK)                   # PRE: this flush's SR bits
        acc = tl.zeros([BV], tl.float32)
        for rb in range(NRB):
            rows = (pb * NRB + rb) * BV + br
            A = tl.load(a_tile + rows[:, None] * DK)
            S = _chain_state(A, _chain_U(Uw, mat, w, w0, rows, jj, NWS, DV, BUFFER_TILE), Wm, Kt, G,
                             jj, BUFFER_LEN, DELTA, PREC, VEC)
            if EXACT:
                tl.store(x_tile + rows[:, None] * DK, S)
                tl.store(a_tile + rows[:, None] * DK, S)
            else:
                # the flush step reads the unrounded state rebuilt from the anchor
                tl.store(y_ptr + yrow * DV + rows, tl.sum(S * qL[None, :], axis=1),
                         mask=tl.where(tokL >= 0, rows >= 0, False))
                tl.store(x_tile + rows[:, None] * DK, S)
                acc = tl.maximum(acc, tl.max(tl.abs(S), axis=1))
        if TWO_PASS:
            tl.debug_barrier()
            g = _nv_scale(tl.max(acc, axis=0))
            for rb in range(NRB):
                rows = (pb * NRB + rb) * BV + br
                S = tl.load(x_tile + rows[:, None] * DK)
                An = _cast_tile(S, g, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi,
                                fi, seq, h, last, DV, DK, BV, AFMT, ASR, 0, rb_tile, PRE)
                tl.store(a_tile + rows[:, None] * DK, An)
                if SHARED:
                    tl.debug_barrier()
                    tl.store(x_tile + rows[:, None] * DK, An)
        tl.debug_barrier()                       # the next window reads what was just written


@triton.jit(do_not_specialize=["T", "WIDTH", "w0", "NWS", "key_lo", "key_hi"])
def _chain_kernel(
        tok_ptr, y_ptr, nf_ptr, seq_ptr, nwin_ptr, nfull_ptr,
        Kw, Ww, QLw, Gw, Uw, Xs, As, A_pay, A_sc, A_gs, Rb, Mx, Cn, err,
        T, WIDTH, w0, NWS, key_lo, key_hi, spin_limit,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        NRB: tl.constexpr, BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr,
        AFMT: tl.constexpr, ASR: tl.constexpr, SHARED: tl.constexpr, DELTA: tl.constexpr,
        EXACT: tl.constexpr, PRE: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
        VEC: tl.constexpr = False):
    """Pass 2, the only sequential one: one program per (sequence x head, NRB * BV rows) runs
    the row's flushes of this window group in order. The dequantized anchor A lives in the
    FP32 scratch As (L2). Per window: u = U - W A^T, the unrounded state S = exp(G_L) A +
    (u w_L)^T K, the flush token's output S q_L, then A = the anchor cast of S (an NVFP4 anchor
    first takes the matrix amax over all row blocks: SPLIT, the row blocks are on d_v / BV
    programs that exchange their amax each window; else one program holds every row, NRB * BV
    = d_v, in two passes). The checkpoint of the next window goes to Xs: the dequantized anchor
    (shared pair) or S (a dual pair's read copy is cast from it in pass 3; exact: S itself). The
    packed anchor is written at the row's last flush only."""
    bh = tl.program_id(0)
    pb = tl.program_id(1)
    b = bh // H
    h = bh % H
    mat = bh.to(tl.int64)
    cols = tl.arange(0, DK)
    jj = tl.arange(0, BUFFER_TILE)
    br = tl.arange(0, BV)
    nf = tl.load(nf_ptr + b)
    seq = tl.load(seq_ptr + b)
    nfull = tl.load(nfull_ptr + b)
    if EXACT:
        nfold = tl.load(nwin_ptr + b)
    else:
        nfold = nfull
    # SPLIT (the host sets it for an NVFP4 anchor outside exact prefill only): the row blocks
    # exchange the matrix amax; else an NVFP4 anchor is cast in two passes by one program
    tl.static_assert((not SPLIT) or (AFMT == 4 and not EXACT), "SPLIT needs an NVFP4 anchor")
    TWO_PASS: tl.constexpr = (AFMT == 4) and (not EXACT) and (not SPLIT)
    a_tile = As + mat * (DV * DK) + cols[None, :]
    wend = tl.minimum(nfold, w0 + NWS)
    if NRB == 1 and not TWO_PASS:
        _chain_rows_in_registers(
            tok_ptr, y_ptr, Kw, Ww, QLw, Gw, Uw, Xs, a_tile, A_pay, A_sc, A_gs, Rb,
            Mx, Cn, err, spin_limit, b, h, mat, pb, cols, jj, br, nf, seq, nfull, w0, wend, T,
            WIDTH, NWS, key_lo, key_hi,
            H, DK, DV, BV, BUFFER_LEN, BUFFER_TILE, AFMT, ASR, SHARED, DELTA, EXACT, PRE, PREC, SPLIT, VEC)
    else:
        # several row blocks per program: an NVFP4 anchor (two-pass cast with the matrix amax)
        # or exact prefill with one (chunk_launch_config gives other anchors one row block)
        tl.static_assert(TWO_PASS or EXACT, "several chain row blocks need an NVFP4 anchor")
        _chain_rows_in_blocks(
            tok_ptr, y_ptr, Kw, Ww, QLw, Gw, Uw, Xs, a_tile, A_pay, A_sc, A_gs, Rb, b, h, mat, pb,
            cols, jj, br, nf, seq, nfull, w0, wend, T, WIDTH, NWS, key_lo, key_hi,
            H, DK, DV, BV, NRB, BUFFER_LEN, BUFFER_TILE, AFMT, ASR, SHARED, DELTA, EXACT, PRE, PREC,
            VEC, TWO_PASS)


@triton.jit(do_not_specialize=["w0", "NWS", "key_lo", "key_hi"])
def _cast_kernel(
        nf_ptr, seq_ptr, nwin_ptr, nfull_ptr, Xs,
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        w0, NWS, key_lo, key_hi,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
        SHARED: tl.constexpr, EXACT: tl.constexpr):
    """Pass 3a (dual pairs and exact prefill), one program per (window, sequence x head), a row
    block at a time (NVFP4: an amax pass first, for the matrix scale). Dual pair: the
    checkpoint of window w > 0 in Xs is the unrounded S of the flush that ended window w - 1;
    it is replaced in place by its read copy (cast with that flush's SR stream, flush index
    nf + w), whose codes are stored for the window after the row's last flush. Exact: the window
    after the row's last entry holds the final unrounded state; it is cast into both roles
    (flush index nf + 1) and Xs is left as it is."""
    wl, bh, b, h, w, mat = _window_program(w0, H)
    cols = tl.arange(0, DK)
    br = tl.arange(0, BV)
    nf = tl.load(nf_ptr + b)
    seq = tl.load(seq_ptr + b)
    if EXACT:
        active = w == tl.load(nwin_ptr + b)
    else:
        nfull = tl.load(nfull_ptr + b)
        active = (w > 0) & (w <= nfull)
    if active:
        xs_tile = Xs + (mat * (NWS + 1) + wl) * (DV * DK) + cols[None, :]
        g = 1.0
        if (RFMT == 4 and not SHARED) or (EXACT and AFMT == 4):
            acc = tl.zeros([BV], tl.float32)
            for rb in range(DV // BV):
                X = tl.load(xs_tile + (rb * BV + br)[:, None] * DK)
                acc = tl.maximum(acc, tl.max(tl.abs(X), axis=1))
            g = _nv_scale(tl.max(acc, axis=0))
        for rb in range(DV // BV):
            rows = rb * BV + br
            X = tl.load(xs_tile + rows[:, None] * DK)
            if EXACT:
                _cast_tile(X, g, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi, nf + 1, seq,
                           h, active, DV, DK, BV, AFMT, ASR, 0)
                if not SHARED:
                    _cast_tile(X, g, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, nf + 1,
                               seq, h, active, DV, DK, BV, RFMT, RSR, 1)
            else:
                Xc = _cast_tile(X, g, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, nf + w,
                                seq, h, w == nfull, DV, DK, BV, RFMT, RSR, 1)
                tl.store(xs_tile + rows[:, None] * DK, Xc)


@triton.jit(do_not_specialize=["T", "WIDTH", "w0", "NWS"])
def _output_kernel(
        tok_ptr, y_ptr, nwin_ptr, nfull_ptr, Pw, Cw, Xs,
        T, WIDTH, w0, NWS,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
        BUFFER_LEN: tl.constexpr, BUFFER_TILE: tl.constexpr, EXACT: tl.constexpr, PREC: tl.constexpr):
    """Pass 3b, one program per (window, sequence x head), a row block at a time: the outputs
    y = P X^T + C of every token of the window from its checkpoint X (Xs: the read copy's
    values; exact: the unrounded state) but the flush token of a flushing window (pass 2
    wrote those)."""
    wl, bh, b, h, w, mat = _window_program(w0, H)
    cols = tl.arange(0, DK)
    jj = tl.arange(0, BUFFER_TILE)
    br = tl.arange(0, BV)
    nfull = tl.load(nfull_ptr + b)
    if EXACT:
        nfold = tl.load(nwin_ptr + b)
    else:
        nfold = nfull
    idx, is_tok, tok_row = _slot_tokens(tok_ptr, b, h, w, T, WIDTH, jj, H, BUFFER_LEN)
    if EXACT:
        keep = is_tok
    else:
        keep = tl.where(w >= nfull, is_tok, is_tok & (jj != BUFFER_LEN - 1))
    if w <= nfold:                                       # else: no token in this window
        tb = mat * NWS + wl
        P = tl.load(Pw + (tb * BUFFER_TILE + jj[:, None]) * DK + cols[None, :])
        xs_tile = Xs + (mat * (NWS + 1) + wl) * (DV * DK) + cols[None, :]
        for rb in range(DV // BV):
            rows = rb * BV + br
            X = tl.load(xs_tile + rows[:, None] * DK)
            y = tl.dot(P, tl.trans(X), input_precision=PREC) \
                + tl.load(Cw + (tb * BUFFER_TILE + jj[:, None]) * DV + rows[None, :])
            tl.store(y_ptr + tok_row[:, None] * DV + rows[None, :], y, mask=keep[:, None])


# ============================================================================ host side

def supports(d_k: int, d_v: int) -> bool:
    """Whether the kernel handles these state dimensions (powers of two >= 16)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (d_k, d_v))


SPIN_LIMIT = 1 << 22            # polls of a split chain's amax wait before it reports an error


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


def _token_map(state: ScanState, valid, B: int, T: int, buffer_len: int, width: int, dev):
    """int32 [B, width]: per window column, the token index t (>= 0), the buffered slot s
    (encoded -2 - s) or a null step (-1): each row is [its buffered steps][its valid tokens].
    valid None (every token valid): token t sits in column count + t, no host sync."""
    col = torch.arange(width, device=dev)[None, :]
    h0 = state.committed.to(dev)[:, None]
    if valid is None:
        tok = torch.where(col < h0, -2 - col, torch.where(col - h0 < T, col - h0, -1))
        return tok.to(torch.int32).contiguous()
    tok = torch.where(col < h0, -2 - col, torch.full((), -1, device=dev))
    bi, ti = valid.nonzero(as_tuple=True)
    cols = h0[bi, 0] + (valid.long().cumsum(1) - 1)[bi, ti]
    tok[bi, cols] = ti
    return tok.to(torch.int32).contiguous()


def _check_scan(state: ScanState, q, k, v, log_a, beta, valid, pair) -> None:
    _check_inputs(state, q, k, v, log_a, beta, valid)
    if pair.buffer_len != state.buffer_len:
        raise ValueError(f"pair {pair.label()} has buffer_len {pair.buffer_len} but the state was "
                         f"built with {state.buffer_len}; use the same pair")
    dk, dv = q.shape[-1], v.shape[-1]
    if not supports(dk, dv):
        raise ValueError(f"the Triton chunk kernel needs d_k and d_v powers of two >= 16, got "
                         f"d_k={dk}, d_v={dv}; use chunk_ref.chunk_scan_ref for this shape")
    if (state.read is None) != (pair.read is None) or state.anchor.format != pair.anchor.format:
        raise ValueError(f"the state's roles ({state.anchor.format}, "
                         f"{None if state.read is None else state.read.format}) do not match the "
                         f"pair {pair.label()}")


def _windows(state: ScanState, valid_b, B: int, T: int, dev):
    """(entries per row after the segment m [B], windows W) or None where no row gains an entry."""
    buffer_len = state.buffer_len
    h0 = state.committed.to(dev)
    if valid_b is None:
        # every token valid: entries per row m = count + T with count <= L, so at most
        # ceil((L + T) / L) windows (a trailing one without entries costs little); no host sync
        if B == 0 or T == 0:
            return None
        return h0 + T, -(-(buffer_len + T) // buffer_len)
    m = h0 + valid_b.sum(1)
    M = int(m.max()) if B else 0                     # the one host sync (padding)
    if M == 0 or T == 0:
        return None
    return m, -(-M // buffer_len)


class _Scratch:
    """The group scratch of one chunk_scan, reused by every group of G windows: window slots
    [BH, G, ...] and checkpoints [BH, G + 1, d_v, d_k]; a split NVFP4 chain's amax slots and
    error flag; window 0's checkpoint (the read copy, or the anchor for a shared pair or exact)
    and the chain's A (the anchor), dequantized."""

    def __init__(self, state, pair, BH, G, dk, dv, buffer_tile, delta, vec, pre, split, exact, dev):
        f32 = torch.float32
        self.Kw = torch.empty(BH, G, buffer_tile, dk, dtype=f32, device=dev)
        self.Pw = torch.empty_like(self.Kw)
        self.Ww = torch.empty_like(self.Kw) if delta else self.Kw
        self.QLw = torch.empty(BH, G, dk, dtype=f32, device=dev)
        self.Gw = torch.empty(BH, G, dk if vec else buffer_tile, dtype=f32, device=dev)   # G, or G_L
        self.Uw = torch.empty(BH, G, buffer_tile, dv, dtype=f32, device=dev)
        self.Cw = torch.empty_like(self.Uw)
        self.Xs = torch.empty(BH, G + 1, dv, dk, dtype=f32, device=dev)
        self.As = torch.empty(BH, dv, dk, dtype=f32, device=dev)
        self.Rb = torch.empty(BH, G, dv, dk, dtype=torch.int32, device=dev) if pre else self.As
        unused = torch.empty(1, dtype=torch.int32, device=dev)     # SPLIT off: never read
        self.Mx = torch.zeros(BH, G, dtype=f32, device=dev) if split else self.Gw
        self.Cn = torch.zeros(BH, G, dtype=torch.int32, device=dev) if split else unused
        self.err = torch.zeros(1, dtype=torch.int32, device=dev) if split else unused
        shared = state.read is None
        first = state.anchor if (shared or exact) else state.read
        spec = pair.anchor if (shared or exact) else pair.read
        self.Xs[:, 0] = spec.fmt.dequantize(first).reshape(BH, dv, dk)
        self.As.copy_(pair.anchor.fmt.dequantize(state.anchor).reshape(BH, dv, dk))


def chunk_scan(state: ScanState, q, k, v, log_a, beta=None, *, pair, seed: int = 0,
               layer: int = 0, valid=None, exact: bool = False,
               precompute_sr_bits: bool = False, pass_events: list | None = None):
    """Triton version of `chunk_ref.chunk_scan_ref` (same arguments, same result within FP32
    reassociation, same SR bits): returns (y [B, T, H, d_v] float32, the ScanState after the
    segment). Inputs may be any float dtype (read as float32 in the kernel); log_a [B, T, H,
    d_k] for a vector-gated state (KDA), as the reference.

    Two options for benchmarks, neither changes the result:
    precompute_sr_bits: a stochastically rounded anchor's SR bits of each flush are drawn by
    pass 1 (4 bytes per state element and window in the scratch) and read by the sequential
    pass (the same bits); False (the default): the sequential pass draws them (Philox) itself.
    H200, Qwen3.5-4B layer at 8K tokens: tp4_hi16_sr 6.74 ms drawn in the chain against 7.00
    precomputed, f4_sr_rs (split chain) 8.33 against 8.98.
    pass_events: a list to which each launch appends (pass name, start, end) CUDA events
    (CUDA only; None: no events)."""
    _check_scan(state, q, k, v, log_a, beta, valid, pair)
    B, T, H, dk = q.shape
    dv, dev, buffer_len = v.shape[-1], q.device, state.buffer_len
    valid_b = None if valid is None else valid.to(torch.bool)
    win = _windows(state, valid_b, B, T, dev)
    if win is None:
        return torch.zeros(B, T, H, dv, dtype=torch.float32, device=dev), state
    m, W = win
    full = m // buffer_len
    tok = _token_map(state, valid_b, B, T, buffer_len, W * buffer_len, dev)
    anchor = core.qt_clone(state.anchor)
    read = None if state.read is None else core.qt_clone(state.read)
    out = _launch_groups(state, pair, tok, q, k, v, log_a, beta, anchor, read, m, full, W, seed,
                         layer, exact, precompute_sr_bits, pass_events)
    y, nk, nv, nG, nb = out
    if valid is not None:
        y[~valid_b] = 0.0                       # padding: no slot, output 0
    if exact:
        count = torch.zeros_like(state.committed)
        flushes = state.n_flush + 1
    else:
        count = m - full * buffer_len
        flushes = state.n_flush + full
    new = ScanState(anchor=anchor, read=read, k=nk, v=nv, G=nG, beta=nb, committed=count,
                    n_flush=flushes, state_indices=state.state_indices)
    if not _finite(y, new, pair):
        _name_the_overflow(state, q, k, v, log_a, beta, pair, seed, layer, valid, exact)
    return y, new


def _finite(y, new: ScanState, pair) -> bool:
    """Whether the outputs and the roles after the segment are finite: one host read. An anchor
    or read copy that overflowed at a flush (an FP16 role past 65504) leaves both non-finite
    (the chain carries it to the segment's end)."""
    roles = [pair.anchor.fmt.dequantize(new.anchor)]
    if new.read is not None:
        roles.append(pair.read.fmt.dequantize(new.read))
    return bool(torch.stack([torch.isfinite(t).all() for t in (y, *roles)]).all())


def _name_the_overflow(state, q, k, v, log_a, beta, pair, seed, layer, valid, exact):
    """The error of a segment whose result is not finite: a non-finite input, else the flush
    whose cast overflowed, named by the torch reference run on the same segment (it checks every
    flush); a reference that finds none leaves a kernel defect."""
    chunk_ref.check_inputs_finite(layer, (q, k, v, log_a, beta), valid)
    chunk_ref.chunk_scan_ref(state, q, k, v, log_a, beta, pair=pair, seed=seed, layer=layer,
                             valid=valid, exact=exact)
    raise RuntimeError(f"layer {layer}: the Triton chunk kernel's outputs or state after this "
                       f"segment are not finite where its torch reference's are (pair "
                       f"{pair.label()}): a kernel defect; run with REPLAYQUANT_BACKEND=torch "
                       f"to go on, and report it")


def _launch(events, name, kernel, grid, *args, **kw):
    """kernel[grid](*args, **kw), between two CUDA events appended to `events` as (name, start,
    end) where events is a list."""
    if events is None:
        kernel[grid](*args, **kw)
        return
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    kernel[grid](*args, **kw)
    b.record()
    events.append((name, a, b))


def _launch_groups(state, pair, tok, q, k, v, log_a, beta, anchor, read, m, full, W, seed, layer,
                   exact, precompute_sr_bits, pass_events):
    """chunk_scan's launches over windows 0..W in groups of G (`group_windows`): pass 1
    (terms), the sequential chain, the casts of the read copies (a split pair or exact) and the
    outputs. Writes the new anchor / read copy into `anchor` / `read`; returns (y, the buffer
    entries left after the segment: k, v, G, beta)."""
    B, T, H, dk = q.shape
    dv, dev, buffer_len = v.shape[-1], q.device, state.buffer_len
    f32, i64 = torch.float32, torch.int64
    delta, vec = beta is not None, state.vector_gate
    q, k, v, log_a = (x.contiguous() for x in (q, k, v, log_a))
    beta = None if beta is None else beta.contiguous()
    shared = read is None
    Aout = _role_args(anchor)
    Rout = _role_args(read if read is not None else anchor)
    y = _empty((B, T, H, dv), f32, dev)
    nk = _empty((B, H, buffer_len, dk), f32, dev)
    nv = _empty((B, H, buffer_len, dv), f32, dev)
    nG = _empty((B, H, buffer_len, dk) if vec else (B, H, buffer_len), f32, dev)
    nb = _empty((B, H, buffer_len), f32, dev) if delta else None
    bk, bv, bG = (t.to(f32).contiguous() for t in (state.k, state.v, state.G))
    bb = state.beta.to(f32).contiguous() if delta else None
    h0k = state.committed.to(device=dev, dtype=torch.int32).contiguous()
    nfl = state.n_flush.to(device=dev, dtype=i64).contiguous()
    seq = state.state_indices.to(device=dev, dtype=i64).contiguous()
    nw = (-(-m // buffer_len)).to(torch.int32).contiguous()
    nfu = full.to(torch.int32).contiguous()
    cfg = chunk_launch_config(pair, B, H, dv, dk, buffer_len, device_sms(dev))
    buffer_tile = cfg["buffer_tile"]
    klo, khi = split_key(layer_seed(seed, layer))
    BH, width = B * H, W * buffer_len
    asr = pair.anchor.rounding == "stochastic"
    pre = bool(precompute_sr_bits and asr and not exact)
    G = min(group_windows(BH, dk, dv, buffer_tile, delta, pre, vec), W + 1)
    split = bool(cfg["chain_split"]) and not exact
    sc = _Scratch(state, pair, BH, G, dk, dv, buffer_tile, delta, vec, pre, split, exact, dev)
    cons = dict(H=H, DK=dk, DV=dv, BUFFER_LEN=buffer_len, BUFFER_TILE=buffer_tile, EXACT=bool(exact),
                PREC=options.get().chunk_dot)
    rsr = pair.read_spec.rounding == "stochastic"
    events = pass_events if (pass_events is not None and dev.type == "cuda") else None
    launch = functools.partial(_launch, events)
    with cpu_threads(dev):
        for w0 in range(0, W + 1, G):          # windows 0..W: window W holds no entry
            n = min(G, W + 1 - w0)
            if w0 > 0:
                sc.Xs[:, 0].copy_(sc.Xs[:, G])  # the checkpoint of the group's first window
                if split:
                    sc.Mx.zero_()
                    sc.Cn.zero_()
            launch("terms", _terms_kernel, (n, BH),
                tok, q, k, v, log_a, beta if delta else log_a, bk, bv, bG, bb if delta else bG,
                h0k, nfu, sc.Kw, sc.Ww, sc.Pw, sc.QLw, sc.Gw, sc.Uw, sc.Cw, nk, nv, nG,
                nb if delta else nG, sc.Rb, nfl, seq, T, width, w0, G, klo, khi, BV=cfg["terms_bv"],
                DELTA=delta, PRE=pre, VEC=vec, num_warps=cfg["terms_warps"], **cons)
            launch("chain", _chain_kernel, (BH, dv // cfg["chain_rows"]),
                tok, y, nfl, seq, nw, nfu, sc.Kw, sc.Ww, sc.QLw, sc.Gw, sc.Uw, sc.Xs, sc.As,
                *Aout[:3], sc.Rb, sc.Mx, sc.Cn, sc.err, T, width, w0, G, klo, khi, SPIN_LIMIT,
                BV=cfg["chain_bv"], NRB=cfg["chain_rows"] // cfg["chain_bv"],
                AFMT=Aout[3], ASR=asr, SHARED=shared, DELTA=delta, PRE=pre, SPLIT=split,
                VEC=vec, num_warps=cfg["chain_warps"], **cons)
            if exact or not shared:
                launch("cast", _cast_kernel, (n, BH),
                    nfl, seq, nw, nfu, sc.Xs, *Aout[:3], *Rout[:3], w0, G, klo, khi,
                    H=H, DK=dk, DV=dv, BV=cfg["cast_bv"], AFMT=Aout[3], ASR=asr, RFMT=Rout[3],
                    RSR=rsr, SHARED=shared, EXACT=bool(exact), num_warps=cfg["cast_warps"])
            launch("output", _output_kernel, (n, BH),
                tok, y, nw, nfu, sc.Pw, sc.Cw, sc.Xs, T, width, w0, G,
                BV=cfg["out_bv"], num_warps=cfg["out_warps"], **cons)
    if split and int(sc.err.item()):             # one host sync, split NVFP4 chains only
        raise RuntimeError(
            f"the split NVFP4 chain's {cfg['chain_split']} programs per matrix were not all "
            f"resident at once ({BH} matrices), so the amax exchange timed out and this call's "
            f"result is wrong; set REPLAYQUANT_NVFP4_CHAIN_SPLIT=0 (or run it inside "
            f"replayquant.options.override(nvfp4_chain_split=0): the two-pass chain) and run "
            f"it again")
    return y, nk, nv, nG, nb


def teacher_force(st, q, k, v, log_a, beta=None, *, valid=None, exact: bool = False):
    """`chunk_ref.teacher_force` through the Triton kernel: run a segment through ReplayState st
    (in place) -> y [B, T, H, d_v]."""
    return chunk_ref.teacher_force(st, q, k, v, log_a, beta, valid=valid, exact=exact,
                                   scan=chunk_scan)
