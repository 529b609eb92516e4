"""The torch decode step on the kernel's store (replay.engine) against its per-row reference
(replay.reference): GDN with fewer key heads than heads, Mamba-2 with groups, KDA; a shared FP32
pair, an SR anchor, an FP8 read copy and a shared NVFP4 pair; rows in different phases,
padding rows, flushes of every slot, buffers poisoned with NaN; every store tensor and the
outputs after every step, bit for bit; no host synchronisation; torch.compile(fullgraph=True)
gives the eager step."""

import pytest
import torch

from replayquant.policy import resolve_pair
from replayquant.testing import (gdn_params, gdn_step_inputs, kda_step_inputs,
                                 mamba2_params, mamba2_step_inputs, random_state)
from replayquant.hostsync import HostSyncCounter
from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import engine as rt
from replayquant.replay.stores import ReplayStore
from test_kernel_replay import assert_same_store, poison_buffers

PAIRS = ["s32_rs", "tp4_hi16_sr", "tp8_hi32", "f4_sr_rs"]
N, B, H, HK, D, L = 4, 3, 4, 2, 16, 4
# the slots of the batch rows at each step (-1: padding): slots drift out of phase, the last
# steps but three pads every row
SCHEDULE = [[0, 1, 2], [0, -1, 1], [3, 0, -1], [2, 3, 1], [-1, 2, 0], [1, 3, 2], [0, 1, 3],
            [2, -1, 0], [3, 1, 2], [0, 2, 3], [-1, -1, -1], [1, 0, 3], [2, 3, 1], [1, -1, 2]]
FNS = {"gdn": (rt.replay_gdn_step_torch, rr.replay_gdn_step_ref),
       "mamba2": (rt.replay_mamba2_step_torch, rr.replay_mamba2_step_ref),
       "kda": (rt.replay_kda_step_torch, rr.replay_kda_step_ref)}


def _store(kind, pair, max_drafts=0, u_dtype=None):
    st = ReplayStore.from_state(random_state(N, H, D, D, seed=5), resolve_pair(pair, L), kind, key_heads=HK,
                                seed=3, layer=1, max_drafts=max_drafts,
                                u_dtype=u_dtype)
    poison_buffers(st)
    return st


def _inputs(kind, seed):
    """(args, kwargs) of one step; gates near 1 (log decay in about [-0.1, 0]), so that the
    state remembers its entries and a wrong entry shows."""
    if kind == "gdn":
        return gdn_step_inputs(B, HK, H, D, D, seed=seed) + gdn_params(H, 1), {}
    if kind == "mamba2":
        x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, D, D, seed=seed)
        A, Dsk, dtb = mamba2_params(H, 1)
        return (x, dt, A, Bm, C), dict(D=Dsk, z=z, dt_bias=dtb)
    q, k, v, g, beta = kda_step_inputs(B, HK, H, D, D, seed=seed)
    return (q, k, v, g.clamp(min=-0.1), beta), {}


def _step(fn, store, kind, i, idx, **kw):
    args, kwargs = _inputs(kind, 100 + i)
    return fn(store, *args, state_indices=torch.tensor(idx), **kwargs, **kw)


@pytest.mark.parametrize("kind,pair,u_dtype",
                         [(k, p, None) for p in PAIRS for k in ("gdn", "mamba2", "kda")]
                         + [(k, "f4_sr_rs", torch.float32) for k in ("gdn", "kda")])
def test_torch_step_matches_reference(kind, pair, u_dtype):
    """14 steps of SCHEDULE (L = 4: every slot flushes at least twice, in different steps):
    outputs and the whole store equal the reference's after every step, and no step reads
    the device on the host. The pairs' stores fold the ring's u (s32_rs; f4_sr_rs with FP32 u:
    NVFP4 roles cast from a state built with the read steps' u) or solve for it (GDN: the key
    factors in Tbuf)."""
    store = _store(kind, pair, u_dtype=u_dtype)
    ref = store.clone()
    fn, fn_ref = FNS[kind]
    phases = set()
    for i, idx in enumerate(SCHEDULE):
        with HostSyncCounter(record_where=True) as c:
            y = _step(fn, store, kind, i, idx)
        y_ref = _step(fn_ref, ref, kind, i, idx)
        assert c.syncs == 0, c.where
        assert torch.equal(y, y_ref), (i, (y - y_ref).abs().max())
        assert_same_store(store, ref)
        phases.add(tuple(store.committed.tolist()))
    assert min(store.n_flush.tolist()) >= 2
    assert any(len(set(p)) > 2 for p in phases)      # rows in different phases


