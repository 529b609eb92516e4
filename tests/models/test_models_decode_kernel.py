"""Decode of patched HF models through the Triton replay decode kernel (interpreter mode on the
CPU, REPLAYQUANT_BACKEND=triton) against the torch path (ReplayState.step), on tiny random
models built from the real config classes; and the explicit ReplayState <-> ReplayStore hand-off.

Tolerance. The models are bf16, as the kernel serves them: its ring keeps k, v (Mamba-2: B, x)
in bf16, which holds a bf16 model's activations exactly (a float32 model runs the torch engine,
`decode_path`), and GDN's u in bf16 beside a separate read copy by design (half the buffer's
bytes), while the torch engine keeps u in FP32. The two paths run the same step semantics (same
flush schedule, same casts, same SR streams); a layer's output y differs by float32
reassociation (~1e-6) and, with a separate read copy, by u's bf16 rounding (relative 2^-9), and
each layer rounds y to bf16, where a reassociation can flip one rounding. After the norm and
projections this is a relative logit error of a few units of 2^-9 (4.3 measured on the
continuation of tiny Qwen3.5); we allow |d logits| <= 8 * 2^-9 * max|logits| (RTOL_BF16 below)
and print what we measure. The float32 exactness of both engines is tests/models/test_decode_exact.py's
(2e-6 of a float64 loop, layer by layer). With an NVFP4
read copy a second effect appears: the bf16-perturbed state that a flush casts can round a few
elements to the neighbouring E2M1 value; the layer-level test bounds those rare outliers by a
quarter of the pair's own effect (its distance from the FP32 pair), as tests/models/test_models.py does
for teacher forcing. Greedy tokens must be equal; the test prints, at every generated position,
twice the observed logit difference over the reference's top-1 / top-2 gap (a bf16 model's
logits can be one unit of bf16 apart).
"""

import math
import warnings
from dataclasses import replace

import pytest
import torch

from replayquant.formats import as_bits
from replayquant.models import decode_path, patch, recurrent_layers, unpatch
from replayquant.models import decode_store as ds
from replayquant.models import runtime
from replayquant.replay import ReplayState, convert

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 96
BUFFER_LEN = 4
NEW_TOKENS = 6             # 5 decode steps after the prompt's token: a flush in each row's decode
RTOL_BF16 = 8 * 2.0 ** -9  # relative logit bound of a bf16 model (module doc)
PAIRS = ("s32_rs", "tp4_hi32")
DT_FLOOR = 0.5             # the tiny Nemotron-H's time_step_min (its dt clamp floor)


def _model(fam: str):
    from transformers import AutoModelForCausalLM, Mamba2Config, NemotronHConfig, Qwen3_5TextConfig
    torch.manual_seed({"qwen3_5": 11, "mamba2": 12}.get(fam, 13))
    if fam == "nemotron_h":
        # NemotronHMamba2Mixer clamps dt to time_step_limit = (time_step_min, inf): a floor of
        # 0.5 clamps the heads whose softplus(dt + dt_bias) falls below it (see _clamped)
        cfg = NemotronHConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3,
                              hybrid_override_pattern="M*M", mamba_num_heads=8, mamba_head_dim=16,
                              ssm_state_size=16, n_groups=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=32, intermediate_size=96,
                              chunk_size=8, time_step_min=DT_FLOOR)
    elif fam == "qwen3_5":
        cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=64, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
                                linear_num_value_heads=4, linear_key_head_dim=16,
                                linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                intermediate_size=96, num_hidden_layers=3,
                                layer_types=["linear_attention", "linear_attention", "full_attention"])
    else:
        cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8,
                           head_dim=16, state_size=16, n_groups=2, expand=2, chunk_size=8)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for _, mod, kind in recurrent_layers(m):
            if kind == "mamba2":          # make the random Mamba-2 state matter (as test_models)
                mod.dt_bias.uniform_(-1.0, 0.5)
                mod.in_proj.weight.mul_(0.1 / mod.in_proj.weight.std())
            else:                         # random A_log decays the GDN state within a few steps
                mod.A_log.uniform_(-4.0, -2.0)
    return m.to(torch.bfloat16)     # the kernel's ring holds a bf16 model's activations exactly


