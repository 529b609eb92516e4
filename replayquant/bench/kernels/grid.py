"""What the decode-kernel benchmark (`replayquant bench kernels`, GPU) measures: the layer shapes,
the precision pairs and grid, each kind's main replay window, and per kind the kernels and their
inputs. The random inputs are replayquant.testing, which the kernel tests draw from too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayquant.testing import (gdn_params, gdn_step_inputs, kda_step_inputs,
                                 mamba2_params, mamba2_step_inputs, random_state)
from replayquant.kernels.conventional import kernel as cv
from replayquant.kernels.conventional import reference as cr
from replayquant.kernels.conventional import verify as cvf
from replayquant.kernels.replay import decode as rd
from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import verify as vf
from replayquant.pairs import PrecisionPair

SHAPES = {
    # Qwen3.5-4B Gated DeltaNet layer: 32 value heads, 16 key heads, d_k = d_v = 128
    "gdn": dict(kind="gdn", H=32, HK=16, dv=128, dk=128),
    # Nemotron-H Mamba-2 layer: 128 heads, head dim 64, state 128, 8 groups
    "mamba2": dict(kind="mamba2", H=128, HK=8, dv=64, dk=128),
    # Kimi-Linear-48B Kimi Delta Attention layer (transformers' KimiLinearConfig: 32 linear heads,
    # head dim 128; q, k, v heads equal)
    "kda": dict(kind="kda", H=32, HK=32, dv=128, dk=128),
}
# speculative rounds, the authors' kernels and the float64 accuracy comparison cover GDN and
# Mamba-2 (KDA has no conventional verify kernel, the authors none for KDA)
SPEC_KINDS = ("gdn", "mamba2")
PEERS = {"gdn": ("peer:fla", "fla fused_recurrent_gated_delta_rule"),
         "mamba2": ("peer:mamba_ssm", "mamba_ssm selective_state_update"),
         "kda": ("peer:fla", "fla fused_recurrent_kda")}
PAIR_L = {"gdn": 16, "mamba2": 8, "kda": 16}     # each kind's main replay window L

PAIRS = ("s32_rs", "tp8_hi32", "tp4_hi32", "tp4_hi16_sr")      # the benchmark's pairs


@dataclass(frozen=True)
class KernelGrid:
    """What one `bench kernels` run measures (its defaults: the command's). batches: the decode
    steps'; Ls: replay window lengths; Ts: drafts per speculative round, at spec_batches;
    kinds: default every kind of `shapes` (default SHAPES); peers, checks, sweep: those
    sections; detail_batches: where the replay rows add the read and flush steps alone;
    staggered_batches: where the windows are also timed with rows out of phase; main_L_only:
    no L but each kind's main L; accuracy: the float64 comparison after the checks."""
    batches: tuple = (1, 8, 32, 128, 256, 512)
    Ls: tuple = (4, 8, 16, 32)
    pairs: tuple = PAIRS
    Ts: tuple = (2, 4)
    spec_batches: tuple = (32, 256, 512)
    kinds: tuple | None = None
    peers: bool = True
    checks: bool = True
    sweep: bool = True
    detail_batches: tuple = (256,)
    staggered_batches: tuple = (256,)
    main_L_only: bool = False
    accuracy: bool = True
    shapes: dict | None = None


def check_names(pairs, kinds) -> None:
    """One clear error for a pair or layer kind the benchmark does not know."""
    bad = [p for p in pairs if p not in PAIRS]
    if bad:
        raise ValueError(f"pairs {bad}: choose from {list(PAIRS)}")
    bad = [k for k in kinds if k not in SHAPES]
    if bad:
        raise ValueError(f"kinds {bad}: choose from {', '.join(SHAPES)}")


def kernel_inputs(kind, S, B, T=None, seed=0, device="cuda"):
    """Kernel keyword arguments of one step (T None) or T drafts."""
    H, HK, dv, dk = S["H"], S["HK"], S["dv"], S["dk"]
    if kind == "gdn":
        q, k, v, a, b = gdn_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
        A_log, dtb = gdn_params(H, seed, device)
        return dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dtb)
    if kind == "kda":
        q, k, v, g, beta = kda_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
        return dict(q=q, k=k, v=v, g=g, beta=beta)
    x, dt, Bm, C, z = mamba2_step_inputs(B, HK, H, dk, dv, T=T, seed=seed, device=device)
    A, D, dtb = mamba2_params(H, seed, device)
    return dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D, z=z, dt_bias=dtb)


def kernel_fns(kind) -> dict:
    """The kernels of a layer kind and their torch references: the conventional step ('conv'),
    the replay step ('step'), the replay verify and (GDN, Mamba-2) the conventional verify."""
    if kind == "gdn":
        return dict(conv=cv.conventional_gdn_step, conv_ref=cr.conventional_gdn_step_ref,
                    step=rd.replay_gdn_step, step_ref=rr.replay_gdn_step_ref,
                    verify=vf.replay_gdn_verify, verify_ref=rr.replay_gdn_verify_ref,
                    cverify=cvf.conventional_gdn_verify, cverify_ref=cr.conventional_gdn_verify_ref)
    if kind == "kda":                       # no conventional KDA verify kernel
        return dict(conv=cv.conventional_kda_step, conv_ref=cr.conventional_kda_step_ref,
                    step=rd.replay_kda_step, step_ref=rr.replay_kda_step_ref,
                    verify=vf.replay_kda_verify, verify_ref=rr.replay_kda_verify_ref)
    return dict(conv=cv.conventional_mamba2_step, conv_ref=cr.conventional_mamba2_step_ref,
                step=rd.replay_mamba2_step, step_ref=rr.replay_mamba2_step_ref,
                verify=vf.replay_mamba2_verify, verify_ref=rr.replay_mamba2_verify_ref,
                cverify=cvf.conventional_mamba2_verify,
                cverify_ref=cr.conventional_mamba2_verify_ref)


@dataclass
class BatchInputs:
    """What the timed rows of one layer kind at batch B share: its shape S, kernels f
    (kernel_fns), random initial state init, kernel inputs kw (of one step, or of T drafts),
    slots idx (0..B-1) and output buffer out; copy_bw: the copy bandwidth the rows are measured
    against."""
    kind: str
    B: int
    S: dict
    f: dict
    init: torch.Tensor
    kw: dict
    idx: torch.Tensor
    out: torch.Tensor
    copy_bw: float

    @classmethod
    def draw(cls, kind, S, B, device, copy_bw, state_seed, input_seed, T=None) -> BatchInputs:
        """The state drawn with state_seed, the inputs of one step (T None) or of T drafts with
        input_seed."""
        init = random_state(B, S["H"], S["dv"], S["dk"], seed=state_seed, device=device)
        kw = kernel_inputs(kind, S, B, T=T, seed=input_seed, device=device)
        drafts = () if T is None else (T,)
        return cls(kind, B, S, kernel_fns(kind), init, kw,
                   idx=torch.arange(B, dtype=torch.int32, device=device),
                   out=torch.empty(B, *drafts, S["H"], S["dv"], device=device), copy_bw=copy_bw)


def load_pair(name, L):
    """Pair `name` with a replay window of L: (PrecisionPair, anchor format, read format or None)."""
    P = PrecisionPair.load(name).with_buffer_len(L)
    return P, P.anchor.format, None if P.read is None else P.read.format
