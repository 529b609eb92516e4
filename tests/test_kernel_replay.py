"""Replay decode step (Triton, interpreter) against its torch reference and against ReplayState,
over many steps across several flushes: every shipped pair, GDN and Mamba-2, odd batch sizes,
padding rows, SR, poisoned outputs and poisoned (never-read) buffer entries."""

import pytest
import torch

from replayquant.bench.inputs import (gdn_params, gdn_step_inputs, mamba2_params,
                                      mamba2_step_inputs, random_state)
from replayquant.kernels.conventional import (ConventionalStore, conventional_gdn_step,
                                              conventional_mamba2_step, gdn_frontend_ref,
                                              launch_config, mamba2_frontend_ref, mamba2_post_ref)
from replayquant.kernels import replay_decode as rd
from replayquant.kernels.replay_decode import (ReplayStore, advance_pointers, choose_launch,
                                               choose_path, resolve_launch, resolve_read_variant,
                                               resolve_path, replay_gdn_step,
                                               replay_gdn_step_ref, replay_mamba2_step,
                                               replay_mamba2_step_ref, replay_launch_config,
                                               DOTS_BLOCK, VERIFY_BLOCK_DEFAULT, FLUSH_BLOCK)
from replayquant.pairs import PrecisionPair, list_pairs
from replayquant.replay import ReplayState
from _helpers import assert_states_close

PAIRS = ["s32_rs", "s16_sr", "sbf16", "tp8_hi32", "tp4_hi32", "tp8_hi16_sr", "tp4_hi16_sr",
         "f4_sr_rs"]


def _tol(pair):
    """Output tolerance: FP32 reassociation, or one grid step of a low-precision copy where the
    tiny difference of an unrounded state crossed a rounding boundary."""
    fp32 = pair.read_spec.format == "fp32" and pair.anchor.format == "fp32"
    return 1e-5 if fp32 else 1e-3


def poison_buffers(store):
    """Buffer entries are never read before they are written: NaN everywhere must not leak."""
    for t in (store.kbuf, store.vbuf, store.ubuf, store.Gbuf, store.bbuf):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


def assert_same_store(a, b):
    """Bit-identical stores (pointers, both roles, buffers; NaN-poisoned entries where both
    are), and the fused launch's arrival counters back at zero."""
    for name in ("committed", "n_flush", "start"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for role in ("anchor", "read"):
        ra, rb = getattr(a, role), getattr(b, role)
        if ra is not None:
            for t in ("payload", "scale", "gscale"):
                if getattr(ra, t, None) is not None:
                    assert torch.equal(getattr(ra, t).view(torch.uint8),
                                       getattr(rb, t).view(torch.uint8)), (role, t)
    for name in ("kbuf", "vbuf", "ubuf", "Gbuf", "bbuf"):
        ta, tb = getattr(a, name), getattr(b, name)
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), name
    assert a.arrive is None or not a.arrive.any()


class Driver:
    """Runs one step of either kind on the kernel and (optionally) the reference."""

    def __init__(self, kind, B, HK, H, dk, dv):
        self.kind, self.B, self.HK, self.H, self.dk, self.dv = kind, B, HK, H, dk, dv

    def inputs(self, seed):
        if self.kind == "gdn":
            return gdn_step_inputs(self.B, self.HK, self.H, self.dk, self.dv, seed=seed) \
                + gdn_params(self.H, seed)
        x, dt, Bm, C, z = mamba2_step_inputs(self.B, self.HK, self.H, self.dk, self.dv, seed=seed)
        A, D, dtb = mamba2_params(self.H, seed)
        return x, dt, A, Bm, C, D, z, dtb

    def step(self, fn, store, inp, idx, out=None, path="replay", **kw):
        if self.kind == "gdn":
            q, k, v, a, b, A_log, dtb = inp
            return fn(store, q, k, v, a, b, A_log, dtb, state_indices=idx, out=out, path=path,
                      **kw)
        x, dt, A, Bm, C, D, z, dtb = inp
        return fn(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb, out=out,
                  path=path, **kw)

    def kernel(self, store, inp, idx, path="replay", **kw):
        out = torch.full((self.B, self.H, self.dv), float("nan"))
        fn = replay_gdn_step if self.kind == "gdn" else replay_mamba2_step
        y = self.step(fn, store, inp, idx, out=out, path=path, **kw)
        assert y is out and torch.isfinite(y).all()
        return y

    def ref(self, store, inp, idx, path="replay"):
        fn = replay_gdn_step_ref if self.kind == "gdn" else replay_mamba2_step_ref
        return self.step(fn, store, inp, idx, path=path)

    def core_inputs(self, inp):
        """(q, k, v, log_a[, beta]) for ReplayState and the post-processing of y."""
        if self.kind == "gdn":
            q, k, v, a, b, A_log, dtb = inp
            return gdn_frontend_ref(q, k, v, a, b, A_log, dtb), None
        x, dt, A, Bm, C, D, z, dtb = inp
        return mamba2_frontend_ref(x, dt, A, Bm, C, dtb)[:4], \
            (lambda y, rows: mamba2_post_ref(y, x[rows], D, z[rows]))


