"""Speculative verify + accept (replay) and the per-draft snapshot baseline (conventional), Triton
in the interpreter, against their torch references and against ReplayState / ConventionalState,
over many rounds with random accept counts including 0 and T, mixed with plain decode steps."""

import pytest
import torch

from replayquant.policy import resolve_pair
from replayquant.testing import (gdn_params, gdn_step_inputs, mamba2_params,
                                 mamba2_step_inputs, random_state)
from replayquant.kernels.conventional.reference import (conventional_accept_ref,
                                                        conventional_gdn_verify_ref,
                                                        conventional_mamba2_verify_ref,
                                                        gdn_frontend_ref, mamba2_frontend_ref,
                                                        mamba2_post_ref)
from replayquant.kernels.replay.decode import advance_pointers, replay_gdn_step, replay_mamba2_step
from replayquant.replay.stores import ConventionalStore, ReplayStore, make_snapshots
from replayquant.kernels.replay.reference import (replay_accept_ref, replay_gdn_step_ref,
                                                  replay_gdn_verify_ref, replay_mamba2_step_ref,
                                                  replay_mamba2_verify_ref)
from replayquant.kernels.conventional.verify import (conventional_accept, conventional_gdn_verify,
                                                     conventional_mamba2_verify)
from replayquant.kernels.replay.verify import replay_accept, replay_gdn_verify, replay_mamba2_verify
from replayquant.pairs import PrecisionPair
from replayquant.replay import ConventionalState, ReplayState
from _helpers import assert_states_close

N, HK, H, DK, DV = 4, 1, 2, 32, 16
IDX = torch.tensor([2, -1, 0, 3, 1])
LIVE = IDX >= 0
PERM = torch.empty(N, dtype=torch.long)
PERM[IDX[LIVE]] = LIVE.nonzero().flatten()


def close(y, yr, tol):
    torch.testing.assert_close(y, yr, rtol=tol, atol=tol * yr.abs().max().item())


def inputs(kind, T, seed):
    """(kernel args, core tensors flattened for ReplayState with rows on slots, post)."""
    B = IDX.shape[0]
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, DK, DV, T=T, seed=seed)
        A_log, dtb = gdn_params(H, seed)
        lead = q.shape[:-2]
        fe = gdn_frontend_ref(q.reshape(-1, HK, DK), k.reshape(-1, HK, DK), v.reshape(-1, H, DV),
                              a.reshape(-1, H), b.reshape(-1, H), A_log, dtb)
        fe = [t.reshape(*lead, *t.shape[1:])[PERM] for t in fe]
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dtb), fe, None
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, DK, DV, T=T, seed=seed)
    A, D, dtb = mamba2_params(H, seed)
    lead = x.shape[:-2]
    fe = mamba2_frontend_ref(x.reshape(-1, H, DV), dt.reshape(-1, H), A, Bm.reshape(-1, HK, DK),
                             C.reshape(-1, HK, DK), dtb)[:4]
    fe = [t.reshape(*lead, *t.shape[1:])[PERM] for t in fe]
    post = lambda y: mamba2_post_ref(y, x[PERM], D, z[PERM])  # noqa: E731
    if T is not None:
        post = lambda y: torch.stack([mamba2_post_ref(y[:, t], x[PERM, t], D, z[PERM, t])  # noqa
                                      for t in range(T)], 1)
    return dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D, z=z, dt_bias=dtb), fe, post


def call(fn, store, kw, extra=()):
    return fn(store, *extra, **kw, state_indices=IDX)


FN = {
    "gdn": (replay_gdn_step, replay_gdn_step_ref, replay_gdn_verify, replay_gdn_verify_ref,
            conventional_gdn_verify, conventional_gdn_verify_ref),
    "mamba2": (replay_mamba2_step, replay_mamba2_step_ref, replay_mamba2_verify,
               replay_mamba2_verify_ref, conventional_mamba2_verify,
               conventional_mamba2_verify_ref),
}


def _accepts(rnd, T):
    g = torch.Generator().manual_seed(rnd)
    n = torch.randint(0, T + 1, (IDX.shape[0],), generator=g)
    n[0] = [0, T, 1][rnd % 3]                      # 0 and T always occur
    return n


