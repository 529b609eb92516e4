"""The chunked teacher-forcing scan (replayquant.kernels.chunk.reference) against ReplayState
stepping token by token: every shipped pair, both kinds, lengths that are not multiples of L,
segmented and unsegmented, padding, the same SR bits."""

import pytest
import torch

from replayquant.kernels.chunk.reference import chunk_scan_ref, initial_scan_state, teacher_force
from replayquant.replay.convert import scan_state_of
from _helpers import scan_inputs, stable_seed, vector_log_a
from replayquant.pairs import PrecisionPair, list_pairs
from replayquant.replay import ReplayState, recurrent_reference
from replayquant.streams import ANCHOR, layer_seed, sr_stream

# relative output tolerance per read format: FP32 arithmetic reassociates (~1e-6); a value that
# lands on a rounding boundary can flip by one step of the read format.
READ_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "fp8": 0.1, "nvfp4": 0.4}


def _sl(t, a, b):
    return None if t is None else t[:, a:b]


def _step_all(st, q, k, v, log_a, beta):
    return torch.stack([st.step(q[:, t], k[:, t], v[:, t], log_a[:, t], _sl(beta, t, t + 1)[:, 0]
                                if beta is not None else None) for t in range(q.shape[1])], 1)


def _close(pair, got, ref, what):
    tol = READ_TOL[pair.read_spec.format]
    scale = ref.abs().max().clamp(min=1e-6)
    err = (got - ref).abs().max() / scale
    assert err <= tol, f"{pair.name} {what}: relative error {err:.2e} > {tol}"
    # most elements agree to reassociation; only boundary flips may differ by more
    frac = ((got - ref).abs() > 1e-5 * scale).float().mean()
    assert frac <= (0.0 if pair.read_spec.format == "fp32" else 0.25), f"{pair.name} {what}: {frac:.3f}"


