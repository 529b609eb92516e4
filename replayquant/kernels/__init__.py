"""Triton kernels, each beside the plain-torch reference that specifies it (same signature).

| module | kernels | reference |
| --- | --- | --- |
| quant | quantize / dequantize of every format, nearest and stochastic | formats/casts |
| conventional | the baseline decode step: read-modify-write of one shared format | the torch `ConventionalState` |
| stores | the decode stores of a layer (`ReplayStore`, `ConventionalStore`) and the checks of a step's inputs, shared by kernels and references | |
| replay_decode | the replay decode step and verify: a flush and a read launch of one kernel, read copy + ring buffer, per-row flush from the anchor | replay_ref (specified by the torch `ReplayState`) |
| verify | speculative verify + accept (on replay_decode's kernel), and the per-draft snapshot baseline | replay_ref / in verify |
| chunk | chunked teacher forcing with the decode semantics (docs/DESIGN.md section 7) | chunk_ref |
| compile_check | compiles every specialization the model paths launch for sm_90, without a GPU | |

Importing this package imports no kernel module (and so not triton): import the module you need.
"""
