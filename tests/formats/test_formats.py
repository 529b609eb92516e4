"""Format semantics through the public API (torch reference backend unless a test says otherwise):
nearest rounding against torch's own casts, NVFP4 against an independent two-level recipe,
stochastic rounding statistics, zeros, errors, byte counts."""

import math

import pytest
import torch

from replayquant.formats import FORMATS, as_bits, get_format
from replayquant.formats.constants import (BF16, E2M1, E2M1_VALUES, E4M3, FP16,
                                           NVFP4_BLOCK_SCALE_MIN)
from replayquant.formats.philox import random_bits_ref
from replayquant.formats.casts import grid_value_ref, round_to_grid_ref

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("REPLAYQUANT_BACKEND", request.param)
    return request.param


def _edge_values() -> torch.Tensor:
    """Huge, tiny, fp32/fp16/bf16 subnormals, ties of every grid, zeros, negative zero."""
    h = 2.0 ** -11
    vals = [
        0.0, -0.0, 1.0, -1.0, 1 + h, 1 + 3 * h, 1 + h / 2, 2 - h / 2,           # fp16 ties
        1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -9,                     # bf16 ties
        65504.0, 65519.0, 65519.99, 65520.0, 65535.0, 65536.0, 7e4, -7e4,    # fp16 overflow edge
        3.3895313892515355e38, 3.39e38, 3.3961e38, 3.4028234e38, -3.4e38,   # bf16 overflow edge
        2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 5 * 2.0 ** -26,  # fp16 subnormal ties
        6.1e-5, 6.0e-5, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25, 1e-6, -3e-7,
        1e-38, 1.17549435e-38, 1.1754942e-38, 1e-40, 1e-45, -1e-45, 2.0 ** -133,  # fp32 subnormals
        2.0 ** -126 * (1 + 2.0 ** -8), 2.0 ** -130 * 3,
        1e-30, 1e30, -1e20, 123.456, -0.1, 0.3,
    ]
    return torch.tensor(vals, dtype=torch.float32)


def _random_values(n: int, gen: torch.Generator) -> torch.Tensor:
    """Values spanning many decades, both signs."""
    mag = torch.exp(torch.empty(n).uniform_(-30, 30, generator=gen))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).to(torch.float32)


def _bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


# ---------------------------------------------------------------- nearest against torch casts

@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_nearest_cast_bit_exact_vs_torch(name, dtype, backend):
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([_edge_values(), _random_values(4000, gen)])
    # also every tie between adjacent values of a random sample of the target grid
    grid = _random_values(500, gen).to(dtype)
    nxt = (_bits16(grid).to(torch.int32) + 1).to(torch.int16).view(dtype)
    ok = torch.isfinite(nxt.float()) & torch.isfinite(grid.float())
    mids = (grid.float()[ok].double() + nxt.float()[ok].double()) / 2
    x = torch.cat([x, mids.float()])
    x = x[: (x.numel() // 16) * 16].reshape(2, -1, 16)
    q = get_format(name).quantize(x, "nearest")
    assert q.payload.dtype == dtype
    assert torch.equal(_bits16(q.payload), _bits16(x.to(dtype)))
    assert torch.equal(_bits16(get_format(name).dequantize(q).to(dtype)), _bits16(x.to(dtype)))


def test_fp8_nearest_bit_exact_vs_torch_on_scaled_values(backend):
    gen = torch.Generator().manual_seed(12)
    rows = [_random_values(64, gen) for _ in range(6)]
    rows.append(torch.tensor([448.0, 0.0, -0.0, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                              2.0 ** -6, 2.0 ** -6 + 2.0 ** -10, 1.0625, 1.1875, 17.0, 19.0,
                              240.0, 232.0, 416.0, 432.0, 440.0, -447.0, 1e-30, -1e-45]
                             + [0.5] * 43))
    x = torch.stack(rows).reshape(7, 1, 64)
    q = get_format("fp8").quantize(x, "nearest")
    scale = q.scales["row"]
    assert scale.shape == (7, 1)
    assert torch.equal(scale, x.abs().amax(-1) / 448.0)
    y = x / scale.unsqueeze(-1)
    assert float(y.abs().max()) <= 448.0
    assert torch.equal(q.payload.view(torch.uint8), y.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(get_format("fp8").dequantize(q),
                       y.to(torch.float8_e4m3fn).float() * scale.unsqueeze(-1))


@pytest.mark.parametrize("grid,dtype", [(FP16, torch.float16), (BF16, torch.bfloat16),
                                        (E4M3, torch.float8_e4m3fn)])
def test_round_to_grid_ref_equals_torch_cast(grid, dtype):
    gen = torch.Generator().manual_seed(13)
    x = torch.cat([_edge_values(), _random_values(3000, gen)])
    if grid is E4M3:
        x = x[x.abs() <= 448.0]          # torch's float8 cast of larger values is version dependent
    code, sign = round_to_grid_ref(x, grid)
    expect = x.to(dtype).view(torch.int16 if grid.sign_shift == 15 else torch.uint8).to(torch.int32)
    got = code | (sign << grid.sign_shift)
    if grid.sign_shift == 15:
        got = got.to(torch.int16).to(torch.int32)
    assert torch.equal(got, expect)


def test_e4m3_and_e2m1_saturate():
    x = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e6, 3e38, -500.0])
    code, sign = round_to_grid_ref(x, E4M3)
    assert torch.equal(grid_value_ref(code, sign, E4M3), torch.tensor([448.0] * 6 + [-448.0]))
    x = torch.tensor([6.0, 6.5, 7.0, 1e9, -6.2])
    for rb in (None, torch.zeros(5, dtype=torch.int64), torch.full((5,), 0xFFFFFFFF)):
        code, sign = round_to_grid_ref(x, E2M1, rb)
        assert torch.equal(grid_value_ref(code, sign, E2M1), torch.tensor([6.0] * 4 + [-6.0]))


# ---------------------------------------------------------------- NVFP4 against the recipe

_E2M1_TIES_UP = (0.75, 1.75, 3.5)          # ties that go up to the even code
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)   # ties that stay at the even code below


