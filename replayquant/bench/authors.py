"""The ReplaySSM authors' decode kernels beside ours (`replayquant bench kernels --authors PATH`).

PATH is a checkout of their vLLM fork (github.com/Johnny-Liou/ReplaySSM) or a folder holding only
the files of `FILES` at the same relative paths (with a COMMIT file naming the fork's commit):
their GDN decode and verify, their Mamba-2 decode (output-only route) and verify, and the launch
config module all four import.
Their code stays there: `load` imports those files under their own module names after putting
stand-ins for the few vLLM names they import into sys.modules (`vllm.triton_utils`: triton and
tl; `vllm.platforms.current_platform`; `NULL_BLOCK_ID`; the softplus of vLLM's mamba_ssm ops),
and takes the stand-ins out again once the files are loaded.

The runners give their kernels the inputs of our rows (`replayquant.testing`, drawn by
`kernels.grid.kernel_inputs`): q, k, v packed into their mixed_qkv layout [B, 2 HK d_k + H d_v] (bf16; Mamba-2's
verify: x, B, C packed as their post-conv output), gates and dt in FP32 as ours, the FP32
state [slots, H, d_v, d_k] with slot 0 their null block (batch row r lives in slot r + 1), the
ring caches in the activation dtype (bf16, their production setting; float32 for their
FP32-activation variant) and the per-row write position, which their metadata builder computes
on the host: position (r * stagger + step) mod L, stagger 0 in phase (every row flushes in the
same step) and 1 staggered (row r starts at r mod L, about B / L rows flush in every step).
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from replayquant.testing import random_state
from replayquant.bench.kernels.grid import kernel_inputs, load_pair
from replayquant.bench.kernels.rows import spec_accepts
from replayquant.bench.kernels.timing import empty_cache, rotations, time_calls, timed_row
from replayquant.kernels.replay import decode as rd
from replayquant.kernels.conventional.reference import (gdn_frontend_ref, mamba2_frontend_ref,
                                                        mamba2_post_ref)
from replayquant.replay.stores import ReplayStore
from replayquant.replay.reference import recurrent_reference
from replayquant.statebytes import replay_window_bytes, state_bytes

FORK = "Johnny-Liou/ReplaySSM"
_MODS = {   # module name -> file, relative to the checkout
    "gdn_decode": "vllm/model_executor/layers/fla/ops/fused_recurrent_replayssm.py",
    "gdn_verify": "vllm/model_executor/layers/fla/ops/gdn_replayssm_spec_decode.py",
    "mamba2_decode": "vllm/model_executor/layers/mamba/ops/"
                     "selective_state_update_replayssm_output_only.py",
    "mamba2_verify": "vllm/model_executor/layers/mamba/ops/selective_state_update_replayssm_spec.py",
}
_CONFIG = "vllm/model_executor/layers/mamba/ops/replayssm_config.py"   # imported by all three
FILES = (*_MODS.values(), _CONFIG)


def _module_name(rel: str) -> str:
    return rel[:-3].replace("/", ".")


def checkout_commit(path, commit: str | None = None) -> str:
    """The fork's commit of checkout `path`: `commit` when given, else the HEAD of `path` when
    `path` is the top of a git work tree, else the first word of `path`/COMMIT. One ValueError
    when `path` lacks one of FILES or no commit can be told."""
    root = Path(path)
    missing = [f for f in FILES if not (root / f).is_file()]
    if missing:
        raise ValueError(f"--authors {path}: not a checkout of the ReplaySSM fork ({FORK}): "
                         f"missing {', '.join(missing)}. Pass the folder that holds vllm/ (a clone "
                         "of the fork, or those files extracted with a COMMIT file beside them)")
    if commit:
        return str(commit)
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=30)
        lines = top.stdout.split()
        if top.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            return lines[1]
    except (OSError, subprocess.SubprocessError):
        pass
    words = (root / "COMMIT").read_text().split() if (root / "COMMIT").is_file() else []
    if words:
        return words[0]
    raise ValueError(f"--authors {path}: cannot tell the fork's commit (not the top of a git "
                     "checkout, no COMMIT file); pass --authors-commit")


@dataclass
class Authors:
    """The authors' kernels, loaded: their decode / verify entry points and where they came from."""
    path: str
    commit: str
    gdn_step: object            # fused_recurrent_gated_delta_rule_replayssm
    gdn_verify: object          # gdn_replayssm_spec_decode
    gdn_commit: object          # commit_gdn_replayssm_spec (their accept: moves the cursors)
    mamba2_step: object         # selective_state_update_replayssm_output_only
    mamba2_verify: object       # selective_state_update_replayssm_spec
    mamba2_commit: object       # commit_replayssm_spec

    def provenance(self) -> dict:
        return {"repo": FORK, "commit": self.commit, "path": self.path, "files": list(FILES)}


