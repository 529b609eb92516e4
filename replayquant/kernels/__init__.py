"""Triton kernels, each beside the plain-torch reference that specifies it (same signature).
The references, the torch engine and the launch tables import no Triton module; the stores they
step live in `replayquant.replay` (`stores`, `roles`), the format specification in
`replayquant.formats` (`casts`, `philox`).

| module | kernels | reference |
| --- | --- | --- |
| quant | quantize / dequantize of every format, nearest and stochastic | formats/casts |
| roles | a stored role's tile loaded into and cast from registers, shared by every kernel | formats/casts |
| conventional | the baseline decode step: read-modify-write of one shared format | conventional_ref (specified by the torch `ConventionalState`) |
| replay_decode | the replay decode step and verify: a flush and a read launch of one kernel, read copy + ring buffer, per-row flush from the anchor; its launch table in replay_launch | replay_ref (specified by the torch `ReplayState`); the torch engine replay_torch |
| verify | speculative verify + accept (on replay_decode's kernel), and the per-draft snapshot baseline | replay_ref / in verify |
| chunk | chunked teacher forcing with the decode semantics (docs/DESIGN.md section 7) | chunk_ref |
| compile_check | compiles every specialization the model paths launch for sm_90, without a GPU | |

Importing this package imports no kernel module (and so not triton): import the module you need.
"""
