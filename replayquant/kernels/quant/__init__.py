"""The format casts in Triton: what every kernel uses to read and write a stored role.

| module | holds |
| --- | --- |
| kernel | quantize / dequantize of every format, nearest and stochastic, and the device functions (Philox, grid rounding, element codecs) the other kernels import |
| roles | a stored role's tile loaded into and cast from registers, shared by every kernel |

Their reference is the format specification, `replayquant.formats.casts` and
`replayquant.formats.philox`, which imports nothing from here. Importing this package imports
no module of it (and so not triton).
"""
