"""Triton kernels of replayquant.kernels.quant.kernel (interpreter mode on the CPU) against the
torch reference, bit for bit: device functions (Philox, grid rounding, element codecs) and every
format's quantize / dequantize, nearest and stochastic, on several shapes with poisoned outputs."""

import pytest
import torch
import triton
import triton.language as tl

from replayquant.formats import get_format
from replayquant.formats.constants import BF16, E2M1, E4M3, FP16
from replayquant.kernels.quant import kernel as quant
from replayquant.kernels.quant import launch as quant_launch
from replayquant.kernels.quant.launch import override_quant_launch
from replayquant.formats.philox import philox_ref, random_bits_ref
from replayquant.formats.casts import grid_value_ref, round_to_grid_ref


@pytest.fixture
def poisoned(monkeypatch):
    """Every kernel output starts as all-ones bytes (NaN for the float types)."""
    def _empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.reshape(-1).view(torch.uint8).fill_(0xFF)
        return t
    monkeypatch.setattr(quant, "_empty", _empty)


# ---------------------------------------------------------------- device functions

@triton.jit
def _philox_kernel(c_ptr, out_ptr, seed_lo, seed_hi, N, B: tl.constexpr):
    o = tl.arange(0, B)
    m = o < N
    c0 = tl.load(c_ptr + 3 * o, mask=m, other=0)
    c1 = tl.load(c_ptr + 3 * o + 1, mask=m, other=0)
    c2 = tl.load(c_ptr + 3 * o + 2, mask=m, other=0)
    words = quant.philox4(seed_lo, seed_hi, c0, c1, c2)
    for w in tl.static_range(4):
        tl.store(out_ptr + w * N + o, words[w].to(tl.int64) & 0xFFFFFFFF, mask=m)


@triton.jit
def _bits_kernel(out_ptr, out_rows_ptr, seed_lo, seed_hi, s_lo, s_hi, R: tl.constexpr,
                 C: tl.constexpr):
    e = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    b = quant.philox_bits(seed_lo, seed_hi, e, s_lo, s_hi)
    tl.store(out_ptr + e, b.to(tl.int64) & 0xFFFFFFFF)
    b = quant.philox_bits_rows(seed_lo, seed_hi, e, s_lo, s_hi)
    tl.store(out_rows_ptr + e, b.to(tl.int64) & 0xFFFFFFFF)


@pytest.mark.parametrize("seed", [0, 1234567, 2 ** 31 + 5, 2 ** 63 + 2 ** 40 + 9])
def test_philox_matches_ref(seed):
    gen = torch.Generator().manual_seed(seed % 1000)
    n = 200
    c = torch.randint(0, 2 ** 32, (n, 3), generator=gen, dtype=torch.int64)
    c[:4] = torch.tensor([[0, 0, 0], [2 ** 32 - 1] * 3, [5, 0, 1], [1, 2 ** 31, 2 ** 32 - 1]])
    out = torch.full((4, n), -1, dtype=torch.int64)
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    _philox_kernel[(1,)](c, out, lo, hi, n, B=256)
    want = philox_ref(c[:, 0], c[:, 1], c[:, 2], 0, lo, hi)
    for w in range(4):
        assert torch.equal(out[w], want[w]), w


@pytest.mark.parametrize("R,C", [(1, 16), (4, 32), (8, 4)])
def test_philox_bits_match_random_bits_ref(R, C):
    """Both kernel forms of the SR bits (per element; one Philox per group of four along the
    rows) give random_bits_ref's words: element e takes word e % 4 of counter e // 4."""
    seed, stream = 2 ** 63 + 77, 2 ** 40 + 5
    want = random_bits_ref((R, C), seed, stream)
    out = torch.full((R, C), -1, dtype=torch.int64)
    out_rows = torch.full((R, C), -1, dtype=torch.int64)
    _bits_kernel[(1,)](out, out_rows, seed & 0xFFFFFFFF, seed >> 32, stream & 0xFFFFFFFF,
                       stream >> 32, R=R, C=C)
    assert torch.equal(out, want) and torch.equal(out_rows, want)


