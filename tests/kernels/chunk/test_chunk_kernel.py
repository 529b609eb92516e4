"""The Triton chunked teacher-forcing kernel (replayquant.kernels.chunk.kernel, interpreter mode)
against its torch reference chunk_ref.chunk_scan_ref: both kinds, shared and dual pairs (an SR NVFP4
one among them), windows including a partial one, segments continuing the flush schedule,
padding, exact prefill, poisoned outputs."""

import pytest
import torch

from replayquant.formats import as_bits
from replayquant.kernels.chunk import kernel as chunk
from replayquant.kernels.chunk import launch as chunk_launch
from replayquant.kernels.chunk.launch import override_chunk_launch
from replayquant.kernels.chunk.reference import chunk_scan_ref, initial_scan_state, teacher_force
from _helpers import scan_inputs, stable_seed, vector_log_a
from replayquant.pairs import PrecisionPair
from replayquant.replay import ReplayState

# relative output tolerance per read format: FP32 arithmetic reassociates (~1e-6); an element
# whose checkpoint value lands on a rounding boundary can flip by one step of the read format.
READ_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1e-2, "fp8": 0.1, "nvfp4": 0.4}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    """Every tensor the kernel writes starts as NaN: a missed write shows."""
    def empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    monkeypatch.setattr(chunk, "_empty", empty)


def _codes(qt):
    return as_bits(qt.payload)


def _roles_match(pair, got, ref, what):
    """Anchors / read copies: FP32 within reassociation; packed formats the same codes except
    where reassociation crosses a rounding boundary. Such a flip is rare (one code step), but
    with SR and GDN it propagates: a flip of a large element changes u and so the whole row of
    the next state by ~ one step of the large element, which moves small elements by several
    of their own (finer) steps. So: few codes differ, and no value by more than two steps at
    the matrix's largest magnitude."""
    for role, spec in (("anchor", pair.anchor), ("read", pair.read)):
        if spec is None:
            assert getattr(got, role) is None
            continue
        a, b = getattr(got, role), getattr(ref, role)
        assert a.format == b.format and a.payload.shape == b.payload.shape
        fa, fb = spec.fmt.dequantize(a), spec.fmt.dequantize(b)
        scale = fb.abs().amax(dim=(-2, -1), keepdim=True)
        if spec.format == "fp32":
            assert ((fa - fb).abs() <= 1e-5 * scale).all(), f"{pair.name} {what} {role}"
            continue
        diff = (_codes(a) != _codes(b)).float().mean().item()
        assert diff <= 0.02, f"{pair.name} {what} {role}: {diff:.2%} of codes differ"
        err = ((fa - fb).abs() / scale).max().item()
        assert err <= 2 * ROLE_STEP[spec.format], f"{pair.name} {what} {role}: {err:.2e}"


# one step of each format relative to the largest magnitude it holds
ROLE_STEP = {"fp16": 2 ** -10, "bf16": 2 ** -7, "fp8": 2 ** -3, "nvfp4": 2 / 6}


def _states_match(pair, got, ref, what):
    _roles_match(pair, got, ref, what)
    assert torch.equal(got.committed, ref.committed) and torch.equal(got.n_flush, ref.n_flush)
    for name in ("k", "v", "beta"):
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), f"{what}: buffer {name}"
    torch.testing.assert_close(got.G, ref.G, rtol=1e-6, atol=1e-6)


def _outputs_match(pair, got, ref, what):
    assert not torch.isnan(got).any(), f"{what}: an output was never written"
    tol = READ_TOL[pair.read_spec.format]
    scale = ref.abs().max().clamp(min=1e-6)
    err = ((got - ref).abs().max() / scale).item()
    assert err <= tol, f"{pair.name} {what}: relative error {err:.2e} > {tol}"
    frac = ((got - ref).abs() > 1e-5 * scale).float().mean().item()
    assert frac <= (0.0 if pair.read_spec.format == "fp32" else 0.1), f"{pair.name} {what}: {frac:.3f}"


