"""A decode step notes which inputs of which rows held NaN or infinity (`FaultRecord`) inside
its own launches: the Triton kernel (interpreter; a read step, a flush step of the flush launch
and of the one-launch form) against its torch reference and the torch engine, for GDN, Mamba-2
and KDA, padding rows noting nothing; on CUDA too where there is one (the GPU's atomics and
memory order; evals/gpu_runs.sh decode runs it); then the record's errors."""

import pytest
import torch

from replayquant.testing import kda_step_inputs, random_state
from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import engine as rt
from replayquant.kernels.replay.decode import replay_gdn_step, replay_kda_step, replay_mamba2_step
from replayquant.kernels.replay.launch import override_replay_launch
from replayquant.replay.stores import FAULT_COLUMNS, FAULT_INPUTS, FaultRecord, ReplayStore
from replayquant.policy import resolve_pair
from test_kernel_replay import Driver, poison_buffers

B, HK, H, DK, DV = 4, 1, 2, 32, 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (step, batch row, input index in FAULT_INPUTS order, value): rows flush at step 2 (L = 3)
POISON = [(0, 0, 0, float("nan")), (1, 3, 3, -float("inf")), (2, 2, 4, float("inf")),
          (2, 0, 2, float("nan")), (3, 0, 0, float("nan")), (4, 2, 1, float("nan"))]


class _Kda:
    """Driver's interface for KDA (inputs q, k, v, g, beta)."""

    def inputs(self, seed):
        return kda_step_inputs(B, HK, H, DK, DV, seed=seed)

    def step(self, fn, store, inp, idx, **kw):
        return fn(store, *inp, state_indices=idx, path="replay", **kw)


def _kernel_order(kind):
    """Position i of FAULT_INPUTS[kind] -> the index of that input in the drivers' tuples."""
    if kind == "mamba2":                 # Driver: x, dt, A, B, C, D, z, dt_bias
        return {0: 4, 1: 3, 2: 0, 3: 1}
    return {i: i for i in range(len(FAULT_INPUTS[kind]))}


def _poisoned(kind, inp, step):
    inp = list(inp)
    at = _kernel_order(kind)
    for s, row, i, val in POISON:
        if s == step and i < len(FAULT_INPUTS[kind]):
            t = inp[at[i]] = inp[at[i]].clone()
            t[row].view(-1)[-1] = val
    return tuple(inp)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,pair,fused", [("gdn", "tp4_hi16_sr", False),
                                             ("gdn", "s32_rs", True),
                                             ("mamba2", "tp8_hi32", False),
                                             ("kda", "s32_rs", False)])
def test_step_notes_nonfinite_inputs_as_its_reference(kind, pair, fused, device):
    if kind == "kda":
        dr, fns = _Kda(), (replay_kda_step, rr.replay_kda_step_ref, rt.replay_kda_step_torch)
    else:
        dr = Driver(kind, B, HK, H, DK, DV)
        fns = (replay_gdn_step, rr.replay_gdn_step_ref, rt.replay_gdn_step_torch) \
            if kind == "gdn" else \
            (replay_mamba2_step, rr.replay_mamba2_step_ref, rt.replay_mamba2_step_torch)
    store = ReplayStore.from_state(random_state(B, H, DV, DK, seed=4).to(device),
                                   resolve_pair(pair, 3), kind, key_heads=HK, seed=2, layer=0)
    poison_buffers(store)
    stores = [store, store.clone(), store.clone()]
    records = [FaultRecord.empty(kind, B + 1, device) for _ in fns]
    idx = torch.tensor([2, 0, 3, 1, -1], device=device)     # batch row 4 pads
    for step in range(5):
        inp = dr.inputs(seed=70 + step)
        inp = tuple(torch.cat([t, t[:1]]) if t.dim() and t.shape[0] == B else t for t in inp)
        inp = _poisoned(kind, tuple(t.to(device) for t in inp), step)
        for fn, st, rec in zip(fns, stores, records):
            with override_replay_launch({"fused": fused} if fn is fns[0] else {}):
                dr.step(fn, st, inp, idx, record=rec)
    want = torch.full((B + 1, len(FAULT_COLUMNS[kind])), -1)      # no flush cast overflows
    for s, row, i, _ in POISON:
        if i < len(FAULT_INPUTS[kind]) and want[row, i] < 0:
            want[row, i] = s + 1
    for rec in records:
        assert torch.equal(rec.bad.cpu(), want)
        assert rec.steps.tolist() == [5, 5, 5, 5, 0]
        assert not rec.flag.any()


def test_record_errors():
    """A record of the wrong shape or dtype, or on a step that does not move its pointers, is one
    clear error before anything is launched."""
    dr = Driver("gdn", B, HK, H, DK, DV)
    store = ReplayStore.from_state(random_state(B, H, DV, DK, seed=4), resolve_pair("s32_rs", 3),
                                   "gdn", key_heads=HK, seed=2)
    inp, idx = dr.inputs(seed=1), torch.arange(B)
    wrong = FaultRecord.empty("mamba2", B, "cpu")
    for fn in (replay_gdn_step, rr.replay_gdn_step_ref, rt.replay_gdn_step_torch):
        with pytest.raises(ValueError, match=r"fault record's bad must be .*\[4, 6\]"):
            dr.step(fn, store, inp, idx, record=wrong)
        with pytest.raises(ValueError, match="moves its pointers"):
            dr.step(fn, store, inp, idx, record=FaultRecord.empty("gdn", B, "cpu"),
                    advance=False)
    assert not store.committed.any()
