"""Vector (per-channel) gates in the replay core, the decay of Kimi Delta Attention: ReplayState /
ConventionalState with log_a [.., H, d_k] against a float64 per-channel recurrence and against
transformers' own KDA recurrence, and the invariants of DESIGN section 4 with vector gates."""

from types import SimpleNamespace

import pytest
import torch

from replayquant.pairs import FormatSpec, PrecisionPair
from replayquant.replay import (ConventionalState, ReplayState, kda_inputs, kda_log_decay,
                                recurrent_reference)

KINDS = [pytest.param(False, id="mamba2"), pytest.param(True, id="kda")]


def make_inputs(B, T, H, dk, dv, delta, seed):
    """Gates that differ strongly between key channels: per head, channel rates spread from
    a ~ 0.999 (remembers hundreds of steps) to a ~ 0.3 (forgets within a few), shuffled over the
    channels, with a little noise per step; a decay on the wrong axis cannot pass."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, dk, generator=g) / dk ** 0.5
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    v = torch.randn(B, T, H, dv, generator=g)
    rates = torch.logspace(-3, 0.08, dk)                               # -log a per channel
    rates = torch.stack([rates[torch.randperm(dk, generator=g)] for _ in range(H)])   # [H, dk]
    noise = 0.8 + 0.4 * torch.rand(B, T, H, dk, generator=g)
    la = -(rates * noise)
    beta = torch.rand(B, T, H, generator=g) if delta else None
    return q, k, v, la, beta


def at(x, t):
    return None if x is None else x[:, t]


def sl(inp, s):
    return tuple(None if x is None else x[:, s] for x in inp)


def run_steps(st, inp, t0=0, t1=None):
    t1 = inp[0].shape[1] if t1 is None else t1
    return torch.stack([st.step(*(at(x, t) for x in inp)) for t in range(t0, t1)], dim=1)


def pair(read, anchor, L, rr="nearest", ar="nearest"):
    return PrecisionPair(read=None if read is None else FormatSpec(read, rr),
                         anchor=FormatSpec(anchor, ar), buffer_len=L)


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def f64(S0, inp, **kw):
    return recurrent_reference(S0, *inp, dtype=torch.float64, **kw)


# ---------------------------------------------------------------- against float64

@pytest.mark.parametrize("delta", KINDS)
@pytest.mark.parametrize("shape,L", [((2, 2, 16, 16), 4), ((1, 3, 8, 32), 5)])
def test_vector_gates_match_float64_recurrence(delta, shape, L):
    """FP32 pairs, shared and dual, over several windows and a partial one: outputs, the anchor
    (the state at the last flush) and the current state within FP32 reassociation."""
    B, H, dv, dk = shape
    T = 3 * L + 2
    inp = make_inputs(B, T, H, dk, dv, delta, seed=dk + L)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    Yref, Sref, states = f64(S0, inp, return_states=True)
    for p in (pair(None, "fp32", L), pair("fp32", "fp32", L)):
        st = ReplayState(S0, p, delta, vector_gate=True)
        Y = run_steps(st, inp)
        assert rel(Y, Yref) < 2e-6
        assert rel(st.current_state(), Sref) < 2e-6
        assert rel(st.anchor(), states[:, 3 * L - 1]) < 2e-6
        assert st.buffer["G"].shape == (B, H, L, dk)
        assert torch.equal(st.committed, torch.full((B,), 2))


def test_kda_s32_matches_transformers_recurrent():
    """kda_log_decay + kda_inputs + ReplayState (s32_rs) against transformers' torch KDA
    recurrence (models/kimi_linear), with verify/accept rounds among the steps."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    B, H, dk, T = 2, 2, 16, 120
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, T, H, dk, generator=g) for _ in range(3))
    f = torch.randn(B, T, H * dk, generator=g)
    A_log = torch.log(torch.rand(H, generator=g) * 0.5 + 0.5)
    dt_bias = torch.linspace(-9, 1, H * dk)[torch.randperm(H * dk, generator=g)]  # long and short memory
    b = torch.randn(B, T, H, generator=g)
    gate = kda_log_decay(f, A_log.view(1, 1, H, 1), dt_bias)
    S0 = torch.randn(B, H, dk, dk, generator=g) * 0.1                # HF layout [.., d_k, d_v]
    y_hf, S_hf = kimi.recurrent_kimi_delta_attention(
        q, k, v, g=gate, beta=b.sigmoid(), initial_state=S0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    qq, kk, vv, la, bb = kda_inputs(q, k, v, gate, b)
    st = ReplayState(S0.transpose(-1, -2), "s32_rs", delta=True, vector_gate=True)
    ys, t = [], 0
    while t < T:
        if t % 23 == 7 and t + 3 <= T:
            ys.append(st.verify(*sl((qq, kk, vv, la, bb), slice(t, t + 3))))
            st.accept(3)
            t += 3
        else:
            ys.append(st.step(*(x[:, t] for x in (qq, kk, vv, la, bb))).unsqueeze(1))
            t += 1
    assert rel(torch.cat(ys, dim=1), y_hf) < 1e-5
    assert rel(st.current_state(), S_hf.transpose(-1, -2)) < 1e-5


def test_kda_log_decay_equals_the_forget_gates_of_transformers():
    """Kimi Linear's softplus gate (its upper branch included) and GLM-5-Next's bounded gate,
    against the modules themselves on the same projection."""
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    glm = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")
    H, dk = 2, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 3, 8, generator=gen)
    for module, bound, A_log in (
            (kimi.KimiLinearForgetGate, None, torch.randn(1, 1, H, 1, generator=gen)),
            (glm.Glm5NextTextForgetGate, -5.0, torch.randn(H, generator=gen))):
        gate = module(SimpleNamespace(hidden_size=8, linear_head_dim=dk, linear_num_heads=H,
                                      linear_lower_bound=bound))
        with torch.no_grad():
            for w in (gate.f_a_proj.weight, gate.f_b_proj.weight):
                w.copy_(torch.randn(w.shape, generator=gen) * 8)      # reaches softplus's x > 20
            gate.A_log.copy_(A_log)
            gate.dt_bias.copy_(torch.randn(H * dk, generator=gen))
            want = gate(x)
            f = gate.f_b_proj(gate.f_a_proj(x))
        got = kda_log_decay(f, gate.A_log, gate.dt_bias, bound)
        assert torch.equal(got, want), module.__name__
    assert bool((f > 20).any())
    with pytest.raises(ValueError, match="H \\* d_k"):
        kda_log_decay(f, A_log, gate.dt_bias[:3])
    with pytest.raises(ValueError, match="g has shape"):
        kda_inputs(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4), torch.randn(2), beta=torch.rand(2))


