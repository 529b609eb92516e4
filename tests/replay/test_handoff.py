"""The hand-off form of a layer's state (`replay.handoff.ScanState`) and its conversions
(`replay.convert`): a ReplayState's export is its ScanState, readable by part name; a store goes
to a ScanState and back bit for bit; the raw ring entries follow a segment in buffer order."""

import torch

from replayquant.formats import QTensor
from replayquant.policy import resolve_pair
from replayquant.replay import ReplayState, ScanState, convert
from replayquant.replay.handoff import PART_NAMES, append_raw, take_rows
from replayquant.replay.roles import PackedRole


def _state(pair="tp4_hi16_sr", B=3, H=2, D=16, L=4, steps=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    st = ReplayState(torch.randn(B, H, D, D, generator=g), resolve_pair(pair, L), delta=True,
                     seed=2, layer=1)
    for _ in range(steps):
        q, k, v = (torch.nn.functional.normalize(torch.randn(B, H, D, generator=g), dim=-1)
                   for _ in range(3))
        st.step(q, k, v, -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g))
    return st


def test_export_is_the_scan_state_read_by_part_name():
    st = _state()
    ss = st.export()
    assert isinstance(ss, ScanState) and list(ss) == list(PART_NAMES)
    assert ss["anchor"] is ss.anchor and ss["flushes"] is ss.n_flush
    assert (ss.pair, ss.seed, ss.layer) == (st.pair, 2, 1)
    assert torch.equal(ss.committed, st.committed) and torch.equal(ss.n_flush, st.n_flush)


def test_one_packed_type():
    """A format's quantize and a store's roles are the same class."""
    assert PackedRole is QTensor
    st = _state()
    store, _ = convert.state_to_store(st, 2)
    assert type(store.anchor) is type(st.anchor_q) is QTensor
    assert st.read_q.scales.keys() == {"block", "matrix"}
    assert store.read.scales["block"] is store.read.scale


def test_store_to_scan_and_back_is_bit_for_bit():
    st = _state(pair="tp8_hi32", steps=5)
    store, idx = convert.state_to_store(st, 2, ring_dtype=torch.float32)
    ss = convert.store_to_scan(store, idx.long(), st.pair, st.seed, st.layer, with_u=True)
    again, idx2 = convert.scan_to_store(ss, 2, ring_dtype=torch.float32)
    assert torch.equal(idx, idx2)
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    for name, a, b in zip(*store.fields(), again.fields()[1]):
        if name == "kbuf":              # the raw keys: the committed entries (zeros after them)
            n = int(store.committed.min())
            a, b = a[:, :n], b[:, :n]
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name
    back = convert.to_replay_state(ss)
    assert torch.equal(back.anchor(), st.anchor()) and torch.equal(back.n_flush, st.n_flush)


def test_raw_entries_follow_the_buffer():
    """append_raw keeps the last `after` of the buffered and new valid entries, in buffer
    order, zeros after; padding takes no entry."""
    L = 4
    raw = {"k": torch.tensor([[1.0, 2.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]])[..., None]}
    committed = torch.tensor([2, 1])
    new = {"k": torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])[..., None]}
    valid = torch.tensor([[True, True, True], [False, True, True]])
    after = torch.tensor([1, 3])                # row 0 flushed once (5 entries: 1 left)
    out = append_raw(raw, committed, new, valid, after, L)["k"][..., 0]
    assert out.tolist() == [[12.0, 0.0, 0.0, 0.0], [5.0, 21.0, 22.0, 0.0]]


def test_take_rows_reorders_every_part():
    ss = _state().export()
    ids = torch.tensor([2, 2, 0])
    got = take_rows(ss, ids)
    assert torch.equal(got.state_indices, ss.state_indices[ids]) and torch.equal(got.u, ss.u[ids])
    assert torch.equal(got.anchor.payload.view(3, -1), ss.anchor.payload.view(3, -1)[ids])
    assert got.n_slots is None
