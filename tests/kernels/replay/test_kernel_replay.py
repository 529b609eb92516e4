"""Replay decode step (Triton, interpreter) against its torch reference and against ReplayState,
over many steps across several flushes: every shipped pair, GDN and Mamba-2, odd batch sizes,
padding rows, SR, poisoned outputs and poisoned (never-read) buffer entries; the anchor against
a float64 recurrence."""

import pytest
import torch

from replayquant.policy import resolve_pair
from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)
from replayquant.kernels.conventional.kernel import conventional_gdn_step, conventional_mamba2_step
from replayquant.kernels.conventional.reference import (gdn_frontend_ref, mamba2_frontend_ref,
                                                        mamba2_post_ref)
from replayquant.kernels.replay.decode import (_flush_grid, _fused, advance_pointers,
                                               replay_gdn_step, replay_mamba2_step)
from replayquant.kernels.replay.launch import (LAUNCH_TABLE, _max_regs, override_replay_launch,
                                              replay_launch_config)
from replayquant.replay.stores import ConventionalStore, ReplayStore, resolve_path
from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import verify as vf
from replayquant.kernels.replay.reference import replay_gdn_step_ref, replay_mamba2_step_ref
from replayquant.pairs import PrecisionPair, list_pairs
from replayquant.replay import ReplayState
from _helpers import assert_same_store, assert_states_close

PAIRS = ["s32_rs", "s16_sr", "sbf16", "tp8_hi32", "tp4_hi32", "tp8_hi16_sr", "tp4_hi16_sr",
         "f4_sr_rs"]


def _tol(pair):
    """Output tolerance: FP32 reassociation, or one grid step of a low-precision copy where the
    tiny difference of an unrounded state crossed a rounding boundary."""
    fp32 = pair.read_spec.format == "fp32" and pair.anchor.format == "fp32"
    return 1e-5 if fp32 else 1e-3


def assert_outputs_close(y, y2, pair):
    """Outputs within _tol; for a pair with a rounded role also a few elements (<= 2%) up to 5%
    of the largest output, where the float32-reassociated unrounded states of kernel and
    reference round to neighbouring values of a coarse grid (FP8: 2^-3 relative steps)."""
    tol = _tol(pair)
    if tol == 1e-5:
        torch.testing.assert_close(y, y2, rtol=tol, atol=tol * y2.abs().max().item())
        return
    scale = y2.abs().max().item()
    d = (y - y2).abs()
    assert (d > tol * scale + tol * y2.abs()).float().mean() <= 0.02, (d.max() / scale).item()
    assert d.max() <= 0.05 * scale, (d.max() / scale).item()


def staggered_slots(step):
    """The slot of each of 5 batch rows at `step` (-1: padding): slot 3 sits out step 2 and then
    moves to another row, one step behind the others (rows of different phase)."""
    if step < 2:
        return torch.tensor([2, -1, 0, 3, 1])
    return torch.tensor([2, -1, 0, -1, 1] if step == 2 else [2, 3, 0, -1, 1])


