"""Replay decode step (ReplaySSM) in Triton: one launch for the whole batch, the flush decided
per sequence inside the kernel (DESIGN sections 3 and 4; `ReplayState` is the specification).

Storage of one layer (`ReplayStore`; slots N, value heads H, key heads / groups HK):

    anchor      PackedRole [N, H, d_v, d_k]     high precision, written only at a flush
    read copy   PackedRole [N, H, d_v, d_k]     low precision, physically packed (None: shared pair)
    kbuf        bf16 [N, C, HK, d_k]            raw k (GDN, re-normalised on read) / B (Mamba-2)
    vbuf        bf16 [N, C, H, d_v]             raw v (GDN) / x (Mamba-2; v = dt x on read)
    ubuf        u_dtype [N, C, H, d_v]          GDN: u computed against the read copy (outputs only)
    Gbuf        fp32 [N, C, H]                  cumulative log gate since the checkpoint
    bbuf        fp32 [N, C, H]                  GDN: beta; Mamba-2: dt
    committed   int32 [N]                       committed buffer entries h (0..L)
    start       int32 [N]                       ring position of the window's first entry
    n_flush     int64 [N]                       flush index of the current anchor (0 = initial cast)

The buffer is a ring of C = L + max_drafts entries: entry j of the window lives at position
(start + j) mod C. When committed entries are flushed just before new entries are appended in
the same launch (h + T > L after a speculative accept), the new window starts after the old
entries, so no program overwrites an entry that another program of the row is still folding.

One step for a row with slot s (the same rule as `ReplayState.step`):

* h == L (left so by a speculative accept): flush the h committed entries first.
* append this step at slot h. If h + 1 == L (or `force_flush`): **flush** — rebuild the unrounded
  FP32 state from the dequantized anchor and the entries (GDN: u recomputed from the anchor by the
  triangular solve), output S q, then anchor <- Q_anchor(S) and read <- Q_read(S), each cast
  independently from S with its own SR stream. Nothing is written to the buffer.
* otherwise **read step**: output from the packed read copy (decoded in registers, never written
  back as FP32) and the buffer, output-only (no d_v x d_k matrix formed); write this step's entry.

The kernels read `committed` and `n_flush` and never write them (other programs of the same row
read them in the same launch): `advance_pointers` moves them afterwards, once per decode step.
At small batch (launch='fused', resolve_launch) a step is one launch: `_replay_fused_kernel` runs
the flush and read bodies per program, and with advance the last program of each row (arrival
counter `ReplayStore.arrive`) moves that row's pointers, after every program of the row has read
them; the same results as the split launch, bit for bit (tests).
An NVFP4 read copy beside an FP32 anchor (FLUSH_DEFER_NV) is cast after the flush, from the
anchor it wrote (S itself), by `_read_cast_kernel`: the flush then runs on row blocks, not whole
matrices (an NVFP4 role has one FP32 scale per matrix).
A model with several layers shares one pair of pointer tensors between its layers' stores and
advances them once per token (`replay_step(..., advance=False)` for all but the last layer).

`replay_step_ref` (torch) has the same signature and effect; tests compare the two, and both
against `ReplayState`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional import (_into, _program_tile, PackedRole, _check_inputs, _front_end,
                                              ConventionalStore, conventional_gdn_step,
                                              conventional_mamba2_step,
                                              _front_math, _gate_out, _gate_z, _indices, _l2norm,
                                              _pow2_dims, _prep,
                                              _rank1_step, _tile_load, _tile_store, _nv_store,
                                              _role_bits,
                                              NO_DT_LIMIT, dt_limit_args,
                                              gdn_frontend_ref, mamba2_frontend_ref,
                                              mamba2_post_ref, role_streams, small_block,
                                              split_key)
from replayquant.kernels.quant import (decode_bf16, decode_fp16, small_float_at,
                                       small_float_pair_at)
from replayquant.streams import ANCHOR, READ, layer_seed

__all__ = ["ReplayStore", "replay_gdn_step", "replay_gdn_step_ref", "replay_mamba2_step",
           "replay_mamba2_step_ref", "advance_pointers", "advance_pointers_ref",
           "choose_path", "resolve_path", "flush_is_lossless", "replay_launch_config",
           "choose_launch", "resolve_launch", "resolve_read_variant"]


def _pair_roles(pair):
    """(anchor (fmt, rounding), read (fmt, rounding) or None, L) of a PrecisionPair or name."""
    from replayquant.pairs import PrecisionPair
    if isinstance(pair, str):
        pair = PrecisionPair.load(pair)
    if not isinstance(pair, PrecisionPair):
        raise ValueError(f"pair must be a PrecisionPair or a pair name, got {type(pair).__name__}")
    anchor = (pair.anchor.format, pair.anchor.rounding)
    read = None if pair.read is None else (pair.read.format, pair.read.rounding)
    return anchor, read, pair.buffer_len


@dataclass
class ReplayStore:
    """Replay state of one layer for N slots (module docstring for the layout)."""

    kind: str
    anchor: PackedRole
    read: PackedRole | None
    L: int
    key_heads: int
    kbuf: torch.Tensor
    vbuf: torch.Tensor
    ubuf: torch.Tensor | None
    Gbuf: torch.Tensor
    bbuf: torch.Tensor
    committed: torch.Tensor
    n_flush: torch.Tensor
    key: int
    start: torch.Tensor | None = None
    max_drafts: int = 0
    pending_T: int | None = None     # drafts verified and not yet accepted
    last_force: bool = False         # path of the last step: True = it flushed every row (force)
    arrive: torch.Tensor | None = None   # int32 [N]: arrival counters of launch='fused' (zero)
    # host knowledge, never read from the GPU: True only while no slot has buffered entries
    # (committed == 0 everywhere), as from_state leaves it and forced steps keep it; a replay
    # step or a verify clears it. Code that writes committed itself must clear it.
    buffers_empty: bool = False

    @property
    def capacity(self) -> int:
        return self.L + self.max_drafts

    @classmethod
    def from_state(cls, initial: torch.Tensor, pair, kind: str, key_heads: int | None = None,
                   seed: int = 0, layer: int = 0, u_dtype=torch.bfloat16,
                   buffer_len: int | None = None, max_drafts: int = 0) -> "ReplayStore":
        """Cast float32 initial [N, H, d_v, d_k] into anchor and read copy (flush index 0,
        independently, as ReplayState), empty buffers. key_heads: GDN key heads / Mamba-2
        groups (default H). max_drafts: the largest T of speculative verify (0: plain decode)."""
        if kind not in ("gdn", "mamba2"):
            raise ValueError(f"kind must be 'gdn' or 'mamba2', got {kind!r}")
        if not isinstance(initial, torch.Tensor) or initial.dim() != 4 or not initial.is_floating_point():
            raise ValueError("initial state must be a float tensor [slots, heads, d_v, d_k]")
        (afmt, arnd), read, L = _pair_roles(pair)
        if buffer_len is not None:
            L = int(buffer_len)
        if L < 1:
            raise ValueError(f"buffer_len must be >= 1, got {L}")
        N, H, dv, dk = initial.shape
        HK = H if key_heads is None else int(key_heads)
        if HK < 1 or H % HK:
            raise ValueError(f"key_heads={HK} must divide the {H} heads")
        _pow2_dims(initial.shape)
        dev = initial.device
        key = layer_seed(seed, layer)
        slots = torch.arange(N)
        x = initial.float()
        anchor = PackedRole.empty(afmt, arnd, tuple(initial.shape), dev)
        anchor.write_(slots, x, key, role_streams(0, ANCHOR, slots, H))
        rrole = None
        if read is not None:
            rrole = PackedRole.empty(read[0], read[1], tuple(initial.shape), dev)
            rrole.write_(slots, x, key, role_streams(0, READ, slots, H))
        if u_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("u_dtype must be torch.bfloat16 or torch.float32")
        if max_drafts < 0 or max_drafts > L:
            raise ValueError(f"max_drafts={max_drafts} must lie in 0..buffer_len={L}")
        bf = torch.bfloat16
        C = L + int(max_drafts)
        return cls(kind, anchor, rrole, L, HK,
                   kbuf=torch.zeros(N, C, HK, dk, dtype=bf, device=dev),
                   vbuf=torch.zeros(N, C, H, dv, dtype=bf, device=dev),
                   ubuf=torch.zeros(N, C, H, dv, dtype=u_dtype, device=dev) if kind == "gdn" else None,
                   Gbuf=torch.zeros(N, C, H, dtype=torch.float32, device=dev),
                   bbuf=torch.zeros(N, C, H, dtype=torch.float32, device=dev),
                   committed=torch.zeros(N, dtype=torch.int32, device=dev),
                   n_flush=torch.zeros(N, dtype=torch.int64, device=dev), key=key,
                   start=torch.zeros(N, dtype=torch.int32, device=dev), max_drafts=int(max_drafts),
                   arrive=torch.zeros(N, dtype=torch.int32, device=dev), buffers_empty=True)

    @property
    def shape(self):
        return self.anchor.shape

    @property
    def shared(self) -> bool:
        return self.read is None

    @property
    def read_role(self) -> PackedRole:
        return self.anchor if self.read is None else self.read

    def clone(self) -> "ReplayStore":
        c = lambda t: None if t is None else t.clone()  # noqa: E731
        return ReplayStore(self.kind, self.anchor.clone(), None if self.read is None else self.read.clone(),
                           self.L, self.key_heads, c(self.kbuf), c(self.vbuf), c(self.ubuf),
                           c(self.Gbuf), c(self.bbuf), c(self.committed), c(self.n_flush), self.key,
                           c(self.start), self.max_drafts, self.pending_T, self.last_force,
                           c(self.arrive), self.buffers_empty)


# ============================================================================ Triton

@triton.jit
def _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk, rows, cols, jj, n,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  CAP: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
                  WANT_U: tl.constexpr, NO_K: tl.constexpr = False):
    """Buffer entries 0..n-1 of one (slot, head) as float32 tiles (rows >= n are zero):
    K [LP, DK] (GDN: re-normalised; NO_K: not loaded, 0), X [LP, BV] (GDN: raw v or u when
    WANT_U; Mamba-2: v = dt x), G [LP] cumulative log gate, Bt [LP] (beta / dt)."""
    m = jj < n
    e = _entry(slot, start, jj, CAP)
    if NO_K:
        K = 0.0
    else:
        K = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cols[None, :], mask=m[:, None],
                    other=0.0).to(tl.float32)
        if DELTA:
            if L2NORM:
                K = K * (1.0 / tl.sqrt(tl.sum(K * K, axis=1) + 1e-6))[:, None]
    G = tl.load(Gbuf + e * HV + hv, mask=m, other=0.0)
    Bt = tl.load(bbuf + e * HV + hv, mask=m, other=0.0)
    X = _entries_x(vbuf, ubuf, e, m, hv, rows, Bt, HV, DV, DELTA, WANT_U)
    return K, X, G, Bt


@triton.jit
def _entries_x(vbuf, ubuf, e, m, hv, rows, Bt, HV: tl.constexpr, DV: tl.constexpr,
               DELTA: tl.constexpr, WANT_U: tl.constexpr):
    """X [LP, BV] of _load_entries for the buffer entries e where m (elsewhere 0): GDN raw v, or
    u when WANT_U; Mamba-2 v = dt x (Bt the entries' dt)."""
    if WANT_U:
        X = tl.load(ubuf + (e[:, None] * HV + hv) * DV + rows[None, :], mask=m[:, None],
                    other=0.0).to(tl.float32)
    else:
        X = tl.load(vbuf + (e[:, None] * HV + hv) * DV + rows[None, :], mask=m[:, None],
                    other=0.0).to(tl.float32)
        if not DELTA:
            X = Bt[:, None] * X
    return X


@triton.jit
def _entry(slot, start, j, CAP: tl.constexpr):
    return slot * CAP + (start + j) % CAP


@triton.jit
def _entry_in(kbuf, vbuf, Gbuf, bbuf, e, hv, hk, rows, cols, HK: tl.constexpr, HV: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr):
    k = tl.load(kbuf + (e * HK + hk) * DK + cols)
    v = tl.load(vbuf + (e * HV + hv) * DV + rows)
    return k, v, tl.load(Gbuf + e * HV + hv), tl.load(bbuf + e * HV + hv)


@triton.jit
def _fold(S, kbuf, vbuf, Gbuf, bbuf, slot, start, hv, hk, rows, cols, n, Gfin,
          HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
          CAP: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr):
    """Fold the n buffered entries into S, one FMA pass per entry (entry j + 1 is loaded while
    entry j is folded).
    GDN (DELTA; S = the dequantized anchor, Gfin unused): the recurrence a_j = exp(G_j - G_{j-1}),
    u_j = beta_j (v_j - a_j S k_j), S <- a_j S + u_j k_j^T; equal to core.rebuild (the triangular
    solve against the anchor) within float32 reassociation.
    Mamba-2 (S = exp(Gfin) deq(A) on entry): S + sum_j exp(Gfin - G_j) (dt_j x_j) B_j^T,
    core.rebuild's closed form."""
    Gprev = 0.0
    kn, vn, Gn, bn = _entry_in(kbuf, vbuf, Gbuf, bbuf, _entry(slot, start, 0, CAP), hv, hk, rows,
                               cols, HK, HV, DK, DV)
    for j in range(0, n):
        k = kn.to(tl.float32)              # GDN k / Mamba-2 B
        v = vn.to(tl.float32)              # GDN v / Mamba-2 x
        G = Gn
        g2 = bn                            # GDN beta / Mamba-2 dt
        kn, vn, Gn, bn = _entry_in(kbuf, vbuf, Gbuf, bbuf,
                                   _entry(slot, start, tl.minimum(j + 1, n - 1), CAP), hv, hk,
                                   rows, cols, HK, HV, DK, DV)
        if DELTA:
            # k / |k| as a factor r on the products: its reduction does not wait for S, so
            # the entry's chain holds one reduction (S k), not two
            r = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6) if L2NORM else 1.0
            S = S * tl.exp(G - Gprev)
            u = g2 * (v - tl.sum(S * k[None, :], axis=1) * r)
            S = S + (u * r)[:, None] * k[None, :]
            Gprev = G
        else:
            w = tl.exp(Gfin - G)
            S = S + (w * (g2 * v))[:, None] * k[None, :]
    return S


