import torch

from replayquant.formats import FORMATS, get_format


def test_registry_roundtrip_shapes():
    x = torch.randn(2, 3, 8, 32)
    for name in FORMATS:
        fmt = get_format(name)
        q = fmt.quantize(x, rounding="stochastic", seed=5)
        assert fmt.dequantize(q).shape == x.shape
        assert q.nbytes > 0
