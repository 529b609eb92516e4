"""Speculative decoding kernels: replay verify + accept (torch references in `replay_ref`), and
the conventional per-draft snapshot baseline (vLLM's scheme; torch references in
`conventional_ref`, snapshot storage `replay.stores.make_snapshots`).

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

import torch
import triton
import triton.language as tl

from replayquant.kernels.conventional import conv_launch
from replayquant.kernels.replay_decode import _launch, advance_pointers
from replayquant.replay.roles import PackedRole
from replayquant.replay.stores import (NO_DT_LIMIT, ConventionalStore, ReplayStore,
                                        _check_accept, _indices)
from replayquant.kernels.verify_onepass import onepass_verify

__all__ = ["replay_gdn_verify", "replay_mamba2_verify", "replay_kda_verify", "replay_accept",
           "conventional_gdn_verify", "conventional_mamba2_verify", "conventional_accept"]


# ============================================================================ replay verify

# The verify's read launch: 'step-kernel', replay_decode._replay_kernel's (a pass over the read
# copy per GDN draft); 'onepass', verify_onepass._onepass_kernel's (one pass for all drafts)
VERIFY_DESIGNS = ("step-kernel", "onepass")


def _onepass(design) -> bool:
    if design not in VERIFY_DESIGNS:
        raise ValueError(f"design must be one of {', '.join(map(repr, VERIFY_DESIGNS))}, "
                         f"got {design!r}")
    return design == "onepass"


def replay_gdn_verify(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                      scale=None, out=None, use_qk_l2norm=True, launch=None, beta_scale=1.0,
                      design="step-kernel"):
    """Outputs of T GDN drafts per row [B, T, H, d_v] (Triton: the flush launch for rows that
    pre-flush, the read launch with the pointer move). q, k [B, T, HK, d_k], v [B, T, H, d_v]
    (k, v bf16), a, b [B, T, H]; beta_scale and launch as replay_gdn_step; design: the read
    launch (VERIFY_DESIGNS). Then call replay_accept."""
    if _onepass(design):
        return onepass_verify(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None,
                              state_indices, out, scale, use_qk_l2norm, launch,
                              beta_scale=beta_scale)
    return _launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices, out,
                   scale, use_qk_l2norm, False, launch=launch, beta_scale=beta_scale)


def replay_mamba2_verify(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                         dt_bias=None, out=None, launch=None, dt_limit=NO_DT_LIMIT,
                         design="step-kernel"):
    """Outputs of T Mamba-2 drafts [B, T, H, P] (Triton, as replay_gdn_verify). x [B, T, H, P],
    dt [B, T, H], B, C [B, T, G, N], z [B, T, H, P] (x, B bf16); dt_limit as
    replay_mamba2_step; design as replay_gdn_verify. Then call replay_accept."""
    if _onepass(design):
        return onepass_verify(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z,
                              state_indices, out, None, False, launch, dt_limit=dt_limit)
    return _launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                   None, False, False, launch=launch, dt_limit=dt_limit)


def replay_kda_verify(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                      out=None, use_qk_l2norm=True, launch=None):
    """Outputs of T Kimi Delta Attention drafts per row [B, T, H, d_v] (Triton, as
    replay_gdn_verify). q, k [B, T, HK, d_k], v [B, T, H, d_v] (k, v bf16), g [B, T, H, d_k]
    the log decay per key channel, beta [B, T, H]. Then call replay_accept."""
    return _launch(store, "kda", q, k, v, g, beta, None, None, None, None, state_indices, out,
                   scale, use_qk_l2norm, False, launch=launch)


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


def conventional_gdn_verify(store: ConventionalStore, snaps: PackedRole, q, k, v, a, b, A_log,
                            dt_bias=None, state_indices=None, scale=None, out=None,
                            use_qk_l2norm=True, block_v=None, num_warps=None):
    """T GDN drafts as read-modify-write steps, each cast into its own snapshot (Triton).
    Returns y [B, T, H, d_v]; the state itself is untouched until conventional_accept."""
    return conv_launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices,
                       out, scale, use_qk_l2norm, block_v, num_warps, snaps=snaps)


def conventional_mamba2_verify(store: ConventionalStore, snaps: PackedRole, x, dt, A, B, C,
                               state_indices=None, D=None, z=None, dt_bias=None, out=None,
                               block_v=None, num_warps=None, dt_limit=NO_DT_LIMIT):
    """T Mamba-2 drafts with per-draft snapshots (Triton). Returns y [B, T, H, P].
    dt_limit as conventional_mamba2_step."""
    return conv_launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                       None, False, block_v, num_warps, dt_limit=dt_limit, snaps=snaps)


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
