"""The replay decode step as one launch, the flush deferred into the next step's read (Triton):
GDN and Mamba-2 with a shared FP32 anchor (s32_rs: GDN caching u in FP32, `folds_u`; Mamba-2
folding dt x). This module's `replay_gdn_step` / `replay_mamba2_step` are decode's with a
design switch: design='deferred-fold' runs this kernel; the default, 'eager-flush', runs
decode's flush launch and read launch. The torch reference of this schedule is
`reference.replay_fold_step_ref`.

The schedule. Every step reads and appends, step L of a window included: a row whose entry
fills the buffer (h + 1 == L) is read like the others, and after the step it holds h == L
unfolded entries. At the next step the program finds h == L and folds the window into each
chunk of the anchor it loads: S_c = e^{G_L} S0_c + (U w)^T K_c (w_j = e^{G_L - G_j} / |k_j|
for GDN's re-normalised keys, 1 for Mamba-2; U the ring's FP32 u, or dt x), with the three
bf16 tensor-core products of decode._dot3 (exact against the raw bf16 keys, float32
sums); it stores S_c as the new anchor and multiplies it with this token's q and k. So the
anchor is read once and written once in one streaming pass of the read's programs: no flush
launch on any step (decode's read steps pay an empty one, 8.4 us of 170.8 at B = 256
under Nsight Compute, and its flush step uses 255-register one-warp tiles), and no re-read of
the anchor after the read's pass (a fold after the pass re-read it and lost: docs/kernels.md,
designs removed). The token then is entry 0 of the new window, whose start is
the old one moved by L: the ring needs L + 1 entries, so that this entry does not overwrite an
entry that the row's other programs are still folding (a store built with max_drafts >= 1).

The store's meaning. A row at h == L holds exactly what a store holds after accepted drafts
filled its buffer (ReplayState's state after L appended steps, the anchor one window behind):
every reader of a store already takes it (the reference, the engine and decode's
step and verify fold it first, as a pre-flush). A step of this design is, on the store, a verify
of one draft that is then accepted (`reference.replay_fold_step_ref`): the pointers move as
decode._moved_pointers' verify rule (T = 1) and then h += 1. The flush index counts the
folds, one step later than the eager schedule's.

A program takes a [BV, d_k] tile of one (batch row, value head): the front end, the ring's terms
of the h entries the read sees (none after a fold), one pass over the anchor's chunks of CK
columns (STAGES chunks' loads in flight) folding them when the row's window is full, the output
and the entry appended, then the row's last program (an arrival counter) moves the pointers.
Layers sharing one pair of pointer tensors pass advance=False to all but their last, then
call fold_advance_pointers.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional.kernel import (_L2_EPS, _front_end, _gate_out,
                                                     _kernel_inputs, _program_tile)
from replayquant.kernels.replay import decode as rd
from replayquant.kernels.replay.decode import (_append_entry, _dot3, _entry, _load_entries,
                                               _moved_pointers, _row_of, advance_pointers)
from replayquant.kernels.replay.launch import chosen_design, fold_launch_config
from replayquant.replay.stores import (ReplayStore, StepTensors, _begin, _check_buffered, _indices,
                                        dt_limit_args, folds_u, step_inputs)

__all__ = ["replay_gdn_step", "replay_mamba2_step", "fold_step", "fold_advance_pointers",
           "fold_supported", "STEP_DESIGNS"]

# The decode step's designs: 'eager-flush', decode's (a flush launch, then the read
# launch; one launch at small batch); 'deferred-fold', this module's
STEP_DESIGNS = ("eager-flush", "deferred-fold")


# ============================================================================ Triton

@triton.jit
def _fold_pass(A_pay, kbuf, Uw, q, k, qp, kp, qa, qb, ka, fold, eGn, slot, start, mat, hk,
               rows, jj, n, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               CAPACITY: tl.constexpr, CK: tl.constexpr, STAGES: tl.constexpr,
               DELTA: tl.constexpr, QLOAD: tl.constexpr, ON_GPU: tl.constexpr):
    """(S q, S k) [BV] of the anchor tile's rows, one pass over its chunks of CK columns; where
    `fold` (the row's window is full), each chunk first becomes e^{G_n} S0_c + Uw^T K_c and is
    stored back in place as the new anchor before its products are taken: Uw [BUFFER_TILE, BV]
    the n entries' u or dt x times their weights, held across the loop (reloading it each
    chunk saved no register: compile_check, docs/kernels.md); K_c the raw bf16 keys' chunk, a
    cache hit for the head's other programs. q, k [DK]: the front end's vectors, a chunk taken
    from registers; with QLOAD loaded a chunk at a time from the raw inputs (at qp, kp) and
    scaled as the front end scales them, (raw * qa) * qb and raw * ka."""
    NC: tl.constexpr = DK // CK
    m = jj < n
    e = _entry(slot, start, jj, CAPACITY)
    UwT = tl.trans(Uw)
    rq = tl.zeros([rows.shape[0]], tl.float32)
    rk = tl.zeros([rows.shape[0]], tl.float32)
    for c in tl.range(0, NC, num_stages=STAGES):
        cc = c * CK + tl.arange(0, CK)
        pa = A_pay + mat * (DV * DK) + rows[:, None] * DK + cc[None, :]
        S = tl.load(pa)
        if fold:
            Kc = tl.load(kbuf + (e[:, None] * HK + hk) * DK + cc[None, :], mask=m[:, None],
                         other=0.0)
            S = _dot3(UwT, Kc, eGn * S, False, ON_GPU)
            tl.store(pa, S)
        qc = q
        kc = k
        if QLOAD:           # the chunk of the raw input times the front end's factors
            qc = (tl.load(qp + cc).to(tl.float32) * qa) * qb
            if DELTA:
                kc = tl.load(kp + cc).to(tl.float32) * ka
        elif NC > 1:
            qc = _row_of(tl.reshape(q, (NC, CK)), c)
            if DELTA:
                kc = _row_of(tl.reshape(k, (NC, CK)), c)
        rq += tl.sum(S * qc[None, :], axis=1)
        if DELTA:
            rk += tl.sum(S * kc[None, :], axis=1)
    return rq, rk


@triton.jit
def _fold_advance_row(h_ptr, st_ptr, nf_ptr, cnt_ptr, slot, PROGRAMS: tl.constexpr,
                      BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr):
    """The row's pointer moves by the last of its PROGRAMS programs to arrive (arrival counter
    cnt_ptr, reset for the next step): a full window folded (decode's verify rule, one
    draft), then the step's entry committed."""
    tl.debug_barrier()                  # every thread of the program is past its loads
    arrived = tl.atomic_add(cnt_ptr + slot, 1)          # acq_rel, gpu scope
    if arrived == PROGRAMS - 1:                         # the row's last program
        h, st, nf = _moved_pointers(tl.load(h_ptr + slot), tl.load(st_ptr + slot),
                                    tl.load(nf_ptr + slot), 0, BUFFER_LEN, CAPACITY, 1, False)
        tl.store(h_ptr + slot, h + 1)
        tl.store(st_ptr + slot, st)
        tl.store(nf_ptr + slot, nf)
        tl.store(cnt_ptr + slot, 0)


