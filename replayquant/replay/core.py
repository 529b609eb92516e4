"""The arithmetic of the replay state (plain torch, FP32): the specification that GPU kernels and
the chunked teacher-forcing kernel are checked against.

Layout (batch b, head h, buffer slot j = 0..L-1, all float32):

    state S, anchor, read copy    [B, H, d_v, d_k]        (S k is a d_v vector)
    buffer k                      [B, H, L, d_k]
    buffer v                      [B, H, L, d_v]           raw v (Mamba-2: v = dt * x)
    buffer G                      [B, H, L]                cumulative log gate since the checkpoint:
                                                           G_j = G_{j-1} + log_a_j (sequential adds, G_{-1} = 0)
                                  [B, H, L, d_k]           the same per key channel for vector gates (KDA:
                                                           log_a [B, H, d_k], added elementwise)
    buffer beta (GDN)             [B, H, L]
    buffer u (GDN)                [B, H, L, d_v]           delta-rule correction computed against the
                                                           READ copy (used only for outputs)

Decay products are g(i+1..j) = exp(G_j - G_i) and g(1..j) = exp(G_j) (slots 1-indexed in the
formulas, 0-indexed in tensors).

Rebuild (flush), n committed entries, checkpoint S_c (dequantized anchor):

    GDN:  rhs_j = beta_j * (v_j - exp(G_j) * (S_c k_j))
          u_j   = rhs_j - beta_j * sum_{i<j} exp(G_j - G_i) (k_j . k_i) u_i      (forward substitution)
    Mamba-2: u_j = v_j
    S = exp(G_n) * S_c + sum_{j<=n} exp(G_n - G_j) u_j k_j^T

Read step (non-flush output at slot p, read copy R):

    GDN:  u_p = beta_p * (v_p - exp(G_p) * (R k_p)) - beta_p * sum_{i<p} exp(G_p - G_i) (k_p . k_i) u_i
    y_p = exp(G_p) * (R q) + sum_{j<=p} exp(G_p - G_j) (k_j . q) u_j        (output-only: no d_v x d_k matrix)

Vector gates (G [..., L, d_k], KDA): the decay multiplies the state's key axis, S Diag(exp(G)),
so every exp(G_j) above becomes a per-channel weight on k (or q) before the dot product:

    rhs_j = beta_j * (v_j - S_c (exp(G_j) * k_j))
    u_j   = rhs_j - beta_j * sum_{i<j} ((k_i * exp(G_j - G_i)) . k_j) u_i
    S     = S_c Diag(exp(G_n)) + sum_{j<=n} u_j (k_j * exp(G_n - G_j))^T
    y_p   = R (exp(G_p) * q) + sum_{j<=p} ((k_j * exp(G_p - G_j)) . q) u_j

Only exp(G_j) and exp(G_later - G_earlier) are formed (both <= 1 for gates a <= 1), never
exp(-G_j) alone, which overflows once a channel has forgotten enough. The functions below take
either kind and tell them apart by G.dim() (3: one gate per head, 4: per channel).

Masked slots (beyond the committed/valid length) contribute exact zeros (torch.where, so stale
buffer contents never leak, even if they are not finite).
"""

from __future__ import annotations

import torch

from replayquant.formats import QTensor


