"""An FP32 pair's decode is the recurrence itself on every path a user runs: one patched layer's
prompt (the chunked scan) handed off to its decode store, then decode steps on either engine
(the torch engine; the Triton kernel in the interpreter, with bf16 model inputs as it serves
them), against a float64 loop written from docs/DESIGN.md section 2 over the layer's raw
inputs, for Gated DeltaNet, Mamba-2 and Kimi Delta Attention.

The inputs are built to expose state errors: gates that remember hundreds of tokens, and raw
keys as short as the embedded models' (|k_raw|^2 down to 0.005), where an extra L2
normalisation (each adds its epsilon, 1e-6, under the root) moves a key by up to 1e-4 of its
length, and a prompt of 27 tokens at L = 8, so that three entries cross the hand-off and the
first decode flush folds them into the anchor. The bound, 2e-6 of the largest output, is float32
arithmetic's (the external references land at 1-7e-7 of float64); a key normalised twice gave
2.9e-4, an entry rounded to bf16 on its way into the ring 1e-3.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from replayquant.models import decode_store, runtime
from replayquant.pairs import PrecisionPair
from replayquant.replay import gdn_inputs, kda_inputs, mamba2_inputs

B, HK, H, D = 2, 1, 2, 16
PROMPT, STEPS, BUFFER_LEN = 27, 10, 8
RTOL = 2e-6


class _Layer:
    def __init__(self):
        self.has_previous_state, self.recurrent_states = [False], [None]


class _Cache:
    """The part of an HF cache a patched layer's runtime uses: one linear-attention layer."""

    def __init__(self):
        self.layers = [_Layer()]

    def update_recurrent_state(self, t, idx):
        self.layers[idx].recurrent_states[0] = t


def _keys(g, T, n, dtype):
    """Raw keys / queries [B, T, n, D] with |x|^2 spread over 0.005 .. 0.5."""
    x = torch.randn(B, T, n, D, generator=g)
    x = x / x.norm(dim=-1, keepdim=True)
    r2 = 10 ** torch.empty(B, T, n, 1).uniform_(math.log10(0.005), math.log10(0.5), generator=g)
    return (x * r2.sqrt()).to(dtype)


def _raw(kind, g, T, dtype):
    """One layer's raw inputs over T tokens, as the patched forward passes them."""
    if kind == "mamba2":
        G = HK
        return dict(x=(0.5 * torch.randn(B, T, H, D, generator=g)).to(dtype),
                    dt=torch.randn(B, T, H, generator=g).to(dtype),
                    A=-torch.empty(H).uniform_(0.2, 0.6, generator=g),
                    B=_keys(g, T, G, dtype), C=_keys(g, T, G, dtype),
                    dt_bias=torch.full((H,), -5.0), dt_limit=(0.0, math.inf))
    q, k, v = _keys(g, T, HK, dtype), _keys(g, T, HK, dtype), torch.randn(B, T, H, D,
                                                                          generator=g).to(dtype)
    if kind == "gdn":
        return dict(q=q, k=k, v=v, a=torch.randn(B, T, H, generator=g).to(dtype),
                    b=torch.randn(B, T, H, generator=g).to(dtype),
                    A_log=torch.full((H,), -4.0), dt_bias=torch.full((H,), -3.0), beta_scale=1.0)
    return dict(q=q, k=k, v=v,
                g=-torch.empty(B, T, H, D).uniform_(1e-4, 4e-3, generator=g),
                beta=torch.sigmoid(torch.randn(B, T, H, generator=g)),
                scale=D ** -0.5)


def _core(kind, raw):
    """The core inputs the patched forward derives from raw (as models/families.py does)."""
    if kind == "mamba2":
        q, k, v, log_a = mamba2_inputs(raw["x"], raw["dt"], raw["A"], raw["B"], raw["C"],
                                       raw["dt_bias"], dt_limit=raw["dt_limit"])
        return q, k, v, log_a, None
    if kind == "gdn":
        g = -raw["A_log"].float().exp() * F.softplus(raw["a"].float() + raw["dt_bias"])
        return gdn_inputs(raw["q"], raw["k"], raw["v"], g, raw["b"])
    return kda_inputs(raw["q"], raw["k"], raw["v"], raw["g"], beta=raw["beta"])