@triton.jit
def _softplus(dt):
    """vLLM's mamba_ssm softplus as their kernels call it: log(1 + e^x), x itself above 20."""
    return tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)


def _stand_ins() -> dict:
    """Modules for the vLLM names the authors' files import, each holding only what they use."""
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__path__ = []                 # a package, so that submodules import
        m.__dict__.update(attrs)
        return m

    class Platform:                     # vllm.platforms.current_platform: the device's family
        @staticmethod
        def is_device_capability_family(cap: int) -> bool:
            return torch.cuda.is_available() and \
                torch.cuda.get_device_capability()[0] * 10 == cap

    names = ["vllm", "vllm.model_executor", "vllm.model_executor.layers",
             "vllm.model_executor.layers.fla", "vllm.model_executor.layers.fla.ops",
             "vllm.model_executor.layers.mamba", "vllm.model_executor.layers.mamba.ops",
             "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    out = {n: mod(n) for n in names}
    out["vllm.triton_utils"] = mod("vllm.triton_utils", triton=triton, tl=tl)
    out["vllm.platforms"] = mod("vllm.platforms", current_platform=Platform())
    out["vllm.model_executor.layers.mamba.ops.mamba_ssm"] = mod(
        "vllm.model_executor.layers.mamba.ops.mamba_ssm", softplus=_softplus)
    out["vllm.v1.attention.backends.utils"] = mod("vllm.v1.attention.backends.utils",
                                                  NULL_BLOCK_ID=0)
    return out


def load(path, commit: str | None = None) -> Authors:
    """Import the authors' kernels from checkout `path` (checkout_commit's checks first)."""
    commit = checkout_commit(path, commit)
    root = Path(path).resolve()
    stubs = _stand_ins()
    names = [*stubs, *(_module_name(f) for f in FILES)]
    saved = {n: sys.modules[n] for n in names if n in sys.modules}
    sys.modules.update(stubs)
    try:
        loaded = {}
        for rel in (_CONFIG, *_MODS.values()):      # the config module first: the others import it
            name = _module_name(rel)
            spec = importlib.util.spec_from_file_location(name, root / rel)
            m = importlib.util.module_from_spec(spec)
            sys.modules[name] = m
            spec.loader.exec_module(m)
            loaded[rel] = m
    except Exception as e:
        raise ValueError(f"--authors {path}: their kernels do not import through the bench's "
                         f"stand-ins ({type(e).__name__}: {e}); the bench knows the files of "
                         f"{FORK} at a84849410") from e
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)
    g, v, m, mv = (loaded[_MODS[k]] for k in _MODS)
    return Authors(str(path), commit, g.fused_recurrent_gated_delta_rule_replayssm,
                   v.gdn_replayssm_spec_decode, v.commit_gdn_replayssm_spec,
                   m.selective_state_update_replayssm_output_only,
                   mv.selective_state_update_replayssm_spec, mv.commit_replayssm_spec)


# ---------------------------------------------------------------------------- runners