def _e2m1_rne(y: torch.Tensor) -> torch.Tensor:
    """Independent E2M1 round-to-nearest-even by thresholds 0.25/0.75/1.25/1.75/2.5/3.5/5."""
    a = y.abs()
    idx = sum((a > t).to(torch.int64) for t in _E2M1_TIES_DOWN)
    idx = idx + sum((a >= t).to(torch.int64) for t in _E2M1_TIES_UP)
    v = torch.tensor(E2M1_VALUES)[idx]
    return torch.where(y < 0, -v, v)


def _nvfp4_recipe(x3: torch.Tensor):
    """Two-level NVFP4 written from the published recipe; returns (x_hat, block scale fp32, gs)."""
    M, R, C = x3.shape
    gs = x3.abs().amax(dim=(1, 2)) / (448.0 * 6.0)
    gs = torch.where(gs > 0, gs, torch.ones_like(gs))
    b = x3.reshape(M, R, C // 16, 16)
    bs = (b.abs().amax(-1) / 6.0 / gs[:, None, None]).clamp(2.0 ** -9, 448.0)
    bs = bs.to(torch.float8_e4m3fn).to(torch.float32)
    den = bs * gs[:, None, None]
    v = _e2m1_rne(b / den.unsqueeze(-1))
    x_hat = (v * bs.unsqueeze(-1)) * gs[:, None, None, None]
    return x_hat.reshape(M, R, C), bs, gs


def _nvfp4_inputs():
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 4, 8, 64, generator=gen)
    x = x * torch.exp(torch.randn(3, 4, 8, 1, generator=gen) * 3)        # rows span decades
    x = x * torch.exp(torch.randn(3, 4, 1, 64, generator=gen) * 2)
    x[0, 0, 0, :16] = 0.0                                                  # a zero block
    x[0, 1] = 0.0                                                          # a zero matrix
    x[1, 0, 0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0,
                                    -0.25, -0.75, -5.0, 0.0, -0.0, 4.0, 6.0, 3.0])
    x[1, 0, 1, :] = 1e-6                                                  # tiny rows: clamped
    x[1, 0, 2, :] = 1e-12
    return x


def test_nvfp4_nearest_matches_independent_recipe(backend):
    x = _nvfp4_inputs()
    fmt = get_format("nvfp4")
    q = fmt.quantize(x, "nearest")
    x3 = x.reshape(-1, 8, 64)
    x_hat, bs, gs = _nvfp4_recipe(x3)
    assert q.payload.dtype == torch.uint8 and q.payload.shape == (12, 8, 32)
    assert torch.equal(q.scales["matrix"], gs)
    assert torch.equal(grid_value_ref(q.scales["block"].to(torch.int32),
                                      torch.zeros_like(q.scales["block"], dtype=torch.int32), E4M3),
                       bs)
    out = fmt.dequantize(q)
    assert out.shape == x.shape
    assert torch.equal(out, x_hat.reshape(x.shape))
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 1], torch.zeros(8, 64))
    assert torch.equal(out[0, 0, 0, :16], torch.zeros(16))


