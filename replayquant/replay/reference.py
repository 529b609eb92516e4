"""The plain sequential recurrence (one step at a time, no rounding): the ground truth of every
accuracy comparison (drift report, tests). Written independently of the replay code.

    Y, S = recurrent_reference(S0, q, k, v, log_a, beta=None, dtype=torch.float32)
    S0 [B,H,d_v,d_k]; q, k [B,T,H,d_k]; v [B,T,H,d_v]; beta [B,T,H] or None
    log_a [B,T,H] (one gate per head):  a = exp(log_a)
        GDN: u = beta (v - a S k), Mamba-2: u = v;  S = a S + u k^T;  y = S q
    log_a [B,T,H,d_k] (one gate per key channel, Kimi Delta Attention):  a = exp(log_a)
        S' = S Diag(a);  GDN: u = beta (v - S' k), Mamba-2: u = v;  S = S' + u k^T;  y = S q

dtype: the arithmetic (float32; float64 for a reference well below FP32 rounding). Y and S are
returned in that dtype.
"""

from __future__ import annotations

import torch


def recurrent_reference(S0, q, k, v, log_a, beta=None, return_states=False, dtype=torch.float32):
    S = S0.to(dtype).clone()
    q, k, v, log_a = (t.to(dtype) for t in (q, k, v, log_a))
    per_channel = log_a.dim() == 4
    ys, states = [], []
    for t in range(q.shape[1]):
        kt = k[:, t].unsqueeze(-2)                                 # [B,H,1,d_k]
        if per_channel:
            S = S * torch.exp(log_a[:, t]).unsqueeze(-2)           # decay the key axis
            a = None
        else:
            a = torch.exp(log_a[:, t])[..., None]                  # [B,H,1]
        if beta is None:
            u = v[:, t]
        else:
            Sk = (S * kt).sum(-1)                                  # [B,H,d_v]
            Sk = Sk if a is None else a * Sk
            u = beta[:, t].to(dtype)[..., None] * (v[:, t] - Sk)
        S = (S if a is None else a[..., None] * S) + u.unsqueeze(-1) * kt
        ys.append((S * q[:, t].unsqueeze(-2)).sum(-1))
        if return_states:
            states.append(S)
    Y = torch.stack(ys, dim=1)
    if return_states:
        return Y, S, torch.stack(states, dim=1)
    return Y, S
