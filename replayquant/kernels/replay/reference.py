"""Torch references of the replay decode step, verify and accept (`decode`, `verify`):
the same signatures and the same effect on a `ReplayStore`, element by element in float32;
tests compare the kernels with them, and both with `ReplayState`.

Per row: a pre-flush folds the committed entries when they would not leave T free slots
(h + T > L, h > 0); a step whose entry fills the buffer (or a forced step) rebuilds the
unrounded state from the anchor and its entries, applies the step, outputs S q and casts both
roles from S; any other step or draft reads the read copy and the buffer and appends its entry.
"""

from __future__ import annotations

import torch

from replayquant.formats import as_bits
from replayquant.formats.casts import nvfp4_carried_scale_ref
from replayquant.kernels.conventional.reference import (_into, gdn_frontend_ref, kda_frontend_ref,
                                                        mamba2_frontend_ref, mamba2_post_ref)
from replayquant.kernels.replay.launch import replay_launch_config
from replayquant.replay.roles import role_streams
from replayquant.replay.stores import (NO_DT_LIMIT, ReplayStore, _begin, _check_accept,
                                        _default_force, _indices, carried_amax,
                                        carried_entry, cast_overflows,
                                        fill_key_factors_ref, folds_u, key_factors_ref,
                                        ring_keys, solves_u)
from replayquant.streams import ANCHOR, READ

__all__ = ["replay_gdn_step_ref", "replay_mamba2_step_ref", "replay_gdn_verify_ref",
           "replay_mamba2_verify_ref", "replay_kda_step_ref", "replay_kda_verify_ref", "replay_accept_ref", "advance_pointers_ref",
           "replay_ref_core", "key_factors_ref", "fill_key_factors_ref"]


def advance_pointers_ref(store: ReplayStore, state_indices, T: int = 1, step: bool = True,
                         force_flush: bool | None = None, accepted=None):
    """torch reference of decode.advance_pointers."""
    force_flush = _default_force(store, step, accepted, force_flush)
    idx = _indices(state_indices, state_indices.shape[0], store.committed.device)
    for b, s in enumerate(idx.long().tolist()):
        if s < 0:
            continue
        h, nf, st = int(store.committed[s]), int(store.n_flush[s]), int(store.start[s])
        if accepted is not None:
            h += int(accepted[b])
        else:
            if h + T > store.buffer_len and h > 0:
                nf, st, h = nf + 1, (st + h) % store.capacity, 0
            if step:
                if h + 1 == store.buffer_len or force_flush:
                    nf, h = nf + 1, 0
                else:
                    h += 1
        store.committed[s] = h
        store.n_flush[s] = nf
        store.start[s] = st


