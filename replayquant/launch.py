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


def process_rank(env=None) -> int:
    """This process's rank (RANK, as torchrun and accelerate launch set it; 0 when unset), or one
    ValueError for a value that is not an integer >= 0."""
    env = os.environ if env is None else env
    raw = env.get("RANK", "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"RANK={raw!r}: the rank of this process, as torchrun or accelerate "
                         f"launch set it, must be an integer >= 0; unset it to run one process")
    return int(raw)


def world_size(env=None) -> int:
    env = os.environ if env is None else env
    try:
        return int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def single_process_warning(command: str = "kl", env=None) -> str | None:
    """A warning to print when more processes were asked for than run (None otherwise)."""
    asked, exact = requested_processes(env)
    if asked is None or asked <= 1 or world_size(env) > 1:
        return None
    n = str(asked) if exact else "N"
    asked_text = f"{asked} processes were" if exact else "more than one process was"
    return (f"warning: {asked_text} asked for, but this runs as one process: `accelerate launch "
            f"--cpu` starts a single process whatever --num_processes says. For {n} processes on CPU run `accelerate launch --multi_gpu "
            f"--num_processes {n} -m replayquant {command} ...` (the processes talk through gloo "
            f"and split the documents; no GPU needed)")
