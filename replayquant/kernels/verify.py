"""Speculative decoding kernels: replay verify + accept (torch references in `replay_ref`), and
the conventional per-draft snapshot baseline (vLLM's scheme) beside its torch reference.

Replay (DESIGN section 4, `ReplayState.verify` / `accept`):

    y = replay_gdn_verify(store, q, k, v, a, b, A_log, dt_bias, state_indices)   # [B, T, H, d_v]
    replay_accept(store, n, state_indices)                                      # pointer move only

  Rows whose committed entries would not leave T free slots (h + T > L, h > 0) flush them first
  (inside the same launch, `replay_decode._replay_kernel`); the T drafts are appended after the
  committed pointer and read in order against the read copy and the buffer, draft t seeing the
  drafts before it. Nothing committed changes; accept adds n to the committed length. A flush
  never folds uncommitted drafts (rejected entries are simply overwritten later).

Conventional baseline (`ConventionalState.verify` / `accept`):

    snaps = make_snapshots(conv_store, T)
    y = conventional_gdn_verify(conv_store, snaps, q, k, ...)     # writes T packed states per row
    conventional_accept(conv_store, snaps, n, state_indices)      # copies snapshot n into the slot

  Each draft is a read-modify-write of the state, cast into its own snapshot (flush index
  n_casts + t + 1); the next draft reads the cast snapshot. Accept restores snapshot n (n = 0:
  the state is untouched) and adds n to n_casts.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional import (_into, _program_tile, ConventionalStore,
                                              _check_inputs, _front_end, _gate_out, _indices, _prep,
                                              _rank1_step, NO_DT_LIMIT, dt_limit_args,
                                              gdn_frontend_ref, launch_config, mamba2_frontend_ref,
                                              mamba2_post_ref)
from replayquant.kernels.roles import PackedRole, _tile_load, _tile_store, role_streams, split_key
from replayquant.kernels.replay_decode import ReplayStore, _launch, advance_pointers
from replayquant.streams import ANCHOR

__all__ = ["replay_gdn_verify", "replay_mamba2_verify", "replay_kda_verify", "replay_accept", "make_snapshots",
           "conventional_gdn_verify", "conventional_gdn_verify_ref", "conventional_mamba2_verify",
           "conventional_mamba2_verify_ref", "conventional_accept", "conventional_accept_ref"]


def _draft_count(x, name):
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        raise ValueError(f"{name} must be a tensor [batch, T drafts, heads, dim]")
    return x.shape[1]


def _check_accept(n, B, T, device, check=True):
    if not check:                     # no host synchronisation (CUDA graph capture)
        return n if n.dtype == torch.int32 else n.to(device=device, dtype=torch.int32)
    if isinstance(n, int) and not isinstance(n, bool):
        n = torch.full((B,), n, dtype=torch.int32, device=device)
    if not isinstance(n, torch.Tensor) or n.is_floating_point() or n.dtype == torch.bool \
            or n.shape != (B,):
        raise ValueError(f"accept: n must be an int or an integer tensor [batch={B}]")
    if T is not None and bool(((n < 0) | (n > T)).any()):
        raise ValueError(f"accept: every n must lie in 0..T={T}")
    return n.to(device=device, dtype=torch.int32).contiguous()


# ============================================================================ replay verify

def _pending(store, T, what):
    if getattr(store, "pending_T", None):
        raise ValueError(f"{what}: {store.pending_T} drafts are pending; call accept first")


def replay_gdn_verify(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                      scale=None, out=None, use_qk_l2norm=True, launch=None, beta_scale=1.0):
    """Outputs of T GDN drafts per row [B, T, H, d_v] (Triton: the flush launch for rows that
    pre-flush, the read launch with the pointer move). q, k [B, T, HK, d_k], v [B, T, H, d_v]
    (k, v bf16), a, b [B, T, H]; beta_scale and launch as replay_gdn_step. Then call
    replay_accept."""
    if store.kind != "gdn":
        raise ValueError("replay_gdn_verify needs a store built with kind='gdn'")
    T = _draft_count(q, "q")
    _pending(store, T, "verify")
    out, _ = _launch(store, q, k, v, a, b, A_log, dt_bias, None, None, state_indices, out, scale,
                     use_qk_l2norm, T, False, False, launch, beta_scale=beta_scale)
    store.pending_T = T
    return out


def replay_mamba2_verify(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                         dt_bias=None, out=None, launch=None, dt_limit=NO_DT_LIMIT):
    """Outputs of T Mamba-2 drafts [B, T, H, P] (Triton, as replay_gdn_verify). x [B, T, H, P],
    dt [B, T, H], B, C [B, T, G, N], z [B, T, H, P] (x, B bf16); dt_limit as
    replay_mamba2_step. Then call replay_accept."""
    if store.kind != "mamba2":
        raise ValueError("replay_mamba2_verify needs a store built with kind='mamba2'")
    T = _draft_count(x, "x")
    _pending(store, T, "verify")
    out, _ = _launch(store, C, B, x, dt, None, A, dt_bias, D, z, state_indices, out, None, False,
                     T, False, False, launch, dt_limit=dt_limit)
    store.pending_T = T
    return out


def replay_kda_verify(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                      out=None, use_qk_l2norm=True, launch=None):
    """Outputs of T Kimi Delta Attention drafts per row [B, T, H, d_v] (Triton, as
    replay_gdn_verify).
    q, k [B, T, HK, d_k], v [B, T, H, d_v] (k, v bf16), g [B, T, H, d_k] the log decay per key
    channel, beta [B, T, H]. Then call replay_accept."""
    if store.kind != "kda":
        raise ValueError(f"replay_kda_verify needs a store built with kind='kda', got "
                         f"{store.kind!r}")
    T = _draft_count(q, "q")
    _pending(store, T, "verify")
    out, _ = _launch(store, q, k, v, g, beta, None, None, None, None, state_indices, out, scale,
                     use_qk_l2norm, T, False, False, launch)
    store.pending_T = T
    return out


def replay_accept(store: ReplayStore, n, state_indices=None, check=True):
    """Commit the first n[b] drafts of each row: committed += n (no state is touched).
    check=False skips the range check of n (no host synchronisation, for CUDA graphs)."""
    T = getattr(store, "pending_T", None)
    if not T:
        raise ValueError("accept: no drafts pending; call verify first")
    B = n.shape[0] if isinstance(n, torch.Tensor) else state_indices.shape[0]
    idx = _indices(state_indices, B, store.committed.device)
    n = _check_accept(n, B, T, store.committed.device, check)
    advance_pointers(store, idx, accepted=n)
    store.pending_T = None


# ============================================================================ conventional

def make_snapshots(store: ConventionalStore, T: int) -> PackedRole:
    """Per-draft snapshot storage for T drafts: [N * T, H, d_v, d_k] in the state's format
    (snapshot t of slot s at index s * T + t). T times the state's memory."""
    N, H, dv, dk = store.state.shape
    snaps = PackedRole.empty(store.state.fmt, store.state.rounding, (N * T, H, dv, dk),
                             store.state.payload.device)
    snaps.T = T
    return snaps


