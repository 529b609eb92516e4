"""The recurrent layers replayquant patches: one table of families and three generic forwards.

A family is one `Family` entry of `FAMILIES`: the layer classes it covers, which of the layer's
attributes hold which input (its `roles`, over the defaults of its kind), and the few ways it
departs from its kind's forward, as data or a hook of a few lines. Three forwards serve every
family: `gdn_forward` (Gated DeltaNet), `kda_forward` (Kimi Delta Attention: the delta rule with
a decay per key channel) and `mamba2_forward` (Mamba-2). Each reproduces the HF
layer's own forward (transformers 5.17 and 5.24 compute the same thing; they differ in the cache
API and the name of the cache argument, `cache_params` in 5.17, `cache` in 5.24, both accepted
here) except for the recurrence itself, which goes through the layer's `LayerRuntime`
(ReplayState decode / chunked teacher forcing). The projections, the short convolution and its
cache state (HF's own `causal_conv1d_fn` / `causal_conv1d_update`, looked up in the layer's
modeling module, so the fast kernels run where HF would use them), the gated norm and the output
projection are the layer's own modules, untouched.

A layer is found by its class name (an entry "*Name" matches every class whose name ends in
Name) and the attributes its family reads; a class a family names exactly but whose attributes
differ is an error that names them (another transformers version laid the layer out otherwise),
never a silent skip. Adding a family: one entry below; a new hook only where its projections or
its output cannot be said by roles and multipliers.

Gated DeltaNet roles (default attribute): qkv (in_proj_qkv; a tuple of attributes: their outputs
concatenated), z (in_proj_z: the output gate), b (in_proj_b: beta logits), a (in_proj_a: decay
input), norm (norm: gated RMS norm), out (out_proj). Mamba-2 roles: in_proj (the fused
gate / xBC / dt projection), norm (gated RMS norm), out (out_proj). Kimi Delta Attention roles:
qkv (q_proj, k_proj, v_proj: concatenated before the short convolution), decay (forget_gate: the
layer's own gate module, hidden states -> log decay [B, T, H, d_k] in FP32), b (b_proj: beta
logits), z_a, z_b (g_a_proj then g_b_proj: the low-rank output gate), norm (o_norm: RMS norm gated
by sigmoid(z)), out (o_proj). Every family also needs its
kind's shape attributes (`_SHAPES`), which all of transformers' layers name alike.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from replayquant.models.decode_graph import graphed_decode
from replayquant.replay import gdn_inputs, kda_inputs, mamba2_inputs

try:  # fires accelerate's hook of conv1d whose weights are used directly (as HF does)
    from transformers.integrations.accelerate import force_accelerate_hooks
except Exception:  # pragma: no cover - older transformers
    def force_accelerate_hooks(names):
        return lambda f: f

__all__ = ["Family", "FAMILIES", "family_of", "layer_kind", "lm_head_scale", "supported_families",
           "gdn_forward", "kda_forward", "mamba2_forward", "FORWARDS", "KIND_NAMES"]

_ROLES = {
    "gdn": {"qkv": ("in_proj_qkv",), "z": "in_proj_z", "b": "in_proj_b", "a": "in_proj_a",
            "norm": "norm", "out": "out_proj"},
    "mamba2": {"in_proj": "in_proj", "norm": "norm", "out": "out_proj"},
    "kda": {"qkv": ("q_proj", "k_proj", "v_proj"), "decay": "forget_gate", "b": "b_proj",
            "z_a": "g_a_proj", "z_b": "g_b_proj", "norm": "o_norm", "out": "o_proj"},
}
_SHAPES = {
    "gdn": ("conv1d", "A_log", "dt_bias", "layer_idx", "head_k_dim", "head_v_dim", "key_dim",
            "value_dim", "activation", "conv_kernel_size"),
    "mamba2": ("conv1d", "A_log", "dt_bias", "D", "layer_idx", "n_groups", "head_dim", "num_heads",
               "ssm_state_size", "intermediate_size", "conv_dim", "time_step_limit", "activation",
               "conv_kernel_size"),
    "kda": ("conv1d", "layer_idx", "num_heads", "head_dim", "qkv_dim", "activation",
            "conv_kernel_size"),
}


@dataclass(frozen=True)
class Family:
    """One family of recurrent layers.

    name: short id; kind: 'gdn', 'kda' or 'mamba2' (the recurrence and the forward); classes: the HF
    layer classes ("*Name": any class name ending in Name); models: the models that use them
    (for messages and docs); roles: role -> attribute over the kind's defaults (a tuple: the
    outputs of those modules concatenated); requires: further attributes the hooks read.
    GDN: project(module, h) -> (qkv [B, T, 2 key_dim + value_dim], z, b, a) where the roles
    cannot say the layout; beta_scale(module) -> the factor on sigmoid(b) (default 1).
    Mamba-2: in_scale / proj_scale: attributes multiplying the layer's input / in_proj's output;
    output(module, y, gate) -> the gated, normed y (default norm(y, gate)).
    lm_head_scale(text config) -> the factor the model's causal-LM forward puts on the LM head's
    output (default none), for harnesses that apply the head themselves.
    """

    name: str
    kind: str
    classes: tuple[str, ...]
    models: str
    roles: dict = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    project: Callable | None = None
    beta_scale: Callable | None = None
    in_scale: str | None = None
    proj_scale: str | None = None
    output: Callable | None = None
    lm_head_scale: Callable | None = None

    def __post_init__(self):
        if self.kind not in _ROLES:
            raise ValueError(f"family {self.name}: kind must be one of {sorted(_ROLES)}, got {self.kind!r}")
        object.__setattr__(self, "roles", {**_ROLES[self.kind], **self.roles})

    def names(self, class_name: str) -> bool:
        """Whether this family names the class, exactly or by a '*' suffix."""
        return any(c == class_name or (c.startswith("*") and class_name.endswith(c[1:]))
                   for c in self.classes)

    def attributes(self) -> tuple[str, ...]:
        """Every attribute the forward and the hooks read."""
        roles = [a for r in self.roles.values() if r is not None
                 for a in ((r,) if isinstance(r, str) else r)]
        scales = [a for a in (self.in_scale, self.proj_scale) if a]
        return tuple(dict.fromkeys(_SHAPES[self.kind] + tuple(roles) + tuple(scales) + self.requires))

    def missing(self, module) -> list[str]:
        return [a for a in self.attributes() if not hasattr(module, a)]

    def role(self, module, role: str):
        return getattr(module, self.roles[role])


# ---------------------------------------------------------------- per-family hooks

def _qwen3_next_project(m, h):
    """Qwen3-Next: q, k, v, z fused per key head in in_proj_qkvz, b and a in in_proj_ba; the
    layer's own fix_query_key_value_ordering takes them apart."""
    B, T = h.shape[:2]
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    return torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1), z, b, a


