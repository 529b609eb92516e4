"""Conventional decode step (Triton, interpreter) against its torch reference and against
ConventionalState: every format, nearest and stochastic rounding, GDN, KDA (a gate per key
channel) and Mamba-2, odd batch sizes, padding rows, poisoned outputs."""

import pytest
import torch

from replayquant.testing import (gdn_params, gdn_step_inputs, kda_step_inputs,
                                 mamba2_params, mamba2_step_inputs, random_state)
from replayquant.kernels.conventional.kernel import (conventional_gdn_step, conventional_kda_step,
                                                     conventional_mamba2_step)
from replayquant.kernels.conventional.launch import override_conventional_launch
from replayquant.kernels.conventional.reference import (conventional_gdn_step_ref,
                                                        conventional_kda_step_ref,
                                                        conventional_mamba2_step_ref,
                                                        gdn_frontend_ref, kda_frontend_ref,
                                                        mamba2_frontend_ref, mamba2_post_ref)
from replayquant.replay.stores import ConventionalStore
from replayquant.replay import ConventionalState
from _helpers import assert_states_close

FORMATS = ["fp32", "fp16", "bf16", "fp8", "nvfp4"]


def poisoned(*shape):
    return torch.full(shape, float("nan"))


def _step(kind, store, ref, B, HK, H, dk, dv, idx, seed, use_state=None):
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, seed=seed)
        A_log, dtb = gdn_params(H, seed)
        out = poisoned(B, H, dv)
        y = conventional_gdn_step(store, q, k, v, a, b, A_log, dtb, state_indices=idx, out=out)
        y2 = None if ref is None else conventional_gdn_step_ref(ref, q, k, v, a, b, A_log, dtb,
                                                                state_indices=idx)
        fe = gdn_frontend_ref(q, k, v, a, b, A_log, dtb)
        post = None
    else:
        x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, seed=seed)
        A, D, dtb = mamba2_params(H, seed)
        out = poisoned(B, H, dv)
        y = conventional_mamba2_step(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                     dt_bias=dtb, out=out)
        y2 = None if ref is None else conventional_mamba2_step_ref(
            ref, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb)
        fe = mamba2_frontend_ref(x, dt, A, Bm, C, dtb)[:4]
        post = lambda yy, rows: mamba2_post_ref(yy, x[rows], D, z[rows])  # noqa: E731
    assert y is out and torch.isfinite(y).all()
    return y, y2, fe, post


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_conventional_step_matches_reference(kind, fmt, rounding):
    N, HK, H, dk, dv = 4, 1, 2, 32, 16
    idx = torch.tensor([2, -1, 0, 3, 1])                   # odd batch, one padding row
    init = random_state(N, H, dv, dk, seed=11)
    store = ConventionalStore.from_state(init, fmt, rounding, seed=5, layer=2)
    ref = store.clone()
    for step in range(3):
        y, y2, _, _ = _step(kind, store, ref, 5, HK, H, dk, dv, idx, seed=100 + step)
        assert (y[1] == 0).all()                           # padding row: output zero
        # after a rounding flip of the stored state (one grid step) outputs differ a little
        tol = 1e-5 if fmt == "fp32" else 1e-3
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
    assert torch.equal(store.n_flush, ref.n_flush)
    assert store.n_flush.tolist() == [3, 3, 3, 3]
    assert_states_close(store.state.dequantize(), ref.state.dequantize())


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", ["s32_rs", "s16_sr", "sbf16", "f4_sr_rs"])
def test_conventional_step_matches_conventional_state(kind, pair):
    """Against replayquant.replay.ConventionalState (batch rows permuted onto slots)."""
    from replayquant.pairs import PrecisionPair
    N, HK, H, dk, dv = 4, 1, 2, 32, 32
    P = PrecisionPair.load(pair)
    idx = torch.tensor([3, 0, -1, 1, 2])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    init = random_state(N, H, dv, dk, seed=3)
    store = ConventionalStore.from_state(init, P.anchor.format, P.anchor.rounding, seed=9)
    cs = ConventionalState(init, P, delta=kind == "gdn", seed=9)
    for step in range(5):
        y, _, fe, post = _step(kind, store, None, 5, HK, H, dk, dv, idx, seed=step)
        yr = cs.step(*[t[perm] for t in fe])
        if post is not None:
            yr = post(yr, perm)
        tol = 1e-5 if pair == "s32_rs" else 1e-3
        torch.testing.assert_close(y[perm], yr, rtol=tol, atol=tol * yr.abs().max().item())
    assert_states_close(store.state.dequantize(), cs.anchor())