@triton.jit
def _round_kernel(y_ptr, r_ptr, code_ptr, sign_ptr, N, B: tl.constexpr, MBITS: tl.constexpr,
                  EMIN: tl.constexpr, MAX_CODE: tl.constexpr, MAX_VALUE: tl.constexpr,
                  IEEE: tl.constexpr, INF_CODE: tl.constexpr, STOCHASTIC: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < N
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    r = tl.load(r_ptr + o, mask=m, other=0).to(tl.uint32)
    code, sign = quant.round_to_grid(y, r, MBITS, EMIN, MAX_CODE, MAX_VALUE, IEEE, INF_CODE,
                                     STOCHASTIC)
    tl.store(code_ptr + o, code, mask=m)
    tl.store(sign_ptr + o, sign, mask=m)


def _grid_inputs(grid, gen):
    """Random finite float32 bit patterns, values around the grid's range, its ties, edges."""
    bits = torch.randint(-2 ** 31, 2 ** 31, (3000,), generator=gen, dtype=torch.int64)
    y = bits.to(torch.int32).view(torch.float32)
    y = y[torch.isfinite(y)]
    top = grid.max_value
    scaled = (torch.rand(3000, generator=gen) * 2 - 1) * top * torch.exp(
        -torch.rand(3000, generator=gen) * 40)
    edges = torch.tensor([0.0, -0.0, top, -top, top * 1.001, top * 1.02, top * 2, 3e38, 1e-45,
                          1.2e-38, 2.0 ** (grid.emin - grid.mbits), 2.0 ** (grid.emin - grid.mbits - 1),
                          3 * 2.0 ** (grid.emin - grid.mbits - 1), 2.0 ** grid.emin, 1.0, 1.5,
                          1 + 2.0 ** (-grid.mbits - 1), 1 + 3 * 2.0 ** (-grid.mbits - 1)])
    out = torch.cat([y, scaled, edges, -edges])
    return out[torch.isfinite(out)]            # the formats reject non-finite input first


@pytest.mark.parametrize("grid", [FP16, BF16, E4M3, E2M1], ids=lambda g: g.name)
@pytest.mark.parametrize("stochastic", [False, True])
def test_round_to_grid_matches_ref(grid, stochastic):
    gen = torch.Generator().manual_seed(7 + grid.mbits)
    y = _grid_inputs(grid, gen).contiguous()
    n = y.numel()
    r = torch.randint(0, 2 ** 32, (n,), generator=gen, dtype=torch.int64)
    r[:8] = torch.tensor([0, 1, 255, 256, 2 ** 32 - 1, 2 ** 32 - 256, 2 ** 31, 2 ** 8 - 1])
    code = torch.full((n,), -7, dtype=torch.int32)
    sign = torch.full((n,), -7, dtype=torch.int32)
    B = 1024
    _round_kernel[(triton.cdiv(n, B),)](
        y, r, code, sign, n, B=B, MBITS=grid.mbits, EMIN=grid.emin, MAX_CODE=grid.max_code,
        MAX_VALUE=grid.max_value, IEEE=grid.ieee_overflow, INF_CODE=grid.inf_code,
        STOCHASTIC=stochastic)
    want_code, want_sign = round_to_grid_ref(y, grid, r if stochastic else None)
    assert torch.equal(code, want_code)
    assert torch.equal(sign, want_sign)


@triton.jit
def _codec_kernel(y_ptr, r_ptr, bits_ptr, dec_ptr, N, B: tl.constexpr, FMT: tl.constexpr,
                  STOCHASTIC: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < N
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    r = tl.load(r_ptr + o, mask=m, other=0).to(tl.uint32)
    if FMT == 0:
        b = quant.encode_fp16(y, r, STOCHASTIC)
        d = quant.decode_fp16(b)
    elif FMT == 1:
        b = quant.encode_bf16(y, r, STOCHASTIC)
        d = quant.decode_bf16(b)
    elif FMT == 2:
        b = quant.encode_e4m3(y, r, STOCHASTIC)
        d = quant.decode_e4m3(b)
    else:
        b = quant.encode_e2m1(y, r, STOCHASTIC)
        d = quant.decode_e2m1(b)
    tl.store(bits_ptr + o, b, mask=m)
    tl.store(dec_ptr + o, d, mask=m)


@pytest.mark.parametrize("fmt", [0, 1, 2, 3], ids=["fp16", "bf16", "e4m3", "e2m1"])
def test_element_codecs(fmt):
    grid = (FP16, BF16, E4M3, E2M1)[fmt]
    gen = torch.Generator().manual_seed(50 + fmt)
    y = _grid_inputs(grid, gen)
    n = y.numel()
    r = torch.randint(0, 2 ** 32, (n,), generator=gen, dtype=torch.int64)
    for stochastic in (False, True):
        bits = torch.full((n,), -1, dtype=torch.int32)
        dec = torch.full((n,), float("nan"))
        _codec_kernel[(triton.cdiv(n, 1024),)](y, r, bits, dec, n, B=1024, FMT=fmt,
                                               STOCHASTIC=stochastic)
        code, sign = round_to_grid_ref(y, grid, r if stochastic else None)
        assert torch.equal(bits, code | (sign << grid.sign_shift))
        if fmt == 0:
            want = bits.to(torch.int16).view(torch.float16).float()
        elif fmt == 1:
            want = bits.to(torch.int16).view(torch.bfloat16).float()
        else:
            want = grid_value_ref(code, sign, grid)
        assert torch.equal(dec, want)


@triton.jit
def _decode_kernel(b_ptr, d_ptr, N, B: tl.constexpr, F: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < N
    b = tl.load(b_ptr + o, mask=m, other=0)
    if F == 0:
        d = quant.decode_fp16(b)
    elif F == 1:
        d = quant.decode_bf16(b)
    elif F == 2:
        d = quant.decode_e4m3(b)
    else:
        d = quant.decode_e2m1(b)
    tl.store(d_ptr + o, d, mask=m)


def test_decoders_on_every_code():
    """Every fp16 / bf16 bit pattern, every E4M3FN byte (but its NaNs), every E2M1 nibble."""
    for fmt, dtype in ((0, torch.float16), (1, torch.bfloat16)):
        allbits = torch.arange(0, 2 ** 16, dtype=torch.int32)
        dec = torch.empty(allbits.numel())
        _decode_kernel[(16,)](allbits, dec, allbits.numel(), B=4096, F=fmt)
        want = allbits.to(torch.int16).view(dtype).float()
        nan = want.isnan()
        assert torch.equal(dec.view(torch.int32)[~nan], want.view(torch.int32)[~nan])
        assert bool(dec[nan].isnan().all())
    b8 = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.int32)
    dec = torch.empty(b8.numel())
    _decode_kernel[(1,)](b8, dec, b8.numel(), B=256, F=2)
    want = b8.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(dec.view(torch.int32), want.view(torch.int32))
    b4 = torch.arange(16, dtype=torch.int32)
    dec = torch.empty(16)
    _decode_kernel[(1,)](b4, dec, 16, B=16, F=3)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(dec.view(torch.int32), torch.cat([mags, -mags]).view(torch.int32))


@triton.jit
def _pair_kernel(w_ptr, one_ptr, two_ptr, N, B: tl.constexpr, SHIFT: tl.constexpr,
                 EBITS: tl.constexpr, MBITS: tl.constexpr):
    o = tl.program_id(0) * B + tl.arange(0, B)
    m = o < N
    w = tl.load(w_ptr + o, mask=m, other=0)
    lo, hi = quant.small_float_pair_at(w, SHIFT, EBITS, MBITS)
    tl.store(two_ptr + 2 * o, lo, mask=m)
    tl.store(two_ptr + 2 * o + 1, hi, mask=m)
    tl.store(one_ptr + 2 * o, quant.small_float_at(w, SHIFT, EBITS, MBITS), mask=m)
    tl.store(one_ptr + 2 * o + 1, quant.small_float_at(w, SHIFT + 16, EBITS, MBITS), mask=m)


def test_pair_decoder_equals_two_single_decodes():
    """small_float_pair_at (two packed codes per integer operation, as the NVFP4 / FP8 read
    kernels decode) equals small_float_at on each code, bit for bit, at every code position of
    a word (E2M1: nibbles i and i + 4; E4M3: bytes 0 and 2, 1 and 3), on random words that
    hold every E2M1 nibble and every E4M3 byte but its NaNs; and the values are the formats'
    (times 2^(bias - 15))."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    n = 4096
    w = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=gen, dtype=torch.int64)
    w[:256] = torch.arange(256) * 0x01010101                 # every byte in every position
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)
    for ebits, mbits, shifts in ((2, 1, (0, 4, 8, 12)), (4, 3, (0, 8))):
        nb = ebits + mbits + 1
        for shift in shifts:
            one, two = torch.full((2 * n,), float("nan")), torch.full((2 * n,), float("nan"))
            _pair_kernel[(triton.cdiv(n, 1024),)](w, one, two, n, B=1024, SHIFT=shift,
                                                  EBITS=ebits, MBITS=mbits)
            codes = torch.stack([(w >> shift) & ((1 << nb) - 1),
                                 (w >> (shift + 16)) & ((1 << nb) - 1)], 1).flatten()
            if ebits == 4:
                ok = codes & 0x7F != 0x7F
                want = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -8
            else:
                ok = torch.ones_like(codes, dtype=torch.bool)
                mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
                want = torch.cat([mags, -mags])[codes.long()] * 2.0 ** -14
            assert torch.equal(two.view(torch.int32), one.view(torch.int32)), (ebits, shift)
            assert torch.equal(two[ok].view(torch.int32), want[ok].view(torch.int32))


# ---------------------------------------------------------------- host kernels vs reference

SHAPES = [(3, 5, 16, 32), (7, 16, 48), (2, 3, 1, 16), (64,), (5, 48), (1, 3, 33, 80), (2, 5, 7)]


def _both_backends(monkeypatch, fn):
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    ref = fn()
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    got = fn()
    return ref, got


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


def _assert_same_q(a, b):
    assert a.format == b.format and a.shape == b.shape
    assert a.payload.dtype == b.payload.dtype and a.payload.shape == b.payload.shape
    assert torch.equal(_bytes(a.payload), _bytes(b.payload))
    assert a.scales.keys() == b.scales.keys()
    for k in a.scales:
        assert a.scales[k].dtype == b.scales[k].dtype
        assert a.scales[k].shape == b.scales[k].shape
        assert torch.equal(_bytes(a.scales[k]), _bytes(b.scales[k])), k


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_triton_formats_equal_reference(name, rounding, monkeypatch, poisoned):
    fmt = get_format(name)
    for i, shape in enumerate(SHAPES):
        if name == "nvfp4" and shape[-1] % 16:
            continue
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
        if x.dim() >= 2:
            x.view(-1, shape[-1])[0] = 0.0                            # a zero row
        seed = 2 ** 40 + 3 * i
        if x.dim() > 2 and i % 2:
            stream = torch.randint(0, 2 ** 62, x.shape[:-2], generator=gen)
        else:
            stream = 17 + i
        q_ref, q_tri = _both_backends(
            monkeypatch, lambda: fmt.quantize(x, rounding, seed=seed, stream=stream))
        _assert_same_q(q_ref, q_tri)
        d_ref, d_tri = _both_backends(monkeypatch, lambda: fmt.dequantize(q_ref))
        assert torch.equal(d_ref, d_tri)
        assert not torch.isnan(d_tri).any()


@pytest.mark.parametrize("plan", [(0, None), (1, 16), (1, 64), (2, 16), (2, 64), (None, None)],
                         ids=["whole", "loop16", "loop64", "split16", "split64", "default"])
def test_nvfp4_launch_plans_equal_reference(plan, poisoned):
    """Every launch plan (one tile per matrix, a program looping over tiles, tiles over programs
    with the amax from torch), with even and uneven tiles, and a matrix past the loop limit."""
    from replayquant.formats import casts as ref
    mode, nb = plan
    gen = torch.Generator().manual_seed(5 if mode is None else 6 + mode)
    shapes = [(3, 16, 64), (2, 9, 48)] if mode is not None else [(2, 20, 224)]   # 280 blocks
    for shape in shapes:
        x3 = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 2)
        x3[0, 0, :16] = 0.0
        for sr in (False, True):
            rb = random_bits_ref(x3.shape, 9, 40) if sr else None
            with override_quant_launch("nvfp4_quantize", mode=mode, nb=nb):
                got = quant.nvfp4_quantize(x3, "stochastic" if sr else "nearest", 9, 40)
            want = ref.nvfp4_quantize_ref(x3, rb)
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            with override_quant_launch("nvfp4_dequantize", nb=16 if mode else 128):
                assert torch.equal(quant.nvfp4_dequantize(*got), ref.nvfp4_dequantize_ref(*want))
        if mode in (0, 1):   # the integer rounding path gives the same bits
            with override_quant_launch("nvfp4_quantize", mode=mode, nb=nb, fast=False):
                got = quant.nvfp4_quantize(x3, "nearest")
            assert all(torch.equal(g, w) for g, w in zip(got, ref.nvfp4_quantize_ref(x3)))


def test_nvfp4_plan_choice():
    assert quant_launch.nvfp4_plan(1024) == (0, 1024, 1, True)
    assert quant_launch.nvfp4_plan(1024, stochastic=True) == (1, 128, 8, True)
    assert quant_launch.nvfp4_plan(64) == (0, 64, 1, True)
    assert quant_launch.nvfp4_plan(48)[3] is False
    assert quant_launch.nvfp4_plan(quant_launch.NVFP4_LOOP_MAX_BLOCKS + 1)[0] == 2


def test_long_rows_and_matrices_equal_reference(poisoned):
    """fp8 rows longer than one tile (chunked amax loop) and casts over several programs."""
    from replayquant.formats import casts as ref
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4176, generator=gen) * 100
    rb = random_bits_ref(x.shape, 1, 2)
    p, s = quant.fp8_quantize(x, "stochastic", 1, 2)
    p2, s2 = ref.fp8_quantize_ref(x, rb)
    assert torch.equal(p.view(torch.uint8), p2.view(torch.uint8)) and torch.equal(s, s2)
    assert torch.equal(quant.fp8_dequantize(p, s), ref.fp8_dequantize_ref(p2, s2))
    x = torch.randn(2, 50, 100, generator=gen)
    rb = random_bits_ref(x.shape, 1, 2)
    got = quant.cast_quantize(x, FP16, torch.float16, "stochastic", 1, 2)
    assert torch.equal(got.view(torch.int16), ref.cast_ref(x, FP16, torch.float16, rb).view(torch.int16))


def test_empty_inputs():
    assert quant.cast_quantize(torch.empty(0, 4, 16), BF16, torch.bfloat16).shape == (0, 4, 16)
    p, s = quant.fp8_quantize(torch.empty(2, 0, 16))
    assert p.shape == (2, 0, 16) and s.shape == (2, 0)
    packed, bs, gs = quant.nvfp4_quantize(torch.empty(0, 4, 16))
    assert packed.shape == (0, 4, 8) and gs.shape == (0,)
