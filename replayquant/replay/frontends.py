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

Kimi Delta Attention (`delta=True`, state built with `vector_gate=True`), as transformers'
`recurrent_kimi_delta_attention` / `chunk_kimi_delta_attention` (Kimi Linear, GLM-5-Next)::

    g = kda_log_decay(f, A_log, dt_bias, lower_bound)   # the layer's forget gate, f = f_b(f_a(x))
    q, k, v, log_a, beta = kda_inputs(q, k, v, g, b)
    y = st.step(q, k, v, log_a, beta)

    g     = -exp(A_log) * softplus(f + dt_bias)              (Kimi Linear; softplus(x) = x above 20)
          = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) (GLM-5-Next with a gate lower bound:
                                                               log_a in (lower_bound, 0))
    q, k  L2-normalised over d_k as x / sqrt(sum x^2 + 1e-6), then q * d_k^-0.5
    log_a = g [..., H, d_k] (one log decay per key channel), beta = sigmoid(b)
    recurrence: S_t = S_{t-1} Diag(a_t) + u_t k_t^T, u_t = beta_t (v_t - S_{t-1} (a_t * k_t)),
    y_t = S_t q_t; transformers keeps the state as [B, H, d_k, d_v], the core as [B, H, d_v, d_k]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["mamba2_dt", "mamba2_inputs", "gdn_inputs", "kda_inputs", "kda_log_decay", "l2norm",
           "l2norm_kda", "L2NORM_EPS"]

# the epsilon under the root of q's and k's L2 norm, as transformers' GDN and KDA layers (and fla)
# add it; the Triton kernels write the same constant in their own code
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's L2 norm over the last axis: x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def l2norm_kda(x: torch.Tensor) -> torch.Tensor:
    """Kimi Delta Attention's L2 norm over the last axis, transformers' form: x / sqrt(sum x^2 +
    eps) (a division by the root, which rounds differently from l2norm's product)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _heads(t: torch.Tensor, H: int, name: str) -> torch.Tensor:
    G = t.shape[-2]
    if H % G:
        raise ValueError(f"{name}: {G} groups/heads do not divide {H} heads")
    return t if G == H else t.repeat_interleave(H // G, dim=-2)


def mamba2_dt(dt, dt_bias=None, *, dt_softplus=True, dt_limit=(0.0, float("inf"))):
    """Mamba-2's step size in float32 from the raw dt [..., H]: softplus(dt + dt_bias), clamped
    to dt_limit unless it is (0, inf). The one formula of the chunked scan's v = dt x and of the
    dt a decode store keeps beside the raw x of a prompt's entries (so both hold the same bits)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None and tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(dt_limit[0], dt_limit[1])
    return dt


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
    dt = mamba2_dt(dt, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
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


def kda_log_decay(f, A_log, dt_bias, lower_bound=None):
    """Kimi Delta Attention forget gate -> log decay g [..., H, d_k] (float32), as transformers'
    KimiLinearForgetGate / Glm5NextTextForgetGate compute it.

    f [..., H * d_k] (the gate projection f_b_proj(f_a_proj(x))); A_log: one per head, [H] or any
    shape holding H values (e.g. [1, 1, H, 1]); dt_bias [H * d_k]; lower_bound None (Kimi Linear:
    -exp(A_log) * softplus(f + dt_bias)) or a negative float (GLM-5-Next's safe gate:
    lower_bound * sigmoid(exp(A_log) * (f + dt_bias)))."""
    H = A_log.numel()
    if f.shape[-1] % H or dt_bias.numel() != f.shape[-1]:
        raise ValueError(f"kda_log_decay: f has {f.shape[-1]} channels, dt_bias {dt_bias.numel()}, "
                         f"A_log {H} heads; expected f and dt_bias of H * d_k channels each")
    g = (f.float() + dt_bias.float().reshape(-1)).unflatten(-1, (H, -1))      # [..., H, d_k]
    rate = torch.exp(A_log.float().reshape(H, 1))
    if lower_bound is not None:
        if not lower_bound < 0:
            raise ValueError(f"kda_log_decay: lower_bound must be negative (a log decay), got {lower_bound}")
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def kda_inputs(q, k, v, g, b=None, *, beta=None, use_l2norm=True):
    """Kimi Delta Attention step tensors -> (q, k, v, log_a, beta) for the core (delta=True,
    vector_gate=True).

    q, k [..., H_k, d_k]; v [..., H, d_v]; g [..., H, d_k] (log decay per key channel, e.g. from
    kda_log_decay); b [..., H] (beta logits) or beta [..., H] directly. With fewer q/k heads
    than v heads each q/k head serves H / H_k consecutive v heads (as gdn_inputs)."""
    if (b is None) == (beta is None):
        raise ValueError("kda_inputs: pass exactly one of b (logits) or beta")
    H, dk = v.shape[-2], k.shape[-1]
    if tuple(g.shape) != tuple(v.shape[:-1]) + (dk,):
        raise ValueError(f"kda_inputs: g has shape {list(g.shape)}, expected "
                         f"{list(v.shape[:-1]) + [dk]} (one log decay per head and key channel)")
    q, k = q.float(), k.float()
    if use_l2norm:        # transformers' KDA form (divide by the root), not gdn's rsqrt product
        q, k = l2norm_kda(q), l2norm_kda(k)
    q = q * (1 / q.shape[-1] ** 0.5)
    beta = torch.sigmoid(b.float()) if beta is None else beta.float()
    return _heads(q, H, "q"), _heads(k, H, "k"), v.float(), g.float(), beta
