"""Torch reference of the chunked teacher-forcing scan (DESIGN section 7).

A run of decode steps with buffer length L is a chunked scan whose chunk boundaries are the
flushes. This module computes a whole segment of tokens at once with exactly the step semantics
of DESIGN section 4, for the generic recurrence ``S_t = a_t S_{t-1} + u_t k_t^T``
(``delta=False``: u = v, Mamba-2; ``delta=True``: the gated delta rule, GDN):

* a token that is not the L-th of its window reads the read copy R of the window's checkpoint
  (for GDN its u comes from R too: ``u + beta * tril(decay * K K^T) u = beta (v - decay * R k)``);
* the L-th token (the flush) reads the unrounded state rebuilt from the dequantized anchor A
  (GDN: u recomputed from A with the same triangular solve);
* that unrounded state is cast independently into the anchor and the read copy, with the SR
  streams of `replayquant.streams` (``layer_seed(seed, layer)``, ``sr_stream(flush index, role,
  rows, heads)``), so the same seed gives the same bits as `ReplayState` stepping token by token.

The state carried between segments is a `ScanState`: the two copies, the raw inputs of the
buffered steps (k, v, log a, beta) and, per sequence, the buffer fill and the flush count. A
segment continues the flush schedule of the previous one (position modulo L carries over), and
tokens marked invalid (padding) are skipped: they occupy no buffer slot, as a server never sees
them. ``exact=True`` is the other prefill: the segment in FP32 (no rounding at window
boundaries), then one cast of the final state, as a server's prefill would.
A flush whose cast of the anchor or read copy is not finite (an fp16 role past 65504), or
whose rebuilt state is not (past FP32's range), is one ValueError at that flush naming layer,
batch row, token and format (`replay.state.flush_overflow_error`), and the state is not handed
back: one host read per flush (`_FlushCheck`), beside each cast's own finiteness check.

Shapes (B sequences, T tokens, H heads): q, k [B, T, H, d_k]; v [B, T, H, d_v]; log_a and beta
[B, T, H]; states [B, H, d_v, d_k] float32. All arithmetic is float32.

Vector gates (Kimi Delta Attention): log_a [B, T, H, d_k], one log decay per key channel, and
the buffer's G [B, H, L, d_k] (a state is built for one kind, `initial_scan_state(...,
vector_gate=True)`). The decay multiplies the state's key axis, S Diag(exp(G)), so within a
window the products take channel-decayed keys and queries: q_t . (k_j * exp(G_t - G_j)) for
j <= t, the state rebuilt as S_c Diag(exp(G_L)) + sum_j u_j (k_j * exp(G_L - G_j))^T. Only
exp(G_t) and exp(G_t - G_j) with t >= j are formed (both <= 1 for gates <= 1); exp(-G_j) alone,
which overflows once a channel has forgotten enough, never is. A constant vector gives the
scalar path's result within FP32 reassociation.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace

import torch

from replayquant import options
from replayquant.formats import QTensor
from replayquant.replay import core
from replayquant.replay.convert import load_scan_state, scan_state_of
from replayquant.replay.handoff import ScanState
from replayquant.replay.state import find_nonfinite, flush_overflow_error, nonfinite_cast
from replayquant.streams import ANCHOR, READ, layer_seed, sr_stream

__all__ = ["cast_roles", "initial_scan_state", "rebuild_state", "chunk_scan_ref", "select_rows",
           "teacher_force", "check_inputs_finite"]


def anchor_f32(state: ScanState, pair) -> torch.Tensor:
    return pair.anchor.fmt.dequantize(state.anchor)


def read_f32(state: ScanState, pair) -> torch.Tensor:
    if state.read is None:
        return anchor_f32(state, pair)
    return pair.read.fmt.dequantize(state.read)


def cast_roles(S: torch.Tensor, pair, *, seed: int, layer: int, flush_index, state_indices):
    """Cast the unrounded FP32 state S [B, H, d_v, d_k] into (anchor, read copy), each directly
    from S (never Q_LP(Q_HP(S))), SR keyed by (layer_seed(seed, layer), flush index, role, row,
    head). Returns (anchor QTensor, read QTensor or None for a shared pair)."""
    H = S.shape[1]
    key = layer_seed(seed, layer)
    state_indices = torch.as_tensor(state_indices, dtype=torch.int64, device=S.device)
    fi = torch.as_tensor(flush_index, dtype=torch.int64, device=S.device)
    a = pair.anchor.fmt.quantize(S, pair.anchor.rounding, seed=key,
                                 stream=sr_stream(fi, ANCHOR, state_indices, H))
    if pair.read is None:
        return a, None
    r = pair.read.fmt.quantize(S, pair.read.rounding, seed=key,
                               stream=sr_stream(fi, READ, state_indices, H))
    return a, r


def initial_scan_state(S0, pair, *, delta: bool, seed: int = 0, layer: int = 0,
                       state_indices=None, vector_gate: bool = False, device=None) -> ScanState:
    """The state `ReplayState(S0, pair, delta, seed, layer, state_indices)` starts from: S0 cast into both
    roles (flush index 0), an empty buffer. S0 a tensor [B, H, d_v, d_k], or its shape for a
    state of zeros on `device` (a new sequence: each role is its format's `zeros`, the bits the
    casts give, without their finiteness checks and host reads). vector_gate: log_a per key
    channel (G [B, H, L, d_k], KDA), else one per head."""
    if isinstance(S0, torch.Tensor):
        if S0.dim() != 4:
            raise ValueError("initial state must be a tensor [B, H, d_v, d_k]")
        S0 = S0.to(torch.float32)
        shape, dev = tuple(S0.shape), S0.device
    else:
        shape, dev = tuple(S0), torch.device("cpu" if device is None else device)
        if len(shape) != 4:
            raise ValueError("initial state must be a tensor [B, H, d_v, d_k] or that shape")
    B, H, dv, dk = shape
    state_indices = torch.arange(B, device=dev) if state_indices is None \
        else torch.as_tensor(state_indices, device=dev)
    buffer_len = pair.buffer_len
    if isinstance(S0, torch.Tensor):
        a, r = cast_roles(S0, pair, seed=seed, layer=layer, flush_index=0,
                          state_indices=state_indices)
    else:
        a = pair.anchor.fmt.zeros(shape, dev)
        r = None if pair.read is None else pair.read.fmt.zeros(shape, dev)
    z = torch.zeros
    return ScanState(anchor=a, read=r, k=z(B, H, buffer_len, dk, device=dev),
                     v=z(B, H, buffer_len, dv, device=dev),
                     G=z(B, H, buffer_len, dk, device=dev) if vector_gate else z(B, H, buffer_len, device=dev),
                     beta=z(B, H, buffer_len, device=dev) if delta else None,
                     committed=torch.zeros(B, dtype=torch.int64, device=dev),
                     n_flush=torch.zeros(B, dtype=torch.int64, device=dev),
                     state_indices=state_indices.to(torch.int64))


def select_rows(mask: torch.Tensor, new: QTensor | None, old: QTensor | None):
    """Per sequence, `new` where mask[b] else `old` (every payload / scale tensor of a state
    QTensor has the batch outermost, so it flattens to [B, -1])."""
    if new is None:
        return None
    B = mask.shape[0]
    m = mask.reshape(B, 1)
    parts = {}
    for name, a, b in [("payload", new.payload, old.payload),
                       *[(k, new.scales[k], old.scales[k]) for k in new.scales]]:
        parts[name] = torch.where(m, a.reshape(B, -1), b.reshape(B, -1)).reshape(a.shape)
    return QTensor(new.format, new.shape, parts.pop("payload"), parts)


def _check_inputs(state, q, k, v, log_a, beta, valid):
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v, log_a)):
        raise ValueError("q, k, v and log_a must be tensors")
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, d_k]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}")
    B, T, H, dk = q.shape
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must be [B, T, H, d_v] = [{B}, {T}, {H}, d_v], got {tuple(v.shape)}")
    want = (B, T, H, dk) if state.vector_gate else (B, T, H)
    if tuple(log_a.shape) != want:
        kind = "per key channel" if state.vector_gate else "one per head"
        raise ValueError(f"log_a must be {list(want)}: the state's gates are {kind}; got "
                         f"{tuple(log_a.shape)}. Build the state for the gates you pass "
                         f"(initial_scan_state(..., vector_gate={not state.vector_gate}))")
    if state.delta != (beta is not None):
        raise ValueError("beta must be given for a delta-rule (GDN) state, and None for Mamba-2")
    if beta is not None and tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if valid is not None and tuple(valid.shape) != (B, T):
        raise ValueError(f"valid must be a bool mask [B, T] = [{B}, {T}], got {tuple(valid.shape)}")
    if state.batch != B or state.heads != H or state.k.shape[-1] != dk or state.v.shape[-1] != v.shape[-1]:
        raise ValueError(f"the state holds B={state.batch}, H={state.heads}, d_k={state.k.shape[-1]}, "
                         f"d_v={state.v.shape[-1]}; the inputs have B={B}, H={H}, d_k={dk}, "
                         f"d_v={v.shape[-1]}")


VECTOR_TERMS_ELEMENTS = 1 << 25     # per-channel decays formed at once (128 MiB in FP32)


def _window_terms(G, kw, qw, vw, bw):
    """State-independent quantities of each window. G [..., L] cumulative log gate, or
    [..., L, d_k] per key channel; kw, qw [..., L, d_k]; vw [..., L, d_v]; bw [..., L] (GDN) or
    None.

    Returns the decayed q.k matrix Aqk[t, j] = q_t . (k_j * exp(G_t - G_j)) for j <= t, and for
    GDN (Vb, Kb) with u(X) = Vb - Kb X^T the solution of the unit lower-triangular system
    u_j + beta_j sum_{i<j} (k_i * exp(G_j - G_i)) . k_j u_i = beta_j (v_j - X (exp(G_j) * k_j))
    (a scalar gate: exp(G_j - G_i) (k_i . k_j) and exp(G_j) X k_j). Vector gates form the
    decay of every (t, j, channel), [..., L, L, d_k], with exponents G_t - G_j <= 0 only, for
    at most VECTOR_TERMS_ELEMENTS of them at a time (windows, dim -3, in blocks).
    """
    buffer_len = kw.shape[-2]
    vec = G.dim() == kw.dim()
    per_window = kw[..., 0, 0, 0].numel() * buffer_len * buffer_len * kw.shape[-1]
    W = kw.shape[-3]
    if vec and W > 1 and per_window * W > VECTOR_TERMS_ELEMENTS:
        n = max(1, VECTOR_TERMS_ELEMENTS // per_window)
        parts = [_window_terms(G[..., a:a + n, :, :], kw[..., a:a + n, :, :], qw[..., a:a + n, :, :],
                               vw[..., a:a + n, :, :], None if bw is None else bw[..., a:a + n, :])
                 for a in range(0, W, n)]
        return tuple(None if p[0] is None else torch.cat(p, dim=-3) for p in zip(*parts))
    tril = torch.ones(buffer_len, buffer_len, dtype=torch.bool, device=G.device).tril()
    mask = tril[:, :, None] if vec else tril
    D = (G.unsqueeze(-2 if vec else -1) - G.unsqueeze(-3 if vec else -2)) \
        .masked_fill(~mask, float("-inf")).exp()                 # [..., t, j (, d_k)]
    if vec:
        kd = kw.unsqueeze(-3) * D                                # k_j * exp(G_t - G_j)
        Aqk = (qw.unsqueeze(-2) * kd).sum(-1)
    else:
        Aqk = (qw @ kw.transpose(-1, -2)) * D
    if bw is None:
        return Aqk, None, None
    strict = torch.ones(buffer_len, buffer_len, dtype=torch.bool, device=G.device).tril(-1)
    KK = (kw.unsqueeze(-2) * kd).sum(-1) if vec else (kw @ kw.transpose(-1, -2)) * D
    Tm = (bw.unsqueeze(-1) * KK).masked_fill(~strict, 0.0)
    Tm = Tm + torch.eye(buffer_len, dtype=Tm.dtype, device=Tm.device)
    Vb = torch.linalg.solve_triangular(Tm, bw.unsqueeze(-1) * vw, upper=False, unitriangular=True)
    eG = G.exp() if vec else G.exp().unsqueeze(-1)
    Kb = torch.linalg.solve_triangular(Tm, bw.unsqueeze(-1) * eG * kw, upper=False,
                                       unitriangular=True)
    return Aqk, Vb, Kb


def rebuild_state(state: ScanState, pair) -> torch.Tensor:
    """The unrounded FP32 state after the buffered steps, rebuilt from the dequantized anchor
    (GDN: u recomputed from the anchor), i.e. what a flush now would cast."""
    return core.rebuild(anchor_f32(state, pair), state.k, state.v, state.G, state.beta,
                        state.committed)[0]


CPU_THREADS_ENV = "REPLAYQUANT_CPU_THREADS"   # the option cpu_threads (replayquant.options)


@contextmanager
def cpu_threads(device):
    """Run the enclosed CPU torch work with at most REPLAYQUANT_CPU_THREADS intra-op threads
    (default 1), restoring the caller's setting afterwards; other devices: no change.

    The scan is a sequence of many small element-wise ops and casts. Measured on the project's
    2-core machine under load (one GDN layer, 1024 tokens, 8 heads, 128 x 128): s32_rs 14.7 s
    with 2 threads against 0.21 s with 1, because every op past torch's parallel grain size
    waits for a second thread that is descheduled. Set the variable to a larger number on an
    idle many-core machine."""
    if torch.device(device).type != "cpu":
        yield
        return
    want = options.get().cpu_threads
    n = torch.get_num_threads()
    if want >= n:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def chunk_scan_ref(state: ScanState, q, k, v, log_a, beta=None, *, pair, seed: int = 0,
                   layer: int = 0, valid=None, exact: bool = False):
    """Run a segment of tokens through the step semantics of DESIGN section 4, window by window.

    state: the ScanState before the segment (`initial_scan_state`, `scan_state_of(ReplayState)`
    or a previous call). q, k [B, T, H, d_k]; v [B, T, H, d_v]; log_a [B, T, H]; beta [B, T, H]
    for GDN, else None (GDN: q, k L2-normalised and q scaled by the caller; Mamba-2: v = dt x,
    k = B, q = C, log_a = dt A); log_a [B, T, H, d_k] for a vector-gated state (KDA). valid [B, T] bool or None: False marks padding, which is
    skipped (no buffer slot, no gate) and gets output 0. exact: FP32 through the segment (the
    buffered steps included) and one cast at its end, flush index + 1 (prefill="exact").
    seed, layer: as given to ReplayState (SR streams).

    Returns (y [B, T, H, d_v] float32, the ScanState after the segment).
    """
    _check_inputs(state, q, k, v, log_a, beta, valid)
    with torch.no_grad(), cpu_threads(q.device):
        return _scan(state, q, k, v, log_a, beta, pair=pair, seed=seed, layer=layer, valid=valid,
                     exact=exact)


def _scan(state, q, k, v, log_a, beta, *, pair, seed, layer, valid, exact):
    if pair.buffer_len != state.buffer_len:
        raise ValueError(f"pair {pair.label()} has buffer_len {pair.buffer_len} but the state was "
                         f"built with {state.buffer_len}; use the same pair")
    f32 = torch.float32
    q, k, v, log_a = (x.to(f32) for x in (q, k, v, log_a))
    beta = None if beta is None else beta.to(f32)
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    dev = q.device
    buffer_len = state.buffer_len
    valid = torch.ones(B, T, dtype=torch.bool, device=dev) if valid is None else valid.to(torch.bool)

    h0 = state.committed
    m = h0 + valid.sum(1)                                   # entries per row: buffered + new
    y = torch.zeros(B, T, H, dv, dtype=f32, device=dev)
    M = int(m.max()) if B else 0
    if M == 0 or T == 0:
        return y, state
    W = -(-M // buffer_len)
    width = W * buffer_len
    lay = _layout(state, q, k, v, log_a, beta, valid, W)
    full = m // buffer_len                                  # windows that end in a flush, per row
    check = _FlushCheck(state, pair, layer, lay, (q, k, v, log_a, beta), valid, exact)
    Y, A, aq, rq = _windows_ref(state, pair, lay, full, W, seed, layer, exact, check)
    bi, ti, cols, slot, Ek, Ev, Eb, G, gt = (lay.bi, lay.ti, lay.cols, lay.slot, lay.Ek, lay.Ev,
                                             lay.Eb, lay.G, lay.gt)

    # -- outputs of the new tokens
    y[bi, ti] = Y.reshape(B, H, width, dv)[bi, :, cols]

    zero = torch.zeros_like
    if exact:
        # A holds the unrounded FP32 state after every entry: cast once (one flush)
        na, nr, _, _ = check.cast(W, torch.ones_like(full, dtype=torch.bool), A, seed,
                                  state.n_flush + 1)
        return y, replace(state, anchor=na, read=nr, k=zero(state.k), v=zero(state.v),
                          G=zero(state.G), beta=None if state.beta is None else zero(state.beta),
                          committed=zero(state.committed), n_flush=state.n_flush + 1, u=None,
                          raw=None)

    # -- the new buffer: each row's entries after its last flush (window `full`)
    count = m - full * buffer_len
    idx = ((full * buffer_len)[:, None] + slot).clamp(max=width - 1)          # [B, L]
    live = slot[None, :] < count[:, None]

    def take(E, tail):
        g = E.gather(2, idx.view(B, 1, buffer_len, *([1] * len(tail))).expand(B, H, buffer_len, *tail))
        return torch.where(live.view(B, 1, buffer_len, *([1] * len(tail))), g, 0.0)

    Gf = G.reshape(B, H, width, *gt)
    new = replace(state, anchor=aq, read=rq, k=take(Ek, (dk,)), v=take(Ev, (dv,)), G=take(Gf, gt),
                  beta=None if Eb is None else take(Eb, ()), committed=count,
                  n_flush=state.n_flush + full, u=None, raw=None)
    return y, new


def _layout(state, q, k, v, log_a, beta, valid, W):
    """The segment laid out for the window loop of `_scan` (float32 inputs): each row as [its
    buffered steps][its valid new tokens][null steps], in columns grouped into windows of L, so
    that the flush schedule of every row is the window grid. Null steps (k = v = beta = 0, log
    a = 0) change nothing and are never flushed."""
    f32 = torch.float32
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    dev = q.device
    buffer_len = state.buffer_len
    width = W * buffer_len
    h0 = state.committed
    bi, ti = valid.nonzero(as_tuple=True)
    cols = h0[bi] + (valid.long().cumsum(1) - 1)[bi, ti]
    slot = torch.arange(buffer_len, device=dev)
    live0 = slot[None, :] < h0[:, None]                     # [B, L] buffered slots

    def lay(buf, new, tail):
        E = torch.zeros(B, H, width, *tail, dtype=f32, device=dev)
        if buf is not None:
            live = live0.reshape(B, 1, buffer_len, *([1] * len(tail)))
            E[:, :, :buffer_len] = torch.where(live, buf.to(f32), 0.0)
        E[bi, :, cols] = new[bi, ti]
        return E

    Ek, Ev, Eq = lay(state.k, k, (dk,)), lay(state.v, v, (dv,)), lay(None, q, (dk,))
    Eb = None if beta is None else lay(state.beta, beta, ())
    # gate increments; window 0 continues the buffer's cumulative G (sequential adds, as a step)
    vec = state.vector_gate
    gt = (dk,) if vec else ()                               # a gate per key channel, or per head
    inc = lay(None, log_a, gt)
    at = (h0 - 1).clamp(min=0).view(B, 1, 1, *([1] * len(gt))).expand(B, H, 1, *gt)
    prev = state.G.to(f32).gather(2, at)[:, :, 0]                                  # [B, H(, d_k)]
    last = torch.where((h0 > 0).view(B, 1, *([1] * len(gt))), prev, torch.zeros((), device=dev))
    inc[torch.arange(B, device=dev), :, (h0 - 1).clamp(min=0)] += last
    G = inc.reshape(B, H, W, buffer_len, *gt).cumsum(3)
    G[:, :, 0] = torch.where(live0.view(B, 1, buffer_len, *([1] * len(gt))), state.G.to(f32), G[:, :, 0])

    kw = Ek.reshape(B, H, W, buffer_len, dk)
    vw = Ev.reshape(B, H, W, buffer_len, dv)
    qw = Eq.reshape(B, H, W, buffer_len, dk)
    bw = None if Eb is None else Eb.reshape(B, H, W, buffer_len)
    Aqk, Vb, Kb = _window_terms(G, kw, qw, vw, bw)
    if vec:                                                 # decay on the key axis, per channel
        qe = qw * G.exp()                                   # q_t * exp(G_t)
        kL = kw * (G[..., -1:, :] - G).exp()                # k_j * exp(G_L - G_j)
        eGL = G[..., -1, :].exp().unsqueeze(-2)             # S_c Diag(exp(G_L))
        eG = wL = None
    else:
        qe = kL = None
        eG = G.exp()
        eGL = G[..., -1].exp()[..., None, None]
        wL = (G[..., -1:] - G).exp()
    return SimpleNamespace(bi=bi, ti=ti, cols=cols, slot=slot, Ek=Ek, Ev=Ev, Eb=Eb, G=G, gt=gt,
                           vec=vec, Aqk=Aqk, Vb=Vb, Kb=Kb, kw=kw, vw=vw, qw=qw, bw=bw, qe=qe,
                           kL=kL, eG=eG, eGL=eGL, wL=wL)


def _windows_ref(state, pair, lay, full, W, seed, layer, exact, check):
    """`_scan`'s window loop: each window's outputs Y [B, H, W, L, d_v] from the state at its
    start, then the state at its end, flushed (both casts, each `check`ed) in the rows whose
    window ends in a flush (`full` > w); returns (Y, the FP32 state after the last window,
    anchor, read copy)."""
    f32 = torch.float32
    B, H = state.committed.shape[0], lay.kw.shape[1]
    buffer_len, dv, dev = state.buffer_len, lay.vw.shape[-1], lay.kw.device
    vec, Aqk, Vb, Kb, kw, vw, qw, bw = (lay.vec, lay.Aqk, lay.Vb, lay.Kb, lay.kw, lay.vw, lay.qw,
                                        lay.bw)
    qe, kL, eG, eGL, wL = lay.qe, lay.kL, lay.eG, lay.eGL, lay.wL
    A = anchor_f32(state, pair)
    R = A if state.read is None else read_f32(state, pair)
    aq, rq = state.anchor, state.read
    Y = torch.empty(B, H, W, buffer_len, dv, dtype=f32, device=dev)
    fmin, fmax = (0, 0) if exact else (int(full.min()), int(full.max()))   # the one host sync
    for w in range(W):
        uR_only = not exact and w >= fmax                    # nobody flushes: R is final
        if bw is None:
            uA = uR = vw[:, :, w]
        elif uR_only:
            uA = uR = Vb[:, :, w] - Kb[:, :, w] @ R.transpose(-1, -2)
        else:
            uA = Vb[:, :, w] - Kb[:, :, w] @ A.transpose(-1, -2)
            uR = uA if (R is A or exact) else Vb[:, :, w] - Kb[:, :, w] @ R.transpose(-1, -2)
        X = A if exact else R
        if vec:
            Y[:, :, w] = qe[:, :, w] @ X.transpose(-1, -2) + Aqk[:, :, w] @ uR
        else:
            Y[:, :, w] = eG[:, :, w, :, None] * (qw[:, :, w] @ X.transpose(-1, -2)) \
                + Aqk[:, :, w] @ uR
        if uR_only:
            continue
        if vec:
            S = eGL[:, :, w] * A + uA.transpose(-1, -2) @ kL[:, :, w]
        else:
            S = eGL[:, :, w] * A + (uA * wL[:, :, w, :, None]).transpose(-1, -2) @ kw[:, :, w]
        if exact:
            A = S
            continue
        # the flush step reads the unrounded state rebuilt from the anchor; then the two casts
        yF = (S @ qw[:, :, w, buffer_len - 1, :, None])[..., 0]
        na, nr, Anew, Rnew = check.cast(w, full > w, S, seed, state.n_flush + w + 1)
        if w < fmin:                                         # every row flushes here
            Y[:, :, w, buffer_len - 1] = yF
            aq, rq, A, R = na, nr, Anew, Rnew
        else:
            flush = full > w
            fm = flush[:, None, None, None]
            Y[:, :, w, buffer_len - 1] = torch.where(flush[:, None, None], yF, Y[:, :, w, buffer_len - 1])
            aq, rq = select_rows(flush, na, aq), select_rows(flush, nr, rq)
            A = torch.where(fm, Anew, A)
            R = A if rq is None else torch.where(fm, Rnew, R)

    return Y, A, aq, rq


def check_inputs_finite(layer: int, inputs, valid=None) -> None:
    """One ValueError naming the layer, input, token and row when a segment's inputs (q, k, v,
    log_a, beta; `find_nonfinite`: valid tokens only) hold NaN or infinity. The scans take the
    inputs as checked (the runtime checks each forward's once); this tells a non-finite input
    from a state that outgrew its format where a scan's result is not finite."""
    bad = find_nonfinite(dict(zip(("q", "k", "v", "log_a", "beta"), inputs)), valid)
    if bad is not None:
        name, row, t, n = bad
        raise ValueError(f"layer {layer}: input {name} holds NaN or infinity at token {t} of "
                         f"this {inputs[0].shape[1]}-token segment, batch row {row} ({n} "
                         f"element(s)); the replay state is unchanged. The inputs come from the "
                         f"model's activations: find where they first become non-finite")


class _FlushCheck:
    """The flushes of a segment (`_windows_ref`; window W: the exact prefill's cast at the
    segment's end), cast and checked: a cast into the anchor or read copy that is not finite
    (one host read a flush, as each cast's own check of its input is), or a rebuilt state that
    is not (which the cast refuses), is one ValueError (`replay.state.flush_overflow_error`)
    naming the layer, the flush's token, the batch row and the format, before the state is
    handed back. Without it an FP16 role past 65504 would give infinite outputs until the next
    flush, whose cast of the infinite state the format would refuse without saying where."""

    def __init__(self, state, pair, layer: int, lay, inputs, valid, exact: bool):
        self.ss, self.pair, self.layer, self.lay = state, pair, layer, lay
        self.inputs, self.valid, self.exact = inputs, valid, exact

    def cast(self, w: int, rows, S, seed: int, flush_index):
        """`cast_roles` of the unrounded state S of the flush at window w, checked in `rows` [B]
        bool: (anchor, read copy or None, both dequantized: the anchor twice when shared)."""
        pair = self.pair
        try:
            na, nr = cast_roles(S, pair, seed=seed, layer=self.layer, flush_index=flush_index,
                                state_indices=self.ss.state_indices)
        except ValueError:
            bad = ~torch.isfinite(S).flatten(1).all(1) & rows
            if bool(bad.any()):
                raise self._error(w, int(bad.nonzero()[0, 0]), "rebuilt state", None) from None
            raise
        Anew = pair.anchor.fmt.dequantize(na)
        Rnew = Anew if nr is None else pair.read.fmt.dequantize(nr)
        roles = (("anchor", pair.anchor, Anew),)
        if nr is not None:
            roles += (("read copy", pair.read, Rnew),)
        bad = nonfinite_cast(roles, rows)
        if bad is not None:
            raise self._error(w, bad[2], bad[0], bad[1])
        return na, nr, Anew, Rnew

    def _error(self, w: int, b: int, role: str, spec) -> ValueError:
        T = self.inputs[0].shape[1]
        check_inputs_finite(self.layer, self.inputs, self.valid)   # not the state: the inputs
        if self.exact:
            at = f"the end of this {T}-token segment (prefill=exact)"
        else:
            L = self.ss.buffer_len
            lay = self.lay
            tok = lay.ti[(lay.bi == b) & (lay.cols == w * L + L - 1)]
            at = (f"token {int(tok[0])} of this {T}-token segment" if tok.numel() else
                  f"the steps buffered before this {T}-token segment")
        return flush_overflow_error(self.layer, role, spec, self.pair, b,
                                    int(self.ss.state_indices[b]),
                                    at)


def teacher_force(st, q, k, v, log_a, beta=None, *, valid=None, exact: bool = False, scan=None):
    """Run a segment through ReplayState st with the chunked scan (in place) -> y [B, T, H, d_v].

    Equal, within reassociation, to calling st.step token by token (valid tokens only), with the
    same SR bits: the scan continues st's flush schedule and SR streams (st.seed, st.layer).
    scan: the scan function (default chunk_scan_ref; `replayquant.kernels.chunk.kernel.chunk_scan`
    is the Triton kernel with the same signature)."""
    scan = chunk_scan_ref if scan is None else scan
    with cpu_threads(q.device):
        y, ss = scan(scan_state_of(st), q, k, v, log_a, beta, pair=st.pair,
                     seed=st.seed, layer=st.layer, valid=valid, exact=exact)
        load_scan_state(st, ss)
    return y