def close_lossy(y, yr, tol):
    """close, except a few elements (<= 2%) up to 5% of the largest output where kernel and
    reference states, equal within float32 reassociation, round to neighbouring grid values."""
    if tol == 1e-5:
        return close(y, yr, tol)
    scale = yr.abs().max().item()
    d = (y - yr).abs()
    assert (d > tol * scale + tol * yr.abs()).float().mean() <= 0.02, (d.max() / scale).item()
    assert d.max() <= 0.05 * scale, (d.max() / scale).item()


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", ["s32_rs", "tp4_hi16_sr", "tp8_hi32", "tp4_hi32"])
def test_replay_verify_accept(kind, pair):
    """Rounds of step / verify(T=3) + random accept with L = 5 (pre-flushes of committed entries
    inside verify, h = L left by accept then flushed by the next step): kernel vs reference vs
    ReplayState, outputs, pointers, anchor and read copy; a verify launched with advance=False
    and its pointers moved by advance_pointers gives the same store."""
    T = 3
    P = PrecisionPair.load(pair).with_buffer_len(5)
    tol = 1e-5 if pair == "s32_rs" else 1e-3
    step, step_ref, ver, ver_ref = FN[kind][:4]
    init = random_state(N, H, DV, DK, seed=31)
    st = ReplayStore.from_state(init, P, kind, key_heads=HK, seed=6, u_dtype=torch.float32,
                                max_drafts=T)
    ref = st.clone()
    rs = ReplayState(init, P, delta=kind == "gdn", seed=6)
    for rnd in range(7):
        if rnd % 3 == 2:
            kw, fe, post = inputs(kind, None, seed=rnd)
            kw = {**kw, "path": "replay"}
            later = st.clone()
            y, y2 = call(step, st, kw), call(step_ref, ref, kw)
            assert torch.equal(call(step, later, {**kw, "advance": False}), y)
            advance_pointers(later, IDX)
            assert torch.equal(later.anchor.payload, st.anchor.payload)
            assert torch.equal(later.read_role.payload, st.read_role.payload)
            assert torch.equal(later.committed, st.committed) and not st.arrive.any()
            yr = rs.step(*fe)
        else:
            kw, fe, post = inputs(kind, T, seed=rnd)
            out = torch.full((IDX.shape[0], T, H, DV), float("nan"))
            y = ver(st, **kw, state_indices=IDX, out=out)
            assert y is out and torch.isfinite(y).all()
            y2 = call(ver_ref, ref, kw)
            yr = rs.verify(*fe)
            n = _accepts(rnd, T)
            replay_accept(st, n, IDX)
            replay_accept_ref(ref, n, IDX)
            rs.accept(n[PERM])
        if post is not None:
            yr = post(yr)
        assert (y[~LIVE] == 0).all()
        close_lossy(y, y2, tol)
        close_lossy(y[PERM], yr, tol)
        assert st.committed.tolist() == ref.committed.tolist() == rs.committed.tolist()
        assert st.n_flush.tolist() == ref.n_flush.tolist() == rs.n_flush.tolist()
    assert max(st.n_flush.tolist()) >= 1
    assert_states_close(st.anchor.dequantize(), rs.anchor())
    assert_states_close(st.read_role.dequantize(), rs.read_copy())
    assert_states_close(st.anchor.dequantize(), ref.anchor.dequantize())


@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32", "tp4_hi32"])
def test_verify_reads_chunks_once(pair):
    """A Mamba-2 verify reads the copy once for all its drafts (_tile_mv_t); at d_k = 128 an FP32
    copy in 4 column chunks, FP8 / NVFP4 in one loaded chunk: a verify of T = 3 drafts after two
    committed steps against its reference, outputs (NaN-poisoned) and pointers."""
    dk, T, idx = 128, 3, torch.tensor([1, 0])
    st = ReplayStore.from_state(random_state(2, 2, 16, dk, seed=8),
                                PrecisionPair.load(pair).with_buffer_len(6), "mamba2",
                                key_heads=1, seed=2, max_drafts=T)
    ref = st.clone()
    tol = 1e-5 if pair == "s32_rs" else 1e-2      # lossy copies: codes rounding either way
    A, D, dtb = mamba2_params(2, 3)
    for seed, t in ((1, None), (2, None), (3, T)):
        x, dt, Bm, C, z = mamba2_step_inputs(2, 1, 2, dk, 16, T=t, seed=seed)
        kw = dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D, z=z, dt_bias=dtb, state_indices=idx)
        if t is None:
            close(replay_mamba2_step(st, **kw), replay_mamba2_step_ref(ref, **kw), tol)
        else:
            y = replay_mamba2_verify(st, **kw, out=torch.full((2, T, 2, 16), float("nan")))
            close(y, replay_mamba2_verify_ref(ref, **kw), tol)
    assert torch.equal(st.committed, ref.committed) and st.pending_T == ref.pending_T == T


