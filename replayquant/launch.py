"""How many processes a launcher was asked for, against how many run.

`accelerate launch --cpu --num_processes N` starts one process whatever N is (accelerate's simple
launcher); it then sets ACCELERATE_USE_CPU=True and, for N > 1 only, MASTER_ADDR / MASTER_PORT,
but no WORLD_SIZE. `accelerate launch --multi_gpu --num_processes N` starts N processes through
torchrun (WORLD_SIZE=N), and works on a machine without CUDA: the processes form a gloo group
and split the documents, as on GPUs. ACCELERATE_NUM_PROCESSES, where set, is taken as the number
asked for.
"""

from __future__ import annotations

import os

__all__ = ["requested_processes", "world_size", "single_process_warning", "process_rank"]


def _true(v) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes")


def requested_processes(env=None) -> tuple[int | None, bool]:
    """(processes asked for, whether that number is known exactly); (None, False) when the
    environment does not say."""
    env = os.environ if env is None else env
    v = env.get("ACCELERATE_NUM_PROCESSES")
    if v:
        try:
            return int(v), True
        except ValueError:
            pass
    if _true(env.get("ACCELERATE_USE_CPU", "")) and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        return 2, False          # more than one; the simple launcher does not pass the number
    return None, False


def _env_int(name: str, unset: int, minimum: int, env=None) -> int:
    """The integer torchrun / accelerate launch put in `name` (`unset` when absent), or one
    ValueError for a value that is not an integer >= minimum."""
    env = os.environ if env is None else env
    raw = env.get(name, "").strip()
    if not raw:
        return unset
    if not raw.isdigit() or int(raw) < minimum:
        raise ValueError(f"{name}={raw!r}: set by torchrun or accelerate launch, it must be an "
                         f"integer >= {minimum}; unset it to run one process")
    return int(raw)


def process_rank(env=None) -> int:
    """This process's rank (RANK; 0 when unset), checked against WORLD_SIZE."""
    rank, size = _env_int("RANK", 0, 0, env), world_size(env)
    if rank >= size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={size}: a rank runs from 0 to WORLD_SIZE "
                         f"- 1; start the processes with torchrun or accelerate launch, or unset "
                         f"both to run one process")
    return rank


def world_size(env=None) -> int:
    """How many processes run (WORLD_SIZE; 1 when unset)."""
    return _env_int("WORLD_SIZE", 1, 1, env)


def single_process_warning(command: str = "kl", env=None) -> str | None:
    """A warning to print when more processes were asked for than run (None otherwise)."""
    asked, exact = requested_processes(env)
    if asked is None or asked <= 1 or world_size(env) > 1:
        return None
    n = str(asked) if exact else "N"
    asked_text = f"{asked} processes were" if exact else "more than one process was"
    return (f"warning: {asked_text} asked for, but this runs as one process: `accelerate launch "
            f"--cpu` starts a single process whatever --num_processes says. For {n} processes "
            f"on CPU run `accelerate launch --multi_gpu --num_processes {n} -m replayquant "
            f"{command} ...` (the processes talk through gloo and split the documents; no GPU "
            f"needed)")