def test_shipped_pairs_are_covered():
    assert set(PAIRS) == set(list_pairs())


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", PAIRS)
def test_replay_step_matches_reference(kind, pair):
    """5 steps with L = 3 (an in-kernel flush per row, slot 3 a step after the others: rows of
    different phase), padding rows, poisoned buffers and outputs; the split launch (flush, read
    and pointer kernels) against the reference, the one-launch path (launch='fused') bit for bit
    against the split launch."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 16
    dr = Driver(kind, 5, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=21)
    store = ReplayStore.from_state(init, pair, kind, key_heads=HK, seed=13, layer=1,
                                   buffer_len=3, u_dtype=torch.float32)
    poison_buffers(store)
    ref, fused = store.clone(), store.clone()
    idx = torch.tensor([2, -1, 0, 3, 1])
    for step in range(5):
        if step == 2:                                  # put slot 3 out of phase
            idx = torch.tensor([2, -1, 0, -1, 1])
        if step == 3:
            idx = torch.tensor([2, 3, 0, -1, 1])
        inp = dr.inputs(seed=step)
        y = dr.kernel(store, inp, idx, launch="split")
        y2 = dr.ref(ref, inp, idx)
        assert (y[idx < 0] == 0).all()
        tol = _tol(PrecisionPair.load(pair))
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
        assert torch.equal(store.committed, ref.committed)
        assert torch.equal(store.n_flush, ref.n_flush)
        assert torch.equal(dr.kernel(fused, inp, idx, launch="fused"), y)
        assert_same_store(fused, store)
    assert store.n_flush.tolist() == [1, 1, 1, 1] and store.committed.tolist() == [2, 2, 2, 1]
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    assert_states_close(store.read_role.dequantize(), ref.read_role.dequantize())
    for name in ("kbuf", "vbuf"):       # raw inputs: bit-identical entries
        a, b = getattr(store, name), getattr(ref, name)
        live = torch.isfinite(b.float())
        assert torch.equal(torch.isfinite(a.float()), live) and torch.equal(a[live], b[live])


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32", "tp4_hi16_sr", "f4_sr_rs"])
def test_replay_step_matches_replay_state(kind, pair):
    """The specification: ReplayState fed the same front-end tensors (rows = state slots)."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 16
    P = PrecisionPair.load(pair).with_buffer_len(4)
    dr = Driver(kind, 5, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=5)
    store = ReplayStore.from_state(init, P, kind, key_heads=HK, seed=3, u_dtype=torch.float32)
    rs = ReplayState(init, P, delta=kind == "gdn", seed=3)
    idx = torch.tensor([2, -1, 0, 3, 1])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    for step in range(9):
        inp = dr.inputs(seed=50 + step)
        y = dr.kernel(store, inp, idx)
        fe, post = dr.core_inputs(inp)
        yr = rs.step(*[t[perm] for t in fe])
        if post is not None:
            yr = post(yr, perm)
        torch.testing.assert_close(y[perm], yr, rtol=_tol(P), atol=_tol(P) * yr.abs().max().item())
    assert store.committed.tolist() == rs.committed.tolist()
    assert store.n_flush.tolist() == rs.flushes.tolist() == [2] * 4
    assert_states_close(store.anchor.dequantize(), rs.anchor())
    assert_states_close(store.read_role.dequantize(), rs.read_copy())


@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32"])
def test_gdn_fold_strong_decay(pair):
    """The GDN flush fold with strong decays against ReplayState: heads whose log gates fall
    ~60, ~8 and ~0.1 per step, so that exp(-G) over a buffer is far past float32 (a fold that
    defers its decay must rescale in time)."""
    N, HK, H, dk, dv = 3, 1, 3, 16, 16
    P = PrecisionPair.load(pair).with_buffer_len(6)
    dr = Driver("gdn", N, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=8)
    store = ReplayStore.from_state(init, P, "gdn", key_heads=HK, seed=3, u_dtype=torch.float32)
    rs = ReplayState(init, P, delta=True, seed=3)
    idx = torch.tensor([1, 0, 2])
    perm = idx.argsort()
    A_log = torch.tensor([4.5, 2.5, -2.0])
    glog = []
    for step in range(13):
        q, k, v, a, b, _, dtb = dr.inputs(seed=90 + step)
        inp = (q, k, v, a.abs() + 1.0, b, A_log, dtb)
        y = dr.kernel(store, inp, idx)
        fe, _ = dr.core_inputs(inp)
        glog.append(fe[3][0])
        yr = rs.step(*[t[perm] for t in fe])
        torch.testing.assert_close(y[perm], yr, rtol=_tol(P), atol=_tol(P) * yr.abs().max().item())
    g = torch.stack(glog)                         # [steps, H] log gates of row 0
    assert (g[:, 0] < -40).all() and (g[:, 1] < -4).all() and (g[:, 2] > -1).all()
    assert store.n_flush.tolist() == rs.flushes.tolist() == [2] * N
    assert_states_close(store.anchor.dequantize(), rs.anchor())
    assert_states_close(store.read_role.dequantize(), rs.read_copy())


def test_replay_bf16_u_buffer_against_reference():
    """Default buffer precision (u in bf16): the reference models the bf16 storage of u."""
    N, HK, H, dk, dv = 3, 1, 2, 32, 16
    dr = Driver("gdn", 3, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk), "tp4_hi32", "gdn", key_heads=HK,
                                   buffer_len=4)
    assert store.ubuf.dtype == torch.bfloat16
    ref = store.clone()
    for step in range(6):
        inp = dr.inputs(seed=step)
        y, y2 = dr.kernel(store, inp, None), dr.ref(ref, inp, None)
        # a one-ulp bf16 difference of a cached u moves an output by ~2^-8 of that term
        torch.testing.assert_close(y, y2, rtol=2e-2, atol=2e-2 * y2.abs().max().item())
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_L1_shared_fp32_equals_conventional_bitwise(kind):
    """DESIGN invariant 1 for the kernels: L = 1, shared FP32 is the conventional kernel."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver(kind, 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=8)
    store = ReplayStore.from_state(init, "s32_rs", kind, key_heads=HK, buffer_len=1)
    conv = ConventionalStore.from_state(init, "fp32")
    for step in range(3):
        inp = dr.inputs(seed=step)
        y = dr.kernel(store, inp, None)
        if kind == "gdn":
            q, k, v, a, b, A_log, dtb = inp
            yc = conventional_gdn_step(conv, q, k, v, a, b, A_log, dtb)
        else:
            x, dt, A, Bm, C, D, z, dtb = inp
            yc = conventional_mamba2_step(conv, x, dt, A, Bm, C, D=D, z=z, dt_bias=dtb)
        assert torch.equal(y, yc)
    assert torch.equal(store.anchor.payload, conv.state.payload)


def test_flush_path_equals_conventional_with_sr():
    """path='flush' (the small-batch dispatch): every step flushes; with a shared SR pair this
    is the conventional read-modify-write, bit for bit (same SR streams)."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver("gdn", 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=2)
    store = ReplayStore.from_state(init, "s16_sr", "gdn", key_heads=HK, seed=4)
    conv = ConventionalStore.from_state(init, "fp16", "stochastic", seed=4)
    for step in range(3):
        inp = dr.inputs(seed=step)
        y = dr.kernel(store, inp, None, path="flush")
        q, k, v, a, b, A_log, dtb = inp
        assert torch.equal(y, conventional_gdn_step(conv, q, k, v, a, b, A_log, dtb))
    assert torch.equal(store.anchor.payload, conv.state.payload)
    assert store.committed.tolist() == [0, 0, 0] and store.n_flush.tolist() == [3, 3, 3]


