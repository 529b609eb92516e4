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