def _falcon_h1_output(m, y, gate):
    """Falcon-H1: the gated RMS norm is optional (mamba_rms_norm); without it the gate is
    y * silu(z), as in its forward."""
    return m.norm(y, gate) if m.mamba_rms_norm else y * F.silu(gate)


FAMILIES: tuple[Family, ...] = (
    Family("qwen3_5", "gdn", ("*GatedDeltaNet",),
           "Qwen3.5 dense and MoE (and transformers' other layers of the same layout)"),
    Family("qwen3_next", "gdn", ("*GatedDeltaNet",), "Qwen3-Next",
           roles=dict.fromkeys(("qkv", "z", "b", "a")), project=_qwen3_next_project,
           requires=("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")),
    Family("olmo_hybrid", "gdn", ("OlmoHybridGatedDeltaNet",), "OLMo-Hybrid",
           roles={"qkv": ("q_proj", "k_proj", "v_proj"), "z": "g_proj", "b": "b_proj",
                  "a": "a_proj", "norm": "o_norm", "out": "o_proj"},
           requires=("allow_neg_eigval",),   # linear_allow_neg_eigval: beta = 2 sigmoid(b)
           beta_scale=lambda m: 2.0 if m.allow_neg_eigval else 1.0),
    Family("mamba2", "mamba2", ("*Mamba2Mixer",),
           "Mamba-2, Nemotron-H (Mamba2Mixer, NemotronHMamba2Mixer)"),
    Family("bamba", "mamba2", ("BambaMixer",), "Bamba"),
    Family("granite_hybrid", "mamba2", ("GraniteMoeHybridMambaLayer",),
           "Granite-4 hybrid (GraniteMoeHybrid)", lm_head_scale=lambda c: 1.0 / c.logits_scaling),
    Family("zamba2", "mamba2", ("Zamba2MambaMixer",), "Zamba2"),
    Family("falcon_h1", "mamba2", ("FalconH1Mixer",), "Falcon-H1",
           in_scale="ssm_in_multiplier", proj_scale="mup_vector",   # its muP multipliers
           requires=("mamba_rms_norm",), output=_falcon_h1_output,
           lm_head_scale=lambda c: c.lm_head_multiplier),
    Family("kimi_linear", "kda", ("KimiLinearDeltaAttention",), "Kimi Linear"),
    # GLM-5-Next's text model (Glm5NextTextModel inside Glm5NextForConditionalGeneration); its
    # forget gate bounds the log decay below (linear_lower_bound), inside the gate module
    Family("glm5_next", "kda", ("Glm5NextTextLinearAttention",), "GLM-5-Next (GLM-5.3-Flash)"),
)

