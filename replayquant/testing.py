"""Random decode-kernel inputs shared by the kernel tests (CPU, Triton interpreter) and the
decode-kernel benchmark (GPU, `replayquant bench kernels`).

Inputs look like a real model's: bf16 activations, raw gate logits in FP32, decays a in
(0.9, 1) on average (GDN A_log / dt_bias, Mamba-2 A / dt ranges as in the released checkpoints).
Every draw comes from its own generator seeded from `seed` (a different offset per function),
so a test's inputs depend on its seeds alone, not on what ran before it.
"""

from __future__ import annotations

import torch


def cpu_generator(seed) -> torch.Generator:
    """A CPU generator seeded with `seed`: draws that do not depend on the global RNG."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def _qkv(B, HK, H, dk, dv, T, seed):
    """The draws a step's inputs start with: (generator, leading shape, normal draw, q, k, v bf16)."""
    g = cpu_generator(seed)
    lead = (B,) if T is None else (B, T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return g, lead, r, r(*lead, HK, dk).bfloat16(), r(*lead, HK, dk).bfloat16(), r(*lead, H, dv).bfloat16()


def gdn_step_inputs(B, HK, H, dk, dv, T=None, seed=0, device="cpu"):
    """(q, k, v, a, b) of one step ([B, ...]) or T drafts ([B, T, ...]); q, k, v bf16."""
    _, lead, r, q, k, v = _qkv(B, HK, H, dk, dv, T, seed)
    a = r(*lead, H) * 0.5
    b = r(*lead, H)
    return tuple(t.to(device) for t in (q, k, v, a, b))


def gdn_params(H, seed=0, device="cpu"):
    """(A_log, dt_bias) [H]: -exp(A_log) softplus(a + dt_bias) gives decays mostly in (0.9, 1)."""
    g = cpu_generator(seed + 7919)
    A_log = torch.rand(H, generator=g) * 1.5 - 4.0
    dt_bias = torch.rand(H, generator=g) * 0.5
    return A_log.to(device), dt_bias.to(device)


def kda_step_inputs(B, HK, H, dk, dv, T=None, seed=0, device="cpu"):
    """(q, k, v, g, beta) of one Kimi Delta Attention step ([B, ...]) or T drafts ([B, T, ...]):
    q, k, v bf16; g [.., H, dk] FP32 log decay per key channel, -rate * softplus(f) with a rate
    per (head, channel) spread log-uniformly over [1e-3, 5], so some channels keep their
    state for thousands of steps while others forget within one; beta = sigmoid(b) FP32."""
    g, lead, r, q, k, v = _qkv(B, HK, H, dk, dv, T, seed)
    rate = 10.0 ** (torch.rand(H, dk, generator=g) * 3.7 - 3.0)
    gate = -rate * torch.nn.functional.softplus(r(*lead, H, dk) * 0.5)
    beta = torch.sigmoid(r(*lead, H))
    return tuple(t.to(device) for t in (q, k, v, gate, beta))


def mamba2_step_inputs(B, G, H, N, P, T=None, seed=0, device="cpu", z=True):
    """(x, dt, Bm, C, z) of one step or T drafts; x, B, C, z bf16, dt raw FP32."""
    g = cpu_generator(seed)
    lead = (B,) if T is None else (B, T)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = r(*lead, H, P).bfloat16()
    dt = r(*lead, H) * 0.5 - 2.0
    Bm = r(*lead, G, N).bfloat16()
    C = r(*lead, G, N).bfloat16()
    zz = r(*lead, H, P).bfloat16() if z else None
    return tuple(None if t is None else t.to(device) for t in (x, dt, Bm, C, zz))


def mamba2_params(H, seed=0, device="cpu"):
    """(A, D, dt_bias) [H]: A < 0."""
    g = cpu_generator(seed + 104729)
    A = -(torch.rand(H, generator=g) * 2.0 + 0.5)
    D = torch.randn(H, generator=g)
    dt_bias = torch.rand(H, generator=g) * 0.5 - 1.0
    return A.to(device), D.to(device), dt_bias.to(device)


def random_state(N, H, dv, dk, seed=0, device="cpu", scale=0.3):
    """States [N, H, d_v, d_k], normal with standard deviation `scale`; on a CUDA device drawn
    there (a benchmark's states run to gigabytes)."""
    if str(device).startswith("cuda"):
        g = torch.Generator(device=device)
        g.manual_seed(seed + 15485863)
        return torch.randn(N, H, dv, dk, generator=g, device=device) * scale
    return torch.randn(N, H, dv, dk, generator=cpu_generator(seed + 15485863)) * scale