def poison_buffers(store):
    """Buffer entries are never read before they are written: NaN everywhere must not leak."""
    for t in (store.kbuf, store.vbuf, store.ubuf, store.Gbuf, store.bbuf, store.Tbuf):
        if t is not None:
            t.view(torch.uint8).fill_(0xFF)


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
    different phase), padding rows, poisoned buffers and outputs, against the reference; the
    pointers moved in the kernel (advance=True) and by advance_pointers after a launch with
    advance=False give the same store, bit for bit."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 16
    dr = Driver(kind, 5, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=21)
    store = ReplayStore.from_state(init, resolve_pair(pair, 3), kind, key_heads=HK, seed=13, layer=1,
                                   u_dtype=torch.float32)
    poison_buffers(store)
    ref, later = store.clone(), store.clone()
    for step in range(5):
        idx = staggered_slots(step)
        inp = dr.inputs(seed=step)
        y = dr.kernel(store, inp, idx)
        y2 = dr.ref(ref, inp, idx)
        assert (y[idx < 0] == 0).all()
        assert_outputs_close(y, y2, PrecisionPair.load(pair))
        assert torch.equal(store.committed, ref.committed)
        assert torch.equal(store.n_flush, ref.n_flush)
        assert torch.equal(dr.kernel(later, inp, idx, advance=False), y)
        advance_pointers(later, idx)
        assert_same_store(later, store)
    assert store.n_flush.tolist() == [1, 1, 1, 1] and store.committed.tolist() == [2, 2, 2, 1]
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    assert_states_close(store.read_role.dequantize(), ref.read_role.dequantize())
    for name in ("kbuf", "vbuf"):       # raw inputs: bit-identical entries
        a, b = getattr(store, name), getattr(ref, name)
        live = torch.isfinite(b.float())
        assert torch.equal(torch.isfinite(a.float()), live) and torch.equal(a[live], b[live])
    if store.Tbuf is not None:          # key factors appended by the reads: the same rows
        live = torch.isfinite(ref.Tbuf)
        assert torch.equal(torch.isfinite(store.Tbuf), live) and live.any()
        torch.testing.assert_close(store.Tbuf[live], ref.Tbuf[live], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind,pair,fused", [("gdn", "s32_rs", True),
                                             ("gdn", "tp8_hi16_sr", True),
                                             ("mamba2", "tp8_hi32", True),
                                             ("gdn", "tp4_hi32", True),
                                             ("gdn", "tp8_hi32", "read"),
                                             ("mamba2", "tp8_hi16_sr", "read"),
                                             ("gdn", "s32_rs", "read")])
def test_fused_step_equals_two_launches(kind, pair, fused):
    """override_replay_launch({'fused': True}) (one launch a step: each program flushes its own
    tile, whole matrices for an NVFP4 role, then reads) and {'fused': 'read'} (one launch on the
    read's 32-row tiles, a flushing row's program running the flush on its two 16-row
    sub-tiles; s32_rs, the GPU's default above one wave, on one 32-row sub-tile) give the two
    launches' outputs and store bit for bit, over windows with rows out
    of phase, padding rows and a forced flush; a verify cannot fuse, nor can an NVFP4 role
    flush inside the read's tiles."""
    N, HK, H, dk, dv = 4, 1, 2, 32, 32
    dr = Driver(kind, 5, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=5), resolve_pair(pair, 3), kind, key_heads=HK,
                                   seed=3)
    poison_buffers(store)
    two = store.clone()
    for step in range(7):
        idx = staggered_slots(step)
        inp = dr.inputs(seed=40 + step)
        path = "flush" if step == 5 else "replay"
        with override_replay_launch({"fused": fused}):
            y = dr.kernel(store, inp, idx, path=path)
        assert torch.equal(y, dr.kernel(two, inp, idx, path=path))
        assert_same_store(store, two)
    with pytest.raises(ValueError, match="not a verify"), override_replay_launch({"fused": fused}):
        _fused(4, False, 1, "cpu")
    if fused == "read":
        nv = ReplayStore.from_state(random_state(N, H, dv, dk, seed=5),
                                    resolve_pair("tp4_hi32", 3), kind, key_heads=HK)
        with pytest.raises(ValueError, match="without an NVFP4 role"), \
                override_replay_launch({"fused": "read"}):
            dr.kernel(nv, dr.inputs(seed=1), idx)


