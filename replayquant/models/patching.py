"""patch / unpatch a Hugging Face model in place, and load_model."""

from __future__ import annotations

import functools
import warnings

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig
from transformers.generation import GenerationMode
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from replayquant.choices import DTYPE_NAMES, PREFILLS
from replayquant.memory import check_fits, replay_cache_bytes
from replayquant.models.families import FORWARDS, layer_kind, supported_families
from replayquant.models.names import resolve_model_name
from replayquant.models.runtime import LayerRuntime
from replayquant.pairs import PrecisionPair
from replayquant.policy import EXACT, LayerPolicy, resolve_pair
from replayquant.statebytes import LayerShape

__all__ = ["recurrent_layers", "patch", "unpatch", "is_patched", "load_model", "load_config",
           "model_class", "model_from_config", "layer_shapes", "PREFILLS"]

_INFO = "_replayquant_patch"
# what HF's generate reads on the model instance, set while it is patched (`_lift_refusal`)
_GENERATION_ATTRS = ("_is_stateful", "_validate_generation_mode")


def recurrent_layers(model) -> list[tuple[str, torch.nn.Module, str]]:
    """(qualified name, module, kind) of every recurrent layer of `model` that can be patched;
    kind is 'gdn' (Gated DeltaNet), 'kda' (Kimi Delta Attention) or 'mamba2'."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"expected a torch.nn.Module (a Hugging Face model), got {type(model).__name__}")
    return [(name, m, kind) for name, m in model.named_modules() if (kind := layer_kind(m))]


def _layer_plan(pair, layers, prefill):
    """(pair, prefill) of each layer: one pair for all, or a policy's pair per layer (a layer
    the policy keeps `exact` runs the shared FP32 pair with prefill="exact", as the KL
    reference does)."""
    if not isinstance(pair, LayerPolicy):
        return [(pair, prefill)] * len(layers)
    fp32 = None
    plan = []
    for p in pair.assign([(name, m.layer_idx) for name, m, _ in layers]):
        if p == EXACT:
            fp32 = fp32 or PrecisionPair.load("s32_rs")
            plan.append((fp32, "exact"))
        else:
            plan.append((p, prefill))
    return plan


def patch(model, pair, prefill: str = "replay", seed: int = 0, buffer_len: int | None = None):
    """Make every recurrent layer of `model` run the replay state machine with `pair` (in place).

    model: a Hugging Face model of a supported family (`replayquant.models.families.FAMILIES`).
    pair: a PrecisionPair or a pair name; buffer_len overrides its L. A
    `replayquant.policy.LayerPolicy` (or the path of a policy YAML) gives each recurrent layer
    its own pair; its layer indices and patterns are checked against the model here.
    prefill: "replay" (multi-token forwards follow the decode step semantics exactly, via the
    chunked scan) or "exact" (FP32 over the segment, one cast at its end, as a server's prefill).
    seed: the SR seed (layer l uses layer_seed(seed, l); sequence b of a batch uses row id b).
    Decode steps (single-token forwards with a cache) run the Triton replay decode kernel on CUDA
    tensors or with REPLAYQUANT_BACKEND=triton, ReplayState.step elsewhere (`decode_path`).
    Attention layers, MLPs and the convolution state are untouched. Patching a patched model
    replaces its settings. HF's assisted generation (`generate(prompt_lookup_num_tokens=...)`,
    `assistant_model=...`), which transformers refuses for a recurrent state, runs on the patched
    model (`_lift_refusal`). Returns the model.
    """
    if prefill not in PREFILLS:
        raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    pair = resolve_pair(pair, buffer_len)
    layers = recurrent_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no recurrent layer replayquant can patch "
                         f"({supported_families()}); nothing to do for a model without SSM state")
    plan = _layer_plan(pair, layers, prefill)      # a policy's errors before anything changes
    _check_buffer_fits(model, plan)
    if is_patched(model):
        unpatch(model)
    for (_, module, kind), (layer_pair, layer_prefill) in zip(layers, plan):
        module._replayquant = LayerRuntime(layer_pair, layer_prefill, seed, module.layer_idx,
                                           delta=kind != "mamba2", kind=kind,
                                           vector_gate=kind == "kda")
        # a partial of the module-level forward (not a bound method, which pickles by the
        # function's name as an attribute of the module): a patched model pickles and loads
        fwd = functools.partial(FORWARDS[kind], module)
        if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward"):
            saved = ("_old_forward", module._old_forward)     # accelerate wraps forward
            module._old_forward = fwd
        else:
            saved = ("forward", module.__dict__.get("forward"))
            module.forward = fwd
        module._replayquant_saved = saved
    _lift_refusal(model)
    setattr(model, _INFO, {"pair": pair, "prefill": prefill, "seed": seed,
                           "layers": [name for name, _, _ in layers],
                           "layer_pairs": {name: (p.label(), pf) for (name, _, _), (p, pf)
                                           in zip(layers, plan)}})
    # a partial of a module-level function, not a closure: the patched model still pickles
    model.save_pretrained = functools.partial(_save_pretrained_patched, model)
    return model


def _check_buffer_fits(model, plan) -> None:
    """One ValueError, before anything changes, when one sequence's replay states (anchor, read
    copy and L buffered entries in every patched layer) could not fit in the memory of the
    model's device: a buffer length of 10^9 is refused here, not by the allocator at the first
    forward."""
    needed = sum(replay_cache_bytes(s, p) for s, (p, _) in zip(layer_shapes(model), plan))
    lengths = sorted({p.buffer_len for p, _ in plan})
    device = next(model.parameters(), torch.zeros(0)).device
    check_fits(needed, f"one sequence of {type(model).__name__} with buffer length "
                       f"{', '.join(map(str, lengths))}",
               "give a smaller buffer_len (the shipped pairs use 8 to 32)", device=str(device))


def layer_shapes(model) -> list[LayerShape]:
    """The LayerShape of every recurrent layer of a Hugging Face model (as `recurrent_layers`
    finds them): GDN value / key heads and head dims, KDA heads and head dim (q, k, v alike),
    Mamba-2 heads, groups, head dim and state size, read from the layer modules."""
    out = []
    for name, m, kind in recurrent_layers(model):
        if kind == "gdn":
            H, HK, dv, dk = m.num_v_heads, m.num_k_heads, m.head_v_dim, m.head_k_dim
        elif kind == "kda":
            H, HK, dv, dk = m.num_heads, m.num_heads, m.head_dim, m.head_dim
        else:
            H, HK, dv, dk = m.num_heads, m.n_groups, m.head_dim, m.ssm_state_size
        out.append(LayerShape(kind, int(H), int(HK), int(dv), int(dk), name, int(m.layer_idx)))
    return out


def _save_pretrained_patched(model, *args, **kwargs):
    """A patched model's save_pretrained: Hugging Face's, which writes the weights and the
    config only (the pair lives in the patched forwards, not in the checkpoint), after one
    warning that says so and how to load it patched again."""
    info = patch_info(model)
    pair = info["pair"]
    name = pair.label() if hasattr(pair, "label") else getattr(pair, "name", str(pair))
    warnings.warn(f"save_pretrained writes {type(model).__name__}'s weights and config without "
                  f"replayquant's pair {name} (prefill={info['prefill']}, seed={info['seed']}): "
                  f"the folder loads as the unpatched model; load it with "
                  f"replayquant.load_model(path, pair=...) to run the pair again",
                  UserWarning, stacklevel=2)
    return type(model).save_pretrained(model, *args, **kwargs)


def unpatch(model):
    """Restore the original forwards of a patched model (in place). Caches filled while patched
    hold replay states, not HF states: start a new cache after unpatching. Returns the model."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"expected a torch.nn.Module, got {type(model).__name__}")
    if not is_patched(model):
        raise ValueError(f"{type(model).__name__} is not patched by replayquant; nothing to unpatch")
    for _, module in model.named_modules():
        saved = module.__dict__.pop("_replayquant_saved", None)
        if saved is None:
            continue
        attr, original = saved
        if original is None:
            module.__dict__.pop(attr, None)
        else:
            setattr(module, attr, original)
        module.__dict__.pop("_replayquant", None)
    for attr in _GENERATION_ATTRS:
        model.__dict__.pop(attr, None)
    model.__dict__.pop("save_pretrained", None)
    delattr(model, _INFO)
    return model


