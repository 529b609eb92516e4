"""Chunked teacher forcing with the decode semantics (docs/DESIGN.md section 7).

| module | holds |
| --- | --- |
| kernel | the Triton scan: four launches per group of windows |
| launch | its launch parameters by shape and the window groups, with `override_chunk_launch` |
| reference | the torch reference `chunk_scan_ref` (same signature and effect) and the `ScanState` it hands over |

Each Triton module is named for what it runs; `launch` and `reference` carry the same names in
every operator's folder. The reference imports no Triton module. Importing this package imports
no module of it (and so not triton).
"""