_BY_TYPE: dict[type, Family] = {}


def family_of(module) -> Family | None:
    """The family of a recurrent layer replayquant can patch, or None for any other module.
    Raises ValueError for a class a family names exactly whose attributes it cannot find."""
    cached = _BY_TYPE.get(type(module))
    if cached is not None and not cached.missing(module):
        return cached
    name = type(module).__name__
    named = []
    for fam in FAMILIES:
        if not fam.names(name):
            continue
        missing = fam.missing(module)
        if not missing:
            _BY_TYPE[type(module)] = fam
            return fam
        if name in fam.classes:
            named.append((fam, missing))
    if named:
        fam, missing = named[0]
        raise ValueError(f"{name} is a {fam.models} layer but has no {', '.join(missing)}: this "
                         f"transformers version lays it out otherwise than the versions replayquant "
                         f"reads (5.17, 5.24)")
    return None


def layer_kind(module) -> str | None:
    """'gdn', 'kda', 'mamba2' or None for a module that is not a recurrent layer we can patch."""
    fam = family_of(module)
    return None if fam is None else fam.kind


KIND_NAMES = {"gdn": "Gated DeltaNet", "kda": "Kimi Delta Attention", "mamba2": "Mamba-2"}


def supported_families() -> str:
    """The supported families for messages: 'Gated DeltaNet of ...; Mamba-2 of ...; ...'."""
    by_kind = {}
    for fam in FAMILIES:
        by_kind.setdefault(fam.kind, []).append(fam.models.split(" (")[0])
    return "; ".join(f"{KIND_NAMES[k]} of {', '.join(v)}" for k, v in by_kind.items())