def write_positions(B: int, L: int, stagger: int, device) -> list:
    """Their per-row cursors of each step of one window, as their metadata builder hands them
    over: (write_pos [B] int32, row r at (r * stagger + s) mod L; is_flush [B] bool, write_pos
    == L - 1, which their Mamba-2 kernel takes besides)."""
    r = torch.arange(B, dtype=torch.int32, device=device) * int(stagger)
    pos = [((r + s) % L).to(torch.int32) for s in range(L)]
    return [(p, p == L - 1) for p in pos]


def _gdn_slots(runner, init, L, HK, act) -> None:
    """Their GDN buffers of one batch, set on `runner`: the FP32 state in slots 1..B (slot 0 is
    their padding slot), the ring caches d (their update vectors) and k in `act`, g in float32,
    and each row's slot (idx)."""
    B, H, dv, dk = init.shape
    dev = init.device
    runner.state = torch.zeros(B + 1, H, dv, dk, device=dev)
    runner.state[1:] = init
    runner.d = torch.zeros(B + 1, H, L, dv, dtype=act, device=dev)
    runner.k = torch.zeros(B + 1, HK, L, dk, dtype=act, device=dev)
    runner.g = torch.zeros(B + 1, H, L, device=dev)
    runner.idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)


class GdnRunner:
    """Their GDN decode (one launch per step) on one batch: FP32 state in slots 1..B, ring caches
    d (their update vectors), k in `act`, g in float32."""

    def __init__(self, A: Authors, init, kw, L, HK, act=torch.bfloat16):
        B, H, dv, dk = init.shape
        self.A, self.act, self.dk = A, act, dk
        _gdn_slots(self, init, L, HK, act)
        self.out = torch.empty(B, H, dv, dtype=act, device=init.device)
        self.set_inputs(kw)

    def set_inputs(self, kw):
        B = kw["q"].shape[0]
        self.mixed = torch.cat([kw["q"].reshape(B, -1), kw["k"].reshape(B, -1),
                                kw["v"].reshape(B, -1)], 1).to(self.act).contiguous()
        self.a, self.b = kw["a"].float().contiguous(), kw["b"].float().contiguous()
        self.A_log, self.dt_bias = kw["A_log"].float(), kw["dt_bias"].float()

    def step(self, cursor):
        write_pos, _ = cursor
        self.A.gdn_step(mixed_qkv=self.mixed, a=self.a, b=self.b, A_log=self.A_log,
                        dt_bias=self.dt_bias, scale=self.dk ** -0.5, initial_state=self.state,
                        d_cache=self.d, k_cache=self.k, g_cache=self.g, out=self.out,
                        ssm_state_indices=self.idx, write_pos=write_pos,
                        use_qk_l2norm_in_kernel=True)
        return self.out

    @property
    def anchor(self):
        return self.state[1:]