@triton.jit
def _last_G(Gbuf, slot, start, h, hv, HV: tl.constexpr, CAP: tl.constexpr):
    """Cumulative log gate of entry h - 1 (0 when h == 0: no load, so a forced Mamba-2 flush
    does not wait on the buffer after its pointers)."""
    e = _entry(slot, start, tl.maximum(h - 1, 0), CAP)
    return tl.load(Gbuf + e * HV + hv, mask=h > 0, other=0.0)


@triton.jit
def _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, fi,
                 slot, hv, amx, DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr,
                 AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
                 SHARED: tl.constexpr, DEFER: tl.constexpr):
    """anchor <- Q_anchor(S), read <- Q_read(S): two independent casts of the same S.
    DEFER (an NVFP4 read copy beside an FP32 anchor, which is S itself): the read copy is left
    to _read_cast_kernel, which casts it from the anchor; this block's max |S| goes to amx."""
    _tile_store(S, A_pay, A_sc, A_gs, mat, rows, cols, key_lo, key_hi, fi, slot, hv,
                DV, DK, BV, AFMT, ASR, 0)
    if not SHARED:
        if DEFER:
            tl.store(amx, tl.max(tl.max(tl.abs(S), axis=1), axis=0))
        else:
            _tile_store(S, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi, fi, slot, hv,
                        DV, DK, BV, RFMT, RSR, 1)


@triton.jit
def _flush_flags(h, T: tl.constexpr, L: tl.constexpr, STEP: tl.constexpr):
    """A row's flushes at committed fill h (a scalar or a block), the one definition that the
    flush, plan, read, cast and pointer code share: (pre, fill). pre: the committed entries
    would not leave T free slots (h + T > L, h > 0; T = 1 in a step), so they fold into the
    anchor first; fill: in a step (STEP), the step's entry fills the buffer (h + 1 == L, from
    the fill left after pre). A forced step flushes whatever these say."""
    pre = (h + T > L) & (h > 0)
    fill = pre & (h < 0)                        # False, shaped as h
    if STEP:
        fill = tl.where(pre, 0, h) + 1 == L
    return pre, fill


@triton.jit
def _flush_body(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        kbuf, vbuf, Gbuf, bbuf, h_ptr, st_ptr, nf_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, FORCE: tl.constexpr, dt_lo, dt_hi, row, hv, hk, rows, cols, slot,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr,
        STEP: tl.constexpr, AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr,
        RSR: tl.constexpr, SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        DT_CLAMP: tl.constexpr, amx_ptr=None, DEFER: tl.constexpr = False):
    """What _replay_flush_kernel does for one live row's program (slot >= 0): the flushes of
    that row (pre-flush of committed entries that would not leave T free slots, and the flush of
    a step that fills the buffer or is forced); nothing for a row that does not flush.
    FORCE (a forced step, path='flush': every row flushes) with a shared pair (the small-batch
    dispatch of resolve_path): every live row flushes, so its inputs and anchor tile are loaded
    before the pointers, as the conventional step loads them (one dependent global load less
    before the state arrives); reloaded only after a pre-flush rewrote the anchor. Not with a
    separate read copy: holding the early tile across the pre-flush made those variants spill
    (ptxas, sm_90a: GDN tp8_hi32 364 bytes), and the dispatcher never forces them."""
    mat = slot * HV + hv
    amx = amx_ptr
    if DEFER:       # this block's entry of the row's amax scratch ([B, HV, DV / BV])
        amx = amx_ptr + (row * HV + hv) * (DV // BV) + tl.min(rows, axis=0) // BV
    EARLY: tl.constexpr = FORCE and STEP and SHARED
    if EARLY:
        q, k, v, log_a, beta, skip = _front_end(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk, rows,
            cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D,
            DT_CLAMP)
        A0 = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
    h = tl.load(h_ptr + slot)
    start = tl.load(st_ptr + slot)
    nf = tl.load(nf_ptr + slot)
    pre, fill = _flush_flags(h, T, L, STEP)
    if pre:
        if EARLY:
            A = A0                      # the same anchor tile, already loaded
        else:
            A = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
        if DELTA:
            S = _fold(A, kbuf, vbuf, Gbuf, bbuf, slot, start, hv, hk, rows, cols, h, 0.0,
                      HK, HV, DK, DV, CAP, DELTA, L2NORM)
        else:
            Gn = _last_G(Gbuf, slot, start, h, hv, HV, CAP)
            S = _fold(tl.exp(Gn) * A, kbuf, vbuf, Gbuf, bbuf, slot, start, hv, hk,
                      rows, cols, h, Gn, HK, HV, DK, DV, CAP, DELTA, L2NORM)
        _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo, key_hi,
                     nf + 1, slot, hv, amx, DV, DK, BV, AFMT, ASR, RFMT, RSR, SHARED, DEFER)
        nf = nf + 1
        start = (start + h) % CAP
        h = h * 0
        if STEP:
            tl.debug_barrier()      # a second flush below re-reads the anchor just written
    if STEP:
        if fill | FORCE:
            if EARLY:
                A = A0
                if pre:                 # the pre-flush above rewrote the anchor
                    A = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
            else:
                q, k, v, log_a, beta, skip = _front_end(
                    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk,
                    rows, cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB,
                    HAS_D, DT_CLAMP)
                A = _tile_load(A_pay, A_sc, A_gs, mat, rows, cols, DV, DK, BV, AFMT)
            if DELTA:
                S = _fold(A, kbuf, vbuf, Gbuf, bbuf, slot, start, hv, hk, rows, cols, h, 0.0,
                          HK, HV, DK, DV, CAP, DELTA, L2NORM)
                S, y = _rank1_step(S, q, k, v, log_a, beta, DELTA)   # h = 0: the conventional step
            else:
                Gf = _last_G(Gbuf, slot, start, h, hv, HV, CAP) + log_a
                S = _fold(A * tl.exp(Gf), kbuf, vbuf, Gbuf, bbuf, slot, start, hv, hk,
                          rows, cols, h, Gf, HK, HV, DK, DV, CAP, DELTA, L2NORM)
                S = S + v[:, None] * k[None, :]
                y = tl.sum(S * q[None, :], axis=1)
            _store_roles(S, A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, mat, rows, cols, key_lo,
                         key_hi, nf + 1, slot, hv, amx, DV, DK, BV, AFMT, ASR, RFMT, RSR, SHARED,
                         DEFER)
            y = _gate_out(y + skip, z_ptr, row, hv, rows, HV, DV, HAS_Z)
            tl.store(out_ptr + (row * HV + hv) * DV + rows, y)


@triton.jit
def _flush_plan_kernel(idx_ptr, h_ptr, list_ptr, n_ptr, B, L: tl.constexpr, T: tl.constexpr,
                       STEP: tl.constexpr, CH: tl.constexpr):
    """The rows that _replay_flush_kernel has work for (padding rows, pre-flushes, and in a step
    the rows whose entry fills the buffer), in batch order: list_ptr[:n], n = n_ptr[0]. One
    program, CH rows at a time."""
    base = 0
    for c0 in range(0, B, CH):
        r = c0 + tl.arange(0, CH)
        inb = r < B
        slot = tl.load(idx_ptr + r, mask=inb, other=0)
        h = tl.load(h_ptr + slot, mask=inb & (slot >= 0), other=0)
        pre, fill = _flush_flags(h, T, L, STEP)
        need = ((slot < 0) | pre | fill) & inb
        cum = tl.cumsum(need.to(tl.int32), axis=0)
        tl.store(list_ptr + base + cum - 1, r, mask=need)
        base += tl.sum(need.to(tl.int32), axis=0)
    tl.store(n_ptr, base)


