"""The replay decode step on a `ReplayStore` in torch, vectorised over the batch rows and with no
host synchronisation: the torch engine of a patched model's decode (the CPU, or dims the Triton
kernel does not take), on the same store layout as the kernel. It steps a store with a bf16
ring as the kernel does, or one with a float32 ring (`ReplayStore.from_state(ring_dtype=
torch.float32)`: u in float32 too and no key factors, which only the kernel's flush reads), the
patched models' CPU path, whose decode then equals `ReplayState.step` within float32
reassociation. torch.compile(fullgraph=True) traces a step without a graph break.

Every row computes both branches of `reference.replay_ref_core` and keeps its own with
torch.where: a row whose entry fills the buffer (committed + 1 == L, or path 'flush') rebuilds
the unrounded state from the anchor and its entries, applies the step, outputs S q and casts
both roles from S (SR streams of flush index n_flush + 1, as the reference); any other row
reads the read copy and the ring and appends its entry (and, for a GDN store that solves for
u, the row of its key factors). Window entries are the L positions from `start`, those at and
past the row's fill masked to zero (never-written entries may hold NaN). Writes go through
index_put at the rows' slots: a row that keeps a tensor writes back what it read, and padding
rows (negative state index) write what the first live row writes, so that no two writes to one
place differ. Live rows must name distinct slots (as for the kernel). In a store built for
drafts (max_drafts), a row whose accepted drafts filled the buffer (committed == L) first
folds them into both roles, as the reference's pre-flush.

Against the reference: the flush (the recurrence from the anchor, the casts with their SR
bits, the kept tiles of a non-finite state or cast, the pointers) is the reference's arithmetic
element by element, and so are the ring's k, v, beta and gate entries. The read branch sums over
the L window positions (the masked ones add zeros) where the reference sums over the row's h
entries (`einsum` over j), and the key factors come from one triangular solve over the L positions
where the reference solves over h + 1: where a platform's matmul or solve orders these sums
differently, the outputs, u and the key factors move by float32 reassociation (about 1e-6
relative); u stored in bf16 may then lie one bf16 step apart where it sat on a rounding
boundary, and in a store that folds the ring's u (folds_u) the flush's state moves as much, so
that a rounded role may differ by one code where a value sits on a rounding boundary. On the
CPU at d = 16 every store tensor and output comes out bit for bit
(tests/kernels/replay/test_replay_torch.py); at d_v = 64 the CPU's bmm sums the zero-padded
window in another order (L = 8, 26 steps, GDN, Mamba-2 and KDA, four pairs): outputs within
2.5e-7 of their largest, the key factors 3e-8, the FP32 u and roles of a folding store 1.1e-7,
every rounded role and bf16 u the same bytes.

Cost: the flush branch (L - 1 entries of the recurrence and both casts) runs for every row at
every step, where the reference runs it for the rows that flush; the price of deciding nothing
on the host.
"""

from __future__ import annotations

import math

import torch

from replayquant.kernels.conventional.reference import (_into, gdn_frontend_ref, kda_frontend_ref,
                                                        mamba2_frontend_ref, mamba2_post_ref)
from replayquant.formats.philox import random_bits_torch
from replayquant.kernels.replay.launch import replay_launch_config
from replayquant.replay.stores import (NO_DT_LIMIT, ReplayStore, StepTensors, _begin,
                                        _check_buffered, _indices, cast_overflows, folds_u, pow2_16,
                                        ring_keys, solves_u, step_inputs)
from replayquant.streams import ANCHOR, READ, sr_stream