@pytest.fixture(scope="module")
def models():
    return {fam: _model(fam) for fam in ("qwen3_5", "mamba2", "nemotron_h")}


def _batch(B=3, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :2] = 0                      # ragged, left-padded
    mask[2, :3] = 0
    return ids, mask


def _generate(model, ids, mask):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             use_cache=True)
    cache = next(c for n in ("past_key_values", "cache_params", "cache")
                 if (c := getattr(out, n, None)) is not None)
    return out.sequences, torch.stack(out.scores, 1), cache


def _spy(monkeypatch):
    """Count kernel decode steps and hand-offs."""
    from replayquant.kernels.replay import decode as rd
    calls = {"kernel": 0, "to_store": 0, "to_state": 0}

    def wrap(mod, name, key):
        orig = getattr(mod, name)

        def f(*a, **k):
            calls[key] += 1
            return orig(*a, **k)
        monkeypatch.setattr(mod, name, f)
    wrap(rd, "replay_gdn_step", "kernel")
    wrap(rd, "replay_mamba2_step", "kernel")
    wrap(ds, "scan_to_store", "to_store")
    wrap(ds, "store_to_scan", "to_state")
    return calls


# ------------------------------------------------------------------------------ path function

def test_decode_path(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    assert decode_path(x, 16, 16) == "torch"
    monkeypatch.delenv("REPLAYQUANT_BACKEND")
    assert decode_path(x, 16, 16) == "torch"          # CPU tensors, auto
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    assert decode_path(x, 16, 32) == "triton"
    assert decode_path(x, 16, 32, dt_limit=(0.0, math.inf)) == "triton"
    p = decode_path(x, 12, 16)
    assert p.startswith("torch (") and "d_k=12" in p
    assert decode_path(x, 16, 16, dt_limit=(0.0, 10.0)) == "triton"    # the kernel clamps dt
    assert decode_path(x, 16, 16, dt_limit=(1e-3, math.inf)) == "triton"
    with pytest.raises(ValueError, match="dt_limit"):
        decode_path(x, 16, 16, dt_limit=(1.0, 0.5))


# ------------------------------------------------------------------------------ hand-off

def _random_state_inputs(delta, B, H, HK, dk, dv, g):
    """Raw inputs of one step (bf16-representable k, v) in the kernel's API, and the same step
    mapped for ReplayState."""
    from replayquant.replay import gdn_inputs, mamba2_inputs
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if delta:
        q, k = r(B, HK, dk), r(B, HK, dk).bfloat16().float()
        v = r(B, H, dv).bfloat16().float()
        a, b = r(B, H), r(B, H)
        A_log, dt_bias = r(H) * 0.3, r(H) * 0.3
        gl = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)
        mapped = gdn_inputs(q, k, v, gl, b)
        raw = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    else:
        x = r(B, H, dv).bfloat16().float()
        dt = r(B, H)
        A = -torch.rand(H, generator=g) - 0.2
        Bm, Cm = (r(B, HK, dk) * 0.3).bfloat16().float(), r(B, HK, dk) * 0.3
        dt_bias = r(H) * 0.3
        mapped = mamba2_inputs(x, dt, A, Bm, Cm, dt_bias) + (None,)
        raw = dict(x=x, dt=dt, A=A, B=Bm, C=Cm, dt_bias=dt_bias)
    return raw, mapped


