"""The conventional decode step (the baseline): a read-modify-write of one state in one format.

| module | holds |
| --- | --- |
| kernel | the step's Triton kernel, GDN, KDA and Mamba-2 |
| verify | the speculative verify with a snapshot per draft (vLLM's scheme) and its accept |
| launch | the launch table: tile rows and warps by shape, with `override_conventional_launch` |
| reference | the torch reference of step, verify and accept (specified by the torch `ConventionalState`) |

Each Triton module is named for what it runs; `launch` and `reference` carry the same names in
every operator's folder. The reference imports no Triton module. Importing this package imports
no module of it (and so not triton).
"""