CASES = [  # pair, L, B, d_k, d_v
    ("tp4_hi16_sr", 8, 2, 16, 16),     # NVFP4 read (whole matrix per program), FP16 SR anchor
    ("f4_sr_rs", 8, 3, 32, 16),        # shared NVFP4 with SR
    ("tp8_hi32", 5, 2, 16, 32),        # FP8 read, FP32 anchor, several row blocks
    ("s32_rs", 1, 2, 16, 16),          # L = 1: every token flushes
]


@pytest.mark.parametrize("name,L,B,dk,dv", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_kernel_equals_reference_segmented(name, L, B, dk, dv, delta):
    """Two segments (the second continues the flush schedule from a partial window): outputs,
    casts and the carried state of the kernel equal the torch reference's."""
    gen = torch.Generator().manual_seed(stable_seed(name, delta))
    H = 2
    pair = PrecisionPair.load(name).with_buffer_len(L)
    T1, T2 = 2 * L + 3, 2 * L + 1
    q, k, v, log_a, beta = scan_inputs(gen, B, T1 + T2, H, dk, dv, delta, a_min=0.85)
    S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
    ss = initial_scan_state(S0, pair, delta=delta, seed=4, layer=3)
    seg = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    ref_s, got_s = ss, ss
    for a, b in ((0, T1), (T1, T1 + T2)):
        args = [seg(t, a, b) for t in (q, k, v, log_a, beta)]
        y_ref, ref_s = chunk_scan_ref(ref_s, *args, pair=pair, seed=4, layer=3)
        y, got_s = chunk.chunk_scan(got_s, *args, pair=pair, seed=4, layer=3)
        _outputs_match(pair, y, y_ref, f"segment {a}:{b}")
        _states_match(pair, got_s, ref_s, f"segment {a}:{b}")
    # the input state is untouched (the kernel casts into copies)
    assert torch.equal(ss.committed, torch.zeros(B, dtype=torch.int64))


@pytest.mark.parametrize("name,exact,pre,knobs", [
    ("tp4_hi16_sr", False, True, {}),
    ("f4_sr_rs", False, True, {"chain_bv": 32, "chain_warps": 4}),
    ("f4_sr_rs", False, False, {}), ("f4_sr_rs", False, True, {}),
    ("f4_sr_rs", False, True, {"REPLAYQUANT_NVFP4_CHAIN_SPLIT": "1"}),
    ("f4_sr_rs", False, False, {"REPLAYQUANT_NVFP4_CHAIN_SPLIT": "1"}),
    ("tp4_hi16_sr", True, True, {})],
    ids=["dual", "shared_nvfp4_32_row_blocks", "shared_nvfp4_chain_philox",
         "shared_nvfp4_one_block", "shared_nvfp4_split", "shared_nvfp4_split_philox", "exact"])
def test_kernel_window_groups_and_row_blocks(name, exact, pre, knobs, monkeypatch):
    """Windows split into launch groups of 2 (the checkpoint crosses a group boundary) and
    d_v = 64 (the NVFP4 casts take the matrix amax over several row blocks; the chain splits
    or loops over row blocks, or runs as a split chain with its amax exchange, on one program
    here) give the reference's result; the SR bits of a stochastic anchor drawn in pass 1 (pre)
    or in the sequential pass."""
    launch = {"max_group_windows": 2}
    for knob, value in knobs.items():         # launch entries, or options from the environment
        if knob.startswith("REPLAYQUANT_"):
            monkeypatch.setenv(knob, value)
        else:
            launch[knob] = value
    gen = torch.Generator().manual_seed(11)
    B, H, dk, dv, L = 2, 1, 16, 64, 4
    pair = PrecisionPair.load(name).with_buffer_len(L)
    T = 5 * L + 2
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, True, a_min=0.85)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 2:5] = False
    S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
    ss = initial_scan_state(S0, pair, delta=True, seed=2, layer=1)
    y_ref, s_ref = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=pair, seed=2, layer=1,
                                  valid=valid, exact=exact)
    with override_chunk_launch(**launch):
        y, s = chunk.chunk_scan(ss, q, k, v, log_a, beta, pair=pair, seed=2, layer=1,
                                valid=valid, exact=exact, precompute_sr_bits=pre)
        assert chunk_launch.group_windows(B * H, dk, dv, 16, True, pre) == 2
    _outputs_match(pair, y, y_ref, "groups")
    _states_match(pair, s, s_ref, "groups")