def test_flush_path_mid_window_and_blocks():
    """A forced flush with entries pending folds them (rebuild); several row blocks per matrix."""
    N, HK, H, dk, dv = 2, 2, 4, 16, 32
    dr = Driver("gdn", 2, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk), "tp8_hi32", "gdn", key_heads=HK,
                                   buffer_len=8, u_dtype=torch.float32)
    ref = store.clone()
    for step, path in enumerate(["replay", "replay", "flush", "replay"]):
        inp = dr.inputs(seed=step)
        out = torch.full((2, H, dv), float("nan"))
        fn_in = inp
        y = replay_gdn_step(store, *fn_in[:5], *fn_in[5:], out=out, path=path, block_v=16)
        y2 = dr.ref(ref, inp, None, path=path)
        torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5 * y2.abs().max().item())
    assert store.committed.tolist() == [1, 1] and store.n_flush.tolist() == [1, 1]
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


def test_dispatcher():
    assert choose_path("gdn", 1) == "flush"
    assert choose_path("gdn", 256) == "replay"
    assert choose_path("gdn", 1, shared=False) == "replay"
    assert choose_path("mamba2", 3, threshold=4) == "flush"
    mk = lambda pair: ReplayStore.from_state(random_state(2, 2, 16, 16), pair, "gdn",  # noqa: E731
                                             key_heads=1, buffer_len=4)
    # 'auto' (default) switches only where lossless: shared FP32 anchor
    assert resolve_path(mk("s32_rs"), 2) == "flush" and resolve_path(mk("s32_rs"), 512) == "replay"
    for pair in ("s16_sr", "f4_sr_rs", "tp4_hi32", "tp8_hi32"):
        assert resolve_path(mk(pair), 2) == "replay", pair
    assert resolve_path(mk("f4_sr_rs"), 2, "auto_lossy") == "flush"
    assert resolve_path(mk("tp4_hi32"), 2, "auto_lossy") == "replay"
    assert resolve_path(mk("tp4_hi32"), 2, "flush") == "flush"
    store = mk("s32_rs")
    dr = Driver("gdn", 2, 1, 2, 16, 16)
    dr.kernel(store, dr.inputs(0), None, path="auto")
    assert store.committed.tolist() == [0, 0] and store.n_flush.tolist() == [1, 1]


