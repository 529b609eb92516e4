"""The replay decode step and speculative verify on a `ReplayStore` (read copy + ring buffer,
per-row flush from the anchor).

| module | holds |
| --- | --- |
| decode | the step kernel: a flush launch and a read launch of one kernel (one launch at small batch, or on the read's tiles with the flush inside), and the pointer move |
| verify | the speculative verify (GDN and Mamba-2 on the one-pass kernel by default, KDA on the step kernel), its accept and the choice of design |
| verify_onepass | the one-pass verify (design='onepass', the default: one pass over the read copy for all drafts) |
| launch | the launch tables of the two kernels, with `override_replay_launch` |
| reference | the torch reference of step, verify and accept (specified by the torch `ReplayState`) |
| engine | the torch engine: the same store stepped in batched torch, bit for bit the reference's output on the CPU |

Each Triton module is named for what it runs; `launch` and `reference` carry the same names in
every operator's folder. The reference and the engine import no Triton module (the engine is the
decode path where Triton does not run, and sits beside the reference it is tested against).
Importing this package imports no module of it (and so not triton).
"""
