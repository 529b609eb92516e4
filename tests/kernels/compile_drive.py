"""Driver for tests/kernels/test_compile_check.py (run under `compile_check record`, so in the Triton
interpreter): generate with a tiny random Qwen3.5 (GDN), Mamba-2 or Nemotron-H (dt clamp) model
patched with each pair (PLAN), seed 0 (layer 1's Philox key is then 1, which Triton specializes
unless the kernel says do_not_specialize), with a prompt longer than the buffer (chunked
prefill, which flushes) and one decode step.

One decode step is enough: every decode step of a generate launches the same kernel with the
same specialization (a row flushes or reads inside it, whatever the batch). Several models joined
by '+' run one after another in one recording; Nemotron-H then runs only the generates that
decode, since its specializations beyond Mamba-2's are the decode kernel's alone (its dt clamp:
8 of its 24, every prefill and cast kernel shared).

    python tests/kernels/compile_drive.py MODEL[+MODEL ...] [PAIR ...]
                                                            MODEL: qwen3_5, mamba2, nemotron_h
"""

import sys

import torch
from transformers import AutoModelForCausalLM, Mamba2Config, NemotronHConfig, Qwen3_5TextConfig

from replayquant import options
from replayquant.models import patch

VOCAB = 64
# What each generate of the drive runs, beyond the pair, on a batch of 3 rows: f4_sr_rs prefills
# with the two-pass NVFP4 chain (what the interpreter chooses), with the split chain (the option
# nvfp4_chain_split, on one program) and in exact prefill; the last two differ from the first in
# the prefill alone, so they stop there (one new token: no decode step).
PLAN = [dict(pair="s32_rs"), dict(pair="tp4_hi32"), dict(pair="f4_sr_rs"),
        dict(pair="f4_sr_rs", chain_split=1, new=1),
        dict(pair="f4_sr_rs", prefill="exact", new=1), dict(pair="tp4_hi16_sr")]
CONFIGS = {
    "qwen3_5": Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, intermediate_size=32,
        num_hidden_layers=3, layer_types=["linear_attention", "linear_attention", "full_attention"]),
    "mamba2": Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4,
                           head_dim=16, state_size=16, n_groups=1, expand=2, chunk_size=8),
    "nemotron_h": NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, hybrid_override_pattern="MM*",
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32,
        chunk_size=8, time_step_min=0.5),
}


def main(argv):
    names = argv[0].split("+") if argv else []
    if not names or not set(names) <= set(CONFIGS):
        print(f"usage: python tests/kernels/compile_drive.py {{{','.join(CONFIGS)}}}[+...] "
              f"[PAIR ...]", file=sys.stderr)
        return 2
    plan = [dict(pair=p) for p in argv[1:]] or PLAN
    for name in names:
        decoding = name == "nemotron_h" and "mamba2" in names
        drive(name, [r for r in plan if r.get("new", 2) > 1] if decoding else plan)
    return 0


def drive(name, plan):
    torch.manual_seed(0)
    # bf16: the decode kernel serves bf16 models (a float32 one decodes on the torch engine)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]).eval().to(torch.bfloat16)
    for run in plan:
        patch(model, run["pair"], prefill=run.get("prefill", "replay"), buffer_len=4, seed=0)
        ids = torch.randint(0, VOCAB, (3, 6))
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        new = run.get("new", 2)
        with torch.no_grad(), options.override(nvfp4_chain_split=run.get("chain_split")):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, use_cache=True)
    print(name, "done", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