def test_split_chain_that_cannot_meet_reports(monkeypatch):
    """A split NVFP4 chain whose programs are not resident together (the interpreter runs them
    one after another) times out in its amax wait and raises, instead of hanging or returning
    a wrong result."""
    monkeypatch.setenv("REPLAYQUANT_NVFP4_CHAIN_SPLIT", "2")
    monkeypatch.setattr(chunk, "SPIN_LIMIT", 3)
    gen = torch.Generator().manual_seed(12)
    B, T, H, dk, dv, L = 1, 6, 1, 16, 32, 4
    pair = PrecisionPair.load("f4_sr_rs").with_buffer_len(L)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, True, a_min=0.85)
    ss = initial_scan_state(torch.randn(B, H, dv, dk, generator=gen), pair, delta=True)
    with pytest.raises(RuntimeError, match="REPLAYQUANT_NVFP4_CHAIN_SPLIT=0"):
        chunk.chunk_scan(ss, q, k, v, log_a, beta, pair=pair)


def test_nvfp4_chain_programs_by_shape():
    """The split takes the most programs per matrix that fit one per SM, >= 16 rows each."""
    assert chunk_launch.nvfp4_chain_programs(32, 128, 132) == 4       # Qwen3.5-4B, one sequence
    assert chunk_launch.nvfp4_chain_programs(16, 128, 132) == 8
    assert chunk_launch.nvfp4_chain_programs(128, 128, 132) == 0      # two-pass: the GPU is full
    assert chunk_launch.nvfp4_chain_programs(2, 32, 132) == 2
    assert chunk_launch.nvfp4_chain_programs(32, 128, None) == 0      # the interpreter


@pytest.mark.parametrize("value,expect", [("0", 0), ("2", 2), ("x", None), ("-1", None)])
def test_nvfp4_chain_split_setting(value, expect, monkeypatch):
    """REPLAYQUANT_NVFP4_CHAIN_SPLIT, read at each call (not at import), forces the chain; a bad
    value is one clear error; options.override sets it for a block and restores it."""
    from replayquant import options
    monkeypatch.setenv("REPLAYQUANT_NVFP4_CHAIN_SPLIT", value)
    if expect is None:
        with pytest.raises(ValueError, match="REPLAYQUANT_NVFP4_CHAIN_SPLIT"):
            chunk_launch.nvfp4_chain_programs(32, 128, 132)
        return
    assert chunk_launch.nvfp4_chain_programs(32, 128, 132) == expect
    with options.override(nvfp4_chain_split=1):
        assert chunk_launch.nvfp4_chain_programs(32, 128, 132) == 1
    assert chunk_launch.nvfp4_chain_programs(32, 128, 132) == expect
    monkeypatch.delenv("REPLAYQUANT_NVFP4_CHAIN_SPLIT")
    assert chunk_launch.nvfp4_chain_programs(32, 128, 132) == 4        # unset: chosen by shape