def _lift_refusal(model) -> None:
    """Let HF's assisted generation run on the patched model: transformers refuses it for a
    model class marked `_is_stateful` (a recurrent state cannot be cropped back); a patched layer
    crops by a pointer move on its replay buffer (`runtime.croppable`). Set on the instance,
    removed by unpatch: `_is_stateful` False, and HF's validation of the generation mode followed
    by the check of the draft length against each layer's L (`check_draft_length`)."""
    if getattr(type(model), "_is_stateful", False):
        model._is_stateful = False
    model._validate_generation_mode = functools.partial(_validate_generation_mode, model)


def _validate_generation_mode(model, generation_mode, generation_config, generation_mode_kwargs):
    """HF's own validation of the generation mode (the model class's), then for assisted
    generation: a static cache refused, and `check_draft_length`; before any forward."""
    type(model)._validate_generation_mode(model, generation_mode, generation_config,
                                          generation_mode_kwargs)
    if generation_mode != GenerationMode.ASSISTED_GENERATION:
        return
    impl = generation_config.cache_implementation
    if isinstance(impl, str) and "static" in impl:
        raise ValueError(
            f"cache_implementation={impl!r} with assisted generation on a patched model: HF "
            f"compiles no step of a cache whose linear-attention layers record their past for "
            f"`crop` (they are then not compileable), so the static cache gains nothing here, and "
            f"on transformers 5.24 it gave other tokens than plain greedy decoding (a patched "
            f"tiny Qwen3.5) or overran its length (an unpatched Qwen3); leave "
            f"cache_implementation unset (the eager loop on HF's dynamic cache)")
    check_draft_length(model, generation_config, generation_mode_kwargs.get("assistant_model"))