def _float64(kind, raw):
    """y [B, T, H, D] of the recurrence in float64, token by token, from the raw inputs."""
    d = {n: t.double() if isinstance(t, torch.Tensor) else t for n, t in raw.items()}
    heads = lambda t: t.repeat_interleave(H // t.shape[-2], dim=-2)  # noqa: E731
    if kind == "mamba2":
        dt = F.softplus(d["dt"] + d["dt_bias"])
        q, k, v, log_a = heads(d["C"]), heads(d["B"]), dt[..., None] * d["x"], dt * d["A"]
        beta = None
    else:
        norm = lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
        q, k, v = heads(norm(d["q"])) * D ** -0.5, heads(norm(d["k"])), d["v"]
        if kind == "gdn":
            log_a = -d["A_log"].exp() * F.softplus(d["a"] + d["dt_bias"])
            beta = torch.sigmoid(d["b"])
        else:
            log_a, beta = d["g"], d["beta"]
    S = torch.zeros(B, H, D, D, dtype=torch.float64)
    ys = []
    for t in range(q.shape[1]):
        a = log_a[:, t].exp()
        decayed = S * (a[..., None, :] if kind == "kda" else a[..., None, None])
        if beta is None:
            u = v[:, t]
        else:
            u = beta[:, t, :, None] * (v[:, t] - (decayed @ k[:, t, ..., None])[..., 0])
        S = decayed + u[..., None] * k[:, t, :, None, :]
        ys.append((S @ q[:, t, ..., None])[..., 0])
    return torch.stack(ys, 1)


def _one(raw, t):
    return {n: v[:, t:t + 1] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v
            for n, v in raw.items()}


def _decode(kind, raw, device="cpu"):
    """The layer's outputs [B, PROMPT + STEPS, H, D]: the prompt through the chunked scan, then
    one-token forwards through the decode store (the first one hands the scan's state off)."""
    pair = PrecisionPair.load("s32_rs").with_buffer_len(BUFFER_LEN)
    rt = runtime.LayerRuntime(pair, "replay", 0, 0, delta=kind != "mamba2", kind=kind,
                              vector_gate=kind == "kda")
    cache = _Cache()
    raw = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in raw.items()}
    prompt = {n: v[:, :PROMPT] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v
              for n, v in raw.items()}
    ys = [rt.run(cache, False, *_core(kind, prompt), None, raw=prompt)]
    cache.layers[0].has_previous_state[0] = True
    for t in range(PROMPT, PROMPT + STEPS):
        one = _one(raw, t)
        y = rt.kernel_decode(cache, True, one, None)
        ys.append(rt.run(cache, True, *_core(kind, one), None, raw=one) if y is None else y)
    st = getattr(cache.layers[0], runtime.STATE_ATTR)
    return torch.cat(ys, 1).cpu(), st


def _check_against_float64(kind, engine, device="cpu"):
    g = torch.Generator().manual_seed({"gdn": 1, "mamba2": 2, "kda": 3}[kind])
    raw = _raw(kind, g, PROMPT + STEPS, torch.bfloat16)
    y, st = _decode(kind, raw, device)
    assert st.engine == engine
    ref = _float64(kind, raw)
    err = ((y.double() - ref).abs().amax((0, 2, 3)) / ref.abs().max()).tolist()
    print(f"{kind} {engine} {device}: prompt {max(err[:PROMPT]):.1e}, "
          f"decode {max(err[PROMPT:]):.1e}")
    assert max(err) <= RTOL, err