@pytest.mark.parametrize("delta", [False, True], ids=["mamba2", "gdn"])
def test_kernel_padding_and_exact(delta):
    """Padding tokens take no slot and give 0; exact=True is FP32 plus one cast at the end."""
    gen = torch.Generator().manual_seed(40 + delta)
    B, T, H, dk, dv, L = 3, 19, 2, 16, 16, 4
    pair = PrecisionPair.load("tp4_hi16_sr").with_buffer_len(L)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, delta, a_min=0.85)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :6] = False                    # left padding
    valid[2, [0, 3, 4, 11, 18]] = False     # scattered
    S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
    ss = initial_scan_state(S0, pair, delta=delta, seed=1)
    # a buffered state first (counts 3, 3, 3), so windows start mid-way
    pre = [t[:, :3] if t is not None else None for t in (q, k, v, log_a, beta)]
    _, ss = chunk_scan_ref(ss, *pre, pair=pair, seed=1)
    y_ref, s_ref = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=pair, seed=1, valid=valid)
    y, s = chunk.chunk_scan(ss, q, k, v, log_a, beta, pair=pair, seed=1, valid=valid)
    assert torch.equal(y[~valid], torch.zeros_like(y[~valid]))
    _outputs_match(pair, y, y_ref, "padded")
    _states_match(pair, s, s_ref, "padded")
    y_ref, s_ref = chunk_scan_ref(ss, q, k, v, log_a, beta, pair=pair, seed=1, valid=valid, exact=True)
    y, s = chunk.chunk_scan(ss, q, k, v, log_a, beta, pair=pair, seed=1, valid=valid, exact=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
    _states_match(pair, s, s_ref, "exact")


def test_kernel_through_replay_state():
    """chunk.teacher_force on a ReplayState equals the torch teacher_force (GDN, SR anchor)."""
    gen = torch.Generator().manual_seed(7)
    B, T, H, dk, dv = 2, 13, 2, 16, 16
    pair = PrecisionPair.load("tp8_hi16_sr").with_buffer_len(4)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, True, a_min=0.85)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    a = ReplayState(S0, pair, delta=True, seed=5, layer=1)
    b = ReplayState(S0, pair, delta=True, seed=5, layer=1)
    ya = teacher_force(a, q, k, v, log_a, beta)
    yb = chunk.teacher_force(b, q, k, v, log_a, beta)
    _outputs_match(pair, yb, ya, "ReplayState")
    assert torch.equal(a.n_flush, b.n_flush) and torch.equal(a.committed, b.committed)
    assert (a.anchor_q.payload != b.anchor_q.payload).float().mean() <= 0.01
    # decode continues alike
    torch.testing.assert_close(b.step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], beta[:, 0]),
                               a.step(q[:, 0], k[:, 0], v[:, 0], log_a[:, 0], beta[:, 0]),
                               rtol=0.1, atol=1e-2)


def test_kernel_bad_inputs():
    pair = PrecisionPair.load("s32_rs").with_buffer_len(4)
    ss = initial_scan_state(torch.zeros(2, 2, 8, 24), pair, delta=False)
    q = torch.zeros(2, 5, 2, 24)
    with pytest.raises(ValueError, match="powers of two"):
        chunk.chunk_scan(ss, q, q, torch.zeros(2, 5, 2, 8), torch.zeros(2, 5, 2), pair=pair)
    ss = initial_scan_state(torch.zeros(2, 2, 16, 16), pair, delta=False)
    q = torch.zeros(2, 5, 2, 16)
    with pytest.raises(ValueError, match="buffer_len"):
        chunk.chunk_scan(ss, q, q, q, torch.zeros(2, 5, 2), pair=pair.with_buffer_len(8))
    with pytest.raises(ValueError, match="beta"):
        chunk.chunk_scan(ss, q, q, q, torch.zeros(2, 5, 2), torch.zeros(2, 5, 2), pair=pair)
    assert chunk.supports(128, 64) and not chunk.supports(96, 128) and not chunk.supports(8, 16)