def _anchors_match(pair, st, ref):
    """Anchors of two ReplayStates: FP32 within reassociation; other formats the same codes
    (same SR bits) except where reassociation crosses a rounding boundary. With L = 1 every
    step flushes, so one crossed boundary moves the later states too: over 80 random cases of
    test_scan_equals_step_decode the GDN delta rule with an FP16 SR anchor differed in a median
    of 0 codes, 0.2% at the 90th percentile and 2.5% at most."""
    if pair.anchor.format == "fp32":
        A, A_ref = st.anchor(), ref.anchor()
        torch.testing.assert_close(A, A_ref, rtol=1e-5, atol=1e-5 * A_ref.abs().max().item())
    else:
        a, b = st.anchor_q, ref.anchor_q
        diff = (a.payload != b.payload).float().mean().item()
        assert diff <= 0.05, f"{pair.name}: {diff:.3%} of anchor codes differ"
        for key in a.scales:
            torch.testing.assert_close(a.scales[key].float(), b.scales[key].float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", list_pairs())
@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_scan_equals_step_decode(name, delta):
    gen = torch.Generator().manual_seed(stable_seed(name, delta))
    B, T, H, dk, dv = 2, 23, 2, 16, 8
    for L in (1, 5):
        pair = PrecisionPair.load(name).with_buffer_len(L)
        q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
        S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
        ref_st = ReplayState(S0, pair, delta=delta, seed=11, layer=2)
        y_ref = _step_all(ref_st, q, k, v, log_a, beta)

        # unsegmented
        st = ReplayState(S0, pair, delta=delta, seed=11, layer=2)
        y = teacher_force(st, q, k, v, log_a, beta)
        _close(pair, y, y_ref, f"L={L} unsegmented")
        _anchors_match(pair, st, ref_st)
        assert torch.equal(st.committed, ref_st.committed)
        assert torch.equal(st.n_flush, ref_st.n_flush)

        # segmented at odd places, with decode steps in between
        st = ReplayState(S0, pair, delta=delta, seed=11, layer=2)
        ys, cuts = [], [0, 3, 4, 11, 12, 13, T]
        for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            if i % 2 and b - a == 1:
                ys.append(_step_all(st, *(t[:, a:b] for t in (q, k, v, log_a)), _sl(beta, a, b)))
            else:
                ys.append(teacher_force(st, q[:, a:b], k[:, a:b], v[:, a:b], log_a[:, a:b],
                                        _sl(beta, a, b)))
        _close(pair, torch.cat(ys, 1), y_ref, f"L={L} segmented")
        _anchors_match(pair, st, ref_st)
        # the states continue alike: a few more decode steps
        q2, k2, v2, la2, b2 = scan_inputs(gen, B, 4, H, dk, dv, delta)
        _close(pair, _step_all(st, q2, k2, v2, la2, b2), _step_all(ref_st, q2, k2, v2, la2, b2),
               f"L={L} continued")


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_sr_bits_and_read_format_independence(delta):
    """With an SR anchor the same seed gives the same anchor as stepping (bit for bit here, where
    no element sits on a boundary); only the read format changing leaves the anchor identical."""
    gen = torch.Generator().manual_seed(5 + delta)
    B, T, H, dk, dv = 2, 20, 2, 16, 16
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    anchors = {}
    for name in ("s16_sr", "tp8_hi16_sr", "tp4_hi16_sr"):
        pair = PrecisionPair.load(name).with_buffer_len(4)
        st = ReplayState(S0, pair, delta=delta, seed=3)
        teacher_force(st, q, k, v, log_a, beta)
        ref = ReplayState(S0, pair, delta=delta, seed=3)
        _step_all(ref, q, k, v, log_a, beta)
        _anchors_match(pair, st, ref)
        anchors[name] = st.anchor()
        other = ReplayState(S0, pair, delta=delta, seed=4)
        teacher_force(other, q, k, v, log_a, beta)
        assert (other.anchor() != st.anchor()).any(), "a different seed must draw different bits"
    # fp32 anchor pairs: the read copy never enters the anchor
    a = []
    for name in ("tp4_hi32", "tp8_hi32", "s32_rs"):
        st = ReplayState(S0, PrecisionPair.load(name).with_buffer_len(4), delta=delta)
        teacher_force(st, q, k, v, log_a, beta)
        a.append(st.anchor())
    assert torch.equal(a[0], a[1]) and torch.equal(a[0], a[2])
    # same for the fp16+SR anchors with different read copies (shared s16_sr reads the anchor)
    assert torch.equal(anchors["tp8_hi16_sr"], anchors["tp4_hi16_sr"])
    assert torch.equal(anchors["s16_sr"], anchors["tp4_hi16_sr"])


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_padding_is_skipped(delta):
    """Invalid tokens occupy no buffer slot: each row equals stepping its valid tokens alone,
    keyed by its own row id (same SR streams)."""
    gen = torch.Generator().manual_seed(17 + delta)
    B, T, H, dk, dv = 3, 17, 2, 16, 8
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(4)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :5] = False                 # left padding
    valid[2, [0, 1, 7, 8, 9, 16]] = False  # scattered
    S0 = torch.zeros(B, H, dv, dk)
    st = ReplayState(S0, pair, delta=delta, seed=1)
    y = teacher_force(st, q, k, v, log_a, beta, valid=valid)
    assert torch.equal(y[~valid], torch.zeros_like(y[~valid]))
    for b in range(B):
        m = valid[b]
        one = ReplayState(S0[b:b + 1], pair, delta=delta, seed=1, state_indices=torch.tensor([b]))
        sel = [t[b:b + 1, m] for t in (q, k, v, log_a)] + [None if beta is None else beta[b:b + 1, m]]
        y_ref = _step_all(one, *sel)
        _close(pair, y[b:b + 1, m], y_ref, f"row {b}")
        assert (st.anchor()[b] != one.anchor()[0]).float().mean() <= 0.02
        assert int(st.committed[b]) == int(one.committed[0])


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_exact_prefill(delta):
    """exact=True: FP32 outputs (the sequential recurrence) and one cast of the final state."""
    gen = torch.Generator().manual_seed(23 + delta)
    B, T, H, dk, dv = 2, 19, 2, 16, 8
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(8)
    ss = initial_scan_state(S0, PrecisionPair.load("s32_rs").with_buffer_len(8), delta=delta)
    # exact continuation of a state with buffered steps, in a low-precision pair
    lp = ReplayState(S0, pair, delta=delta, seed=9)
    Y, S = recurrent_reference(lp.anchor(), q, k, v, log_a, beta)   # FP32 from the initial anchor
    teacher_force(lp, q[:, :3], k[:, :3], v[:, :3], log_a[:, :3], _sl(beta, 0, 3))
    before = lp.n_flush.clone()
    y = teacher_force(lp, q[:, 3:], k[:, 3:], v[:, 3:], log_a[:, 3:], _sl(beta, 3, T), exact=True)
    torch.testing.assert_close(y, Y[:, 3:], rtol=1e-4, atol=1e-5)
    assert torch.equal(lp.n_flush, before + 1) and int(lp.committed.max()) == 0
    # the anchor is one cast of the FP32 final state (flush index + 1)
    A_exact = pair.anchor.fmt.dequantize(
        pair.anchor.fmt.quantize(S, "stochastic", seed=layer_seed(9, 0), stream=_streams(lp, before + 1)))
    assert (lp.anchor() != A_exact).float().mean() <= 0.01
    # unsegmented exact from a fresh state equals the reference too
    Y, S = recurrent_reference(S0, q, k, v, log_a, beta)
    y2, ss2 = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=PrecisionPair.load("s32_rs").with_buffer_len(8),
                             exact=True)
    torch.testing.assert_close(y2, Y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ss2.anchor.payload, S, rtol=1e-4, atol=1e-5)


