"""GPU benchmarks (not run in CI): each writes a results JSON with provenance and a markdown table."""


def check_model_bench(command: str, shape: str, device: str | None = None) -> None:
    """One ValueError, before any work, for a whole-model benchmark of a real model's shape
    (about 4.2 B parameters over a 131072-token document by default: 9 GiB of host memory after
    a minute, hours to run) on a machine without a CUDA GPU or on a `device` off it; the tiny
    shape is the benchmark's CPU smoke test."""
    import torch
    off = device is not None and not str(device).startswith("cuda")
    if shape == "tiny" or (not off and torch.cuda.is_available()):
        return
    where = f"--device {device} is not one" if off else "this machine has no CUDA GPU"
    raise ValueError(f"{command} times the {shape} shape (about 4.2 B parameters) on a CUDA GPU, "
                     f"and {where}: run it on a machine with one, or give --shape tiny (with a "
                     f"short --context, e.g. 1024) for a CPU smoke test of the code")