@pytest.mark.parametrize("fam", ["qwen3_5", "mamba2", "kimi_linear"])
def test_patched_model_runs_the_kernel(fam, monkeypatch):
    """A patched tiny HF model with the Triton backend (REPLAYQUANT_BACKEND=triton: what CUDA
    tensors get) runs the chunk kernel and gives the torch path's logits within reassociation,
    in segments with a ragged batch (Kimi Linear: per-channel gates, the tiny model of
    tests/models/test_kda_models.py with gates that remember)."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Mamba2Config, Qwen3_5TextConfig
    from replayquant.models import patch, runtime
    transformers.logging.set_verbosity_error()
    if fam == "kimi_linear":
        from test_kda_models import _model
        model = _model("kimi_linear", 3)
    else:
        if fam == "qwen3_5":
            cfg = Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                                    linear_num_value_heads=2, linear_key_head_dim=16,
                                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                    layer_types=["linear_attention", "full_attention"])
        else:
            cfg = Mamba2Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=4,
                               head_dim=16, state_size=16, n_groups=1, expand=2, chunk_size=8)
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(cfg).eval()
    patch(model, "tp4_hi16_sr", buffer_len=4, seed=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0

    calls = []
    real = chunk.chunk_scan
    monkeypatch.setattr(chunk, "chunk_scan", lambda *a, **k: calls.append(1) or real(*a, **k))

    import inspect
    params = inspect.signature(type(model).forward).parameters
    cache_arg = next(n for n in ("cache", "past_key_values", "cache_params") if n in params)

    @torch.no_grad()
    def run():
        cache, outs = None, []
        for a, b in ((0, 6), (6, 11)):
            kw = {} if cache is None else {cache_arg: cache}
            out = model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], use_cache=True, **kw)
            cache = next(c for n in ("cache", "past_key_values", "cache_params")
                         if (c := getattr(out, n, None)) is not None)
            outs.append(out.logits)
        return torch.cat(outs, 1)

    ref = run()
    assert not calls and runtime.teacher_force_path(ids, 16, 16) == "torch"
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    assert runtime.teacher_force_path(ids, 16, 16) == "triton"
    assert runtime.teacher_force_path(ids, 16, 24).startswith("torch (")
    got = run()
    assert calls, "the Triton chunk kernel did not run"
    valid = mask.bool()
    d = (got - ref)[valid].abs()
    scale = ref[valid].abs().max().item()
    assert (d > 1e-4 * scale).float().mean().item() <= 0.1 and d.max().item() <= 0.05 * scale


def test_whole_model_bench_runs_on_cpu_with_a_tiny_shape(tmp_path):
    """`replayquant bench teacher-forcing`'s whole-model part: unpatched and patched forwards of
    the random-weight model, ratio, the clock around the replay calls, a section in the JSON that
    keeps the file's other sections."""
    pytest.importorskip("transformers")
    from replayquant.bench import teacher_forcing as tf
    out = tmp_path / "tf.json"
    out.write_text('{"check": [1]}')
    r = tf.run_model(out, shape="tiny", context=64, segment=32, dtype="float32", device="cpu",
                     warmup_tokens=32)
    import json
    saved = json.loads(out.read_text())
    assert saved["check"] == [1] and saved["whole_model"]["pair"] == "tp4_hi16_sr"
    assert r["hf_forward_s"] > 0 and r["patched_forward_s"] > 0 and r["teacher_force_path"] == "torch"
    assert r["ratio_patched_over_hf"] > 0 and "git_commit" in r["provenance"]
    assert set(r["inside_patched_s"]) == {"replay_teacher_force", "chunk_scan"}


# ------------------------------------------------------------------ vector gates (KDA)

VECTOR_CASES = [  # pair, delta, exact, padding
    ("tp4_hi16_sr", True, False, True),     # NVFP4 read, FP16 SR anchor, padded rows
    ("f4_sr_rs", True, False, False),       # shared NVFP4 with SR (two-pass chain)
    ("tp8_hi32", False, False, False),      # Mamba-2 form with per-channel gates
    ("tp4_hi16_sr", True, True, True),      # exact prefill
]