def test_conventional_groups_and_blocks():
    """GDN with 2 key heads for 4 value heads, several row blocks per matrix (block_v < d_v)."""
    N, HK, H, dk, dv = 3, 2, 4, 16, 32
    init = random_state(N, H, dv, dk, seed=1)
    store = ConventionalStore.from_state(init, "fp32")
    ref = store.clone()
    q, k, v, a, b = gdn_step_inputs(3, HK, H, dk, dv, seed=4)
    A_log, dtb = gdn_params(H, 4)
    with override_conventional_launch(block_v=16):
        y = conventional_gdn_step(store, q, k, v, a, b, A_log, dtb)
    y2 = conventional_gdn_step_ref(ref, q, k, v, a, b, A_log, dtb)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(store.state.payload, ref.state.payload, rtol=1e-5, atol=1e-6)


def test_conventional_bad_inputs():
    store = ConventionalStore.from_state(random_state(2, 2, 16, 16), "fp16")
    q, k, v, a, b = gdn_step_inputs(2, 1, 2, 16, 16)
    A_log, dtb = gdn_params(2)
    with pytest.raises(ValueError, match="v has shape"):
        conventional_gdn_step(store, q, k, v[:, :, :8], a, b, A_log, dtb)
    with pytest.raises(ValueError, match="state_indices"):
        conventional_gdn_step(store, q, k, v, a, b, A_log, dtb, state_indices=torch.zeros(3))
    with pytest.raises(ValueError, match="block_v"), override_conventional_launch(block_v=12):
        conventional_gdn_step(store, q, k, v, a, b, A_log, dtb)
    with pytest.raises(ValueError, match="unknown state format"):
        ConventionalStore.from_state(random_state(2, 2, 16, 16), "int4")
    with pytest.raises(ValueError, match="power of two"):
        ConventionalStore.from_state(random_state(2, 2, 24, 16), "fp32")


def _clamping_limit(dt, dtb):
    """A dt_limit (lo, hi) that clamps some softplus(dt + dt_bias) entries from each side."""
    d = torch.nn.functional.softplus(dt.float() + dtb.float())
    lo, hi = d.quantile(0.3).item(), d.quantile(0.7).item()
    assert (d < lo).any() and (d > hi).any()
    return lo, hi


