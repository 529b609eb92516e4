"""A role that overflows at a flush (an FP16 anchor or read copy past 65504) is one error at that
flush, naming layer, batch row, step and format and what to do, with the state left as it was:
on the reference ReplayState (and the conventional baseline, its L = 1 case), the chunked scan's
torch reference and the Triton chunk kernel (interpreter). Tiny shapes: about a second each."""

import pytest
import torch

from replayquant.kernels.chunk import kernel as chunk
from replayquant.kernels.chunk.reference import chunk_scan_ref, initial_scan_state, teacher_force
from replayquant.pairs import FormatSpec, PrecisionPair
from replayquant.replay import ConventionalState, ReplayState

L, T, DK, DV = 4, 7, 16, 16
FP16_READ = PrecisionPair(FormatSpec("fp16"), FormatSpec("fp32"), L, "fp16read")
PAIRS = {"tp4_hi16_sr": ("anchor", PrecisionPair.load("tp4_hi16_sr").with_buffer_len(L)),
         "s16_sr": ("anchor", PrecisionPair.load("s16_sr").with_buffer_len(L)),
         "fp16read": ("read copy", FP16_READ)}


def _inputs(delta: bool, big: float = 1e6):
    """[2, T, 1, ...] inputs whose row 1 builds a state past FP16's 65504 by the first flush
    (token L - 1); row 0 stays small."""
    g = torch.Generator().manual_seed(3)
    q = torch.nn.functional.normalize(torch.randn(2, T, 1, DK, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.rand(2, T, 1, DK, generator=g) + 1, dim=-1)
    v = torch.rand(2, T, 1, DV, generator=g) + 1
    v[1] *= big
    la = -0.01 * torch.rand(2, T, 1, generator=g)
    beta = torch.ones(2, T, 1) if delta else None
    return q, k, v, la, beta


def _snapshot(st):
    """What a ReplayState holds: its roles, counters and committed buffer entries (slots past
    the committed count are ignored by every step)."""
    p = st.export()
    h = int(p["committed"].max())
    out = {"anchor": st.anchor(), "read": st.read_copy(), "committed": p["committed"],
           "n_flush": p["n_flush"]}
    out.update({n: p[n][:, :, :h] for n in ("k", "v", "G", "beta", "u") if p[n] is not None})
    return {n: t.clone() for n, t in out.items()}


def _unchanged(before, st):
    after = _snapshot(st)
    return all(torch.equal(before[n], after[n]) for n in before)


def _message(role, fmt, where):
    return rf"layer 5: the {role} \({fmt} of pair \S+\) overflows at the flush of {where}, " \
           rf"batch row 1 \(sequence 1\).*larger than {fmt} holds.*unchanged.*wider format.*" \
           rf"fp32.*bf16.*activations"


@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("name", list(PAIRS))
def test_replay_state_names_the_overflowing_flush(name, delta):
    role, pair = PAIRS[name]
    fmt = (pair.anchor if role == "anchor" else pair.read).format
    q, k, v, la, beta = _inputs(delta)
    st = ReplayState(torch.zeros(2, 1, DV, DK), pair, delta=delta, layer=5)
    for t in range(L - 1):
        y = st.step(q[:, t], k[:, t], v[:, t], la[:, t], None if beta is None else beta[:, t])
        assert torch.isfinite(y).all()
    before = _snapshot(st)
    t = L - 1
    with pytest.raises(ValueError, match=_message(role, fmt, f"step {L} of this state")):
        st.step(q[:, t], k[:, t], v[:, t], la[:, t], None if beta is None else beta[:, t])
    assert _unchanged(before, st)


@pytest.mark.parametrize("scan", ["ref", "triton"])
@pytest.mark.parametrize("delta", [False, True])
def test_chunked_scan_names_the_overflowing_flush(scan, delta):
    role, pair = PAIRS["tp4_hi16_sr"]
    q, k, v, la, beta = _inputs(delta)
    st = ReplayState(torch.zeros(2, 1, DV, DK), pair, delta=delta, layer=5)
    before = _snapshot(st)
    where = f"token {L - 1} of this {T}-token segment"
    with pytest.raises(ValueError, match=_message(role, "fp16", where)):
        teacher_force(st, q, k, v, la, beta, scan=chunk.chunk_scan if scan == "triton" else None)
    assert _unchanged(before, st)
    # a row whose state fits goes through
    y, _ = chunk_scan_ref(initial_scan_state((1, 1, DV, DK), pair, delta=delta), q[:1], k[:1],
                          v[:1], la[:1], None if beta is None else beta[:1], pair=pair)
    assert torch.isfinite(y).all()


def test_exact_prefill_cast_that_overflows_is_named():
    pair = PAIRS["s16_sr"][1]
    q, k, v, la, _ = _inputs(False)
    ss = initial_scan_state((2, 1, DV, DK), pair, delta=False)
    with pytest.raises(ValueError, match=_message("anchor", "fp16", "the end of this 7-token "
                                                   "segment \\(prefill=exact\\)")):
        chunk_scan_ref(ss, q, k, v, la, pair=pair, layer=5, exact=True)


def test_conventional_state_names_the_overflowing_step():
    pair = PAIRS["s16_sr"][1]
    q, k, v, la, _ = _inputs(False)
    st = ConventionalState(torch.zeros(2, 1, DV, DK), pair, delta=False, layer=5)
    with pytest.raises(ValueError, match=_message("state", "fp16", "step 1 of this state")):
        st.step(q[:, 0], k[:, 0], v[:, 0], la[:, 0])
    assert torch.equal(st.n_flush, torch.zeros(2, dtype=torch.int64))


def test_patched_model_names_the_overflowing_flush_not_the_next_layers_inputs():
    """Through a patched model's prompt forward: the first recurrent layer's FP16 anchor
    overflows at its first flush (its input scaled by 1e6), and the error names that layer and
    flush rather than the NaN the next layer would see."""
    from replayquant.models import load_model, recurrent_layers
    model = load_model("tiny-qwen3.5", PrecisionPair.load("s16_sr").with_buffer_len(L),
                       dtype="float32")
    _, layer, _ = recurrent_layers(model)[0]

    def scale(mod, args, kwargs):
        h = (args[0] if args else kwargs["hidden_states"]) * 1e6
        return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
    layer.register_forward_pre_hook(scale, with_kwargs=True)
    with pytest.raises(ValueError, match=rf"layer {layer.layer_idx}: the anchor \(fp16 of pair "
                                         rf"s16_sr\) overflows at the flush of token {L - 1} of "
                                         rf"this 12-token segment, batch row 0"):
        model(torch.arange(3, 15).view(1, 12))


@pytest.mark.parametrize("scan", ["state", "ref"])
def test_state_past_fp32_range_is_named_at_its_flush(scan):
    """Finite inputs whose state outgrows FP32 itself: named at the flush, not refused by the
    format's cast without saying where."""
    pair = PrecisionPair.load("s32_rs").with_buffer_len(L)
    q, k, v, la, _ = _inputs(False, big=1.6e38)             # v up to 3.2e38: finite
    k = 4 * k                                               # Mamba-2's B: not normalised
    msg = (r"layer 5: the rebuilt state of pair \S+ overflows at the flush of {}, batch row 1 .*"
           r"not finite in FP32.*activations")
    st = ReplayState(torch.zeros(2, 1, DV, DK), pair, delta=False, layer=5)
    if scan == "ref":
        at = f"token {L - 1} of this {T}-token segment"
        with pytest.raises(ValueError, match=msg.format(at)):
            teacher_force(st, q, k, v, la)
        return
    for t in range(L - 1):
        st.step(q[:, t], k[:, t], v[:, t], la[:, t])
    with pytest.raises(ValueError, match=msg.format(f"step {L} of this state")):
        st.step(q[:, L - 1], k[:, L - 1], v[:, L - 1], la[:, L - 1])


# ------------------------------------------------------------------------------ decode stores

def _decode_fns(kind):
    """(Triton kernel, torch engine, torch reference) decode steps of `kind`."""
    from replayquant.kernels.replay import decode as rd
    from replayquant.kernels.replay import reference as rr
    from replayquant.kernels.replay import engine as rt
    return tuple(getattr(m, f"replay_{kind}_step{s}")
                 for m, s in ((rd, ""), (rt, "_torch"), (rr, "_ref")))


def _decode_inputs(kind, step, big=1e7):
    """(args, kwargs) of one decode step of two batch rows, one head, d = 16, gates near 1: row
    1's v (Mamba-2: x) `big` times larger, so that its state passes FP16's 65504 by the first
    flush; row 0 stays small."""
    from replayquant.testing import (gdn_params, gdn_step_inputs, kda_step_inputs,
                                     mamba2_params, mamba2_step_inputs)
    if kind == "mamba2":
        x, dt, Bm, C, _ = mamba2_step_inputs(2, 1, 1, DK, DV, seed=step, z=False)
        x[1] *= big
        A, D, dtb = mamba2_params(1, 0)
        return (x, dt, A, Bm, C), dict(D=D, dt_bias=dtb)
    if kind == "kda":
        q, k, v, g, beta = kda_step_inputs(2, 1, 1, DK, DV, seed=step)
        v[1] *= big
        return (q, k, v, g.clamp(min=-0.1), beta), {}
    q, k, v, a, b = gdn_step_inputs(2, 1, 1, DK, DV, seed=step)
    v[1] *= big
    return (q, k, v, a, b) + gdn_params(1, 0), {}


def _role_bytes(store, slot):
    return [t[slot].view(torch.uint8).clone() for r in (store.anchor, store.read) if r is not None
            for t in (r.payload, r.scale, r.gscale) if t is not None]


@pytest.mark.parametrize("kind,name", [("gdn", "tp4_hi16_sr"), ("gdn", "s16_sr"),
                                       ("gdn", "fp16read"), ("mamba2", "tp4_hi16_sr"),
                                       ("kda", "tp4_hi16_sr")])
def test_decode_flush_whose_cast_overflows_keeps_the_roles_and_notes_the_step(kind, name):
    """A decode store whose batch row 1 (in slot 0) builds a state past FP16's range by its first
    flush (step L): the Triton kernel (interpreter), the torch engine and the torch reference
    keep that row's anchor and read copy as they were (finite), write row 0's, and note step L
    in the fault record's flush-cast column, no input column; the engine and the reference
    agree bit for bit."""
    from replayquant.testing import random_state
    from replayquant.replay.stores import FAULT_INPUTS, FaultRecord, ReplayStore
    from test_kernel_replay import assert_same_store
    _, pair = PAIRS[name]
    fns = _decode_fns(kind)
    store = ReplayStore.from_state(random_state(2, 1, DV, DK, seed=4), pair, kind, seed=2,
                                   layer=5)
    stores = [store, store.clone(), store.clone()]
    records = [FaultRecord.empty(kind, 2, "cpu") for _ in fns]
    idx = torch.tensor([1, 0])
    before = [_role_bytes(store, s) for s in (0, 1)]
    for step in range(L + 1):
        args, kw = _decode_inputs(kind, step)
        for fn, st, rec in zip(fns, stores, records):
            assert torch.isfinite(fn(st, *args, state_indices=idx, record=rec, **kw)).all()
        if step == L - 1:
            for st in stores:
                assert st.n_flush.tolist() == [1, 1]
                assert all(map(torch.equal, _role_bytes(st, 0), before[0]))     # kept
                assert not all(map(torch.equal, _role_bytes(st, 1), before[1]))  # written
    for st, rec in zip(stores, records):
        for r in (st.anchor, st.read):
            assert r is None or torch.isfinite(r.dequantize()).all()
        n = len(FAULT_INPUTS[kind])
        assert rec.bad[:, n:].tolist() == [[-1], [L]] and (rec.bad[:, :n] < 0).all()
        assert rec.steps.tolist() == [L + 1, L + 1] and not rec.flag.any()
    assert_same_store(stores[1], stores[2])


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.slow), "torch"])
def test_patched_decode_names_the_overflowing_flush_at_the_next_forward(backend):
    """A patched tiny-qwen3.5 (s16_sr, L = 4) whose first recurrent layer's decode inputs in
    batch row 1 are scaled by 1e8: its FP16 anchor would overflow at the first decode flush
    (decode step 3 after a 5-token prompt); the step keeps the roles and notes it on the device,
    and the next multi-token forward raises that overflow, naming the layer, the decode step and
    the row, not the inputs. Both engines: the Triton kernel (interpreter, a bf16 model) and the
    torch engine (float32)."""
    import warnings

    from transformers import DynamicCache

    from replayquant import options
    from replayquant.kl.lockstep import cache_kwarg
    from replayquant.models import load_model, recurrent_layers, runtime
    dtype = "bfloat16" if backend == "triton" else "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("tiny-qwen3.5", PrecisionPair.load("s16_sr").with_buffer_len(L),
                           dtype=dtype)
    _, layer, _ = recurrent_layers(model)[0]

    def scale(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        if h.shape[1] == 1:                                 # decode steps only
            h = h.clone()
            h[1] *= 1e8
        return ((h,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h})
    layer.register_forward_pre_hook(scale, with_kwargs=True)
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        with options.override(backend="torch"):             # the prompt: L + 1 tokens
            tok = model(torch.arange(3, 8).view(1, 5).repeat(2, 1), **kw).logits[:, -1:].argmax(-1)
        with options.override(backend=backend):
            for _ in range(L):
                tok = model(tok, **kw).logits[:, -1:].argmax(-1)
            st = getattr(cache.layers[layer.layer_idx], runtime.STATE_ATTR)
            assert st.engine == backend
            assert torch.isfinite(st.anchor.dequantize()).all()
            with pytest.raises(ValueError, match=rf"layer {layer.layer_idx}: the anchor \(fp16 of "
                                                 rf"pair s16_sr\) overflows at the flush of decode "
                                                 rf"step 3 after the prompt, batch row 1 .*larger "
                                                 rf"than fp16 holds.*wider format"):
                model(torch.ones(2, 3, dtype=torch.long), **kw)