@pytest.mark.parametrize("pair", ["s32_rs", "tp4_hi16_sr"])
def test_torch_step_folds_accepted_drafts_flush_path_and_no_advance(pair):
    """Accepted drafts that fill the buffer (committed == L) are folded before the step (a
    second flush in one step where the step's entry fills the buffer again), path 'flush'
    flushes every row, advance=False leaves the pointers: all as the reference."""
    store = _store("gdn", pair, max_drafts=2)
    A_log, dtb = gdn_params(H, 1)
    idx = torch.tensor([0, 2, 3])
    for i in range(2):
        rr.replay_gdn_verify_ref(store, *gdn_step_inputs(B, HK, H, D, D, T=2, seed=10 + i),
                                 A_log, dtb, state_indices=idx)
        rr.replay_accept_ref(store, torch.tensor([2, 2, 1]), state_indices=idx)
    assert store.committed.tolist() == [L, 0, L, 2]
    ref = store.clone()
    fn, fn_ref = FNS["gdn"]
    for i, (idx, kw) in enumerate([([0, 1, 2], {}), ([3, -1, 1], {}), ([2, 0, 3], {}),
                                   ([1, 3, 0], dict(path="flush")),
                                   ([0, 1, 2], dict(advance=False))]):
        with HostSyncCounter() as c:
            y = _step(fn, store, "gdn", i, idx, **kw)
        assert c.syncs == 0
        assert torch.equal(y, _step(fn_ref, ref, "gdn", i, idx, **kw))
        assert_same_store(store, ref)
        assert store.last_force == ref.last_force == (kw.get("path") == "flush")


@pytest.mark.parametrize("pair", ["tp8_hi32", "f4_sr_rs"])
def test_torch_step_keeps_roles_of_non_finite_flush_tiles(pair):
    """A flushing row whose state turns NaN in some tiles keeps both roles' bytes there (FP8:
    per row tile; NVFP4: the whole matrix), as the reference."""
    store = _store("gdn", pair)
    ref = store.clone()
    fn, fn_ref = FNS["gdn"]
    for i in range(L):
        args, _ = _inputs("gdn", 100 + i)
        if i == L - 1:                         # the flush step: one element of v is NaN
            args[2][1, 0, 3] = float("nan")
        y = fn(store, *args, state_indices=torch.tensor([0, 1, 2]))
        y_ref = fn_ref(ref, *args, state_indices=torch.tensor([0, 1, 2]))
        torch.testing.assert_close(y, y_ref, rtol=0, atol=0, equal_nan=True)
        assert_same_store(store, ref)
    assert store.n_flush.tolist() == [1, 1, 1, 0]
    assert torch.isnan(y[1]).any() and torch.isfinite(store.anchor.dequantize([1])).all()


@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda"])
def test_torch_step_compiles_without_graph_break(kind):
    """torch.compile(fullgraph=True) traces the step (no graph break) and gives the eager step's
    outputs and store over steps with flushes and padding rows."""
    pair = "tp4_hi16_sr" if kind == "gdn" else "f4_sr_rs"
    store = _store(kind, pair)
    eager = store.clone()
    fn = FNS[kind][0]
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    for i, idx in enumerate(SCHEDULE[:6]):
        y = _step(compiled, store, kind, i, idx)
        assert torch.equal(y, _step(fn, eager, kind, i, idx))
        assert_same_store(store, eager)
    assert store.n_flush.any()


def test_torch_step_checks_like_the_kernel():
    store = _store("gdn", "s32_rs")
    with pytest.raises(ValueError, match="kind='mamba2'"):
        _step(rt.replay_mamba2_step_torch, store, "mamba2", 0, [0, 1, 2])
    args, _ = _inputs("gdn", 0)
    with pytest.raises(ValueError, match="bfloat16"):
        rt.replay_gdn_step_torch(store, args[0], args[1].float(), *args[2:])


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi16_sr"), ("mamba2", "f4_sr_rs"),
                                       ("kda", "s32_rs"), ("gdn", "s32_rs")])