# ---------------------------------------------------------------- invariants 1 and 3

@pytest.mark.parametrize("delta", KINDS)
def test_L1_shared_bit_identical_to_conventional(delta):
    inp = make_inputs(2, 30, 2, 16, 8, delta, seed=2)
    S0 = torch.randn(2, 2, 8, 16) * 0.3
    for fmt, r in (("fp32", "nearest"), ("nvfp4", "stochastic")):
        p = pair(None, fmt, 1, ar=r)
        a = ReplayState(S0, p, delta, seed=7, layer=3, vector_gate=True)
        c = ConventionalState(S0, p, delta, seed=7, layer=3, vector_gate=True)
        assert torch.equal(run_steps(a, inp), run_steps(c, inp)), fmt
        assert torch.equal(a.anchor(), c.anchor())
        y = c.verify(*sl(inp, slice(0, 3)))                # conventional speculation, vector gates
        c.accept(2)
        assert y.shape == (2, 3, 2, 8)


@pytest.mark.parametrize("delta", KINDS)
def test_read_format_never_changes_anchor(delta):
    B, H, dv, dk, L = 2, 2, 8, 16, 5
    inp = make_inputs(B, 24, H, dk, dv, delta, seed=6)
    S0 = torch.randn(B, H, dv, dk)
    states = [ReplayState(S0, pair(r, "fp16", L, rr=rr, ar="stochastic"), delta, seed=1, vector_gate=True)
              for r, rr in ((None, "nearest"), ("nvfp4", "nearest"), ("fp8", "stochastic"))]
    outs = []
    for t in range(12):
        outs.append([s.step(*(at(x, t) for x in inp)) for s in states])
        assert all(torch.equal(s.anchor_q.payload, states[0].anchor_q.payload) for s in states[1:])
    for r in range(4):
        for s in states:
            s.verify(*sl(inp, slice(12 + 3 * r, 15 + 3 * r)))
            s.accept(torch.tensor([r % 4, 3 - r % 4]))
        assert all(torch.equal(s.anchor(), states[0].anchor()) for s in states[1:])
    assert not torch.equal(outs[-2][0], outs[-2][1])     # the read copies did differ


# ---------------------------------------------------------------- speculation

