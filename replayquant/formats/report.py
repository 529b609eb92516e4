"""`replayquant formats`: every format and rounding on one state-like tensor, as a table.

The tensor (fixed seed, `state_like_tensor`) imitates SSM states: [8 heads, 128, 128] float32,
x[h, i, j] = 10^a_h * 10^b_hi * z_hij with a_h ~ U(-1, 1) (heads differ by up to two decades),
b_hi ~ N(0, 1) (rows differ by decades, as decayed key directions do) and z ~ N(0, 1). It spans
about ten decades, so the block and per-matrix scales of NVFP4 and the row scales of FP8 matter.

Columns: bytes per element (B/elem) at d = 128 (payload + scales, for one 128 x 128 matrix), RMSE of
the round trip, RMSE relative to the RMS of x, the largest relative error |x_hat - x| / |x|
over non-zero x (1.0 means some element was flushed to zero), and the share of non-zero
elements flushed to zero. Stochastic rounding uses one draw (seed 0).
"""

from __future__ import annotations

import math

import torch
from rich.console import Console
from rich.table import Table

from replayquant.formats import FORMATS
from replayquant.formats.constants import NVFP4_BLOCK, ROUNDINGS
from replayquant.memory import check_fits

DEFAULT_SHAPE = (8, 128, 128)
DEFAULT_SEED = 0


def check_dims(positive: dict, block_multiple: dict | None = None) -> None:
    """One ValueError for the first bad dimension. Keys are the option names users type
    (e.g. "--d-k"); every value in `positive` must be an integer >= 1, every value in
    `block_multiple` a positive multiple of NVFP4_BLOCK (NVFP4 scales blocks of 16 elements of
    a row, so its rows must split into whole blocks)."""
    for name, v in {**positive, **(block_multiple or {})}.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    for name, v in (block_multiple or {}).items():
        if v % NVFP4_BLOCK:
            raise ValueError(f"{name} must be a multiple of {NVFP4_BLOCK} (NVFP4 stores one scale "
                             f"per {NVFP4_BLOCK} elements of a row), got {v}")


def state_like_tensor(shape=DEFAULT_SHAPE, seed: int = DEFAULT_SEED) -> torch.Tensor:
    """Fixed-seed float32 tensor [H, R, C] whose heads and rows span decades (module docstring)."""
    if len(shape) != 3:
        raise ValueError(f"state_like_tensor: shape must be (heads, rows, cols), got {shape}")
    H, R, C = shape
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(H, 1, 1, generator=gen, dtype=torch.float64) * 2 - 1
    b = torch.randn(H, R, 1, generator=gen, dtype=torch.float64)
    z = torch.randn(H, R, C, generator=gen, dtype=torch.float64)
    return (10.0 ** a * 10.0 ** b * z).to(torch.float32)


def error_stats(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """RMSE, relative RMSE, max relative error over non-zero x, share of non-zero x flushed."""
    x64, e = x.double(), (x_hat.double() - x.double())
    nz = x64 != 0
    rmse = math.sqrt(float((e ** 2).mean()))
    rms = math.sqrt(float((x64 ** 2).mean()))
    rel = (e[nz].abs() / x64[nz].abs())
    return {
        "rmse": rmse,
        "rel_rmse": rmse / rms if rms > 0 else 0.0,
        "max_rel_err": float(rel.max()) if rel.numel() else 0.0,
        "flushed": float((x_hat[nz] == 0).double().mean()) if nz.any() else 0.0,
    }


def formats_report(shape=DEFAULT_SHAPE, seed: int = DEFAULT_SEED, d: int = 128) -> list[dict]:
    """One row per (format, rounding): bytes/element at d and the error statistics."""
    if len(shape) != 3:
        raise ValueError(f"the test tensor's shape must be (heads, rows, cols), got {tuple(shape)}")
    check_dims({"--heads": shape[0]}, {"--d": shape[2]})
    check_dims({"rows": shape[1]})
    n = shape[0] * shape[1] * shape[2]
    check_fits(64.0 * n, f"the test tensor {list(shape)} ({n} elements: its float64 draw, the "
                         f"round trips and their error statistics)",
               "give a smaller --d or fewer --heads", "cpu")
    x = state_like_tensor(shape, seed)
    rows = []
    for name, fmt in FORMATS.items():
        for rounding in ROUNDINGS:
            if name == "fp32" and rounding == "stochastic":
                continue
            x_hat = fmt.fake_quantize(x, rounding, seed=0)
            rows.append({"format": name, "rounding": rounding,
                         "bytes_per_element": fmt.bytes_per_element(d, d),
                         **error_stats(x, x_hat)})
    return rows


def render_formats_table(rows: list[dict], shape=DEFAULT_SHAPE, seed: int = DEFAULT_SEED):
    """A rich Table of `formats_report` rows."""
    t = Table(title=f"State formats on a state-like tensor {list(shape)} (seed {seed}; "
                    f"see replayquant/formats/report.py)")
    for col, just in (("format", "left"), ("rounding", "left"), ("B/elem", "right"),
                      ("RMSE", "right"), ("rel RMSE", "right"), ("max rel err", "right"),
                      ("flushed", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in rows:
        t.add_row(r["format"], r["rounding"], f"{r['bytes_per_element']:.4f}", f"{r['rmse']:.2e}",
                  f"{r['rel_rmse']:.2e}", f"{r['max_rel_err']:.2e}", f"{100 * r['flushed']:.3f}%")
    return t


def print_formats_table(shape=DEFAULT_SHAPE, seed: int = DEFAULT_SEED) -> list[dict]:
    rows = formats_report(shape, seed)
    Console().print(render_formats_table(rows, shape, seed))
    return rows


__all__ = ["check_dims", "state_like_tensor", "error_stats", "formats_report",
           "render_formats_table", "print_formats_table"]
