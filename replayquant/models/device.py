"""Which device a command runs on: CUDA when present, else the CPU; a device named by the user
is checked against this machine before any weights are loaded.

    check_device("cuda:1")        -> "cuda:1", or one ValueError (no CUDA, no such index, a typo)
    check_device_map("auto")      -> "auto" (accelerate's placement strategies pass through)
    default_device()              -> "cuda" if torch.cuda.is_available() else "cpu"
    describe_devices(model)       -> "cuda:0 (NVIDIA H200)" / "cpu": where the weights are
"""

from __future__ import annotations

import torch

__all__ = ["PLACEMENTS", "check_device", "check_device_map", "default_device", "describe_device",
           "describe_devices"]

# accelerate's device_map strategies (from_pretrained(device_map=...)); they also run on the CPU
PLACEMENTS = ("auto", "balanced", "balanced_low_0", "sequential")


def default_device() -> str:
    """CUDA when this machine has it, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(spec, option: str = "--device") -> str:
    """`spec` if it names a device this machine has (cpu, cuda, cuda:N, mps, xpu, ...); else one
    ValueError saying what is there and what to pass."""
    s = str(spec).strip()
    hint = f"pass {option} cpu, or leave {option} out (CUDA when present, else the CPU)"
    try:
        dev = torch.device(s)
    except (RuntimeError, ValueError):
        raise ValueError(f"{option} {s}: not a device; give cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return s
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise ValueError(f"{option} {s}: this machine has no CUDA device ({why}); {hint}")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"{option} {s}: this machine has {n} CUDA device(s), cuda:0 to "
                             f"cuda:{n - 1}; {hint}")
        return s
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if not callable(available) or not available():
        raise ValueError(f"{option} {s}: this machine has no {dev.type} device; {hint}")
    return s


def check_device_map(spec, option: str = "--device-map"):
    """None, one of accelerate's placement strategies (PLACEMENTS), or a device `check_device`
    accepts."""
    if spec is None or str(spec).strip() in PLACEMENTS:
        return None if spec is None else str(spec).strip()
    return check_device(spec, option)


def describe_device(device) -> str:
    """'cuda:0 (NVIDIA H200)' or 'cpu'."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(dev)


def describe_devices(model) -> str:
    """Where a model's weights are, e.g. 'cpu' or 'cuda:0 (NVIDIA H200), cuda:1 (NVIDIA H200)'."""
    devices = sorted({str(p.device) for p in model.parameters()}) or ["cpu"]
    return ", ".join(describe_device(d) for d in devices)