@pytest.mark.parametrize("delta", KINDS)
def test_accept_moves_only_the_pointer(delta):
    """verify + accept(n) leaves anchor, read copy and buffer as verify left them and moves h;
    the accepted drafts' outputs and buffer entries equal those of n plain steps, bit for bit;
    rejected drafts change nothing later."""
    B, H, dv, dk, L, T = 2, 2, 8, 16, 8, 4
    inp = make_inputs(B, 40, H, dk, dv, delta, seed=8)
    junk = make_inputs(B, 40, H, dk, dv, delta, seed=9)
    S0 = torch.randn(B, H, dv, dk)
    p = pair("nvfp4", "fp32", L)
    a, b = (ReplayState(S0, p, delta, seed=4, vector_gate=True) for _ in range(2))
    n = torch.tensor([3, 1])
    drafts = tuple(None if x is None else torch.where(
        (torch.arange(T)[None, :] < n[:, None]).view(B, T, *([1] * (x.dim() - 2))), x[:, :T], j[:, :T])
        for x, j in zip(inp, junk))
    y = a.verify(*drafts)
    snap = {name: t.clone() for name, t in a.buffer.items()}
    A0, R0, f0 = a.anchor(), a.read_copy(), a.n_flush
    a.accept(n)
    assert torch.equal(a.committed, n)
    assert torch.equal(a.anchor(), A0) and torch.equal(a.read_copy(), R0) and torch.equal(a.n_flush, f0)
    assert all(torch.equal(t, snap[name]) for name, t in a.buffer.items())
    for r in range(B):                       # row r of b steps its n[r] accepted tokens alone
        nr = int(n[r])
        for t in range(nr):
            yb = b.step(*(at(x, t) for x in inp))
            assert torch.equal(yb[r], y[r, t])
        for name, t_ in b.buffer.items():
            assert torch.equal(t_[r, :, :nr], a.buffer[name][r, :, :nr]), name
        b = ReplayState(S0, p, delta, seed=4, vector_gate=True)
    # from here on both continue with the same tokens: a's rejected drafts leave no trace
    b.verify(*sl(inp, slice(0, T)))
    b.accept(n)
    ya, yb = run_steps(a, inp, 10, 30), run_steps(b, inp, 10, 30)
    assert torch.equal(ya, yb) and torch.equal(a.anchor(), b.anchor())


@pytest.mark.parametrize("delta", KINDS)
def test_speculative_rounds_match_float64_on_accepted_tokens(delta):
    """Random accept counts with plain steps between: flush one window early (h + T > L), every
    verify has T free slots, and the outputs of the accepted tokens follow the float64
    recurrence fed only those tokens."""
    B, H, dv, dk, L, T, N = 2, 2, 8, 16, 6, 3, 60
    inp = make_inputs(B, N, H, dk, dv, delta, seed=10)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    st = ReplayState(S0, pair("fp32", "fp32", L), delta, vector_gate=True)
    gen = torch.Generator().manual_seed(1)
    pos = torch.zeros(B, dtype=torch.int64)
    got = [[] for _ in range(B)]
    rnd = 0
    while int(pos.max()) + T < N:
        rows = torch.arange(B)
        if rnd % 4 == 3:
            y = st.step(*(None if x is None else x[rows, pos] for x in inp))
            for r in range(B):
                got[r].append(y[r:r + 1])
            pos += 1
        else:
            h0, f0 = st.committed, st.n_flush
            idx = pos[:, None] + torch.arange(T)
            Y = st.verify(*(None if x is None else x[rows[:, None], idx] for x in inp))
            assert torch.equal(st.n_flush - f0, ((h0 + T > L) & (h0 > 0)).long())
            n = torch.randint(0, T + 1, (B,), generator=gen)
            st.accept(n)
            for r in range(B):
                got[r].append(Y[r, : int(n[r])])
            pos += n
        rnd += 1
    assert int(st.n_flush.min()) >= 3
    for r in range(B):
        m = int(pos[r])
        Yref, Sref = f64(S0[r:r + 1], tuple(None if x is None else x[r:r + 1, :m] for x in inp))
        assert rel(torch.cat(got[r]), Yref[0]) < 3e-6
        assert rel(st.current_state()[r], Sref[0]) < 3e-6


# ---------------------------------------------------------------- dual vs shared, scalar case

def test_dual_beats_shared_at_equal_read_format():
    """NVFP4 read copy over an FP32 anchor against shared NVFP4 with SR (the same read format):
    output error against float64 over the last two windows, averaged over seeds, well below the
    shared pair's (the channels that forget fast cap both errors, hence a factor of 2 and not
    more); the dual anchor stays at FP32 accuracy."""
    B, H, dv, dk, L, T = 1, 2, 16, 32, 8, 64
    errs = {"tp4_hi32": [], "f4_sr_rs": []}
    anchor = []
    for seed in (1, 2, 3):
        inp = make_inputs(B, T, H, dk, dv, True, seed=20 + seed)
        S0 = torch.randn(B, H, dv, dk) * 0.5
        Yref, Sref = f64(S0, inp)
        for name in errs:
            st = ReplayState(S0, PrecisionPair.load(name).with_buffer_len(L), True, seed=seed,
                             vector_gate=True)
            Y = run_steps(st, inp)
            errs[name].append(float((Y[:, -16:].double() - Yref[:, -16:]).norm() / Yref[:, -16:].norm()))
            if name == "tp4_hi32":
                anchor.append(rel(st.anchor(), Sref))
    mean = {name: sum(e) / len(e) for name, e in errs.items()}
    assert mean["tp4_hi32"] * 2 < mean["f4_sr_rs"], mean
    assert max(anchor) < 2e-6