@pytest.mark.parametrize("engine", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda"])
def test_fp32_decode_after_a_prompt_is_the_float64_recurrence(kind, engine, monkeypatch):
    monkeypatch.setenv("REPLAYQUANT_BACKEND", engine)
    _check_against_float64(kind, engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (evals/gpu_runs.sh decode)")
@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda"])
def test_fp32_decode_after_a_prompt_on_cuda(kind, monkeypatch):
    """The same on the GPU: the chunk kernel's prompt, the hand-off, the compiled decode kernel
    (tensor-core products, the GPU's own exp and softplus)."""
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "auto")
    _check_against_float64(kind, "triton", "cuda")


@pytest.mark.parametrize("kind", ["gdn", "mamba2", "kda"])
def test_hand_off_holds_the_entries_decode_steps_append(kind, monkeypatch):
    """A prompt of 28 tokens handed off into the decode store leaves in its ring the entries that
    a prompt of 24 tokens (three flushes) followed by 4 decode steps appends for the same
    tokens: the raw k (GDN, KDA) or x (Mamba-2) bit for bit and Mamba-2's step size within one
    float32 unit, on the torch engine (whose ring holds any activation exactly)."""
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    g = torch.Generator().manual_seed(7)
    raw = _raw(kind, g, 29, torch.bfloat16)
    pair = PrecisionPair.load("s32_rs").with_buffer_len(BUFFER_LEN)
    stores = []
    for prompt in (28, 24):
        rt = runtime.LayerRuntime(pair, "replay", 0, 0, delta=kind != "mamba2", kind=kind,
                                  vector_gate=kind == "kda")
        cache = _Cache()
        first = {n: v[:, :prompt] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v
                 for n, v in raw.items()}
        rt.run(cache, False, *_core(kind, first), None, raw=first)
        cache.layers[0].has_previous_state[0] = True
        for t in range(prompt, 29):
            one = _one(raw, t)
            if rt.kernel_decode(cache, True, one, None) is None:
                rt.run(cache, True, *_core(kind, one), None, raw=one)
        stores.append(getattr(cache.layers[0], runtime.STATE_ATTR))
    handed, stepped = stores
    assert torch.equal(decode_store.committed(handed), decode_store.committed(stepped))
    h = int(decode_store.committed(handed).min())
    assert h == 5
    a, b = decode_store.raw_entries(handed), decode_store.raw_entries(stepped)
    for name in a:
        if name == "dt":       # softplus over [B, T, H] or [B, H]: vectorised apart, 1 ulp
            torch.testing.assert_close(a[name][:, :h], b[name][:, :h], rtol=2.5e-7, atol=0)
        else:
            assert torch.equal(a[name][:, :h], b[name][:, :h]), name


# ---------------------------------------------------------------- whole models

EMBEDDED = ("tiny-qwen3.5", "tiny-mamba2", "tiny-kimi-linear")


@torch.no_grad()
def short_keys(model, factor=0.1):
    """Scale the key channels of each delta-rule layer's short convolution (GDN: channels
    key_dim..2 key_dim of q, k, v; KDA: qkv_dim..2 qkv_dim), so that its raw keys are as short
    as the embedded models' (SiLU is nearly linear near 0): random init gives |k_raw|^2 of
    about 1, where one extra normalisation moves a key by 1e-6 of its length and hides."""
    from replayquant.models import recurrent_layers
    for _, mod, kind in recurrent_layers(model):
        if kind != "mamba2":
            n = mod.key_dim if kind == "gdn" else mod.qkv_dim
            mod.conv1d.weight[n:2 * n].mul_(factor)
            if mod.conv1d.bias is not None:
                mod.conv1d.bias[n:2 * n].mul_(factor)


class _LayerOutputs:
    """The outputs of a model's recurrent layers, forward by forward (a forward hook on each)."""

    def __init__(self, model):
        from replayquant.models import recurrent_layers
        self.seen = {}
        self.hooks = [mod.register_forward_hook(self._hook(name))
                      for name, mod, _ in recurrent_layers(model)]

    def _hook(self, name):
        def f(mod, args, out):
            self.seen.setdefault(name, []).append((out[0] if isinstance(out, tuple) else out)
                                                  .detach().float())
        return f

    def close(self):
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def decode_equals_teacher_forcing(model, ids, mask, n=8, buffer_len=8):
    """The checks of an FP32 pair on a model (every family's tiny config in test_families.py and
    test_kda_models.py, and the embedded models here) -> (tokens equal, largest difference):
    greedy generate through s32_rs at `buffer_len` (the prompt's last entries cross the hand-off
    into the decode store, and decode flushes fold them) must give the unpatched model's tokens,
    and each recurrent layer's output at every decode step must equal teacher forcing of the
    generated sequence through the same patch (prefill "replay"); the difference returned is the
    largest over layers and steps, relative to the layer's largest teacher-forced output (float32
    noise: up to 1e-6 measured; a key normalised twice gave 4.6e-6 on tiny-qwen3.5, 1.1e-5 on
    tiny-kimi-linear)."""
    from replayquant.models import patch, unpatch

    def generate():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, use_cache=True)

    seq_ref = generate()
    patch(model, "s32_rs", buffer_len=buffer_len, prefill="replay")
    hooks = _LayerOutputs(model)
    try:
        seq = generate()
        dec = {k: torch.cat(v[1:], 1) for k, v in hooks.seen.items()}   # decode steps 1..n-1
        hooks.seen.clear()
        fmask = torch.cat([mask, torch.ones(mask.shape[0], n, dtype=mask.dtype)], 1)
        model(input_ids=seq, attention_mask=fmask)
        P = ids.shape[1]
        tf = {k: v[0][:, P:P + n - 1] for k, v in hooks.seen.items()}
    finally:
        hooks.close()
        unpatch(model)
    d = max(((dec[k] - tf[k]).abs().max() / tf[k].abs().max()).item() for k in tf)
    return torch.equal(seq, seq_ref), d


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_model_decode_is_its_teacher_forcing(name):
    from replayquant.models import load_model
    model = load_model(name, dtype="float32", device_map="cpu")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (2, 27), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0                                  # ragged, left-padded
    same, d = decode_equals_teacher_forcing(model, ids, mask)
    print(f"{name}: decode vs teacher forcing {d:.1e} of a layer's largest output")
    assert same, "s32_rs changed a greedy token"
    assert d <= 2e-6, d