@triton.jit
def _fold_read_kernel(
        A_pay, kbuf, vbuf, ubuf, Gbuf, bbuf, h_ptr, st_ptr, nf_ptr, cnt_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, beta_scale, dt_lo, dt_hi,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, BUFFER_LEN: tl.constexpr, CAPACITY: tl.constexpr,
        BUFFER_TILE: tl.constexpr, CK: tl.constexpr, STAGES: tl.constexpr,
        QLOAD: tl.constexpr, FOLDS: tl.constexpr, DELTA: tl.constexpr,
        L2NORM: tl.constexpr, HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        DT_CLAMP: tl.constexpr, ON_GPU: tl.constexpr, ADVANCE: tl.constexpr):
    """One decode step of a shared FP32 pair, a program per [BV, d_k] tile (module docstring):
    a row at h == L folds its window into the anchor within the read's pass. FOLDS False
    compiles the read path alone (compile_check's figure of what a read step runs; every launch
    passes True)."""
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
    if slot >= 0:
        mat = slot * HV + hv
        jj = tl.arange(0, BUFFER_TILE)
        h = tl.load(h_ptr + slot)
        start = tl.load(st_ptr + slot)
        fold = (h + 1 > BUFFER_LEN) & (h > 0)       # the window is full: fold it in the pass
        q, k, v, log_a, beta, skip = _front_end(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk, rows, cols,
            scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D, DT_CLAMP, False)
        # the h entries once: the read's terms (none after a fold) or the fold's U w
        Kb, r, X, G, Bt = _load_entries(kbuf, vbuf, ubuf, Gbuf, bbuf, slot, start, hv, hk,
                                        rows, cols, jj, h, HK, HV, DK, DV, CAPACITY, DELTA,
                                        L2NORM, DELTA, False)
        Gn = tl.sum(tl.where(jj == h - 1, G, 0.0), axis=0)        # the last entry's gate
        live = jj < h
        w = tl.where(fold, tl.where(live, tl.exp(tl.where(live, Gn - G, 0.0)), 0.0) * r, 0.0)
        Uw = X * w[:, None]
        Gp = tl.where(fold, 0.0, Gn) + log_a
        prev = live & ~fold
        wdec = tl.where(prev, tl.exp(tl.where(prev, Gp - G, 0.0)), 0.0)
        qk = r * tl.sum(Kb.to(tl.float32) * q[None, :], axis=1)
        yb = tl.sum((wdec * qk)[:, None] * X, axis=0)
        corr = yb
        if DELTA:
            beta = beta * beta_scale
            kk = r * tl.sum(Kb.to(tl.float32) * k[None, :], axis=1)
            corr = tl.sum((wdec * kk)[:, None] * X, axis=0)
        qp = q_ptr + (row * HK + hk) * DK
        kp = k_ptr + (row * HK + hk) * DK
        qa = 1.0                # the front end's factors of the raw q, k (QLOAD)
        ka = 1.0
        qb = 1.0
        if QLOAD and DELTA:
            qb = scale
            if L2NORM:
                qr = tl.load(qp + cols).to(tl.float32)
                kr = tl.load(kp + cols).to(tl.float32)
                qa = 1.0 / tl.sqrt(tl.sum(qr * qr, axis=0) + _L2_EPS)
                ka = 1.0 / tl.sqrt(tl.sum(kr * kr, axis=0) + _L2_EPS)
        rq, rk = _fold_pass(A_pay, kbuf, Uw, q, k, qp, kp, qa, qb, ka, fold & FOLDS, tl.exp(Gn),
                            slot, start, mat, hk, rows, jj, h, HK, DK, DV, CAPACITY, CK, STAGES,
                            DELTA, QLOAD, ON_GPU)
        eG = tl.exp(Gp)
        if DELTA:
            u = beta * (v - eG * rk) - beta * corr
        else:
            u = v
        y = eG * rq + yb + tl.sum(k * q, axis=0) * u
        y = _gate_out(y + skip, z_ptr, row, hv, rows, HV, DV, HAS_Z)
        tl.store(out_ptr + (row * HV + hv) * DV + rows, y)
        p = tl.where(fold, 0, h)
        st = tl.where(fold, (start + h) % CAPACITY, start)
        _append_entry(kbuf, vbuf, ubuf, Gbuf, bbuf, v_ptr, tl.load(kp + cols), u, Gp, beta,
                      _entry(slot, st, p, CAPACITY), row, hv, hk, rows, cols,
                      tl.program_id(1) == 0, HK, HV, DK, DV, DELTA, False)
        if ADVANCE:
            _fold_advance_row(h_ptr, st_ptr, nf_ptr, cnt_ptr, slot, HV * (DV // BV),
                              BUFFER_LEN, CAPACITY)
    else:
        tl.store(out_ptr + (row * HV + hv) * DV + rows, tl.zeros([BV], tl.float32))


# ============================================================================ host side

def fold_supported(store: ReplayStore) -> str | None:
    """None where the deferred fold takes this store, else why not: a GDN store with a shared
    FP32 anchor and FP32 u (folds_u), or a Mamba-2 store with a shared FP32 anchor."""
    if store.kind not in ("gdn", "mamba2"):
        return f"it takes a 'gdn' or 'mamba2' store, not {store.kind!r}"
    if not (store.shared and store.anchor.fmt == "fp32"):
        return (f"it takes a shared FP32 anchor (s32_rs), not anchor {store.anchor.fmt} / read "
                f"{store.read_role.fmt}{'' if store.shared else ' (separate)'}; other pairs "
                f"keep design='eager-flush'")
    if store.kind == "gdn" and not folds_u(store):
        return "a GDN store folds its u only when the ring keeps it in FP32 (u_dtype float32)"
    return None


def fold_step(store: ReplayStore, kind, q, k, v, a, b, A, dt_bias, D, z, state_indices, out,
              scale, use_qk_l2norm, path="auto", dt_limit=None, advance=True, beta_scale=1.0,
              record=None):
    """A decode step of a `kind` ('gdn' or 'mamba2') store in one launch, arguments in
    decode._launch's order (Mamba-2: q = C, k = B, v = x, a = dt); returns out; its tile
    from launch.FOLD_TABLE (override_replay_launch({'fold': ...}) for others). The forced
    flush (path 'flush'), the fault
    record and stores other than fold_supported's are refused: they keep 'eager-flush'."""
    why = fold_supported(store) if store.kind == kind else None
    if why is not None:
        raise ValueError(f"design='deferred-fold': {why}")
    if _begin(store, kind, True, path):
        raise ValueError("design='deferred-fold' defers every flush; path='flush' (flush every "
                         "row now) runs with design='eager-flush'")
    if record is not None:
        raise ValueError("design='deferred-fold' notes no faults (record); use "
                         "design='eager-flush'")
    if store.capacity < store.buffer_len + 1:
        raise ValueError(f"design='deferred-fold' needs a ring of L + 1 = {store.buffer_len + 1}"
                         f" entries (the token after a full window is appended while the window"
                         f" is folded): build the store with max_drafts >= 1, got capacity "
                         f"{store.capacity}")
    lead, hk = step_inputs(kind, store.shape, False,
                            StepTensors(q, k, v, a, b, A, dt_bias, D, z))
    N, HV, dv, dk = store.shape
    if hk != store.key_heads:
        raise ValueError(f"the inputs have {hk} key heads, the store {store.key_heads} "
                         f"(key_heads)")
    delta = kind != "mamba2"
    _check_buffered(store, delta, k, v, kernel=True)
    beta_scale = float(beta_scale)
    if not (math.isfinite(beta_scale) and beta_scale > 0):
        raise ValueError(f"beta_scale must be a finite number > 0, got {beta_scale}")
    dt_lo, dt_hi, dt_clamp = dt_limit_args(dt_limit)
    B = lead[0]
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(B, HV, dv, dtype=torch.float32, device=q.device)
    if store.arrive is None or store.arrive.shape[0] != N:
        store.arrive = torch.zeros(N, dtype=torch.int32, device=store.committed.device)
    BV, nw, CK, stages, qload = fold_launch_config(store)
    _fold_read_kernel[(B * HV, dv // BV)](
        store.anchor.payload, store.kbuf, store.vbuf,
        store.ubuf if store.ubuf is not None else store.vbuf, store.Gbuf, store.bbuf,
        store.committed, store.start, store.n_flush, store.arrive, idx, out,
        *_kernel_inputs(q, k, v, a, b, A, dt_bias, D, z),
        float(scale if scale is not None else 1.0 / math.sqrt(dk)), beta_scale, dt_lo, dt_hi,
        HK=store.key_heads, HV=HV, DK=dk, DV=dv, BV=BV, BUFFER_LEN=store.buffer_len,
        CAPACITY=store.capacity, BUFFER_TILE=max(16, triton.next_power_of_2(store.buffer_len)),
        CK=CK, STAGES=stages, QLOAD=qload, FOLDS=True,
        DELTA=delta, L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None,
        HAS_D=D is not None, HAS_Z=z is not None, DT_CLAMP=dt_clamp, ON_GPU=q.is_cuda,
        ADVANCE=bool(advance), num_warps=nw)
    store.last_force = False
    return out


def fold_advance_pointers(store: ReplayStore, state_indices) -> None:
    """The pointer moves of a deferred-fold step launched with advance=False: a full window
    folded (decode's verify rule for one draft), then the step's entry committed."""
    advance_pointers(store, state_indices, T=1, step=False)
    B = state_indices.shape[0]
    advance_pointers(store, state_indices,
                     accepted=torch.ones(B, dtype=torch.int32, device=store.committed.device))


def _deferred(design) -> bool:
    return chosen_design(design, STEP_DESIGNS) == "deferred-fold"


def replay_gdn_step(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                    scale=None, out=None, use_qk_l2norm=True, path="auto", advance=True,
                    beta_scale=1.0, record=None, design="eager-flush"):
    """decode.replay_gdn_step (same arguments) with the design switch: 'eager-flush'
    runs it, 'deferred-fold' fold_step (its tile: launch.fold_launch_config)."""
    if _deferred(design):
        return fold_step(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None,
                         state_indices, out, scale, use_qk_l2norm, path, advance=advance,
                         beta_scale=beta_scale, record=record)
    return rd.replay_gdn_step(store, q, k, v, a, b, A_log, dt_bias=dt_bias,
                              state_indices=state_indices, scale=scale, out=out,
                              use_qk_l2norm=use_qk_l2norm, path=path, advance=advance,
                              beta_scale=beta_scale, record=record)


def replay_mamba2_step(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                       dt_bias=None, out=None, path="auto", advance=True,
                       dt_limit=rd.NO_DT_LIMIT, record=None, design="eager-flush"):
    """decode.replay_mamba2_step (same arguments) with the design switch, as
    replay_gdn_step."""
    if _deferred(design):
        return fold_step(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z,
                         state_indices, out, None, False, path, dt_limit=dt_limit,
                         advance=advance, record=record)
    return rd.replay_mamba2_step(store, x, dt, A, B, C, state_indices=state_indices, D=D, z=z,
                                 dt_bias=dt_bias, out=out, path=path, advance=advance,
                                 dt_limit=dt_limit, record=record)