def test_fused_where_follows_the_table():
    """FUSED_TABLE: a shared FP32 pair of GDN or Mamba-2 flushes inside the read launch above one
    wave (measured faster with rows staggered); other pairs and KDA (not timed) keep the flush
    launch; the interpreter runs two launches whatever the table says."""
    from replayquant.kernels.replay.launch import fused_where
    want = {("gdn", "s32_rs"): "read", ("mamba2", "s32_rs"): "read"}
    for kind in ("gdn", "mamba2", "kda"):
        for pair in ("s32_rs", "tp8_hi32", "tp4_hi32"):
            st = ReplayStore.from_state(random_state(2, 2, 16, 16), PrecisionPair.load(pair),
                                        kind, key_heads=1)
            assert fused_where(st) == want.get((kind, pair), ""), (kind, pair)
    assert _fused(1, True, 10 ** 6, "cpu", "read") == ""


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
        assert_outputs_close(y[perm], yr, P)
    assert store.committed.tolist() == rs.committed.tolist()
    assert store.n_flush.tolist() == rs.n_flush.tolist() == [2] * 4
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
        assert_outputs_close(y[perm], yr, P)
    g = torch.stack(glog)                         # [steps, H] log gates of row 0
    assert (g[:, 0] < -40).all() and (g[:, 1] < -4).all() and (g[:, 2] > -1).all()
    assert store.n_flush.tolist() == rs.n_flush.tolist() == [2] * N
    assert_states_close(store.anchor.dequantize(), rs.anchor())
    assert_states_close(store.read_role.dequantize(), rs.read_copy())


@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32", "tp4_hi32"])
def test_read_in_chunks(pair):
    """GDN read copies with a chunk in LAUNCH_TABLE are read in chunks of columns once d_k
    exceeds the chunk (d_k = 128: FP32 and FP8 four chunks, NVFP4 two), against the reference
    over two windows."""
    N, HK, H, dk, dv = 2, 1, 1, 128, 16
    dr = Driver("gdn", N, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=4), resolve_pair(pair, 3), "gdn", key_heads=HK,
                                   u_dtype=torch.float32)
    poison_buffers(store)
    ref = store.clone()
    P = PrecisionPair.load(pair)
    for step in range(6):
        inp = dr.inputs(seed=40 + step)
        assert_outputs_close(dr.kernel(store, inp, None), dr.ref(ref, inp, None), P)
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


@pytest.mark.parametrize("pair", ["tp4_hi32", "s32_rs"])
def test_replay_bf16_u_buffer_against_reference(pair):
    """u in bf16 (the default beside a separate read copy; a shared pair's default is FP32, which
    its flush folds, so a shared pair given bf16 u solves for u as the others do): the reference
    models the bf16 storage of u."""
    N, HK, H, dk, dv = 3, 1, 2, 32, 16
    dr = Driver("gdn", 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk)
    assert ReplayStore.from_state(init, resolve_pair(pair), "gdn").ubuf.dtype == \
        (torch.float32 if pair == "s32_rs" else torch.bfloat16)
    store = ReplayStore.from_state(init, resolve_pair(pair, 4), "gdn", key_heads=HK,
                                   u_dtype=torch.bfloat16)
    assert not rr.folds_u(store)
    ref = store.clone()
    for step in range(6):
        inp = dr.inputs(seed=step)
        y, y2 = dr.kernel(store, inp, None), dr.ref(ref, inp, None)
        # a one-ulp bf16 difference of a cached u moves an output by ~2^-8 of that term
        torch.testing.assert_close(y, y2, rtol=2e-2, atol=2e-2 * y2.abs().max().item())
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    # the key factors are part of a store that solves for u: without them, one clear error
    store.Tbuf = None
    with pytest.raises(ValueError, match="needs its key factors: Tbuf"):
        dr.kernel(store, dr.inputs(seed=9), None)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