@pytest.mark.parametrize("kind", ["gdn", "mamba2"])
@pytest.mark.parametrize("pair", PAIRS)
def test_hand_off_round_trip_and_steps(monkeypatch, kind, pair):
    """ReplayState -> ReplayStore -> ReplayState keeps the packed anchor / read copy bit for bit
    and the committed entries (bf16-rounded); kernel steps from the converted store across two
    flushes follow ReplayState.step; converting back mid-window and continuing with
    ReplayState.step follows the kernel."""
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    delta = kind == "gdn"
    B, H, HK, dk, dv, L = 3, 4, 2, 16, 16, BUFFER_LEN
    g = torch.Generator().manual_seed(5)
    from replayquant.pairs import PrecisionPair
    pr = PrecisionPair.load(pair).with_buffer_len(L)
    st = ReplayState(torch.randn(B, H, dv, dk, generator=g) * 0.5, pr, delta=delta, seed=3, layer=1)
    ref = ReplayState(torch.zeros(B, H, dv, dk), pr, delta=delta, seed=3, layer=1)
    for _ in range(L + 2):                       # one flush, then 2 committed entries
        _, mapped = _random_state_inputs(delta, B, H, HK, dk, dv, g)
        st.step(*mapped)
    ref.load(st.export())
    kst = ds.from_state(st, HK)
    back = ds.to_replay_state(kst)
    a, b = st.export(), back.export()
    for role in ("anchor", "read"):
        if a[role] is None:
            assert b[role] is None
            continue
        assert torch.equal(a[role].payload.view(torch.uint8), b[role].payload.view(torch.uint8))
        for n in a[role].scales:
            assert torch.equal(a[role].scales[n], b[role].scales[n])
    assert torch.equal(a["committed"], b["committed"]) and torch.equal(a["n_flush"], b["n_flush"])
    assert torch.equal(a["state_indices"], b["state_indices"])
    h = int(a["committed"][0])
    assert h == 2
    for n in ("k", "v", "G") + (("beta", "u") if delta else ()):
        torch.testing.assert_close(b[n][:, :, :h], a[n][:, :, :h], rtol=2.0 ** -8, atol=1e-6)

    # kernel steps from the converted store vs ReplayState.step: across two flushes. For an
    # NVFP4 read copy the bf16 entries perturb the state a flush casts, which may round a few
    # elements to the neighbouring E2M1 value: bound those outliers by a quarter of the pair's
    # own effect (its difference from the FP32 pair on the same inputs), the rest by the bf16 bound
    twin = ReplayState(st.anchor(), PrecisionPair.load("s32_rs").with_buffer_len(L), delta=delta)
    twin.load({**st.export(), "read": None, "u": None, "anchor": twin.export()["anchor"]})
    worst, outliers, effect = 0.0, 0.0, 0.0
    for i in range(2 * L):
        raw, mapped = _random_state_inputs(delta, B, H, HK, dk, dv, g)
        y_k = ds.step(kst, raw)
        y_r = ref.step(*mapped)
        scale = y_r.abs().max().item()
        d = (y_k - y_r).abs()
        worst = max(worst, d.max().item() / scale)
        outliers = max(outliers, (d > RTOL_BF16 * scale).float().mean().item())
        effect = max(effect, (twin.step(*mapped) - y_r).abs().max().item() / scale)
        if i == L:                               # back to the torch reference mid-window
            ref2 = ds.to_replay_state(kst)
            assert torch.equal(ref2.committed, ref.committed)
            assert torch.equal(ref2.n_flush, ref.n_flush)
    assert torch.equal(kst.n_flush[:B], ref.n_flush)
    print(f"{kind} {pair}: kernel vs ReplayState max relative {worst:.2e}, elements above the "
          f"bf16 bound {outliers:.1%}, pair effect {effect:.2e}")
    if pair == "s32_rs":
        assert worst <= RTOL_BF16, f"{kind} {pair}: kernel vs ReplayState relative {worst:.2e}"
    else:
        assert outliers <= 0.1 and worst <= max(RTOL_BF16, 0.25 * effect), (worst, outliers, effect)
    raw, mapped = _random_state_inputs(delta, B, H, HK, dk, dv, g)
    kst2 = ds.from_state(ref2, HK)
    y_r, y_k = ref2.step(*mapped), ds.step(kst2, raw)     # a state that came from a store, and back
    assert (y_k - y_r).abs().max() <= RTOL_BF16 * y_r.abs().max()


