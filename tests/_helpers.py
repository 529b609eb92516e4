"""Assertions shared by several test files (pytest puts tests/ on sys.path)."""

import torch


def assert_states_close(a: torch.Tensor, b: torch.Tensor, tight=1e-5, frac=0.02):
    """Dequantized states: equal within float32 reassociation, except a few elements where the
    tiny difference of the unrounded values crossed a rounding boundary (one grid step)."""
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    scale = b.abs().max().clamp(min=1e-30)
    d = (a - b).abs()
    assert (d > tight * scale).float().mean() <= frac, (d.max() / scale).item()
    assert d.max() <= 0.5 * scale


def scan_inputs(gen, B, T, H, dk, dv, delta, a_min=0.9):
    """Random recurrence inputs [B, T, H, ...]: q scaled by 1/sqrt(dk), L2-normalised k, decay
    a in [a_min, 1), beta in [0, 1) for GDN (delta) else None."""
    q = torch.randn(B, T, H, dk, generator=gen) / dk ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=gen), dim=-1)
    v = torch.randn(B, T, H, dv, generator=gen)
    log_a = torch.log(a_min + (1 - a_min) * torch.rand(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen) if delta else None
    return q, k, v, log_a, beta