@pytest.mark.parametrize("name,delta,exact,padding", VECTOR_CASES,
                         ids=["dual_padded", "shared_nvfp4", "no_delta", "exact"])
def test_kernel_vector_gates_equal_reference(name, delta, exact, padding):
    """Per-channel gates (log_a [B, T, H, d_k]) with channels that forget within a step beside
    ones that hardly forget: two segments (the second continues a partial window, over launch
    groups of 2 windows), outputs, casts and carried state (G per channel) as the reference's."""
    gen = torch.Generator().manual_seed(stable_seed(name, delta, exact))
    B, H, dk, dv, L = 2, 1, 16, 16, 4
    pair = PrecisionPair.load(name).with_buffer_len(L)
    T1, T2 = 2 * L + 3, L + 2
    q, k, v, _, beta = scan_inputs(gen, B, T1 + T2, H, dk, dv, delta)
    log_a = vector_log_a(gen, B, T1 + T2, H, dk)
    valid = None
    if padding:
        valid = torch.ones(B, T1 + T2, dtype=torch.bool)
        valid[1, [0, 1, 6, T1 + 1]] = False
    S0 = torch.randn(B, H, dv, dk, generator=gen) * 0.5
    ss = initial_scan_state(S0, pair, delta=delta, seed=3, layer=2, vector_gate=True)
    seg = lambda t, a, b: None if t is None else t[:, a:b]  # noqa: E731
    ref_s, got_s = ss, ss
    for a, b in ((0, T1), (T1, T1 + T2)):
        args = [seg(t, a, b) for t in (q, k, v, log_a, beta)]
        kw = dict(pair=pair, seed=3, layer=2, valid=seg(valid, a, b), exact=exact)
        y_ref, ref_s = chunk_scan_ref(ref_s, *args, **kw)
        with override_chunk_launch(max_group_windows=2):
            y, got_s = chunk.chunk_scan(got_s, *args, **kw)
        _outputs_match(pair, y, y_ref, f"segment {a}:{b}")
        assert got_s.G.shape == (B, H, L, dk)
        _states_match(pair, got_s, ref_s, f"segment {a}:{b}")


def test_kernel_vector_gates_against_float64_and_scalar_path():
    """FP32 pair: the kernel with per-channel gates against the float64 recurrence
    S_t = S_{t-1} Diag(a_t) + u_t k_t^T (outputs and the rebuilt final state); a gate that is
    the same on every channel gives the scalar kernel's outputs within FP32 reassociation."""
    from replayquant.kernels.chunk.reference import rebuild_state
    from replayquant.replay import recurrent_reference
    gen = torch.Generator().manual_seed(71)
    B, T, H, dk, dv, L = 2, 13, 1, 16, 16, 4
    pair = PrecisionPair.load("s32_rs").with_buffer_len(L)
    q, k, v, log_a, beta = scan_inputs(gen, B, T, H, dk, dv, True)
    la_vec = vector_log_a(gen, B, T, H, dk)
    S0 = torch.randn(B, H, dv, dk, generator=gen)
    Y, S = recurrent_reference(S0, q, k, v, la_vec, beta, dtype=torch.float64)
    y, ss = chunk.chunk_scan(initial_scan_state(S0, pair, delta=True, vector_gate=True),
                             q, k, v, la_vec, beta, pair=pair)
    assert ((y.double() - Y).abs().max() / Y.abs().max()).item() <= 2e-6
    assert ((rebuild_state(ss, pair).double() - S).abs().max() / S.abs().max()).item() <= 2e-6
    y_s, _ = chunk.chunk_scan(initial_scan_state(S0, pair, delta=True), q, k, v, log_a, beta,
                              pair=pair)
    y_v, _ = chunk.chunk_scan(initial_scan_state(S0, pair, delta=True, vector_gate=True), q, k, v,
                              log_a[..., None].expand(-1, -1, -1, dk), beta, pair=pair)
    torch.testing.assert_close(y_v, y_s, rtol=1e-5, atol=1e-6)
