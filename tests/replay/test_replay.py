"""ReplayState / ConventionalState: the invariants of DESIGN section 4 (torch reference, CPU)."""

import pytest
import torch

from replayquant.formats import get_format
from replayquant.pairs import FormatSpec, PrecisionPair
from replayquant.replay import ConventionalState, ReplayState, recurrent_reference
from replayquant.streams import ANCHOR, READ, layer_seed, sr_stream

KINDS = [pytest.param(False, id="mamba2"), pytest.param(True, id="gdn")]


def make_inputs(B, T, H, dk, dv, delta, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    v = torch.randn(B, T, H, dv, generator=g)
    la = torch.log(torch.rand(B, T, H, generator=g) * 0.1 + 0.9)
    beta = torch.rand(B, T, H, generator=g) if delta else None
    return q, k, v, la, beta


def at(x, t):
    return None if x is None else x[:, t]


def run_steps(st, inp, t0=0, t1=None):
    q, k, v, la, beta = inp
    t1 = q.shape[1] if t1 is None else t1
    return torch.stack([st.step(q[:, t], k[:, t], v[:, t], la[:, t], at(beta, t))
                        for t in range(t0, t1)], dim=1)


def pair(read, anchor, L, rr="nearest", ar="nearest"):
    return PrecisionPair(read=None if read is None else FormatSpec(read, rr),
                         anchor=FormatSpec(anchor, ar), buffer_len=L)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ---------------------------------------------------------------- invariant 1 and 2

@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("shape", [(2, 3, 16, 32), (1, 1, 5, 7)])
def test_L1_shared_fp32_bit_identical_to_conventional(delta, shape):
    B, H, dv, dk = shape
    inp = make_inputs(B, 60, H, dk, dv, delta, seed=1)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    p = pair(None, "fp32", 1)
    y_r = run_steps(ReplayState(S0, p, delta), inp)
    cs = ConventionalState(S0, p, delta)
    y_c = run_steps(cs, inp)
    assert torch.equal(y_r, y_c)
    st = ReplayState(S0, p, delta)
    run_steps(st, inp)
    assert torch.equal(st.anchor(), cs.anchor())
    Yref, Sref = recurrent_reference(S0, *inp)
    assert rel(y_c, Yref) < 1e-5 and rel(cs.anchor(), Sref) < 1e-5


@pytest.mark.parametrize("delta", KINDS)
def test_L1_shared_sr_bit_identical_to_conventional(delta):
    inp = make_inputs(2, 40, 2, 16, 8, delta, seed=2)
    S0 = torch.randn(2, 2, 8, 16)
    for fmt in ("fp16", "nvfp4", "bf16"):
        p = pair(None, fmt, 1, ar="stochastic")
        a, b = ReplayState(S0, p, delta, seed=7, layer=3), ConventionalState(S0, p, delta, seed=7, layer=3)
        assert torch.equal(run_steps(a, inp), run_steps(b, inp)), fmt
        assert torch.equal(a.anchor(), b.anchor())


@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("L", [2, 5, 16])
def test_L_gt_1_fp32_within_reassociation(delta, L):
    B, H, dv, dk = 2, 2, 16, 16
    inp = make_inputs(B, 70, H, dk, dv, delta, seed=3)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    Yref, Sref, states = recurrent_reference(S0, *inp, return_states=True)
    for p in (pair(None, "fp32", L), pair("fp32", "fp32", L)):
        st = ReplayState(S0, p, delta)
        Y = run_steps(st, inp)
        assert rel(Y, Yref) < 2e-6
        assert rel(st.current_state(), Sref) < 2e-6
        # the anchor is the state at the last flush
        last = (70 // L) * L
        ref_anchor = S0 if last == 0 else states[:, last - 1]
        assert rel(st.anchor(), ref_anchor) < 2e-6
        assert torch.equal(st.committed, torch.full((B,), 70 % L))


# ---------------------------------------------------------------- casts and flush semantics

@pytest.mark.parametrize("delta", KINDS)
def test_initial_cast_uses_streams_independently(delta):
    S0 = torch.randn(2, 3, 8, 32)
    rows = torch.tensor([5, 9])
    p = pair("nvfp4", "fp16", 4, rr="stochastic", ar="stochastic")
    st = ReplayState(S0, p, delta, seed=11, layer=2, state_indices=rows)
    key = layer_seed(11, 2)
    A = get_format("fp16").quantize(S0, "stochastic", seed=key, stream=sr_stream(0, ANCHOR, rows, 3))
    R = get_format("nvfp4").quantize(S0, "stochastic", seed=key, stream=sr_stream(0, READ, rows, 3))
    assert torch.equal(st.anchor_q.payload, A.payload)
    assert torch.equal(st.read_q.payload, R.payload)
    assert all(torch.equal(st.read_q.scales[k], R.scales[k]) for k in R.scales)
    assert torch.equal(st.read_copy(), get_format("nvfp4").dequantize(R))
    assert isinstance(st.anchor_q.payload, torch.Tensor) and st.read_q.payload.dtype == torch.uint8


@pytest.mark.parametrize("delta", KINDS)
def test_flush_casts_both_roles_from_the_same_unrounded_state(delta):
    B, H, dv, dk, L = 2, 2, 8, 32, 6
    inp = make_inputs(B, 12, H, dk, dv, delta, seed=4)
    S0 = torch.randn(B, H, dv, dk)
    p = pair("nvfp4", "fp16", L, rr="stochastic", ar="stochastic")
    st = ReplayState(S0, p, delta, seed=3)
    run_steps(st, inp, 0, 4)                       # h = 4
    S = st.current_state()                         # what the pre-flush will cast
    q, k, v, la, beta = inp
    sl = slice(4, 7)                               # T = 3: 4 + 3 > 6 -> flush first
    st.verify(q[:, sl], k[:, sl], v[:, sl], la[:, sl], None if beta is None else beta[:, sl])
    assert torch.equal(st.n_flush, torch.ones(B, dtype=torch.int64))
    key, rows = layer_seed(3, 0), torch.arange(B)
    A = get_format("fp16").quantize(S, "stochastic", seed=key, stream=sr_stream(1, ANCHOR, rows, H))
    R = get_format("nvfp4").quantize(S, "stochastic", seed=key, stream=sr_stream(1, READ, rows, H))
    assert torch.equal(st.anchor_q.payload, A.payload)
    assert torch.equal(st.read_q.payload, R.payload)
    # never Q_LP(Q_HP(S)): with an FP32 read copy and a BF16 anchor the read copy is S itself
    st = ReplayState(S0, pair("fp32", "bf16", L), delta)
    run_steps(st, inp, 0, 4)
    S = st.current_state()
    st.verify(q[:, sl], k[:, sl], v[:, sl], la[:, sl], None if beta is None else beta[:, sl])
    assert torch.equal(st.read_copy(), S)
    assert torch.equal(st.anchor(), S.to(torch.bfloat16).float())
    assert not torch.equal(st.anchor(), S)


@pytest.mark.parametrize("delta", KINDS)
def test_flush_step_output_from_unrounded_state(delta):
    """FP32 anchor + NVFP4 read: flush-step outputs are FP32-exact, the others are not."""
    L = 4
    inp = make_inputs(2, 24, 2, 32, 16, delta, seed=5)
    S0 = torch.randn(2, 2, 16, 32)
    Yref, Sref = recurrent_reference(S0, *inp)
    st = ReplayState(S0, pair("nvfp4", "fp32", L), delta)
    Y = run_steps(st, inp)
    flush_steps = torch.arange(24) % L == L - 1
    assert rel(Y[:, flush_steps], Yref[:, flush_steps]) < 2e-6
    assert rel(Y[:, ~flush_steps], Yref[:, ~flush_steps]) > 1e-3
    assert rel(st.anchor(), Sref) < 2e-6          # read-copy rounding never enters the anchor


# ---------------------------------------------------------------- invariant 3

@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("anchor", [("fp32", "nearest"), ("fp16", "stochastic")])
def test_read_format_never_changes_anchor(delta, anchor):
    B, H, dv, dk, L = 2, 2, 16, 32, 5
    inp = make_inputs(B, 40, H, dk, dv, delta, seed=6)
    S0 = torch.randn(B, H, dv, dk)
    af, ar = anchor
    states = [ReplayState(S0, pair(r, af, L, rr=rr, ar=ar), delta, seed=1)
              for r, rr in ((None, "nearest"), ("nvfp4", "nearest"), ("fp8", "stochastic"), ("bf16", "nearest"))]
    q, k, v, la, beta = inp
    outs = []
    for t in range(40):
        outs.append([s.step(q[:, t], k[:, t], v[:, t], la[:, t], at(beta, t)) for s in states])
        for s in states[1:]:
            assert torch.equal(s.anchor_q.payload, states[0].anchor_q.payload)
    # speculative rounds too
    for r in range(6):
        sl = slice(r * 3, r * 3 + 3)
        for s in states:
            s.verify(q[:, sl], k[:, sl], v[:, sl], la[:, sl], None if beta is None else beta[:, sl])
            s.accept(torch.tensor([r % 4, 3 - r % 4]))
        for s in states[1:]:
            assert torch.equal(s.anchor(), states[0].anchor())
    assert not torch.equal(outs[-2][0], outs[-2][1])   # the read copies did differ


# ---------------------------------------------------------------- invariant 4 and speculation

def spec_inputs(inp, sl):
    return tuple(None if x is None else x[:, sl] for x in inp)


@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("cls", [ReplayState, ConventionalState])
def test_rejected_drafts_change_nothing(delta, cls):
    B, H, dv, dk, T = 3, 2, 8, 16, 3
    p = pair(None, "fp16", 6, ar="stochastic") if cls is ConventionalState else \
        pair("nvfp4", "fp16", 6, ar="stochastic")
    inp = make_inputs(B, 80, H, dk, dv, delta, seed=7)
    junk = make_inputs(B, 80, H, dk, dv, delta, seed=8)
    S0 = torch.randn(B, H, dv, dk)
    a, b = cls(S0, p, delta, seed=2), cls(S0, p, delta, seed=2)
    gen = torch.Generator().manual_seed(0)
    pos = torch.zeros(B, dtype=torch.int64)           # next token per row
    for r in range(20):
        n = torch.randint(0, T + 1, (B,), generator=gen)
        idx = (pos[:, None] + torch.arange(T)).clamp(max=79)
        ins = tuple(None if x is None else x[torch.arange(B)[:, None], idx] for x in inp)
        # b sees the same accepted drafts, but different rejected ones
        mask = torch.arange(T)[None, :] >= n[:, None]
        insb = tuple(None if x is None else torch.where(
            mask.view(B, T, *([1] * (x.dim() - 2))), j[torch.arange(B)[:, None], idx], x)
            for x, j in zip(ins, junk))
        ya, yb = a.verify(*ins), b.verify(*insb)
        acc = ~mask
        assert torch.equal(ya[acc], yb[acc])
        a.accept(n), b.accept(n)
        assert torch.equal(a.anchor(), b.anchor()) and torch.equal(a.read_copy(), b.read_copy())
        assert torch.equal(a.committed, b.committed)
        if r % 3 == 2:                                  # plain steps in between
            t = int(pos.max()) % 70
            s = spec_inputs(inp, slice(t, t + 1))
            s = tuple(None if x is None else x[:, 0] for x in s)
            assert torch.equal(a.step(*s), b.step(*s))
        pos += n


@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("L,T", [(8, 3), (4, 4), (16, 5)])
def test_speculative_matches_sequential_on_accepted_tokens(delta, L, T):
    """Random accept counts (0 and T included) over many rounds vs the FP32 recurrence fed only
    the accepted tokens; every verify has T free slots; flushes only when needed."""
    B, H, dv, dk = 3, 2, 16, 16
    N = 200
    inp = make_inputs(B, N, H, dk, dv, delta, seed=9)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    st = ReplayState(S0, pair("fp32", "fp32", L), delta)
    gen = torch.Generator().manual_seed(1)
    pos = torch.zeros(B, dtype=torch.int64)
    got = [[] for _ in range(B)]
    seen0 = seenT = False
    rnd = 0
    while int(pos.max()) + T < N:
        if rnd % 4 == 3:                     # a plain step (rows at different committed lengths)
            ins = tuple(None if x is None else x[torch.arange(B), pos] for x in inp)
            h0, f0 = st.committed, st.n_flush
            y = st.step(*ins)
            assert torch.equal(st.n_flush - f0, ((h0 == L) | (h0 + 1 == L)).long())
            for b in range(B):
                got[b].append(y[b:b + 1])
            pos += 1
            rnd += 1
            continue
        h0, f0 = st.committed, st.n_flush
        idx = pos[:, None] + torch.arange(T)
        ins = tuple(None if x is None else x[torch.arange(B)[:, None], idx] for x in inp)
        Y = st.verify(*ins)
        assert bool((st.committed + T <= L).all())
        need = (h0 + T > L) & (h0 > 0)
        assert torch.equal(st.n_flush - f0, need.long())
        n = torch.randint(0, T + 1, (B,), generator=gen)
        if rnd % 5 == 1:
            n[0] = 0
        if rnd % 5 == 2:
            n[1] = T
        seen0 |= bool((n == 0).any())
        seenT |= bool((n == T).any())
        st.accept(n)
        for b in range(B):
            got[b].append(Y[b, : int(n[b])])
        pos += n
        rnd += 1
    assert seen0 and seenT and rnd > 30
    for b in range(B):
        m = int(pos[b])
        Yref, Sref = recurrent_reference(S0[b:b + 1], *(None if x is None else x[b:b + 1, :m] for x in inp))
        assert rel(torch.cat(got[b]), Yref[0]) < 3e-6
        assert rel(st.current_state()[b], Sref[0]) < 3e-6


@pytest.mark.parametrize("delta", KINDS)
def test_conventional_speculation_restores_snapshots(delta):
    """Snapshot + restore equals stepping only the accepted tokens, bit for bit (SR included)."""
    B, H, dv, dk, T = 3, 2, 8, 16, 4
    inp = make_inputs(B, 120, H, dk, dv, delta, seed=10)
    S0 = torch.randn(B, H, dv, dk)
    p = pair(None, "nvfp4", 1, ar="stochastic")
    st = ConventionalState(S0, p, delta, seed=5)
    gen = torch.Generator().manual_seed(2)
    pos = torch.zeros(B, dtype=torch.int64)
    got = [[] for _ in range(B)]
    for _ in range(20):
        idx = pos[:, None] + torch.arange(T)
        Y = st.verify(*(None if x is None else x[torch.arange(B)[:, None], idx] for x in inp))
        assert st.snapshot_bytes == T * st.anchor_q.nbytes
        n = torch.randint(0, T + 1, (B,), generator=gen)
        st.accept(n)
        for b in range(B):
            got[b].append(Y[b, : int(n[b])])
        pos += n
    for b in range(B):
        m = int(pos[b])
        ref = ConventionalState(S0[b:b + 1], p, delta, seed=5, state_indices=torch.tensor([b]))
        y = run_steps(ref, tuple(None if x is None else x[b:b + 1, :m] for x in inp))
        assert torch.equal(torch.cat(got[b]), y[0])
        assert torch.equal(st.anchor()[b], ref.anchor()[0])


# ---------------------------------------------------------------- invariant 5 and empty history

@pytest.mark.parametrize("delta", KINDS)
def test_sr_reproducible_and_keyed_by_sequence(delta):
    B, H, dv, dk = 3, 2, 8, 32
    inp = make_inputs(B, 30, H, dk, dv, delta, seed=11)
    S0 = torch.randn(B, H, dv, dk)
    p = pair("nvfp4", "fp16", 4, rr="stochastic", ar="stochastic")

    def run(seed, layer=0, perm=None):
        rows = torch.arange(B) if perm is None else perm
        s0 = S0 if perm is None else S0[perm]
        ins = inp if perm is None else tuple(None if x is None else x[perm] for x in inp)
        st = ReplayState(s0, p, delta, seed=seed, layer=layer, state_indices=rows)
        return run_steps(st, ins), st.anchor(), st.read_copy()

    a, b = run(42), run(42)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = run(43)
    assert not torch.equal(a[1], c[1])
    assert not torch.equal(a[1], run(42, layer=1)[1])
    perm = torch.tensor([2, 0, 1])               # same sequences in other batch slots
    d = run(42, perm=perm)
    assert all(torch.equal(x[perm], y) for x, y in zip(a, d))


@pytest.mark.parametrize("delta", KINDS)
def test_empty_history_leaves_anchor_untouched(delta):
    B, H, dv, dk, T = 2, 2, 8, 16, 4
    inp = make_inputs(B, 40, H, dk, dv, delta, seed=12)
    S0 = torch.randn(B, H, dv, dk)
    st = ReplayState(S0, pair("fp8", "fp16", 4, ar="stochastic"), delta)
    A0, R0 = st.anchor(), st.read_copy()
    for r in range(5):                          # T = L with h = 0: no flush, reject everything
        st.verify(*spec_inputs(inp, slice(r * T, r * T + T)))
        st.accept(0)
        assert torch.equal(st.anchor(), A0) and torch.equal(st.read_copy(), R0)
        assert torch.equal(st.n_flush, torch.zeros(B, dtype=torch.int64))
    assert torch.equal(st.current_state(), A0)
    # accept all T = L: h == L, the flush happens at the next step
    st.verify(*spec_inputs(inp, slice(0, T)))
    st.accept(T)
    assert torch.equal(st.committed, torch.full((B,), 4)) and torch.equal(st.anchor(), A0)
    st.step(*(None if x is None else x[:, 5] for x in inp))
    assert torch.equal(st.n_flush, torch.ones(B, dtype=torch.int64))
    assert torch.equal(st.committed, torch.ones(B, dtype=torch.int64))


# ---------------------------------------------------------------- bad input

def test_bad_inputs_name_the_tensor():
    B, H, dv, dk = 2, 2, 8, 16
    S0 = torch.zeros(B, H, dv, dk)
    st = ReplayState(S0, "s32_rs", delta=True)
    q, k, v = torch.randn(B, H, dk), torch.randn(B, H, dk), torch.randn(B, H, dv)
    la, beta = torch.zeros(B, H), torch.ones(B, H)
    with pytest.raises(ValueError, match=r"\bk has shape"):
        st.step(q, k[:, :, :3], v, la, beta)
    with pytest.raises(ValueError, match=r"\bv has shape"):
        st.step(q, k, torch.randn(B, H, dk + 1), la, beta)
    with pytest.raises(ValueError, match=r"log_a must be floating"):
        st.step(q, k, v, la.long(), beta)
    with pytest.raises(ValueError, match=r"beta is required"):
        st.step(q, k, v, la, None)
    with pytest.raises(ValueError, match=r"beta must be None"):
        ReplayState(S0, "s32_rs", delta=False).step(q, k, v, la, beta)
    with pytest.raises(ValueError, match=r"q has shape"):
        st.verify(q.unsqueeze(1)[:, :, :1], k.unsqueeze(1), v.unsqueeze(1), la.unsqueeze(1), beta.unsqueeze(1))
    with pytest.raises(ValueError, match=r"1 <= T <= buffer_len"):
        st.verify(*(x.unsqueeze(1).expand(B, 17, *x.shape[1:]) for x in (q, k, v, la, beta)))
    with pytest.raises(ValueError, match=r"no drafts pending"):
        st.accept(1)
    st.verify(*(x.unsqueeze(1) for x in (q, k, v, la, beta)))
    with pytest.raises(ValueError, match=r"pending"):
        st.step(q, k, v, la, beta)
    with pytest.raises(ValueError, match=r"0\.\.T=1"):
        st.accept(torch.tensor([0, 2]))
    st.accept(torch.tensor([1, 0]))
    assert st.committed.tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"initial_state"):
        ReplayState(torch.zeros(B, H, dv), "s32_rs", delta=True)
    with pytest.raises(ValueError, match=r"initial_state must be floating"):
        ReplayState(torch.zeros(B, H, dv, dk, dtype=torch.int32), "s32_rs", delta=True)
    with pytest.raises(ValueError, match=r"state_indices"):
        ReplayState(S0, "s32_rs", delta=True, state_indices=torch.arange(3))
    with pytest.raises(ValueError, match=r"multiple of 16"):
        ReplayState(torch.zeros(B, H, dv, 8), "tp4_hi32", delta=True)
    with pytest.raises(ValueError, match=r"shared pair"):
        ConventionalState(S0, "tp8_hi32", delta=True)
    with pytest.raises(ValueError, match=r"unknown precision pair"):
        ReplayState(S0, "nope", delta=True)


def test_low_precision_inputs_are_accepted():
    S0 = torch.zeros(1, 2, 8, 16)
    st = ReplayState(S0, "s32_rs", delta=False)
    y = st.step(torch.randn(1, 2, 16, dtype=torch.bfloat16), torch.randn(1, 2, 16, dtype=torch.bfloat16),
                torch.randn(1, 2, 8, dtype=torch.float16), torch.zeros(1, 2), None)
    assert y.dtype == torch.float32 and y.shape == (1, 2, 8)


def test_triton_quant_backend_gives_the_same_bits(monkeypatch):
    """ReplayState on the Triton quantize kernels (as on a GPU) draws the same SR bits as the
    torch reference, including row-subset flushes at unequal committed lengths."""
    B, H, dv, dk = 3, 1, 4, 16
    inp = make_inputs(B, 12, H, dk, dv, True, seed=13)
    S0 = torch.randn(B, H, dv, dk)
    p = pair("nvfp4", "fp16", 3, rr="stochastic", ar="stochastic")

    def run():
        st = ReplayState(S0, p, delta=True, seed=3, state_indices=torch.tensor([4, 7, 1]))
        ys = [st.step(*(x[:, t] for x in inp)) for t in range(2)]
        ys.append(st.verify(*spec_inputs(inp, slice(2, 4))).flatten(1))
        st.accept(torch.tensor([0, 1, 2]))
        ys += [st.step(*(x[:, t] for x in inp)) for t in range(4, 7)]
        return [y.flatten() for y in ys] + [st.anchor(), st.read_copy(), st.n_flush]

    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    a = run()
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    b = run()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