def test_L1_shared_fp32_equals_conventional_bitwise(kind):
    """DESIGN invariant 1 for the kernels: L = 1, shared FP32 is the conventional kernel."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver(kind, 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=8)
    store = ReplayStore.from_state(init, resolve_pair("s32_rs", 1), kind, key_heads=HK)
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
    """path='flush': every step flushes; with a shared SR pair this
    is the conventional read-modify-write, bit for bit (same SR streams)."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver("gdn", 3, HK, H, dk, dv)
    init = random_state(N, H, dv, dk, seed=2)
    store = ReplayStore.from_state(init, resolve_pair("s16_sr"), "gdn", key_heads=HK, seed=4)
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
    store = ReplayStore.from_state(random_state(N, H, dv, dk), resolve_pair("tp8_hi32", 8), "gdn", key_heads=HK,
                                   u_dtype=torch.float32)
    ref = store.clone()
    for step, path in enumerate(["replay", "replay", "flush", "replay"]):
        inp = dr.inputs(seed=step)
        out = torch.full((2, H, dv), float("nan"))
        fn_in = inp
        with override_replay_launch({"flush": (16, None), "read": (16, None)}):
            y = replay_gdn_step(store, *fn_in[:5], *fn_in[5:], out=out, path=path)
        y2 = dr.ref(ref, inp, None, path=path)
        torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5 * y2.abs().max().item())
    assert store.committed.tolist() == [1, 1] and store.n_flush.tolist() == [1, 1]
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi32"), ("mamba2", "tp4_hi32"),
                                       ("gdn", "tp4_hi16_sr")])
def test_nvfp4_read_copy_whole_matrices(kind, pair):
    """An NVFP4 read copy of a matrix of 64 rows: the flush takes the whole matrix (one scale a
    matrix), the read launch 4 tiles of it; beside an FP32 anchor and an FP16 + SR one, the
    reference's casts within float32 reassociation of the rebuilt state; steps across a flush
    (L = 3), a verify of 2 drafts with its pre-flush and an accept, poisoned buffers, a padding
    row."""
    from replayquant.kernels.replay.reference import replay_accept_ref
    from replayquant.kernels.replay.verify import replay_accept
    N, HK, H, dk, dv, T = 2, 1, 1, 16, 64, 2
    dr = Driver(kind, N + 1, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=9), resolve_pair(pair, 3), kind,
                                   key_heads=HK, u_dtype=torch.float32,
                                   max_drafts=T)
    def launch():
        return override_replay_launch({"read": (16, None)})     # 4 read programs a matrix
    with launch():
        assert replay_launch_config(store, "flush") == (dv, 1)
    poison_buffers(store)
    ref = store.clone()
    idx = torch.tensor([1, -1, 0])
    P = PrecisionPair.load(pair)
    for step in range(5):
        if step == 2:
            fn, fr = ((vf.replay_gdn_verify, rr.replay_gdn_verify_ref) if kind == "gdn"
                      else (vf.replay_mamba2_verify, rr.replay_mamba2_verify_ref))
            if kind == "gdn":
                q, k, v, a, b = gdn_step_inputs(N + 1, HK, H, dk, dv, T=T, seed=70)
                A_log, dtb = gdn_params(H, 70)
                with launch():
                    y = fn(store, q, k, v, a, b, A_log, dtb, state_indices=idx)
                y2 = fr(ref, q, k, v, a, b, A_log, dtb, state_indices=idx)
            else:
                x, dt, Bm, C, z = mamba2_step_inputs(N + 1, HK, H, dk, dv, T=T, seed=70)
                A, D, dtb = mamba2_params(H, 70)
                with launch():
                    y = fn(store, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb)
                y2 = fr(ref, x, dt, A, Bm, C, state_indices=idx, D=D, z=z, dt_bias=dtb)
            n = torch.tensor([2, 0, 1])
            replay_accept(store, n, idx)
            replay_accept_ref(ref, n, idx)
        else:
            inp = dr.inputs(seed=60 + step)
            with launch():
                y = dr.kernel(store, inp, idx)
            y2 = dr.ref(ref, inp, idx)
        assert (y[1] == 0).all()
        assert_outputs_close(y, y2, P)
        assert store.committed.tolist() == ref.committed.tolist()
    assert store.n_flush.tolist() == ref.n_flush.tolist() and min(store.n_flush.tolist()) >= 2
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    assert_states_close(store.read.dequantize(), ref.read.dequantize())
    torch.testing.assert_close(store.read.gscale, ref.read.gscale, rtol=1e-5, atol=0)


