"""The fixed sets of values users name, one table each: the library checks against them and the
command line offers them as its choices. Plain strings only (no torch, no transformers), so that
the command line builds its options and `--help` without loading the model code.

| name | values | used by |
| --- | --- | --- |
| DTYPE_NAMES | Hugging Face's dtype names and the short ones, each with its torch dtype's name | `replayquant.models.patching.DTYPES` (the torch dtypes), `--dtype` (with auto) |
| PREFILLS | replay, exact | `patch` / `load_model`, the lm-eval model, `--prefill` |
| REFERENCES | exact, hf | the KL reference, `--reference` |
"""

from __future__ import annotations

__all__ = ["DTYPE_NAMES", "PREFILLS", "REFERENCES"]

# dtype name -> the torch dtype's attribute name: Hugging Face's spellings
# (`from_pretrained(dtype="half")` takes any torch floating dtype by its torch name) and the short
# ones of the command line
DTYPE_NAMES: dict[str, str] = {
    "bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
    "bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
    "half": "float16", "float": "float32",
    "float64": "float64", "double": "float64",
}

# prefill of a patched model: replay (every token through the decode step semantics) or exact
# (FP32 over the segment, one cast at its end, as a server's prefill)
PREFILLS = ("replay", "exact")

# the KL reference: exact (s32_rs with FP32 prefill: the exact FP32 state) or hf (the unpatched model)
REFERENCES = ("exact", "hf")
