"""Options from the environment are read when used (not frozen at import), checked with one clear
error naming the variable, and overridden for a block by options.override."""

import pytest
import torch

from replayquant import options
from replayquant.formats import use_triton


def test_read_at_call_time(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "torch")
    assert options.get().backend == "torch" and not use_triton(x)
    monkeypatch.setenv("REPLAYQUANT_BACKEND", "triton")
    assert use_triton(x)
    monkeypatch.setenv("REPLAYQUANT_CHUNK_DOT", "ieee")
    assert options.get().chunk_dot == "ieee"
    monkeypatch.delenv("REPLAYQUANT_CHUNK_DOT")
    assert options.get().chunk_dot == "tf32x3"


@pytest.mark.parametrize("var,value", [("REPLAYQUANT_BACKEND", "gpu"), ("REPLAYQUANT_CHUNK_DOT", "tf32"),
                                       ("REPLAYQUANT_NVFP4_CHAIN_SPLIT", "-1"),
                                       ("REPLAYQUANT_CPU_THREADS", "0"), ("REPLAYQUANT_CPU_THREADS", "x"),
                                       ("REPLAYQUANT_DECODE_GRAPHS", "yes")])
def test_bad_value_names_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        options.get()


def test_override_is_scoped_and_checked(monkeypatch):
    monkeypatch.delenv("REPLAYQUANT_CHUNK_DOT", raising=False)
    with options.override(chunk_dot="ieee", nvfp4_chain_split=0):
        assert options.get().chunk_dot == "ieee" and options.get().nvfp4_chain_split == 0
        with options.override(chunk_dot="tf32x3"):
            assert options.get().chunk_dot == "tf32x3" and options.get().nvfp4_chain_split == 0
        assert options.get().chunk_dot == "ieee"
    assert options.get() == options.Options()
    with pytest.raises(ValueError, match="REPLAYQUANT_CHUNK_DOT"):
        with options.override(chunk_dot="fp64"):
            pass
    with pytest.raises(TypeError, match="unknown option"):
        with options.override(dots="ieee"):
            pass