def test_launch_table_and_path():
    """One launch table for the two launches of a step: the read launch's tiles; a flush that
    writes an NVFP4 role takes whole matrices, other flushes 16- or 32-row tiles;
    override_replay_launch overrides it for its block, with one error for a tile the kernel
    cannot take and one for a key it does not know. 'auto' is 'replay' at every batch."""
    def mk(pair, dv=32, dk=16):
        return ReplayStore.from_state(random_state(2, 2, dv, dk), resolve_pair(pair, 4), "gdn", key_heads=1)
    cfg = replay_launch_config
    assert LAUNCH_TABLE[-1][:4] == ("flush", "*", "*", 16)      # a catch-all row each launch
    assert cfg(mk("s32_rs"), "flush") == (32, 1)         # an FP32 shared pair folds u
    assert cfg(mk("tp8_hi32"), "flush") == (16, 1)
    assert cfg(mk("s32_rs", 128, 128), "read") == (64, 1)    # FP32: 64 rows a warp, chunked
    assert cfg(mk("tp4_hi32", 128, 128), "read") == (64, 1)  # chunked as well
    assert cfg(mk("s16_sr", 128, 128), "read") == (64, 2)    # a whole decoded tile, 2 warps
    assert cfg(mk("tp4_hi32", 64), "flush") == (64, 1)       # an NVFP4 role: whole matrices
    assert cfg(mk("tp4_hi16_sr", 64), "read") == (64, 1)     # reads need no matrix amax
    assert cfg(mk("f4_sr_rs"), "flush") == (32, 1)
    over = override_replay_launch
    with over({"read": (16, 2)}):
        assert cfg(mk("tp8_hi32"), "read") == (16, 2)
        assert cfg(mk("tp8_hi32"), "flush") == (16, 1)            # the flush's stays the table's
        with over({"flush": (32, 4)}):                          # an inner override replaces
            assert cfg(mk("tp8_hi32"), "flush") == (32, 4)
            assert cfg(mk("tp8_hi32"), "read") == (32, 1)
        assert cfg(mk("tp8_hi32"), "read") == (16, 2)             # the outer one holds again
    assert cfg(mk("tp8_hi32"), "read") == (32, 1)                 # and the table after both
    for pair in ("f4_sr_rs", "tp4_hi32"):
        with pytest.raises(ValueError, match="rows must be d_v"), over({"flush": (16, None)}):
            cfg(mk(pair), "flush")
    with pytest.raises(ValueError, match="power of two >= 16"), over({"read": (8, None)}):
        cfg(mk("s32_rs"), "read")
    with pytest.raises(ValueError, match="warps"), over({"flush": (None, 3)}):
        cfg(mk("s32_rs"), "flush")
    with pytest.raises(ValueError, match="keys"), over({"reads": (16, 1)}):
        pass
    # the read launch's register cap: the table's unless the launch names rows, warps or regs
    assert _max_regs(mk("tp4_hi32"), "read") == 128
    assert _max_regs(mk("tp4_hi32"), "read", T=4) is None     # a verify: uncapped
    with over({"read": (64, 2)}):
        assert _max_regs(mk("tp4_hi32"), "read") is None
    with over({"read": (64, 2, 128)}):
        assert _max_regs(mk("s32_rs"), "read") == 128
    assert _max_regs(mk("s32_rs"), "read") is None
    assert _max_regs(mk("tp4_hi32"), "flush") is None
    with pytest.raises(ValueError, match="16..255"), over({"read": (64, 2, 300)}):
        _max_regs(mk("s32_rs"), "read")
    # the flush launch's grid: TPP tiles a program (all FLUSH_MAX_TILES on the CPU)
    assert _flush_grid(12, "cpu") == (8, (2,)) and _flush_grid(3, "cpu") == (4, (1,))
    st = mk("s32_rs", 16)
    for B in (1, 512):
        assert resolve_path(st, B) == "replay" and resolve_path(st, B, "flush") == "flush"
    dr = Driver("gdn", 2, 1, 2, 16, 16)
    dr.kernel(st, dr.inputs(0), None, path="auto")
    assert st.committed.tolist() == [1, 1] and st.n_flush.tolist() == [0, 0]


