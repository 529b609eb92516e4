"""Driver for tests/test_compile_check.py (run under `compile_check record`, so in the Triton
interpreter): generate with tiny random Qwen3.5 (GDN), Mamba-2 and Nemotron-H (dt clamp) models
patched with each pair, seed 0 (layer 1's Philox key is then 1, which Triton specializes unless
the kernel says do_not_specialize), at a batch below and above the one-launch threshold, with a
prompt longer than the buffer (chunked prefill) and enough new tokens to flush.

    python tests/compile_drive.py [PAIR ...]
"""

import sys

import torch
from transformers import AutoModelForCausalLM, Mamba2Config, NemotronHConfig, Qwen3_5TextConfig

from replayquant import options
from replayquant.models import patch

VOCAB = 64
# (pair, batches, the option nvfp4_chain_split): s32_rs runs the one-launch step below 8 rows and the
# split one above; an NVFP4 role always takes the split launch; f4_sr_rs prefills with the
# two-pass NVFP4 chain (what the interpreter chooses) and with the split chain (on one program)
PLAN = [("s32_rs", (3, 9), None), ("tp4_hi32", (3,), None), ("f4_sr_rs", (3,), None),
        ("f4_sr_rs", (3,), 1), ("tp4_hi16_sr", (3,), None)]
if sys.argv[1:]:
    PLAN = [(p, (3, 9), None) for p in sys.argv[1:]]
CONFIGS = [
    Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                      linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                      linear_conv_kernel_dim=4, intermediate_size=32, num_hidden_layers=3,
                      layer_types=["linear_attention", "linear_attention", "full_attention"]),
    Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                 state_size=16, n_groups=1, expand=2, chunk_size=8),
    NemotronHConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3,
                    hybrid_override_pattern="MM*", mamba_num_heads=4, mamba_head_dim=16,
                    ssm_state_size=16, n_groups=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, intermediate_size=32, chunk_size=8, time_step_min=0.5),
]

torch.manual_seed(0)
for cfg in CONFIGS:
    model = AutoModelForCausalLM.from_config(cfg).eval()
    for pair, batches, split in PLAN:
        patch(model, pair, buffer_len=4, seed=0)
        for B in batches:
            ids = torch.randint(0, VOCAB, (B, 6))
            mask = torch.ones_like(ids)
            mask[1, :2] = 0
            with torch.no_grad():
                with options.override(nvfp4_chain_split=split):
                    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                   min_new_tokens=6, do_sample=False, use_cache=True)
    print(cfg.model_type, "done", flush=True)