# key_lo / key_hi: not specialized (Triton makes an integer argument equal to 1 a constexpr)
@triton.jit(do_not_specialize=["key_lo", "key_hi"])
def _conv_verify_kernel(
        S_pay, S_sc, S_gs, P_pay, P_sc, P_gs, ncast_ptr, idx_ptr, out_ptr,
        q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, z_ptr,
        scale, key_lo, key_hi, dt_lo, dt_hi,
        HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
        BV: tl.constexpr, T: tl.constexpr, FMT: tl.constexpr, SR: tl.constexpr,
        DELTA: tl.constexpr, L2NORM: tl.constexpr, HAS_DTB: tl.constexpr, HAS_D: tl.constexpr,
        HAS_Z: tl.constexpr, DT_CLAMP: tl.constexpr):
    row, hv, hk, rows, cols, slot = _program_tile(idx_ptr, HK, HV, DK, BV)
    if slot >= 0:
        S = _tile_load(S_pay, S_sc, S_gs, slot * HV + hv, rows, cols, DV, DK, BV, FMT)
        nc = tl.load(ncast_ptr + slot)
        for t in tl.static_range(T):
            tok = row * T + t
            q, k, v, log_a, beta, skip = _front_end(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_ptr, dtb_ptr, D_ptr, tok, hv, hk, rows, cols,
                scale, dt_lo, dt_hi, HK, HV, DK, DV, DELTA, L2NORM, HAS_DTB, HAS_D, DT_CLAMP)
            S, y = _rank1_step(S, q, k, v, log_a, beta, DELTA)
            snap = (slot * T + t) * HV + hv
            _tile_store(S, P_pay, P_sc, P_gs, snap, rows, cols, key_lo, key_hi, nc + t + 1, slot,
                        hv, DV, DK, BV, FMT, SR, 0)
            y = _gate_out(y + skip, z_ptr, tok, hv, rows, HV, DV, HAS_Z)
            tl.store(out_ptr + (tok * HV + hv) * DV + rows, y)
            if t + 1 < T:
                if FMT != 0:
                    tl.debug_barrier()      # the next draft reads the cast snapshot
                    S = _tile_load(P_pay, P_sc, P_gs, snap, rows, cols, DV, DK, BV, FMT)
    else:
        for t in tl.static_range(T):
            tl.store(out_ptr + ((row * T + t) * HV + hv) * DV + rows, tl.zeros([BV], tl.float32))


