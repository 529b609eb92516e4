"""The plain sequential FP32 recurrence (one step at a time, no rounding): the ground truth of
every accuracy comparison (drift report, tests). Written independently of the replay code.

    Y, S = recurrent_reference(S0, q, k, v, log_a, beta=None)
    S0 [B,H,d_v,d_k]; q, k [B,T,H,d_k]; v [B,T,H,d_v]; log_a [B,T,H]; beta [B,T,H] or None
    a = exp(log_a);  GDN: u = beta (v - a S k), Mamba-2: u = v;  S = a S + u k^T;  y = S q
"""

from __future__ import annotations

import torch


def recurrent_reference(S0, q, k, v, log_a, beta=None, return_states=False):
    S = S0.to(torch.float32).clone()
    q, k, v, log_a = (t.to(torch.float32) for t in (q, k, v, log_a))
    ys, states = [], []
    for t in range(q.shape[1]):
        a = torch.exp(log_a[:, t])[..., None]                     # [B,H,1]
        kt = k[:, t].unsqueeze(-2)                                 # [B,H,1,d_k]
        if beta is None:
            u = v[:, t]
        else:
            Sk = (S * kt).sum(-1)                                  # [B,H,d_v]
            u = beta[:, t].to(torch.float32)[..., None] * (v[:, t] - a * Sk)
        S = a[..., None] * S + u.unsqueeze(-1) * kt
        ys.append((S * q[:, t].unsqueeze(-2)).sum(-1))
        if return_states:
            states.append(S)
    Y = torch.stack(ys, dim=1)
    if return_states:
        return Y, S, torch.stack(states, dim=1)
    return Y, S