def _streams(st, fi):
    return sr_stream(fi, ANCHOR, st.state_indices, st.H)


def test_bad_inputs():
    pair = PrecisionPair.load("s32_rs").with_buffer_len(4)
    ss = initial_scan_state(torch.zeros(2, 2, 8, 16), pair, delta=True)
    q = torch.zeros(2, 5, 2, 16)
    v = torch.zeros(2, 5, 2, 8)
    la = torch.zeros(2, 5, 2)
    with pytest.raises(ValueError, match="beta"):
        chunk_scan_ref(ss, q, q, v, la, None, pair=pair)
    with pytest.raises(ValueError, match="v must be"):
        chunk_scan_ref(ss, q, q, v[:, :4], la, la, pair=pair)
    with pytest.raises(ValueError, match="log_a"):
        chunk_scan_ref(ss, q, q, v, la[..., :1], la, pair=pair)
    with pytest.raises(ValueError, match="valid"):
        chunk_scan_ref(ss, q, q, v, la, la, pair=pair, valid=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="buffer_len"):
        chunk_scan_ref(ss, q, q, v, la, la, pair=pair.with_buffer_len(8))
    with pytest.raises(ValueError, match="state holds"):
        chunk_scan_ref(ss, q[:1], q[:1], v[:1], la[:1], la[:1], pair=pair)
    st = ReplayState(torch.zeros(2, 2, 8, 16), pair, delta=False)
    st.verify(q[:, :2], q[:, :2], v[:, :2], la[:, :2])
    with pytest.raises(ValueError, match="pending drafts"):
        scan_state_of(st)


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_state_hand_off(delta):
    """ReplayState.export / load / from_parts: a state rebuilt from its parts continues exactly
    as the original (same outputs bit for bit, same anchors), and bad parts name themselves."""
    gen = torch.Generator().manual_seed(31 + delta)
    B, T, H, dk, dv = 2, 9, 2, 16, 8
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(4)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    st = ReplayState(S0, pair, delta=delta, seed=2, layer=1)
    _step_all(st, *(t[:, :6] for t in (q, k, v, log_a)), _sl(beta, 0, 6))     # 1 flush + 2 buffered
    parts = st.export()
    assert set(parts) == set(ReplayState.PART_NAMES)
    snap = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in parts.items()}
    clone = ReplayState.from_parts(snap, pair, delta=delta, seed=2, layer=1)
    assert torch.equal(clone.committed, st.committed) and torch.equal(clone.n_flush, st.n_flush)
    # without u (GDN): recomputed against the read copy, equal within reassociation
    other = ReplayState(torch.zeros_like(S0), pair, delta=delta, seed=2, layer=1)
    other.load({n: t for n, t in snap.items() if n != "u"})
    if delta:
        n = int(snap["committed"][0])
        torch.testing.assert_close(other.buffer["u"][:, :, :n], snap["u"][:, :, :n], rtol=1e-5,
                                   atol=1e-6)
    rest = [t[:, 6:] for t in (q, k, v, log_a)] + [_sl(beta, 6, T)]
    y = _step_all(st, *rest)
    assert torch.equal(_step_all(clone, *rest), y)
    assert torch.equal(clone.anchor_q.payload, st.anchor_q.payload)
    torch.testing.assert_close(_step_all(other, *rest), y, rtol=1e-5, atol=1e-5)
    bad = dict(parts, committed=torch.full((B,), 9))
    with pytest.raises(ValueError, match="committed"):
        other.load(bad)
    with pytest.raises(ValueError, match="k"):
        other.load(dict(parts, k=parts["k"][:, :1]))
    with pytest.raises(ValueError, match="read"):
        other.load(dict(parts, read=None))
    with pytest.raises(ValueError, match="unknown part"):
        other.load(dict(parts, extra=1))
    # the flush index's other public name, as a property and as a part
    assert torch.equal(st.flushes, st.n_flush) and torch.equal(parts["flushes"], parts.n_flush)
    legacy = {("flushes" if n == "n_flush" else n): t for n, t in snap.items()}
    again = ReplayState.from_parts(legacy, pair, delta=delta, seed=2, layer=1)
    assert torch.equal(again.n_flush, legacy["flushes"])


