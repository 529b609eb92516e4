"""Rebuild the embedded tiny models: corpus, tokenizer, one Qwen3.5, one Mamba-2 and one Kimi
Linear model (--models qwen,mamba,kimi; each trained the same way, on the same data and budget).

Stages (each deterministic from its inputs and --seed):

  prepare     King James Version from Debian's bible-kjv-text .deb (downloaded with `apt-get
              download` if not found) -> split by book -> byte-level BPE tokenizer (4096) -> uint16
              token streams in DATA_DIR (default .gpu/tiny), and the held-out books as gzip JSONL.
  train       both models on DATA_DIR's token streams (GPU; bf16 autocast), checkpoint with the best
              validation loss (validation books are neither training nor held-out books), weights
              rounded to bf16 for shipping, then the long-memory evaluation of the shipped weights
              (fp32, Hugging Face's own torch code): held-out perplexity at contexts 512 / 4096 /
              8192 / 16384, NLL by position in the window, and the same 16K windows with the
              recurrent state reset every 512 tokens; a loss-curve PNG and a JSON log into --out.
  device-run  `train`, then the 16K-context KL demo of both new models (`replayquant kl`, five
              pairs, 3 held-out books) on the same GPU, everything packed into at most 8 files
              (the device tool's limit). Checks the fast paths first and aborts loudly if the
              Qwen3.5 one is not there.
  evaluate    the long-memory evaluation alone, on the shipped folders (any device), with each
              model's training record read from the log of the run that trained it.
  install     copy the model folders from a train output into replayquant/assets/, the log and
              stdouts into results/train_tiny/ (a log of other models than train_log.json's as
              train_log_<model>.json beside it), redraw loss_curve.png there from every log, and
              unpack the demo results into results/demo/.

Fast training paths (GPU only; the shipped models run on Hugging Face's torch code everywhere):
  * Qwen3.5: with flash-linear-attention (`fla`) importable before transformers loads the model
    file, transformers' Gated DeltaNet calls fla's `chunk_gated_delta_rule` (checked: the step
    aborts if the resolved function is not fla's).
  * Kimi Linear: likewise, transformers' Kimi Delta Attention calls fla's `chunk_kda` (the same
    check, and its outputs and gradients against transformers' torch chunk_kimi_delta_attention).
  * Mamba-2: transformers' fast path needs the mamba_ssm / causal_conv1d CUDA builds. Instead the
    SSD scan alone (`modeling_mamba2.mamba2_chunk_scan`) is replaced, for training, by fla's
    `chunk_simple_gla`: the Mamba-2 recurrence h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,
    y_t = C_t h_t + D x_t is scalar-decay gated linear attention with q = C, k = B, v = dt * x,
    log-decay g = dt * A per head, scale 1. Checked on random inputs (outputs and gradients)
    against transformers' torch scan before training, and on the trained weights (max |logit
    difference| of the whole model, fp32) after; both go into the log.

Long memory (the demo needs a recurrent state that carries information across thousands of
tokens):
  * trained at 8K context on contiguous text (random 8K windows of the EOS-joined training books);
  * decay gates initialised toward long memory: GDN heads' decay rate A * softplus(dt_bias) spread
    log-uniformly over [1e-4, 1] per layer (transformers' default puts every head between 0.013
    and 21, i.e. memories of at most ~75 tokens); Kimi Delta Attention's per-channel rates
    exp(A_log) softplus(dt_bias) likewise over the channels of each layer (default 1e-3 .. 1.6);
    Mamba-2 time_step_min 1e-4 (default 1e-3);
  * residual dropout (training only, forward hooks on each mixer / MLP / embedding output) against
    the overfitting of a few epochs of a 0.9M-token corpus.

How the shipped models were made (results/train_tiny/: train_log.json with tiny-qwen3.5's and
tiny-mamba2's training and evaluation, train_log_tiny-kimi-linear.json with tiny-kimi-linear's,
loss_curve.png of all three; the training stdouts are in git history:
`git show 7c956f0:results/train_tiny/train_stdout_tiny-qwen3.5.txt`, and the same for
tiny-kimi-linear):

  python evals/train_tiny.py prepare --heldout-out replayquant/data/kjv_heldout.jsonl.gz
  # on one H200 (evals/gpu_runs.sh, .gpu/tiny + .gpu/wheels carried; torch 2.11, Triton 3.6,
  # transformers 5.17, fla 0.6.0); tiny-qwen3.5 (stdout: train_stdout_tiny-qwen3.5.txt):
  python evals/train_tiny.py device-run --data .gpu/tiny --out $OUT --time-budget 120,120 \
      --deadline 425 --reserve 85 --source-commit <commit>
  #   600 steps x 8 x 8K tokens in 67 s (0.125 s/step), best validation at step 300 (shipped).
  # tiny-mamba2: 400 steps x 8 x 8K tokens in 45 s (0.112 s/step, fla's fused_chunk_simple_gla),
  # d_state 128, time_step_min 1e-4, with the shipped tiny-qwen3.5 evaluated beside it:
  python evals/train_tiny.py device-run --data .gpu/tiny --out $OUT --models mamba --steps 400 \
      --evaluate-also qwen --train-stdout results/train_tiny/train_stdout_tiny-qwen3.5.txt \
      --deadline 185 --reserve 60 --source-commit <commit>
  # tiny-kimi-linear: 524 steps x 8 x 8K tokens in 85 s (0.163 s/step, fla's chunk_kda):
  python evals/train_tiny.py device-run --data .gpu/tiny --out $OUT --models kimi \
      --time-budget 100 --deadline 390 --reserve 80 --source-commit <commit>
  python evals/train_tiny.py install --from <the device-run output>
  python evals/train_tiny.py plot --log results/train_tiny/train_log.json \
      --log results/train_tiny/train_log_tiny-kimi-linear.json --out results/train_tiny/loss_curve.png
  # the long-memory evaluation alone, of both shipped folders:
  python evals/train_tiny.py evaluate --data .gpu/tiny --out <dir> \
      --train-record qwen=results/train_tiny/train_stdout_tiny-qwen3.5.txt \
      --train-record mamba=results/train_tiny/train_log.json

`--steps auto` (the default) times the first steps and fits each model's step count into its
--time-budget; the log records the resolved counts, and `--steps N,M` with the same seed reruns
that schedule (same data order, same initialisation; bitwise equality also needs the same GPU and
library versions).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import tiny_data  # noqa: E402

MODEL_NAMES = {"qwen": "tiny-qwen3.5", "mamba": "tiny-mamba2", "kimi": "tiny-kimi-linear"}
ASSETS = ROOT / "replayquant" / "assets"
RESULTS = ROOT / "results" / "train_tiny"
DEMO_RESULTS = ROOT / "results" / "demo"
DEMO_PAIRS = ["s32_rs", "sbf16", "f4_sr_rs", "tp4_hi32", "tp4_hi16_sr"]
T_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:6.1f} s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ models
def qwen_config(vocab_size: int, eos_id: int):
    """Qwen3.5 architecture, scaled down: 6 Gated DeltaNet layers + 2 gated full-attention layers
    (the 3:1 pattern of Qwen3.5), 2 key heads of 128 (Qwen3.5's key head size) / 4 value heads of
    64 (each value head a 128x64 state).
    rope_theta 1000: every rotary frequency completes a period inside the training context, so
    16K contexts see no unseen rotation angles."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
        linear_value_head_dim=64, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=131072, tie_word_embeddings=True, use_cache=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def mamba_config(vocab_size: int, eos_id: int):
    """Mamba-2, scaled down: 8 layers, d_model 256, expand 2, 8 heads of 64, d_state 128 (Mamba-2's
    default), 1 group (each head a 64x128 state). initializer_range 0.02 (HF's default 0.1 starts the tied output
    layer far above ln(vocab)); time_step_min 1e-4 (HF 1e-3): dt_bias initialised so that dt is
    log-uniform in [1e-4, 0.1], decay rates dt * A from 1e-4 (memory ~10K tokens) up."""
    from transformers import Mamba2Config
    return Mamba2Config(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=8, expand=2, head_dim=64,
        num_heads=8, state_size=128, n_groups=1, conv_kernel=4, chunk_size=64,
        initializer_range=0.02, time_step_min=1e-4, time_step_floor=1e-4,
        tie_word_embeddings=True, use_cache=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def kimi_config(vocab_size: int, eos_id: int):
    """Kimi Linear architecture, sized as tiny-qwen3.5: 6 Kimi Delta Attention layers + 2
    attention layers (the 3:1 pattern), KDA 2 heads of 128 (Kimi Linear's head size; each head a
    128x128 state: as many state elements per layer as tiny-qwen3.5's 4 x 128x64); the attention
    layers are Kimi Linear's MLA (no positional encoding, as in Kimi Linear), 4 heads; dense MLPs
    of 384 everywhere (the MoE of the large model buys nothing at this size). The LM head is its
    own matrix: transformers' KimiLinearForCausalLM ties no weights (5.3M parameters in all)."""
    from transformers import KimiLinearConfig
    return KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"], mlp_layer_types=["dense"] * 8,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        linear_num_heads=2, linear_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=131072, tie_word_embeddings=False, use_cache=True,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)


def build_model(kind: str, vocab_size: int, eos_id: int):
    from transformers import KimiLinearForCausalLM, Mamba2ForCausalLM, Qwen3_5ForCausalLM
    if kind == "qwen":
        return Qwen3_5ForCausalLM(qwen_config(vocab_size, eos_id))
    if kind == "mamba":
        return Mamba2ForCausalLM(mamba_config(vocab_size, eos_id))
    if kind == "kimi":
        return KimiLinearForCausalLM(kimi_config(vocab_size, eos_id))
    raise ValueError(f"unknown model kind {kind!r}: use one of {', '.join(MODEL_NAMES)}")


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _is_kda_gate(mod) -> bool:
    """A Kimi Delta Attention forget gate (A_log per head, dt_bias per head and key channel)."""
    return type(mod).__name__.endswith("ForgetGate") and hasattr(mod, "dt_bias")


def _kda_rates(mod):
    """Decay rate at zero input of each channel of a KDA forget gate, exp(A_log) *
    softplus(dt_bias): [H, d_k] float64 (memory ~ 1 / rate tokens)."""
    import torch.nn.functional as F
    H = mod.A_log.numel()
    sp = F.softplus(mod.dt_bias.detach().double().cpu()).reshape(H, -1)
    return mod.A_log.detach().double().cpu().reshape(H, 1).exp() * sp


def _quantiles(r) -> list[list[float]]:
    """Per head: min, quartiles and max of its channels' rates (3 significant digits)."""
    import torch
    q = torch.quantile(r, torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=r.dtype), dim=1).T
    return [[float(f"{x:.3g}") for x in row] for row in q]


def init_long_memory(model, seed: int, lo: float = 1e-4, hi: float = 1.0) -> list[list[float]]:
    """GDN layers: set A_log so that each head's decay rate at a = 0, A * softplus(dt_bias), is
    spread log-uniformly over [lo, hi] (heads evenly spaced in log space, a random offset per
    layer). Kimi Delta Attention layers: the same over the H * d_k channels of each layer (A_log
    = 0 and dt_bias = softplus^-1 of the rate; the rates dealt to the channels in a random order,
    so every head holds short and long memories); their record per head is [min, quartiles,
    max]. Returns the rates per layer. Mamba-2 needs nothing here (see mamba_config)."""
    import torch
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(seed + 17)
    rates = []
    with torch.no_grad():
        for mod in model.modules():
            if _is_kda_gate(mod):
                n = mod.dt_bias.numel()
                u = (torch.arange(n, dtype=torch.float64) + torch.rand(1, generator=gen,
                                                                       dtype=torch.float64)) / n
                r = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
                r = r[torch.randperm(n, generator=gen)]
                mod.A_log.zero_()
                mod.dt_bias.copy_(torch.log(torch.expm1(r)).to(mod.dt_bias.dtype))
                rates.append(_quantiles(_kda_rates(mod)))
            elif type(mod).__name__.endswith("GatedDeltaNet"):
                h = mod.A_log.numel()
                u = (torch.arange(h, dtype=torch.float64) + torch.rand(1, generator=gen,
                                                                       dtype=torch.float64)) / h
                r = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
                sp = F.softplus(mod.dt_bias.detach().double().cpu())
                mod.A_log.copy_(torch.log(r / sp).to(mod.A_log.dtype))
                rates.append([round(float(x), 6) for x in r])
    return rates


def decay_rates(model) -> list[list[float]]:
    """Per layer and head, the decay rate at zero input of the trained model (GDN: A *
    softplus(dt_bias); Mamba-2: A * softplus(dt_bias); Kimi Delta Attention: per head [min,
    quartiles, max] of its channels' exp(A_log) softplus(dt_bias)): memory ~ 1 / rate tokens."""
    import torch.nn.functional as F
    out = []
    for mod in model.modules():
        if _is_kda_gate(mod):
            out.append(_quantiles(_kda_rates(mod)))
        elif hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
            r = mod.A_log.detach().float().exp() * F.softplus(mod.dt_bias.detach().float())
            out.append([float(f"{x:.3g}") for x in r.cpu()])
    return out


def add_dropout(model, p: float) -> list:
    """Residual dropout for training: forward hooks on every token mixer (GDN, attention, Mamba-2
    mixer), MLP and the embedding output. Inactive in eval mode; the shipped models have no hooks."""
    import torch.nn.functional as F
    if p <= 0:
        return []

    def hook(mod, inp, out):
        if not mod.training:
            return out
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, True),) + tuple(out[1:])
        return F.dropout(out, p, True)

    suffixes = (".linear_attn", ".self_attn", ".mlp", ".mixer", ".embed_tokens", ".embeddings")
    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith(suffixes)]
    if not handles:
        raise RuntimeError("add_dropout: no mixer / MLP / embedding modules found")
    return handles


