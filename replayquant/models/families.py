"""Replacement forwards of the recurrent layers of each supported family.

Each forward reproduces the HF layer's own forward (transformers 5.17 and 5.24 compute the same
thing; they differ in the cache API and the name of the cache argument, `cache_params` in 5.17,
`cache` in 5.24, both accepted here) except for the recurrence itself, which goes through the
layer's `LayerRuntime` (ReplayState decode / chunked teacher forcing). The projections, the short
convolution and its cache state (HF's own `causal_conv1d_fn` / `causal_conv1d_update`, looked up
in the layer's modeling module, so the fast kernels run where HF would use them), the gated norm
and the output projection are the layer's own modules, untouched.

Families (found by the layer's class and attributes):
* "gdn": Gated DeltaNet of Qwen3.5 / Qwen3.5-MoE (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
  `in_proj_a`) and Qwen3-Next (`in_proj_qkvz`, `in_proj_ba`, `fix_query_key_value_ordering`).
* "mamba2": Mamba2Mixer (Mamba-2) and NemotronHMamba2Mixer (Nemotron-H).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from replayquant.replay import gdn_inputs, mamba2_inputs

try:  # fires accelerate's hook of conv1d whose weights are used directly (as HF does)
    from transformers.integrations.accelerate import force_accelerate_hooks
except Exception:  # pragma: no cover - older transformers
    def force_accelerate_hooks(names):
        return lambda f: f

__all__ = ["layer_kind", "gdn_forward", "mamba2_forward", "FORWARDS"]


def layer_kind(module) -> str | None:
    """'gdn', 'mamba2' or None for a module that is not a recurrent layer we can patch."""
    name = type(module).__name__
    if name.endswith("GatedDeltaNet") and all(hasattr(module, a) for a in
                                              ("conv1d", "A_log", "dt_bias", "norm", "out_proj",
                                               "layer_idx", "head_k_dim", "head_v_dim")):
        if hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz"):
            return "gdn"
    if name.endswith("Mamba2Mixer") and all(hasattr(module, a) for a in
                                            ("in_proj", "conv1d", "A_log", "dt_bias", "D", "norm",
                                             "out_proj", "layer_idx", "n_groups", "head_dim")):
        return "mamba2"
    return None


# ---------------------------------------------------------------- HF helpers, with fallbacks

def _hf(module, name):
    return getattr(sys.modules.get(type(module).__module__), name, None)


def _mask_padding(module, x, attention_mask):
    fn = _hf(module, "apply_mask_to_padding_states")
    if fn is not None:
        return fn(x, attention_mask)
    if attention_mask is not None:
        return (x * attention_mask[:, :, None]).to(x.dtype)
    return x


def _conv(module, x, cache, had_prev, activation, **kwargs):
    """Short causal convolution over x [B, C, T] with HF's cache handling -> [B, C, T]."""
    T = x.shape[-1]
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias
    lay = None if cache is None else cache.layers[module.layer_idx]
    recording = lay is not None and bool(getattr(lay, "record_past", False))
    if had_prev and T == 1 and not recording:
        fn = _hf(module, "causal_conv1d_update")
        return fn(x, lay.conv_states[0], weight, bias, activation)
    if cache is not None:
        x = cache.update_conv_state(x, module.layer_idx, conv_kernel_size=module.conv_kernel_size)
    fn = _hf(module, "causal_conv1d_fn")
    if fn is not None:
        out = fn(x, weight, bias, activation=activation, **kwargs)
    else:  # pragma: no cover
        out = F.conv1d(x.to(weight.dtype), weight.unsqueeze(1), bias,
                       padding=weight.shape[-1] - 1, groups=x.shape[1])[..., :x.shape[-1]]
        out = F.silu(out).to(x.dtype) if activation in ("silu", "swish") else out.to(x.dtype)
    return out[:, :, -T:] if cache is not None else out


def _pop_cache(cache, cache_params):
    return cache if cache is not None else cache_params


def _check_kwargs(kwargs):
    for key in ("cu_seq_lens_q", "cu_seqlens", "seq_idx"):
        if kwargs.get(key) is not None:
            raise ValueError(f"packed sequences ({key}) are not supported by the replay patch; "
                             f"pass a padded batch with an attention mask instead")