def test_auto_default_small_batch_s32_rs():
    """Default path at small batch: s32_rs flushes every step (= conventional FP32, bit for bit),
    within FP32 reassociation of the replay schedule with an FP32 u buffer (the default bf16 u
    buffer rounds the replay outputs, the flush path does not); advance=False + advance_pointers() follows
    the path the step took; tp8_hi32 keeps the replay schedule."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver("gdn", 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=5)
    auto = ReplayStore.from_state(init, "s32_rs", "gdn", key_heads=HK, buffer_len=4)
    rep = ReplayStore.from_state(init, "s32_rs", "gdn", key_heads=HK, buffer_len=4,
                                 u_dtype=torch.float32)
    conv = ConventionalStore.from_state(init, "fp32")
    tp8 = ReplayStore.from_state(init, "tp8_hi32", "gdn", key_heads=HK, buffer_len=4)
    for step in range(5):
        inp = dr.inputs(seed=step)
        q, k, v, a, b, A_log, dtb = inp
        out = torch.full((3, H, dv), float("nan"))
        y = replay_gdn_step(auto, q, k, v, a, b, A_log, dtb, out=out, advance=False)
        advance_pointers(auto, torch.arange(3, dtype=torch.int32))
        yr = dr.kernel(rep, inp, None, path="replay")
        assert torch.equal(y, conventional_gdn_step(conv, q, k, v, a, b, A_log, dtb))
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5 * yr.abs().max().item())
        replay_gdn_step(tp8, q, k, v, a, b, A_log, dtb)
    assert auto.committed.tolist() == [0, 0, 0] and auto.n_flush.tolist() == [5, 5, 5]
    assert rep.committed.tolist() == [1, 1, 1] and rep.n_flush.tolist() == [1, 1, 1]
    assert tp8.committed.tolist() == [1, 1, 1] and tp8.n_flush.tolist() == [1, 1, 1]
    assert_states_close(auto.anchor.dequantize(), conv.state.dequantize())


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_forced_step_on_empty_buffers_is_the_conventional_kernel(kind, monkeypatch):
    """A forced step of s32_rs whose buffers are known empty (buffers_empty: from_state, forced
    steps since) runs the conventional kernel on the anchor (one launch, n_flush counted in it):
    bit for bit the flush kernel's result (outputs, anchor, pointers). A replay step or a
    verify clears the flag; forced steps then fold the buffer in the flush kernel (vs the
    reference); explicit launch options keep the flush kernel."""
    calls = []
    name = f"conventional_{kind}_step"
    real = getattr(rd, name)
    monkeypatch.setattr(rd, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver(kind, 4, HK, H, dk, dv)
    conv = ReplayStore.from_state(random_state(N, H, dv, dk, seed=8), "s32_rs", kind,
                                  key_heads=HK, buffer_len=4, max_drafts=2,
                                  u_dtype=torch.float32)
    poison_buffers(conv)
    flush, ref = conv.clone(), conv.clone()
    idx = torch.tensor([2, -1, 0, 1])
    for step in range(6):
        inp = dr.inputs(seed=50 + step)
        path = "replay" if step == 3 else "flush"       # step 3 buffers an entry per row
        n = len(calls)
        y = dr.kernel(conv, inp, idx, path=path)
        y2 = dr.kernel(flush, inp, idx, path=path, launch="split")
        y3 = dr.ref(ref, inp, idx, path=path)
        assert len(calls) == n + (step < 3)             # conventional only while empty
        assert conv.buffers_empty == (step < 3) and flush.buffers_empty == (step < 3)
        assert torch.equal(y, y2)
        assert_same_store(conv, flush)
        torch.testing.assert_close(y, y3, rtol=1e-5, atol=1e-5 * y3.abs().max().item())
    assert conv.n_flush.tolist() == [5, 5, 5] and conv.committed.tolist() == [0, 0, 0]
    # a forced, advanced step over every slot (no state_indices) empties every buffer again
    dr3 = Driver(kind, N, HK, H, dk, dv)
    dr3.kernel(conv, dr3.inputs(seed=70), None, path="flush", advance=False)
    assert not conv.buffers_empty
    dr3.kernel(conv, dr3.inputs(seed=71), None, path="flush")
    assert conv.buffers_empty and conv.committed.tolist() == [0, 0, 0]
    fresh = ReplayStore.from_state(random_state(N, H, dv, dk), "s32_rs", kind, key_heads=HK)
    assert fresh.buffers_empty and fresh.clone().buffers_empty
    tp8 = ReplayStore.from_state(random_state(N, H, dv, dk), "tp8_hi32", kind, key_heads=HK)
    n = len(calls)
    dr.kernel(tp8, dr.inputs(seed=1), idx, path="flush")         # not lossless: flush kernel
    dr.kernel(fresh, dr.inputs(seed=1), idx, path="flush", flush_config=(16, 1))
    assert len(calls) == n


def test_verify_clears_buffers_empty():
    from replayquant.kernels.verify import replay_accept, replay_gdn_verify
    N, HK, H, dk, dv = 2, 1, 2, 16, 16
    st = ReplayStore.from_state(random_state(N, H, dv, dk), "s32_rs", "gdn", key_heads=HK,
                                max_drafts=2)
    q, k, v, a, b = gdn_step_inputs(N, HK, H, dk, dv, T=2)
    A_log, dtb = gdn_params(H)
    replay_gdn_verify(st, q, k, v, a, b, A_log, dtb)
    assert not st.buffers_empty
    replay_accept(st, torch.tensor([2, 1]))
    assert not st.buffers_empty and st.committed.tolist() == [2, 1]


@pytest.mark.parametrize("kind,pair", [("gdn", "tp8_hi32"), ("mamba2", "tp4_hi16_sr")])
def test_fused_launch_blocks_advance_and_forced_flush(kind, pair):
    """launch='fused' with several programs per row (row blocks x value heads; an NVFP4 role
    needs whole matrices), odd batch with padding rows out of phase, poisoned outputs and
    buffers: advance=True (pointers moved by the row's last program) and advance=False followed
    by advance_pointers equal the split launch bit for bit, with path 'replay' and 'flush'."""
    N, HK, H, dk, dv = 4, 2, 4, 16, 16
    dr = Driver(kind, 5, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=11), pair, kind, key_heads=HK,
                                   seed=5, buffer_len=3)
    poison_buffers(store)
    a, b = store.clone(), store.clone()
    nv = "nvfp4" in (store.anchor.fmt, store.read_role.fmt)
    cfg = {} if nv else dict(block_v=8, num_warps=2)
    idx = torch.tensor([3, -1, 0, 2, 1])
    for step in range(6):
        if step == 2:
            idx = torch.tensor([3, -1, 0, -1, 1])          # slot 2 falls out of phase
        if step == 3:
            idx = torch.tensor([2, 3, 0, -1, 1])
        path = "flush" if step == 4 else "replay"
        inp = dr.inputs(seed=100 + step)
        y = dr.kernel(store, inp, idx, path=path, launch="split")
        ya = dr.kernel(a, inp, idx, path=path, launch="fused", **cfg)
        yb = dr.kernel(b, inp, idx, path=path, launch="fused", advance=False, **cfg)
        assert (y[idx < 0] == 0).all()
        advance_pointers(b, idx)
        assert torch.equal(ya, y) and torch.equal(yb, y)
        assert_same_store(a, store)
        assert_same_store(b, store)
    assert store.n_flush.tolist() == [2, 2, 2, 2] and store.committed.tolist() == [1, 1, 1, 1]


def test_flush_plan_lists_the_rows_with_work():
    """_flush_plan_kernel lists, in batch order, the padding rows, the rows with a pre-flush
    (h + T > L, h > 0) and, in a step, the rows whose entry fills the buffer; in chunks of CH
    rows (B > CH)."""
    L, B = 4, 23
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    h = torch.randint(0, L + 1, (B + 2,), generator=g, dtype=torch.int32)
    idx = torch.randperm(B + 2, generator=g)[:B].to(torch.int32)
    idx[torch.randperm(B, generator=g)[:4]] = -1
    for T, step in ((1, True), (3, False), (2, True)):
        lst = torch.full((B,), -5, dtype=torch.int32)
        n = torch.full((1,), -5, dtype=torch.int32)
        rd._flush_plan_kernel[(1,)](idx, h, lst, n, B, L=L, T=T, STEP=step, CH=8)
        hs = torch.where(idx >= 0, h[idx.clamp(min=0).long()], 0)
        pre = (hs + T > L) & (hs > 0)
        need = (idx < 0) | pre
        if step:
            need |= torch.where(pre, 0, hs) + 1 == L
        want = torch.nonzero(need).flatten().to(torch.int32)
        assert n.item() == len(want) and torch.equal(lst[:len(want)], want)


@pytest.mark.parametrize("kind,pair", [("gdn", "s32_rs"), ("mamba2", "tp8_hi32")])
def test_flush_blocks_chosen_on_device_equal(kind, pair, monkeypatch):
    """A decode step's flush that chooses its blocks per item on the device from the listed
    items (FLUSH_DEVICE_BLOCKS, DYN): every block of a matrix in one item (from 1 item), one
    block per item (a threshold never reached) and the host's one block ({}: no device choice)
    give the same outputs and stores, bit for bit: steps out of phase with padding rows,
    poisoned outputs and buffers, two flush blocks of 8 rows per matrix."""
    N, HK, H, dk, dv, B = 5, 2, 4, 16, 16, 6
    dr = Driver(kind, B, HK, H, dk, dv)
    base = ReplayStore.from_state(random_state(N, H, dv, dk, seed=17), pair, kind, key_heads=HK,
                                  seed=6, buffer_len=3)
    poison_buffers(base)
    subsets = [torch.tensor([4, -1, 0, 2, 1, 3]), torch.tensor([4, -1, 0, -1, -1, 3]),
               torch.tensor([1, 3, -1, 0, 2, 4])]
    got = {}
    for m in (None, 1, 10 ** 9):
        monkeypatch.setattr(rd, "FLUSH_DEVICE_BLOCKS", {} if m is None else {kind: (B + 1, m)})
        st, ys = base.clone(), []
        for step in range(6):
            idx = subsets[step % len(subsets)]
            ys.append(dr.kernel(st, dr.inputs(seed=70 + step), idx, launch="split",
                                flush_config=(8, 1)))
        got[m] = st, ys
    assert int(got[1][0].n_flush.sum()) > 0
    for m in (1, 10 ** 9):
        assert_same_store(got[None][0], got[m][0])
        for a_, b_ in zip(got[None][1], got[m][1]):
            assert torch.equal(a_, b_)


def _random_accepts(B, T):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    return torch.randint(0, T + 1, (B,), generator=g, dtype=torch.int32)


def _steps_around_verify(dr, st, n, at, T, acc, seed, **step_kw):
    """n calls on store st (6 batch rows over 5 slots, row 1 padding), the outputs: split-launch
    decode steps, first on a subset of the rows (slots out of phase: fills 3, 1, 2, 3, 3 after
    three calls), then on all; call `at` is a verify of T drafts and the accepts acc."""
    from replayquant.kernels.verify import replay_accept, replay_gdn_verify, replay_mamba2_verify
    full = [4, -1, 0, 2, 1, 3]
    subsets = [[4, -1, 0, -1, -1, 3], [4, -1, 0, 2, -1, 3]]
    B, HK, H, dk, dv = dr.B, dr.HK, dr.H, dr.dk, dr.dv
    ys = []
    for step in range(n):
        idx = torch.tensor(subsets[step] if step < len(subsets) else full)
        if step == at:
            if dr.kind == "gdn":
                q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, T=T, seed=seed)
                A_log, dtb = gdn_params(H, seed)
                y = replay_gdn_verify(st, q, k, v, a, b, A_log, dtb, state_indices=idx)
            else:
                x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, T=T, seed=seed)
                A, D, dtb = mamba2_params(H, seed)
                y = replay_mamba2_verify(st, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                         dt_bias=dtb)
            replay_accept(st, acc, idx)
        else:
            y = dr.kernel(st, dr.inputs(seed=seed + 10 + step), idx, launch="split", **step_kw)
        ys.append(y)
    return ys


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi16_sr"), ("mamba2", "s32_rs")])
def test_flush_list_equals_one_program_per_matrix(kind, pair, monkeypatch):
    """The flush kernel over _flush_plan_kernel's list (FLUSH_LIST, a few programs looping over
    the items) equals one program per matrix, bit for bit: steps out of phase with padding rows
    (NaN-poisoned outputs and buffers), a verify of T = 3 drafts with pre-flushes and random
    accepts, and more steps."""
    N, HK, H, dk, dv, B, T = 5, 2, 4, 16, 16, 6, 3
    dr = Driver(kind, B, HK, H, dk, dv)
    base = ReplayStore.from_state(random_state(N, H, dv, dk, seed=13), pair, kind, key_heads=HK,
                                  seed=5, buffer_len=4, max_drafts=T)
    poison_buffers(base)
    acc = _random_accepts(B, T)
    got = {}
    for lst in (False, True):
        monkeypatch.setattr(rd, "FLUSH_LIST", lst)
        st = base.clone()
        got[lst] = st, _steps_around_verify(dr, st, 7, 3, T, acc, seed=50)
    assert_same_store(got[False][0], got[True][0])
    for a_, b_ in zip(got[False][1], got[True][1]):
        assert torch.equal(a_, b_)


NV_SR_HI32 = PrecisionPair.from_dict({"name": "tp4sr_hi32", "buffer_len": 4,
                                      "read": {"format": "nvfp4", "rounding": "stochastic"},
                                      "anchor": {"format": "fp32", "rounding": "nearest"}})


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi32"), ("mamba2", "tp4_hi32"),
                                       ("gdn", NV_SR_HI32)])
def test_deferred_nvfp4_read_cast_equal(kind, pair, monkeypatch):
    """An NVFP4 read copy beside an FP32 anchor cast by _read_cast_kernel after a flush on row
    blocks (FLUSH_DEFER_NV) equals the whole-matrix cast in the flush, bit for bit (outputs,
    anchor, read copy with its scales, pointers): decode steps out of phase with padding rows,
    poisoned outputs and buffers, two flush blocks per matrix, a verify of T = 3 drafts with
    pre-flushes and random accepts; stochastic rounding of the read copy with its stream."""
    N, HK, H, dk, dv, B, T = 5, 2, 4, 16, 16, 6, 3
    dr = Driver(kind, B, HK, H, dk, dv)
    base = ReplayStore.from_state(random_state(N, H, dv, dk, seed=23), pair, kind, key_heads=HK,
                                  seed=7, buffer_len=4, max_drafts=T)
    assert rd.defers_read_cast(base, B) == (kind == "gdn")       # Mamba-2 from 128 rows
    poison_buffers(base)
    acc = _random_accepts(B, T)
    got = {}
    for defer in (False, True):
        monkeypatch.setattr(rd, "FLUSH_DEFER_NV",
                            {kind: {"rows": 1, "verify_rows": 1, "L": 1}} if defer else {})
        st = base.clone()
        got[defer] = st, _steps_around_verify(dr, st, 8, 4, T, acc, seed=70,
                                              flush_config=(8, 1) if defer else None)
    assert (got[True][0].n_flush >= 1).all()
    assert_same_store(got[False][0], got[True][0])
    for a_, b_ in zip(got[False][1], got[True][1]):
        assert torch.equal(a_, b_)


def test_defer_rule():
    """FLUSH_DEFER_NV: rows of a step and of a verify, the buffer length, and only an NVFP4
    read copy beside an FP32 anchor."""
    mk = lambda pair, kind, L: ReplayStore.from_state(random_state(1, 2, 16, 16), pair, kind,  # noqa
                                                      key_heads=1, buffer_len=L)
    assert rd.defers_read_cast(mk("tp4_hi32", "gdn", 4), 1)
    assert not rd.defers_read_cast(mk("tp4_hi32", "gdn", 4), 32, verify=True)
    assert rd.defers_read_cast(mk("tp4_hi32", "gdn", 4), 128, verify=True)
    assert not rd.defers_read_cast(mk("tp4_hi32", "mamba2", 8), 64)
    assert rd.defers_read_cast(mk("tp4_hi32", "mamba2", 8), 128)
    assert not rd.defers_read_cast(mk("tp4_hi32", "mamba2", 4), 256)
    for pair in ("s32_rs", "tp8_hi32", "tp4_hi16_sr"):
        assert not rd.defers_read_cast(mk(pair, "gdn", 16), 256)


def test_launch_dispatcher():
    mk = lambda: ReplayStore.from_state(random_state(2, 2, 16, 16), "tp4_hi32", "gdn",  # noqa
                                        key_heads=1, buffer_len=4)
    assert choose_launch("gdn", 1, threshold=8) == "fused"
    assert choose_launch("mamba2", 8, threshold=8) == "split"
    # the H200's thresholds (FUSED_THRESHOLD): GDN without NVFP4 one launch below 32 rows,
    # Mamba-2 below 8
    assert choose_launch("gdn", 24) == "fused" and choose_launch("gdn", 32) == "split"
    assert choose_launch("mamba2", 8) == "split" and choose_launch("gdn", 1, nvfp4=True) == "split"
    st = mk()
    assert resolve_launch(st, 1) == "split"                  # NVFP4 read copy: never fused
    tp8 = ReplayStore.from_state(random_state(2, 2, 16, 16), "tp8_hi32", "gdn", key_heads=1)
    assert resolve_launch(tp8, 1) == "fused" and resolve_launch(tp8, 4096) == "split"
    assert resolve_launch(st, 1, "split") == "split" and resolve_launch(st, 4096, "fused") == "fused"
    assert resolve_launch(st, 1, "auto", "dots") == "split"
    assert resolve_read_variant(tp8, 4096) == "dots" and resolve_read_variant(tp8, 8) == "block"
    assert resolve_read_variant(tp8, 4096, "auto", "fused") == "block"
    assert resolve_read_variant(tp8, 4096, "block") == "block"
    m2 = ReplayStore.from_state(random_state(2, 2, 16, 16), "s32_rs", "mamba2", key_heads=1)
    assert resolve_read_variant(m2, 4096) == "dots" and resolve_read_variant(m2, 127) == "block"
    # the 'dots' read of a decode step runs DOTS_BLOCK's (rows, warps, row blocks per program)
    # by kind and read copy format (the measured best), a verify (T > 1) VERIFY_BLOCK's for either
    # read variant, the block read of a step keeps its size rule with one row block per program;
    # explicit blocks win
    big = ReplayStore.from_state(random_state(2, 2, 64, 128), "s32_rs", "mamba2", key_heads=1)
    assert replay_launch_config(big, 4096, read_variant="dots")[0] == DOTS_BLOCK[("mamba2", "fp32")]
    assert replay_launch_config(big, 4096, read_variant="dots", T=4)[0] == VERIFY_BLOCK_DEFAULT
    assert replay_launch_config(big, 8, T=4)[0] == VERIFY_BLOCK_DEFAULT
    g32 = ReplayStore.from_state(random_state(2, 2, 64, 128), "s32_rs", "gdn", key_heads=1)
    assert replay_launch_config(g32, 8, T=4)[0] == (16, 1, 1)          # GDN FP32 block verify
    assert replay_launch_config(g32, 8, T=4, read_variant="dots")[0] == VERIFY_BLOCK_DEFAULT
    assert replay_launch_config(g32, 8, 16, T=4)[0] == (16, 2, 1)      # explicit block: size rule
    nvb = ReplayStore.from_state(random_state(2, 2, 64, 128), "tp4_hi16_sr", "mamba2", key_heads=1)
    assert replay_launch_config(nvb, 4096, read_variant="dots")[0] == DOTS_BLOCK[("mamba2", "nvfp4")]
    assert replay_launch_config(big, 4096)[0] == (32, 4, 1)
    assert replay_launch_config(big, 4096, 32, read_variant="dots")[0] == (32, 4, 1)
    assert replay_launch_config(big, 4096, 32, read_variant="dots", read_blocks=2)[0] == (32, 4, 2)
    assert replay_launch_config(big, 4096, None, 2, read_variant="dots")[0][:2] == (16, 2)
    # a table entry with more blocks than a small matrix has takes all of its blocks
    small = ReplayStore.from_state(random_state(2, 2, 32, 16), "s32_rs", "gdn", key_heads=1)
    assert replay_launch_config(small, 4096, read_variant="dots")[0] == (16, 1, 2)
    # below 1024 matrices the flush block is the conventional kernel's (small_block): one warp
    # on 16 rows while that gives 2048 programs, else on 8
    assert replay_launch_config(big, 1)[1] == (8, 1) and replay_launch_config(big, 4096)[1] == (16, 1)
    sep = ReplayStore.from_state(random_state(2, 2, 64, 128), "tp8_hi32", "mamba2", key_heads=1)
    assert replay_launch_config(sep, 4096)[1] == FLUSH_BLOCK[("mamba2", False)] == (16, 1)
    assert replay_launch_config(big, 256)[1] == (16, 1) == launch_config("fp32", 512, 64, 128)
    assert launch_config("fp32", 2, 64, 128) == (8, 1) and launch_config("nvfp4", 2, 64, 128)[0] == 64
    with pytest.raises(ValueError, match="launch"):
        resolve_launch(st, 1, "one")
    with pytest.raises(ValueError, match="dots"):
        resolve_launch(st, 1, "fused", "dots")
    q, k, v, a, b = gdn_step_inputs(2, 1, 2, 16, 16)
    A_log, dtb = gdn_params(2)
    with pytest.raises(ValueError, match="flush block must be d_v"):
        replay_gdn_step(st, q, k, v, a, b, A_log, dtb, launch="fused", block_v=8)


def test_replay_bad_inputs():
    store = ReplayStore.from_state(random_state(2, 2, 16, 16), "s32_rs", "gdn", key_heads=1)
    q, k, v, a, b = gdn_step_inputs(2, 1, 2, 16, 16)
    A_log, dtb = gdn_params(2)
    with pytest.raises(ValueError, match="bfloat16"):
        replay_gdn_step(store, q, k.float(), v, a, b, A_log, dtb)
    with pytest.raises(ValueError, match="path"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, path="fast")
    with pytest.raises(ValueError, match="read_variant"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, read_variant="kh")
    with pytest.raises(ValueError, match="kind"):
        replay_mamba2_step(store, v, a, A_log, k, q)
    with pytest.raises(ValueError, match="key_heads"):
        ReplayStore.from_state(random_state(2, 3, 16, 16), "s32_rs", "gdn", key_heads=2)
    # an NVFP4 role cast in the flush (here the read copy of an FP16 anchor; tp4_hi32's is cast
    # after it, FLUSH_DEFER_NV) is written a whole matrix at a time
    nv = ReplayStore.from_state(random_state(2, 2, 32, 16), "tp4_hi16_sr", "gdn", key_heads=1)
    with pytest.raises(ValueError, match="flush block must be d_v"):
        replay_gdn_step(nv, q, k, gdn_step_inputs(2, 1, 2, 16, 32)[2], a, b, A_log, dtb,
                        flush_config=(16, 4))
    with pytest.raises(ValueError, match="block_v"):
        replay_gdn_step(nv, q, k, gdn_step_inputs(2, 1, 2, 16, 32)[2], a, b, A_log, dtb,
                        block_v=12)
    with pytest.raises(ValueError, match="row blocks per program"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, flush_config=(4, 1, 3))
    with pytest.raises(ValueError, match="heads per program"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, flush_config=(4, 1, 1, 3))


@pytest.mark.parametrize("kind,pair", [("gdn", "s32_rs"), ("gdn", "tp4_hi16_sr"),
                                       ("mamba2", "tp8_hi32"), ("mamba2", "tp4_hi32")])
def test_read_variant_dots_matches_reference_and_block(kind, pair):
    """read_variant='dots' (per-entry dot products formed once per (row, key head) by
    _entry_dots_kernel, then the block read kernel without the k entries): 6 steps with L = 3
    across flushes, two key heads, padding rows, rows out of phase, poisoned outputs and
    buffers, default bf16 u buffer: equals the torch reference and the block kernel; with
    flush programs of two 8-row blocks and two value heads each (flush_config (rows, warps, NT,
    NH)) as well (NVFP4 pairs: whole matrices, NT = 1), and with read programs of 2 blocks of 8
    rows (read_blocks: the next block's loads issued before this block's products)."""
    N, HK, H, dk, dv = 4, 2, 4, 16, 16
    dr = Driver(kind, 5, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=29), pair, kind,
                                   key_heads=HK, seed=3, buffer_len=3)
    poison_buffers(store)
    ref, blk, nt2 = store.clone(), store.clone(), store.clone()
    rbs = {2: store.clone()}
    ntc = (dv, 4, 1, 2) if "tp4" in pair else (8, 1, 2, 2)    # NVFP4: whole matrices
    idx = torch.tensor([2, -1, 0, 3, 1])
    tol = 2e-2 if kind == "gdn" else _tol(PrecisionPair.load(pair))     # bf16 u (GDN)
    for step in range(6):
        if step == 2:
            idx = torch.tensor([2, -1, 0, -1, 1])
        if step == 3:
            idx = torch.tensor([2, 3, 0, -1, 1])
        inp = dr.inputs(seed=40 + step)
        y = dr.kernel(store, inp, idx, launch="split", read_variant="dots", block_v=16)
        y2 = dr.ref(ref, inp, idx)
        y3 = dr.kernel(blk, inp, idx, launch="split", block_v=16)
        y4 = dr.kernel(nt2, inp, idx, launch="split", read_variant="dots", block_v=16,
                       flush_config=ntc)
        torch.testing.assert_close(y4, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
        for nb, st_ in rbs.items():
            y5 = dr.kernel(st_, inp, idx, launch="split", read_variant="dots", block_v=8,
                           read_blocks=nb)
            torch.testing.assert_close(y5, y, rtol=1e-5, atol=1e-5 * y.abs().max().item())
        assert (y[idx < 0] == 0).all()
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
        torch.testing.assert_close(y, y3, rtol=1e-5, atol=1e-5 * y3.abs().max().item())
        assert torch.equal(store.committed, ref.committed) and torch.equal(store.n_flush, ref.n_flush)
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    assert_states_close(store.read_role.dequantize(), blk.read_role.dequantize())
    assert torch.equal(nt2.anchor.dequantize(), store.anchor.dequantize())
    assert torch.equal(nt2.read_role.dequantize(), store.read_role.dequantize())
    for name in ("kbuf", "vbuf", "Gbuf", "bbuf"):
        a_, b_ = getattr(store, name), getattr(blk, name)
        assert torch.equal(a_.view(torch.uint8), b_.view(torch.uint8)), name
        for st_ in rbs.values():
            assert torch.equal(getattr(st_, name).view(torch.uint8), a_.view(torch.uint8)), name
    for st_ in rbs.values():
        assert torch.equal(st_.committed, store.committed)
        assert_states_close(st_.anchor.dequantize(), store.anchor.dequantize())
        if kind == "gdn":
            torch.testing.assert_close(st_.ubuf.float(), store.ubuf.float(), rtol=1e-2, atol=1e-3,
                                           equal_nan=True)
    with pytest.raises(ValueError, match="split launch"):
        dr.kernel(store, inp, idx, launch="fused", read_variant="dots")
    with pytest.raises(ValueError, match="read_blocks"):
        dr.kernel(store, inp, idx, launch="split", read_variant="dots", block_v=8, read_blocks=3)
    with pytest.raises(ValueError, match="read_blocks"):
        dr.kernel(store, inp, idx, launch="fused", read_blocks=2)


@pytest.mark.parametrize("pair", ["s32_rs", "tp4_hi32"])
def test_replay_mamba2_dt_limit(pair):
    """dt_limit (Nemotron-H's time_step_limit) through replay_mamba2_step across two flushes
    (L = 3) and replay_mamba2_verify: kernel == reference == ReplayState fed
    replay.frontends.mamba2_inputs with the same limit (which clamps entries on both sides);
    the clamped dt is what the buffer holds, so later rebuilds see it too."""
    from replayquant.kernels.verify import (replay_accept, replay_accept_ref,
                                            replay_mamba2_verify, replay_mamba2_verify_ref)
    from replayquant.replay import mamba2_inputs
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    P = PrecisionPair.load(pair).with_buffer_len(3)
    init = random_state(N, H, dv, dk, seed=6)
    store = ReplayStore.from_state(init, P, "mamba2", key_heads=HK, seed=2, u_dtype=torch.float32,
                                   max_drafts=2)
    poison_buffers(store)
    ref = store.clone()
    rs = ReplayState(init, P, delta=False, seed=2)
    idx = torch.tensor([1, -1, 0, 2])
    live = idx >= 0
    perm = torch.empty(N, dtype=torch.long)
    perm[idx[live]] = live.nonzero().flatten()
    A, D, dtb = mamba2_params(H, 9)
    tol = _tol(P)
    changed = 0.0
    for step in range(7):
        x, dt, Bm, C, z = mamba2_step_inputs(4, HK, H, dk, dv, seed=70 + step)
        d = torch.nn.functional.softplus(dt + dtb)
        lim = (d.quantile(0.3).item(), d.quantile(0.7).item())
        assert (d < lim[0]).any() and (d > lim[1]).any()
        y = replay_mamba2_step(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb,
                               out=torch.full((4, H, dv), float("nan")), path="replay",
                               dt_limit=lim)
        y0 = replay_mamba2_step_ref(ref.clone(), x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                    dt_bias=dtb, path="replay", advance=False)
        y2 = replay_mamba2_step_ref(ref, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                    dt_bias=dtb, path="replay", dt_limit=lim)
        fe = mamba2_inputs(x, dt, A, Bm, C, dtb, dt_limit=lim)
        yr = mamba2_post_ref(rs.step(*[t[perm] for t in fe]), x[perm], D, z[perm])
        changed = max(changed, ((y0 - y2).abs().max() / y2.abs().max()).item())
        assert (y[1] == 0).all() and torch.isfinite(y).all()
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
        torch.testing.assert_close(y[perm], yr, rtol=tol, atol=tol * yr.abs().max().item())
        assert torch.equal(store.committed, ref.committed)
        assert torch.equal(store.n_flush, ref.n_flush)
    assert store.n_flush.tolist() == rs.flushes.tolist() == [2] * 3
    assert_states_close(store.anchor.dequantize(), rs.anchor())
    assert changed > 10 * tol                     # the clamp mattered

    x, dt, Bm, C, z = mamba2_step_inputs(4, HK, H, dk, dv, T=2, seed=90)
    d = torch.nn.functional.softplus(dt + dtb)
    lim = (d.quantile(0.3).item(), d.quantile(0.7).item())
    yv = replay_mamba2_verify(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb,
                              out=torch.full((4, 2, H, dv), float("nan")), dt_limit=lim)
    yv2 = replay_mamba2_verify_ref(ref, x, dt, A, Bm, C, state_indices=idx, D=D, z=z,
                                   dt_bias=dtb, dt_limit=lim)
    torch.testing.assert_close(yv, yv2, rtol=tol, atol=tol * yv2.abs().max().item())
    n = torch.tensor([2, 0, 1, 2])
    replay_accept(store, n, idx)
    replay_accept_ref(ref, n, idx)
    assert torch.equal(store.committed, ref.committed)