# ------------------------------------------------------------------------- scans: fast, reference
def _hf_modules():
    from transformers.models.mamba2 import modeling_mamba2 as mm
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qm
    return qm, mm


@functools.cache
def hf_mamba_scan():
    """transformers' own Mamba-2 chunked scan (the torch code every CPU user runs)."""
    return _hf_modules()[1].mamba2_chunk_scan


@functools.cache
def _hf_gdn_wrapper():
    """transformers' module-level `torch_chunk_gated_delta_rule` as imported (before any patch)."""
    return _hf_modules()[0].torch_chunk_gated_delta_rule


def hf_gdn_reference():
    """transformers' torch chunked gated delta rule (the function its wrapper falls back to)."""
    fn = _hf_gdn_wrapper()
    return getattr(fn, "__wrapped__", fn)


def _hf_kimi():
    from transformers.models.kimi_linear import modeling_kimi_linear as km
    return km


@functools.cache
def _hf_kda_wrapper():
    """transformers' module-level `chunk_kimi_delta_attention` as imported (before any patch)."""
    return _hf_kimi().chunk_kimi_delta_attention


def hf_kda_reference():
    """transformers' torch chunked Kimi Delta Attention (what its wrapper falls back to)."""
    fn = _hf_kda_wrapper()
    return getattr(fn, "__wrapped__", fn)


def gdn_fla_impl():
    """The fla function transformers' Qwen3.5 GDN resolved at import, or None (torch fallback)."""
    return fla_impl(_hf_gdn_wrapper())


def fla_impl(fn):
    """The fla function a transformers kernel wrapper resolved at import, or None (its torch
    fallback)."""
    for cell in fn.__closure__ or ():
        try:
            obj = cell.cell_contents
        except ValueError:
            continue
        if callable(obj) and str(getattr(obj, "__module__", "")).startswith("fla"):
            return obj
    return None


def naive_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                     **kwargs):
    """Reference for fla's chunk_simple_gla (quadratic form; tests and the CPU dry run):
    S_t = exp(g_t) S_{t-1} + k_t v_t^T, o_t = scale * q_t S_t; shapes [B, T, H, K|V], g [B, T, H]."""
    import torch
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf, gf = q.float(), k.float(), v.float(), g.float()
    G = gf.cumsum(1)                                        # [B, T, H]
    T = q.shape[1]
    diff = G[:, :, None, :] - G[:, None, :, :]              # [B, t, s, H]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal[None, :, :, None], diff, float("-inf")).exp()
    att = torch.einsum("bthk,bshk->btsh", qf, kf) * decay
    o = torch.einsum("btsh,bshv->bthv", att, vf)
    if initial_state is not None:
        o = o + torch.einsum("bthk,bhkv->bthv", qf * G.exp()[..., None], initial_state.float())
    o = o * scale
    final = None
    if output_final_state:
        w = (G[:, -1:, :] - G).exp()                        # [B, s, H]
        final = torch.einsum("bsh,bshk,bshv->bhkv", w, kf, vf)
        if initial_state is not None:
            final = final + G[:, -1, :, None, None].exp() * initial_state.float()
    return o.to(q.dtype), final