def _draft_length(model, config, assistant) -> tuple[int, str] | None:
    """(the most drafts one round of HF's assisted generation proposes, the option that sets it),
    following the candidate generator HF's `_get_candidate_generator` picks; None for one it
    picks otherwise (MTP, DFlash: their crops meet the layer's own check). An assistant's
    `num_assistant_tokens_schedule` 'heuristic' grows the length without bound: one ValueError."""
    if config.prompt_lookup_num_tokens is not None and config.assistant_early_exit is None:
        return int(config.prompt_lookup_num_tokens), "prompt_lookup_num_tokens"
    helper = model if config.assistant_early_exit is not None else assistant
    if helper is None:
        return None
    defaults = GenerationConfig._get_default_generation_params()
    gc = helper.generation_config
    schedule = gc.num_assistant_tokens_schedule or defaults["num_assistant_tokens_schedule"]
    if schedule != "constant":
        raise ValueError(f"num_assistant_tokens_schedule={schedule!r} lets the draft length grow "
                         f"past the replay buffer L of the patched layers; set the assistant's "
                         f"generation_config.num_assistant_tokens_schedule = 'constant'")
    return (int(gc.num_assistant_tokens or defaults["num_assistant_tokens"]),
            "num_assistant_tokens")


def check_draft_length(model, generation_config, assistant_model=None) -> None:
    """One ValueError where a patched layer of the target or of a patched assistant has a buffer
    L below the draft length of HF's assisted generation: a crop removes up to that many tokens,
    which the layer keeps uncommitted in its buffer (`runtime.LayerRuntime._speculate`)."""
    drafts = _draft_length(model, generation_config, assistant_model)
    if drafts is None:
        return
    n, option = drafts
    for who, m in (("", model), ("the assistant's ", assistant_model)):
        if m is None or not is_patched(m):
            continue
        for name, module, _ in recurrent_layers(m):
            pair = module._replayquant.pair
            if pair.buffer_len < n:
                raise ValueError(
                    f"{option}={n} drafts, but {who}layer {name} runs pair {pair.label()} with "
                    f"L = {pair.buffer_len}: speculative decoding keeps up to {n} drafts "
                    f"uncommitted in the replay buffer; use {option} <= {pair.buffer_len} or "
                    f"patch with buffer_len >= {n}")


def is_patched(model) -> bool:
    return hasattr(model, _INFO)


def patch_info(model) -> dict | None:
    """The settings of a patched model ({pair, prefill, seed, layers, layer_pairs: qualified
    name -> (pair label, prefill)}) or None."""
    return getattr(model, _INFO, None)


# dtype names load_model takes (`replayquant.choices.DTYPE_NAMES`) -> their torch dtypes
DTYPES = {name: getattr(torch, attr) for name, attr in DTYPE_NAMES.items()}


def resolve_dtype(dtype):
    """"auto", a torch floating dtype, or its name (`DTYPES`: HF's spellings such as "half" and
    the short bf16 / fp16 / fp32) as the torch dtype; anything else is one ValueError."""
    if dtype == "auto" or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype {dtype!r} unknown; use auto, one of {', '.join(DTYPES)} or a torch "
                     f"floating dtype")