def _entries_ref(store: ReplayStore, s: int, n: int, start: int):
    """Float32 entries 0..n-1 of slot s for all heads: K [H, n, dk] (GDN / KDA re-normalised),
    V (GDN / KDA raw v; Mamba-2 v = dt x) [H, n, dv], U (stored u) [H, n, dv], G [H, n]
    (KDA: [H, n, dk], per key channel), Bt [H, n]."""
    H = store.shape[1]
    pos = [(start + j) % store.capacity for j in range(n)]
    K = ring_keys(store.kind, store.kbuf[s, pos].float().transpose(0, 1)
                  .repeat_interleave(H // store.key_heads, dim=0))
    V = store.vbuf[s, pos].float().transpose(0, 1)
    G = store.Gbuf[s, pos].transpose(0, 1)
    Bt = store.bbuf[s, pos].transpose(0, 1)
    if store.kind == "mamba2":
        V = Bt.unsqueeze(-1) * V
    U = None if store.ubuf is None else store.ubuf[s, pos].float().transpose(0, 1)
    return K, V, U, G, Bt


def _key_factor_rows_ref(store: ReplayStore, s: int, start: int, lo: int, n: int):
    """Tbuf rows of window entries lo..n-1 of slot s, from the ring's first n entries."""
    K, _, _, G, Bt = _entries_ref(store, s, n, start)
    T = key_factors_ref(K, G, Bt)
    for j in range(lo, n):
        e = (start + j) % store.capacity
        store.Tbuf[s, e] = 0.0
        store.Tbuf[s, e, :, :n] = T[:, j]


def _rebuild_ref(A, K, V, G, Bt, delta, cur=None, vec=False, U=None):
    """Unrounded state after the entries (K [H, n, dk], V [H, n, dv], G, Bt [H, n]) and, if given,
    the current step cur = (k, v, log_a, beta) [H, ...], from checkpoint A [H, dv, dk]: GDN as
    the recurrence entry by entry (a_j = exp(G_j - G_{j-1}); the kernel solves the same
    triangular system in WY form; with U [H, n, dv], the cached u of a store that folds it,
    decode.folds_u, u_j = U_j), Mamba-2 as the closed form exp(G_n) A +
    sum_j exp(G_n - G_j) v_j k_j^T; the current step as the conventional step. vec (KDA):
    G [H, n, dk] and log_a [H, dk] decay each key channel (column) of S."""
    n = G.shape[1]
    H = A.shape[0]
    col = (lambda x: x[:, None, :]) if vec else (lambda x: x[:, None, None])  # noqa: E731
    if delta:
        S = A
        Gprev = G.new_zeros(G.shape[:1] + G.shape[2:])
        for j in range(n):
            S = S * col(torch.exp(G[:, j] - Gprev))
            if U is None:
                u = Bt[:, j:j + 1] * (V[:, j] - (S * K[:, j].unsqueeze(1)).sum(-1))
            else:
                u = U[:, j]
            S = S + u.unsqueeze(-1) * K[:, j].unsqueeze(1)
            Gprev = G[:, j]
    else:
        Gn = G[:, n - 1] if n > 0 else torch.zeros(H, device=A.device)
        S = A * torch.exp(Gn)[:, None, None]
        for j in range(n):
            S = S + (torch.exp(Gn - G[:, j]).unsqueeze(-1) * V[:, j]).unsqueeze(-1) \
                * K[:, j].unsqueeze(1)
    if cur is not None:
        k, v, log_a, beta = cur
        S = S * col(torch.exp(log_a))
        u = beta.unsqueeze(-1) * (v - (S * k.unsqueeze(1)).sum(-1)) if delta else v
        S = S + u.unsqueeze(-1) * k.unsqueeze(1)
    return S


def _write_roles_ref(store: ReplayStore, s: int, S, fi: int, back: int = 0) -> bool:
    """Both roles of slot s cast from S; a tile of the flush launch (replay_launch_config's rows
    of one head) whose S holds NaN or infinity, or whose cast into either role does (an FP16
    role past 65504, stores.cast_overflows), keeps both roles as they were, as in the kernel.
    back: 1 for a flush step after its launch's pre-flush (_carried_ref). Returns whether a cast
    overflowed."""
    H = store.shape[1]
    bv = replay_launch_config(store, "flush")[0]
    roles = [(r, w) for r, w in ((store.anchor, ANCHOR), (store.read, READ)) if r is not None]

    def tiles(m):                 # [H, dv, dk] -> [H, dv, 1]: m anywhere in the row's tile
        return m.unflatten(1, (-1, bv)).flatten(2).any(2).repeat_interleave(bv, 1)[:, :, None]

    keep = tiles(~torch.isfinite(S))
    over = torch.zeros_like(keep)
    for r, w in roles:
        if cast_overflows(r.fmt):
            pay = r.encode(torch.where(keep, 0.0, S)[None], store.key,
                           role_streams(fi, w, [s], H))[0][0]
            over = over | tiles(~torch.isfinite(pay))
    keep = keep | over
    if bool(keep.any()):
        before = [[None if t is None else as_bits(t)[s].clone()
                   for t in (r.payload, r.scale, r.gscale)] for r, _ in roles]
        _write_roles_ref(store, s, torch.where(keep, 0.0, S), fi, back)
        for (r, _), old in zip(roles, before):        # the kept tiles' bytes as they were
            for t, o in zip((r.payload, r.scale, r.gscale), old):
                if t is not None:
                    m = keep if o.dim() == 3 else keep[..., 0] if o.dim() == 2 else \
                        keep[..., 0].all(1)          # a matrix's scale: all its tiles kept
                    as_bits(t)[s] = torch.where(m, o, as_bits(t)[s])
        return bool(over.any())
    for r, w in roles:
        gs = _carried_ref(store, s, S, fi, back) if w == READ and store.carried is not None \
            else None
        r.write_([s], S[None], store.key, role_streams(fi, w, [s], H), gscale=gs)
    return False


def _carried_ref(store: ReplayStore, s: int, S, fi: int, back: int = 0):
    """The carried global scales [1, H] of flush fi's read copy of slot s (stores: from the amax
    of flush fi - 1 - back, the last one of an earlier launch), after noting S's amax (a kept
    tile's rows are zero in S) as flush fi's."""
    rec = store.carried[s]
    prev = carried_amax(rec[:, (fi - 1 - back) % 3])
    rec[:, fi % 3] = torch.maximum(rec[:, fi % 3], carried_entry(S.abs().amax(dim=(-2, -1)), fi))
    return nvfp4_carried_scale_ref(prev)[None]


def _read_token_ref(R, K, X, G, Gp, qt, kt, vt, bt, delta: bool, vec: bool, bf):
    """One read step of a row: its output [H, d_v] from the read copy R and the p buffered
    entries K [H, p, dk], X (u, or Mamba-2's v) [H, p, dv], G (cumulative log gates) before it,
    Gp this step's cumulative gate; and what it buffers (GDN / KDA: u rounded to the ring's
    dtype bf; Mamba-2: v)."""
    if vec:             # decays per key channel: into the keys, the read copy's columns
        wdec = torch.exp(Gp.unsqueeze(1) - G)                   # [H, p, dk]
        eG = torch.exp(Gp)                                       # [H, dk]
        rk = (R * (eG * kt).unsqueeze(1)).sum(-1)
        rq = (R * (eG * qt).unsqueeze(1)).sum(-1)
        kk = (wdec * K * kt.unsqueeze(1)).sum(-1)
        qk = (wdec * K * qt.unsqueeze(1)).sum(-1)
        bt = bt.unsqueeze(-1)
        u = bt * (vt - rk) - bt * torch.einsum("hj,hjd->hd", kk, X)
        u = u.to(bf).float()
        return rq + torch.einsum("hj,hjd->hd", qk, X) + (kt * qt).sum(-1, keepdim=True) * u, u
    wdec = torch.exp(Gp.unsqueeze(-1) - G)                      # [H, p]
    eG = torch.exp(Gp)
    if delta:
        corr = torch.einsum("hj,hjd->hd", wdec * (K * kt.unsqueeze(1)).sum(-1), X)
        rk = (R * kt.unsqueeze(1)).sum(-1)
        bt = bt.unsqueeze(-1)
        u = bt * (vt - eG.unsqueeze(-1) * rk) - bt * corr
        u = u.to(bf).float()
    else:
        u = vt
    qk = (K * qt.unsqueeze(1)).sum(-1)
    y = eG.unsqueeze(-1) * (R * qt.unsqueeze(1)).sum(-1) \
        + torch.einsum("hj,hjd->hd", wdec * qk, X) + (kt * qt).sum(-1, keepdim=True) * u
    return y, u


def replay_ref_core(store: ReplayStore, fe, raw, state_indices, T: int, step: bool, force: bool,
                    post=None, record=None):
    """Torch twin of _replay_kernel. fe: front-end tensors (q, k, v, log_a, gate2) float32 with
    value heads, each [B, T, H, ...] (gate2: GDN beta, Mamba-2 dt); raw: (k raw [B, T, HK, dk],
    x/v raw [B, T, H, dv]) as stored. post(y, b, t) applies the Mamba-2 D skip / z gate.
    record: a step's FaultRecord (its `note` of the step made), whose flush-cast column notes
    the rows whose flush kept its roles for a cast that overflowed. Returns y [B, T, H, dv]."""
    q, k, v, log_a, beta = fe
    kraw, xraw = raw
    delta = store.kind != "mamba2"
    vec = store.kind == "kda"
    B = q.shape[0]
    N, H, dv, dk = store.shape
    buffer_len = store.buffer_len
    idx = _indices(state_indices, B, q.device).long()
    y = torch.zeros(B, T, H, dv, dtype=torch.float32, device=q.device)
    bf = torch.bfloat16 if store.ubuf is None else store.ubuf.dtype
    fold = folds_u(store)
    over = torch.zeros(B, dtype=torch.bool)
    for b_, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        h, nf, start = int(store.committed[s]), int(store.n_flush[s]), int(store.start[s])
        back = 0                # a flush after this launch's pre-flush: the scale before it
        if h + T > buffer_len and h > 0:
            K, V, U, G, Bt = _entries_ref(store, s, h, start)
            S = _rebuild_ref(store.anchor.dequantize([s])[0], K, V, G, Bt, delta, vec=vec,
                             U=U if fold else None)
            over[b_] |= _write_roles_ref(store, s, S, nf + 1)
            nf, start, h, back = nf + 1, (start + h) % store.capacity, 0, 1
        if step and (h + 1 == buffer_len or force):
            K, V, U, G, Bt = _entries_ref(store, s, h, start)
            S = _rebuild_ref(store.anchor.dequantize([s])[0], K, V, G, Bt, delta,
                             cur=(k[b_, 0], v[b_, 0], log_a[b_, 0], beta[b_, 0]), vec=vec,
                             U=U if fold else None)
            y[b_, 0] = (S * q[b_, 0].unsqueeze(1)).sum(-1)
            over[b_] |= _write_roles_ref(store, s, S, nf + 1, back)
        else:
            R = store.read_role.dequantize([s])[0]
            K, V, U, G, Bt = _entries_ref(store, s, h, start)
            X = U if delta else V
            Gp = G[:, h - 1] if h > 0 else G.new_zeros(G.shape[:1] + G.shape[2:])
            for t in range(T):
                p = h + t
                Gp = Gp + log_a[b_, t]
                kt = k[b_, t]
                y[b_, t], u = _read_token_ref(R, K, X, G, Gp, q[b_, t], kt, v[b_, t], beta[b_, t],
                                              delta, vec, bf)
                K = torch.cat([K, kt.unsqueeze(1)], 1)
                X = torch.cat([X, u.unsqueeze(1)], 1)
                G = torch.cat([G, Gp.unsqueeze(1)], 1)
                e = (start + p) % store.capacity
                store.kbuf[s, e] = kraw[b_, t].to(store.kbuf.dtype)    # the ring's dtype
                store.vbuf[s, e] = xraw[b_, t].to(store.vbuf.dtype)
                if delta:
                    store.ubuf[s, e] = u.to(store.ubuf.dtype)
                store.bbuf[s, e] = beta[b_, t]
                store.Gbuf[s, e] = Gp
                if solves_u(store) and store.Tbuf is not None:   # a float32 ring keeps none
                    _key_factor_rows_ref(store, s, start, p, p + 1)
        if post is not None:
            for t in range(T):
                y[b_, t] = post(y[b_, t], b_, t)
    if record is not None:
        record.note_cast(over.to(q.device), state_indices)
    return y


def _gdn_fe(q, k, v, a, b, A_log, dt_bias, scale, use_qk_l2norm, beta_scale):
    """The GDN front end of [B, T, ...] inputs, each [B, T, H, ...]; beta = beta_scale sigmoid(b)."""
    B, T = q.shape[:2]
    fe = gdn_frontend_ref(*(t.flatten(0, 1) for t in (q, k, v, a, b)), A_log, dt_bias, scale,
                          use_qk_l2norm)
    fe = [t.unflatten(0, (B, T)) for t in fe]
    fe[4] = fe[4] * float(beta_scale)
    return tuple(fe)


def _mamba2_fe(x, dt, A, Bm, C, dt_bias, dt_limit):
    Bt, T = x.shape[:2]
    fe = mamba2_frontend_ref(x.flatten(0, 1), dt.flatten(0, 1), A, Bm.flatten(0, 1),
                             C.flatten(0, 1), dt_bias, dt_limit)
    return tuple(t.unflatten(0, (Bt, T)) for t in fe)


def _mamba2_post(x, D, z):
    """post(y, b, t) of replay_ref_core for x, z [B, T, H, P]."""
    return lambda y, b_, t: mamba2_post_ref(y[None], x[b_:b_ + 1, t], D,  # noqa: E731
                                            None if z is None else z[b_:b_ + 1, t])[0]


def replay_gdn_step_ref(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None,
                        state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                        path="auto", advance=True, beta_scale=1.0, record=None):
    """torch reference of replay_gdn_step (same signature, same effect on the store)."""
    force = _begin(store, "gdn", True, path)
    if record is not None:
        record.note("gdn", (q, k, v, a, b), state_indices, advance)
    store.last_force = force
    one = lambda t: t.unsqueeze(1)  # noqa: E731
    fe = _gdn_fe(one(q), one(k), one(v), one(a), one(b), A_log, dt_bias, scale, use_qk_l2norm,
                 beta_scale)
    y = replay_ref_core(store, fe, (one(k), one(v)), state_indices, 1, True, force,
                        record=record)[:, 0]
    if advance:
        advance_pointers_ref(store, _indices(state_indices, q.shape[0], q.device), 1, True, force)
    return _into(out, y)


def replay_mamba2_step_ref(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None, z=None,
                           dt_bias=None, out=None, path="auto", advance=True,
                           dt_limit=NO_DT_LIMIT, record=None):
    """torch reference of replay_mamba2_step."""
    force = _begin(store, "mamba2", True, path)
    if record is not None:
        record.note("mamba2", (C, B, x, dt), state_indices, advance)
    store.last_force = force
    one = lambda t: None if t is None else t.unsqueeze(1)  # noqa: E731
    fe = _mamba2_fe(one(x), one(dt), A, one(B), one(C), dt_bias, dt_limit)
    y = replay_ref_core(store, fe, (one(B), one(x)), state_indices, 1, True, force,
                        _mamba2_post(one(x), D, one(z)), record=record)[:, 0]
    if advance:
        advance_pointers_ref(store, _indices(state_indices, x.shape[0], x.device), 1, True, force)
    return _into(out, y)


def replay_gdn_verify_ref(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None,
                          state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                          beta_scale=1.0):
    """torch reference of replay_gdn_verify."""
    T = q.shape[1]
    _begin(store, "gdn", False, None)
    fe = _gdn_fe(q, k, v, a, b, A_log, dt_bias, scale, use_qk_l2norm, beta_scale)
    y = replay_ref_core(store, fe, (k, v), state_indices, T, False, False)
    advance_pointers_ref(store, _indices(state_indices, q.shape[0], q.device), T, step=False)
    store.pending_T = T
    return _into(out, y)


def replay_mamba2_verify_ref(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None,
                             z=None, dt_bias=None, out=None, dt_limit=NO_DT_LIMIT):
    """torch reference of replay_mamba2_verify."""
    T = x.shape[1]
    _begin(store, "mamba2", False, None)
    fe = _mamba2_fe(x, dt, A, B, C, dt_bias, dt_limit)
    y = replay_ref_core(store, fe, (B, x), state_indices, T, False, False, _mamba2_post(x, D, z))
    advance_pointers_ref(store, _indices(state_indices, x.shape[0], x.device), T, step=False)
    store.pending_T = T
    return _into(out, y)


def _kda_fe(q, k, v, g, beta, scale, use_qk_l2norm):
    """The KDA front end of [B, T, ...] inputs, each [B, T, H, ...]."""
    B, T = q.shape[:2]
    fe = kda_frontend_ref(*(t.flatten(0, 1) for t in (q, k, v, g, beta)), scale, use_qk_l2norm)
    return tuple(t.unflatten(0, (B, T)) for t in fe)


def replay_kda_step_ref(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                        out=None, use_qk_l2norm=True, path="auto", advance=True,
                        record=None):
    """torch reference of replay_kda_step."""
    force = _begin(store, "kda", True, path)
    if record is not None:
        record.note("kda", (q, k, v, g, beta), state_indices, advance)
    store.last_force = force
    one = lambda t: t.unsqueeze(1)  # noqa: E731
    fe = _kda_fe(one(q), one(k), one(v), one(g), one(beta), scale, use_qk_l2norm)
    y = replay_ref_core(store, fe, (one(k), one(v)), state_indices, 1, True, force,
                        record=record)[:, 0]
    if advance:
        advance_pointers_ref(store, _indices(state_indices, q.shape[0], q.device), 1, True, force)
    return _into(out, y)


def replay_kda_verify_ref(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                          out=None, use_qk_l2norm=True):
    """torch reference of replay_kda_verify."""
    T = q.shape[1]
    _begin(store, "kda", False, None)
    fe = _kda_fe(q, k, v, g, beta, scale, use_qk_l2norm)
    y = replay_ref_core(store, fe, (k, v), state_indices, T, False, False)
    advance_pointers_ref(store, _indices(state_indices, q.shape[0], q.device), T, step=False)
    store.pending_T = T
    return _into(out, y)


def replay_accept_ref(store: ReplayStore, n, state_indices=None, check=True):
    """torch reference of verify.replay_accept."""
    T = getattr(store, "pending_T", None)
    if not T:
        raise ValueError("accept: no drafts pending; call verify first")
    B = n.shape[0] if isinstance(n, torch.Tensor) else state_indices.shape[0]
    idx = _indices(state_indices, B, store.committed.device)
    n = _check_accept(n, B, T, store.committed.device)
    advance_pointers_ref(store, idx, accepted=n)
    store.pending_T = None

