"""Hugging Face hybrid models with any precision pair.

    import replayquant
    model = replayquant.load_model("Qwen3.5-4B", pair="tp4_hi16_sr", dtype="bfloat16",
                                   device_map="auto")
    model = replayquant.patch(hf_model, "tp4_hi16_sr", prefill="replay")   # in place
    replayquant.unpatch(model)                                             # restores it

* Families (`families.FAMILIES`, one entry each): Gated DeltaNet layers of Qwen3.5 (dense and
  MoE), Qwen3-Next and OLMo-Hybrid; Mamba-2 mixers of Mamba-2, Nemotron-H, Bamba, Granite-4
  hybrid, Zamba2 and Falcon-H1; Kimi Delta Attention layers of Kimi Linear and GLM-5-Next (its
  text model; `load_model` loads GLM-5-Next through its conditional-generation class,
  `patching.model_class`). The recurrent layers are found in the model
  (`recurrent_layers`); a model without any is an error. Attention, MLPs and the
  short-convolution state are untouched.
* Generation (`generate(use_cache=True)`, any batch, left-padded ragged prompts): every decode
  step of every recurrent layer goes through the replay state machine with the pair, flushing
  every L tokens, on the layer's decode store: the Triton replay decode kernel
  (`replayquant.kernels.replay.decode`) on CUDA tensors or with REPLAYQUANT_BACKEND=triton, the
  torch engine (`replayquant.kernels.replay.engine`) elsewhere; `decode_path` says which (see
  `runtime` for the hand-off from the multi-token forwards' state into the store).
* Teacher forcing (a forward over a sequence, in segments with the cache or not):
  prefill="replay" puts every token through the decode step semantics with the chunked scan
  (the Triton kernel `replayquant.kernels.chunk.kernel` on CUDA, its torch reference
  `replayquant.kernels.chunk.reference` elsewhere; `teacher_force_path` says which); prefill="exact"
  computes the segment in FP32 and casts once. Segments continue the flush schedule; padding
  tokens are skipped.
* Short names: `SHORT_NAMES` (table in `replayquant.models.names`).
"""

from replayquant.models.names import SHORT_NAMES, resolve_model_name
from replayquant.models.patching import (PREFILLS, is_patched, load_model, patch, patch_info,
                                         recurrent_layers, unpatch)
from replayquant.models.runtime import decode_path, teacher_force_path

__all__ = ["load_model", "patch", "unpatch", "is_patched", "patch_info", "recurrent_layers",
           "SHORT_NAMES", "resolve_model_name", "PREFILLS", "decode_path", "teacher_force_path"]