def lm_head_scale(model) -> float:
    """The factor the model's causal-LM forward applies to its LM head's output (the
    `lm_head_scale` of its families: Falcon-H1's lm_head_multiplier, 1 / logits_scaling of
    Granite-4), 1.0 for the other families. A harness that applies the head itself, as the KL
    runner does, applies it too."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for _, m in model.named_modules():
        fam = family_of(m)
        if fam is not None and fam.lm_head_scale is not None:
            return float(fam.lm_head_scale(cfg))
    return 1.0


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


def _enter(module, hidden_states, cache, cache_params, attention_mask, kwargs):
    """What every forward starts with: the layer's runtime and family, the cache under either
    argument name, packed sequences refused, padding positions zeroed, and whether the cache
    holds a previous step. Returns (rt, fam, cache, hidden_states, had_prev)."""
    rt, fam = module._replayquant, _BY_TYPE[type(module)]
    cache = _pop_cache(cache, cache_params)
    _check_kwargs(kwargs)
    kwargs.pop("cu_seq_lens_q", None)
    hidden_states = _mask_padding(module, hidden_states, attention_mask)
    had_prev = cache is not None and rt.has_previous(rt.cache_layer(cache))
    return rt, fam, cache, hidden_states, had_prev


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


def _apply(fam: Family, module, role: str, x):
    """The module(s) of a role applied to x (a tuple of attributes: outputs concatenated)."""
    attr = fam.roles[role]
    if isinstance(attr, str):
        return getattr(module, attr)(x)
    outs = [getattr(module, a)(x) for a in attr]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _layer_forward(forward):
    """A patched layer forward as HF calls it: accelerate's hook of conv1d fired (its weights are
    used directly), eager decode steps replayed as CUDA graphs (`decode_graph`)."""
    return graphed_decode(force_accelerate_hooks("conv1d")(forward))


# ---------------------------------------------------------------- Gated DeltaNet

def _gdn_project(fam, m, h):
    B, T = h.shape[:2]
    return (_apply(fam, m, "qkv", h), _apply(fam, m, "z", h).reshape(B, T, -1, m.head_v_dim),
            _apply(fam, m, "b", h), _apply(fam, m, "a", h))


@_layer_forward
def gdn_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """Gated DeltaNet layer forward (every "gdn" family) with the replay recurrence."""
    rt, fam, cache, hidden_states, had_prev = _enter(self, hidden_states, cache, cache_params,
                                                     attention_mask, kwargs)
    B, T, _ = hidden_states.shape

    project = fam.project or (lambda m, h: _gdn_project(fam, m, h))
    mixed_qkv, z, b, a = project(self, hidden_states)
    mixed_qkv = _conv(self, mixed_qkv.transpose(1, 2), cache, had_prev, self.activation,
                      **kwargs).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(B, T, -1, self.head_k_dim)
    key = key.reshape(B, T, -1, self.head_k_dim)
    value = value.reshape(B, T, -1, self.head_v_dim)
    scale = 1.0 if fam.beta_scale is None else float(fam.beta_scale(self))
    raw = dict(q=query, k=key, v=value, a=a, b=b, A_log=self.A_log, dt_bias=self.dt_bias,
               beta_scale=scale)
    valid = _valid(attention_mask, B, T)
    y = rt.kernel_decode(cache, had_prev, raw, valid)     # a decode step on the kernel's store
    if y is None:
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        # beta = sigmoid(b) in FP32 (HF takes it in the model dtype; rounding beta to bf16 is a
        # known long-context drift source, and FP32 is what the kernels use)
        if scale == 1.0:
            q, k, v, log_a, beta = gdn_inputs(query, key, value, g, b)
        else:
            q, k, v, log_a, beta = gdn_inputs(query, key, value, g,
                                              beta=scale * torch.sigmoid(b.float()))
        y = rt.run(cache, had_prev, q, k, v, log_a, beta, valid, raw=raw)
    core = y.to(query.dtype).reshape(-1, self.head_v_dim)
    core = fam.role(self, "norm")(core, z.reshape(-1, self.head_v_dim))
    return fam.role(self, "out")(core.reshape(B, T, -1))


# ---------------------------------------------------------------- Mamba-2

@_layer_forward
def mamba2_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """Mamba-2 mixer forward (every "mamba2" family) with the replay recurrence."""
    rt, fam, cache, hidden_states, had_prev = _enter(self, hidden_states, cache, cache_params,
                                                     attention_mask, kwargs)
    B, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    if fam.in_scale:
        hidden_states = hidden_states * getattr(self, fam.in_scale)
    projected = _apply(fam, self, "in_proj", hidden_states)
    if fam.proj_scale:
        projected = projected * getattr(self, fam.proj_scale)
    gate, xBC, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    xBC = _conv(self, xBC.transpose(1, 2), cache, had_prev, self.activation, **kwargs)
    xBC = _mask_padding(self, xBC.transpose(1, 2), attention_mask)
    GN = self.n_groups * self.ssm_state_size
    x, Bm, Cm = torch.split(xBC, [self.intermediate_size, GN, GN], dim=-1)
    x = x.reshape(B, T, self.num_heads, self.head_dim)
    Bm, Cm = Bm.reshape(B, T, self.n_groups, -1), Cm.reshape(B, T, self.n_groups, -1)
    A = -torch.exp(self.A_log.float())
    dt_limit = tuple(self.time_step_limit)
    raw = dict(x=x, dt=dt, A=A, B=Bm, C=Cm, dt_bias=self.dt_bias, dt_limit=dt_limit)
    valid = _valid(attention_mask, B, T)
    y = rt.kernel_decode(cache, had_prev, raw, valid)     # a decode step on the kernel's store
    if y is None:
        q, k, v, log_a = mamba2_inputs(x, dt, A, Bm, Cm, self.dt_bias, dt_limit=dt_limit)
        y = rt.run(cache, had_prev, q, k, v, log_a, None, valid, raw=raw)
    y = y + self.D.float()[:, None] * x.float()                       # D skip, outside the state
    y = y.reshape(B, T, -1)
    out = fam.output(self, y, gate) if fam.output else fam.role(self, "norm")(y, gate)
    return fam.role(self, "out")(out.to(dtype))


# ---------------------------------------------------------------- Kimi Delta Attention

@_layer_forward
def kda_forward(self, hidden_states, cache=None, attention_mask=None, cache_params=None, **kwargs):
    """Kimi Delta Attention layer forward (every "kda" family) with the replay recurrence."""
    rt, fam, cache, hidden_states, had_prev = _enter(self, hidden_states, cache, cache_params,
                                                     attention_mask, kwargs)
    B, T, _ = hidden_states.shape

    mixed_qkv = _conv(self, _apply(fam, self, "qkv", hidden_states).transpose(1, 2), cache,
                      had_prev, self.activation, **kwargs).transpose(1, 2)
    query, key, value = (t.reshape(B, T, -1, self.head_dim)
                         for t in torch.split(mixed_qkv, [self.qkv_dim] * 3, dim=-1))
    g = fam.role(self, "decay")(hidden_states)          # log decay [B, T, H, d_k], FP32
    # beta = sigmoid(b) in FP32, as for Gated DeltaNet (HF takes it in the model dtype)
    beta = torch.sigmoid(_apply(fam, self, "b", hidden_states).float())
    # q and k before their L2 norm, which the decode step and the chunked scan's front end
    # (kda_inputs) each take once
    raw = dict(q=query, k=key, v=value, g=g, beta=beta, scale=self.head_dim ** -0.5)
    valid = _valid(attention_mask, B, T)
    y = rt.kernel_decode(cache, had_prev, raw, valid)     # a decode step on the kernel's store
    if y is None:
        q, k, v, log_a, beta = kda_inputs(query, key, value, g, beta=beta)
        y = rt.run(cache, had_prev, q, k, v, log_a, beta, valid, raw=raw)
    z = fam.role(self, "z_b")(fam.role(self, "z_a")(hidden_states))
    core = fam.role(self, "norm")(y.to(query.dtype), z.reshape(B, T, -1, self.head_dim))
    return fam.role(self, "out")(core.reshape(B, T, -1))


FORWARDS = {"gdn": gdn_forward, "kda": kda_forward, "mamba2": mamba2_forward}
