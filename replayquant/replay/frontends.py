"""Model front ends: map a model's per-step tensors onto the generic core
`S_t = a_t S_{t-1} + u_t k_t^T` (log_a = log a_t) consumed by ReplayState / ConventionalState.

Both accept a leading [B] (one step) or [B, T] (drafts / a sequence) and keep the head axis at -2.

Mamba-2 (`delta=False`)::

    q, k, v, log_a = mamba2_inputs(x, dt, A, B, C, dt_bias)
    y = st.step(q, k, v, log_a) + D[:, None] * x      # D skip (and the z gate) stay outside

    dt    = softplus(dt_raw + dt_bias), clamped to dt_limit      [..., H]
    log_a = dt * A                          (A < 0, one per head)
    v     = dt * x                          [..., H, P]            (d_v = head dim P)
    k     = B, q = C                        [..., G, N] -> [..., H, N]: head h uses group h // (H / G)

Gated DeltaNet (`delta=True`), as transformers' `torch_recurrent_gated_delta_rule`::

    q, k, v, log_a, beta = gdn_inputs(q, k, v, g, b)
    y = st.step(q, k, v, log_a, beta)

    q, k  L2-normalised over d_k (x * rsqrt(sum x^2 + 1e-6), the HF / FLA formula),
          q then scaled by 1/sqrt(d_k); with fewer k-heads than v-heads each q/k head
          serves H_v / H_k consecutive v-heads
    log_a = g (already a log decay),   beta = sigmoid(b)   (pass beta=... instead if you have it)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["mamba2_inputs", "gdn_inputs", "l2norm"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads(t: torch.Tensor, H: int, name: str) -> torch.Tensor:
    G = t.shape[-2]
    if H % G:
        raise ValueError(f"{name}: {G} groups/heads do not divide {H} heads")
    return t if G == H else t.repeat_interleave(H // G, dim=-2)


def mamba2_inputs(x, dt, A, B, C, dt_bias=None, ngroups=None, *, dt_softplus=True,
                  dt_limit=(0.0, float("inf"))):
    """Mamba-2 step tensors -> (q, k, v, log_a) for the core (delta=False).

    x [..., H, P]; dt [..., H] (raw, before dt_bias and softplus); A [H] (negative);
    B, C [..., G, N]; dt_bias [H] or None; ngroups: G (checked against B if given).
    """
    H = x.shape[-2]
    if ngroups is not None and B.shape[-2] != ngroups:
        raise ValueError(f"B has {B.shape[-2]} groups, ngroups={ngroups}")
    if dt.shape != x.shape[:-1]:
        raise ValueError(f"dt has shape {list(dt.shape)}, expected {list(x.shape[:-1])}")
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    log_a = dt * A.float()
    v = dt.unsqueeze(-1) * x.float()
    return _heads(C.float(), H, "C"), _heads(B.float(), H, "B"), v, log_a


def gdn_inputs(q, k, v, g, b=None, *, beta=None, use_l2norm=True):
    """Gated DeltaNet step tensors -> (q, k, v, log_a, beta) for the core (delta=True).

    q, k [..., H_k, d_k]; v [..., H_v, d_v]; g [..., H_v] (log decay); b [..., H_v] (beta logits)
    or beta [..., H_v] directly.
    """
    if (b is None) == (beta is None):
        raise ValueError("gdn_inputs: pass exactly one of b (logits) or beta")
    H = v.shape[-2]
    q, k = q.float(), k.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q / math.sqrt(q.shape[-1])
    beta = torch.sigmoid(b.float()) if beta is None else beta.float()
    return _heads(q, H, "q"), _heads(k, H, "k"), v.float(), g.float(), beta
