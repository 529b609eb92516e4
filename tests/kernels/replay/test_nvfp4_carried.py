"""An NVFP4 read copy cast with a global scale carried from the previous flush
(`ReplayStore.from_state(..., nvfp4_scale='carried')`, docs/kernels.md): flush tiles of 16 rows
cast it alone. Tied to the format's own cast: after every flush the read copy is, bit for bit,
`formats.casts.nvfp4_quantize_ref` of the FP32 anchor (the unrounded state) with the power of
two `nvfp4_carried_scale_ref` makes of the previous flush's anchor amax."""

import pytest
import torch

from replayquant.formats.casts import nvfp4_carried_scale_ref, nvfp4_quantize_ref
from replayquant.kernels.replay.launch import override_replay_launch, replay_launch_config
from replayquant.policy import resolve_pair
from replayquant.replay.stores import ReplayStore
from replayquant.testing import random_state
from _helpers import assert_same_store, assert_states_close
from test_kernel_replay import Driver, poison_buffers, staggered_slots


def test_carried_scale_is_the_least_power_of_two_with_headroom():
    """gs = the least power of two with 2688 gs >= 2 amax (at least 2^-126), 1 for amax 0."""
    g = torch.Generator().manual_seed(4)
    a = torch.rand(4096, generator=g) * torch.exp(torch.randn(4096, generator=g) * 12)
    a = torch.cat([a, torch.tensor([0.0, 1e-42, 2688.0 / 2, 1344.0 * 1.5, 3e38])])
    gs = nvfp4_carried_scale_ref(a).double()
    assert ((gs.log2() == gs.log2().round())).all()
    ok = 2688 * gs >= 2 * a.double()
    least = (2688 * gs / 2 < 2 * a.double()) | (gs == 2.0 ** -126) | (a == 0)
    assert (ok & least).all() and gs[a == 0].eq(1).all()


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_carried_read_copy_is_the_format_cast_of_the_anchor(kind):
    """GDN and Mamba-2 tp4_hi32, d_v = 32 (two 16-row flush tiles a matrix), L = 3, rows out of
    phase, a padding row, a forced flush, poisoned buffers and outputs: the two launches and
    the flush inside the read's tiles ({'fused': 'read'}) give the same store bit for bit; after
    each flush, in the kernel's store and the reference's, the read copy is the format's cast of
    the anchor with the carried scale and the record holds the anchor's amax; the outputs and
    read copies of kernel and reference agree within float32 reassociation (outputs within 1%
    of the largest: 2% of them differ by more than 1e-3 relative, the NVFP4 copy's products
    summed in another order). A matrix whose recorded amax was made 64x smaller saturates at its
    next flush, as the format's cast with that scale does, and `saturated()` says so."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 32
    dr = Driver(kind, 5, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=8)
    store = ReplayStore.from_state(init, resolve_pair("tp4_hi32", 3), kind, key_heads=HK,
                                   seed=2, nvfp4_scale="carried")
    assert replay_launch_config(store, "flush")[0] == 16
    poison_buffers(store)
    fz, ref = store.clone(), store.clone()
    amax = {id(st): init.abs().amax(dim=(-2, -1)) for st in (store, ref)}   # previous flush's
    flushed = 0
    for step in range(7):
        idx = staggered_slots(step)
        inp = dr.inputs(seed=80 + step)
        path = "flush" if step == 5 else "replay"
        if step == 5:           # slot 0's last amax 64x smaller: its next flush saturates
            for st in (store, ref):
                amax[id(st)][0] = amax[id(st)][0] / 64
            for st, a in ((store, amax[id(store)]), (fz, amax[id(store)]), (ref, amax[id(ref)])):
                e = int(st.n_flush[0]) % 3
                st.carried[0, :, e] = (st.carried[0, :, e] >> 32 << 32) | \
                    a[0].view(torch.int32).to(torch.int64)
        before = store.n_flush.clone()
        y = dr.kernel(store, inp, idx, path=path)
        with override_replay_launch({"fused": "read"}):
            assert torch.equal(dr.kernel(fz, inp, idx, path=path), y)
        assert_same_store(fz, store)
        y2 = dr.ref(ref, inp, idx, path=path)       # float32 reassociation: within 1% of the
        torch.testing.assert_close(y, y2, rtol=0, atol=1e-2 * y2.abs().max().item())   # largest
        assert torch.equal(store.n_flush, ref.n_flush)
        for s in (store.n_flush != before).nonzero().flatten().tolist():
            for st in (store, ref):
                _assert_format_cast(st, s, amax[id(st)])
            flushed += 1
        if step == 5:           # every slot flushed; slot 0 outgrew its scale, as the format says
            for st in (store, ref):
                assert st.saturated().tolist() == [[True] * H] + [[False] * H] * (N - 1)
    assert flushed >= 8 and store.n_flush.min() >= 2
    assert_states_close(store.read.dequantize(), ref.read.dequantize())


def _assert_format_cast(st, s, amax):
    """Slot s just flushed: its read copy is the format's cast of its FP32 anchor with the scale
    carried from amax[s] (the previous flush's), the record holds this flush's amax; amax[s]
    moves on."""
    S = st.anchor.dequantize([s])[0]
    pay, bs, g = nvfp4_quantize_ref(S, gs=nvfp4_carried_scale_ref(amax[s]))
    assert torch.equal(st.read.payload[s], pay) and torch.equal(st.read.scale[s], bs)
    assert torch.equal(st.read.gscale[s], g)
    f = int(st.n_flush[s])
    rec = st.carried[s, :, f % 3]
    assert torch.equal(rec >> 32, torch.full_like(rec, f))
    amax[s] = S.abs().amax(dim=(-2, -1))
    assert torch.equal((rec & 0xFFFFFFFF).to(torch.int32).view(torch.float32), amax[s])


def test_carried_scale_takes_an_nvfp4_read_copy_beside_another_anchor():
    x = random_state(2, 1, 16, 16)
    for pair in ("s32_rs", "f4_sr_rs"):
        with pytest.raises(ValueError, match="an NVFP4 read copy beside an anchor"):
            ReplayStore.from_state(x, resolve_pair(pair), "gdn", nvfp4_scale="carried")
    with pytest.raises(ValueError, match="torch engine"):
        ReplayStore.from_state(x, resolve_pair("tp4_hi32"), "gdn", nvfp4_scale="carried",
                               ring_dtype=torch.float32)
    with pytest.raises(ValueError, match="'matrix' or 'carried'"):
        ReplayStore.from_state(x, resolve_pair("tp4_hi32"), "gdn", nvfp4_scale="amax")


def test_carried_preflush_inside_the_one_pass_verify():
    """GDN tp4_hi32 with a carried scale, rounds of T = 3 drafts (L = 4) whose rows pre-flush
    or not, a padding row: the one-pass verify with its pre-flushes inside its read program
    ({'fused': 'read'}) gives the flush launch's outputs and store bit for bit, and each
    pre-flush leaves the format's cast of the anchor with the carried scale. Then a forced step
    on full windows (a pre-flush and a flush in one launch), after the last flush's recorded
    amax was made 16x larger: the flush casts with the scale of that amax, not its own launch's
    pre-flush's, in the kernel and the reference (it fails when the kernel's or the reference's
    flush takes the pre-flush's)."""
    from replayquant.kernels.replay.verify import replay_accept, replay_gdn_verify
    from test_kernel_verify_onepass import _inputs
    HK, H, B, dk, dv, L, T = 1, 2, 3, 32, 32, 4, 3
    idx = torch.tensor([2, 0, -1, 3])
    init = random_state(B + 1, H, dv, dk, seed=6)
    st = ReplayStore.from_state(init, resolve_pair("tp4_hi32", L), "gdn", key_heads=HK, seed=5,
                                max_drafts=T, nvfp4_scale="carried")
    amax = init.abs().amax(dim=(-2, -1))             # the previous flush's, per slot and head
    pre = 0
    for rnd in range(5):
        kw = _inputs("gdn", HK, H, dk, dv, B + 1, T, torch.bfloat16, seed=3 * rnd + 1)
        one, before = st.clone(), st.n_flush.clone()
        with override_replay_launch({"fused": "read"}):
            y1 = replay_gdn_verify(one, **kw, state_indices=idx,
                                   out=torch.full((B + 1, T, H, dv), float("nan")))
        with override_replay_launch({"fused": False}):
            y0 = replay_gdn_verify(st, **kw, state_indices=idx)
        assert torch.equal(y1, y0)
        assert_same_store(one, st)
        for s in (st.n_flush != before).nonzero().flatten().tolist():
            _assert_format_cast(st, s, amax)
            pre += 1
        n = torch.tensor([T, 1, 0, 2]).roll(rnd)
        replay_accept(st, n, idx)
    assert pre >= 3
    # a forced step on full windows: its pre-flush and its flush in one launch, the flush taking
    # the scale of the flush before that launch (stores.ReplayStore.carried), as the reference
    assert (st.committed == L).any(), st.committed
    for s in range(B + 1):      # the last flush's amax 16x larger: a scale its pre-flush won't give
        e = int(st.n_flush[s]) % 3
        amax[s] = amax[s] * 16
        st.carried[s, :, e] = (st.carried[s, :, e] >> 32 << 32) | \
            amax[s].view(torch.int32).to(torch.int64)
    ref, before = st.clone(), st.n_flush.clone()
    dr = Driver("gdn", B + 1, HK, H, dk, dv)
    inp = dr.inputs(seed=5)
    y = dr.kernel(st, inp, idx, path="flush")
    y2 = dr.ref(ref, inp, idx, path="flush")
    torch.testing.assert_close(y, y2, rtol=0, atol=1e-2 * y2.abs().max().item())
    assert torch.equal(st.n_flush, ref.n_flush) and (st.n_flush - before).max() == 2
    for s in (st.n_flush != before).nonzero().flatten().tolist():
        for one in (st, ref):
            _assert_format_cast(one, s, amax.clone())


def test_carried_kda_read_copy_is_the_format_cast():
    """KDA tp4_hi32 with a carried scale (a gate per key channel; the same flush tiles), d_v = 32,
    L = 3, a padding row: after each flush the read copy of the kernel's store and of the
    reference's is the format's cast of its anchor with the carried scale; outputs within 1% of
    the largest."""
    from replayquant.kernels.replay.decode import replay_kda_step
    from replayquant.kernels.replay.reference import replay_kda_step_ref
    from replayquant.testing import kda_step_inputs
    N, HK, H, dk, dv = 3, 1, 2, 32, 32
    init = random_state(N, H, dv, dk, seed=4)
    st = ReplayStore.from_state(init, resolve_pair("tp4_hi32", 3), "kda", key_heads=HK, seed=4,
                                nvfp4_scale="carried")
    poison_buffers(st)
    ref = st.clone()
    amax = {id(x): init.abs().amax(dim=(-2, -1)) for x in (st, ref)}
    idx = torch.tensor([2, -1, 0, 1])
    flushed = 0
    for step in range(5):
        q, k, v, g, beta = kda_step_inputs(4, HK, H, dk, dv, seed=30 + step)
        before = st.n_flush.clone()
        y = replay_kda_step(st, q, k, v, g, beta, state_indices=idx,
                            out=torch.full((4, H, dv), float("nan")))
        y2 = replay_kda_step_ref(ref, q, k, v, g, beta, state_indices=idx)
        torch.testing.assert_close(y, y2, rtol=0, atol=1e-2 * y2.abs().max().item())
        for s in (st.n_flush != before).nonzero().flatten().tolist():
            for x in (st, ref):
                _assert_format_cast(x, s, amax[id(x)])
            flushed += 1
    assert flushed == N