@pytest.mark.parametrize("delta", KINDS)
def test_constant_vector_gates_equal_scalar_gates(delta):
    """A gate vector equal over the channels gives the scalar-gate state within FP32 rounding
    (not bit for bit: the decay multiplies k per channel instead of the correction u)."""
    B, H, dv, dk, L = 2, 2, 8, 16, 4
    q, k, v, la, beta = make_inputs(B, 22, H, dk, dv, delta, seed=12)
    la = la[..., 0]                                                  # one gate per head
    inp_s, inp_v = (q, k, v, la, beta), (q, k, v, la.unsqueeze(-1).expand(-1, -1, -1, dk), beta)
    S0 = torch.randn(B, H, dv, dk) * 0.3
    p = pair("nvfp4", "fp32", L)
    s, w = ReplayState(S0, p, delta, seed=3), ReplayState(S0, p, delta, seed=3, vector_gate=True)
    ys, yw = run_steps(s, inp_s, 0, 14), run_steps(w, inp_v, 0, 14)
    ys = torch.cat([ys, s.verify(*sl(inp_s, slice(14, 17)))], dim=1)
    yw = torch.cat([yw, w.verify(*sl(inp_v, slice(14, 17)))], dim=1)
    assert rel(yw, ys) < 2e-6
    assert rel(w.anchor(), s.anchor()) < 2e-6
    assert rel(w.current_state(), s.current_state()) < 2e-6


# ---------------------------------------------------------------- hand-off and bad input

def test_export_load_from_parts_with_vector_gates():
    B, H, dv, dk, L = 2, 2, 8, 16, 5
    inp = make_inputs(B, 20, H, dk, dv, True, seed=13)
    S0 = torch.randn(B, H, dv, dk)
    p = pair("nvfp4", "fp16", L, rr="stochastic", ar="stochastic")
    st = ReplayState(S0, p, True, seed=2, layer=1, vector_gate=True)
    run_steps(st, inp, 0, 7)
    parts = st.export()
    assert parts["G"].shape == (B, H, L, dk)
    clone = ReplayState.from_parts(parts, p, True, seed=2, layer=1)
    assert clone.vector_gate
    no_u = ReplayState.from_parts({n: t for n, t in parts.items() if n != "u"}, p, True, seed=2, layer=1)
    ya, yb, yc = (run_steps(s, inp, 7, 20) for s in (st, clone, no_u))
    assert torch.equal(ya, yb) and torch.equal(st.anchor_q.payload, clone.anchor_q.payload)
    assert rel(yc, ya) < 1e-5               # u recomputed by the triangular solve: reassociation
    scalar = ReplayState(S0, p, True, seed=2, layer=1)
    with pytest.raises(ValueError, match=r"parts\['G'\] must be a tensor \[2, 2, 5\]"):
        scalar.load(parts)


@pytest.mark.parametrize("cls", [ReplayState, ConventionalState])
def test_wrong_gate_shape_and_nonfinite_gates(cls):
    B, H, dv, dk = 2, 2, 8, 16
    S0 = torch.zeros(B, H, dv, dk)
    q, k, v, beta = torch.randn(B, H, dk), torch.randn(B, H, dk), torch.randn(B, H, dv), torch.rand(B, H)
    vec = cls(S0, "s32_rs", delta=True, vector_gate=True)
    sca = cls(S0, "s32_rs", delta=True)
    with pytest.raises(ValueError, match=r"log_a has shape \[2, 2\], expected \[2, 2, 16\].*vector_gate=True"):
        vec.step(q, k, v, torch.zeros(B, H), beta)
    with pytest.raises(ValueError, match=r"log_a has shape \[2, 2, 16\], expected \[2, 2\].*vector_gate=True"):
        sca.step(q, k, v, torch.zeros(B, H, dk), beta)
    with pytest.raises(ValueError, match=r"log_a has shape \[2, 1, 2, 15\], expected \[2, 1, 2, 16\]"):
        vec.verify(*(x.unsqueeze(1) for x in (q, k, v, torch.zeros(B, H, dk - 1), beta)))
    bad = torch.zeros(B, H, dk)
    bad[1, 0, 5] = float("nan")
    with pytest.raises(ValueError, match=r"step 1 of this state: input log_a holds NaN .*batch row 1"):
        vec.step(q, k, v, bad, beta)
    with pytest.raises(ValueError, match=r"vector_gate must be True"):
        cls(S0, "s32_rs", delta=True, vector_gate="yes")
    assert torch.equal(vec.anchor(), S0)                  # nothing changed
