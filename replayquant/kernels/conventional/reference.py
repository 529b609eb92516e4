"""Torch references of the conventional decode step (`conventional.py`): each kernel `f` there
has its reference `f_ref` here with the same signature and the same in-place effect on the
`ConventionalStore`, as have the per-draft snapshot verify and accept of `verify.py`; the GDN,
KDA and Mamba-2 front ends have their torch twins here, which the replay references and the
torch engine share. Plain torch: importing this module imports no
Triton.

    S_t = Q(a_t deq(S_{t-1}) + u_t k_t^T),   y_t = S_t q_t          (DESIGN section 4)
    KDA:  S_t = Q(deq(S_{t-1}) Diag(a_t) + u_t k_t^T), a_t in (0, 1]^{d_k}
"""

from __future__ import annotations

import math

import torch

from replayquant.replay.frontends import l2norm, l2norm_kda
from replayquant.replay.roles import PackedRole, role_streams
from replayquant.replay.stores import (NO_DT_LIMIT, ConventionalStore, StepTensors, _check_accept,
                                        _indices, dt_limit_args, step_inputs)
from replayquant.streams import ANCHOR


# ---------------------------------------------------------------------------- front ends

def _qk_ref(q, k, HV, scale, norm):
    """q and k of a delta-rule front end in float32: L2-normalised by `norm` (None: as given),
    q scaled by `scale` (default d_k^-1/2), each key head expanded to its HV / HK value heads."""
    q, k = q.float(), k.float()
    if norm is not None:
        q, k = norm(q), norm(k)
    q = q * (scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    r = HV // q.shape[1]
    return q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)


def gdn_frontend_ref(q, k, v, a, b, A_log, dt_bias, scale=None, use_qk_l2norm=True):
    """torch twin of the GDN front end: (q, k expanded to value heads, v, g, beta) in float32."""
    q, k = _qk_ref(q, k, v.shape[1], scale, l2norm if use_qk_l2norm else None)
    x = a.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    g = -torch.exp(A_log.float()) * torch.nn.functional.softplus(x)
    beta = torch.sigmoid(b.float())
    return q, k, v.float(), g, beta