@triton.jit
def _flush_program(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        kbuf, vbuf, Gbuf, bbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, dt_lo, dt_hi, row, hg,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr,
        STEP: tl.constexpr, AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr,
        RSR: tl.constexpr, SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        DT_CLAMP: tl.constexpr, FORCE: tl.constexpr, nt, NH: tl.constexpr, b0, amx_ptr,
        DEFER: tl.constexpr):
    """One work item of _replay_flush_kernel: value heads hg * NH .. of batch row `row`, nt row
    blocks of each from block b0 on (nt a constexpr, or chosen on the device)."""
    slot = tl.load(idx_ptr + row).to(tl.int64)
    cols = tl.arange(0, DK)
    for ih in range(NH):
        hv = hg * NH + ih
        hk = hv // (HV // HK)
        for i in range(nt):
            rows = (b0 + i) * BV + tl.arange(0, BV)
            if slot >= 0:
                _flush_body(A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, Gbuf, bbuf, h_ptr,
                            st_ptr, nf_ptr, out_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr,
                            dtb_ptr, D_ptr, z_ptr, scale, key_lo, key_hi, FORCE, dt_lo, dt_hi,
                            row, hv, hk, rows, cols, slot, HK, HV, DK, DV, BV, L, CAP, T, STEP,
                            AFMT, ASR, RFMT, RSR, SHARED, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z,
                            DT_CLAMP, amx_ptr, DEFER)
            else:
                for t in tl.static_range(T):      # padding rows: zero outputs, nothing else
                    tl.store(out_ptr + ((row * T + t) * HV + hv) * DV + rows,
                             tl.zeros([BV], tl.float32))


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi"])
def _replay_flush_kernel(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        kbuf, vbuf, Gbuf, bbuf, h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, dt_lo, dt_hi, list_ptr, n_ptr, amx_ptr,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr,
        STEP: tl.constexpr, AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr,
        RSR: tl.constexpr, SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        DT_CLAMP: tl.constexpr, FORCE: tl.constexpr, NT: tl.constexpr, NH: tl.constexpr = 1,
        LIST: tl.constexpr = False, DYN: tl.constexpr = False, DYN_MIN: tl.constexpr = 0,
        DEFER: tl.constexpr = False):
    """The flushing rows of a step / verify: (1) committed entries that would not leave T free
    slots (h + T > L, h > 0) are folded into the anchor first; (2) a step whose entry fills the
    buffer (h + 1 == L, or force) rebuilds through it, outputs S q and casts both roles.
    Work items: NH consecutive value heads of a batch row (each with NT consecutive row blocks of
    its matrix, one after the other). Without LIST one program per item (grid B * HV / NH):
    programs of rows that do not flush read the pointers and return. With LIST (the rows of
    _flush_plan_kernel's list, list_ptr[:n_ptr[0]]) each program loops over the items of the
    listed rows, item pid, pid + programs, ...: a step in which few rows flush launches a few
    programs per SM, not one per matrix that has nothing to do.
    DYN (LIST, NT every block of a matrix): the blocks per item chosen here from the listed
    items, all NT blocks of a matrix in one item from DYN_MIN items on, else NT items of one
    block each.
    DEFER (LIST; an NVFP4 read copy beside an FP32 anchor): blocks of any rows; each flushed
    block writes the anchor and its max |S| (amx_ptr), and _read_cast_kernel, launched next,
    writes the read copy."""
    pid = tl.program_id(0)
    PER: tl.constexpr = HV // NH
    if LIST:
        n = tl.load(n_ptr) * PER
        per_block = False
        if DYN:
            per_block = n < DYN_MIN
        if per_block:               # an item per block of the NT blocks of a matrix
            for it in range(pid, n * NT, tl.num_programs(0)):
                w = it // NT
                _flush_program(A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, Gbuf, bbuf,
                               h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr, v_ptr,
                               a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, key_lo, key_hi,
                               dt_lo, dt_hi, tl.load(list_ptr + w // PER), w % PER, HK, HV,
                               DK, DV, BV, L, CAP, T, STEP, AFMT, ASR, RFMT, RSR, SHARED, DELTA,
                               L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP, FORCE, 1, NH, it % NT,
                               amx_ptr, DEFER)
        else:
            for it in range(pid, n, tl.num_programs(0)):
                _flush_program(A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, Gbuf, bbuf,
                               h_ptr, st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr, v_ptr,
                               a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, key_lo, key_hi,
                               dt_lo, dt_hi, tl.load(list_ptr + it // PER), it % PER, HK, HV,
                               DK, DV, BV, L, CAP, T, STEP, AFMT, ASR, RFMT, RSR, SHARED, DELTA,
                               L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP, FORCE, NT, NH,
                               tl.program_id(1) * NT, amx_ptr, DEFER)
    else:
        _flush_program(A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, Gbuf, bbuf, h_ptr,
                       st_ptr, nf_ptr, idx_ptr, out_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr,
                       A_ptr, dtb_ptr, D_ptr, z_ptr, scale, key_lo, key_hi, dt_lo, dt_hi,
                       pid // PER, pid % PER, HK, HV, DK, DV, BV, L, CAP, T, STEP, AFMT, ASR,
                       RFMT, RSR, SHARED, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP, FORCE,
                       NT, NH, tl.program_id(1) * NT, amx_ptr, DEFER)


@triton.jit(do_not_specialize=["key_lo", "key_hi"])
def _read_cast_kernel(A_pay, R_pay, R_sc, R_gs, h_ptr, nf_ptr, idx_ptr, list_ptr, n_ptr, amx_ptr,
                      key_lo, key_hi, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BV: tl.constexpr, L: tl.constexpr, T: tl.constexpr, STEP: tl.constexpr,
                      RSR: tl.constexpr):
    """The NVFP4 read copy of the blocks that _replay_flush_kernel (DEFER) flushed, from the FP32
    anchor it wrote (S itself) and the matrix's max |S| over its blocks (amx_ptr): the same
    bits as casting S in the flush, with the flush's stochastic-rounding stream (flush index
    of the row's last flush in that launch). Items: (listed row, value head, row block)."""
    NB: tl.constexpr = DV // BV
    cols = tl.arange(0, DK)
    for it in range(tl.program_id(0), tl.load(n_ptr) * (HV * NB), tl.num_programs(0)):
        w = it // NB
        row = tl.load(list_ptr + w // HV)
        hv = w % HV
        slot = tl.load(idx_ptr + row).to(tl.int64)
        if slot >= 0:
            pre, fill = _flush_flags(tl.load(h_ptr + slot), T, L, STEP)
            if pre | fill:
                fi = tl.load(nf_ptr + slot) + pre.to(tl.int32) + fill.to(tl.int32)
                mat = slot * HV + hv
                rows = (it % NB) * BV + tl.arange(0, BV)
                offs = rows[:, None] * DK + cols[None, :]
                x = tl.load(A_pay + mat * (DV * DK) + offs)
                amax = tl.max(tl.load(amx_ptr + (row * HV + hv) * NB + tl.arange(0, NB)),
                              axis=0)
                rb = _role_bits(offs, RSR, key_lo, key_hi, fi, 1, slot, hv)
                _nv_store(x, amax, R_pay, R_sc, R_gs, mat, rows, rb, DV, DK, BV, RSR)


@triton.jit
def _tile_raw(pay, sc, mat, rows, r0, ok, DV: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr,
              BV: tl.constexpr, RW: tl.constexpr):
    """The loads of the read copy's rows `rows`, not decoded (what a row-block loop carries as
    its prefetch): (payload, scales); rows = r0 + arange(BV). NVFP4: int32 words [BV, DK/8]
    (word w holds the E2M1 codes of columns 8w..8w+7, column 8w+i in bits 4i..4i+3) and the E4M3
    block scale byte of each word [BV, DK/8]; FP8: int32 words [BV, DK/4] (column 4w+i in byte
    i) and the row scales [BV]; FP32 / FP16 / BF16: the stored values [BV, DK], or with RW < DK
    as [DK / RW, BV, RW], scales a dummy. Codes packed four or eight to a register keep the
    payload (and a prefetch of it) in few registers.
    ok False (a scalar): nothing loaded."""
    if FMT == 4:
        NW: tl.constexpr = DK // 8
        w = tl.arange(0, NW)
        words = pay.to(tl.pointer_type(tl.int32))
        p = tl.load(words + mat * (DV * NW) + rows[:, None] * NW + w[None, :], mask=ok, other=0)
        b = tl.load(sc + mat * (DV * (DK // 16)) + rows[:, None] * (DK // 16) + (w // 2)[None, :],
                    mask=ok, other=0)
    elif FMT == 3:
        NW: tl.constexpr = DK // 4
        w = tl.arange(0, NW)
        words = pay.to(tl.pointer_type(tl.int32))
        p = tl.load(words + mat * (DV * NW) + rows[:, None] * NW + w[None, :], mask=ok, other=0)
        b = tl.load(sc + mat * DV + rows, mask=ok, other=0.0)
    else:
        if RW == DK:
            cols = tl.arange(0, DK)
            p = tl.load(pay + mat * (DV * DK) + rows[:, None] * DK + cols[None, :], mask=ok,
                        other=0)
        else:
            # [DK / RW, BV, RW]: element [a, r, c] is column a * RW + c of row r0 + r, loaded as
            # BV * DK / RW pieces of RW contiguous columns, piece a * BV + r. RW / 4 lanes share
            # a piece; as BV is a multiple of the 32 * 4 / RW pieces that one load instruction
            # covers, all pieces of a row sit in one lane group, so the reshape moves no data and
            # a row's sums end in log2(RW / 4) shuffle rounds, not the five of a 128-column row
            # on all 32 lanes (RW = DK). (A 3-D load [DK / RW, BV, RW] would leave it to the
            # compiler which of the two non-contiguous dimensions gets the lanes: Triton 3.6
            # and 3.9 choose differently.)
            A: tl.constexpr = DK // RW
            pc = tl.arange(0, A * BV)
            c = tl.arange(0, RW)
            off = (pc % BV) * DK + (pc // BV) * RW
            p = tl.load(pay + mat * (DV * DK) + r0 * DK + off[:, None] + c[None, :], mask=ok,
                        other=0)
            p = tl.reshape(p, (A, BV, RW))
        b = tl.zeros([1], tl.float32)
    return p, b


@triton.jit
def _nib_pair(p, I: tl.constexpr, xa, xb, ya, yb, TWO: tl.constexpr, ax=None, ay=None):
    """Accumulators (ax, ay) plus the E2M1 codes I and I + 4 of the words p (decoded as a pair,
    small_float_pair_at) times the columns they hold, xa and xb (and ya, yb with TWO)."""
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
    ax += hi * xb[None, :]                  # one fused multiply-add per code and vector
    if TWO:
        ay += hi * yb[None, :]
    return ax, ay


@triton.jit
def _split4(x, N: tl.constexpr):
    """x [4N] -> its elements 4w, 4w+1, 4w+2, 4w+3 as four [N] vectors."""
    e, o = tl.split(tl.reshape(x, (N, 2, 2)))
    x0, x2 = tl.split(e)
    x1, x3 = tl.split(o)
    return x0, x1, x2, x3


@triton.jit
def _tile_mv(p, b, s, x, y, TWO: tl.constexpr, DK: tl.constexpr, FMT: tl.constexpr,
             RW: tl.constexpr):
    """(read copy) @ x and, with TWO, (read copy) @ y, for x, y [DK] float32, from _tile_raw's
    loads (s: the NVFP4 matrix scale), decoding each code once, in registers, as it is used;
    without TWO the second value is the first. NVFP4: sums over each word's 8 columns, times
    the word's block scale, summed over the row, times the matrix scale (and the decode's 2^14);
    FP8: the row's sum times its scale (and 2^8)."""
    if FMT == 4:
        NW: tl.constexpr = DK // 8
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
        NW: tl.constexpr = DK // 4
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
    else:
        if FMT == 0:
            T = p
        elif FMT == 1:
            T = decode_fp16(p)
        else:
            T = decode_bf16(p)
        rx = _row_dot(T, x, DK, RW)
        ry = rx
        if TWO:
            ry = _row_dot(T, y, DK, RW)
    return rx, ry


@triton.jit
def _pick(X2, tt, t):
    """Row t of a float32 [TP, N] tile of a verify's drafts (tt = arange(TP)), exactly: the
    other rows are replaced by -0.0, which adds nothing (not even to a -0.0)."""
    return tl.sum(tl.where((tt == t)[:, None], X2, -0.0), axis=0)


@triton.jit
def _pick1(x2, tt, t):
    """Element t of a [TP] vector of a verify's drafts, as _pick."""
    return tl.sum(tl.where(tt == t, x2, -0.0), axis=0)


@triton.jit
def _row_dot(T, x, DK: tl.constexpr, RW: tl.constexpr):
    """Row sums of T * x for a 16- / 32-bit tile of _tile_raw: [BV, DK], or [DK / RW, BV, RW]."""
    if RW == DK:
        r = tl.sum(T * x[None, :], axis=1)
    else:
        r = tl.sum(tl.sum(T * tl.reshape(x, (DK // RW, RW))[:, None, :], axis=0), axis=1)
    return r


@triton.jit
def _read_body(
        R_pay, R_sc, R_gs,
        kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, FORCE: tl.constexpr, dt_lo, dt_hi, row, hv, hk, rows, cols, slot,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, LP: tl.constexpr, T: tl.constexpr,
        STEP: tl.constexpr, RFMT: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, U_BF16: tl.constexpr,
        DT_CLAMP: tl.constexpr, dots_ptr=None, DOTS: tl.constexpr = False, NT: tl.constexpr = 1,
        RW: tl.constexpr = 32, TP: tl.constexpr = 1, PRE: tl.constexpr = False):
    """What _replay_read_kernel does for one live row's program (slot >= 0): nothing for a row
    that flushes this step, else the outputs of its T entries and their appends, for NT blocks of
    BV rows from `rows` on, one after the other (the loads of the next block, read copy and u
    entries, issued before the products of this one). DOTS: the per-entry dot products k_j.k
    (GDN) and k_j.q of each draft come from _entry_dots_kernel (dots_ptr [B, HK, T, 2, LP])
    instead of the buffer's k entries. RW: _tile_raw's row width of a 16- / 32-bit read copy
    (both kernels pass _row_width's; the default only keeps the keyword order).
    PRE (a verify, VERIFY_PRELOAD): every draft's inputs (and dot products) are loaded at once,
    as [TP, ...] tiles (TP: T rounded up to a power of two), before the pointers: the draft loop
    stores outputs and entries, and a load after a store cannot be moved above it (the compiler
    cannot tell that the pointers do not alias), so loads inside the loop cost one memory round
    trip per draft."""
    jj = tl.arange(0, LP)
    if PRE:
        tt = tl.arange(0, TP)
        okt = tt < T
        tok2 = row * T + tt
        Q2 = tl.load(q_ptr + (tok2[:, None] * HK + hk) * DK + cols[None, :], mask=okt[:, None],
                     other=0.0).to(tl.float32)
        K2 = tl.load(k_ptr + (tok2[:, None] * HK + hk) * DK + cols[None, :], mask=okt[:, None],
                     other=0.0).to(tl.float32)
        A2 = tl.load(a_ptr + tok2 * HV + hv, mask=okt, other=0.0).to(tl.float32)
        B2 = A2
        if DELTA:
            B2 = tl.load(b_ptr + tok2 * HV + hv, mask=okt, other=0.0).to(tl.float32)
        if DOTS:
            d2 = dots_ptr + (((row * HK + hk) * T + tt) * 2 * LP)[:, None] + jj[None, :]
            DK2 = tl.load(d2, mask=okt[:, None], other=0.0)
            DQ2 = tl.load(d2 + LP, mask=okt[:, None], other=0.0)
    mat = slot * HV + hv
    # issued before the pointers are known: one dependent load less on the critical path
    # (wasted only on rows that flush this step)
    r0 = tl.program_id(1) * (BV * NT)                  # rows = r0 + arange(BV) (_program_tile)
    P, Sb = _tile_raw(R_pay, R_sc, mat, rows, r0, True, DV, DK, RFMT, BV, RW)
    s = 1.0
    if RFMT == 4:
        s = tl.load(R_gs + mat)
    h = tl.load(h_ptr + slot)
    start = tl.load(st_ptr + slot)
    pre, fill = _flush_flags(h, T, L, STEP)
    if pre:                            # flushed by _replay_flush_kernel
        start = (start + h) % CAP
        h = h * 0
    go = True
    if STEP:
        go = (~fill) & (not FORCE)
    if go:
        K0, X, G0, Bt = _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk, rows,
                                      cols, jj, h, HK, HV, DK, DV, CAP, DELTA, L2NORM, DELTA, DOTS)
        e0 = _entry(slot, start, jj, CAP)
        Gp0 = tl.sum(tl.where(jj == h - 1, G0, 0.0), axis=0)     # the last committed gate
        for ib in range(NT):
            rb = rows + ib * BV
            more = ib + 1 < NT
            Pc, Sc = P, Sb
            # the next block's read copy and u entries (GDN; Mamba-2: v entries)
            P, Sb = _tile_raw(R_pay, R_sc, mat, rb + BV, r0 + (ib + 1) * BV, more, DV, DK, RFMT,
                              BV, RW)
            Xn = _entries_x(vbuf, ubuf, e0, (jj < h) & more, hv, rb + BV, Bt, HV, DV, DELTA,
                            DELTA)
            K = K0
            G = G0
            Gp = Gp0
            if PRE:
                X2 = tl.load(v_ptr + (tok2[:, None] * HV + hv) * DV + rb[None, :],
                             mask=okt[:, None], other=0.0).to(tl.float32)
                if HAS_Z:
                    Z2 = tl.load(z_ptr + (tok2[:, None] * HV + hv) * DV + rb[None, :],
                                 mask=okt[:, None], other=0.0).to(tl.float32)
            for t in tl.static_range(T):
                tok = row * T + t
                if PRE:
                    xraw = _pick(X2, tt, t)
                    kraw = _pick(K2, tt, t)
                    q, k, v, log_a, beta, skip = _front_math(
                        _pick(Q2, tt, t), kraw, xraw, _pick1(A2, tt, t), _pick1(B2, tt, t),
                        A_ptr, dtb_ptr, D_ptr, hv, scale, dt_lo, dt_hi, DELTA, L2NORM, HAS_DTB,
                        HAS_D, DT_CLAMP)
                else:
                    q, k, v, log_a, beta, skip = _front_end(
                        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, tok, hv, hk,
                        rb, cols, scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB,
                        HAS_D, DT_CLAMP)
                p = h + t
                Gp = Gp + log_a
                prev = jj < p
                wdec = tl.where(prev, tl.exp(tl.where(prev, Gp - G, 0.0)), 0.0)
                eG = tl.exp(Gp)
                if DELTA:
                    rk, rq = _tile_mv(Pc, Sc, s, k, q, True, DK, RFMT, RW)
                    if DOTS:
                        if PRE:
                            kk = _pick(DK2, tt, t)
                        else:
                            kk = tl.load(dots_ptr + ((row * HK + hk) * T + t) * 2 * LP + jj)
                    else:
                        kk = tl.sum(K * k[None, :], axis=1)
                    corr = tl.sum((wdec * kk)[:, None] * X, axis=0)
                    u = beta * (v - eG * rk) - beta * corr
                    if U_BF16:
                        u = u.to(tl.bfloat16).to(tl.float32)
                else:
                    rq, _ = _tile_mv(Pc, Sc, s, q, q, False, DK, RFMT, RW)
                    u = v
                if DOTS:
                    if PRE:
                        qk = _pick(DQ2, tt, t)
                    else:
                        qk = tl.load(dots_ptr + (((row * HK + hk) * T + t) * 2 + 1) * LP + jj)
                else:
                    qk = tl.sum(K * q[None, :], axis=1)
                y = eG * rq + tl.sum((wdec * qk)[:, None] * X, axis=0) + tl.sum(k * q, axis=0) * u
                if PRE:
                    y = y + skip
                    if HAS_Z:
                        y = _gate_z(y, _pick(Z2, tt, t))
                else:
                    y = _gate_out(y + skip, z_ptr, tok, hv, rb, HV, DV, HAS_Z)
                tl.store(out_ptr + (tok * HV + hv) * DV + rb, y)
                # append entry p (raw inputs in bf16, gates in fp32, GDN u)
                e = _entry(slot, start, p, CAP)
                if T > 1:
                    cur = jj == p
                    if not DOTS:
                        K = tl.where(cur[:, None], k[None, :], K)
                    X = tl.where(cur[:, None], u[None, :], X)
                    G = tl.where(cur, Gp, G)
                if not PRE:
                    xraw = tl.load(v_ptr + (tok * HV + hv) * DV + rb)
                tl.store(vbuf + (e * HV + hv) * DV + rb, xraw.to(tl.bfloat16))
                if DELTA:
                    tl.store(ubuf + (e * HV + hv) * DV + rb, u.to(ubuf.dtype.element_ty))
                if (tl.program_id(1) == 0) & (ib == 0):   # one row block writes the head's entries
                    tl.store(Gbuf + e * HV + hv, Gp)
                    tl.store(bbuf + e * HV + hv, beta)
                    if hv % (HV // HK) == 0:
                        if not PRE:
                            kraw = tl.load(k_ptr + (tok * HK + hk) * DK + cols)
                        tl.store(kbuf + (e * HK + hk) * DK + cols, kraw.to(tl.bfloat16))
            X = Xn


@triton.jit
def _entry_dots_kernel(kbuf, h_ptr, st_ptr, idx_ptr, q_ptr, k_ptr, dots_ptr, scale,
                       HK: tl.constexpr, DK: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr,
                       LP: tl.constexpr, T: tl.constexpr, DELTA: tl.constexpr,
                       L2NORM: tl.constexpr):
    """read_variant='dots' (a decode step, T = 1, or a verify of T drafts), launched before the
    read kernel: one program per (row, key head) forms the per-entry dot products of the
    buffer's committed k entries, and of the drafts before draft t, with draft t's k (GDN) and q,
    dots [B, HK, T, 2, LP] (0 past those entries), so that the read programs of the key head's
    value heads and row blocks load 2 x LP floats per draft instead of the [LP, DK] k entries
    (registers, and the K-side work repeated per program). Same expressions as _load_entries /
    _front_end / _read_body."""
    pid = tl.program_id(0)
    row = pid // HK
    hk = pid % HK
    cols = tl.arange(0, DK)
    jj = tl.arange(0, LP)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    if slot >= 0:
        h = tl.load(h_ptr + slot)
        start = tl.load(st_ptr + slot)
        pre, _ = _flush_flags(h, T, L, False)
        if pre:                            # flushed by _replay_flush_kernel
            start = (start + h) % CAP
            h = h * 0
        m = jj < h
        e = slot * CAP + (start + jj) % CAP
        K = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cols[None, :], mask=m[:, None],
                    other=0.0).to(tl.float32)
        if DELTA:
            if L2NORM:
                K = K * (1.0 / tl.sqrt(tl.sum(K * K, axis=1) + 1e-6))[:, None]
        for t in tl.static_range(T):
            tok = row * T + t
            q = tl.load(q_ptr + (tok * HK + hk) * DK + cols).to(tl.float32)
            k = tl.load(k_ptr + (tok * HK + hk) * DK + cols).to(tl.float32)
            o = dots_ptr + ((row * HK + hk) * T + t) * 2 * LP + jj
            if DELTA:
                if L2NORM:
                    q = _l2norm(q)
                    k = _l2norm(k)
                q = q * scale
                tl.store(o, tl.sum(K * k[None, :], axis=1))
            tl.store(o + LP, tl.sum(K * q[None, :], axis=1))
            if T > 1:                       # draft t is entry h + t of the drafts after it
                K = tl.where((jj == h + t)[:, None], k[None, :], K)


@triton.jit
def _replay_read_kernel(
        R_pay, R_sc, R_gs,
        kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, dt_lo, dt_hi, dots_ptr,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, LP: tl.constexpr, T: tl.constexpr,
        STEP: tl.constexpr, RFMT: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, U_BF16: tl.constexpr,
        DT_CLAMP: tl.constexpr, DOTS: tl.constexpr, NT: tl.constexpr, RW: tl.constexpr,
        TP: tl.constexpr, PRE: tl.constexpr):
    """The non-flushing rows (after _replay_flush_kernel in a verify; beside it, on the caller's
    stream while the flush runs on its side stream, in a CUDA decode step): outputs of T
    entries from the packed read copy and the buffer, output-only, and their appends
    (read_variant 'block'; 'dots' (DOTS) takes the per-entry dot products from
    _entry_dots_kernel). A program takes NT blocks of BV rows of its matrix, one after the
    other. Never launched for a forced step (every row flushes)."""
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV, NT)
    if slot >= 0:
        _read_body(R_pay, R_sc, R_gs, kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, out_ptr,
                   q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, False,
                   dt_lo, dt_hi, row, hv, hk, rows, cols, slot, HK, HV, DK, DV, BV, L, CAP, LP, T,
                   STEP, RFMT, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, U_BF16, DT_CLAMP, dots_ptr,
                   DOTS, NT, RW, TP, PRE)


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi"])
def _replay_fused_kernel(
        A_pay, A_sc, A_gs, R_pay, R_sc, R_gs,
        kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, nf_ptr, cnt_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, dt_lo, dt_hi,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, L: tl.constexpr, CAP: tl.constexpr, LP: tl.constexpr,
        AFMT: tl.constexpr, ASR: tl.constexpr, RFMT: tl.constexpr, RSR: tl.constexpr,
        SHARED: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr, HAS_DTB: tl.constexpr,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, U_BF16: tl.constexpr, DT_CLAMP: tl.constexpr,
        ADVANCE: tl.constexpr, FORCE: tl.constexpr, RW: tl.constexpr):
    """A decode step (T = 1) in one launch (launch='fused', the small-batch path): each program
    runs what _replay_flush_kernel and then _replay_read_kernel would run for its (row, value
    head, row block), so a row either flushes or reads (and appends). A pre-flush (h == L after a
    speculative accept) writes the rows of the read copy that the same program reads next (the
    flush body ends it with a block barrier); the flush and read blocks are therefore the same.
    With ADVANCE the pointer kernel is folded in: every program of a row, once done with the
    row's pointers, increments the row's arrival counter; the last one moves committed / start /
    n_flush (_moved_pointers) and resets the counter, so no program reads a moved pointer."""
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
    if slot >= 0:
        _flush_body(A_pay, A_sc, A_gs, R_pay, R_sc, R_gs, kbuf, vbuf, Gbuf, bbuf, h_ptr, st_ptr,
                    nf_ptr, out_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr,
                    z_ptr, scale, key_lo, key_hi, FORCE, dt_lo, dt_hi, row, hv, hk, rows, cols,
                    slot, HK, HV, DK, DV, BV, L, CAP, 1, True, AFMT, ASR, RFMT, RSR, SHARED,
                    DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, DT_CLAMP)
        _read_body(R_pay, R_sc, R_gs, kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, out_ptr,
                   q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr, scale, FORCE,
                   dt_lo, dt_hi, row, hv, hk, rows, cols, slot, HK, HV, DK, DV, BV, L, CAP, LP, 1,
                   True, RFMT, DELTA, L2NORM, HAS_DTB, HAS_D, HAS_Z, U_BF16, DT_CLAMP, RW=RW)
        if ADVANCE:
            tl.debug_barrier()                  # every thread of the program is past its loads
            arrived = tl.atomic_add(cnt_ptr + slot, 1)          # acq_rel, gpu scope
            if arrived == HV * (DV // BV) - 1:                  # the row's last program
                h, st, nf = _moved_pointers(tl.load(h_ptr + slot), tl.load(st_ptr + slot),
                                            tl.load(nf_ptr + slot), FORCE, L, CAP, 1, True)
                tl.store(h_ptr + slot, h)
                tl.store(st_ptr + slot, st)
                tl.store(nf_ptr + slot, nf)
                tl.store(cnt_ptr + slot, 0)
    else:
        tl.store(out_ptr + (row * HV + hv) * DV + rows, tl.zeros([BV], tl.float32))


@triton.jit
def _moved_pointers(h, st, nf, force, L: tl.constexpr, CAP: tl.constexpr, T: tl.constexpr,
                    STEP: tl.constexpr):
    """(committed, start, n_flush) after a step (STEP) or a verify of T drafts, from the values
    the kernels read (scalars or blocks): the kernels' flush decisions."""
    pre, fill = _flush_flags(h, T, L, STEP)
    nf = tl.where(pre, nf + 1, nf)
    st = tl.where(pre, (st + h) % CAP, st)
    h = tl.where(pre, 0, h)
    if STEP:
        fl = fill | (force != 0)
        nf = tl.where(fl, nf + 1, nf)
        h = tl.where(fl, 0, h + 1)
    return h, st, nf


@triton.jit
def _advance_kernel(h_ptr, st_ptr, nf_ptr, idx_ptr, acc_ptr, B, L: tl.constexpr,
                    CAP: tl.constexpr, T: tl.constexpr,
                    STEP: tl.constexpr, force, HAS_ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Pointer moves after a step / verify launch (the kernels' decisions), or after accept."""
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
        h, st, nf = _moved_pointers(h, st, nf, force, L, CAP, T, STEP)
    tl.store(h_ptr + s, h, mask=ok)
    tl.store(st_ptr + s, st, mask=ok)
    tl.store(nf_ptr + s, nf, mask=ok)


def _default_force(store, step, accepted, force_flush):
    if force_flush is None:     # the path the last step of this store took (resolve_path)
        return bool(store.last_force) if step and accepted is None else False
    return bool(force_flush)


def advance_pointers(store: ReplayStore, state_indices, T: int = 1, step: bool = True,
                     force_flush: bool | None = None, accepted=None):
    """Move committed / n_flush after a step (step=True) or a verify of T drafts (step=False),
    or after accept (accepted: int tensor [B] of accepted drafts). force_flush None: the path
    the store's last step took (a step with path 'auto' may have flushed every row)."""
    force_flush = _default_force(store, step, accepted, force_flush)
    B = state_indices.shape[0]
    idx = _indices(state_indices, B, store.committed.device)
    acc = None
    if accepted is not None:
        acc = accepted.to(device=idx.device, dtype=torch.int32).contiguous()
    BLOCK = 256
    _advance_kernel[(triton.cdiv(B, BLOCK),)](
        store.committed, store.start, store.n_flush, idx, acc if acc is not None else idx, B,
        L=store.L, CAP=store.capacity, T=T,
        STEP=step, force=int(force_flush), HAS_ACC=acc is not None, BLOCK=BLOCK)


def advance_pointers_ref(store: ReplayStore, state_indices, T: int = 1, step: bool = True,
                         force_flush: bool | None = None, accepted=None):
    force_flush = _default_force(store, step, accepted, force_flush)
    idx = _indices(state_indices, state_indices.shape[0], store.committed.device).long()
    for b, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        h, nf, st = int(store.committed[s]), int(store.n_flush[s]), int(store.start[s])
        if accepted is not None:
            h += int(accepted[b])
        else:
            if h + T > store.L and h > 0:
                nf, st, h = nf + 1, (st + h) % store.capacity, 0
            if step:
                if h + 1 == store.L or force_flush:
                    nf, h = nf + 1, 0
                else:
                    h += 1
        store.committed[s] = h
        store.n_flush[s] = nf
        store.start[s] = st


# ============================================================================ host side

# read kernel block of read_variant='dots' in a decode step: (rows, warps, row blocks per
# program), by (kind, read copy format). H200, B = 256, 'dots' read step (h = L/2), us by config
# (read copies loaded as packed words, next block prefetched), best of 12 configs (rows 16 / 32
# / 64, 1-4 warps, 1-8 blocks):
# GDN FP32 (16, 1, 8) 170.1 (16, 1, 1: 200.1), FP8 (32, 1, 4) 123.6 (16, 1, 1: 137.0), NVFP4
# (32, 1, 1) 128.3 (16, 1, 1: 215.0); Mamba-2 FP32 (16, 1, 4) 301.1 (16, 1, 1: 319.9), FP8
# (32, 1, 1) 164.0 (216.0), NVFP4 (32, 1, 1) 175.8 (255.3). FP16 / BF16 read copies: not
# measured, FP32's.
DOTS_BLOCK = {("gdn", "fp32"): (16, 1, 8), ("gdn", "fp8"): (32, 1, 4), ("gdn", "nvfp4"): (32, 1, 1),
              ("mamba2", "fp32"): (16, 1, 4), ("mamba2", "fp8"): (32, 1, 1),
              ("mamba2", "nvfp4"): (32, 1, 1)}
# read kernel block of a verify (T > 1 drafts), by (kind, read variant, read copy format). H200,
# T = 4, the bench's speculative round (verify + accept, L = 16 / 8) by config (16, 1, 1) (16, 2, 1)
# (16, 1, 2) (32, 1, 1) (32, 2, 1): the
# 'dots' read at B = 512, us, (16, 1, 1) -> best: GDN FP32 1293.6 -> 1189.5 (32, 1, 1), FP8
# 1237.2 -> 1109.8, NVFP4 1708.3 -> 1249.5; Mamba-2 1573.5 -> 1535.0, 1827.8 -> 1693.5, 2435.9 ->
# 1675.0, all (32, 1, 1). The block read at B = 32 (the size rule's (16, 2, 1) -> best): GDN FP32
# 185.9 -> 150.5 (16, 1, 1; (32, 1, 1) 195.1), FP8 212.2 -> 135.3 (32, 1, 1), NVFP4 209.1 -> 131.7
# (32, 1, 1); Mamba-2 239.7 -> 161.9, 226.0 -> 148.5, 302.3 -> 141.5, all (32, 1, 1). Two row
# blocks per program were slower in every cell. FP16 / BF16 read copies: FP32's, not measured.
VERIFY_BLOCK = {("gdn", "block", "fp32"): (16, 1, 1)}
VERIFY_BLOCK_DEFAULT = (32, 1, 1)


# Columns of a row that one lane group holds side by side in the read kernel's 16- / 32-bit read
# copy tiles (_tile_raw): RW / 4 lanes per row, so each row's sums end in log2(RW / 4) shuffle
# rounds; RW = d_k (128) spreads a row over all 32 lanes (5 rounds). Capped at d_k. By decode
# step, and by (kind, read variant) of a verify. H200, s32_rs, RW 128 / 32 / 16: the
# 'dots' T = 4 round at B = 512, us: GDN 1189.4 / 1013.0 / 1038.5, Mamba-2 1534.9 / 1472.5 /
# 1485.4, and the block-read round GDN 1891.2 / 1918.9 / 1945.8, Mamba-2 2150.7 / 1821.3 /
# 1814.0; the 'dots' read step at B = 256 lost (GDN 169.4 / 176.9 / 181.5, Mamba-2 298.0 / 309.4 /
# 316.4: the x vectors' copies per lane raise the registers from 127 to ~235, halving the
# programs per SM of a bandwidth-bound read). With RW 32 for every verify the grid put GDN's
# block-read round at B = 32 (its default read there) at 103.6 us without flushes, against 93.8
# with RW = d_k, so GDN's block verify keeps RW = d_k.
READ_ROW_WIDTH = {"step": 128, ("verify", "gdn", "dots"): 32, ("verify", "gdn", "block"): 128,
                  ("verify", "mamba2", "dots"): 32, ("verify", "mamba2", "block"): 32}


def _row_width(dk: int, T: int, kind: str, variant: str) -> int:
    """The read kernel's RW for a step (T = 1) or a verify of T drafts with this read variant."""
    rw = READ_ROW_WIDTH["step"] if T == 1 else READ_ROW_WIDTH[("verify", kind, variant)]
    return min(rw, dk)


def _measured_block(kind: str, variant: str, fmt: str, T: int):
    """The read kernel's measured (rows, warps, row blocks) for this read: VERIFY_BLOCK's for a
    verify (T > 1), DOTS_BLOCK's for a 'dots' step, None for a block-read step (size rule)."""
    fmt = fmt if fmt in ("fp8", "nvfp4") else "fp32"         # FP16 / BF16: FP32's
    if T != 1:
        return VERIFY_BLOCK.get((kind, variant, fmt), VERIFY_BLOCK_DEFAULT)
    return DOTS_BLOCK[(kind, fmt)] if variant == "dots" else None


def replay_launch_config(store: ReplayStore, n_rows: int, block_v=None, num_warps=None,
                         flush_config=None, read_variant: str = "block", read_blocks=None,
                         T: int = 1, defer: bool = False):
    """((BV, warps, row blocks per program) of the read kernel, (BV, warps) of the flush
    kernel), from the shape, the read variant and the drafts T (1: a decode step; a verify of
    T > 1 drafts takes VERIFY_BLOCK's, either read variant). The read
    kernel takes any row block (NVFP4 block scales run along d_k); the flush kernel holds whole
    matrices when it writes an NVFP4 role (one FP32 scale per matrix), unless that role is a
    read copy whose cast is deferred to _read_cast_kernel (defer: see FLUSH_DEFER_NV)."""
    N, H, dv, dk = store.shape
    measured = _measured_block(store.kind, read_variant, store.read_role.fmt, T)
    if block_v is None and measured is not None:
        bv, nw, nt = measured
        block_v = min(dv, bv)
        num_warps = nw if num_warps is None else num_warps
        read_blocks = min(nt, dv // block_v) if read_blocks is None else read_blocks
    if block_v is None:
        block_v = min(dv, 32 if n_rows * H >= 2048 else 16)
    if dv % block_v or block_v & (block_v - 1) or block_v < 1:
        raise ValueError(f"block_v={block_v} must be a power of two dividing d_v={dv}")
    if num_warps is None:
        num_warps = max(1, min(8, block_v * dk // 1024))
    read_blocks = 1 if read_blocks is None else int(read_blocks)
    if read_blocks < 1 or (dv // block_v) % read_blocks:
        raise ValueError(f"read_blocks={read_blocks} must divide the {dv // block_v} blocks of "
                         f"{block_v} rows of a matrix")
    nv = _has_nvfp4(store) and not defer
    fbv, fnw = flush_config if flush_config is not None else (None, None)
    if fbv is None:
        if nv:
            fbv = dv
        elif n_rows * H >= 1024:
            fbv, fw = FLUSH_BLOCK[(store.kind, store.shared)]
            fbv, fnw = min(dv, fbv), fw if fnw is None else fnw
        else:       # latency-bound (batch 1): the conventional kernel's small blocks
            fbv, small_warps = small_block(n_rows * H, dv)
            fnw = small_warps if fnw is None else fnw
    if nv and fbv != dv:
        raise ValueError("an NVFP4 role is written a whole matrix at a time here (the flush "
                         "casts it; see FLUSH_DEFER_NV): the flush block must be d_v")
    if dv % fbv or fbv & (fbv - 1):
        raise ValueError(f"flush block {fbv} must be a power of two dividing d_v={dv}")
    if fnw is None:
        fnw = _flush_warps(fbv, dk)
    return (block_v, num_warps, read_blocks), (fbv, fnw)


# flush kernel block (rows, warps) from 1024 state matrices, by (kind, shared pair), for pairs
# without an NVFP4 role (whole matrices). H200, B = 256, replay flush step (h = L - 1), us by
# block (16, 1) / (16, 2) / (32, 4) / (64, 8):
# GDN s32_rs 876 / 992 / 1039 / 1094, tp8_hi32 1024 / 1200 / 1228 / 1697; Mamba-2 s32_rs
# 829 / 1071 / 1049 / 975, tp8_hi32 1391 / 1257 / 1264 / 1233. Mamba-2 tp8_hi32 takes (16, 1)
# all the same: its whole 'dots' window, flush kernel on its side stream, in phase / staggered,
# measured 348.9 / 363.3 us per step on (16, 1) with NT = 4 against 378.3 / 366.3 on (32, 4)
FLUSH_BLOCK = {("gdn", True): (16, 1), ("gdn", False): (16, 1),
               ("mamba2", True): (16, 1), ("mamba2", False): (16, 1)}


# value heads per flush program when a program holds a whole matrix (an NVFP4 role is written;
# not in a forced step), by (kind, any role with stochastic rounding); 1 elsewhere. In a step
# where a row does not flush, each of its flush programs reads the pointers and returns, but a
# whole-matrix program holds most of an SM's registers while it does. H200, B = 256, NH = 1 / 2 /
# 4 / 8, us: 'dots' read step, flush step, 'dots' window in phase / staggered. GDN tp4_hi16_sr
# read 166.9 / 143.6 / 120.2 / 115.2, flush 1550 / 1563 / 1509 / 1507, windows 255.0 / 257.3
# -> 203.9 / 212.4 at NH = 8; Mamba-2 tp4_hi16_sr read 185.6 -> 154.9, flush 1697 -> 1734,
# windows 373.4 / 391.2 -> 355.0 / 351.0.
# Without stochastic rounding NH > 1 slowed the flush step more than it saved: GDN tp4_hi32
# flush 1534 -> 1694-1740, windows 217.9 / 216.2 -> 217.7 / 238.7 at NH = 8; Mamba-2 tp4_hi32
# flush 1329 -> 2140-2197, windows 319.8 / 324.9 -> 411.6 / 402.0. Measured once each. Only from
# FLUSH_HEADS_MIN matrices (the 8192 of GDN at B = 256; Mamba-2 from B = 64), where it was
# measured: with few rows, NH heads per program leave too few programs (at B = 1, 4 for GDN's
# 32 heads; with NH = 8 at every batch GDN tp4_hi16_sr's batch-1 window ran at 0.197x the
# conventional step's speed, against 0.425x with NH = 1).
# Not with FLUSH_LIST (no programs without work): 8 heads per item there left GDN tp4_hi16_sr's
# staggered window at 228.6 us against 203.1 with one.
FLUSH_HEADS = {("gdn", True): 8, ("mamba2", True): 8}
FLUSH_HEADS_MIN = 8192


# rows from which a one-warp flush program (outside a forced step) takes every row block of its
# matrix, one after the other (NT = d_v / rows); below, one block per program. With few rows
# flushing at a time (rows out of phase, as in serving) the flush's latency is the step's: the
# blocks of a matrix on one program wait for each other. H200, block read, split launch
# (measured once each), window us in phase / staggered, all blocks vs
# one: B = 8 GDN s32_rs 19.2 / 52.2 vs 17.5 / 25.6, tp8_hi32 16.7 / 52.2 vs 13.8 / 18.2, Mamba-2
# s32_rs 20.0 / 32.8 vs 20.7 / 22.0, tp8_hi32 16.8 / 39.1 vs 17.8 / 21.4; B = 32 GDN 44.8 / 114.8
# vs 50.1 / 63.3, 40.4 / 116.7 vs 43.7 / 49.2, Mamba-2 56.7 / 61.8 vs 59.8 / 56.2, 50.3 / 62.7
# vs 52.8 / 53.8; B = 64 GDN 86.3 / 150.0 vs 98.0 / 102.5, 75.2 / 146.1 vs 83.8 / 88.5, Mamba-2
# 101.1 / 100.7 vs 104.9 / 99.7, 96.1 / 95.1 vs 97.8 / 92.4; at B = 256 ('dots') all blocks won
# (GDN s32_rs 204.6 / 203.8 vs 229.9 / 227.4), and at B = 128 ('dots')
# on the mean of the two windows for s32_rs (GDN 117.8 vs 126.5, Mamba-2 175.7 vs 178.0), not
# for tp8_hi32 (98.2 vs 96.1, 135.6 vs 133.0). The speculative round (T = 4, its pre-flushes)
# as well, us, all blocks vs one: B = 8 GDN s32_rs 59.8 vs
# 37.8, tp8_hi32 68.3 vs 38.7, Mamba-2 41.1 vs 38.6, 45.3 vs 37.4; B = 32 GDN 127.8 vs 111.5,
# 131.4 vs 110.6, Mamba-2 123.7 vs 122.7, 130.3 vs 123.1.
FLUSH_ALL_BLOCKS_MIN_ROWS = 128
# By kind, (rows, items): below `rows` rows a decode step's flush (not a verify's: its
# pre-flushes come before its read, so their latency is the round's) counts the listed work
# items (rows that flush x value heads) on the device and gives a one-warp program every block
# of its matrix from `items` items on, one block per item below; the host's rule above
# elsewhere. Rows in phase list them all in one step of L, rows out of phase B / L per step.
# H200, windows us in phase / staggered, host's rule vs the device's choice (block read below
# 128 rows, 'dots' from 128; measured once): GDN s32_rs B = 32
# 50.0 / 63.7 vs 44.8 / 49.7, B = 128 108.3 / 126.1 vs 108.0 / 109.9; tp8_hi32 B = 32 43.9 /
# 49.5 vs 40.6 / 48.9, B = 128 84.0 / 113.9 vs 84.0 / 100.4; B = 64 (one loop with a runtime
# block count) GDN s32_rs 98.2 / 102.8 vs 88.5 / 88.9. At B = 256 the
# device's choice lost staggered (GDN tp8_hi32 167.3 vs 178.1: 16 rows of 32 heads, one block
# each). Mamba-2 mixed at B = 32 (s32_rs 59.5 / 56.4 vs 56.3 / 56.1, tp8_hi32 53.1 / 54.0 vs
# 50.8 / 61.1), within 1% at 128 and 256: the host's rule.
FLUSH_DEVICE_BLOCKS = {"gdn": (256, 1024)}


def _flush_warps(fbv, dk):
    """Warps of a flush program holding fbv x dk state elements."""
    return max(2, min(16, fbv * dk // 1024))


def choose_path(kind: str, n_rows: int, shared: bool = True, threshold: int | None = None) -> str:
    """'replay' or 'flush' (every step flushes: for a shared pair this is the conventional
    read-modify-write on the anchor), by size alone. Measured on the H200 (all rows of a batch in
    the same phase, GDN L = 16, Mamba-2 L = 8): for shared
    pairs the forced flush was faster than the replay window below DISPATCH_THRESHOLD rows (s32_rs,
    us/step incl. the pointer kernel, forced flush vs window: GDN B=1 5.6 vs 8.1, B=32 42.4 vs
    49.6, B=128 160.8 vs 168.1, B=256 343.9 vs 331.3; Mamba-2 B=8 17.4 vs 19.2, B=32 80.1 vs
    69.0); for pairs with a separate read copy the forced flush (which writes both roles every
    step) was never faster (GDN tp4_hi32 B=1 11.1 vs 9.1 us), so they always replay.
    With cold L2 the GDN figures hold: forced flush vs block window B=128 160.7 vs 168.3, B=256
    344.9 vs 331.8 ('dots' window 269.2 at B=256). With the 'dots' read (16-row blocks on one
    warp) the GDN s32_rs window at B=128 is 140.3 us against a forced flush of 169.2 (block
    window 178.2): so the GDN threshold is 128 rows, where 'dots' starts. Mamba-2's 'dots' window
    is below the forced flush at every measured B >= 128.
    This does not look at rounding: `resolve_path` decides whether a switch may be taken."""
    if threshold is None:
        threshold = DISPATCH_THRESHOLD[(kind, bool(shared))]
    return "flush" if n_rows < threshold else "replay"


# rows below which every step flushes (see choose_path for the H200 figures)
DISPATCH_THRESHOLD = {("gdn", True): 128, ("gdn", False): 1,
                      ("mamba2", True): 16, ("mamba2", False): 1}

PATHS = ("auto", "auto_lossy", "replay", "flush")


def flush_is_lossless(store: ReplayStore) -> bool:
    """True when flushing every step adds no rounding: a shared pair whose anchor is FP32 (the
    unrounded FP32 state is its own cast under either rounding; no SR bits are drawn). The state
    then equals the replay schedule's up to FP32 reassociation (DESIGN invariants 1-2), and so do
    the outputs when the GDN u buffer is FP32; with the default bf16 u buffer the replay outputs of
    non-flush steps carry the bf16 rounding of u, the flush path's outputs do not (they are the
    conventional FP32 recurrence, bit for bit)."""
    return store.read is None and store.anchor.fmt == "fp32"


def resolve_path(store: ReplayStore, n_rows: int, path: str = "auto") -> str:
    """The path a step of n_rows rows takes ('replay' or 'flush').

    * 'replay': the ReplayState schedule (flush when the buffer fills).
    * 'flush': every step flushes (committed stays 0, n_flush counts steps); for a shared pair
      this is the conventional read-modify-write, with its roundings.
    * 'auto' (the default of the step functions): 'flush' below choose_path's threshold only
      where that is lossless (flush_is_lossless: shared FP32 anchor, e.g. s32_rs), else 'replay'.
      The flush schedule (committed, n_flush) changes; the state only by FP32 reassociation, the
      outputs also lose the bf16 rounding of a bf16 u buffer (they become the conventional FP32
      step). Pairs with a lossy anchor or a separate read copy always replay.
    * 'auto_lossy': choose_path by size for any shared pair (e.g. f4_sr_rs, s16_sr at small
      batch): this adds a rounding per step, so it changes results; an explicit choice.
    Layers that share pointer tensors must take the same path: resolve it once per token and pass
    it to every layer (each step records its choice for advance_pointers' default)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
    if path == "auto":
        if not flush_is_lossless(store):
            return "replay"
        return choose_path(store.kind, n_rows, True)
    if path == "auto_lossy":
        return choose_path(store.kind, n_rows, store.shared)
    return path


READ_VARIANTS = ("block", "dots")

# rows from which read_variant='auto' (the default of the step functions) reads with 'dots' in a
# split launch (None: never). H200, GDN B = 256,
# L = 16, read step us block / kh / dots: s32_rs 295.7 / 213.2 / 205.2, tp4_hi32 380.3 / 308.4 /
# 259.4; window 350.1 / 272.4 / 269.2 and 454.0 / 384.1 / 341.7. With 16-row 'dots' blocks (the
# default), GDN windows block / dots at B = 128:
# s32_rs 178.2 / 140.3, tp8_hi32 164.6 / 115.6, tp4_hi32 206.2 / 144.8, tp4_hi16_sr 217.8 /
# 156.1; B = 512: 693.4 / 521.5, 654.9 / 454.3, 825.5 / 569.6, 868.5 / 611.3.
# Mamba-2 (L = 8), window us block / dots:
# B = 128 (dots with the 32-row block) s32_rs 251.4 / 228.0, tp8_hi32 229.0 / 215.2, tp4_hi32
# 240.1 / 224.1, tp4_hi16_sr 360.5 / 345.2; B = 256 (dots 16 rows, 1 warp) 499.9 / 440.4,
# 450.6 / 386.6, 472.2 / 413.1, 710.5 / 651.0; with 16-row 'dots' blocks (the default) B = 128:
# 250.6 / 226.8, 227.6 / 196.0, 238.8 / 207.9,
# 358.5 / 327.2; B = 512: 997.4 / 872.2, 890.0 / 757.1, 932.8 / 811.2, 1401.9 / 1276.4.
# Below 128 rows not measured: 'block' there.
DOTS_MIN_ROWS = {"gdn": 128, "mamba2": 128}


def resolve_read_variant(store: ReplayStore, n_rows: int, read_variant: str = "auto",
                         launch: str = "split") -> str:
    """The read kernel of a decode step: read_variant as given, or for 'auto' 'dots' in a split
    launch from DOTS_MIN_ROWS[kind] rows, else 'block' (the fused launch has its own read)."""
    if read_variant != "auto":
        return read_variant or "block"
    m = DOTS_MIN_ROWS.get(store.kind)
    return "dots" if launch == "split" and m is not None and n_rows >= m else "block"
LAUNCHES = ("auto", "split", "fused")

# rows below which a decode step runs as one launch (launch='auto' -> 'fused'), by (kind, any
# NVFP4 role). H200, GDN L = 16, window us/step
# fused vs split: s32_rs B=1 6.3 vs 8.6, B=8 19.2 vs 18.3; tp8_hi32 B=1 5.8 vs 7.8, B=8 17.6 vs
# 17.6; tp4_hi32 B=1 12.8 vs 8.7 (an NVFP4 role makes the fused block a whole matrix: never
# faster). Block read, windows us in phase / staggered, split vs fused, measured once:
# GDN tp8_hi32 B = 8 14.0 / 18.4 vs 12.0 / 16.6, B = 32 43.9 / 49.4
# vs 40.8 / 51.3, B = 64 84.1 / 89.2 vs 77.9 / 91.3; with FLUSH_DEVICE_BLOCKS B = 16
# 23.4 / 32.1 vs 21.4 / 31.5, B = 24 32.3 / 39.6 vs 30.6 / 39.9, B = 32 40.6 / 48.9 (split): so
# GDN without NVFP4 runs the one launch below 32 rows. Mamba-2 tp8_hi32 B = 8 17.8 / 21.4 vs
# 18.8 / 24.1, s32_rs 20.7 / 22.1 vs 22.8 / 22.5: split from 8; tp4_hi32 lost at
# every B, both kinds.
FUSED_THRESHOLD = {("gdn", False): 32, ("gdn", True): 1, ("mamba2", False): 8, ("mamba2", True): 1}


# By kind, the rows from which a flush that writes an NVFP4 read copy beside an FP32 anchor
# runs on the row blocks of the other pairs and leaves the read copy to _read_cast_kernel
# (launched next on the flush's stream, over the same listed rows), which casts it from the
# anchor with the matrix's max |S| that the flush blocks wrote: the same bits as casting S whole
# (one FP32 scale per matrix), which made every NVFP4 flush program hold a whole matrix on 16
# warps. On the GPU the anchor then differs from the whole-matrix flush's within float32
# reassociation of the fold (16-row blocks on one warp), and the read copy by one NVFP4 step
# where that crossed a rounding boundary (GDN B = 64 check: anchor 2.4e-7, outputs 4.6e-4).
# Not in a forced step, the one-launch path or without FLUSH_LIST, nor for other anchors (the
# read copy must be cast from the unrounded S, which only an FP32 anchor keeps). H200, tp4_hi32,
# windows us in phase / staggered, deferred vs whole matrices (measured once each; 'dots' from
# 128 rows, block read below): GDN B = 1 7.4 / 7.4 vs 8.0 / 8.0, B = 8
# 17.6 / 23.3 vs 16.3 / 26.2, B = 32 48.3 / 55.3 vs 50.7 / 64.7, B = 128 79.7 / 81.3 vs 98.6 /
# 98.7, B = 256 150.7 / 165.7 vs 189.1 / 194.6 (flush step 1114.7 vs 1736.6); Mamba-2 B = 32
# 59.1 / 58.5 vs 54.3 / 56.8 (the extra launch: read step 40.1 vs 34.5), B = 64 108.5 / 101.6
# vs 104.8 / 106.7, B = 128 133.8 / 144.5 vs 140.4 / 144.5, B = 256 257.3 / 279.2 vs 273.0 /
# 278.8; verify T = 4 rounds at B = 512 GDN 900.3 vs 1041.5, Mamba-2 1398.0 vs 1439.5. A cast by
# the last flush block of each matrix instead of the extra launch (arrival counters) is slower
# (GDN B = 256 flush step 1272.2, staggered window at B = 8 37.3): one program casting a whole
# matrix is the step's tail.
# Mamba-2 at L = 4, where a flush folds 3 entries, loses to the whole-matrix flush (tp4_hi32
# windows B = 256 359.2 / 410.4 vs 329.9 /
# 337.2, B = 128 188.4 / 208.5 vs 175.9 / 174.4), so Mamba-2 defers from L = 8; a GDN verify at
# B = 32 (T = 2) paid the cast's launch in its rounds without flushes (43.2 vs 36.2 us; with
# flushes 54.7 vs 54.9), so verifies defer from 128 rows (at 256 and 512 the grid shows no loss;
# T = 4 at 512 gained, above). Per kind: the least batch rows of a step and of a verify, the least
# buffer length L.
FLUSH_DEFER_NV = {"gdn": {"rows": 1, "verify_rows": 128, "L": 1},
                  "mamba2": {"rows": 128, "verify_rows": 128, "L": 8}}


def defers_read_cast(store: ReplayStore, rows: int, verify: bool = False) -> bool:
    """Whether a (listed) flush of `rows` batch rows of this store (in a decode step, or before
    a verify's appends) leaves its read copy to _read_cast_kernel (FLUSH_DEFER_NV)."""
    rule = FLUSH_DEFER_NV.get(store.kind)
    if rule is None or store.L < rule["L"]:
        return False
    return (rows >= rule["verify_rows" if verify else "rows"] and store.read is not None
            and store.read.fmt == "nvfp4" and store.anchor.fmt == "fp32")


def _has_nvfp4(store: ReplayStore) -> bool:
    return store.anchor.fmt == "nvfp4" or (store.read is not None and store.read.fmt == "nvfp4")


def choose_launch(kind: str, n_rows: int, threshold: int | None = None, nvfp4: bool = False) -> str:
    """'fused' (one kernel per step: flush or read per row, pointer move folded in) below the
    FUSED_THRESHOLD rows of (kind, nvfp4), else 'split' (flush kernel, read kernel, pointer
    kernel)."""
    if threshold is None:
        threshold = FUSED_THRESHOLD[(kind, bool(nvfp4))]
    return "fused" if n_rows < threshold else "split"


def resolve_launch(store: ReplayStore, n_rows: int, launch: str = "auto",
                   read_variant: str = "block") -> str:
    """The kernels a decode step runs: 'split' (_replay_flush_kernel, then _replay_read_kernel
    with its 'dots' pre-kernel or not, then the pointer kernel when advancing) or 'fused' (one launch,
    _replay_fused_kernel, pointers moved inside it when advancing). 'auto': choose_launch by
    size; read_variant 'dots' is a split-launch read, so 'auto' keeps it split. Both give
    the same results (same arithmetic per element; tests)."""
    if launch not in LAUNCHES:
        raise ValueError(f"launch must be one of {', '.join(map(repr, LAUNCHES))}, got {launch!r}")
    if read_variant == "dots":                  # an explicit split-launch read kernel
        if launch == "fused":
            raise ValueError(f"read_variant={read_variant!r} runs in the split launch "
                             "(launch='split' or 'auto')")
        return "split"
    if launch == "auto":
        return choose_launch(store.kind, n_rows, nvfp4=_has_nvfp4(store))
    return launch


def _launch(store: ReplayStore, q, k, v, a, b, A, dt_bias, D, z, state_indices, out, scale,
            use_qk_l2norm, T, step, force, block_v, num_warps, flush_config=None,
            read_variant=None, dt_limit=None, launch="split", advance=False, read_blocks=None):
    """Launch the step (T = 1) or verify (T drafts) kernels; returns (out, idx, moved): moved
    when the launch already advanced the pointers (launch='fused' with advance). flush_config:
    the flush kernel's (rows, warps), or (rows, warps, NT) to set how many row blocks one flush
    program takes (default: all of its matrix for one-warp blocks outside a forced step from
    FLUSH_ALL_BLOCKS_MIN_ROWS rows, else 1, or chosen on the device by FLUSH_DEVICE_BLOCKS).
    read_blocks: row blocks per read program
    (default: replay_launch_config's)."""
    delta = store.kind == "gdn"
    if launch == "fused" and not (step and T == 1):
        raise ValueError("launch='fused' is the decode step only (T = 1, not verify)")
    if launch == "fused" and read_blocks not in (None, 1):
        raise ValueError("read_blocks sets the split launch's read kernel; launch='fused' runs "
                         "one block per program")
    read_variant = read_variant or "block"
    if read_variant not in READ_VARIANTS:
        raise ValueError(f"read_variant must be one of {READ_VARIANTS}, got {read_variant!r}")
    N, HV, dv, dk = store.shape
    HK = store.key_heads
    lead = (q.shape[0],) if T == 1 and step else (q.shape[0], T)
    if q.dim() != len(lead) + 2:
        raise ValueError(f"{'q' if delta else 'C'} must have shape {list(lead) + [HK, dk]}")
    B = q.shape[0]
    kind = store.kind
    _check_inputs(kind, store.shape, B, {
        "q" if delta else "C": (q, lead + (HK, dk)), "k" if delta else "B": (k, lead + (HK, dk)),
        "v" if delta else "x": (v, lead + (HV, dv)), "a" if delta else "dt": (a, lead + (HV,)),
        "b": (b, lead + (HV,)), "A_log" if delta else "A": (A, (HV,)), "dt_bias": (dt_bias, (HV,)),
        "D": (D, (HV,)), "z": (z, lead + (HV, dv))})
    _check_buffered_bf16(delta, k, v)
    if not step and T > store.max_drafts:
        raise ValueError(f"T={T} drafts, but the store was built with max_drafts="
                         f"{store.max_drafts} (ReplayStore.from_state(..., max_drafts=T))")
    dt_lo, dt_hi, dt_clamp = dt_limit_args(dt_limit)
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(*lead, HV, dv, dtype=torch.float32, device=q.device)
    nt = nh = None
    if flush_config is not None and len(flush_config) == 4:      # (rows, warps, blocks, heads)
        *flush_config, nh = flush_config
    if flush_config is not None and len(flush_config) == 3:      # (rows, warps, row blocks)
        *flush_config, nt = flush_config
    use_list = FLUSH_LIST and not force
    defer = use_list and launch != "fused" and defers_read_cast(store, B, verify=not step)
    (BV, nw, rnt), (FBV, fnw) = replay_launch_config(store, B, block_v, num_warps, flush_config,
                                                     read_variant, read_blocks, T, defer)
    if nt is not None and (nt < 1 or (dv // FBV) % nt):
        raise ValueError(f"flush_config: {nt} row blocks per program must divide the "
                         f"{dv // FBV} blocks of {FBV} rows of a matrix")
    if nh is not None and (nh < 1 or HV % nh):
        raise ValueError(f"flush_config: {nh} heads per program must divide the {HV} value heads")
    Ap, As, Ag, afid = store.anchor.kernel_args()
    Rp, Rs, Rg, rfid = store.read_role.kernel_args()
    ar = store.anchor.rounding == "stochastic"
    rr = store.read_role.rounding == "stochastic"
    q, k, v, a, b, A, dt_bias, D, z = map(_prep, (q, k, v, a, b, A, dt_bias, D, z))
    dummy = a
    ubuf = store.ubuf if store.ubuf is not None else store.vbuf
    inputs = (q, k, v, a, b if b is not None else dummy, A, dt_bias if dt_bias is not None else dummy,
              D if D is not None else dummy, z if z is not None else dummy)
    sc = float(scale if scale is not None else 1.0 / math.sqrt(dk))
    U_BF16 = store.ubuf is not None and store.ubuf.dtype == torch.bfloat16
    LP = max(16, triton.next_power_of_2(store.L))
    if launch == "fused":
        # one block for the flush and the read of a row (a pre-flush writes the rows it reads):
        # the flush block (whole matrices when an NVFP4 role is written); block_v overrides
        fbv, fnw = (block_v, num_warps) if block_v is not None else (FBV, fnw)
        replay_launch_config(store, B, None, None, (fbv, fnw))        # validates the block
        fnw = fnw if fnw is not None else _flush_warps(fbv, dk)
        if store.arrive is None or store.arrive.shape[0] != N:
            store.arrive = torch.zeros(N, dtype=torch.int32, device=store.committed.device)
        _replay_fused_kernel[(B * HV, dv // fbv)](
            Ap, As, Ag, Rp, Rs, Rg, store.kbuf, store.vbuf, ubuf, store.Gbuf, store.bbuf,
            store.committed, store.start, store.n_flush, store.arrive, idx, out, *inputs,
            sc, *split_key(store.key), dt_lo, dt_hi,
            HK=HK, HV=HV, DK=dk, DV=dv, BV=fbv, L=store.L, CAP=store.capacity, LP=LP,
            AFMT=afid, ASR=ar, RFMT=rfid, RSR=rr,
            SHARED=store.shared, DELTA=delta, L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None,
            HAS_D=D is not None, HAS_Z=z is not None, U_BF16=U_BF16, DT_CLAMP=dt_clamp,
            ADVANCE=bool(advance), FORCE=bool(force), RW=_row_width(dk, 1, store.kind, "block"),
            num_warps=fnw)
        return out, idx, bool(advance)
    common = dict(HK=HK, HV=HV, DK=dk, DV=dv, L=store.L, CAP=store.capacity, T=T, STEP=step,
                  RFMT=rfid, DELTA=delta, L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None,
                  HAS_D=D is not None, HAS_Z=z is not None, DT_CLAMP=dt_clamp)
    # a forced step flushes every row: one block per program (batch 1 is latency-bound);
    # otherwise most programs find nothing to do, and a one-warp program takes every block of
    # its matrix (NT), one after the other. With the flush kernel on its side stream that gives
    # the lowest mean of the in-phase and staggered 'dots' windows (H200, B = 256; us per step
    # in phase / staggered at NT = 1 / 2 / 4 / 8):
    # GDN s32_rs 263 / 255, 254 / 279, 247 / 271, 243 / 271; tp8_hi32 235 / 239, 210 / 233,
    # 203 / 230, 200 / 233; Mamba-2 s32_rs (4 blocks) 427 / 387, 392 / 393, 380 / 382.
    # Without the side stream NT = 1 is best staggered (GDN s32_rs 266 vs 321 at NT = 8).
    # Not multi-warp blocks: Mamba-2 tp8_hi32 on (32, 4) blocks, NT = 2 vs 1: flush step
    # 1375 vs 1266 us, 'dots' read step 245.9 vs 246.1
    # Below FLUSH_ALL_BLOCKS_MIN_ROWS rows, one block per program (see there), unless the
    # device chooses (below).
    # a decode step's flush may choose its blocks per item on the device (FLUSH_DEVICE_BLOCKS)
    dev_rows, dev_items = FLUSH_DEVICE_BLOCKS.get(store.kind, (0, 0))
    dyn = (nt is None and use_list and step and fnw == 1 and B < dev_rows and dv // FBV > 1)
    if dyn:
        nt = dv // FBV
    elif nt is None:
        nt = 1 if force or fnw > 1 or B < FLUSH_ALL_BLOCKS_MIN_ROWS else dv // FBV
    if nh is None:
        nh = 1 if force or use_list or FBV != dv or B * HV < FLUSH_HEADS_MIN else \
            math.gcd(FLUSH_HEADS.get((store.kind, ar or rr), 1), HV)
    side = _flush_stream(q, step, T, force)
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        n_prog = B * HV // nh
        lst = cnt = amx = idx                           # any pointers: unused without LIST / defer
        if defer:
            amx = torch.empty(B * HV * (dv // FBV), dtype=torch.float32, device=q.device)
        if use_list:
            lst = torch.empty(B, dtype=torch.int32, device=q.device)
            cnt = torch.empty(1, dtype=torch.int32, device=q.device)
            _flush_plan_kernel[(1,)](idx, store.committed, lst, cnt, B, L=store.L, T=T,
                                     STEP=step, CH=min(1024, triton.next_power_of_2(B)))
            n_prog = _list_programs(n_prog * (nt if dyn else 1), fnw, q.device)
        _replay_flush_kernel[(n_prog, dv // (FBV * nt))](
            Ap, As, Ag, Rp, Rs, Rg, store.kbuf, store.vbuf, store.Gbuf, store.bbuf,
            store.committed, store.start, store.n_flush, idx, out, *inputs,
            sc, *split_key(store.key), dt_lo, dt_hi, lst, cnt, amx, BV=FBV,
            AFMT=afid, ASR=ar, RSR=rr, SHARED=store.shared,
            FORCE=bool(force), NT=nt, NH=nh, LIST=use_list, num_warps=fnw,
            DYN=dyn, DYN_MIN=dev_items if dyn else 0, DEFER=defer,
            **_list_regs(use_list, fnw, q, step), **common)
        if defer:
            _read_cast_kernel[(_list_programs(B * HV * (dv // FBV), 1, q.device),)](
                Ap, Rp, Rs, Rg, store.committed, store.n_flush, idx, lst, cnt, amx,
                *split_key(store.key), HV=HV, DK=dk, DV=dv, BV=FBV, L=store.L, T=T, STEP=step,
                RSR=rr, num_warps=1)
    if not force:
        dots = idx                                      # any pointer: unused unless DOTS
        if read_variant == "dots":
            dots = torch.empty(B, HK, T, 2, LP, dtype=torch.float32, device=q.device)
            _entry_dots_kernel[(B * HK,)](
                store.kbuf, store.committed, store.start, idx, q, k, dots, sc, HK=HK, DK=dk,
                L=store.L, CAP=store.capacity, LP=LP, T=T, DELTA=delta, L2NORM=use_qk_l2norm,
                num_warps=max(1, min(4, LP * dk // 1024)))
        _replay_read_kernel[(B * HV, dv // (BV * rnt))](
            Rp, Rs, Rg, store.kbuf, store.vbuf, ubuf, store.Gbuf, store.bbuf,
            store.committed, store.start, idx, out, *inputs, sc, dt_lo, dt_hi, dots,
            BV=BV, LP=LP, U_BF16=U_BF16, DOTS=read_variant == "dots", NT=rnt,
            RW=_row_width(dk, T, store.kind, read_variant), TP=triton.next_power_of_2(T),
            PRE=T > 1 and VERIFY_PRELOAD, num_warps=nw, **common)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    return out, idx, False


# A verify's read kernel loads every draft's inputs before its draft loop (_read_body, PRE).
# H200, T = 4 round at B = 512 ('dots'), us, with / without (measured once): GDN s32_rs 810.5 /
# 982.5 (snapshot round 2153.3), tp8_hi32 872.7 / 1097.2,
# tp4_hi32 1046.5 / 1201.7; Mamba-2 s32_rs 1182.0 / 1474.7 (snapshot 4071.9), tp8_hi32
# 1454.8 / 1778.4, tp4_hi32 1450.9 / 1698.8. Static SASS (Triton 3.6): s32_rs program GDN
# 4256 -> 4224, Mamba-2 2504 -> 3008 instructions (the picks): the time was the round trips.
# Not for the 'dots' kernel's q and k: preloaded there, the rounds took GDN 869.6, Mamba-2
# 1214.6 (measured apart from the above, not in one A/B).
VERIFY_PRELOAD = True

# Outside a forced step the flush kernel takes the rows _flush_plan_kernel lists (those with
# work: few in most steps) and launches FLUSH_LIST_WARPS_PER_SM warps of programs per SM (each
# looping over the listed rows' items), instead of one program per matrix whose program only
# reads the pointers and returns when its row does not flush. H200, B = 256, 'dots', us, grid /
# list, measured once (16 warps per SM): read step GDN
# s32_rs 167.5 / 157.0, tp4_hi32 128.9 / 98.1, Mamba-2 s32_rs 297.6 / 268.8, tp4_hi32 177.0 /
# 127.5; window in phase / staggered GDN s32_rs 221.1 / 252.9 -> 202.6 / 204.1, tp4_hi32
# 218.3 / 216.2 -> 203.7 / 208.5, tp4_hi16_sr 203.1 / 212.4 -> 189.0 / 202.2; Mamba-2 s32_rs
# 358.1 / 367.8 -> 333.0 / 335.7, tp4_hi32 321.4 / 325.4 -> 293.4 / 298.6, tp4_hi16_sr 355.1 /
# 351.1 -> 332.3 / 342.0. The flush step itself, grid -> list: GDN s32_rs 993.6 -> 868.5,
# tp4_hi32 1537.4 -> 1769.4 (not explained: 128 registers in both), Mamba-2 tp4_hi32 1328.7 ->
# 1437.4. 16 warps per SM was at or below 32 and 64 in 11 of the 12 windows;
# FLUSH_LIST_MAXNREG: without it the Mamba-2 NVFP4 flush step took 2225.7 us (180 registers)
FLUSH_LIST = True
FLUSH_LIST_WARPS_PER_SM = 16
FLUSH_LIST_MAXNREG = 128
# the same for one-warp programs, by decode step and verify (None: no cap). Static SASS (Triton
# 3.6, sm_90a): the GDN s32_rs step's flush program of 16 rows on one warp takes 254 registers
# (8 programs per SM), 2200 instructions; capped at 128 it spills 156 bytes, at 168 none. H200,
# measured once, us, none / 128 / 168 / 8-row blocks: the flush
# step at B = 256 only lost (GDN s32_rs 868.3 / 1005.7 / 980.3 / 894.0, tp8_hi32 875.7 / 1079.6
# / 1166.1 / 1052.5; Mamba-2 s32_rs 759.9 / 801.0 / 778.6 / 921.5, tp8_hi32 1173.8 / 1251.4 /
# 1302.4 / 1295.2), the T = 4 round at B = 512 (its pre-flushes) won with a separate FP8 copy:
# GDN tp8_hi32 858.8 / 833.4 / 862.1 / 846.2, Mamba-2 tp8_hi32 1441.5 / 1320.8 / 1447.4 /
# 1284.5; s32_rs equal at 128 (GDN 807.3 / 808.3, Mamba-2 1179.8 / 1180.7)
FLUSH_LIST_MAXNREG_1W = {"step": None, "verify": 128}
FLUSH_LIST_CPU_PROGRAMS = 3         # the interpreter: a few programs, so that they loop
_SM_COUNT: dict = {}


def _list_regs(use_list: bool, warps: int, q, step: bool) -> dict:
    """The register cap of a LIST flush launch (NVIDIA), as the launch's maxnreg option.
    Multi-warp programs: ptxas would give the looping program more registers than one item's
    program (Triton 3.6, sm_90a: the Mamba-2 whole-matrix NVFP4 flush on 8 warps 180 instead of
    120, one program per SM instead of two); FLUSH_LIST_MAXNREG keeps it at the count that holds
    two (no spill there). One-warp programs: FLUSH_LIST_MAXNREG_1W, by decode step (step) or
    verify (measured there)."""
    cap = (FLUSH_LIST_MAXNREG if warps > 1
           else FLUSH_LIST_MAXNREG_1W["step" if step else "verify"])
    if not (use_list and cap and q.is_cuda and torch.version.hip is None):
        return {}
    return {"maxnreg": cap}


def _list_programs(items: int, warps: int, device) -> int:
    """Programs of a LIST flush launch of `items` work items of `warps` warps each."""
    if device.type != "cuda":
        return max(1, min(items, FLUSH_LIST_CPU_PROGRAMS))
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(items, sms * max(1, FLUSH_LIST_WARPS_PER_SM // warps)))


# A decode step's flush kernel runs on a side stream, beside the 'dots' and read kernels
# (forked from and joined back to the caller's stream, also inside a CUDA graph capture): in a
# step (T = 1) the rows that flush and the rows that read are disjoint (a read program of a
# flushing row returns; its early load of the read copy is discarded), so the flushing
# programs' latency and the other rows' programs that only read their pointers overlap the
# read. Not in a verify: a pre-flush rewrites the read copy that the same row's read uses. (A
# verify whose flush ran beside a first read pass over the rows without pre-flushes, the
# flagged rows read after it in a second launch, was slower: T = 4 round at B = 512 GDN s32_rs
# 853.5 vs 807.7 us, Mamba-2 1227.6 vs 1182.2.)
FLUSH_SIDE_STREAM = True
_SIDE_STREAMS: dict = {}


def _flush_stream(q, step: bool, T: int, force: bool):
    """The side stream of the flush kernel (waiting on the caller's stream), or None: on the CPU,
    in a verify, in a forced step (no read kernel) or with FLUSH_SIDE_STREAM off."""
    if not (FLUSH_SIDE_STREAM and q.is_cuda and step and T == 1 and not force):
        return None
    side = _SIDE_STREAMS.get(q.device)
    if side is None:
        side = _SIDE_STREAMS[q.device] = torch.cuda.Stream(q.device)
    side.wait_stream(torch.cuda.current_stream(q.device))
    return side


def _no_pending(store):
    if store.pending_T:
        raise ValueError(f"step: {store.pending_T} drafts are pending; call replay_accept first")


def _force(path, store, B):
    force = resolve_path(store, B, path) == "flush"
    store.last_force = force
    if not force:
        store.buffers_empty = False
    return force


def _note_all_flushed(store: ReplayStore, force: bool, advance: bool, state_indices, B: int):
    """A forced, advanced step over every slot (state_indices None, B == slots) leaves every
    buffer empty: buffers_empty becomes known again."""
    if force and advance and state_indices is None and B == store.committed.shape[0]:
        store.buffers_empty = True


def _check_buffered_bf16(delta: bool, k, v):
    for name, t in (("k" if delta else "B", k), ("v" if delta else "x", v)):
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be bfloat16 (the replay buffer stores it in bf16), "
                             f"got {t.dtype}")


def _conventional_view(store: ReplayStore, force: bool, launch, flush_config, block_v,
                       num_warps, read_variant, read_blocks=None):
    """The anchor as a ConventionalStore (sharing its memory and n_flush) when this step can run
    as the conventional kernel: a forced step of a lossless shared pair (flush_is_lossless)
    whose buffers are known empty (buffers_empty), every launch option at its default. Such a
    step rebuilds from the anchor alone and writes it back uncast: the conventional
    read-modify-write, bit for bit (tests), and its n_casts count is the flush count (h stays
    0, start does not move). Else None."""
    if not (force and store.buffers_empty and flush_is_lossless(store) and launch == "auto"
            and flush_config is None and block_v is None and num_warps is None
            and read_blocks is None and read_variant in ("auto", None)):
        return None
    return ConventionalStore(store.anchor, store.n_flush, store.key)


def replay_gdn_step(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                    scale=None, out=None, use_qk_l2norm=True, path="auto", block_v=None,
                    num_warps=None, advance=True, flush_config=None, read_variant="auto",
                    launch="auto", read_blocks=None):
    """One GDN replay decode step for a batch (Triton), inputs as conventional_gdn_step
    (k, v bf16). path (resolve_path): 'auto' (default: below the measured batch threshold a
    shared FP32-anchor pair such as s32_rs flushes every step, which is the conventional kernel
    and was faster there on the H200; this changes the flush schedule (committed stays 0) but the
    results only by FP32 reassociation; every other pair replays), 'replay' (the ReplayState
    schedule at any size), 'flush' (every step flushes) or 'auto_lossy' (size switch for any
    shared pair: adds roundings, changes results). A flushing step of a lossless pair whose
    buffers are known empty (ReplayStore.buffers_empty) runs the conventional kernel on the
    anchor, unless a launch option is given (_conventional_view).
    Returns y float32 [B, H, d_v]; with advance=False the caller moves the pointers
    (advance_pointers; its default force_flush is the path this step took).
    read_variant: 'auto' (default: 'dots' from DOTS_MIN_ROWS rows, else 'block'), 'block' (one
    program per (row, value head, row block)) or 'dots' (the block kernel, with the
    per-entry dot products formed once per (row, key head) by a small kernel launched before
    it); same results within FP32 reassociation (DOTS_MIN_ROWS has the H200 figures; docs/kernels.md
    what limits each kernel).
    launch (resolve_launch): 'auto' (default: one launch per step below FUSED_THRESHOLD rows,
    never for a pair with an NVFP4 role),
    'split' or 'fused'; the same results. With launch 'fused', block_v / num_warps set the one
    block of the fused kernel (default: the flush block). read_blocks: blocks of block_v rows
    that one read program of the split launch takes in turn (default with read_variant 'dots'
    and no block_v: DOTS_BLOCK by kind and read copy format, else 1)."""
    if store.kind != "gdn":
        raise ValueError("replay_gdn_step needs a store built with kind='gdn'")
    if b is None:
        raise ValueError("GDN needs b (beta logits) [batch, value heads]")
    _no_pending(store)
    force = _force(path, store, q.shape[0])
    cs = _conventional_view(store, force, launch, flush_config, block_v, num_warps, read_variant,
                            read_blocks)
    if cs is not None:              # (the other paths check the dtypes in _launch)
        _check_buffered_bf16(True, k, v)
        return conventional_gdn_step(cs, q, k, v, a, b, A_log, dt_bias, state_indices, scale,
                                     out, use_qk_l2norm, advance=advance)
    lau = resolve_launch(store, q.shape[0], launch, read_variant or "block")
    rv = resolve_read_variant(store, q.shape[0], read_variant, lau)
    out, idx, moved = _launch(store, q, k, v, a, b, A_log, dt_bias, None, None, state_indices,
                              out, scale, use_qk_l2norm, 1, True, force, block_v, num_warps,
                              flush_config, rv, launch=lau, advance=advance,
                              read_blocks=read_blocks)
    if advance and not moved:
        advance_pointers(store, idx, 1, True, force)
    _note_all_flushed(store, force, advance, state_indices, out.shape[0])
    return out


def replay_mamba2_step(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                       dt_bias=None, out=None, path="auto", block_v=None, num_warps=None,
                       advance=True, flush_config=None, dt_limit=NO_DT_LIMIT, launch="auto",
                       read_variant="auto", read_blocks=None):
    """One Mamba-2 replay decode step (Triton), inputs as conventional_mamba2_step (x, B bf16;
    dt_limit = (lo, hi) clamps softplus(dt + dt_bias), (0, inf): no clamp).
    path, advance, launch: as replay_gdn_step (default 'auto': only s32_rs-like shared FP32
    anchors switch to a flush every step below the measured batch threshold); read_variant
    'auto' (default: 'dots' from DOTS_MIN_ROWS rows, else 'block'), 'block' or 'dots' (the
    entries' B_j.C formed once per (row, group)); read_blocks as replay_gdn_step."""
    if store.kind != "mamba2":
        raise ValueError("replay_mamba2_step needs a store built with kind='mamba2'")
    _no_pending(store)
    force = _force(path, store, x.shape[0])
    cs = _conventional_view(store, force, launch, flush_config, block_v, num_warps, read_variant,
                            read_blocks)
    if cs is not None:              # (the other paths check the dtypes in _launch)
        _check_buffered_bf16(False, B, x)
        return conventional_mamba2_step(cs, x, dt, A, B, C, state_indices, D, z, dt_bias, out,
                                        advance=advance, dt_limit=dt_limit)
    lau = resolve_launch(store, x.shape[0], launch, read_variant or "block")
    rv = resolve_read_variant(store, x.shape[0], read_variant, lau)
    out, idx, moved = _launch(store, C, B, x, dt, None, A, dt_bias, D, z, state_indices, out, None,
                              False, 1, True, force, block_v, num_warps, flush_config,
                              rv, dt_limit=dt_limit, launch=lau, advance=advance,
                              read_blocks=read_blocks)
    if advance and not moved:
        advance_pointers(store, idx, 1, True, force)
    _note_all_flushed(store, force, advance, state_indices, out.shape[0])
    return out


# ============================================================================ torch reference

def _ring(store, start, n):
    return [(start + j) % store.capacity for j in range(n)]


def _entries_ref(store: ReplayStore, s: int, n: int, L2: bool, start: int):
    """Float32 entries 0..n-1 of slot s for all heads: K [H, n, dk], V (GDN raw v; Mamba v = dt x)
    [H, n, dv], U (GDN stored u) [H, n, dv], G [H, n], Bt [H, n]."""
    H = store.shape[1]
    r = H // store.key_heads
    pos = _ring(store, start, n)
    K = store.kbuf[s, pos].float().transpose(0, 1).repeat_interleave(r, dim=0)
    if store.kind == "gdn" and L2:
        K = K * torch.rsqrt((K * K).sum(-1, keepdim=True) + 1e-6)
    V = store.vbuf[s, pos].float().transpose(0, 1)
    G = store.Gbuf[s, pos].transpose(0, 1)
    Bt = store.bbuf[s, pos].transpose(0, 1)
    if store.kind == "mamba2":
        V = Bt.unsqueeze(-1) * V
    U = None if store.ubuf is None else store.ubuf[s, pos].float().transpose(0, 1)
    return K, V, U, G, Bt


def _rebuild_ref(A, K, V, G, Bt, delta, cur=None):
    """Unrounded state after the entries (K [H, n, dk], V [H, n, dv], G, Bt [H, n]) and, if given,
    the current step cur = (k, v, log_a, beta) [H, ...], from checkpoint A [H, dv, dk], in the
    kernels' order: GDN runs the recurrence (a_j = exp(G_j - G_{j-1})), Mamba-2 the closed form
    exp(G_n) A + sum_j exp(G_n - G_j) v_j k_j^T (= core.rebuild within reassociation)."""
    n = G.shape[1]
    H = A.shape[0]
    if delta:
        S = A
        Gprev = torch.zeros(H, device=A.device)
        for j in range(n):
            S = S * torch.exp(G[:, j] - Gprev)[:, None, None]
            u = Bt[:, j:j + 1] * (V[:, j] - (S * K[:, j].unsqueeze(1)).sum(-1))
            S = S + u.unsqueeze(-1) * K[:, j].unsqueeze(1)
            Gprev = G[:, j]
        if cur is not None:
            k, v, log_a, beta = cur
            S = S * torch.exp(log_a)[:, None, None]
            u = beta.unsqueeze(-1) * (v - (S * k.unsqueeze(1)).sum(-1))
            S = S + u.unsqueeze(-1) * k.unsqueeze(1)
        return S
    Gn = G[:, n - 1] if n > 0 else torch.zeros(H, device=A.device)
    if cur is not None:
        Gn = Gn + cur[2]
    S = A * torch.exp(Gn)[:, None, None]
    for j in range(n):
        w = torch.exp(Gn - G[:, j])
        S = S + (w.unsqueeze(-1) * V[:, j]).unsqueeze(-1) * K[:, j].unsqueeze(1)
    if cur is not None:
        S = S + cur[1].unsqueeze(-1) * cur[0].unsqueeze(1)
    return S


def _write_roles_ref(store: ReplayStore, s: int, S, fi: int):
    H = store.shape[1]
    store.anchor.write_([s], S[None], store.key, role_streams(fi, ANCHOR, [s], H))
    if store.read is not None:
        store.read.write_([s], S[None], store.key, role_streams(fi, READ, [s], H))


def replay_ref_core(store: ReplayStore, fe, raw, state_indices, T: int, step: bool, force: bool,
                    post=None):
    """Torch twin of the flush + read kernels. fe: front-end tensors (q, k, v, log_a, gate2) float32 with
    value heads, each [B, T, H, ...] (gate2: GDN beta, Mamba-2 dt); raw: (k raw [B, T, HK, dk], x/v raw [B, T, H, dv]) as
    stored. post(y, b, t) applies the Mamba-2 D skip / z gate. Returns y [B, T, H, dv]."""
    q, k, v, log_a, beta = fe
    kraw, xraw = raw
    delta = store.kind == "gdn"
    B = q.shape[0]
    N, H, dv, dk = store.shape
    L = store.L
    idx = _indices(state_indices, B, q.device).long()
    y = torch.zeros(B, T, H, dv, dtype=torch.float32, device=q.device)
    bf = torch.bfloat16 if store.ubuf is None else store.ubuf.dtype
    for b_, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        h, nf, start = int(store.committed[s]), int(store.n_flush[s]), int(store.start[s])
        if h + T > L and h > 0:
            K, V, _, G, Bt = _entries_ref(store, s, h, True, start)
            S = _rebuild_ref(store.anchor.dequantize([s])[0], K, V, G, Bt, delta)
            _write_roles_ref(store, s, S, nf + 1)
            nf, start, h = nf + 1, (start + h) % store.capacity, 0
        if step and (h + 1 == L or force):
            A = store.anchor.dequantize([s])[0]
            K, V, _, G, Bt = _entries_ref(store, s, h, True, start)
            S = _rebuild_ref(A, K, V, G, Bt, delta,
                             cur=(k[b_, 0], v[b_, 0], log_a[b_, 0], beta[b_, 0]))
            y[b_, 0] = (S * q[b_, 0].unsqueeze(1)).sum(-1)
            _write_roles_ref(store, s, S, nf + 1)
        else:
            R = store.read_role.dequantize([s])[0]
            K, V, U, G, Bt = _entries_ref(store, s, h, True, start)
            X = U if delta else V
            Gp = G[:, h - 1] if h > 0 else torch.zeros(H, device=q.device)
            for t in range(T):
                p = h + t
                Gp = Gp + log_a[b_, t]
                wdec = torch.exp(Gp.unsqueeze(-1) - G)                  # [H, p]
                eG = torch.exp(Gp)
                kt, qt = k[b_, t], q[b_, t]
                if delta:
                    corr = torch.einsum("hj,hjd->hd", wdec * (K * kt.unsqueeze(1)).sum(-1), X)
                    rk = (R * kt.unsqueeze(1)).sum(-1)
                    bt = beta[b_, t].unsqueeze(-1)
                    u = bt * (v[b_, t] - eG.unsqueeze(-1) * rk) - bt * corr
                    u = u.to(bf).float()
                else:
                    u = v[b_, t]
                qk = (K * qt.unsqueeze(1)).sum(-1)
                y[b_, t] = eG.unsqueeze(-1) * (R * qt.unsqueeze(1)).sum(-1) \
                    + torch.einsum("hj,hjd->hd", wdec * qk, X) + (kt * qt).sum(-1, keepdim=True) * u
                K = torch.cat([K, kt.unsqueeze(1)], 1)
                X = torch.cat([X, u.unsqueeze(1)], 1)
                G = torch.cat([G, Gp.unsqueeze(1)], 1)
                p = (start + p) % store.capacity
                store.kbuf[s, p] = kraw[b_, t].to(torch.bfloat16)
                store.vbuf[s, p] = xraw[b_, t].to(torch.bfloat16)
                if delta:
                    store.ubuf[s, p] = u.to(store.ubuf.dtype)
                store.bbuf[s, p] = beta[b_, t]
                store.Gbuf[s, p] = Gp
        if post is not None:
            for t in range(T):
                y[b_, t] = post(y[b_, t], b_, t)
    return y


def replay_gdn_step_ref(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None,
                        state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                        path="auto", block_v=None, num_warps=None, advance=True,
                        flush_config=None, read_variant="auto", launch="auto", read_blocks=None):
    """torch reference of replay_gdn_step (same signature, same effect on the store)."""
    force = _force(path, store, q.shape[0])
    qf, kf, vf, g, beta = gdn_frontend_ref(q, k, v, a, b, A_log, dt_bias, scale, use_qk_l2norm)
    fe = tuple(t.unsqueeze(1) for t in (qf, kf, vf, g, beta))
    y = replay_ref_core(store, fe, (k.unsqueeze(1), v.unsqueeze(1)), state_indices, 1, True,
                        force)[:, 0]
    if advance:
        advance_pointers_ref(store, _indices(state_indices, q.shape[0], q.device), 1, True, force)
    _note_all_flushed(store, force, advance, state_indices, q.shape[0])
    return _into(out, y)


def replay_mamba2_step_ref(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                           dt_bias=None, out=None, path="auto", block_v=None, num_warps=None,
                           advance=True, flush_config=None, dt_limit=NO_DT_LIMIT,
                           launch="auto", read_variant="auto", read_blocks=None):
    """torch reference of replay_mamba2_step."""
    force = _force(path, store, x.shape[0])
    q, k, v, log_a, d = mamba2_frontend_ref(x, dt, A, B, C, dt_bias, dt_limit)
    fe = tuple(t.unsqueeze(1) for t in (q, k, v, log_a, d))
    post = lambda y, b_, t: mamba2_post_ref(y[None], x[b_:b_ + 1], D,  # noqa: E731
                                            None if z is None else z[b_:b_ + 1])[0]
    y = replay_ref_core(store, fe, (B.unsqueeze(1), x.unsqueeze(1)), state_indices, 1, True, force,
                        post)[:, 0]
    if advance:
        advance_pointers_ref(store, _indices(state_indices, x.shape[0], x.device), 1, True, force)
    _note_all_flushed(store, force, advance, state_indices, x.shape[0])
    return _into(out, y)