@pytest.mark.parametrize("kind,pair", [("gdn", "tp4_hi16_sr"), ("mamba2", "s32_rs")])
def test_scan_state_goes_into_the_store_as_through_a_replay_state(kind, pair):
    """The chunked scan's state straight into the decode store (`decode_store.from_scan`, what a
    prefill into a static cache does) gives the store of the ReplayState route bit for bit (GDN u
    solved against the read copy, key factors of every slot at once), with one host read (the
    slot count) where the route through a ReplayState made 18 here (GDN tp4_hi16_sr: two reads
    a slot for its key factors) and 5 (Mamba-2 s32_rs)."""
    from replayquant.hostsync import HostSyncCounter
    from replayquant.kernels.chunk.reference import chunk_scan_ref
    from replayquant.replay.convert import scan_state_of
    from replayquant.kernels.ops import store_tensors
    from replayquant.pairs import PrecisionPair
    delta = kind == "gdn"
    B, T, H, HK, dk, dv = 5, 11, 4, 2, 16, 16
    g = torch.Generator().manual_seed(17)
    pr = PrecisionPair.load(pair).with_buffer_len(BUFFER_LEN)
    st = ReplayState(torch.randn(B, H, dv, dk, generator=g) * 0.5, pr, delta=delta, seed=2, layer=3)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, dk, generator=g), dim=-1)
    ins = (torch.randn(B, T, H, dk, generator=g), k, torch.randn(B, T, H, dv, generator=g),
           -torch.rand(B, T, H, generator=g) * 0.3, torch.rand(B, T, H, generator=g) if delta else None)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[:2, :3] = False                        # left padding: rows commit different counts
    _, ss = chunk_scan_ref(scan_state_of(st), *ins, pair=pr, seed=2, layer=3, valid=valid)
    via = ReplayState.from_parts(ss, pr, delta=delta, seed=2, layer=3)
    with HostSyncCounter() as c:
        direct = ds.from_scan(ss, HK)
    assert c.syncs == 1, c.by_name
    with HostSyncCounter() as c:                 # slot count known on the host (a new state)
        known = ds.from_scan(replace(ss, n_slots=B), HK)
    assert c.syncs == 0, c.by_name
    assert all(torch.equal(a, b) for a, b in zip(ds.tensors(known), ds.tensors(direct)))
    old = ds.from_state(via, HK)
    assert len(set(old.committed.tolist())) > 1
    assert (direct.Tbuf is None) == (old.Tbuf is None)
    for a, b in zip(store_tensors(direct) + [direct.state_indices],
                    store_tensors(old) + [old.state_indices], strict=True):
        assert a.dtype == b.dtype and torch.equal(as_bits(a), as_bits(b))


def test_prefill_into_a_static_cache_reads_the_device_a_few_times_a_layer(models, monkeypatch):
    """A prompt into HF's static cache (the prefill of a compiled generate) on the Triton path:
    per recurrent layer, the input check, the chunk kernel's window plan (2), the slot count of
    the hand-off into the decode store and the casts' finiteness checks of the new state (2),
    6 host reads in all, where a new state through ReplayState and the hand-off through it made
    33 (tiny-qwen3.5, B = 8)."""
    from transformers import StaticCache

    from replayquant.hostsync import HostSyncCounter
    from replayquant.kl.lockstep import cache_kwarg
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    model = models["qwen3_5"]
    patch(model, "tp4_hi32", buffer_len=BUFFER_LEN)
    try:
        ids, mask = _batch(B=4, T=9)
        cache = StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad(), HostSyncCounter(record_where=True) as c:
            model(ids, attention_mask=mask, use_cache=True, cache_position=torch.arange(9),
                  **{cache_kwarg(model): cache})
        ours = [w for w in c.where if "transformers/" not in w]
        assert len(ours) <= 6 * len(recurrent_layers(model)), sorted(ours)
    finally:
        unpatch(model)