__all__ = ["replay_gdn_step_torch", "replay_mamba2_step_torch", "replay_kda_step_torch"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as integers of its width: where and index_put move bytes, NaN payloads too."""
    if t.is_floating_point():
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return t


class _Rows:
    """The batch rows of a step: slot (padding rows read slot 0), live (state index >= 0), and
    the row src whose values each row writes (itself, or for a padding row the first live row)."""

    def __init__(self, state_indices, B: int, device):
        idx = _indices(state_indices, B, device).long()
        self.live = idx >= 0
        self.slot = idx.clamp(min=0)
        first = torch.argmax(self.live.to(torch.int32))       # 0 when no row is live
        self.src = torch.where(self.live, torch.arange(B, device=device), first)

    def put(self, t: torch.Tensor, new: torch.Tensor, write: torch.Tensor, pos=None):
        """t[slot(, pos)] = new for the live rows where `write` holds (broadcast over new's
        trailing dims); everything else keeps its bytes."""
        tb, nb = _bits(t), _bits(new.to(t.dtype))
        where = (self.slot,) if pos is None else (self.slot, pos)
        old = tb[where]
        m = write & self.live.view((-1,) + (1,) * (write.dim() - 1))
        m = m.view(m.shape + (1,) * (old.dim() - m.dim()))
        vals = torch.where(m, nb, old)[self.src]
        tb[tuple(w[self.src] for w in where)] = vals


def _row(m: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-row mask [B] shaped to broadcast against like [B, ...]."""
    return m.view((-1,) + (1,) * (like.dim() - 1))


def _window(store: ReplayStore, rows: _Rows, start, n_live):
    """Float32 window entries 0..L-1 of each row from `start` [B], those at j >= n_live [B]
    zero: K [B, H, L, dk] (GDN / KDA re-normalised as the reference), V (Mamba-2 dt x)
    [B, H, L, dv], U [B, H, L, dv] or None, G [B, H, L] (KDA [.., dk]), Bt [B, H, L], and the
    mask live [B, L]."""
    H, buffer_len = store.shape[1], store.buffer_len
    j = torch.arange(buffer_len, device=start.device)
    pos = (start.long()[:, None] + j) % store.capacity                  # [B, L]
    s = rows.slot[:, None]
    live = j[None, :] < n_live.long()[:, None]

    def get(buf):
        x = buf[s, pos].float().transpose(1, 2)                        # [B, heads, L, ...]
        m = live[:, None, :].view(live.shape[:1] + (1, buffer_len) + (1,) * (x.dim() - 3))
        return torch.where(m, x, 0.0)

    K = ring_keys(store.kind, get(store.kbuf).repeat_interleave(H // store.key_heads, dim=1))
    V, G, Bt = get(store.vbuf), get(store.Gbuf), get(store.bbuf)
    if store.kind == "mamba2":
        V = Bt.unsqueeze(-1) * V
    U = None if store.ubuf is None else get(store.ubuf)
    return K, V, U, G, Bt, live


def _at(x: torch.Tensor, i, j_dim: int = 2):
    """x[b, :, i[b]] of x [B, H, L, ...] for each row (i outside 0..L-1: zero)."""
    out = torch.zeros_like(x.select(j_dim, 0))
    for j in range(x.shape[j_dim]):
        out = torch.where(_row(i == j, out), x.select(j_dim, j), out)
    return out


def _rebuild(store: ReplayStore, A, K, V, U, G, Bt, n_live, cur=None):
    """reference._rebuild_ref for every row: the unrounded state [B, H, dv, dk] after the row's
    first n_live window entries and, if given, the current step cur = (k, v, log_a, beta).
    n_live: [B] entries per row, or an int when every row whose state is used has that many
    (a step's flush: L - 1), which skips the per-entry masks."""
    delta, vec = store.kind != "mamba2", store.kind == "kda"
    col = (lambda x: x[:, :, None, :]) if vec else (lambda x: x[:, :, None, None])  # noqa: E731
    n = n_live if isinstance(n_live, int) else K.shape[2]

    def keep(j, new, old):            # entry j applies to the rows that have it
        return new if isinstance(n_live, int) else torch.where(_row(n_live > j, old), new, old)

    if delta:
        fold = folds_u(store)
        S = A
        Gprev = torch.zeros_like(G[:, :, 0])
        for j in range(n):
            Sj = S * col(torch.exp(G[:, :, j] - Gprev))
            if fold:
                u = U[:, :, j]
            else:
                u = Bt[:, :, j:j + 1] * (V[:, :, j] - (Sj * K[:, :, j].unsqueeze(2)).sum(-1))
            S = keep(j, Sj + u.unsqueeze(-1) * K[:, :, j].unsqueeze(2), S)
            Gprev = keep(j, G[:, :, j], Gprev)
    else:
        if isinstance(n_live, int):
            Gn = G[:, :, n - 1] if n else torch.zeros_like(G[:, :, 0])
        else:
            Gn = _at(G, n_live - 1)
        S = A * torch.exp(Gn)[:, :, None, None]
        for j in range(n):
            S = keep(j, S + (torch.exp(Gn - G[:, :, j]).unsqueeze(-1) * V[:, :, j]).unsqueeze(-1)
                     * K[:, :, j].unsqueeze(2), S)
    if cur is not None:
        k, v, log_a, beta = cur
        S = S * col(torch.exp(log_a))
        u = beta.unsqueeze(-1) * (v - (S * k.unsqueeze(2)).sum(-1)) if delta else v
        S = S + u.unsqueeze(-1) * k.unsqueeze(2)
    return S


def _flush_tile_rows(store: ReplayStore) -> int:
    """Rows of the tile whose roles a non-finite flush keeps: the Triton flush launch's where
    the kernel takes the store's dims (powers of two >= 16), else the whole d_v (dims only this
    engine runs)."""
    dv, dk = store.shape[2:]
    if pow2_16(dv) and pow2_16(dk):
        return replay_launch_config(store, "flush")[0]
    return dv


def _write_roles(store: ReplayStore, rows: _Rows, S, fi, write):
    """reference._write_roles_ref for the rows where `write` holds: both roles cast from S
    [B, H, dv, dk] with the SR streams of flush index fi [B]; a tile of the flush launch whose S
    holds NaN or infinity, or whose cast into either role does (an FP16 role past 65504,
    stores.cast_overflows), keeps its bytes (a cast of all rows, selected per row and tile).
    Returns [B] bool: the rows written to whose cast overflowed in a tile."""
    H = S.shape[1]
    bv = _flush_tile_rows(store)

    def tiles(m):                 # [B, H, dv, dk] -> [B, H, dv, 1]: m anywhere in the row's tile
        return m.unflatten(2, (-1, bv)).flatten(3).any(3).repeat_interleave(bv, 2)[..., None]

    bad = tiles(~torch.isfinite(S))
    S = torch.where(bad, 0.0, S)
    casts = [(role, role.encode(S, store.key, sr_stream(fi, which, rows.slot, H),
                                bits=random_bits_torch))
             for role, which in ((store.anchor, ANCHOR), (store.read, READ)) if role is not None]
    over = torch.zeros_like(bad)
    for role, packed in casts:
        if cast_overflows(role.fmt):
            over = over | tiles(~torch.isfinite(packed[0]))
    keep = bad | over
    for role, packed in casts:
        for t, e in zip((role.payload, role.scale, role.gscale), packed):
            if t is None:
                continue
            m = keep if e.dim() == 4 else keep[..., 0] if e.dim() == 3 else keep[:, :, 0, 0]
            rows.put(t, e, ~m & _row(write, m))
    return write & rows.live & over.flatten(1).any(1)


def _key_factor_rows(store: ReplayStore, rows: _Rows, K, G, Bt, n_live):
    """Row n_live - 1 of each row's key factors (I + A)^{-1} (reference.key_factors_ref) over its
    first n_live window entries, zero past it: [B, H, L]."""
    buffer_len = K.shape[2]
    j = torch.arange(buffer_len, device=K.device)
    live = j[None, :] < n_live.long()[:, None]                              # [B, L]
    low = torch.ones(buffer_len, buffer_len, dtype=torch.bool, device=K.device).tril(-1)
    pair = low & live[:, None, :, None] & live[:, None, None, :]             # [B, 1, L, L]
    d = torch.where(pair, G[..., :, None] - G[..., None, :], 0.0)
    A = torch.where(pair, Bt[..., :, None] * torch.exp(d) * (K @ K.transpose(-1, -2)), 0.0)
    eye = torch.eye(buffer_len, device=K.device).expand_as(A)
    T = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    return torch.where(live[:, None, :], _at(T, n_live - 1), 0.0)


def _read_step(store: ReplayStore, rows: _Rows, R, win, h, cur):
    """replay_ref_core's read branch (T = 1) for every row: (y [B, H, dv], u [B, H, dv], the
    entry's cumulative gate Gp) from the read copy R, the window (h [B] live entries) and
    cur = (q, k, v, log_a, beta)."""
    q, k, v, log_a, beta = cur
    K, V, U, G, Bt, live = win
    delta, vec = store.kind != "mamba2", store.kind == "kda"
    bf = torch.bfloat16 if store.ubuf is None else store.ubuf.dtype
    X = U if delta else V
    Gp = _at(G, h - 1) + log_a
    if vec:
        m = live[:, None, :, None]
        wdec = torch.where(m, torch.exp(Gp.unsqueeze(2) - G), 0.0)           # [B, H, L, dk]
        eG = torch.exp(Gp)
        rk = (R * (eG * k).unsqueeze(2)).sum(-1)
        rq = (R * (eG * q).unsqueeze(2)).sum(-1)
        kk = (wdec * K * k.unsqueeze(2)).sum(-1)
        qk = (wdec * K * q.unsqueeze(2)).sum(-1)
        bt = beta.unsqueeze(-1)
        u = bt * (v - rk) - bt * torch.einsum("bhj,bhjd->bhd", kk, X)
        u = u.to(bf).float()
        y = rq + torch.einsum("bhj,bhjd->bhd", qk, X) + (k * q).sum(-1, keepdim=True) * u
        return y, u, Gp
    wdec = torch.where(live[:, None, :], torch.exp(Gp.unsqueeze(-1) - G), 0.0)   # [B, H, L]
    eG = torch.exp(Gp)
    if delta:
        corr = torch.einsum("bhj,bhjd->bhd", wdec * (K * k.unsqueeze(2)).sum(-1), X)
        rk = (R * k.unsqueeze(2)).sum(-1)
        bt = beta.unsqueeze(-1)
        u = bt * (v - eG.unsqueeze(-1) * rk) - bt * corr
        u = u.to(bf).float()
    else:
        u = v
    qk = (K * q.unsqueeze(2)).sum(-1)
    y = eG.unsqueeze(-1) * (R * q.unsqueeze(2)).sum(-1) \
        + torch.einsum("bhj,bhjd->bhd", wdec * qk, X) + (k * q).sum(-1, keepdim=True) * u
    return y, u, Gp


def _step(store: ReplayStore, fe, raw, state_indices, force: bool, advance: bool, post=None,
          flushing=None, record=None):
    """One decode step of every row (replay_ref_core with T = 1, then advance_pointers_ref):
    fe = (q, k, v, log_a, beta) float32 [B, H, ...] with value heads, raw = (k / B raw
    [B, HK, dk], v / x raw [B, H, dv]) as stored; post(y) the Mamba-2 D skip / z gate;
    flushing: see replay_gdn_step_torch; record: the FaultRecord whose flush-cast column notes
    the rows whose flush kept its roles for a cast that overflowed (after its `note` of the
    step). Returns y [B, H, dv] (padding rows zero)."""
    q = fe[0]
    B, buffer_len, C = q.shape[0], store.buffer_len, store.capacity
    rows = _Rows(state_indices, B, q.device)
    h = store.committed[rows.slot].long()
    nf = store.n_flush[rows.slot]
    start = store.start[rows.slot].long()
    over = torch.zeros(B, dtype=torch.bool, device=q.device)
    if store.max_drafts:
        # accepted drafts can fill the buffer (committed == L): fold them before the step
        pre = rows.live & (h + 1 > buffer_len) & (h > 0)
        K, V, U, G, Bt, _ = _window(store, rows, start, h)
        S = _rebuild(store, store.anchor.dequantize(rows.slot), K, V, U, G, Bt, buffer_len)
        over = _write_roles(store, rows, S, nf + 1, pre)
        nf = nf + pre.long()
        start = torch.where(pre, (start + h) % C, start)
        h = torch.where(pre, 0, h)
        flushing = None
    flush = (h + 1 == buffer_len) | force
    win = _window(store, rows, start, h)
    K, V, U, G, Bt, _ = win
    # the read branch, before the flush writes the read copy
    y_read, u, Gp = _read_step(store, rows, store.read_role.dequantize(rows.slot), win, h, fe)
    # the flush branch: every row (keeping its own branch), or the rows the caller named
    if flushing is None or force:
        S = _rebuild(store, store.anchor.dequantize(rows.slot), K, V, U, G, Bt,
                     h if force else buffer_len - 1, cur=fe[1:])
        y_flush = (S * q.unsqueeze(2)).sum(-1)
        over = over | _write_roles(store, rows, S, nf + 1, flush)
        y = torch.where(_row(flush, y_flush), y_flush, y_read)
    elif len(flushing):
        i = torch.as_tensor(flushing, dtype=torch.long, device=q.device)
        sub = _Rows(_indices(state_indices, B, q.device)[i], len(i), q.device)
        S = _rebuild(store, store.anchor.dequantize(sub.slot), K[i], V[i],
                     None if U is None else U[i], G[i], Bt[i], buffer_len - 1,
                     cur=tuple(None if t is None else t[i] for t in fe[1:]))
        y = y_read.index_copy(0, i, (S * q[i].unsqueeze(2)).sum(-1))
        o = _write_roles(store, sub, S, nf[i] + 1, torch.ones(len(i), dtype=torch.bool,
                                                             device=q.device))
        over = over | torch.zeros_like(over).index_copy(0, i, o)
    else:
        y = y_read
    read = ~flush
    e = (start + h) % C
    kraw, xraw = raw
    rows.put(store.kbuf, kraw, read, e)
    rows.put(store.vbuf, xraw, read, e)
    if store.ubuf is not None:
        rows.put(store.ubuf, u, read, e)
    rows.put(store.bbuf, fe[4], read, e)
    rows.put(store.Gbuf, Gp, read, e)
    if solves_u(store) and store.Tbuf is not None:      # the kernel's flush reads them
        K2, _, _, G2, Bt2, _ = _window(store, rows, start, h + 1)     # with the new entry
        rows.put(store.Tbuf, _key_factor_rows(store, rows, K2, G2, Bt2, h + 1), read, e)
    if post is not None:
        y = post(y)
    if record is not None:
        record.note_cast(over, state_indices)
    if advance:
        rows.put(store.committed, torch.where(flush, 0, h + 1), rows.live)
        rows.put(store.n_flush, nf + flush.long(), rows.live)
        rows.put(store.start, start, rows.live)
    return torch.where(_row(rows.live, y), y, 0.0)


def _begin_step(store, kind, path, q, k, v, a, b, A=None, dt_bias=None, D=None, z=None):
    """The kernel's checks of a step (store kind, pending drafts, the inputs' shapes, key heads,
    the buffered k / v in the ring's dtype); records the step's path (last_force) and returns
    whether every row flushes."""
    force = _begin(store, kind, True, path)
    _, hk = step_inputs(kind, store.shape, False, StepTensors(q, k, v, a, b, A, dt_bias, D, z))
    if hk != store.key_heads:
        raise ValueError(f"the inputs have {hk} key heads, the store {store.key_heads} "
                         f"(key_heads)")
    _check_buffered(store, kind != "mamba2", k, v, kernel=False)
    store.last_force = force
    return force


def replay_gdn_step_torch(store: ReplayStore, q, k, v, a, b, A_log, dt_bias=None,
                          state_indices=None, scale=None, out=None, use_qk_l2norm=True,
                          path="auto", advance=True, beta_scale=1.0, flushing=None,
                          record=None):
    """One GDN replay decode step in torch (module docstring), the signature and effect of
    reference.replay_gdn_step_ref (the kept tiles of a non-finite flush or cast are those of the
    flush launch, launch.replay_launch_config, as the reference's). flushing: the batch rows
    (indices, live rows) whose entry fills their buffer at this step, where the caller knows
    them on the host without reading the device (a patched model's decode store counts its
    steps); the flush branch then runs on those rows alone, the same arithmetic row by row. They
    must be exactly those rows; None (the default): every row computes both branches and keeps
    its own. Ignored for path 'flush' and in a store built for drafts. record: a
    stores.FaultRecord the step notes its inputs' faults and its flush's casts that overflowed
    in."""
    force = _begin_step(store, "gdn", path, q, k, v, a, b, A_log, dt_bias)
    if record is not None:
        record.note("gdn", (q, k, v, a, b), state_indices, advance)
    beta_scale = float(beta_scale)
    if not (math.isfinite(beta_scale) and beta_scale > 0):
        raise ValueError(f"beta_scale must be a finite number > 0, got {beta_scale}")
    fe = list(gdn_frontend_ref(q, k, v, a, b, A_log, dt_bias, scale, use_qk_l2norm))
    fe[4] = fe[4] * beta_scale
    y = _step(store, tuple(fe), (k, v), state_indices, force, advance, flushing=flushing,
              record=record)
    return _into(out, y)


def replay_mamba2_step_torch(store: ReplayStore, x, dt, A, B, C, state_indices=None, D=None,
                             z=None, dt_bias=None, out=None, path="auto", advance=True,
                             dt_limit=NO_DT_LIMIT, flushing=None, record=None):
    """One Mamba-2 replay decode step in torch, as reference.replay_mamba2_step_ref (flushing,
    record: as replay_gdn_step_torch)."""
    force = _begin_step(store, "mamba2", path, C, B, x, dt, None, A, dt_bias, D, z)
    if record is not None:
        record.note("mamba2", (C, B, x, dt), state_indices, advance)
    fe = mamba2_frontend_ref(x, dt, A, B, C, dt_bias, dt_limit)
    y = _step(store, fe, (B, x), state_indices, force, advance,
              post=lambda y: mamba2_post_ref(y, x, D, z), flushing=flushing, record=record)
    return _into(out, y)


def replay_kda_step_torch(store: ReplayStore, q, k, v, g, beta, state_indices=None, scale=None,
                          out=None, use_qk_l2norm=True, path="auto", advance=True,
                          flushing=None, record=None):
    """One Kimi Delta Attention replay decode step in torch, as reference.replay_kda_step_ref
    (flushing, record: as replay_gdn_step_torch)."""
    force = _begin_step(store, "kda", path, q, k, v, g, beta)
    if record is not None:
        record.note("kda", (q, k, v, g, beta), state_indices, advance)
    fe = kda_frontend_ref(q, k, v, g, beta, scale, use_qk_l2norm)
    y = _step(store, fe, (k, v), state_indices, force, advance, flushing=flushing,
              record=record)
    return _into(out, y)
