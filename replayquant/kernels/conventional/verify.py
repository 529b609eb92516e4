"""Speculative decoding kernels of the conventional store: the per-draft snapshot baseline
(vLLM's scheme; torch references in `reference`, snapshot storage
`replay.stores.make_snapshots`).

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

from replayquant.kernels.conventional.kernel import conv_launch
from replayquant.replay.roles import PackedRole
from replayquant.replay.stores import NO_DT_LIMIT, ConventionalStore, _check_accept, _indices

__all__ = ["conventional_gdn_verify", "conventional_mamba2_verify", "conventional_accept"]


def conventional_gdn_verify(store: ConventionalStore, snaps: PackedRole, q, k, v, a, b, A_log,
                            dt_bias=None, state_indices=None, scale=None, out=None,
                            use_qk_l2norm=True):
    """T GDN drafts as read-modify-write steps, each cast into its own snapshot (Triton).
    Returns y [B, T, H, d_v]; the state itself is untouched until conventional_accept."""
    return conv_launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices,
                       out, scale, use_qk_l2norm, snaps=snaps)


def conventional_mamba2_verify(store: ConventionalStore, snaps: PackedRole, x, dt, A, B, C,
                               state_indices=None, D=None, z=None, dt_bias=None, out=None,
                               dt_limit=NO_DT_LIMIT):
    """T Mamba-2 drafts with per-draft snapshots (Triton). Returns y [B, T, H, P].
    dt_limit as conventional_mamba2_step."""
    return conv_launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                       None, False, dt_limit=dt_limit, snaps=snaps)


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