def test_hand_off_rows_are_slots():
    """Reordered sequence ids become the store's slots (SR streams follow the sequence); ids that
    repeat (a beam reorder before decode starts) take the slots 0..B-1."""
    st = ReplayState(torch.randn(2, 2, 16, 16), "tp4_hi16_sr", delta=False,
                     state_indices=torch.tensor([3, 1]))
    store, idx = convert.state_to_store(st, 2)
    assert idx.tolist() == [3, 1] and store.shape[0] == 4
    back = convert.store_to_state(store, idx, st.pair, st.seed, st.layer)
    assert torch.equal(back.anchor(), st.anchor()) and torch.equal(back.read_copy(), st.read_copy())
    dup = ReplayState(torch.randn(2, 2, 16, 16), "s32_rs", delta=False,
                      state_indices=torch.tensor([1, 1]))
    store, idx = convert.state_to_store(dup, 2)     # repeated ids take the slots 0..B-1
    assert idx.tolist() == [0, 1] and store.shape[0] == 2
    back = convert.store_to_state(store, idx, dup.pair, dup.seed, dup.layer)
    assert torch.equal(back.anchor(), dup.anchor())


# ------------------------------------------------------------------------------ generate

# Mamba-2 layers: s32_rs on Mamba-2 and tp4_hi32 on Nemotron-H, whose difference from Mamba-2 is
# the dt clamp, which the kernel applies whatever the pair (test_kernel_replay.py's dt-limit test
# checks it against the reference with s32_rs and tp4_hi32 both)
@pytest.mark.parametrize("fam,pair", [("qwen3_5", "s32_rs"), ("qwen3_5", "tp4_hi32"),
                                      ("mamba2", "s32_rs"), ("nemotron_h", "tp4_hi32")])