@pytest.mark.parametrize("kind,pair", [("gdn", "s32_rs"), ("mamba2", "s32_rs"),
                                       ("gdn", "tp4_hi32")])
def test_anchor_within_1e5_of_float64_after_three_windows(kind, pair):
    """The anchor of an FP32 anchor (the tensor-core rebuild: exact bf16 k products, float32
    accumulation) after three windows of L = 8 equals a float64 recurrence of the same inputs
    within 1e-5 (relative to the state's largest element); gates that keep the state for
    hundreds of steps, so that every flush's error stays in it."""
    N, HK, H, dk, dv, L = 2, 1, 2, 32, 16, 8
    init = random_state(N, H, dv, dk, seed=3)
    store = ReplayStore.from_state(init, resolve_pair(pair, L), kind, key_heads=HK,
                                   u_dtype=torch.float32)
    S = init.double()
    dr = Driver(kind, N, HK, H, dk, dv)
    for step in range(3 * L):
        inp = list(dr.inputs(seed=200 + step))
        if kind == "gdn":
            inp[3] = inp[3] - 6.0                    # a: softplus small, decay ~0.998
        else:
            inp[1] = inp[1] - 4.0                    # dt small
        dr.kernel(store, tuple(inp), None)
        fe, _ = dr.core_inputs(tuple(inp))
        q, k, v, log_a = (t.double() for t in fe[:4])
        S = S * torch.exp(log_a)[..., None, None]
        if kind == "gdn":
            u = fe[4].double()[..., None] * (v - (S * k[:, :, None, :]).sum(-1))
        else:
            u = v
        S = S + u[..., :, None] * k[:, :, None, :]
    assert store.n_flush.tolist() == [3, 3] and store.committed.tolist() == [0, 0]
    err = ((store.anchor.dequantize().double() - S).abs().max() / S.abs().max()).item()
    assert err < 1e-5, err


def test_gdn_beta_scale():
    """beta = beta_scale sigmoid(b) (OLMo-Hybrid: 2) in the kernel and the reference, across a
    flush; the buffer holds the scaled beta."""
    N, HK, H, dk, dv = 3, 1, 2, 16, 16
    dr = Driver("gdn", N, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(N, H, dv, dk, seed=4), resolve_pair("tp8_hi32", 3), "gdn",
                                   key_heads=HK, u_dtype=torch.float32)
    ref, one = store.clone(), store.clone()
    for step in range(4):
        q, k, v, a, b, A_log, dtb = dr.inputs(seed=30 + step)
        y = replay_gdn_step(store, q, k, v, a, b, A_log, dtb, beta_scale=2.0)
        y2 = replay_gdn_step_ref(ref, q, k, v, a, b, A_log, dtb, beta_scale=2.0)
        y1 = replay_gdn_step(one, q, k, v, a, b, A_log, dtb)
        torch.testing.assert_close(y, y2, rtol=1e-4, atol=1e-5 * y2.abs().max().item())
        assert (y - y1).abs().max() > 1e-3 * y1.abs().max()
    torch.testing.assert_close(store.bbuf, ref.bbuf)
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
    with pytest.raises(ValueError, match="beta_scale"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, beta_scale=0.0)


