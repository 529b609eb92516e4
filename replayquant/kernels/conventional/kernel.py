"""Conventional SSM decode step (the baseline serving engines run): in-place read-modify-write
of the recurrent state stored in any format, for Gated DeltaNet, Kimi Delta Attention (KDA: a
gate per key channel) and Mamba-2.

    S_t = Q(a_t deq(S_{t-1}) + u_t k_t^T),   y_t = S_t q_t          (DESIGN section 4)
    KDA:  S_t = Q(deq(S_{t-1}) Diag(a_t) + u_t k_t^T), a_t in (0, 1]^{d_k}

This file also holds what every decode kernel of the package shares beside the stored roles
(`replay/roles.py`, their casts in registers in `kernels/quant/roles.py`):

* The GDN, KDA and Mamba-2 front ends as real models need them (GDN: q/k L2 norm in kernel,
  g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in FP32; KDA: q/k L2 norm in
  kernel, the per-channel log decay g and beta as the layer computes them; Mamba-2: groups over B/C,
  softplus(dt + dt_bias) then clamped to dt_limit = (lo, hi) when one is given (as
  transformers' time_step_limit and replay.frontends.mamba2_inputs), A per head, D skip,
  optional z gate), whose torch twins are in `reference.py`.

`state_indices[b]` maps batch row b to its state slot; a negative index marks a padding row
(output zero, nothing read or written). Each kernel `f` has a torch reference `f_ref` with the
same signature in `reference.py`; tests compare the two.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional.launch import launch_config
from replayquant.kernels.quant.roles import _tile_load, _tile_store, split_key
from replayquant.replay.stores import (NO_DT_LIMIT, ConventionalStore, StepTensors, _indices,
                                        _pow2_dims, dt_limit_args, step_inputs)
from replayquant.replay.frontends import L2NORM_EPS


# ---------------------------------------------------------------------------- front ends

_L2_EPS: tl.constexpr = tl.constexpr(L2NORM_EPS)   # q, k L2 norms: x / sqrt(sum x^2 + eps)


@triton.jit
def _softplus(x):
    # torch.nn.functional.softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _l2norm(x):
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) + _L2_EPS))


@triton.jit
def _program_tile(idx_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr):
    """Grid (batch row x value head, row block) -> batch row, value head, its key head, the
    block's state rows and columns, and the row's state slot (negative: padding row)."""
    pid = tl.program_id(0)
    row = pid // HV
    hv = pid % HV
    rows = tl.program_id(1) * BV + tl.arange(0, BV)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    return row, hv, hv // (HV // HK), rows, tl.arange(0, DK), slot


@triton.jit
def _front_end(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, row, hv, hk, rows, cols,
               scale, dt_lo, dt_hi, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
               DV: tl.constexpr, DELTA: tl.constexpr, L2NORM: tl.constexpr, HAS_DTB: tl.constexpr,
               HAS_D: tl.constexpr, DT_CLAMP: tl.constexpr, VEC: tl.constexpr):
    """Token `row`'s inputs of value head hv in float32: (q, k [DK], v [rows], log_a, beta, skip).
    GDN (DELTA): q, k L2-normalised (times the reciprocal root), q scaled, log_a = -e^A
    softplus(a + dt_bias), beta = sigmoid(b). KDA (VEC): q, k normalised in KDA's own form
    x / sqrt(sum x^2 + 1e-6), q scaled, log_a the layer's decay per key channel [DK] (a_ptr), beta
    as given (b_ptr). Mamba-2: q = C, k = B of the head's group, v = dt x, log_a = dt A,
    beta = dt, skip = D x (zeros without D); dt = softplus(dt + dt_bias), then (DT_CLAMP)
    min(max(dt, dt_lo), dt_hi) as torch.clamp."""
    q = tl.load(q_ptr + (row * HK + hk) * DK + cols).to(tl.float32)
    k = tl.load(k_ptr + (row * HK + hk) * DK + cols).to(tl.float32)
    x = tl.load(v_ptr + (row * HV + hv) * DV + rows).to(tl.float32)
    v = x
    skip = x * 0.0
    if VEC:
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + _L2_EPS)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + _L2_EPS)
        q = q * scale
        log_a = tl.load(a_ptr + (row * HV + hv) * DK + cols).to(tl.float32)
        beta = tl.load(b_ptr + row * HV + hv).to(tl.float32)
    else:
        a = tl.load(a_ptr + row * HV + hv).to(tl.float32)
        if HAS_DTB:
            a = a + tl.load(dtb_ptr + hv).to(tl.float32)
        A = tl.load(A_ptr + hv).to(tl.float32)
        if DELTA:
            if L2NORM:
                q = _l2norm(q)
                k = _l2norm(k)
            q = q * scale
            log_a = -tl.exp(A) * _softplus(a)
            beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + row * HV + hv).to(tl.float32)))
        else:
            dt = _softplus(a)
            if DT_CLAMP:
                dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
            log_a = dt * A
            beta = dt
            v = dt * x
            if HAS_D:
                skip = tl.load(D_ptr + hv).to(tl.float32) * x
    return q, k, v, log_a, beta, skip


@triton.jit
def _gate_out(y, z_ptr, row, hv, rows, HV: tl.constexpr, DV: tl.constexpr, HAS_Z: tl.constexpr):
    """The output gate y * silu(z) (HAS_Z)."""
    if HAS_Z:
        z = tl.load(z_ptr + (row * HV + hv) * DV + rows).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    return y


@triton.jit
def _gated_step(S, q, k, v, log_a, beta, DELTA: tl.constexpr, VEC: tl.constexpr):
    """S <- a S + u k^T (VEC, KDA's gate per key channel: S Diag(a), log_a [DK]), u = v or
    (DELTA) beta (v - (a S) k); returns (S, y = S q)."""
    if VEC:
        S = S * tl.exp(log_a)[None, :]
    else:
        S = S * tl.exp(log_a)
    if DELTA:
        u = beta * (v - tl.sum(S * k[None, :], axis=1))
    else:
        u = v
    S = S + u[:, None] * k[None, :]
    y = tl.sum(S * q[None, :], axis=1)
    return S, y


# ============================================================================ conventional step


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi"])
def _conventional_kernel(
        S_pay, S_sc, S_gs, P_pay, P_sc, P_gs, ncast_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, dt_lo, dt_hi,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, T: tl.constexpr, SNAP: tl.constexpr, FMT: tl.constexpr,
        SR: tl.constexpr, DELTA: tl.constexpr, VEC: tl.constexpr, L2NORM: tl.constexpr,
        HAS_DTB: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
        DT_CLAMP: tl.constexpr):
    """A step (T = 1: the state S read-modify-written in place, P = S) or, with SNAP, a verify of
    T drafts (vLLM's scheme: draft t cast into its snapshot of P, flush index n_casts + t + 1,
    the next draft reading the cast snapshot). VEC: KDA (a_ptr the log decay per key channel,
    b_ptr beta)."""
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
    if slot >= 0:
        mat = slot * HV + hv
        fi = tl.load(ncast_ptr + slot) + 1
        for t in tl.static_range(T):
            tok = row * T + t
            q, k, v, log_a, beta, skip = _front_end(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, tok, hv, hk, rows, cols,
                scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D, DT_CLAMP, VEC)
            if t == 0:
                S = _tile_load(S_pay, S_sc, S_gs, mat, rows, cols, DV, DK, BV, FMT)
            S, y = _gated_step(S, q, k, v, log_a, beta, DELTA, VEC)
            dst = (slot * T + t) * HV + hv if SNAP else mat
            _tile_store(S, P_pay, P_sc, P_gs, dst, rows, cols, key_lo, key_hi, fi + t, slot, hv,
                        DV, DK, BV, FMT, SR, 0)
            y = _gate_out(y + skip, z_ptr, tok, hv, rows, HV, DV, HAS_Z)
            tl.store(out_ptr + (tok * HV + hv) * DV + rows, y)
            if t + 1 < T:
                if FMT != 0:
                    tl.debug_barrier()      # the next draft reads the cast snapshot
                    S = _tile_load(P_pay, P_sc, P_gs, dst, rows, cols, DV, DK, BV, FMT)
    else:
        for t in tl.static_range(T):
            tl.store(out_ptr + ((row * T + t) * HV + hv) * DV + rows, tl.zeros([BV], tl.float32))


@triton.jit
def _advance_casts_kernel(ncast_ptr, idx_ptr, B):
    offs = tl.arange(0, 1024)
    for start in range(0, B, 1024):
        m = (start + offs) < B
        s = tl.load(idx_ptr + start + offs, mask=m, other=-1)
        ok = m & (s >= 0)
        c = tl.load(ncast_ptr + s, mask=ok, other=0)
        tl.store(ncast_ptr + s, c + 1, mask=ok)


def _kernel_inputs(q, k, v, a, b, A, dt_bias, D, z) -> list:
    """A step's input tensors as the kernels take them: contiguous, an absent one replaced by `a`
    (a pointer the kernel never reads: its HAS_* flag is False)."""
    a = a.contiguous()
    return [a if t is None else t.contiguous() for t in (q, k, v, a, b, A, dt_bias, D, z)]


def conv_launch(store: ConventionalStore, kind, q, k, v, a, b, A, dt_bias, D, z, state_indices,
                out, scale, use_qk_l2norm, advance=True, dt_limit=None, snaps=None):
    """_conventional_kernel for a step of `kind` (the state in place; advance: n_casts += 1) or,
    with snaps (make_snapshots), a verify of the drafts on axis 1 of the inputs."""
    st = store.state
    N, HV, dv, dk = st.shape
    _pow2_dims(st.shape)
    lead, HK = step_inputs(kind, st.shape, snaps is not None,
                           StepTensors(q, k, v, a, b, A, dt_bias, D, z))
    B, T = lead[0], lead[-1] if snaps is not None else 1
    if snaps is not None and (getattr(snaps, "T", None) != T or snaps.fmt != st.fmt):
        raise ValueError(f"snapshots were made for T={getattr(snaps, 'T', None)} drafts in "
                         f"{snaps.fmt}; call make_snapshots(store, T={T})")
    dt_lo, dt_hi, dt_clamp = dt_limit_args(dt_limit)
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(*lead, HV, dv, dtype=torch.float32, device=q.device)
    BV, nw = launch_config(st.fmt, B * HV, dv, dk)
    args = st.kernel_args()
    _conventional_kernel[(B * HV, dv // BV)](
        *args[:3], *(args if snaps is None else snaps.kernel_args())[:3], store.n_casts, idx,
        out, *_kernel_inputs(q, k, v, a, b, A, dt_bias, D, z),
        float(scale if scale is not None else 1.0 / math.sqrt(dk)), *split_key(store.key),
        dt_lo, dt_hi, HK=HK, HV=HV, DK=dk, DV=dv, BV=BV, T=T, SNAP=snaps is not None,
        FMT=args[3], SR=st.rounding == "stochastic", DELTA=kind != "mamba2", VEC=kind == "kda",
        L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None, HAS_D=D is not None,
        HAS_Z=z is not None, DT_CLAMP=dt_clamp, num_warps=nw)
    if advance and snaps is None:
        _advance_casts_kernel[(1,)](store.n_casts, idx, B)
    return out


def conventional_gdn_step(store: ConventionalStore, q, k, v, a, b, A_log, dt_bias=None,
                          state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                          advance=True):
    """One GDN decode step for a batch, state updated in place (Triton).

    q, k [B, HK, dk] (raw; L2-normalised in kernel), v [B, HV, dv], a, b [B, HV] (raw gates),
    A_log, dt_bias [HV]; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in FP32.
    Returns y float32 [B, HV, dv] (zero on padding rows)."""
    return conv_launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices,
                       out, scale, use_qk_l2norm, advance)


def conventional_kda_step(store: ConventionalStore, q, k, v, g, beta, state_indices=None,
                          scale=None, out=None, use_qk_l2norm=True, advance=True):
    """One Kimi Delta Attention decode step for a batch, state updated in place (Triton).

    q, k [B, HK, dk] (raw; L2-normalised in kernel), v [B, HV, dv], g [B, HV, dk] the log decay
    per key channel (the layer's forget gate output, <= 0), beta [B, HV] (after its sigmoid),
    as the layer hands them to fused_recurrent_kda. S <- S Diag(exp(g)), u = beta (v - S k),
    S <- Q(S + u k^T), y = S q (q scaled by `scale`, default d_k^-1/2).
    Returns y float32 [B, HV, dv] (zero on padding rows)."""
    return conv_launch(store, "kda", q, k, v, g, beta, None, None, None, None, state_indices,
                       out, scale, use_qk_l2norm, advance)


def conventional_mamba2_step(store: ConventionalStore, x, dt, A, B, C, state_indices=None, D=None,
                             z=None, dt_bias=None, out=None, advance=True,
                             dt_limit=NO_DT_LIMIT):
    """One Mamba-2 decode step for a batch, state [slots, heads, head dim P, d_state N] updated
    in place (Triton). x [B, H, P], dt [B, H] (raw; softplus(dt + dt_bias) in kernel, then
    clamped to dt_limit = (lo, hi) unless it is (0, inf), as transformers' time_step_limit),
    A [H] (negative), B, C [B, G, N] (groups), D [H], z [B, H, P] optional (y * silu(z)).
    Returns y float32 [B, H, P]."""
    return conv_launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                       None, False, advance, dt_limit)