@pytest.mark.parametrize("fmt,pair", [("fp32", "s32_rs"), ("bf16", "sbf16")])
def test_conventional_mamba2_dt_limit(fmt, pair):
    """dt_limit (Nemotron-H's time_step_limit): kernel == reference == ConventionalState fed
    replay.frontends.mamba2_inputs with the same limit; the limit changes the outputs; (0, inf)
    is the kernel without a limit, bit for bit; a malformed limit is a ValueError."""
    from replayquant.kernels.conventional.reference import conventional_mamba2_verify_ref
    from replayquant.kernels.conventional.verify import conventional_mamba2_verify
    from replayquant.replay.stores import make_snapshots
    from replayquant.pairs import PrecisionPair
    from replayquant.replay import mamba2_inputs
    N, G, H, dk, dv = 3, 1, 2, 16, 16
    P = PrecisionPair.load(pair)
    idx = torch.tensor([1, -1, 0, 2])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    init = random_state(N, H, dv, dk, seed=7)
    store = ConventionalStore.from_state(init, P.anchor.format, P.anchor.rounding, seed=4)
    assert P.anchor.format == fmt
    ref, plain = store.clone(), store.clone()
    cs = ConventionalState(init, P, delta=False, seed=4)
    A, D, dtb = mamba2_params(H, 3)
    for step in range(3):
        x, dt, Bm, C, z = mamba2_step_inputs(4, G, H, dk, dv, seed=30 + step)
        lim = _clamping_limit(dt, dtb)
        y = conventional_mamba2_step(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                     dt_bias=dtb, out=poisoned(4, H, dv), dt_limit=lim)
        y2 = conventional_mamba2_step_ref(ref, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                          dt_bias=dtb, dt_limit=lim)
        yp = conventional_mamba2_step(plain, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                      dt_bias=dtb)
        fe = mamba2_inputs(x, dt, A, Bm, C, dtb, dt_limit=lim)
        yr = mamba2_post_ref(cs.step(*[t[perm] for t in fe]), x[perm], D, z[perm])
        assert (y[1] == 0).all() and torch.isfinite(y).all()
        tol = 1e-5 if fmt == "fp32" else 1e-3
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
        torch.testing.assert_close(y[perm], yr, rtol=tol, atol=tol * yr.abs().max().item())
        assert (y - yp).abs().max() > 10 * tol * y2.abs().max()          # the clamp mattered
    assert_states_close(store.state.dequantize(), ref.state.dequantize())
    assert_states_close(store.state.dequantize(), cs.anchor())

    # verify (T = 2 drafts) with the limit: kernel == reference
    x, dt, Bm, C, z = mamba2_step_inputs(4, G, H, dk, dv, T=2, seed=40)
    lim = _clamping_limit(dt, dtb)
    snaps, snaps_r = make_snapshots(store, 2), make_snapshots(ref, 2)
    yv = conventional_mamba2_verify(store, snaps, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                    dt_bias=dtb, out=torch.full((4, 2, H, dv), float("nan")),
                                    dt_limit=lim)
    yv2 = conventional_mamba2_verify_ref(ref, snaps_r, x, dt, A, Bm, C, state_indices=idx, D=D,
                                         z=z, dt_bias=dtb, dt_limit=lim)
    tol = 1e-5 if fmt == "fp32" else 1e-3
    torch.testing.assert_close(yv, yv2, rtol=tol, atol=tol * yv2.abs().max().item())

    # no limit: bit for bit the kernel without the argument
    a, b = store.clone(), store.clone()
    x, dt, Bm, C, z = mamba2_step_inputs(4, G, H, dk, dv, seed=50)
    ya = conventional_mamba2_step(a, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb)
    yb = conventional_mamba2_step(b, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb,
                                  dt_limit=(0.0, float("inf")))
    assert torch.equal(ya, yb) and torch.equal(a.state.payload, b.state.payload)
    for bad in ((1.0, 0.5), (0.1,), "x", (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="dt_limit"):
            conventional_mamba2_step(a, x, dt, A, Bm, C, dt_bias=dtb, state_indices=idx,
                                     dt_limit=bad)


# ------------------------------------------------------------------ KDA (per-channel gates)

@pytest.mark.parametrize("fmt,rounding", [("fp32", "nearest"), ("bf16", "stochastic"),
                                          ("fp8", "nearest"), ("nvfp4", "stochastic")])
def test_conventional_kda_step_matches_reference(fmt, rounding):
    """KDA step kernel == its torch reference (3 steps, odd batch with a padding row, channels
    that forget within a step beside ones that hardly do)."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 16
    idx = torch.tensor([2, -1, 0, 3, 1])
    store = ConventionalStore.from_state(random_state(N, H, dv, dk, seed=13), fmt, rounding,
                                         seed=5, layer=2)
    ref = store.clone()
    for step in range(3):
        q, k, v, g, beta = kda_step_inputs(5, HK, H, dk, dv, seed=200 + step)
        y = conventional_kda_step(store, q, k, v, g, beta, state_indices=idx, out=poisoned(5, H, dv))
        y2 = conventional_kda_step_ref(ref, q, k, v, g, beta, state_indices=idx)
        assert (y[1] == 0).all() and torch.isfinite(y).all()
        tol = 1e-5 if fmt == "fp32" else 1e-3
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
    assert torch.equal(store.n_flush, ref.n_flush) and store.n_flush.tolist() == [3, 3, 3, 3]
    assert_states_close(store.state.dequantize(), ref.state.dequantize())


@pytest.mark.parametrize("pair", ["s32_rs", "f4_sr_rs"])
def test_conventional_kda_step_matches_conventional_state(pair):
    """Against ConventionalState(vector_gate=True) fed the model path's front end
    (replay.kda_inputs, which kda_frontend_ref equals bit for bit; batch rows permuted onto
    slots); with s32_rs also against the float64 recurrence."""
    from replayquant.pairs import PrecisionPair
    from replayquant.replay import kda_inputs, recurrent_reference
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    P = PrecisionPair.load(pair)
    idx = torch.tensor([2, 0, -1, 1])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    init = random_state(N, H, dv, dk, seed=3)
    store = ConventionalStore.from_state(init, P.anchor.format, P.anchor.rounding, seed=9)
    cs = ConventionalState(init, P, delta=True, seed=9, vector_gate=True)
    steps = [kda_step_inputs(4, HK, H, dk, dv, seed=300 + t) for t in range(4)]
    ys = []
    for q, k, v, g, beta in steps:
        y = conventional_kda_step(store, q, k, v, g, beta, state_indices=idx)
        fe = [t[perm] for t in kda_inputs(q, k, v, g, beta=beta)]
        assert all(torch.equal(a[perm], b) for a, b in zip(kda_frontend_ref(q, k, v, g, beta), fe))
        yr = cs.step(*fe)
        tol = 1e-5 if pair == "s32_rs" else 1e-3
        torch.testing.assert_close(y[perm], yr, rtol=tol, atol=tol * yr.abs().max().item())
        ys.append((y[perm], fe))
    assert_states_close(store.state.dequantize(), cs.anchor())
    if pair == "s32_rs":
        fe = [torch.stack([f[i] for _, f in ys], 1) for i in range(5)]
        Y, S = recurrent_reference(init, *fe, dtype=torch.float64)
        y = torch.stack([y for y, _ in ys], 1)
        assert ((y.double() - Y).abs().max() / Y.abs().max()).item() <= 2e-6
        assert ((store.state.dequantize().double() - S).abs().max() / S.abs().max()).item() <= 2e-6


def test_conventional_kda_constant_gate_equals_gdn():
    """A KDA gate that is the same on every channel is the GDN step: the KDA kernel fed GDN's
    g (expanded over d_k) and sigmoid(b) gives the GDN kernel's outputs and state (FP32; 2 key
    heads for 4 value heads)."""
    N, HK, H, dk, dv = 3, 2, 4, 16, 16
    init = random_state(N, H, dv, dk, seed=2)
    a_st = ConventionalStore.from_state(init, "fp32")
    b_st = a_st.clone()
    for step in range(2):
        q, k, v, a, b = gdn_step_inputs(N, HK, H, dk, dv, seed=400 + step)
        A_log, dtb = gdn_params(H, 4)
        _, _, _, g, beta = gdn_frontend_ref(q, k, v, a, b, A_log, dtb)
        y1 = conventional_gdn_step(a_st, q, k, v, a, b, A_log, dtb)
        y2 = conventional_kda_step(b_st, q, k, v, g[..., None].expand(-1, -1, dk), beta)
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b_st.state.payload, a_st.state.payload, rtol=1e-5, atol=1e-6)


def test_conventional_kda_bad_inputs():
    store = ConventionalStore.from_state(random_state(2, 2, 16, 16), "fp16")
    q, k, v, g, beta = kda_step_inputs(2, 1, 2, 16, 16)
    for fn in (conventional_kda_step, conventional_kda_step_ref):
        with pytest.raises(ValueError, match=r"g has shape \(2, 2\), expected \(2, 2, 16\)"):
            fn(store, q, k, v, g[..., 0], beta)
        with pytest.raises(ValueError, match="beta has shape"):
            fn(store, q, k, v, g, beta[:, :1])
        with pytest.raises(ValueError, match="KDA needs g"):
            fn(store, q, k, v, None, beta)