class Mamba2Runner:
    """Their Mamba-2 decode (a B.C precompute launch, then the output-only step, which folds the
    ring into the state at the flush) on one batch: FP32 state in slots 1..B, x and B caches in
    `act`, dt cache and the B.C scratch in float32."""

    def __init__(self, A: Authors, init, kw, L, G, act=torch.bfloat16):
        B, H, P, N = init.shape
        dev = init.device
        self.A, self.act, self.L = A, act, L
        self.state = torch.zeros(B + 1, H, P, N, device=dev)
        self.state[1:] = init
        self.x_cache = torch.zeros(B + 1, H, L, P, dtype=act, device=dev)
        self.dt_cache = torch.zeros(B + 1, H, L, device=dev)
        self.B_cache = torch.zeros(B + 1, G, L, N, dtype=act, device=dev)
        self.bc_pre = torch.zeros(B, G, L, device=dev)
        self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
        self.out = torch.empty(B, H, P, dtype=act, device=dev)
        self.set_inputs(kw)

    def set_inputs(self, kw):
        B, H, P = kw["x"].shape
        N = self.state.shape[-1]
        a = self.act
        self.x, self.z = kw["x"].to(a).contiguous(), kw["z"].to(a).contiguous()
        self.Bm, self.C = kw["B"].to(a).contiguous(), kw["C"].to(a).contiguous()
        # their kernel takes one dt, A, D and dt_bias per head, broadcast over the head dims
        self.dt = kw["dt"].float().unsqueeze(-1).expand(B, H, P)
        self.Am = kw["A"].float()[:, None, None].expand(H, P, N)
        self.D = kw["D"].float()[:, None].expand(H, P)
        self.dt_bias = kw["dt_bias"].float()[:, None].expand(H, P)

    def step(self, cursor):
        write_pos, is_flush = cursor
        self.A.mamba2_step(self.state, self.x, self.dt, self.Am, self.Bm, self.C, self.D,
                           self.dt_bias, z=self.z, dt_softplus=True, x_cache=self.x_cache,
                           dt_cache=self.dt_cache, B_cache=self.B_cache, bc_pre=self.bc_pre,
                           write_pos=write_pos, is_flush=is_flush,
                           max_cache_len=self.L, state_batch_indices=self.idx, out=self.out)
        return self.out

    @property
    def anchor(self):
        return self.state[1:]


class GdnSpecRunner:
    """Their GDN speculative round on one batch: verify (two launches: rows that flush one window
    early, then the others) on T tokens per row, then their commit of n accepted tokens, which
    moves the per-slot cursors (write_pos, cache_base, is_flush) of their circular ring."""

    def __init__(self, A: Authors, init, kw, L, HK, T, act=torch.bfloat16):
        B, H, dv, dk = init.shape
        dev = init.device
        self.A, self.L, self.T = A, L, T
        _gdn_slots(self, init, L, HK, act)
        self.write_pos = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self.cache_base = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self.is_flush = torch.zeros(B + 1, dtype=torch.int8, device=dev)
        self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
        n = B * T
        self.mixed = torch.cat([kw["q"].reshape(n, -1), kw["k"].reshape(n, -1),
                                kw["v"].reshape(n, -1)], 1).to(act).contiguous()
        self.a = kw["a"].float().reshape(n, H).contiguous()
        self.b = kw["b"].float().reshape(n, H).contiguous()
        self.A_log, self.dt_bias = kw["A_log"].float(), kw["dt_bias"].float()
        self.out = torch.empty(n, H, dv, dtype=act, device=dev)

    def round(self, n_accepted):
        self.A.gdn_verify(self.mixed, self.a, self.b, self.A_log, self.dt_bias, self.state,
                          self.d, self.k, self.g, self.out, self.qsl, self.idx, self.write_pos,
                          self.cache_base, self.is_flush, max_cache_len=self.L,
                          max_spec_len=self.T)
        self.A.gdn_commit(self.write_pos, self.cache_base, self.is_flush, n_accepted, self.idx,
                          max_cache_len=self.L, max_spec_len=self.T)
        return self.out