def test_replay_bad_inputs():
    store = ReplayStore.from_state(random_state(2, 2, 16, 16), resolve_pair("s32_rs"), "gdn", key_heads=1)
    q, k, v, a, b = gdn_step_inputs(2, 1, 2, 16, 16)
    A_log, dtb = gdn_params(2)
    with pytest.raises(ValueError, match="bfloat16"):
        replay_gdn_step(store, q, k.float(), v, a, b, A_log, dtb)
    with pytest.raises(ValueError, match="path"):
        replay_gdn_step(store, q, k, v, a, b, A_log, dtb, path="fast")
    with pytest.raises(ValueError, match="kind"):
        replay_mamba2_step(store, v, a, A_log, k, q)
    with pytest.raises(ValueError, match="key_heads"):
        ReplayStore.from_state(random_state(2, 3, 16, 16), resolve_pair("s32_rs"), "gdn", key_heads=2)
    with pytest.raises(TypeError, match="policy.resolve_pair makes one"):
        ReplayStore.from_state(random_state(2, 2, 16, 16), "s32_rs", "gdn", key_heads=1)
    nv = ReplayStore.from_state(random_state(2, 2, 32, 16), resolve_pair("f4_sr_rs"), "gdn", key_heads=1)
    with pytest.raises(ValueError, match="rows must be d_v"), \
            override_replay_launch({"flush": (16, None)}):
        replay_gdn_step(nv, q, k, gdn_step_inputs(2, 1, 2, 16, 32)[2], a, b, A_log, dtb)


@pytest.mark.parametrize("pair", ["s32_rs", "tp4_hi32"])
def test_replay_mamba2_dt_limit(pair):
    """dt_limit (Nemotron-H's time_step_limit) through replay_mamba2_step across two flushes
    (L = 3) and replay_mamba2_verify: kernel == reference == ReplayState fed
    replay.frontends.mamba2_inputs with the same limit (which clamps entries on both sides);
    the clamped dt is what the buffer holds, so later rebuilds see it too."""
    from replayquant.kernels.replay.reference import replay_accept_ref, replay_mamba2_verify_ref
    from replayquant.kernels.replay.verify import replay_accept, replay_mamba2_verify
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
    assert store.n_flush.tolist() == rs.n_flush.tolist() == [2] * 3
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


@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32"])
def test_flush_of_a_nonfinite_state_keeps_the_tile(pair):
    """A NaN in one value row of one head at a flush step: the kernel and its reference keep
    both roles of that flush tile (tp8_hi32: 16-row tiles, so the head's other tile is written)
    bit for bit as before the step, and write the same tiles elsewhere."""
    B, HK, H, dk, dv = 2, 1, 2, 32, 32
    dr = Driver("gdn", B, HK, H, dk, dv)
    store = ReplayStore.from_state(random_state(B, H, dv, dk, seed=5), resolve_pair(pair, 2), "gdn", key_heads=HK,
                                   seed=3, layer=0)
    ref = store.clone()
    idx = torch.arange(B)
    inp = dr.inputs(seed=0)
    dr.step(replay_gdn_step, store, inp, idx)
    dr.step(replay_gdn_step_ref, ref, inp, idx)
    before = store.clone()
    q, k, v, *rest = dr.inputs(seed=1)
    v = v.clone()
    v[0, 0, 3] = float("nan")
    dr.step(replay_gdn_step, store, (q, k, v, *rest), idx)
    dr.step(replay_gdn_step_ref, ref, (q, k, v, *rest), idx)
    assert store.n_flush.tolist() == [1, 1]
    bv = replay_launch_config(store, "flush")[0]
    for s in (store, ref):
        for role in [r for r in ("anchor", "read") if getattr(s, r) is not None]:
            new, old = getattr(s, role).dequantize(), getattr(before, role).dequantize()
            assert torch.equal(new[0, 0, :bv], old[0, 0, :bv]), role        # the kept tile
            assert torch.isfinite(new).all()
            assert not torch.equal(new[1], old[1])                          # a written row
    assert_states_close(store.anchor.dequantize(), ref.anchor.dequantize())