def make_mamba2_scan(gla):
    """A drop-in for transformers' `mamba2_chunk_scan` computing the SSD recurrence with a
    scalar-decay gated-linear-attention kernel `gla` (fla's chunk_simple_gla on the GPU)."""
    import torch
    import torch.nn.functional as F

    def scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        bsz, T, H, P = hidden_states.shape
        groups = B.shape[2]
        dt = dt.float()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        cdt = (torch.bfloat16 if torch.is_autocast_enabled(hidden_states.device.type)
               else torch.float32)
        x = hidden_states.float()
        q = C.repeat_interleave(H // groups, dim=2).to(cdt)
        k = B.repeat_interleave(H // groups, dim=2).to(cdt)
        v = (x * dt[..., None]).to(cdt)
        g = dt * A.float()[None, None, :]                  # log decay per step, <= 0
        h0 = None if initial_states is None else initial_states.transpose(-1, -2).contiguous()
        o, ht = gla(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), scale=1.0,
                    initial_state=h0, output_final_state=return_final_states)
        y = o.float()
        if D is not None:
            y = y + D.float()[:, None] * x
        if return_final_states:
            return y, ht.transpose(-1, -2).float()          # HF's state layout [B, H, P, N]
        return y

    scan.gla = gla
    return scan


def make_gdn(impl, chunk_size: int):
    """transformers' call of the chunked gated delta rule, sent to fla's kernel `impl` with a
    given chunk size."""
    def gdn(query, key, value, g, beta, chunk_size_=None, initial_state=None,
            output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return impl(query, key, value, g=g, beta=beta, initial_state=initial_state,
                    output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                    chunk_size=chunk_size)
    return gdn


@contextlib.contextmanager
def patched(mod, name: str, fn):
    old = getattr(mod, name)
    setattr(mod, name, fn)
    try:
        yield
    finally:
        setattr(mod, name, old)


@contextlib.contextmanager
def reference_paths():
    """transformers' torch scans for both architectures (the code the shipped models run)."""
    qm, mm = _hf_modules()
    with patched(qm, "torch_chunk_gated_delta_rule", hf_gdn_reference()), \
            patched(mm, "mamba2_chunk_scan", hf_mamba_scan()), \
            patched(_hf_kimi(), "chunk_kimi_delta_attention", hf_kda_reference()):
        yield


def segment_reset(fn, seg: int):
    """Wrap a chunked scan ([B, T, ...] tensors in, [B, T, ...] out) so that its recurrent state
    starts from zero every `seg` tokens: [B, T] is cut into [B * n, seg] rows (T padded at the end,
    which a causal scan never sees)."""
    import torch
    import torch.nn.functional as F

    def wrapped(*args, **kwargs):
        x0 = args[0] if args else next(iter(kwargs.values()))
        bsz, T = x0.shape[:2]
        n = -(-T // seg)
        pad = n * seg - T
        if kwargs.get("initial_state") is not None or kwargs.get("initial_states") is not None:
            raise ValueError("segment_reset: no initial state allowed (use_cache=False)")

        def cut(x):
            if torch.is_tensor(x) and x.dim() >= 2 and tuple(x.shape[:2]) == (bsz, T):
                if pad:
                    x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
                return x.reshape(bsz * n, seg, *x.shape[2:])
            return x

        def join(y):
            if torch.is_tensor(y) and y.dim() >= 2 and y.shape[0] == bsz * n and y.shape[1] == seg:
                return y.reshape(bsz, n * seg, *y.shape[2:])[:, :T]
            return y

        out = fn(*[cut(a) for a in args], **{k: cut(v) for k, v in kwargs.items()})
        if isinstance(out, tuple):
            return (join(out[0]),) + (None,) * (len(out) - 1)
        return join(out)

    return wrapped


@contextlib.contextmanager
def recurrent_reset(seg: int):
    """The recurrent state of every GDN / KDA / Mamba-2 layer restarts from zero every `seg`
    tokens; everything else (attention layers, the 4-tap convolutions) still sees the whole
    window."""
    qm, mm = _hf_modules()
    km = _hf_kimi()
    with patched(qm, "torch_chunk_gated_delta_rule", segment_reset(qm.torch_chunk_gated_delta_rule, seg)), \
            patched(mm, "mamba2_chunk_scan", segment_reset(mm.mamba2_chunk_scan, seg)), \
            patched(km, "chunk_kimi_delta_attention", segment_reset(km.chunk_kimi_delta_attention, seg)):
        yield


def _rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def check_scan(kind: str, fast, device, bf16: bool, T: int = 512, seed: int = 0) -> dict:
    """Outputs and input gradients of a fast scan (called as the model calls it) vs transformers'
    torch scan on random inputs with the tiny models' head shapes. bf16: inputs rounded to bf16
    and the fast scan run under bf16 autocast, as in training; the reference runs in fp32 on the
    same values. Returns relative max errors (max |difference| / max |reference|)."""
    import torch
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dt_in = torch.bfloat16 if bf16 else torch.float32

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt_in)

    if kind == "qwen":
        B, H, K, V = 2, 4, 128, 64
        ins = {"query": rnd(B, T, H, K), "key": rnd(B, T, H, K), "value": rnd(B, T, H, V),
               "g": (-torch.rand(B, T, H, generator=gen) ** 3 * 2).to(device),
               "beta": torch.rand(B, T, H, generator=gen).to(device=device, dtype=dt_in)}
        ref = hf_gdn_reference()

        def run(fn, t):
            return fn(t["query"], t["key"], t["value"], g=t["g"], beta=t["beta"],
                      use_qk_l2norm_in_kernel=True)[0]
    elif kind == "kimi":
        B, H, K = 2, 2, 128
        ins = {"query": rnd(B, T, H, K), "key": rnd(B, T, H, K), "value": rnd(B, T, H, K),
               "g": (-torch.rand(B, T, H, K, generator=gen) ** 3 * 2).to(device),
               "beta": torch.rand(B, T, H, generator=gen).to(device=device, dtype=dt_in)}
        ref = hf_kda_reference()

        def run(fn, t):
            return fn(t["query"], t["key"], t["value"], g=t["g"], beta=t["beta"],
                      use_qk_l2norm_in_kernel=True)[0]
    else:
        B, H, P, N = 2, 8, 64, 128
        dt_bias = torch.log(torch.expm1(torch.exp(torch.linspace(math.log(1e-4), math.log(0.1), H))))
        ins = {"hidden_states": rnd(B, T, H, P), "dt": rnd(B, T, H, scale=0.5),
               "B": rnd(B, T, 1, N, scale=0.3), "C": rnd(B, T, 1, N, scale=0.3)}
        fixed = {"A": -torch.arange(1, H + 1, dtype=torch.float32).to(device),
                 "D": torch.ones(H, device=device), "dt_bias": dt_bias.to(device)}
        ref = hf_mamba_scan()

        def run(fn, t):
            return fn(t["hidden_states"], t["dt"], fixed["A"], t["B"], t["C"], chunk_size=64,
                      D=fixed["D"], dt_bias=fixed["dt_bias"], dt_softplus=True)
    t_f = {k: v.detach().clone().requires_grad_(True) for k, v in ins.items()}
    t_r = {k: v.detach().float().clone().requires_grad_(True) for k, v in ins.items()}
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        o_f = run(fast, t_f)
    o_r = run(ref, t_r)
    w = torch.randn(*o_r.shape, generator=gen).to(device)
    (o_f.float() * w).sum().backward()
    (o_r.float() * w).sum().backward()
    res = {"out": _rel_err(o_f, o_r)}
    for k in ins:
        res["grad_" + k] = _rel_err(t_f[k].grad, t_r[k].grad)
    return {"T": T, "inputs": "bf16 + autocast" if bf16 else "fp32",
            "rel_max_err": {k: float(f"{v:.3g}") for k, v in res.items()}}


def model_logit_diff(model, ids, autocast: bool) -> dict:
    """Max |logit difference| of the whole model (same weights, eval mode): the scans in place now
    (the training path) vs transformers' torch scans. autocast: both under bf16 autocast (as in
    training: fla's kernels then run in bf16, transformers' torch scans upcast to fp32)."""
    import torch
    was = model.training
    model.eval()
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        fast = model(input_ids=ids, use_cache=False).logits.float()
        with reference_paths():
            ref = model(input_ids=ids, use_cache=False).logits.float()
    model.train(was)
    return {"tokens": int(ids.numel()), "bf16_autocast": autocast,
            "max_abs_logit_diff": float(f"{(fast - ref).abs().max():.3g}"),
            "mean_abs_logit_diff": float(f"{(fast - ref).abs().mean():.3g}"),
            "max_abs_logit": float(f"{ref.abs().max():.3g}"),
            "nll_fast": round(float(torch.nn.functional.cross_entropy(fast[0, :-1], ids[0, 1:])), 5),
            "nll_reference": round(float(torch.nn.functional.cross_entropy(ref[0, :-1], ids[0, 1:])), 5)}


# ------------------------------------------------------------------------------------------- train
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def token_loss(model, ids, autocast: bool):
    """Per-position next-token cross entropy (fp32) of a [B, T] batch: [B, T - 1]."""
    import torch
    import torch.nn.functional as F
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                          reduction="none").view(ids.shape[0], -1)
    return nll


def eval_stream(model, tokens: np.ndarray, ctx: int, device, autocast: bool) -> float:
    """Mean NLL over the non-overlapping windows of ctx+1 tokens of one stream, in one batch."""
    import torch
    model.eval()
    n = (len(tokens) - 1) // ctx
    batch = np.stack([tokens[w * ctx:w * ctx + ctx + 1] for w in range(n)]).astype(np.int64)
    with torch.no_grad():
        nll = token_loss(model, torch.from_numpy(batch).to(device), autocast)
    model.train()
    return float(nll.mean())


BUCKETS = [0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]


def eval_heldout(model, docs_tokens: list[np.ndarray], eos_id: int, ctx: int, device,
                 batch: int | None = None, reset_every: int | None = None) -> dict:
    """Held-out perplexity at context `ctx`: every book is [EOS] + its tokens, cut into consecutive
    windows of ctx tokens (each from a fresh state); every token after a window's first is scored.
    fp32, no autocast, transformers' torch scans (as the shipped weights run on a CPU). Also the
    mean NLL by position in the window (log-spaced buckets), which shows whether the model uses
    long context. `reset_every`: the recurrent layers' state restarts every that many tokens.
    batch: windows per forward, default 16K tokens' worth (transformers' Mamba-2 torch scan holds
    a [batch, chunks + 1, chunks + 1, heads, head_dim, d_state] fp32 tensor: 17 GB at 1 x 16K with
    d_state 128; 8 x 16K asks for 129 GB)."""
    import torch
    batch = batch or max(1, min(8, 16384 // ctx))
    model.eval()
    windows = []
    for doc in docs_tokens:
        seq = np.concatenate([[eos_id], doc]).astype(np.int64)
        windows += [seq[s:s + ctx] for s in range(0, len(seq) - 1, ctx) if len(seq[s:s + ctx]) >= 2]
    total, count = 0.0, 0
    nb = len(BUCKETS) - 1
    bsum, bcnt = np.zeros(nb), np.zeros(nb)
    bucket_of = np.searchsorted(BUCKETS, np.arange(1, ctx), side="right") - 1
    by_len: dict[int, list[np.ndarray]] = {}
    for w in windows:
        by_len.setdefault(len(w), []).append(w)
    reset = recurrent_reset(reset_every) if reset_every else contextlib.nullcontext()
    with torch.no_grad(), reference_paths(), reset:
        for length in sorted(by_len):
            group = by_len[length]
            for i in range(0, len(group), batch):
                ids = torch.from_numpy(np.stack(group[i:i + batch])).to(device)
                nll = token_loss(model, ids, autocast=False).double().cpu().numpy()
                total += nll.sum()
                count += nll.size
                per_pos = nll.sum(0)
                np.add.at(bsum, bucket_of[:length - 1], per_pos)
                np.add.at(bcnt, bucket_of[:length - 1], nll.shape[0])
    model.train()
    mean = total / count
    out = {"context": ctx, "windows": len(windows), "tokens_scored": int(count),
           "nll": round(float(mean), 5), "ppl": round(math.exp(mean), 3),
           "nll_by_position": {f"{BUCKETS[b]}-{BUCKETS[b + 1]}": round(float(bsum[b] / bcnt[b]), 4)
                               for b in range(nb) if bcnt[b] > 0}}
    if reset_every:
        out["recurrent_state_reset_every"] = reset_every
    return out


def long_memory_eval(model, heldout_docs, eos_id, args, device, name):
    """Held-out perplexity at each of args.eval_contexts and at the longest with the recurrent
    state reset every args.reset_every tokens, logged; returns (evaluations, summary)."""
    evals = [eval_heldout(model, heldout_docs, eos_id, ctx, device) for ctx in args.eval_contexts]
    evals.append(eval_heldout(model, heldout_docs, eos_id, max(args.eval_contexts), device,
                              reset_every=args.reset_every))
    for e in evals:
        log(f"[{name}] held-out ppl @ ctx {e['context']}"
            + (f" (recurrent state reset every {args.reset_every})" if e.get("recurrent_state_reset_every") else "")
            + f": {e['ppl']}  by position {e['nll_by_position']}")
    summary = long_memory_summary(evals)
    log(f"[{name}] long memory: {json.dumps(summary)}")
    return evals, summary


def long_memory_summary(evals: list[dict]) -> dict:
    """The numbers that say whether the state carries information across thousands of tokens."""
    by = {(e["context"], e.get("recurrent_state_reset_every")): e for e in evals}
    out = {"ppl_by_context": {str(e["context"]): e["ppl"] for e in evals
                              if not e.get("recurrent_state_reset_every")}}
    longest = max(c for c, r in by if r is None)
    carried = by[(longest, None)]["nll_by_position"]
    late = [k for k in carried if int(k.split("-")[0]) >= 2048]
    out["nll_early_64_512"] = round(float(np.mean([carried[k] for k in ("64-256", "256-512")
                                                    if k in carried])), 4)
    out["nll_late_from_2048"] = round(float(np.mean([carried[k] for k in late])), 4) if late else None
    for (c, r), e in by.items():
        if r is not None:
            rb = e["nll_by_position"]
            keys = [k for k in rb if int(k.split("-")[0]) >= 512 and k in carried]
            gap = {k: round(rb[k] - carried[k], 4) for k in keys}
            out[f"recurrent_reset_{r}_vs_carried_ctx{c}"] = {
                "nll_reset": e["nll"], "nll_carried": by[(c, None)]["nll"],
                "nll_gap": round(e["nll"] - by[(c, None)]["nll"], 5),
                "nll_gap_by_position_from_512": gap}
    if (512, None) in by and (longest, None) in by:
        out["full_reset_512_minus_carried"] = round(by[(512, None)]["nll"]
                                                    - by[(longest, None)]["nll"], 5)
    return out


# -------------------------------------------------------------------------------------- fast paths
def setup_fast_paths(args, device) -> dict:
    """Pick the training scans: for each architecture, the first candidate whose outputs and input
    gradients match transformers' torch scan (check_scan) at the tiny models' head shapes, else
    transformers' torch scan itself (slow; said loudly). Aborts if fla is required but missing.

    fla 0.6.0 refuses gated backward kernels on Hopper with Triton 3.4-3.7.0 (its issue #640: a
    Triton code-generation bug corrupting dk at key block size 64). The tiny models use key / state
    sizes of 128 (block 128, the configuration that report calls correct), the refusal is lifted,
    and the gradient check at the training shapes decides; a candidate that fails it is not used.
    Returns {"record": ..., "qwen_scan": fn or None, "mamba_scan": fn or None} (None: transformers'
    own torch scan)."""
    import torch
    cuda = device.type == "cuda"
    rec = {}
    _hf_gdn_wrapper()                  # capture transformers' own functions before any patching
    _hf_kda_wrapper()
    hf_mamba_scan()
    qwen_cands, mamba_cands, kimi_cands = [], [], []
    if args.require_fla:
        try:
            import fla  # noqa: F401
            rec["fla_version"] = getattr(fla, "__version__", "?")
        except Exception as e:
            raise SystemExit(f"FAST PATH MISSING: cannot import fla ({e!r}); install the carried "
                             f"wheels (.gpu/wheels) into a --target dir on PYTHONPATH")
        impl = gdn_fla_impl()
        if impl is None:
            raise SystemExit("FAST PATH MISSING: transformers' Qwen3.5 GDN did not resolve fla's "
                             "chunk_gated_delta_rule")
        import fla.ops.common.chunk_o as fla_chunk_o
        if getattr(fla_chunk_o, "TRITON_ABOVE_3_7_1", True) is False:
            fla_chunk_o.TRITON_ABOVE_3_7_1 = True          # lift the #640 refusal; checked below
            rec["fla_hopper_guard_lifted"] = True
        kda = fla_impl(_hf_kda_wrapper())
        if kda is None and "kimi" in args.models.split(","):
            raise SystemExit("FAST PATH MISSING: transformers' Kimi Delta Attention did not "
                             "resolve fla's chunk_kda")
        # transformers' own call of chunk_kda (its wrapper as imported, fla inside)
        kimi_cands = [("fla chunk_kda (transformers' call)", _hf_kda_wrapper())]
        from fla.ops.simple_gla import chunk_simple_gla, fused_chunk_simple_gla
        qwen_cands = [("fla chunk_gated_delta_rule, chunk 64", make_gdn(impl, 64)),
                      ("fla chunk_gated_delta_rule, chunk 32", make_gdn(impl, 32))]
        mamba_cands = [("fla fused_chunk_simple_gla (q=C, k=B, v=dt*x, g=dt*A)",
                        make_mamba2_scan(fused_chunk_simple_gla)),
                       ("fla chunk_simple_gla (q=C, k=B, v=dt*x, g=dt*A)",
                        make_mamba2_scan(chunk_simple_gla))]
    elif args.mamba_scan == "naive":
        mamba_cands = [("naive simple GLA (q=C, k=B, v=dt*x, g=dt*A; CPU dry run)",
                        make_mamba2_scan(naive_simple_gla))]
    if args.mamba_scan == "hf":
        mamba_cands = []
    tol = 0.1 if cuda else 0.02
    chosen = {}
    trained = [k for k in args.models.split(",") if k]
    for kind, cands in (("qwen", qwen_cands), ("mamba", mamba_cands), ("kimi", kimi_cands)):
        if kind not in trained:                # nothing to train: no kernels to compile and check
            cands = []
        rec[f"{kind}_checks"] = []
        chosen[kind] = (None, "transformers torch scan")
        for label, fn in cands:
            t0 = time.time()
            try:
                chk = check_scan(kind, fn, device, bf16=cuda)
                ok = max(chk["rel_max_err"].values()) <= tol
            except Exception as e:
                chk, ok = {"error": repr(e)[:500]}, False
            chk.update(candidate=label, passed=ok, seconds=round(time.time() - t0, 1))
            rec[f"{kind}_checks"].append(chk)
            log(f"fast path check {kind}: {chk}")
            if ok:
                chosen[kind] = (fn, label)
                break
        if cands and chosen[kind][0] is None:
            if kind in ("qwen", "kimi") and not args.fast_fallback:
                raise SystemExit(f"FAST PATH WRONG: no fla {kind} candidate matches "
                                 f"transformers' scan")
            log(f"!!! {kind}: NO FAST SCAN PASSED ITS CHECK; training on transformers' torch scan "
                f"(slow) !!!")
        rec[f"{kind}_training_scan"] = chosen[kind][1]
    if cuda:
        torch.cuda.synchronize()
    return {"record": rec, "qwen_scan": chosen["qwen"][0], "mamba_scan": chosen["mamba"][0],
            "kimi_scan": chosen["kimi"][0], "labels": {k: v[1] for k, v in chosen.items()}}


# ------------------------------------------------------------------------------------------- train
def load_data(data: Path, heldout_limit: int = 0):
    meta = json.loads((data / "corpus.json").read_text())
    heldout = np.load(data / "heldout.npy")
    docs = json.loads((data / "heldout_docs.json").read_text())
    heldout_docs, pos = [], 0
    for d in docs:                              # heldout.npy is [EOS doc0 EOS doc1 ...]
        assert heldout[pos] == meta["eos_id"]
        heldout_docs.append(heldout[pos + 1:pos + 1 + d["tokens"]])
        pos += 1 + d["tokens"]
    if heldout_limit:
        heldout_docs = [d[:heldout_limit] for d in heldout_docs]
    return meta, np.load(data / "train.npy"), np.load(data / "val.npy"), heldout_docs


def train_one(kind: str, data: Path, out: Path, args, steps: str, budget: float,
              fast: dict) -> dict:
    import torch
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    meta, train, val, heldout_docs = load_data(data, args.heldout_limit)
    vocab, eos_id = meta["vocab_size"], meta["eos_id"]
    name = MODEL_NAMES[kind]
    t_model = time.time()

    torch.manual_seed(args.seed)
    np_rng = np.random.default_rng(args.seed)
    model = build_model(kind, vocab, eos_id)
    init_rates = (init_long_memory(model, args.seed)
                  if kind in ("qwen", "kimi") and args.long_memory_init else None)
    model = model.to(device)
    model.config.use_cache = False
    model.train()
    hooks = add_dropout(model, args.dropout)
    nparam = n_params(model)
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    T, B = args.seq_len, args.batch
    val_ctx = min(T, args.val_context)
    qm, mm = _hf_modules()
    scan = fast[f"{kind}_scan"]
    scan_ctx = (contextlib.nullcontext() if scan is None
                else patched(qm, "torch_chunk_gated_delta_rule", scan) if kind == "qwen"
                else patched(_hf_kimi(), "chunk_kimi_delta_attention", scan) if kind == "kimi"
                else patched(mm, "mamba2_chunk_scan", scan))
    log(f"[{name}] {nparam / 1e6:.3f}M parameters, batch {B} x {T}, device {device}, "
        f"budget {budget:.0f} s, dropout {args.dropout}")

    total = None if steps == "auto" else int(steps)
    probe = 6                     # steps timed to resolve --steps auto (warmup is longer than this)
    losses, val_curve = [], []
    best = (float("inf"), -1, None)
    t0 = time.time()
    t_probe = None
    step = 0
    pending = []
    stopped_early = None
    hard_stop = t0 + 1.25 * budget
    if args.deadline:                           # leave --reserve seconds for evaluation + demos
        hard_stop = min(hard_stop, T_START + args.deadline - args.reserve)
    with scan_ctx:
        while total is None or step < total:
            starts = np_rng.integers(0, len(train) - T - 1, size=B)
            batch = np.stack([train[s:s + T + 1] for s in starts]).astype(np.int64)
            ids = torch.from_numpy(batch).to(device, non_blocking=True)
            lr = lr_at(step, total or 10 ** 9, args.lr, args.warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            loss = token_loss(model, ids, cuda).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            pending.append(loss.detach())
            step += 1
            if step == 1:
                first = float(loss)
                if not math.isfinite(first):
                    raise RuntimeError(f"[{name}] first training loss is {first}")
                log(f"[{name}] step 1 loss {first:.4f} (compile + first step {time.time() - t0:.1f} s)")
            if step == 2:
                if cuda:
                    torch.cuda.synchronize()
                t_probe = time.time()
            if total is None and step == probe:
                if cuda:
                    torch.cuda.synchronize()
                per_step = (time.time() - t_probe) / (probe - 2)
                left = budget - (time.time() - t0)
                # validation every eval_every steps costs about one step each time
                total = int(min(args.max_steps, max(probe + 1, probe + left / (per_step * 1.05))))
                log(f"[{name}] {per_step:.3f} s/step -> {total} steps for {budget:.0f} s")
            if total is not None and step < total and time.time() > hard_stop:
                log(f"[{name}] !!! past the hard stop at step {step}: stopping here")
                stopped_early = step
                total = step
            if len(pending) >= 10 or (total is not None and step >= total):
                losses += [round(float(x), 4) for x in torch.stack(pending).cpu()]
                pending = []
                if not math.isfinite(losses[-1]):
                    raise RuntimeError(f"[{name}] training loss is {losses[-1]} at step {step}")
            if total is not None and (step % args.eval_every == 0 or step >= total):
                vloss = eval_stream(model, val, val_ctx, device, cuda)
                val_curve.append((step, round(vloss, 4)))
                log(f"[{name}] step {step}/{total} lr {lr:.2e} train {float(loss.detach()):.4f} "
                    f"val {vloss:.4f}")
                if vloss < best[0]:
                    best = (vloss, step, {k: v.detach().to("cpu", copy=True)
                                          for k, v in model.state_dict().items()})
        train_time = time.time() - t0
        for h in hooks:
            h.remove()
        model.load_state_dict(best[2])
        # Ship bf16-rounded weights; compute in fp32 (config dtype float32 -> from_pretrained fp32)
        round_params_bf16(model)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        # the training scan vs transformers' own forward, same (shipped) weights, fp32
        probe_ids = torch.from_numpy(np.concatenate([[eos_id], heldout_docs[0][:2047]])
                                     .astype(np.int64)[None]).to(device)
        check = model_logit_diff(model, probe_ids, autocast=cuda)
        log(f"[{name}] trained weights, training path vs transformers' torch path (fp32): {check}")
    t1 = time.time()
    evals, summary = long_memory_eval(model, heldout_docs, eos_id, args, device, name)
    eval_time = time.time() - t1
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    folder = out / "_build" / name              # tarred later: the device returns at most 8 files
    save_model_folder(model, folder, data / "tokenizer")
    tokens_seen = total * B * T
    return {
        "name": name, "architecture": type(model).__name__, "parameters": nparam,
        "config": json.loads((folder / "config.json").read_text()),
        "seed": args.seed, "seq_len": T, "batch": B, "steps": total, "steps_arg": steps,
        "time_budget": budget, "stopped_early_at": stopped_early, "tokens_seen": tokens_seen,
        "epochs": round(tokens_seen / len(train), 2),
        "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
        "dropout": args.dropout,
        "optimizer": "AdamW(0.9, 0.95), cosine to 10%, grad clip 1.0, bf16 autocast",
        "training_scan": fast["labels"][kind],
        "training_vs_hf_forward": check,
        "long_memory_init": ({"kda_decay_rate_per_head_min_quartiles_max": init_rates}
                             if init_rates and kind == "kimi"
                             else {"gdn_decay_rate_per_head": init_rates} if init_rates
                             else {"mamba2_time_step_min": model.config.time_step_min}
                             if kind == "mamba" else None),
        "decay_rate_per_head_trained": decay_rates(model),
        "train_seconds": round(train_time, 1), "seconds_per_step": round(train_time / total, 4),
        "eval_seconds": round(eval_time, 1), "model_seconds": round(time.time() - t_model, 1),
        "best_val": {"step": best[1], "context": val_ctx, "nll": round(best[0], 4),
                     "ppl": round(math.exp(best[0]), 3)},
        "train_loss": losses, "val_curve": val_curve, "heldout": evals,
        "long_memory": summary,
        "safetensors_bytes": (folder / "model.safetensors").stat().st_size,
    }


def parse_train_stdout(path: Path, name: str) -> dict:
    """The training record of an earlier run, read back from its stdout (the lines `train_one`
    logs): steps, seconds per step, validation curve, train loss at the validation steps."""
    import re
    text = Path(path).read_text()
    pat = re.compile(rf"\[{re.escape(name)}\] step (\d+)/(\d+) lr \S+ train ([\d.]+) val ([\d.]+)")
    rows = [(int(a), int(b), float(c), float(d)) for a, b, c, d in pat.findall(text)]
    if not rows:
        raise SystemExit(f"{path}: no training lines for {name}")
    per = re.search(rf"\[{re.escape(name)}\] ([\d.]+) s/step", text)
    head = re.search(rf"\[{re.escape(name)}\] ([\d.]+)M parameters, batch (\d+) x (\d+)", text)
    best = min(rows, key=lambda r: r[3])
    return {"stdout": str(path), "steps": rows[-1][1], "seconds_per_step": float(per[1]) if per else None,
            "batch": int(head[2]) if head else None, "seq_len": int(head[3]) if head else None,
            "val_curve": [(r[0], r[3]) for r in rows], "train_loss_at_val_steps": [(r[0], r[2]) for r in rows],
            "best_val": {"step": best[0], "nll": best[3], "ppl": round(math.exp(best[3]), 3)}}


def evaluate_folder(kind: str, folder: Path, data: Path, args, device, train_stdout: Path | None) -> dict:
    """The long-memory evaluation of an already trained (shipped) model folder, fp32, with the
    training record of the run that made it read from that run's stdout."""
    import torch
    from transformers import AutoModelForCausalLM
    meta, train, _, heldout_docs = load_data(data, args.heldout_limit)
    name = MODEL_NAMES[kind]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(device).eval()
    t1 = time.time()
    evals, summary = long_memory_eval(model, heldout_docs, meta["eos_id"], args, device, name)
    rec = {"name": name, "architecture": type(model).__name__, "parameters": n_params(model),
           "config": json.loads((folder / "config.json").read_text()),
           "evaluated_from": str(folder.relative_to(ROOT)) if folder.is_relative_to(ROOT) else str(folder),
           "decay_rate_per_head_trained": decay_rates(model),
           "eval_seconds": round(time.time() - t1, 1), "heldout": evals, "long_memory": summary,
           "safetensors_bytes": (folder / "model.safetensors").stat().st_size}
    if train_stdout is not None and str(train_stdout).endswith(".json"):
        old = next(m for m in json.loads(Path(train_stdout).read_text())["models"] if m["name"] == name)
        keep = ("steps", "seq_len", "batch", "best_val", "val_curve", "train_loss", "tokens_seen",
                "epochs", "lr", "warmup", "weight_decay", "optimizer", "train_seconds",
                "seconds_per_step", "seed")
        rec.update({k: old[k] for k in keep if k in old})
        rec["training_run"] = {"log": str(train_stdout), "heldout_then": old.get("heldout")}
    elif train_stdout is not None:
        tr = parse_train_stdout(train_stdout, name)
        rec.update(training_run=tr, steps=tr["steps"], seq_len=tr["seq_len"], batch=tr["batch"],
                   best_val=tr["best_val"], val_curve=tr["val_curve"],
                   train_loss=None, train_loss_at_val_steps=tr["train_loss_at_val_steps"])
    return rec


def round_params_bf16(model) -> None:
    """Round every parameter to bf16 in place, keeping fp32 storage (buffers such as RoPE's
    inv_freq stay exact: they are computed from the config, not shipped)."""
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def save_model_folder(model, folder: Path, tokenizer_dir: Path) -> None:
    """HF folder: bf16 safetensors (the parameters, already bf16-exact), config with dtype float32
    (from_pretrained loads and computes in fp32 by default), generation config, tokenizer files."""
    import torch
    folder.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    sd = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")                  # tied to the input embedding: stored once
    model.save_pretrained(str(folder), state_dict=sd)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in sorted(tokenizer_dir.iterdir()):
        shutil.copy(f, folder / f.name)


def plot_losses(logs: list[dict], path: Path) -> None:
    """Write `loss_figure(logs)` to `path`."""
    import matplotlib.pyplot as plt
    fig = loss_figure(logs)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def loss_figure(logs: list[dict]):
    """Left: training / validation loss by step, with the step whose weights ship starred (the
    lowest validation loss: later steps overfit the training books). Right: held-out NLL by
    position in the window (longest context), recurrent state carried vs reset every
    --reset-every tokens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4))
    for lg, c in zip(logs, ["tab:blue", "tab:orange", "tab:green"]):
        if lg.get("train_loss"):
            y = np.array(lg["train_loss"])
            k = min(10, len(y))
            smooth = np.convolve(y, np.ones(k) / k, mode="valid")
            ax.plot(np.arange(k, len(y) + 1), smooth, color=c, lw=1.2,
                    label=f"{lg['name']} train ({lg['parameters'] / 1e6:.1f}M params, "
                          f"{lg['seq_len'] // 1024}K context)")
        else:                                   # an earlier run: its stdout has one batch per 50 steps
            xs, ys = zip(*lg["train_loss_at_val_steps"])
            ax.plot(xs, ys, "x-", color=c, ms=4, lw=0.8,
                    label=f"{lg['name']} train, one batch ({lg['parameters'] / 1e6:.1f}M params, "
                          f"{lg['seq_len'] // 1024}K context)")
        vs, vl = zip(*lg["val_curve"])
        ax.plot(vs, vl, "o--", color=c, ms=3, lw=0.8, label=f"{lg['name']} validation")
        for e in lg["heldout"]:
            if e["context"] != max(x["context"] for x in lg["heldout"]):
                continue
            keys = list(e["nll_by_position"])
            mids = [math.sqrt(max(1, int(a)) * int(b)) for a, b in (k_.split("-") for k_ in keys)]
            reset = e.get("recurrent_state_reset_every")
            bx.plot(mids, list(e["nll_by_position"].values()), "--" if reset else "-o", color=c,
                    ms=3, lw=1.2, label=f"{lg['name']} " + (f"state reset every {reset}"
                                                            if reset else "state carried"))
    best = [(lg["best_val"]["step"], dict(lg["val_curve"])[lg["best_val"]["step"]], lg["steps"])
            for lg in logs]
    ax.plot([b[0] for b in best], [b[1] for b in best], "*", color="black", ms=11, zorder=5,
            label="weights shipped: lowest validation loss, step " +
                  ", ".join(f"{s}/{n}" for s, _, n in best))
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_ylim(bottom=min(min(lg.get("train_loss") or [y for _, y in lg["train_loss_at_val_steps"]])
                           for lg in logs) - 0.2, top=6.0)
    ax.set_title("Tiny models on the KJV (4096-token BPE)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    bx.set_xscale("log")
    bx.set_xlabel("position in the window (tokens, bucket geometric mid)")
    bx.set_ylabel("held-out NLL (nats)")
    bx.set_title("Held-out books, fp32: does the state carry information?")
    bx.grid(alpha=0.3)
    bx.legend(fontsize=8)
    fig.tight_layout()
    return fig


def train_all(args, out: Path, fast: dict) -> dict:
    """Train, evaluate and save every model in --models; returns the log (also written)."""
    import torch
    from replayquant.provenance import provenance
    data = Path(args.data)
    kinds = [k for k in args.models.split(",") if k]
    args.evaluate_also = [k for k in (args.evaluate_also or "").split(",") if k]
    steps = args.steps.split(",")
    budgets = [float(b) for b in str(args.time_budget).split(",")]
    if len(steps) == 1:
        steps = steps * len(kinds)
    if len(budgets) == 1:
        budgets = budgets * len(kinds)
    if len(steps) != len(kinds) or not all(x == "auto" or x.isdigit() for x in steps) \
            or len(budgets) != len(kinds):
        raise SystemExit(f"--steps {args.steps!r} / --time-budget {args.time_budget!r}: give one "
                         f"value, or one per model ({len(kinds)}: {args.models})")
    logs = []
    device = torch.device(args.device)
    for kind in args.evaluate_also:
        logs.append(evaluate_folder(kind, ASSETS / MODEL_NAMES[kind], data, args, device,
                                    Path(args.train_stdout) if args.train_stdout else None))
    for kind, nsteps, budget in zip(kinds, steps, budgets):
        logs.append(train_one(kind, data, out, args, nsteps, budget, fast))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    logs.sort(key=lambda lg: list(MODEL_NAMES.values()).index(lg["name"]))
    for lg in logs:                            # tar each model folder: the device returns <= 8 files
        if lg.get("evaluated_from"):
            continue
        with tarfile.open(out / f"{lg['name']}.tar", "w") as tf:
            tf.add(out / "_build" / lg["name"], arcname=lg["name"])
    plot_losses(logs, out / "loss_curve.png")
    record = {"provenance": provenance(device=args.device, command=" ".join(sys.argv),
                                       source_commit=args.source_commit,
                                       wall_seconds=round(time.time() - T_START, 1)),
              "fast_paths": fast["record"],
              "corpus": json.loads((data / "corpus.json").read_text()),
              "models": logs}
    record["corpus"]["source"].pop("copyright", None)
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    print("\nmodel            params   steps  train s  best val ppl  " +
          "  ".join(f"ppl@{e['context']}" + ("r" if e.get("recurrent_state_reset_every") else "")
                    for e in logs[0]["heldout"]))
    for lg in logs:
        print(f"{lg['name']:<16} {lg['parameters'] / 1e6:5.2f}M  {lg.get('steps') or 0:5d}  "
              f"{lg.get('train_seconds') or float('nan'):7.1f}  "
              f"{lg.get('best_val', {}).get('ppl', float('nan')):12.2f}  " +
              "  ".join(f"{e['ppl']:8.2f}" for e in lg["heldout"]), flush=True)
    return record


def prepare_device(args):
    import torch
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        import torch.utils.deterministic
        torch.utils.deterministic.fill_uninitialized_memory = False   # no extra fill kernels
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda but CUDA is not available")
        torch.backends.cuda.matmul.allow_tf32 = True
    return device


def cmd_train(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (Path(args.data) / "corpus.json").is_file():
        raise SystemExit(f"{args.data} has no corpus.json: run `python evals/train_tiny.py prepare` first")
    device = prepare_device(args)
    fast = setup_fast_paths(args, device)
    train_all(args, out, fast)
    shutil.rmtree(out / "_build", ignore_errors=True)


def run_demo(args, folder: Path, name: str, out_json: Path, timeout: float) -> dict:
    """`replayquant kl` on a trained model folder, in a subprocess without fla on its path (the
    harness's FP32 reference is transformers' torch code, as on any machine)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("REPLAYQUANT_GIT_COMMIT", args.source_commit or "unknown")
    dataset = subprocess.run([sys.executable, "-m", "replayquant.data"], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.strip()
    cmd = [sys.executable, "-m", "replayquant", "kl", "--model", str(folder)]
    for p in DEMO_PAIRS:
        cmd += ["--pair", p]
    cmd += ["--dataset", dataset, "--context", str(args.demo_context), "--docs", str(args.demo_docs),
            "--dtype", "float32", "--device-map", args.device, "--out", str(out_json),
            "--no-progress"]
    log(f"[demo {name}] {' '.join(cmd)}")
    t0 = time.time()
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(res.stdout[-6000:], res.stderr[-3000:], sep="\n", flush=True)
    if res.returncode != 0:
        raise RuntimeError(f"[demo {name}] replayquant kl exited {res.returncode}")
    return {"command": " ".join(cmd), "seconds": round(time.time() - t0, 1)}


def cmd_device_run(args) -> None:
    """train + 16K demo on the GPU; at most 8 files in --out."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = prepare_device(args)
    fast = setup_fast_paths(args, device)
    record = train_all(args, out, fast)
    # the new models into the package (this copy of the tree), then the demo on them
    import torch
    if args.demo_tag:
        tag = args.demo_tag
    elif device.type == "cuda":
        tag = "h200" if "H200" in torch.cuda.get_device_name(device) else "cuda"
    else:
        tag = device.type
    suffix = f"_ctx{args.demo_context // 1024}k_{tag}"
    demo_files = []
    record["demo"] = {}
    for lg in record["models"]:
        name = lg["name"]
        dest = ASSETS / name
        if not lg.get("evaluated_from"):     # trained here: into the package (this copy of the tree)
            if dest.exists():
                shutil.rmtree(dest)
            shutil.copytree(out / "_build" / name, dest)
        left = T_START + args.deadline - time.time() - 10 if args.deadline else 600
        if left < 20:
            log(f"!!! [demo {name}] skipped: only {left:.0f} s left before the deadline")
            record["demo"][name] = {"skipped": f"{left:.0f} s left"}
            continue
        out_json = DEMO_RESULTS / f"{name}{suffix}.json"
        for old in (out_json, out_json.with_suffix(".png")):
            old.unlink(missing_ok=True)
        shutil.rmtree(out_json.with_suffix(".kl"), ignore_errors=True)
        try:
            record["demo"][name] = run_demo(args, dest, name, out_json, timeout=left)
            demo_files += [out_json, out_json.with_suffix(".png"), out_json.with_suffix(".kl")]
        except Exception as e:               # keep what was trained: the log and models come back
            log(f"!!! [demo {name}] FAILED: {e!r}")
            record["demo"][name] = {"error": repr(e)}
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    if demo_files:
        with tarfile.open(out / "demo.tar", "w") as tf:
            for f in demo_files:
                if f.exists():
                    tf.add(f, arcname=str(f.relative_to(ROOT)))
    shutil.rmtree(out / "_build", ignore_errors=True)
    log(f"device-run done: {sorted(p.name for p in out.iterdir())}")


def cmd_evaluate(args) -> None:
    """The long-memory evaluation of the shipped model folders (no training): log + PNG in --out."""
    from replayquant.provenance import provenance
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = prepare_device(args)
    records = {}
    for item in args.train_record:
        kind, _, path = item.partition("=")
        records[kind] = Path(path)
    logs = [evaluate_folder(kind, ASSETS / MODEL_NAMES[kind], Path(args.data), args, device,
                            records.get(kind)) for kind in args.models.split(",") if kind]
    plot_losses(logs, out / "loss_curve.png")
    record = {"provenance": provenance(device=args.device, command=" ".join(sys.argv),
                                       source_commit=args.source_commit,
                                       wall_seconds=round(time.time() - T_START, 1)),
              "note": "evaluation of the shipped folders; each model's training record is read "
                      "from the log of the run that trained it (training_run)",
              "corpus": json.loads((Path(args.data) / "corpus.json").read_text()),
              "models": logs}
    record["corpus"]["source"].pop("copyright", None)
    (out / "train_log.json").write_text(json.dumps(record, indent=1))
    log(f"wrote {out / 'train_log.json'} and {out / 'loss_curve.png'}")


def log_models(paths: list[Path]) -> list[dict]:
    """The model records of several train logs, one per model name (where two logs hold the same
    model, the one of the later run by provenance date), in MODEL_NAMES order."""
    latest = {}
    for path in paths:
        rec = json.loads(Path(path).read_text())
        date = rec.get("provenance", {}).get("date", "")
        for m in rec["models"]:
            if m["name"] not in latest or date >= latest[m["name"]][0]:
                latest[m["name"]] = (date, m)
    order = list(MODEL_NAMES.values())
    return [latest[n][1] for n in sorted(latest, key=lambda n: (n not in order, order.index(n)
                                                                 if n in order else 0, n))]


def cmd_plot(args) -> None:
    """Redraw the PNG (e.g. after a change to the plot) from the logs alone, all their models in
    one figure."""
    plot_losses(log_models(args.log), Path(args.out))


def cmd_prepare(args) -> None:
    meta = tiny_data.prepare(args.data, deb=args.deb, cache_dir=args.cache,
                             vocab_size=args.vocab_size, heldout_out=args.heldout_out)
    s = meta["split"]
    print(f"tokenizer: vocab {meta['vocab_size']}; tokens train {s['train']['tokens']}, "
          f"val {s['val']['tokens']}, held-out {s['heldout']['tokens']} ({', '.join(s['heldout']['books'])})")


def _check_members(tar: Path, top: str) -> None:
    with tarfile.open(tar) as tf:
        for n in tf.getnames():
            if n.startswith(("/", "..")) or ".." in n.split("/") or n.split("/")[0] != top:
                raise SystemExit(f"{tar}: unexpected member path {n!r}")


def _extract(tar: Path, dest: Path) -> None:
    with tarfile.open(tar) as tf:
        tf.extractall(dest)


def cmd_install(args) -> None:
    src = Path(args.src)
    names = [n for n in MODEL_NAMES.values() if (src / f"{n}.tar").is_file()]
    if not names:
        raise SystemExit(f"{src} has no model tar")
    for name in names:
        _check_members(src / f"{name}.tar", name)
    if (src / "demo.tar").is_file():
        _check_members(src / "demo.tar", "results")
    for name in names:
        dest = ASSETS / name
        if dest.exists():
            shutil.rmtree(dest)
        ASSETS.mkdir(parents=True, exist_ok=True)
        _extract(src / f"{name}.tar", ASSETS)
    install_logs(src, RESULTS)
    if (src / "demo.tar").is_file():
        _extract(src / "demo.tar", ROOT)
    print(f"installed into {ASSETS} and {RESULTS}")


def install_logs(src: Path, results: Path) -> None:
    """A run's train log into results/: train_log.json when that file is not there or holds the
    same models (a rerun replaces it); a run of other models keeps its own file beside it,
    train_log_<model>[+<model>...].json, so the log of each run stays as it was written. The
    training stdouts are copied by name, and loss_curve.png is redrawn from every log there."""
    results.mkdir(parents=True, exist_ok=True)
    if (src / "train_log.json").is_file():
        models = [m["name"] for m in json.loads((src / "train_log.json").read_text())["models"]]
        main = results / "train_log.json"
        same = main.is_file() and sorted(
            m["name"] for m in json.loads(main.read_text())["models"]) == sorted(models)
        name = "train_log.json" if same or not main.is_file() else f"train_log_{'+'.join(models)}.json"
        shutil.copy(src / "train_log.json", results / name)
    for f in src.glob("train_stdout*.txt"):
        shutil.copy(f, results / f.name)
    logs = sorted(results.glob("train_log*.json"))
    if logs:
        plot_losses(log_models(logs), results / "loss_curve.png")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus, split, tokenizer, token streams")
    p.add_argument("--data", default=str(ROOT / ".gpu" / "tiny"))
    p.add_argument("--deb", default=None, help="path to bible-kjv-text_4.38_all.deb")
    p.add_argument("--cache", default=None, help="where to look for / download the .deb")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-out", default=None, help="also write the held-out books (jsonl.gz)")
    for cmd, hlp in (("train", "train and evaluate both models (GPU)"),
                     ("device-run", "train, evaluate, 16K demo of both models, pack (GPU)")):
        t = sub.add_parser(cmd, help=hlp)
        t.add_argument("--data", default=str(ROOT / ".gpu" / "tiny"))
        t.add_argument("--out", required=True)
        t.add_argument("--models", default="qwen,mamba",
                       help=f"the models to train, comma-separated, of {','.join(MODEL_NAMES)}")
        t.add_argument("--device", default="cuda")
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--seq-len", type=int, default=8192)
        t.add_argument("--batch", type=int, default=8)
        t.add_argument("--steps", default="auto",
                       help="'auto' (fit --time-budget), a number, or one per model (e.g. 900,700)")
        t.add_argument("--max-steps", type=int, default=600,
                       help="at most this many steps (600 x 64K tokens: ~42 epochs of the training books)")
        t.add_argument("--time-budget", default="150",
                       help="seconds of training per model (one value or one per model)")
        t.add_argument("--deadline", type=float, default=0,
                       help="seconds since start after which training stops and demos are skipped")
        t.add_argument("--reserve", type=float, default=100,
                       help="training stops --reserve seconds before --deadline")
        t.add_argument("--lr", type=float, default=2e-3)
        t.add_argument("--warmup", type=int, default=40)
        t.add_argument("--weight-decay", type=float, default=0.1)
        t.add_argument("--dropout", type=float, default=0.15)
        t.add_argument("--long-memory-init", action=argparse.BooleanOptionalAction, default=True)
        t.add_argument("--eval-every", type=int, default=50)
        t.add_argument("--val-context", type=int, default=4096)
        t.add_argument("--eval-contexts", type=lambda s: [int(x) for x in s.split(",")],
                       default=[512, 4096, 8192, 16384])
        t.add_argument("--reset-every", type=int, default=512,
                       help="also score the longest context with the recurrent state reset this often")
        t.add_argument("--require-fla", action=argparse.BooleanOptionalAction, default=None,
                       help="abort unless fla's kernels are in use (default: on CUDA)")
        t.add_argument("--mamba-scan", choices=["fla", "naive", "hf"], default=None,
                       help="Mamba-2 training scan (default: fla on CUDA, hf elsewhere)")
        t.add_argument("--fast-fallback", action=argparse.BooleanOptionalAction, default=True,
                       help="if no fast scan passes its check, train on transformers' scan (slow)")
        t.add_argument("--source-commit", default=None,
                       help="commit of the code (where the device's copy has no .git)")
        t.add_argument("--heldout-limit", type=int, default=0,
                       help="score only the first N tokens of each held-out book (smoke tests)")
        t.add_argument("--deterministic", action="store_true", default=True)
        t.add_argument("--evaluate-also", default="",
                       help="models (qwen,mamba,kimi) not trained here: evaluate the folder in "
                            "replayquant/assets and demo it too")
        t.add_argument("--train-stdout", default=None,
                       help="stdout of the run that trained the --evaluate-also model (its record)")
        t.add_argument("--demo-context", type=int, default=16384)
        t.add_argument("--demo-docs", type=int, default=3)
        t.add_argument("--demo-tag", default=None,
                       help="file-name tag of the demo results (default: h200 on an H200, else "
                            "the device type)")
    e = sub.add_parser("evaluate", help="long-memory evaluation of the shipped models (no training)")
    e.add_argument("--data", default=str(ROOT / ".gpu" / "tiny"))
    e.add_argument("--out", required=True)
    e.add_argument("--models", default="qwen,mamba")
    e.add_argument("--device", default="cpu")
    e.add_argument("--eval-contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[512, 4096, 8192, 16384])
    e.add_argument("--reset-every", type=int, default=512)
    e.add_argument("--heldout-limit", type=int, default=0)
    e.add_argument("--train-record", action="append", default=[],
                   help="KIND=PATH: the training run's stdout (.txt) or train_log.json")
    e.add_argument("--source-commit", default=None)
    e.add_argument("--deterministic", action="store_true", default=True)
    pl = sub.add_parser("plot", help="redraw the loss PNG from train logs (all their models)")
    pl.add_argument("--log", required=True, action="append", type=Path,
                    help="a train_log*.json; give it once per log")
    pl.add_argument("--out", required=True)
    i = sub.add_parser("install", help="copy a train output into the package and results/")
    i.add_argument("--from", dest="src", required=True)
    args = ap.parse_args(argv)
    if args.cmd in ("train", "device-run"):
        cuda = args.device.startswith("cuda")
        if args.require_fla is None:
            args.require_fla = cuda
        if args.mamba_scan is None:
            args.mamba_scan = "fla" if cuda else "hf"
    {"prepare": cmd_prepare, "train": cmd_train, "device-run": cmd_device_run,
     "evaluate": cmd_evaluate, "plot": cmd_plot, "install": cmd_install}[args.cmd](args)


if __name__ == "__main__":
    main()