def test_generate_kernel_equals_torch(models, monkeypatch, fam, pair):
    """Greedy generate (ragged left-padded batch of 3, L = 4, 5 decode steps) through the Triton
    decode kernel gives the torch path's tokens and logits within the bf16 bound; every decode
    step of every recurrent layer ran the kernel, the hand-off happened once per layer, and a
    multi-token forward continuing the cache converts back and agrees as well. Nemotron-H: its
    Mamba-2 layers clamp dt (time_step_limit = (DT_FLOOR, inf), a floor below some heads'
    softplus(dt_bias)), which the kernel does too: decode_path is 'triton', not a fallback."""
    model = models[fam]
    n_layers = len(recurrent_layers(model))
    patch(model, pair, buffer_len=BUFFER_LEN, seed=5)
    if fam == "nemotron_h":
        from replayquant.kernels.replay import decode as rd
        limits = []
        orig_step = rd.replay_mamba2_step

        def record(*a, **k):
            limits.append(k.get("dt_limit"))
            return orig_step(*a, **k)
        monkeypatch.setattr(rd, "replay_mamba2_step", record)
        for _, mod, _ in recurrent_layers(model):
            assert tuple(mod.time_step_limit) == (DT_FLOOR, math.inf)
            assert bool((torch.nn.functional.softplus(mod.dt_bias) < DT_FLOOR).any())
            with monkeypatch.context() as mp:
                mp.setenv("REPLAYQUANT_BACKEND", "triton")
                assert mod._replayquant.decode_path(
                    torch.zeros(1), 16, 16, {"dt_limit": tuple(mod.time_step_limit)}) == "triton"
    ids, mask = _batch(seed=1 if fam == "qwen3_5" else 2)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    seq_t, sc_t, cache_t = _generate(model, ids, mask)

    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    calls = _spy(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no fallback warning on a supported model
        seq_k, sc_k, cache_k = _generate(model, ids, mask)
    steps = NEW_TOKENS - 1
    assert calls["kernel"] == steps * n_layers, calls
    assert calls["to_store"] == n_layers and calls["to_state"] == 0, calls
    for _, mod, _ in recurrent_layers(model):
        lay = cache_k.layers[mod.layer_idx]
        kst = getattr(lay, runtime.STATE_ATTR)
        assert isinstance(kst, ds.ReplayStore)
        ref_st = getattr(cache_t.layers[mod.layer_idx], runtime.STATE_ATTR)
        assert isinstance(ref_st, ds.ReplayStore) and ref_st.engine == "torch"
        assert kst.engine == "triton"
        flushes = ref_st.n_flush[ref_st.state_indices.long()]
        assert torch.equal(kst.n_flush[kst.state_indices.long()], flushes)
        assert int((flushes.min())) >= 2
    d = (sc_k - sc_t).abs().max().item()
    scale = sc_t.abs().max().item()
    top2 = sc_t.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]                  # [B, steps] reference top-1 margin
    risk = 2 * (sc_k - sc_t).abs().amax(-1) / gap      # < 1: this token cannot flip
    print(f"{fam} {pair}: max |d logits| {d:.2e} ({d / scale:.2e} of max |logit| {scale:.2f}); "
          f"bound {RTOL_BF16 * scale:.2e}; worst 2|d| / top-1 gap {risk.max().item():.2f}")
    assert d <= RTOL_BF16 * scale, f"{d:.2e} > {RTOL_BF16 * scale:.2e}"
    # (a bf16 model's logits sit on bf16's grid, so a top-1 margin can be a single unit of it:
    # the margin is printed, the tokens must be equal)
    assert torch.equal(seq_k, seq_t)
    if fam == "nemotron_h":
        assert limits and all(tuple(lim) == (DT_FLOOR, math.inf) for lim in limits), limits

    # a multi-token forward continuing each cache: each layer's store (of either engine) is
    # handed back once
    nxt = torch.randint(0, VOCAB, (3, 3), generator=torch.Generator().manual_seed(9))
    fmask = torch.cat([mask, torch.ones(3, NEW_TOKENS - 1 + 3, dtype=mask.dtype)], 1)
    with torch.no_grad():
        monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
        lt = model(input_ids=nxt, attention_mask=fmask, cache=cache_t,
                   use_cache=True).logits
        monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
        lk = model(input_ids=nxt, attention_mask=fmask, cache=cache_k,
                   use_cache=True).logits
    assert calls["to_state"] == 2 * n_layers, calls
    assert (lk - lt).abs().max().item() <= RTOL_BF16 * lt.abs().max().item()


def test_unsupported_layer_warns_once(monkeypatch):
    """A Mamba-2 head dim the kernel cannot take (d_v = 12, not a power of two): one warning per
    layer naming the path that runs (the torch reference), and no kernel call."""
    from transformers import AutoModelForCausalLM, Mamba2Config
    torch.manual_seed(14)
    model = AutoModelForCausalLM.from_config(Mamba2Config(
        vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_heads=8, head_dim=12,
        state_size=16, n_groups=2, expand=2, chunk_size=8)).eval()
    patch(model, "s32_rs", buffer_len=BUFFER_LEN)
    ids, mask = _batch(T=5, seed=4)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    calls = _spy(monkeypatch)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                           do_sample=False, use_cache=True)
    msgs = [str(x.message) for x in w if "replayquant decode" in str(x.message)]
    assert len(msgs) == len(recurrent_layers(model)), msgs
    assert all("torch (" in m and "d_v=12" in m for m in msgs)
    assert calls["kernel"] == 0