class Mamba2SpecRunner:
    """Their Mamba-2 speculative round on one batch: verify of T tokens per row from their packed
    post-conv layout (conv_out [B T, x | B | C], a circular cache of x | B and dt), three
    launches (scatter + B.C precompute, verify rows, flush rows), then their commit."""

    def __init__(self, A: Authors, init, kw, L, G, T, act=torch.bfloat16):
        B, H, P, N = init.shape
        dev = init.device
        n, buf = B * T, triton.next_power_of_2(L)
        self.A, self.L, self.T, self.G, self.N, self.d_inner = A, L, T, G, N, H * P
        self.state = torch.zeros(B + 1, H, P, N, device=dev)
        self.state[1:] = init
        self.cache = torch.zeros(B + 1, buf, H * P + G * N, dtype=act, device=dev)
        self.dt_cache = torch.zeros(B + 1, H, buf, device=dev)
        self.conv_out = torch.cat([kw["x"].reshape(n, -1), kw["B"].reshape(n, -1),
                                   kw["C"].reshape(n, -1)], 1).to(act).contiguous()
        self.dt = kw["dt"].float().reshape(n, H).contiguous()
        self.Am = kw["A"].float()[:, None, None].expand(H, P, N)
        self.D = kw["D"].float()[:, None].expand(H, P)
        self.dt_bias = kw["dt_bias"].float()
        self.z = kw["z"].to(act).reshape(n, H, P).contiguous()
        self.write_pos = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self.origin = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        self.is_flush = torch.zeros(B + 1, dtype=torch.int8, device=dev)
        self.idx = torch.arange(1, B + 1, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(0, n + 1, T, dtype=torch.int32, device=dev)
        self.bc_pre = torch.zeros(B, G, buf, triton.next_power_of_2(T), dtype=act, device=dev)
        self.out = torch.empty(n, H, P, dtype=act, device=dev)

    def round(self, n_accepted):
        self.A.mamba2_verify(self.state, self.cache, self.dt_cache, self.conv_out, self.dt,
                             self.Am, write_pos=self.write_pos, post_conv_state_pos=self.origin,
                             is_flush=self.is_flush, query_start_loc=self.qsl,
                             state_batch_indices=self.idx, max_cache_len=self.L,
                             max_spec_len=self.T, d_inner=self.d_inner, ngroups=self.G,
                             dstate=self.N, D=self.D, z=self.z, dt_bias=self.dt_bias,
                             dt_softplus=True, out=self.out, bc_pre=self.bc_pre)
        self.A.mamba2_commit(self.write_pos, self.origin, self.is_flush, n_accepted, self.idx,
                             max_cache_len=self.L, max_spec_len=self.T)
        return self.out


def runner(kind, A: Authors, init, kw, L, HK, act=torch.bfloat16):
    return (GdnRunner if kind == "gdn" else Mamba2Runner)(A, init, kw, L, HK, act)


# ---------------------------------------------------------------------------- bytes

def window_bytes(kind, L, B, H, HK, dv, dk) -> float:
    """Mean HBM bytes per step of their window (L - 1 steps reading the FP32 state and h cached
    entries and appending one, then the flush reading and writing the state), bf16 activations
    and caches, fp32 gates, bf16 output; counted as for our rows (statebytes)."""
    r = H / HK
    S = 4.0 * dv * dk
    kb = dk * 2 / r                                     # k / B per head (shared by the group)
    if kind == "gdn":
        entry = kb + dv * 2 + 4                         # k, d, g
        io = 2 * dk * 2 / r + dv * 2 + 8 + dv * 2       # q, k, v, a, b; out
        extra = 0.0
    else:
        entry = kb + dv * 2 + 4                         # B, x, dt
        io = 2 * dk * 2 / r + 2 * dv * 2 + 4 + dv * 2   # B, C, x, z, dt; out
        extra = 2 * L * 4 / r                           # the B.C scratch, written and read
    total = sum(S + h * entry + entry + io + extra for h in range(L - 1))
    total += 2 * S + (L - 1) * entry + io
    return B * H * total / L


# ---------------------------------------------------------------------------- timed sections

def _our_step(kind):
    return rd.replay_gdn_step if kind == "gdn" else rd.replay_mamba2_step


def bench_window(kind, B, L, device, copy_bw, S, A: Authors, staggered=False) -> list:
    """Rows of kernel 'authors' (and 'authors-staggered'): their mean decode step over a window of
    L steps, flush included, timed as our replay-window rows (CUDA graph of the window over
    rotated copies of state and caches, cold L2)."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=B, device=device)
    kw = kernel_inputs(kind, S, B, seed=1, device=device)
    per = (B + 1) * H * (4 * dv * dk + L * (2 * dv + 4)) + (B + 1) * HK * L * 2 * dk
    R = rotations(per, device)
    runs = [runner(kind, A, init, kw, L, HK) for _ in range(R)]
    nb = window_bytes(kind, L, B, H, HK, dv, dk)
    rows = []
    for stagger in ((0, 1) if staggered else (0,)):
        pos = write_positions(B, L, stagger, device)
        count = itertools.count()

        def window_step():
            p = pos[next(count) % L]
            for ru in runs:
                ru.step(p)
        ms = time_calls(window_step, L) / R
        rows.append(timed_row(kind, "authors-staggered" if stagger else "authors", "fp32", B,
                              ms, nb, copy_bw, L=L, rot=R, commit=A.commit,
                              note="the authors' kernel (FP32 state, bf16 activations and "
                                   "caches), mean step over a window of L steps; write positions "
                                   "given per step, as their host-side metadata"
                                   + (", row r starts at r mod L" if stagger else "")))
    del runs
    empty_cache()
    return rows


def bench_spec(kind, B, T, L, device, copy_bw, S, A: Authors) -> list:
    """Row 'spec-authors-round': their verify of T tokens per row + their commit, with the accept
    counts of our spec-replay-round rows at the same (B, T) (spec_accepts)."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=B + 1, device=device)
    kw = kernel_inputs(kind, S, B, T=T, seed=3, device=device)
    n = spec_accepts(B, T, device)
    sr = (GdnSpecRunner if kind == "gdn" else Mamba2SpecRunner)(A, init, kw, L, HK, T)
    ms = time_calls(lambda: sr.round(n), 8)
    tokens = B * (float(n.float().mean()) + 1.0)
    row = timed_row(kind, "spec-authors-round", "fp32", B, ms, None, copy_bw, T=T, L=L,
                    tokens_per_s=tokens / ms * 1e3, mean_accept=float(n.float().mean()),
                    commit=A.commit, note="the authors' verify (its launches: flush rows, verify "
                    "rows; Mamba-2 also a scatter + B.C launch) and their cursor commit, with the "
                    "accept counts of spec-replay-round")
    del sr
    empty_cache()
    return [row]


def bench_ours_staggered(kind, B, pair, L, device, copy_bw, S, store=None) -> list:
    """Row 'replay-window-staggered': our replay window (path='replay') with row b starting the
    window at fill b mod L, as the authors-staggered row (the replay-window row has every row
    flush in the same step). store: ReplayStore.from_state's options (bench.kernels.sweep's
    store_options)."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    P, af, rf = load_pair(pair, L)
    init = random_state(B, H, dv, dk, seed=B, device=device)
    kw = kernel_inputs(kind, S, B, seed=1, device=device)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    out = torch.empty(B, H, dv, device=device)
    R = rotations(B * H * (state_bytes(af, dv, dk) + (state_bytes(rf, dv, dk) if rf else 0)),
                  device)
    sts = [ReplayStore.from_state(init, P, kind, key_heads=HK, **(store or {})) for _ in range(R)]
    for st in sts:
        st.committed.copy_(torch.arange(B, dtype=torch.int32, device=device) % L)
    step = _our_step(kind)

    def window_step():
        for st in sts:
            step(st, **kw, state_indices=idx, out=out, path="replay")
    ms = time_calls(window_step, L) / R
    row = timed_row(kind, "replay-window-staggered", pair, B, ms,
                    replay_window_bytes(kind, af, rf, L, B, H, HK, dv, dk), copy_bw, L=L, rot=R,
                    note="path='replay', row b starts the window at fill b mod L: about B / L "
                         "rows flush in every step")
    del sts
    empty_cache()
    return [row]


# ---------------------------------------------------------------------------- accuracy

def _rel_fro(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-300))


def _reference(kind, init, kws):
    """Float64 recurrence of the steps `kws` from `init`: outputs [B, T, H, d_v] and final state."""
    per = []
    for kw in kws:
        if kind == "gdn":
            q, k, v, g, beta = gdn_frontend_ref(kw["q"], kw["k"], kw["v"], kw["a"], kw["b"],
                                                kw["A_log"], kw["dt_bias"])
        else:
            q, k, v, g, _ = mamba2_frontend_ref(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"],
                                                kw["dt_bias"])
            beta = None
        per.append((q, k, v, g, beta))
    st = lambda i: torch.stack([p[i] for p in per], 1)  # noqa: E731
    Y, S = recurrent_reference(init, st(0), st(1), st(2), st(3),
                               None if kind == "mamba2" else st(4), dtype=torch.float64)
    if kind == "mamba2":
        Y = torch.stack([mamba2_post_ref(Y[:, t], kw["x"].double(), kw["D"].double(),
                                         kw["z"].double()) for t, kw in enumerate(kws)], 1)
    return Y, S


ACC_PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32")      # FP32 anchors


def accuracy(kind, S, B, L, device, A: Authors | None = None, pairs=ACC_PAIRS,
             windows: int = 3) -> dict:
    """Relative Frobenius errors against a float64 recurrence after `windows` windows of L steps
    (every row in phase, so the last step is a flush): our pairs' anchors and outputs
    (path='replay'), the authors' FP32 state and outputs with bf16 caches and, their
    FP32-activation variant, float32 activations and caches; ours against theirs on the same
    inputs."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    init = random_state(B, H, dv, dk, seed=77, device=device)
    n = windows * L
    kws = [kernel_inputs(kind, S, B, seed=500 + t, device=device) for t in range(n)]
    params = ("A_log", "dt_bias") if kind == "gdn" else ("A", "D", "dt_bias")
    kws = [{**kw, **{p: kws[0][p] for p in params}} for kw in kws]     # one layer's parameters
    Y_ref, S_ref = _reference(kind, init, kws)
    idx = torch.arange(B, dtype=torch.int32, device=device)
    step = _our_step(kind)
    res = {"B": B, "L": L, "windows": windows, "shape": dict(S), "ours": {}, "authors": {},
           "ours_vs_authors": {}}
    ours = {}
    for pair in pairs:
        st = ReplayStore.from_state(init, load_pair(pair, L)[0], kind, key_heads=HK)
        ys = torch.stack([step(st, **kw, state_indices=idx, path="replay").float().clone()
                          for kw in kws], 1)
        anchor = st.anchor.dequantize()
        ours[pair] = (ys, anchor)
        res["ours"][pair] = {"anchor": _rel_fro(anchor, S_ref), "outputs": _rel_fro(ys, Y_ref)}
    if A is not None:
        pos = write_positions(B, L, 0, device)
        for name, act in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            ru = runner(kind, A, init, kws[0], L, HK, act)
            ys = []
            for t, kw in enumerate(kws):
                ru.set_inputs(kw)
                ys.append(ru.step(pos[t % L]).float().clone())
            ys = torch.stack(ys, 1)
            res["authors"][name] = {"state": _rel_fro(ru.anchor, S_ref),
                                    "outputs": _rel_fro(ys, Y_ref)}
            for pair, (yo, ao) in ours.items():
                res["ours_vs_authors"][f"{pair} / {name}"] = {"state": _rel_fro(ao, ru.anchor),
                                                              "outputs": _rel_fro(yo, ys)}
        res["authors_commit"] = A.commit
    empty_cache()
    return res


def print_accuracy(kind, acc: dict) -> None:
    f = lambda d: ", ".join(f"{k} {v:.2e}" for k, v in d.items())  # noqa: E731
    print(f"[bench kernels] accuracy {kind} B={acc['B']} L={acc['L']}, {acc['windows']} windows, "
          "relative Frobenius error against a float64 recurrence:", flush=True)
    for who in ("ours", "authors", "ours_vs_authors"):
        for name, d in acc.get(who, {}).items():
            print(f"  {who:15s} {name:16s} {f(d)}", flush=True)