def test_rejected_drafts_change_nothing():
    """verify + accept(0) leaves anchor, read copy and every later output bit-identical."""
    T = 2
    init = random_state(N, H, DV, DK, seed=2)
    a = ReplayStore.from_state(init, resolve_pair("tp4_hi16_sr", 4), "gdn", key_heads=HK,
                               max_drafts=T)
    b = a.clone()
    kw, _, _ = inputs("gdn", None, seed=0)
    call(replay_gdn_step, a, kw)
    call(replay_gdn_step, b, kw)
    kwT, _, _ = inputs("gdn", T, seed=1)
    replay_gdn_verify(a, **kwT, state_indices=IDX)
    replay_accept(a, torch.zeros(IDX.shape[0], dtype=torch.long), IDX)
    for s in range(4):                               # through the next flush
        kw, _, _ = inputs("gdn", None, seed=10 + s)
        assert torch.equal(call(replay_gdn_step, a, kw), call(replay_gdn_step, b, kw))
    assert torch.equal(a.anchor.payload, b.anchor.payload)
    assert torch.equal(a.read.payload, b.read.payload)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", ["s32_rs", "s16_sr", "f4_sr_rs"])
def test_conventional_snapshot_verify(kind, pair):
    """Per-draft snapshots (vLLM's scheme): kernel vs reference vs ConventionalState, poisoned
    snapshot buffers, random accept counts (restore snapshot n; n = 0 leaves the state)."""
    T = 3
    P = PrecisionPair.load(pair)
    tol = 1e-5 if pair == "s32_rs" else 1e-3
    ver, ver_ref = FN[kind][4:]
    init = random_state(N, H, DV, DK, seed=41)
    cs = ConventionalStore.from_state(init, P.anchor.format, P.anchor.rounding, seed=8)
    ref = cs.clone()
    snaps, snaps_ref = make_snapshots(cs, T), make_snapshots(ref, T)
    snaps.payload.view(torch.uint8).fill_(0xFF)
    cst = ConventionalState(init, P, delta=kind == "gdn", seed=8)
    for rnd in range(3):
        kw, fe, post = inputs(kind, T, seed=rnd)
        out = torch.full((IDX.shape[0], T, H, DV), float("nan"))
        y = ver(cs, snaps, **kw, state_indices=IDX, out=out)
        assert y is out and torch.isfinite(y).all() and (y[~LIVE] == 0).all()
        y2 = ver_ref(ref, snaps_ref, **kw, state_indices=IDX)
        yr = cst.verify(*fe)
        if post is not None:
            yr = post(yr)
        close(y, y2, tol)
        close(y[PERM], yr, tol)
        n = _accepts(rnd, T)
        conventional_accept(cs, snaps, n, IDX)
        conventional_accept_ref(ref, snaps_ref, n, IDX)
        cst.accept(n[PERM])
        assert cs.n_flush.tolist() == ref.n_flush.tolist() == cst.n_flush.tolist()
    assert_states_close(cs.state.dequantize(), cst.anchor())
    assert_states_close(cs.state.dequantize(), ref.state.dequantize())