def test_beam_reorder_of_kernel_state():
    """A beam reorder (HF reorder_cache replaces the cache's marker tensor by its rows picked by
    the beam ids) gathers the store's slots on the device, repeats included, and the state stays
    the kernel's store: anchor, read copy, counters and entries are those of the torch
    reorder; the SR stream ids are the slots (each row draws its slot's streams from its next
    flush on)."""
    from types import SimpleNamespace
    from replayquant.pairs import PrecisionPair
    pr = PrecisionPair.load("tp4_hi32").with_buffer_len(BUFFER_LEN)
    g = torch.Generator().manual_seed(8)
    st = ReplayState(torch.randn(3, 2, 16, 16, generator=g), pr, delta=False)
    for _ in range(BUFFER_LEN + 1):
        st.step(*(torch.randn(3, 2, 16, generator=g) for _ in range(3)),
                -torch.rand(3, 2, generator=g))
    rt = runtime.LayerRuntime(pr, "replay", 0, 0, delta=False, kind="mamba2")
    for ids in ([2, 0, 1], [0, 0, 1]):
        lay = SimpleNamespace(recurrent_states=[torch.tensor(ids, dtype=torch.float32)[:, None]],
                              has_previous_state=[True])
        setattr(lay, runtime.STATE_ATTR, ds.from_state(st, 2))
        got = rt.get_state(lay, True, 3, 2, 16, 16, torch.device("cpu"))
        assert isinstance(got, ds.ReplayStore)
        back = ds.to_replay_state(got)
        held = replace(st.export(), u=None)
        ref = convert.to_replay_state(runtime.take_rows(held, torch.tensor(ids)))
        assert torch.equal(back.export()["state_indices"], torch.arange(3))
        assert torch.equal(back.anchor(), ref.anchor()) and torch.equal(back.read_copy(), ref.read_copy())
        assert torch.equal(back.committed, ref.committed) and torch.equal(back.n_flush, ref.n_flush)
        S, S_ref = back.current_state(), ref.current_state()    # entries went through bf16
        assert (S - S_ref).abs().max() <= 2.0 ** -7 * S_ref.abs().max()


@pytest.mark.parametrize("fam", ["qwen3_5", "mamba2"])
def test_kernel_is_the_torch_engine_on_a_bf16_ring(models, monkeypatch, fam):
    """Where the differences of test_generate_kernel_equals_torch come from: with an FP32 u
    buffer, greedy generate through the Triton engine equals the torch engine given the same
    store (a bf16 ring, and the hand-off's bf16 entries) within float32 reassociation at every
    step, for an NVFP4 read copy too. So the kernel adds nothing but the bf16 ring (and the
    NVFP4 roundings that perturbation moves). (With u in bf16 too, a u on a bf16 rounding
    boundary that reassociation moves one step moves the logits by about 1e-3.)"""
    model = models[fam]
    patch(model, "tp4_hi32", buffer_len=BUFFER_LEN, seed=5)
    ids, mask = _batch(seed=1 if fam == "qwen3_5" else 2)
    monkeypatch.setitem(ds.RING_DTYPE, "torch", torch.bfloat16)
    monkeypatch.setattr(convert, "default_u_dtype", lambda *a: torch.float32)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    seq_t, sc_t, cache_t = _generate(model, ids, mask)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    seq_k, sc_k, cache_k = _generate(model, ids, mask)
    for cache, engine in ((cache_t, "torch"), (cache_k, "triton")):    # same ring, its own engine
        stores = [getattr(lay, runtime.STATE_ATTR) for lay in cache.layers
                  if hasattr(lay, runtime.STATE_ATTR)]
        assert stores and all(s.engine == engine and s.kbuf.dtype == torch.bfloat16
                              for s in stores)
    d = (sc_k - sc_t).abs().max().item()
    print(f"{fam}: Triton engine vs torch engine on a bf16 ring: max |d| {d:.1e}")
    assert torch.equal(seq_k, seq_t)
    assert d <= 1e-4 * sc_t.abs().max().item()