# what AutoConfig.from_pretrained takes of load_model's from_pretrained arguments
_CONFIG_KWARGS = ("revision", "trust_remote_code", "token", "subfolder", "cache_dir",
                  "local_files_only")


def _hf_class(table: dict, model_type):
    """transformers' own class named for model_type in one of its name tables, or None."""
    name = table.get(model_type) if isinstance(model_type, str) else None
    return getattr(transformers, name, None) if isinstance(name, str) else None


def load_config(path, **config_kwargs):
    """The config at path in transformers' own config class for its model_type, not the class
    AutoConfig holds for that type: another package can register its own there, and
    flash-linear-attention does so for 'mamba2' when imported (HF's Qwen3.5 / Qwen3-Next layers
    import it where it is installed), which made load_model build fla's Mamba-2 model, whose
    layers replayquant does not patch. A type transformers does not know (remote code) goes
    through AutoConfig."""
    d, _ = PretrainedConfig.get_config_dict(path, **config_kwargs)
    cls = _hf_class(CONFIG_MAPPING_NAMES, d.get("model_type"))
    return (cls or AutoConfig).from_pretrained(path, **config_kwargs)


def model_class(config):
    """transformers' own class that loads this config's causal LM (see `load_config` for why
    not the Auto registry's): its causal-LM class, or for a model whose causal LM is its
    text-and-vision conditional-generation class, that one (GLM-5-Next:
    Glm5NextForConditionalGeneration; its vision tower is loaded and idles on text). A type
    transformers does not know gets AutoModelForCausalLM, whose from_pretrained then names what
    it accepts."""
    mt = getattr(config, "model_type", None)
    return (_hf_class(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, mt)
            or _hf_class(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, mt) or AutoModelForCausalLM)


def model_from_config(config):
    """A model of `model_class(config)` with random weights (the Auto class's from_config for a
    type transformers does not know)."""
    cls = model_class(config)
    return cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)


def load_model(name_or_path, pair=None, *, dtype="auto", device_map=None, prefill: str = "replay",
               seed: int = 0, buffer_len: int | None = None, **from_pretrained_kwargs):
    """Load a causal LM (`model_class`: transformers' own causal-LM class, or the
    conditional-generation class of GLM-5-Next) with from_pretrained and patch it.

    name_or_path: a short name (`replayquant.models.SHORT_NAMES`, e.g. "Qwen3.5-4B"), a hub id
    or a local folder. pair: a PrecisionPair, a pair name, a LayerPolicy or a pair / policy
    YAML path (None: the unpatched model).
    dtype: "auto", a torch floating dtype or its name as Hugging Face takes it ("bfloat16",
    "float16" / "half", "float32" / "float", ...; `resolve_dtype`) for weights and activations
    (the recurrence always runs in FP32 arithmetic with the pair's storage formats).
    (`torch_dtype=`, HF's older name, is taken as dtype.)
    device_map, **from_pretrained_kwargs: passed to from_pretrained.
    prefill, seed, buffer_len: as in `patch`. Returns the model in eval mode; with
    output_loading_info=True, as from_pretrained, (model, loading info).
    """
    path = resolve_model_name(name_or_path)
    if "torch_dtype" in from_pretrained_kwargs:        # HF's older name of the argument
        alias = from_pretrained_kwargs.pop("torch_dtype")
        if dtype != "auto" and resolve_dtype(alias) != resolve_dtype(dtype):
            raise ValueError(f"dtype={dtype!r} and torch_dtype={alias!r} disagree; give one of them")
        dtype = alias
    dtype = resolve_dtype(dtype)
    if prefill not in PREFILLS:
        raise ValueError(f"prefill must be one of {PREFILLS}, got {prefill!r}")
    if pair is not None:
        pair = resolve_pair(pair, buffer_len)          # fail before loading weights
    config = load_config(path, **{k: v for k, v in from_pretrained_kwargs.items()
                                  if k in _CONFIG_KWARGS})
    loaded = model_class(config).from_pretrained(path, config=config, dtype=dtype,
                                                 device_map=device_map, **from_pretrained_kwargs)
    model = loaded[0] if from_pretrained_kwargs.get("output_loading_info") else loaded
    model.eval()
    if pair is not None:
        patch(model, pair, prefill=prefill, seed=seed)
    return loaded