def kda_frontend_ref(q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """torch twin of the KDA front end: (q, k expanded to value heads, v, log_a = g, beta) in
    float32; q, k L2-normalised as transformers' KDA (x / sqrt(sum x^2 + 1e-6), as
    replay.kda_inputs), q scaled by `scale` (default d_k^-1/2)."""
    q, k = _qk_ref(q, k, v.shape[1], scale, l2norm_kda if use_qk_l2norm else None)
    return q, k, v.float(), g.float(), beta.float()


def mamba2_frontend_ref(x, dt, A, Bm, Cm, dt_bias=None, dt_limit=None):
    """torch twin of the Mamba-2 front end: (q = C, k = B per head, v = dt x, log_a = dt A, dt),
    dt = softplus(dt + dt_bias) clamped to dt_limit (None / (0, inf): no clamp)."""
    H, G = x.shape[1], Bm.shape[1]
    lo, hi, clamp = dt_limit_args(dt_limit)
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    d = torch.nn.functional.softplus(d)
    if clamp:
        d = d.clamp(lo, hi)
    r = H // G
    k = Bm.float().repeat_interleave(r, dim=1)
    q = Cm.float().repeat_interleave(r, dim=1)
    return q, k, d.unsqueeze(-1) * x.float(), d * A.float(), d


def mamba2_post_ref(y, x, D=None, z=None):
    if D is not None:
        y = y + D.float()[None, :, None] * x.float()
    if z is not None:
        zf = z.float()
        y = y * zf * torch.sigmoid(zf)
    return y


# ---------------------------------------------------------------------------- conventional step


def _conventional_ref(store, q, k, v, log_a, beta, state_indices, delta):
    st = store.state
    B = q.shape[0]
    idx = _indices(state_indices, B, q.device).long()
    live = (idx >= 0).nonzero().flatten()
    y = torch.zeros(B, st.shape[1], st.shape[2], dtype=torch.float32, device=q.device)
    if live.numel() == 0:
        return y, idx, live
    slots = idx[live]
    S = st.dequantize(slots)
    qq, kk, vv, la = q[live], k[live], v[live], log_a[live]
    S = S * (torch.exp(la)[..., None, :] if la.dim() == 3 else torch.exp(la)[..., None, None])
    if delta:
        u = beta[live][..., None] * (vv - (S * kk[:, :, None, :]).sum(-1))
    else:
        u = vv
    S = S + u[..., :, None] * kk[:, :, None, :]
    y[live] = (S * qq[:, :, None, :]).sum(-1)
    streams = role_streams(store.n_casts[slots].cpu() + 1, ANCHOR, slots.cpu(), st.shape[1])
    st.write_(slots, S, store.key, streams)
    return y, idx, live


def _into(out, y):
    """A reference's result, written into the caller's `out` buffer where given (the kernels'
    contract), else returned as is."""
    if out is None:
        return y
    out.copy_(y)
    return out


def conventional_gdn_step_ref(store: ConventionalStore, q, k, v, a, b, A_log, dt_bias=None,
                              state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                              advance=True):
    """torch reference of conventional_gdn_step (same signature, same in-place effect)."""
    qf, kf, vf, g, beta = gdn_frontend_ref(q, k, v, a, b, A_log, dt_bias, scale, use_qk_l2norm)
    y, idx, live = _conventional_ref(store, qf, kf, vf, g, beta, state_indices, True)
    if advance and live.numel():
        store.n_casts[idx[live]] += 1
    return _into(out, y)


def conventional_kda_step_ref(store: ConventionalStore, q, k, v, g, beta, state_indices=None,
                              scale=None, out=None, use_qk_l2norm=True, advance=True):
    """torch reference of conventional_kda_step (same signature, same in-place effect)."""
    step_inputs("kda", store.state.shape, False, StepTensors(q, k, v, g, beta))
    qf, kf, vf, la, bf = kda_frontend_ref(q, k, v, g, beta, scale, use_qk_l2norm)
    y, idx, live = _conventional_ref(store, qf, kf, vf, la, bf, state_indices, True)
    if advance and live.numel():
        store.n_casts[idx[live]] += 1
    return _into(out, y)


def conventional_mamba2_step_ref(store: ConventionalStore, x, dt, A, B, C, state_indices=None,
                                 D=None, z=None, dt_bias=None, out=None, advance=True,
                                 dt_limit=NO_DT_LIMIT):
    """torch reference of conventional_mamba2_step."""
    q, k, v, log_a, _ = mamba2_frontend_ref(x, dt, A, B, C, dt_bias, dt_limit)
    y, idx, live = _conventional_ref(store, q, k, v, log_a, None, state_indices, False)
    y = mamba2_post_ref(y, x, D, z)
    y[idx < 0] = 0
    if advance and live.numel():
        store.n_casts[idx[live]] += 1
    return _into(out, y)


# ---------------------------------------------------------------------------- speculative verify
# (the per-draft snapshot baseline of `verify.py`: snapshots from replay.stores.make_snapshots)


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
                                use_qk_l2norm=True):
    """torch reference of conventional_gdn_verify (SR streams keyed by the slot id)."""
    B, T = q.shape[:2]
    fe = gdn_frontend_ref(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), a.flatten(0, 1),
                          b.flatten(0, 1), A_log, dt_bias, scale, use_qk_l2norm)
    fe = tuple(t.unflatten(0, (B, T)) for t in fe)
    y = _conv_verify_ref(store, snaps, fe, state_indices, None)
    return _into(out, y)


def conventional_mamba2_verify_ref(store: ConventionalStore, snaps: PackedRole, x, dt, A, B, C,
                                   state_indices=None, D=None, z=None, dt_bias=None, out=None,
                                   dt_limit=NO_DT_LIMIT):
    """torch reference of conventional_mamba2_verify."""
    Bt, T = x.shape[:2]
    q, k, v, log_a, _ = mamba2_frontend_ref(x.flatten(0, 1), dt.flatten(0, 1), A,
                                            B.flatten(0, 1), C.flatten(0, 1), dt_bias, dt_limit)
    fe = tuple(t.unflatten(0, (Bt, T)) for t in (q, k, v, log_a)) + (None,)
    post = lambda y, b_, t: mamba2_post_ref(y[None], x[b_:b_ + 1, t], D,  # noqa: E731
                                            None if z is None else z[b_:b_ + 1, t])[0]
    y = _conv_verify_ref(store, snaps, fe, state_indices, post)
    return _into(out, y)