def matvec(S: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """S [b,H,d_v,d_k], X [b,H,n,d_k] -> [b,H,n,d_v]: S x for each of the n vectors x."""
    return torch.matmul(X, S.transpose(-1, -2))


def _gather_slot(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """t [b,H,L,...], p [b] slot per row -> [b,H,...]."""
    b, H = t.shape[:2]
    idx = p.view(b, 1, 1, *([1] * (t.dim() - 3))).expand(b, H, 1, *t.shape[3:])
    return t.gather(2, idx).squeeze(2)


def _scatter_slot(t: torch.Tensor, p: torch.Tensor, val: torch.Tensor) -> None:
    """t[b, :, p[b]] = val[b] in place; val [b,H,...]."""
    b, H = t.shape[:2]
    idx = p.view(b, 1, 1, *([1] * (t.dim() - 3))).expand(b, H, 1, *t.shape[3:])
    t.scatter_(2, idx, val.unsqueeze(2))


def committed_mask(n: torch.Tensor, buffer_len: int) -> torch.Tensor:
    """[b, 1, L] bool: entry j of row b is among its first n[b] (committed) entries."""
    return (torch.arange(buffer_len, device=n.device)[None, :] < n[:, None]).unsqueeze(1)


def solve_u(Sc, K, V, G, beta, valid):
    """Delta-rule corrections of every slot from checkpoint Sc (the triangular solve).
    G [b,H,L] or, for vector gates, [b,H,L,d_k]; valid [b,1,L]."""
    if G.dim() == 4:
        return _solve_u_vec(Sc, K, V, G, beta, valid)
    buffer_len = K.shape[2]
    rhs = beta.unsqueeze(-1) * (V - torch.exp(G).unsqueeze(-1) * matvec(Sc, K))
    KK = torch.matmul(K, K.transpose(-1, -2))                       # [b,H,L,L]: k_j . k_i
    jj = torch.arange(buffer_len, device=K.device)
    lower = jj[None, :] < jj[:, None]                               # [j, i]: i < j
    D = torch.where(lower, G.unsqueeze(-1) - G.unsqueeze(-2), torch.zeros((), device=G.device))
    W = torch.where(lower, torch.exp(D) * KK, torch.zeros((), device=G.device))
    U = rhs.clone()
    for j in range(1, buffer_len):
        corr = torch.matmul(W[:, :, j:j + 1, :j], U[:, :, :j, :])[:, :, 0, :]
        U[:, :, j, :] = rhs[:, :, j, :] - beta[:, :, j].unsqueeze(-1) * corr
    return torch.where(valid.unsqueeze(-1), U, torch.zeros((), device=U.device))


def _solve_u_vec(Sc, K, V, G, beta, valid):
    """solve_u for vector gates G [b,H,L,d_k]: row j's key products (k_i * exp(G_j - G_i)) . k_j
    are formed row by row (L d_k per row, no [L, L, d_k] tensor)."""
    buffer_len = K.shape[2]
    rhs = beta.unsqueeze(-1) * (V - matvec(Sc, torch.exp(G) * K))
    U = rhs.clone()
    for j in range(1, buffer_len):
        Kd = K[:, :, :j] * torch.exp(G[:, :, j:j + 1] - G[:, :, :j])        # [b,H,j,d_k]
        w = torch.matmul(Kd, K[:, :, j].unsqueeze(-1)).transpose(-1, -2)    # [b,H,1,j]
        corr = torch.matmul(w, U[:, :, :j, :])[:, :, 0, :]
        U[:, :, j, :] = rhs[:, :, j, :] - beta[:, :, j].unsqueeze(-1) * corr
    return torch.where(valid.unsqueeze(-1), U, torch.zeros((), device=U.device))


def rebuild(Sc, K, V, G, beta, n):
    """Unrounded FP32 state after the first n[b] buffered entries of each row (n may be 0).

    Sc [b,H,d_v,d_k] checkpoint; K [b,H,L,d_k]; V [b,H,L,d_v]; G [b,H,L] (or [b,H,L,d_k] for
    vector gates); beta [b,H,L] or None (Mamba-2); n int64 [b].
    Returns (S [b,H,d_v,d_k], U [b,H,L,d_v]); U = the corrections used (= v for Mamba-2).
    n = 0 returns Sc exactly.
    """
    if G.dim() == 4:
        return _rebuild_vec(Sc, K, V, G, beta, n)
    b, H, buffer_len = G.shape
    zero = torch.zeros((), device=G.device)
    valid = committed_mask(n, buffer_len)                                 # [b,1,L]
    Gn = torch.where((n > 0).view(b, 1), _gather_slot(G, (n - 1).clamp(min=0)), zero)  # [b,H]
    if beta is None:
        U = torch.where(valid.unsqueeze(-1), V, zero)
    else:
        U = solve_u(Sc, K, V, G, beta, valid)
    w = torch.where(valid, torch.exp(torch.where(valid, Gn.unsqueeze(-1) - G, zero)), zero)
    S = torch.exp(Gn)[..., None, None] * Sc + torch.matmul((U * w.unsqueeze(-1)).transpose(-1, -2), K)
    return S, U


def _rebuild_vec(Sc, K, V, G, beta, n):
    """rebuild for vector gates G [b,H,L,d_k]: S = Sc Diag(exp(G_n)) + sum_j u_j (k_j * exp(G_n - G_j))^T."""
    b, H, buffer_len, dk = G.shape
    zero = torch.zeros((), device=G.device)
    valid = committed_mask(n, buffer_len)                                 # [b,1,L]
    Gn = torch.where((n > 0).view(b, 1, 1), _gather_slot(G, (n - 1).clamp(min=0)), zero)  # [b,H,d_k]
    if beta is None:
        U = torch.where(valid.unsqueeze(-1), V, zero)
    else:
        U = solve_u(Sc, K, V, G, beta, valid)
    v4 = valid.unsqueeze(-1)
    w = torch.where(v4, torch.exp(torch.where(v4, Gn.unsqueeze(2) - G, zero)), zero)  # [b,H,L,d_k]
    S = torch.exp(Gn).unsqueeze(-2) * Sc + torch.matmul(U.transpose(-1, -2), K * w)
    return S, U


def read_outputs(R, K, V, G, beta, U, h, q):
    """Outputs of T appended entries at slots h..h+T-1 (already written to K, V, G, beta), from
    read copy R [b,H,d_v,d_k]. GDN: also computes and stores u of those slots into U (in place),
    against R. q [b,H,T,d_k]; G [b,H,L] or [b,H,L,d_k] (vector gates). Returns y [b,H,T,d_v]."""
    if G.dim() == 4:
        return _read_outputs_vec(R, K, V, G, beta, U, h, q)
    b, H, buffer_len = G.shape
    T = q.shape[2]
    zero = torch.zeros((), device=G.device)
    slot = torch.arange(buffer_len, device=G.device)
    Uv = V if beta is None else U
    Rq = matvec(R, q)                                                # [b,H,T,d_v]
    ys = []
    for i in range(T):
        p = h + i
        Gp = _gather_slot(G, p)                                      # [b,H]
        diff = Gp.unsqueeze(-1) - G                                  # [b,H,L]
        if beta is not None:
            lower = (slot[None, :] < p[:, None]).unsqueeze(1)        # [b,1,L]
            kp = _gather_slot(K, p)                                  # [b,H,d_k]
            vp = _gather_slot(V, p)
            bp = _gather_slot(beta, p).unsqueeze(-1)
            kk = torch.matmul(K, kp.unsqueeze(-1))[..., 0]           # [b,H,L]
            W = torch.where(lower, torch.exp(torch.where(lower, diff, zero)) * kk, zero)
            corr = torch.matmul(W.unsqueeze(2), U)[:, :, 0, :]
            rhs = bp * (vp - torch.exp(Gp).unsqueeze(-1) * matvec(R, kp.unsqueeze(2))[:, :, 0, :])
            _scatter_slot(U, p, rhs - bp * corr)
        upto = (slot[None, :] <= p[:, None]).unsqueeze(1)
        qi = q[:, :, i, :]
        qk = torch.matmul(K, qi.unsqueeze(-1))[..., 0]                # [b,H,L]: k_j . q
        W = torch.where(upto, torch.exp(torch.where(upto, diff, zero)) * qk, zero)
        ys.append(torch.exp(Gp).unsqueeze(-1) * Rq[:, :, i, :]
                  + torch.matmul(W.unsqueeze(2), Uv)[:, :, 0, :])
    return torch.stack(ys, dim=2)


def _read_outputs_vec(R, K, V, G, beta, U, h, q):
    """read_outputs for vector gates G [b,H,L,d_k]: the decay weights k_j per channel
    (k_j * exp(G_p - G_j)) before its dot with q or k_p, and the read copy reads exp(G_p) * q."""
    buffer_len = G.shape[2]
    T = q.shape[2]
    zero = torch.zeros((), device=G.device)
    slot = torch.arange(buffer_len, device=G.device)
    Uv = V if beta is None else U
    ys = []
    for i in range(T):
        p = h + i
        Gp = _gather_slot(G, p)                                      # [b,H,d_k]
        diff = Gp.unsqueeze(2) - G                                   # [b,H,L,d_k]
        eGp = torch.exp(Gp)
        if beta is not None:
            lower = (slot[None, :] < p[:, None]).unsqueeze(1)        # [b,1,L]
            kp = _gather_slot(K, p)                                  # [b,H,d_k]
            vp = _gather_slot(V, p)
            bp = _gather_slot(beta, p).unsqueeze(-1)
            Kd = K * torch.exp(torch.where(lower.unsqueeze(-1), diff, zero))
            W = torch.where(lower, torch.matmul(Kd, kp.unsqueeze(-1))[..., 0], zero)   # [b,H,L]
            corr = torch.matmul(W.unsqueeze(2), U)[:, :, 0, :]
            rhs = bp * (vp - matvec(R, (eGp * kp).unsqueeze(2))[:, :, 0, :])
            _scatter_slot(U, p, rhs - bp * corr)
        upto = (slot[None, :] <= p[:, None]).unsqueeze(1)
        qi = q[:, :, i, :]
        Kd = K * torch.exp(torch.where(upto.unsqueeze(-1), diff, zero))
        W = torch.where(upto, torch.matmul(Kd, qi.unsqueeze(-1))[..., 0], zero)        # [b,H,L]
        ys.append(matvec(R, (eGp * qi).unsqueeze(2))[:, :, 0, :]
                  + torch.matmul(W.unsqueeze(2), Uv)[:, :, 0, :])
    return torch.stack(ys, dim=2)


# ---------------------------------------------------------------- QTensor rows

def _parts(q: QTensor):
    return (q.payload, q.scale, q.gscale)


def qt_take(q: QTensor, idx: torch.Tensor, B: int) -> QTensor:
    """The batch rows idx of a packed state QTensor (every component has B outermost)."""
    def take(t):
        if t is None:
            return None
        per = t.shape[0] // B
        return t.view(B, per, *t.shape[1:])[idx].reshape(len(idx) * per, *t.shape[1:])
    pay, scale, gscale = (take(t) for t in _parts(q))
    return QTensor(q.format, (len(idx),) + tuple(q.shape[1:]), pay, scale=scale, gscale=gscale,
                   rounding=q.rounding)


def qt_put(q: QTensor, idx: torch.Tensor, sub: QTensor, B: int) -> None:
    """Write the rows of `sub` into rows idx of q, in place."""
    for t, s in zip(_parts(q), _parts(sub)):
        if t is not None:
            per = t.shape[0] // B
            t.view(B, per, *t.shape[1:])[idx] = s.reshape(len(idx), per, *t.shape[1:])


def qt_clone(q: QTensor) -> QTensor:
    return q.clone()