def test_flush_rows_named_by_the_caller_change_nothing(kind, pair):
    """A step told which rows flush (`flushing`, as a patched model's decode store knows them on
    the host) runs the flush branch on those rows alone and gives the outputs and the store of
    a step that computes it for every row, bit for bit, over SCHEDULE's rows in different
    phases (steps where no row flushes, one does, several do); a float32 ring (the patched
    models' CPU path) as well as the kernel's bf16 ring."""
    for ring in (torch.bfloat16, torch.float32):
        store = ReplayStore.from_state(random_state(N, H, D, D, seed=5), resolve_pair(pair, L), kind, key_heads=HK,
                                       seed=3, layer=1, ring_dtype=ring)
        poison_buffers(store)
        told = store.clone()
        fn = FNS[kind][0]
        counts = set()
        for i, idx in enumerate(SCHEDULE):
            args, kwargs = _inputs(kind, 100 + i)
            args = tuple(t.to(ring) if j in ((1, 2) if kind != "mamba2" else (0, 3)) else t
                         for j, t in enumerate(args))
            si = torch.tensor(idx)
            rows = [r for r, s in enumerate(idx) if s >= 0 and int(told.committed[s]) + 1 == L]
            counts.add(len(rows))
            y = fn(store, *args, state_indices=si, **kwargs)
            y_told = fn(told, *args, state_indices=si, flushing=rows, **kwargs)
            assert torch.equal(y, y_told), (ring, i)
            assert_same_store(store, told)
        assert {0, 1} <= counts and max(counts) >= 2


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi16_sr"), ("mamba2", "s32_rs")])
def test_packed_store_steps_as_its_fields(kind, pair):
    """A packed store (ReplayStore.pack: every field a view of one byte buffer, which the
    operator takes alone) keeps its values bit for bit, its clone is packed too, and the
    operator replayquant::replay_step gives on it, eagerly and compiled (fullgraph, the
    operator receiving the one buffer), the outputs and store of the same step on the store
    of separate fields."""
    from replayquant.kernels import ops
    fields = _store(kind, pair)
    packed = fields.clone()
    packed.pack()
    assert_same_store(packed, fields)
    lo = packed.blob.data_ptr()
    hi = lo + packed.blob.numel()
    names, ts = packed.fields()
    assert len(ts) > 8 and all(lo <= t.data_ptr() < hi and t.is_contiguous() for t in ts)
    assert all((t.data_ptr() - lo) % 256 == 0 for t in ts)
    sent = ops.store_tensors(packed)
    assert len(sent) == 1 and sent[0] is packed.blob
    twin = packed.clone()
    assert twin.blob is not None and twin.blob.data_ptr() != lo
    assert_same_store(twin, packed)
    # packed into the buffer of a store of the same layout (a reused decode store): its
    # address, the same fields as in a buffer of its own
    spare = fields.clone()
    spare.pack()
    again, where = fields.clone(), spare.blob.data_ptr()
    spare.blob.fill_(7)                  # every field's bytes are written
    again.pack(into=spare.blob)
    assert again.blob.data_ptr() == where and again.blob_layout == packed.blob_layout
    assert_same_store(again, packed)
    with pytest.raises(ValueError, match="uint8 buffer of"):
        fields.clone().pack(into=spare.blob[:-256])
    names_in = ops._INPUTS[kind]
    meta = ops.store_meta(packed, "torch")

    def step(store, ins, idx):
        return ops.replay_step(store, ins, idx, meta=meta if store.blob is not None
                               else ops.store_meta(store, "torch"))

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for i, idx in enumerate(SCHEDULE[:7]):
        args, kw = _inputs(kind, 100 + i)
        ins = dict(zip(names_in, args + ((kw["dt_bias"],) if kind == "mamba2" else ())))
        idx = torch.tensor(idx)
        y = step(fields, ins, idx)
        assert torch.equal(step(packed, ins, idx), y)
        assert torch.equal(compiled(twin, ins, idx), y)
        assert_same_store(packed, fields)
        assert_same_store(twin, fields)
    assert fields.n_flush.any()
