"""The replay decode steps as PyTorch custom operators, so that torch.compile keeps each one as a
single node of its graph and CUDA graphs capture its launches.

`replay_step(store, inputs, state_indices, ...)` runs one decode step of a `ReplayStore` through
the operator `replayquant::replay_step`, whose arguments are the store's tensors (declared as
mutated: the step writes the ring, the pointers and, at a flush, both roles), the step's input
tensors, and a string holding what the store's tensors do not say (kind, formats, L, key heads,
the SR key, the engine). The engine is the store's: 'triton' (`replay_decode.replay_{gdn,mamba2,
kda}_step`, a bf16 ring) or 'torch' (`replay_torch`, the same step in torch ops with no host
read, for the CPU and for dims the kernel does not take). The fake implementation allocates the
output [B, H, d_v] float32 and touches nothing, which is all a tracer needs. Eager callers get
the same launches as calling the engine directly; the operator adds one dictionary lookup.

The store's host fields (`pending_T`, `last_force`) are kept by the caller: a decode step leaves
pending_T None and sets last_force to the step's path, as the engines do.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Optional

import torch

from replayquant.kernels.roles import PackedRole
from replayquant.kernels.stores import ReplayStore

__all__ = ["replay_step", "store_tensors", "store_meta"]

# the store's tensor fields, in the operator's order (a role's absent scale tensors are left out
# and named in the meta string)
_RING = ("kbuf", "vbuf", "ubuf", "Gbuf", "bbuf", "Tbuf", "committed", "start", "n_flush", "arrive")
_ROLE = ("payload", "scale", "gscale")
_INPUTS = {"gdn": ("q", "k", "v", "a", "b", "A_log", "dt_bias"),
           "mamba2": ("x", "dt", "A", "B", "C", "dt_bias"),
           "kda": ("q", "k", "v", "g", "beta")}


def _present(store: ReplayStore):
    """(names, tensors) of the store's tensor fields that are not None (the arrival counters
    allocated if the store has none yet)."""
    if store.arrive is None:
        store.arrive = torch.zeros_like(store.committed)
    names, ts = [], []
    for role in ("anchor", "read"):
        r = getattr(store, role)
        if r is None:
            continue
        for f in _ROLE:
            t = getattr(r, f)
            if t is not None:
                names.append(f"{role}.{f}")
                ts.append(t)
    for f in _RING:
        t = getattr(store, f)
        if t is not None:
            names.append(f)
            ts.append(t)
    return names, ts


ENGINES = ("triton", "torch")


def store_meta(store: ReplayStore, engine: str = "triton") -> str:
    """What the operator needs beside the store's tensors, as a string (the operator's cache
    key); engine: 'triton' or 'torch', which steps the store."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    names, _ = _present(store)
    role = lambda r: None if r is None else [r.fmt, r.rounding, list(r.shape)]  # noqa: E731
    return json.dumps({"kind": store.kind, "anchor": role(store.anchor), "read": role(store.read),
                       "L": store.L, "key_heads": store.key_heads, "key": store.key,
                       "max_drafts": store.max_drafts, "names": names, "engine": engine})


def store_tensors(store: ReplayStore) -> list[torch.Tensor]:
    """The store's tensors in the operator's order (store_meta names them)."""
    return _present(store)[1]


@lru_cache(maxsize=256)
def _layout(meta: str) -> dict:
    return json.loads(meta)


def _store_of(tensors: list[torch.Tensor], meta: str) -> ReplayStore:
    m = _layout(meta)
    by = dict(zip(m["names"], tensors))

    def role(name):
        spec = m[name]
        if spec is None:
            return None
        return PackedRole(spec[0], spec[1], tuple(spec[2]), by[f"{name}.payload"],
                          by.get(f"{name}.scale"), by.get(f"{name}.gscale"))

    return ReplayStore(m["kind"], role("anchor"), role("read"), m["L"], m["key_heads"],
                       kbuf=by["kbuf"], vbuf=by["vbuf"], ubuf=by.get("ubuf"), Gbuf=by["Gbuf"],
                       bbuf=by["bbuf"], committed=by["committed"], n_flush=by["n_flush"],
                       key=m["key"], start=by["start"], max_drafts=m["max_drafts"],
                       arrive=by["arrive"], Tbuf=by.get("Tbuf"))


@torch.library.custom_op("replayquant::replay_step", mutates_args=("state",))
def _replay_step_op(state: list[torch.Tensor], inputs: list[Optional[torch.Tensor]],
                    state_indices: torch.Tensor, meta: str, path: str,
                    scalars: list[float], dt_limit: list[float]) -> torch.Tensor:
    store = _store_of(state, meta)
    gdn, mamba2, kda = _ENGINE_STEPS[_layout(meta)["engine"]]()
    kind = store.kind
    if kind == "gdn":
        q, k, v, a, b, A_log, dt_bias = inputs
        return gdn(store, q, k, v, a, b, A_log, dt_bias, state_indices=state_indices,
                   use_qk_l2norm=True, path=path, beta_scale=scalars[1])
    if kind == "mamba2":
        x, dt, A, B, C, dt_bias = inputs
        lim = tuple(dt_limit) if dt_limit else None
        return mamba2(store, x, dt, A, B, C, state_indices=state_indices, dt_bias=dt_bias,
                      path=path, **({} if lim is None else {"dt_limit": lim}))
    q, k, v, g, beta = inputs
    return kda(store, q, k, v, g, beta, state_indices=state_indices, scale=scalars[0] or None,
               use_qk_l2norm=True, path=path)


def _triton_steps():
    from replayquant.kernels import replay_decode as rd
    return rd.replay_gdn_step, rd.replay_mamba2_step, rd.replay_kda_step


def _torch_steps():
    from replayquant.kernels import replay_torch as rt
    return rt.replay_gdn_step_torch, rt.replay_mamba2_step_torch, rt.replay_kda_step_torch


_ENGINE_STEPS = {"triton": _triton_steps, "torch": _torch_steps}


@_replay_step_op.register_fake
def _(state, inputs, state_indices, meta, path, scalars, dt_limit):
    m = _layout(meta)
    H, dv = m["anchor"][2][1], m["anchor"][2][2]
    x = inputs[0]
    return x.new_empty((x.shape[0], H, dv), dtype=torch.float32)


def replay_step(store: ReplayStore, inputs: dict, state_indices: torch.Tensor,
                path: str = "replay", meta: str | None = None) -> torch.Tensor:
    """One decode step of `store` (kind gdn / mamba2 / kda) through the custom operator: inputs
    as the kind's replay_decode step takes them, by name (GDN q, k, v, a, b, A_log, dt_bias,
    beta_scale; Mamba-2 x, dt, A, B, C, dt_bias, dt_limit; KDA q, k, v, g, beta, scale).
    meta: store_meta(store, engine), which a caller stepping the same store many times computes
    once (a tracer then sees a constant; None: the Triton engine). Returns y float32 [B, H, d_v]."""
    kind = store.kind
    ts = [inputs.get(n) for n in _INPUTS[kind]]
    lim = inputs.get("dt_limit")
    y = _replay_step_op(store_tensors(store), ts, state_indices,
                        store_meta(store) if meta is None else meta, path,
                        [float(inputs.get("scale") or 0.0), float(inputs.get("beta_scale", 1.0))],
                        [] if lim is None else [float(x) for x in lim])
    store.last_force = path == "flush"
    return y