def test_nvfp4_packing_layout():
    # one block with scale 1 and global scale 1: x = E2M1 values, element 2i low nibble
    x = torch.zeros(1, 16, 16)
    x[0, 0] = torch.tensor([0.5, -1.0, 6.0, 0.0, 1.5, -0.5, 2.0, 3.0, 4.0, -6.0, 0, 0, 0, 0, 0, 0])
    x[0, 1:, :] = 6.0
    x[0, 15, 0] = 2688.0                      # amax 2688 -> global scale exactly 1
    q = get_format("nvfp4").quantize(x, "nearest")
    assert float(q.scales["matrix"][0]) == 1.0
    assert int(q.scales["block"][0, 0, 0]) == 0x38            # E4M3 1.0
    assert q.payload[0, 0, :5].tolist() == [0x1 | (0xA << 4), 0x7 | (0x0 << 4),
                                            0x3 | (0x9 << 4), 0x4 | (0x5 << 4),
                                            0x6 | (0xF << 4)]


# ---------------------------------------------------------------- stochastic rounding

def _positive_grid(grid) -> torch.Tensor:
    """Every finite non-negative value of a grid, ascending (float64)."""
    if grid is FP16:
        return torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).double()
    if grid is E4M3:
        return torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    if grid is E2M1:
        return torch.tensor(E2M1_VALUES, dtype=torch.float64)
    raise AssertionError(grid)


def _neighbours(a: torch.Tensor, grid):
    """(lower, upper) grid neighbours of magnitudes a (equal where a is on the grid; the upper
    one saturates at the grid max)."""
    g = _positive_grid(grid)
    i = (torch.searchsorted(g, a.double(), right=True) - 1).clamp(max=g.numel() - 1)
    lo = g[i]
    hi = torch.where(lo == a.double(), lo, g[(i + 1).clamp(max=g.numel() - 1)])
    return lo, hi


def _sr_values(grid):
    if grid is FP16:   # normals, subnormals (< 2^-14), values near 1 and near the max
        return torch.tensor([1.0 + 2.0 ** -12, 1.3, 3.14159, -2.71828, 1000.3, 65000.5, 6e-5,
                             1e-6, -3e-7, 2.0 ** -25, 7e-8, 1.0, 2.0 ** -24, -0.0])
    if grid is E4M3:   # normals, subnormals (< 2^-6), above the max (saturation)
        return torch.tensor([1.1, 0.3, -17.5, 300.0, 440.0, 0.01, 2.0 ** -10, -0.004, 3e-4,
                             448.0, 460.0, 2.0 ** -9, 0.0, 1e4])
    return torch.tensor([0.1, 0.4, 0.7, 1.2, -1.9, 2.2, 2.9, 4.5, 5.9, -0.25, 6.0, 3.0, 7.5, 0.0])


@pytest.mark.parametrize("grid", [FP16, E4M3, E2M1], ids=lambda g: g.name)
def test_sr_unbiased_neighbours_only(grid):
    vals = _sr_values(grid)
    n = 4000
    y = vals.reshape(1, 1, -1).expand(n, 1, -1)
    rb = random_bits_ref(y.shape, seed=99, stream=17)
    code, sign = round_to_grid_ref(y, grid, rb)
    if grid is FP16:
        got = (code | (sign << 15)).to(torch.int16).view(torch.float16).double()
    else:
        got = grid_value_ref(code, sign, grid).double()
    a = vals.abs()
    lo, hi = _neighbours(a, grid)
    mag = got.abs()
    assert bool(((mag == lo) | (mag == hi)).all()), "SR left the two neighbours"
    assert torch.equal(torch.signbit(got), torch.signbit(y).expand_as(got))
    on_grid = lo == a.double()
    assert bool((mag[..., on_grid] == a.double()[on_grid]).all()), "representable value changed"
    sat = a.double() > _positive_grid(grid)[-1]
    assert bool((mag[..., sat] == lo[sat]).all()), "saturating grid exceeded its max"
    # mean converges to x: tolerance from the Bernoulli variance (plus the 2^-24 bias bound)
    target = torch.where(sat, lo, a.double())
    var = (target - lo) * (hi - target)
    tol = 5 * torch.sqrt(var / n) + 2.0 ** -23 * (hi - lo) + 1e-300
    err = (mag.mean(dim=(0, 1)) - target).abs()
    assert bool((err <= tol).all()), (err, tol)
    # both neighbours occur where x sits well inside its interval
    inside = (~on_grid) & (~sat) & ((a.double() - lo) > 0.05 * (hi - lo)) & \
             ((hi - a.double()) > 0.05 * (hi - lo))
    assert bool(((mag == lo).any(dim=(0, 1)) & (mag == hi).any(dim=(0, 1)))[inside].all())