def _valid(attention_mask, B, T):
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, T):
        raise ValueError(f"recurrent layers need a 2-D padding mask [B, T] = [{B}, {T}], got "
                         f"{tuple(attention_mask.shape)}")
    return attention_mask.to(torch.bool)


# ---------------------------------------------------------------- Gated DeltaNet

@force_accelerate_hooks("conv1d")
def gdn_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """Gated DeltaNet layer forward (Qwen3.5 dense/MoE, Qwen3-Next) with the replay recurrence."""
    rt = self._replayquant
    cache = _pop_cache(cache, cache_params)
    _check_kwargs(kwargs)
    kwargs.pop("cu_seq_lens_q", None)
    hidden_states = _mask_padding(self, hidden_states, attention_mask)
    B, T, _ = hidden_states.shape
    had_prev = cache is not None and rt.has_previous(rt.cache_layer(cache))

    if hasattr(self, "in_proj_qkvz"):                      # Qwen3-Next layout
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
        mixed_qkv = torch.cat([t.reshape(B, T, -1) for t in (query, key, value)], dim=-1)
    else:                                                  # Qwen3.5 layout
        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states).reshape(B, T, -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)

    mixed_qkv = _conv(self, mixed_qkv.transpose(1, 2), cache, had_prev, self.activation,
                      **kwargs).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(B, T, -1, self.head_k_dim)
    key = key.reshape(B, T, -1, self.head_k_dim)
    value = value.reshape(B, T, -1, self.head_v_dim)
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    # beta = sigmoid(b) in FP32 (HF takes it in the model dtype; rounding beta to bf16 is a known
    # long-context drift source, and FP32 is what the kernels use)
    q, k, v, log_a, beta = gdn_inputs(query, key, value, g, b)

    raw = dict(q=query, k=key, v=value, a=a, b=b, A_log=self.A_log, dt_bias=self.dt_bias)
    y = rt.run(cache, had_prev, q, k, v, log_a, beta, _valid(attention_mask, B, T), raw=raw)
    core = y.to(query.dtype).reshape(-1, self.head_v_dim)
    core = self.norm(core, z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(B, T, -1))


# ---------------------------------------------------------------- Mamba-2

@force_accelerate_hooks("conv1d")
def mamba2_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """Mamba-2 mixer forward (Mamba2Mixer, NemotronHMamba2Mixer) with the replay recurrence."""
    rt = self._replayquant
    cache = _pop_cache(cache, cache_params)
    _check_kwargs(kwargs)
    B, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    had_prev = cache is not None and rt.has_previous(rt.cache_layer(cache))
    hidden_states = _mask_padding(self, hidden_states, attention_mask)
    projected = self.in_proj(hidden_states)
    gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xBC = _conv(self, xBC.transpose(1, 2), cache, had_prev, self.activation, **kwargs)
    xBC = _mask_padding(self, xBC.transpose(1, 2), attention_mask)
    GN = self.n_groups * self.ssm_state_size
    x, Bm, Cm = torch.split(xBC, [self.intermediate_size, GN, GN], dim=-1)
    x = x.reshape(B, T, self.num_heads, self.head_dim)
    A = -torch.exp(self.A_log.float())
    q, k, v, log_a = mamba2_inputs(x, dt, A, Bm.reshape(B, T, self.n_groups, -1),
                                   Cm.reshape(B, T, self.n_groups, -1), self.dt_bias,
                                   dt_limit=tuple(self.time_step_limit))
    raw = dict(x=x, dt=dt, A=A, B=Bm.reshape(B, T, self.n_groups, -1),
               C=Cm.reshape(B, T, self.n_groups, -1), dt_bias=self.dt_bias,
               dt_limit=tuple(self.time_step_limit))
    y = rt.run(cache, had_prev, q, k, v, log_a, None, _valid(attention_mask, B, T), raw=raw)
    y = y + self.D.float()[:, None] * x.float()                       # D skip, outside the state
    out = self.norm(y.reshape(B, T, -1), gate)
    return self.out_proj(out.to(dtype))


FORWARDS = {"gdn": gdn_forward, "mamba2": mamba2_forward}
