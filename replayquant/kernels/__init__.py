"""Triton kernels, one folder per operator, each beside the plain-torch reference that
specifies it (same signature) and its launch table. The references, the torch engine and the
launch tables import no Triton module; the stores they step live in `replayquant.replay`
(`stores`, `roles`), the format specification in `replayquant.formats` (`casts`, `philox`).

| folder | kernels | launch table | reference |
| --- | --- | --- | --- |
| quant | quantize / dequantize of every format (kernel); a stored role's tile cast in registers, shared by every kernel (roles) | launch (the NVFP4 quantize plan) | formats/casts |
| conventional | the baseline decode step (kernel), its verify with per-draft snapshots and accept (verify) | launch | reference (specified by the torch `ConventionalState`) |
| replay | the replay decode step (decode), speculative verify + accept (verify), the one-pass verify (verify_onepass) | launch | reference (specified by the torch `ReplayState`); the torch engine, engine |
| chunk | chunked teacher forcing with the decode semantics (docs/DESIGN.md section 7) | launch | reference |

Beside the folders: `ops` registers the decode step, verify and accept as custom operators
(either engine), and `compile_check` compiles every specialization the model paths launch for
sm_90, without a GPU (a developer's tool).

A launch table is asked, never passed: each `launch` module has one lookup function and an
override context (`override_replay_launch`, `override_conventional_launch`,
`override_chunk_launch`, `override_quant_launch`) with which tests and the benchmark's sweep
try other configs; the kernels' signatures carry no launch parameters.

Importing this package imports no kernel module (and so not triton): import the module you need.
"""