def test_sr_bf16_neighbours():
    x = torch.tensor([1.0 + 2.0 ** -10, 3.3e38, 1e-39, -5.5, 1e-20])
    y = x.reshape(1, 1, -1).expand(2000, 1, -1)
    q = get_format("bf16").quantize(y, "stochastic", seed=4)
    b = q.payload.view(torch.int16).to(torch.int32)
    near = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    # only the two codes around x (adjacent bit patterns), mean -> x
    assert bool(((b - near).abs() <= 1).all())
    assert len(set(b[:, 0, 0].tolist())) == 2
    mean = q.payload.double().mean(dim=(0, 1))
    assert abs(float(mean[0]) - float(x[0])) < 5 * 2.0 ** -8 / math.sqrt(2000) + 1e-12


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "nvfp4"])
def test_sr_deterministic_and_streams_differ(name, backend):
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(3, 2, 4, 32, generator=gen)
    fmt = get_format(name)
    a = fmt.fake_quantize(x, "stochastic", seed=7, stream=10)
    assert torch.equal(a, fmt.fake_quantize(x, "stochastic", seed=7, stream=10))
    assert torch.equal(a, fmt.dequantize(fmt.quantize(x, "stochastic", seed=7, stream=10)))
    assert not torch.equal(a, fmt.fake_quantize(x, "stochastic", seed=8, stream=10))
    b = fmt.fake_quantize(x, "stochastic", seed=7, stream=11)
    # int stream s gives matrix i the stream s + i: shifting by one shifts the matrices
    assert torch.equal(b, fmt.fake_quantize(x, "stochastic", seed=7,
                                            stream=torch.arange(11, 17).reshape(3, 2)))
    assert not torch.equal(a.reshape(6, 4, 32)[0], b.reshape(6, 4, 32)[0])
    a1 = fmt.fake_quantize(x.reshape(6, 4, 32)[1:].contiguous(), "stochastic", seed=7, stream=11)
    assert torch.equal(a.reshape(6, 4, 32)[1:], a1)
    streams = torch.tensor([[5, 2 ** 40 + 3], [7, 9], [1, 2 ** 62]])
    c = fmt.fake_quantize(x, "stochastic", seed=7, stream=streams)
    assert torch.equal(c, fmt.fake_quantize(x, "stochastic", seed=7, stream=streams))
    mats = c.reshape(6, 4, 32)
    assert not torch.equal(mats[0], fmt.fake_quantize(x[0, 0], "stochastic", seed=7, stream=6))
    assert torch.equal(mats[0], fmt.fake_quantize(x[0, 0], "stochastic", seed=7, stream=5))
    # the same values in two matrices with different streams round differently
    same = x[:1, :1].expand(1, 2, 4, 32).contiguous()
    d = fmt.fake_quantize(same, "stochastic", seed=7, stream=0)
    assert not torch.equal(d[0, 0], d[0, 1])


def test_sr_explicit_bits_match_generated():
    x = torch.randn(2, 8, 32)
    for name in ("fp16", "fp8", "nvfp4"):
        fmt = get_format(name)
        rb = random_bits_ref(x.shape, seed=3, stream=4)
        assert torch.equal(fmt.fake_quantize(x, "stochastic", seed=3, stream=4),
                           fmt.fake_quantize(x, "stochastic", rbits=rb))


# ---------------------------------------------------------------- zeros, errors, bytes

@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zero_rows_blocks_give_zeros(name, rounding, backend):
    """Zero rows and blocks dequantize to zeros beside a non-zero one; Format.zeros (a new
    state's roles, without the finiteness check) is quantize(zeros) bit for bit."""
    x = torch.zeros(2, 3, 4, 32)
    x[1, 2, 1, 5] = -3.0
    fmt = get_format(name)
    out = fmt.fake_quantize(x, rounding, seed=1)
    assert not torch.isnan(out).any()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, 2, 1] = False
    assert bool((out[mask] == 0).all())
    want = fmt.quantize(torch.zeros(x.shape), rounding, seed=1, stream=torch.arange(3) + 5)
    got = fmt.zeros(x.shape)
    assert (got.format, got.shape, sorted(got.scales)) == (want.format, want.shape,
                                                           sorted(want.scales))
    for a, b in [(got.payload, want.payload)] + [(got.scales[k], want.scales[k])
                                                 for k in want.scales]:
        assert a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises_naming_format(name, bad):
    x = torch.ones(2, 4, 16)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match=name):
        get_format(name).quantize(x)