def _conv_verify(store: ConventionalStore, snaps: PackedRole, q, k, v, a, b, A, dt_bias, D, z,
                 state_indices, out, scale, delta, use_qk_l2norm, block_v, num_warps,
                 dt_limit=None):
    st = store.state
    N, HV, dv, dk = st.shape
    if q.dim() != 4:
        raise ValueError("verify inputs need a draft axis: [batch, T, heads, dim]")
    B, T, HK = q.shape[:3]
    if getattr(snaps, "T", None) != T or snaps.fmt != st.fmt:
        raise ValueError(f"snapshots were made for T={getattr(snaps, 'T', None)} drafts in "
                         f"{snaps.fmt}; call make_snapshots(store, T={T})")
    kind = "gdn" if delta else "mamba2"
    _check_inputs(kind, st.shape, B, {
        "q" if delta else "C": (q, (B, T, HK, dk)), "k" if delta else "B": (k, (B, T, HK, dk)),
        "v" if delta else "x": (v, (B, T, HV, dv)), "a" if delta else "dt": (a, (B, T, HV)),
        "b": (b, (B, T, HV)), "A_log" if delta else "A": (A, (HV,)), "dt_bias": (dt_bias, (HV,)),
        "D": (D, (HV,)), "z": (z, (B, T, HV, dv))})
    dt_lo, dt_hi, dt_clamp = dt_limit_args(dt_limit)
    idx = _indices(state_indices, B, q.device)
    if out is None:
        out = torch.empty(B, T, HV, dv, dtype=torch.float32, device=q.device)
    BV, nw = launch_config(st.fmt, B * HV, dv, dk, block_v, num_warps)
    Sp, Ss, Sg, fid = st.kernel_args()
    Pp, Ps, Pg, _ = snaps.kernel_args()
    q, k, v, a, b, A, dt_bias, D, z = map(_prep, (q, k, v, a, b, A, dt_bias, D, z))
    dummy = a
    _conv_verify_kernel[(B * HV, dv // BV)](
        Sp, Ss, Sg, Pp, Ps, Pg, store.n_casts, idx, out,
        q, k, v, a, b if b is not None else dummy, A, dt_bias if dt_bias is not None else dummy,
        D if D is not None else dummy, z if z is not None else dummy,
        float(scale if scale is not None else 1.0 / math.sqrt(dk)), *split_key(store.key),
        dt_lo, dt_hi,
        HK=HK, HV=HV, DK=dk, DV=dv, BV=BV, T=T, FMT=fid, SR=st.rounding == "stochastic",
        DELTA=delta, L2NORM=use_qk_l2norm, HAS_DTB=dt_bias is not None, HAS_D=D is not None,
        HAS_Z=z is not None, DT_CLAMP=dt_clamp, num_warps=nw)
    return out


def conventional_gdn_verify(store: ConventionalStore, snaps: PackedRole, q, k, v, a, b, A_log,
                            dt_bias=None, state_indices=None, scale=None, out=None,
                            use_qk_l2norm=True, block_v=None, num_warps=None):
    """T GDN drafts as read-modify-write steps, each cast into its own snapshot (Triton).
    Returns y [B, T, H, d_v]; the state itself is untouched until conventional_accept."""
    return _conv_verify(store, snaps, q, k, v, a, b, A_log, dt_bias, None, None, state_indices,
                        out, scale, True, use_qk_l2norm, block_v, num_warps)


def conventional_mamba2_verify(store: ConventionalStore, snaps: PackedRole, x, dt, A, B, C,
                               state_indices=None, D=None, z=None, dt_bias=None, out=None,
                               block_v=None, num_warps=None, dt_limit=NO_DT_LIMIT):
    """T Mamba-2 drafts with per-draft snapshots (Triton). Returns y [B, T, H, P].
    dt_limit as conventional_mamba2_step."""
    return _conv_verify(store, snaps, C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                        None, False, False, block_v, num_warps, dt_limit)


@triton.jit
def _restore_kernel(src, dst, idx_ptr, n_ptr, ncast_ptr, M, T: tl.constexpr,
                    BLOCK: tl.constexpr, BUMP: tl.constexpr):
    """dst[slot] <- src[slot * T + n - 1] (M bytes per slot) where n > 0; BUMP: n_casts += n."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    slot = tl.load(idx_ptr + row).to(tl.int64)
    n = tl.load(n_ptr + row)
    if (slot >= 0) & (n > 0):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < M
        x = tl.load(src + (slot * T + n - 1) * M + offs, mask=m)
        tl.store(dst + slot * M + offs, x, mask=m)
    if BUMP:
        if (slot >= 0) & (c == 0):
            tl.store(ncast_ptr + slot, tl.load(ncast_ptr + slot) + n)


def _slot_bytes(t: torch.Tensor, n_slots: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(n_slots, -1)


def conventional_accept(store: ConventionalStore, snaps: PackedRole, n, state_indices=None,
                        check=True):
    """Restore snapshot n[b] into row b's slot (n = 0: nothing) and count its casts (Triton)."""
    st = store.state
    N = st.shape[0]
    T = snaps.T
    B = n.shape[0] if isinstance(n, torch.Tensor) else state_indices.shape[0]
    idx = _indices(state_indices, B, st.payload.device)
    n = _check_accept(n, B, T, st.payload.device, check)
    parts = [(st.payload, snaps.payload)]
    if st.scale is not None:
        parts.append((st.scale, snaps.scale))
    if st.gscale is not None:
        parts.append((st.gscale, snaps.gscale))
    for i, (dst, src) in enumerate(parts):
        d = _slot_bytes(dst, N)
        s = _slot_bytes(src, N * T)
        M = d.shape[1]
        BLOCK = min(8192, triton.next_power_of_2(M))
        _restore_kernel[(B, triton.cdiv(M, BLOCK))](s, d, idx, n, store.n_casts, M, T=T,
                                                    BLOCK=BLOCK, BUMP=i == 0, num_warps=4)


def conventional_accept_ref(store: ConventionalStore, snaps: PackedRole, n, state_indices=None,
                            check=True):
    st = store.state
    T = snaps.T
    B = n.shape[0] if isinstance(n, torch.Tensor) else state_indices.shape[0]
    idx = _indices(state_indices, B, st.payload.device).long()
    n = _check_accept(n, B, T, st.payload.device).long()
    for b_, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        j = int(n[b_])
        if j > 0:
            for dst, src in ((st.payload, snaps.payload), (st.scale, snaps.scale),
                             (st.gscale, snaps.gscale)):
                if dst is not None:
                    dst[s] = src[s * T + j - 1]
        store.n_casts[s] += j


def _conv_verify_ref(store, snaps, fe, state_indices, post):
    q, k, v, log_a, beta = fe
    st = store.state
    B, T = q.shape[:2]
    N, H, dv, dk = st.shape
    idx = _indices(state_indices, B, q.device).long()
    y = torch.zeros(B, T, H, dv, dtype=torch.float32, device=q.device)
    for b_, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        S = st.dequantize([s])[0]
        nc = int(store.n_casts[s])
        for t in range(T):
            S = S * torch.exp(log_a[b_, t])[:, None, None]
            if beta is not None:
                u = beta[b_, t][:, None] * (v[b_, t] - (S * k[b_, t][:, None, :]).sum(-1))
            else:
                u = v[b_, t]
            S = S + u[:, :, None] * k[b_, t][:, None, :]
            y[b_, t] = (S * q[b_, t][:, None, :]).sum(-1)
            if post is not None:
                y[b_, t] = post(y[b_, t], b_, t)
            snaps.write_([s * T + t], S[None], store.key, role_streams(nc + t + 1, ANCHOR, [s], H))
            S = snaps.dequantize([s * T + t])[0]
    return y


def conventional_gdn_verify_ref(store: ConventionalStore, snaps: PackedRole, q, k, v, a, b, A_log,
                                dt_bias=None, state_indices=None, scale=None, out=None,
                                use_qk_l2norm=True, block_v=None, num_warps=None):
    """torch reference of conventional_gdn_verify (SR streams keyed by the slot id)."""
    B, T = q.shape[:2]
    fe = gdn_frontend_ref(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), a.flatten(0, 1),
                          b.flatten(0, 1), A_log, dt_bias, scale, use_qk_l2norm)
    fe = tuple(t.unflatten(0, (B, T)) for t in fe)
    y = _conv_verify_ref(store, snaps, fe, state_indices, None)
    return _into(out, y)


def conventional_mamba2_verify_ref(store: ConventionalStore, snaps: PackedRole, x, dt, A, B, C,
                                   state_indices=None, D=None, z=None, dt_bias=None, out=None,
                                   block_v=None, num_warps=None, dt_limit=NO_DT_LIMIT):
    """torch reference of conventional_mamba2_verify."""
    Bt, T = x.shape[:2]
    q, k, v, log_a, _ = mamba2_frontend_ref(x.flatten(0, 1), dt.flatten(0, 1), A,
                                            B.flatten(0, 1), C.flatten(0, 1), dt_bias, dt_limit)
    fe = tuple(t.unflatten(0, (Bt, T)) for t in (q, k, v, log_a)) + (None,)
    post = lambda y, b_, t: mamba2_post_ref(y[None], x[b_:b_ + 1, t], D,  # noqa: E731
                                            None if z is None else z[b_:b_ + 1, t])[0]
    y = _conv_verify_ref(store, snaps, fe, state_indices, post)
    return _into(out, y)