def _random_bits_int64(shape, seed, stream):
    """random_bits_ref written with the torch int64 philox_ref (the readable specification)."""
    from replayquant.formats.philox import philox_ref, split_u64
    mat = shape[:-2] if len(shape) >= 2 else ()
    per = 1
    for d in shape[len(mat):]:
        per *= d
    if isinstance(stream, torch.Tensor):
        streams = torch.broadcast_to(stream.to(torch.int64), mat)
    else:
        streams = (stream + torch.arange(int(torch.tensor(mat).prod()) if mat else 1)).reshape(mat)
    lo, hi = split_u64(streams.reshape(-1, 1))
    elem = torch.arange(per, dtype=torch.int64).reshape(1, -1)
    k0, k1 = split_u64(seed)
    # element e: word e % 4 of counter e // 4 (written per element, not by groups as the library)
    words = philox_ref(elem // 4, lo, hi, torch.zeros_like(elem), k0, k1)
    return torch.stack(words, dim=-1).gather(-1, (elem % 4).expand(lo.shape[0], per)[..., None])[
        ..., 0].reshape(shape)


def test_fast_random_bits_equal_the_int64_philox():
    """random_bits_ref (numpy uint32 lanes, the CPU fast path) and random_bits_torch (int64
    torch, the GPU path) give philox_ref's words."""
    from replayquant.formats.philox import random_bits_ref, random_bits_torch
    gen = torch.Generator().manual_seed(8)
    cases = [((7,), 0, 0), ((3, 5), 2 ** 63 + 5, 2 ** 40 + 3),
             ((2, 3, 4, 16), 12345, torch.randint(0, 2 ** 62, (2, 3), generator=gen)),
             ((2, 3, 4, 16), 2 ** 64 - 1, torch.randint(0, 2 ** 62, (3,), generator=gen)),
             ((0, 4, 4), 1, 1), ((4, 1, 1), 7, 2 ** 62 + 11),
             ((2, 2, 8, 16), layer_seed(3, 2), sr_stream(torch.tensor([5, 1]), ANCHOR,
                                                          torch.tensor([0, 7]), 2))]
    for shape, seed, stream in cases:
        got = random_bits_ref(shape, seed, stream)
        want = _random_bits_int64(shape, seed, stream)
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want), shape
        # the torch path a GPU takes (random_bits_ref(..., device=cuda)), here on the CPU, in
        # chunks of a few matrices
        for chunk in (1, 40, 1 << 24):
            t = random_bits_torch(shape, seed, stream, "cpu", chunk=chunk)
            assert t.dtype == torch.int64 and torch.equal(t, want), (shape, chunk)


