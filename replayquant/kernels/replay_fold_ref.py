"""Torch reference of the deferred-fold decode step (`replay_fold`, design='deferred-fold'): the
same signatures as replay_gdn_step_ref / replay_mamba2_step_ref and the same effect on a
`ReplayStore` as the kernel, element by element in float32.

A step of that schedule is, on the store, a verify of one draft that is then accepted: a row
whose window is full (h == L) folds it into the anchor first (replay_ref_core's pre-flush), the
token is read against the anchor and the entries left and appended, and then committed
(h += 1); no step flushes by itself, so a row holds h == L entries after the step that fills
its window, as after accepted drafts that fill it.
"""

from __future__ import annotations

import torch

from replayquant.kernels.conventional_ref import _into
from replayquant.kernels.replay_ref import (_gdn_fe, _mamba2_fe, _mamba2_post,
                                            advance_pointers_ref, replay_ref_core)
from replayquant.replay.stores import NO_DT_LIMIT, ReplayStore, _begin, _indices

__all__ = ["replay_fold_step_ref", "replay_gdn_fold_step_ref", "replay_mamba2_fold_step_ref",
           "fold_advance_pointers_ref"]


def fold_advance_pointers_ref(store: ReplayStore, state_indices) -> None:
    """torch reference of replay_fold.fold_advance_pointers."""
    advance_pointers_ref(store, state_indices, T=1, step=False)
    advance_pointers_ref(store, state_indices,
                         accepted=torch.ones(state_indices.shape[0], dtype=torch.int32))


def replay_fold_step_ref(store: ReplayStore, kind, fe, raw, state_indices, post=None,
                         advance=True):
    """One deferred-fold step of the front-end tensors fe ([B, 1, H, ...], replay_ref_core's)
    and the raw k / x ([B, 1, ...]); returns y [B, H, d_v]."""
    if store.capacity < store.buffer_len + 1:
        raise ValueError("the deferred fold needs a ring of L + 1 entries (max_drafts >= 1)")
    _begin(store, kind, True, "auto")
    store.last_force = False
    y = replay_ref_core(store, fe, raw, state_indices, 1, False, False, post=post)[:, 0]
    if advance:
        fold_advance_pointers_ref(store, _indices(state_indices, y.shape[0], y.device))
    return y


def replay_gdn_fold_step_ref(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None,
                             state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                             advance=True, beta_scale=1.0):
    """torch reference of replay_gdn_step(..., design='deferred-fold')."""
    one = lambda t: t.unsqueeze(1)  # noqa: E731
    fe = _gdn_fe(one(q), one(k), one(v), one(a), one(b), A_log, dt_bias, scale, use_qk_l2norm,
                 beta_scale)
    idx = _indices(state_indices, q.shape[0], q.device)
    return _into(out, replay_fold_step_ref(store, "gdn", fe, (one(k), one(v)), idx,
                                           advance=advance))


def replay_mamba2_fold_step_ref(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None,
                                z=None, dt_bias=None, out=None, advance=True,
                                dt_limit=NO_DT_LIMIT):
    """torch reference of replay_mamba2_step(..., design='deferred-fold')."""
    one = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    fe = _mamba2_fe(one(x), one(dt), A, one(B), one(C), dt_bias, dt_limit)
    idx = _indices(state_indices, x.shape[0], x.device)
    return _into(out, replay_fold_step_ref(store, "mamba2", fe, (one(B), one(x)), idx,
                                           post=_mamba2_post(one(x), D, one(z)),
                                           advance=advance))