def test_verify_bad_inputs():
    st = ReplayStore.from_state(random_state(N, H, DV, DK), resolve_pair("s32_rs", 4), "gdn", key_heads=HK,
                                max_drafts=2)
    kw, _, _ = inputs("gdn", 3, seed=0)
    with pytest.raises(ValueError, match="max_drafts"):
        replay_gdn_verify(st, **kw, state_indices=IDX)
    with pytest.raises(ValueError, match="no drafts pending"):
        replay_accept(st, torch.zeros(5, dtype=torch.long), IDX)
    kw, _, _ = inputs("gdn", 2, seed=0)
    replay_gdn_verify(st, **kw, state_indices=IDX)
    with pytest.raises(ValueError, match="pending"):
        call(replay_gdn_step, st, inputs("gdn", None, seed=1)[0])
    with pytest.raises(ValueError, match="0..T=2"):
        replay_accept(st, torch.full((5,), 3), IDX)
    cs = ConventionalStore.from_state(random_state(N, H, DV, DK), "fp32")
    with pytest.raises(ValueError, match="make_snapshots"):
        conventional_gdn_verify(cs, make_snapshots(cs, 3), **kw, state_indices=IDX)


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", ["s32_rs", "tp8_hi32"])
def test_forced_flush_after_accept_fills_buffer(kind, pair):
    """A forced step (path='flush'; with a shared FP32 pair the flush starts from the read copy
    tile loaded before the pointers) on rows that an accept left with a full buffer (h = L):
    the pre-flush rewrites the anchor first and the step must fold on top of it, not on the
    tile loaded early. Kernel vs reference."""
    T, Lb = 3, 4
    step, step_ref, ver, ver_ref = FN[kind][:4]
    init = random_state(N, H, DV, DK, seed=5)
    st = ReplayStore.from_state(init, PrecisionPair.load(pair).with_buffer_len(Lb), kind,
                                key_heads=HK, seed=6, u_dtype=torch.float32, max_drafts=T)
    ref = st.clone()
    kw, _, _ = inputs(kind, None, seed=1)
    call(step, st, {**kw, "path": "replay"})
    call(step_ref, ref, {**kw, "path": "replay"})
    kw, _, _ = inputs(kind, T, seed=2)
    call(ver, st, kw)
    call(ver_ref, ref, kw)
    n = torch.full((IDX.shape[0],), T)
    replay_accept(st, n, IDX)
    replay_accept_ref(ref, n, IDX)
    assert set(st.committed.tolist()) == {Lb}
    kw, _, _ = inputs(kind, None, seed=3)
    y = call(step, st, {**kw, "path": "flush"})
    y2 = call(step_ref, ref, {**kw, "path": "flush"})
    close(y, y2, 1e-5)
    assert st.n_flush.tolist() == ref.n_flush.tolist() and min(st.n_flush.tolist()) >= 2
    assert_states_close(st.anchor.dequantize(), ref.anchor.dequantize())


@pytest.mark.parametrize("engine", ["triton", "torch"])
def test_verify_accept_operators(engine):
    """The custom operators replayquant::replay_verify / replay_accept (kernels.ops) give what the
    engine's functions give called directly, bit for bit (the Triton kernels; the torch engine's
    replay.engine step and reference verify / accept), steps between rounds through
    replayquant::replay_step; and
    torch.compile(fullgraph=True) traces a round of verify + accept as one graph with the eager
    outputs and store."""
    from replayquant.kernels import ops
    T = 2
    P = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(4)
    init = random_state(N, H, DV, DK, seed=32)
    st = ReplayStore.from_state(init, P, "gdn", key_heads=HK, seed=6, u_dtype=torch.float32,
                                max_drafts=T)
    direct, comp = st.clone(), st.clone()
    ver, acc = (replay_gdn_verify, replay_accept) if engine == "triton" else \
        (replay_gdn_verify_ref, replay_accept_ref)
    from replayquant.kernels.replay.engine import replay_gdn_step_torch
    step = replay_gdn_step if engine == "triton" else replay_gdn_step_torch
    meta = ops.store_meta(st, engine)

    def round_(store, kw, n):
        y = ops.replay_verify(store, kw, IDX, meta)
        ops.replay_accept(store, n, IDX, meta, check=False)
        return y

    compiled = torch.compile(round_, backend="eager", fullgraph=True)
    for rnd in range(3):
        kw, _, _ = inputs("gdn", T, seed=40 + rnd)
        n = _accepts(rnd, T).to(torch.int32)
        y = ops.replay_verify(st, kw, IDX, meta)
        ops.replay_accept(st, n, IDX, meta)
        assert torch.equal(y, call(ver, direct, kw))
        acc(direct, n, IDX)
        assert torch.equal(compiled(comp, kw, n), y)
        kw1, _, _ = inputs("gdn", None, seed=50 + rnd)
        y1 = ops.replay_step(st, kw1, IDX, "replay", meta)
        assert torch.equal(y1, call(step, direct, {**kw1, "path": "replay"}))
        ops.replay_step(comp, kw1, IDX, "replay", meta)
    for a, b, c in zip(ops.store_tensors(st), ops.store_tensors(direct), ops.store_tensors(comp)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    assert st.pending_T is None and comp.pending_T is None