def test_nvfp4_bad_last_dim_raises():
    with pytest.raises(ValueError, match="multiple of 16"):
        get_format("nvfp4").quantize(torch.ones(4, 24))


def test_bad_rounding_and_name():
    with pytest.raises(ValueError, match="rounding"):
        get_format("fp8").quantize(torch.ones(2, 16), rounding="up")
    with pytest.raises(ValueError, match="unknown format"):
        get_format("int4")


def test_nbytes():
    x = torch.randn(3, 5, 16, 32)
    n = x.numel()
    assert get_format("fp32").quantize(x).nbytes == 4 * n
    assert get_format("fp16").quantize(x).nbytes == 2 * n
    assert get_format("bf16").quantize(x).nbytes == 2 * n
    assert get_format("fp8").quantize(x).nbytes == n + 4 * (n // 32)
    assert get_format("nvfp4").quantize(x).nbytes == n // 2 + n // 16 + 4 * 15
    assert get_format("nvfp4").bytes_per_element(128, 128) == 0.5 + 1 / 16 + 4 / 16384
    assert get_format("fp8").bytes_per_element(128) == 1 + 4 / 128
    q = get_format("nvfp4").quantize(torch.randn(64))          # 1-D: one matrix
    assert q.nbytes == 32 + 4 + 4 and get_format("nvfp4").dequantize(q).shape == (64,)


def test_block_scale_clamp_documented_value():
    assert NVFP4_BLOCK_SCALE_MIN == 2.0 ** -9
    # a block ~1e-6 of the matrix amax keeps non-zero levels thanks to the 2^-9 clamp (2^-6
    # would put its block scale 8x higher and round these elements to zero)
    x = torch.zeros(1, 2, 16)
    x[0, 0, 0] = 1.0
    x[0, 1] = torch.linspace(1e-6, 4e-6, 16)
    out = get_format("nvfp4").fake_quantize(x)
    assert bool((out[0, 1] != 0).all())


def test_formats_report_rows():
    from replayquant.formats.report import formats_report, render_formats_table, state_like_tensor
    x = state_like_tensor((2, 32, 32), seed=1)
    assert torch.equal(x, state_like_tensor((2, 32, 32), seed=1))
    ratio = x.abs().amax() / x.abs()[x != 0].min()
    assert float(ratio) > 1e6                           # spans decades
    rows = formats_report((2, 32, 32), seed=1)
    assert [(r["format"], r["rounding"]) for r in rows][:3] == [
        ("fp32", "nearest"), ("fp16", "nearest"), ("fp16", "stochastic")]
    by = {(r["format"], r["rounding"]): r for r in rows}
    assert by[("fp32", "nearest")]["rmse"] == 0.0
    assert by[("nvfp4", "nearest")]["bytes_per_element"] == 0.5 + 1 / 16 + 4 / 16384
    assert by[("fp16", "nearest")]["rel_rmse"] < by[("fp8", "nearest")]["rel_rmse"] < \
        by[("nvfp4", "nearest")]["rel_rmse"] < 0.5
    assert render_formats_table(rows).row_count == len(rows)


def test_nvfp4_cast_with_a_given_global_scale():
    """nvfp4_quantize_ref(gs=...): the matrices' own scale gives today's bytes; a power of two
    above it (a scale chosen before the whole matrix is known, evals/nvfp4_headroom.py) keeps
    every element within 2688 gs and the error of today's within 1%, the block scales taking up
    the difference; one below it saturates the largest elements at 2688 gs."""
    from replayquant.formats.casts import (nvfp4_dequantize_ref, nvfp4_global_scale_ref,
                                           nvfp4_quantize_ref)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 32, 64, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    own = nvfp4_quantize_ref(x)
    gs = nvfp4_global_scale_ref(x)
    assert all(torch.equal(a, b) for a, b in zip(own, nvfp4_quantize_ref(x, None, gs)))
    err = lambda q: (nvfp4_dequantize_ref(*q) - x).pow(2).mean().sqrt()  # noqa: E731
    up = nvfp4_quantize_ref(x, None, torch.exp2(torch.ceil(torch.log2(gs)) + 1))
    assert torch.equal(up[2], torch.exp2(torch.ceil(torch.log2(gs)) + 1))
    assert err(up) <= 1.01 * err(own)
    down = nvfp4_quantize_ref(x, None, gs / 4)
    y = nvfp4_dequantize_ref(*down)
    assert torch.allclose(y.abs().amax((-2, -1)), 2688 * gs / 4)
