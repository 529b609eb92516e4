"""Speculative decoding kernels of the replay store: verify + accept (torch references in
`reference`; the conventional per-draft snapshot baseline is `conventional.verify`).

Replay (DESIGN section 4, `ReplayState.verify` / `accept`):

    y = replay_gdn_verify(store, q, k, v, a, b, A_log, dt_bias, state_indices)   # [B, T, H, d_v]
    replay_accept(store, n, state_indices)                                      # pointer move only

  Rows whose committed entries would not leave T free slots (h + T > L, h > 0) flush them first
  (inside the same launch, `decode._replay_kernel`); the T drafts are appended after the
  committed pointer and read in order against the read copy and the buffer, draft t seeing the
  drafts before it. Nothing committed changes; accept adds n to the committed length. A flush
  never folds uncommitted drafts (rejected entries are simply overwritten later).
"""

from __future__ import annotations

import torch

from replayquant.kernels.replay.decode import _launch, advance_pointers
from replayquant.kernels.replay.launch import chosen_design
from replayquant.replay.stores import NO_DT_LIMIT, ReplayStore, _check_accept, _indices
from replayquant.kernels.replay.verify_onepass import onepass_verify

__all__ = ["replay_gdn_verify", "replay_mamba2_verify", "replay_kda_verify", "replay_accept"]


# ============================================================================ replay verify

# The verify's read launch: 'onepass', verify_onepass._onepass_kernel's (one pass over the read
# copy for all drafts; the default: T = 4 rounds at B = 512 on an H100 1.24-1.93x faster than
# the step kernel's for GDN and Mamba-2, s32_rs / tp8_hi32 / tp4_hi32, docs/kernels.md);
# 'step-kernel', decode._replay_kernel's (a pass over the read copy per GDN draft; KDA's verify)
VERIFY_DESIGNS = ("onepass", "step-kernel")


def _onepass(design) -> bool:
    return chosen_design(design, VERIFY_DESIGNS) == "onepass"


def replay_gdn_verify(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None, state_indices=None,
                      scale=None, out=None, use_qk_l2norm=True, beta_scale=1.0,
                      design="onepass"):
    """Outputs of T GDN drafts per row [B, T, H, d_v] (Triton: the flush launch for rows that
    pre-flush, the read launch with the pointer move). q, k [B, T, HK, d_k], v [B, T, H, d_v]
    (k, v bf16), a, b [B, T, H]; beta_scale as replay_gdn_step; design: the read launch
    (VERIFY_DESIGNS). Then call replay_accept."""
    if _onepass(design):
        return onepass_verify(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None,
                              state_indices, out, scale, use_qk_l2norm, beta_scale=beta_scale)
    return _launch(store, "gdn", q, k, v, a, b, A_log, dt_bias, None, None, state_indices, out,
                   scale, use_qk_l2norm, False, beta_scale=beta_scale)


def replay_mamba2_verify(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                         dt_bias=None, out=None, dt_limit=NO_DT_LIMIT,
                         design="onepass"):
    """Outputs of T Mamba-2 drafts [B, T, H, P] (Triton, as replay_gdn_verify). x [B, T, H, P],
    dt [B, T, H], B, C [B, T, G, N], z [B, T, H, P] (x, B bf16); dt_limit as
    replay_mamba2_step; design as replay_gdn_verify. Then call replay_accept."""
    if _onepass(design):
        return onepass_verify(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z,
                              state_indices, out, None, False, dt_limit=dt_limit)
    return _launch(store, "mamba2", C, B, x, dt, None, A, dt_bias, D, z, state_indices, out,
                   None, False, False, dt_limit=dt_limit)


def replay_kda_verify(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                      out=None, use_qk_l2norm=True):
    """Outputs of T Kimi Delta Attention drafts per row [B, T, H, d_v] (Triton, as
    replay_gdn_verify). q, k [B, T, HK, d_k], v [B, T, H, d_v] (k, v bf16), g [B, T, H, d_k]
    the log decay per key channel, beta [B, T, H]. Then call replay_accept."""
    return _launch(store, "kda", q, k, v, g, beta, None, None, None, None, state_indices, out,
                   scale, use_qk_l2norm, False)


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