def test_cpu_threads_scope(monkeypatch):
    """The CPU scan runs with REPLAYQUANT_CPU_THREADS intra-op threads (default 1) and restores
    the caller's setting; a bad value is one clear error."""
    from replayquant.kernels.chunk.reference import CPU_THREADS_ENV, cpu_threads
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with cpu_threads(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        monkeypatch.setenv(CPU_THREADS_ENV, "2")
        with cpu_threads("cpu"):
            assert torch.get_num_threads() == 2
        monkeypatch.setenv(CPU_THREADS_ENV, "many")
        with pytest.raises(ValueError, match=CPU_THREADS_ENV):
            with cpu_threads("cpu"):
                pass
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


# ------------------------------------------------------------------ vector gates (KDA)

def _vector_case(gen, B, T, H, dk, dv, delta):
    q, k, v, _, beta = scan_inputs(gen, B, T, H, dk, dv, delta)
    return q, k, v, vector_log_a(gen, B, T, H, dk), beta


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_vector_gates_against_float64_recurrence(delta):
    """Per-channel gates, an FP32 pair, windows of L = 5 over two segments (the second continues
    a partial window): outputs and the final state within FP32 reassociation of the float64
    recurrence S_t = S_{t-1} Diag(a_t) + u_t k_t^T, with channels that forget within a step
    beside channels that hardly forget (a decay on the wrong axis is far off)."""
    gen = torch.Generator().manual_seed(61 + delta)
    B, T, H, dk, dv = 2, 23, 2, 16, 8
    pair = PrecisionPair.load("s32_rs").with_buffer_len(5)
    q, k, v, log_a, beta = _vector_case(gen, B, T, H, dk, dv, delta)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    Y, S = recurrent_reference(S0, q, k, v, log_a, beta, dtype=torch.float64)
    ss = initial_scan_state(S0, pair, delta=delta, vector_gate=True)
    ys = []
    for a, b in ((0, 12), (12, T)):
        y, ss = chunk_scan_ref(ss, *(t[:, a:b] for t in (q, k, v, log_a)), _sl(beta, a, b), pair=pair)
        ys.append(y)
    assert ss.G.shape == (B, H, 5, dk) and ss.committed.tolist() == [3, 3]
    err = ((torch.cat(ys, 1).double() - Y).abs().max() / Y.abs().max()).item()
    assert err <= 2e-6, err
    from replayquant.kernels.chunk.reference import rebuild_state
    err = ((rebuild_state(ss, pair).double() - S).abs().max() / S.abs().max()).item()
    assert err <= 2e-6, err


@pytest.mark.parametrize("name", ["tp4_hi16_sr", "f4_sr_rs", "tp8_hi32"])
def test_vector_gates_scan_equals_step_decode(name):
    """Vector-gated GDN (KDA): the scan equals ReplayState(vector_gate=True) stepping token by
    token (segments at odd places, L = 1 and 4), with the same SR bits."""
    gen = torch.Generator().manual_seed(stable_seed(name))
    B, T, H, dk, dv = 2, 14, 2, 16, 8
    for L in (1, 4):
        pair = PrecisionPair.load(name).with_buffer_len(L)
        q, k, v, log_a, beta = _vector_case(gen, B, T, H, dk, dv, True)
        S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
        ref = ReplayState(S0, pair, delta=True, seed=7, layer=1, vector_gate=True)
        y_ref = _step_all(ref, q, k, v, log_a, beta)
        st = ReplayState(S0, pair, delta=True, seed=7, layer=1, vector_gate=True)
        ys = [teacher_force(st, *(t[:, a:b] for t in (q, k, v, log_a, beta)))
              for a, b in ((0, 5), (5, 6), (6, T))]
        _close(pair, torch.cat(ys, 1), y_ref, f"L={L}")
        _anchors_match(pair, st, ref)
        assert torch.equal(st.committed, ref.committed) and torch.equal(st.n_flush, ref.n_flush)


@pytest.mark.parametrize("exact", [False, True], ids=["replay", "exact"])
def test_constant_vector_gates_equal_scalar_gates(exact):
    """A gate that is the same on every channel gives the scalar path's outputs and state
    within FP32 reassociation (GDN, FP32 anchor, a partial last window)."""
    gen = torch.Generator().manual_seed(67)
    B, T, H, dk, dv = 2, 11, 2, 16, 8
    pair = PrecisionPair.load("tp8_hi32").with_buffer_len(4)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, True)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    ys, yv = (chunk_scan_ref(initial_scan_state(S0, pair, delta=True, vector_gate=vg), q, k, v,
                             la, beta, pair=pair, exact=exact)
              for vg, la in ((False, log_a), (True, log_a[..., None].expand(-1, -1, -1, dk))))
    torch.testing.assert_close(yv[0], ys[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pair.anchor.fmt.dequantize(yv[1].anchor),
                               pair.anchor.fmt.dequantize(ys[1].anchor), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(yv[1].G, ys[1].G[..., None].expand(-1, -1, -1, dk), rtol=0, atol=0)


def test_vector_gate_shape_mismatch():
    """log_a of the other kind than the state's is one error naming the shapes and the fix."""
    pair = PrecisionPair.load("s32_rs").with_buffer_len(4)
    q = torch.zeros(2, 5, 2, 16)
    v = torch.zeros(2, 5, 2, 8)
    for vg, la in ((False, torch.zeros(2, 5, 2, 16)), (True, torch.zeros(2, 5, 2))):
        ss = initial_scan_state(torch.zeros(2, 2, 8, 16), pair, delta=True, vector_gate=vg)
        with pytest.raises(ValueError, match=f"log_a must be .*vector_gate={not vg}"):
            chunk_scan_ref(ss, q, q, v, la, la[..., 0] if la.dim() == 4 else la, pair=pair)


def test_vector_terms_in_window_blocks(monkeypatch):
    """The per-channel decays of a long segment are formed a block of windows at a time (a
    memory bound): the same values as all windows at once, up to the summation order torch's
    CPU reduction picks for a shape (on AVX2 a sum over d_k of fewer rows lands 1 ulp apart in
    some outputs), and the same anchor codes."""
    from replayquant.kernels.chunk import reference as chunk_ref
    gen = torch.Generator().manual_seed(73)
    B, T, H, dk, dv = 2, 27, 2, 16, 8
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(4)
    q, k, v, log_a, beta = _vector_case(gen, B, T, H, dk, dv, True)
    ss = initial_scan_state(torch.randn(B, H, dv, dk, generator=gen), pair, delta=True,
                            vector_gate=True)
    y, s = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=pair)
    monkeypatch.setattr(chunk_ref, "VECTOR_TERMS_ELEMENTS", 3 * B * H * 4 * 4 * dk)
    y2, s2 = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=pair)
    torch.testing.assert_close(y2, y, rtol=1e-6, atol=1e-6)
    assert (s.anchor.payload != s2.anchor.payload).float().mean().item() <= 0.02
