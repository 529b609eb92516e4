"""The replay decode step, verify and accept as PyTorch custom operators, so that torch.compile
keeps each one as a single node of its graph and CUDA graphs capture its launches.

`replay_verify(store, inputs, state_indices)` (operator `replayquant::replay_verify`, inputs
with a draft axis) and `replay_accept(store, n, state_indices)` (`replayquant::replay_accept`,
the pointer move) are speculative decoding's round on the same store: the Triton engine's
`replay.verify.replay_*_verify` / `replay_accept`, the torch engine's references in
`replay.reference`.

`replay_step(store, inputs, state_indices, ...)` runs one decode step of a `ReplayStore` through
the operator `replayquant::replay_step`, whose arguments are the store's tensors, or its one
byte buffer where the store is packed (`ReplayStore.pack`; declared as
mutated: the step writes the ring, the pointers and, at a flush, both roles), the step's input
tensors, and a string holding what the store's tensors do not say (kind, formats, L, key heads,
the SR key, the engine). The engine is the store's: 'triton' (`replay.decode.replay_{gdn,mamba2,
kda}_step`, a bf16 ring) or 'torch' (`replay.engine`, the same step in torch ops with no host
read, for the CPU and for dims the kernel does not take). The fake implementation allocates the
output [B, H, d_v] float32 and touches nothing, which is all a tracer needs. A step may take a
`stores.FaultRecord` (its three tensors, declared as mutated too), in which the step notes which
inputs of which rows held NaN or infinity: inside the kernel's launches (or the torch engine's
ops), so that watching the inputs costs no launch of its own. Eager callers get
the same launches as calling the engine directly; the operator adds one dictionary lookup.

The store's host fields (`pending_T`, `last_force`) are kept by the caller: a decode step leaves
pending_T None and sets last_force to the step's path, as the engines do.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Optional

import torch

from replayquant.kernels.replay import reference as rr
from replayquant.kernels.replay import engine as rt
from replayquant.replay.roles import PackedRole
from replayquant.replay.stores import (FaultRecord, ReplayStore, _begin, _check_accept,
                                        packed_views)

__all__ = ["replay_step", "replay_verify", "replay_accept", "store_tensors", "store_meta",
           "ENGINES"]

_INPUTS = {"gdn": ("q", "k", "v", "a", "b", "A_log", "dt_bias"),
           "mamba2": ("x", "dt", "A", "B", "C", "dt_bias"),
           "kda": ("q", "k", "v", "g", "beta")}


ENGINES = ("triton", "torch")


def store_meta(store: ReplayStore, engine: str = "triton", packed: list | None = None) -> str:
    """What the operator needs beside the store's tensors, as a string (the operator's cache
    key); engine: 'triton' or 'torch', which steps the store; packed: the layout the store will
    have once packed (ReplayStore.pack_layout), for an unpacked one (default: its own)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    names, _ = store.fields()
    role = lambda r: None if r is None else [r.fmt, r.rounding, list(r.shape)]  # noqa: E731
    return json.dumps({"kind": store.kind, "anchor": role(store.anchor), "read": role(store.read),
                       "buffer_len": store.buffer_len, "key_heads": store.key_heads, "key": store.key,
                       "max_drafts": store.max_drafts, "names": names,
                       "packed": store.blob_layout if packed is None else packed,
                       "engine": engine})


def store_tensors(store: ReplayStore) -> list[torch.Tensor]:
    """The store's tensors in the operator's order (store_meta names them): its blob alone where
    it is packed (ReplayStore.pack), else its fields."""
    return [store.blob] if store.blob is not None else store.fields()[1]


@lru_cache(maxsize=256)
def _layout(meta: str) -> dict:
    return json.loads(meta)


def _store_of(tensors: list[torch.Tensor], meta: str) -> ReplayStore:
    m = _layout(meta)
    by = packed_views(tensors[0], m["packed"]) if m["packed"] else dict(zip(m["names"], tensors))

    def role(name):
        spec = m[name]
        if spec is None:
            return None
        return PackedRole(spec[0], tuple(spec[2]), by[f"{name}.payload"], rounding=spec[1],
                          scale=by.get(f"{name}.scale"), gscale=by.get(f"{name}.gscale"))

    return ReplayStore(m["kind"], role("anchor"), role("read"), m["buffer_len"], m["key_heads"],
                       kbuf=by["kbuf"], vbuf=by["vbuf"], ubuf=by.get("ubuf"), Gbuf=by["Gbuf"],
                       bbuf=by["bbuf"], committed=by["committed"], n_flush=by["n_flush"],
                       key=m["key"], start=by["start"], max_drafts=m["max_drafts"],
                       arrive=by["arrive"], Tbuf=by.get("Tbuf"))


def _run(fns, state, inputs, state_indices, meta, scalars, dt_limit, **kw):
    """Call the kind's function of fns (gdn, mamba2, kda) on the store these tensors hold."""
    store = _store_of(state, meta)
    gdn, mamba2, kda = fns
    kind = store.kind
    if kind == "gdn":
        q, k, v, a, b, A_log, dt_bias = inputs
        return gdn(store, q, k, v, a, b, A_log, dt_bias, state_indices=state_indices,
                   use_qk_l2norm=True, beta_scale=scalars[1], **kw)
    if kind == "mamba2":
        x, dt, A, B, C, dt_bias = inputs
        lim = {"dt_limit": tuple(dt_limit)} if dt_limit else {}
        return mamba2(store, x, dt, A, B, C, state_indices=state_indices, dt_bias=dt_bias,
                      **lim, **kw)
    q, k, v, g, beta = inputs
    return kda(store, q, k, v, g, beta, state_indices=state_indices, scale=scalars[0] or None,
               use_qk_l2norm=True, **kw)


_TRITON_MODULES = None


def _triton_modules():
    """(replay.decode, replay.verify), imported at the Triton engine's first call: they import
    Triton, which replayquant installs on Linux only and which the torch engine does not need."""
    global _TRITON_MODULES
    if _TRITON_MODULES is None:
        from replayquant.kernels.replay import decode, verify
        _TRITON_MODULES = decode, verify
    return _TRITON_MODULES


def _engine_fns(meta: str, what: str):
    """The engine's (gdn, mamba2, kda) functions for `what` ('step', 'verify', 'accept')."""
    engine = _layout(meta)["engine"]
    if engine == "triton":
        rd, vf = _triton_modules()
        if what == "step":
            return rd.replay_gdn_step, rd.replay_mamba2_step, rd.replay_kda_step
        return (vf.replay_gdn_verify, vf.replay_mamba2_verify, vf.replay_kda_verify) \
            if what == "verify" else vf.replay_accept
    if what == "step":
        return rt.replay_gdn_step_torch, rt.replay_mamba2_step_torch, rt.replay_kda_step_torch
    return (rr.replay_gdn_verify_ref, rr.replay_mamba2_verify_ref, rr.replay_kda_verify_ref) \
        if what == "verify" else rr.replay_accept_ref


@torch.library.custom_op("replayquant::replay_step", mutates_args=("state", "record"))
def _replay_step_op(state: list[torch.Tensor], inputs: list[Optional[torch.Tensor]],
                    state_indices: torch.Tensor, meta: str, path: str,
                    scalars: list[float], dt_limit: list[float],
                    flushing: Optional[list[int]], record: list[torch.Tensor]) -> torch.Tensor:
    kw = {} if flushing is None else {"flushing": flushing}
    return _run(_engine_fns(meta, "step"), state, inputs, state_indices, meta, scalars, dt_limit,
                path=path, record=FaultRecord(*record) if record else None, **kw)


@_replay_step_op.register_fake
def _(state, inputs, state_indices, meta, path, scalars, dt_limit, flushing, record):
    m = _layout(meta)
    H, dv = m["anchor"][2][1], m["anchor"][2][2]
    x = inputs[0]
    return x.new_empty((x.shape[0], H, dv), dtype=torch.float32)


@torch.library.custom_op("replayquant::replay_verify", mutates_args=("state",))
def _replay_verify_op(state: list[torch.Tensor], inputs: list[Optional[torch.Tensor]],
                      state_indices: torch.Tensor, meta: str, scalars: list[float],
                      dt_limit: list[float]) -> torch.Tensor:
    return _run(_engine_fns(meta, "verify"), state, inputs, state_indices, meta, scalars,
                dt_limit)


@_replay_verify_op.register_fake
def _(state, inputs, state_indices, meta, scalars, dt_limit):
    m = _layout(meta)
    H, dv = m["anchor"][2][1], m["anchor"][2][2]
    x = inputs[0]
    return x.new_empty((x.shape[0], x.shape[1], H, dv), dtype=torch.float32)


@torch.library.custom_op("replayquant::replay_accept", mutates_args=("state",))
def _replay_accept_op(state: list[torch.Tensor], n: torch.Tensor, state_indices: torch.Tensor,
                      meta: str, T: int) -> None:
    store = _store_of(state, meta)
    store.pending_T = T
    _engine_fns(meta, "accept")(store, n, state_indices, check=False)


@_replay_accept_op.register_fake
def _(state, n, state_indices, meta, T):
    return None


def _op_args(store: ReplayStore, inputs: dict):
    """(input tensors in the operator's order, scalars, dt_limit) of a step's or verify's inputs."""
    ts = [inputs.get(n) for n in _INPUTS[store.kind]]
    lim = inputs.get("dt_limit")
    return (ts, [float(inputs.get("scale") or 0.0), float(inputs.get("beta_scale", 1.0))],
            [] if lim is None else [float(x) for x in lim])


def replay_step(store: ReplayStore, inputs: dict, state_indices: torch.Tensor,
                path: str = "replay", meta: str | None = None,
                flushing: list[int] | None = None,
                record: FaultRecord | None = None) -> torch.Tensor:
    """One decode step of `store` (kind gdn / mamba2 / kda) through the custom operator: inputs
    as the kind's replay.decode step takes them, by name (GDN q, k, v, a, b, A_log, dt_bias,
    beta_scale; Mamba-2 x, dt, A, B, C, dt_bias, dt_limit; KDA q, k, v, g, beta, scale).
    meta: store_meta(store, engine), which a caller stepping the same store many times computes
    once (a tracer then sees a constant; None: the Triton engine). flushing: the torch engine's
    host-known flushing rows (replay.engine.replay_gdn_step_torch; the Triton engine takes none).
    record: a FaultRecord the step notes its inputs' NaN and infinities in (on the device).
    Returns y float32 [B, H, d_v]."""
    ts, scalars, lim = _op_args(store, inputs)
    meta = store_meta(store) if meta is None else meta
    if flushing is not None and _layout(meta)["engine"] != "torch":
        raise ValueError("flushing names the rows the torch engine flushes; the Triton engine "
                         "finds them on the device")
    y = _replay_step_op(store_tensors(store), ts, state_indices, meta, path, scalars, lim,
                        None if flushing is None else [int(r) for r in flushing],
                        [] if record is None else list(record))
    store.last_force = path == "flush"
    return y


def replay_verify(store: ReplayStore, inputs: dict, state_indices: torch.Tensor,
                  meta: str | None = None) -> torch.Tensor:
    """The outputs of T drafts per row through the operator replayquant::replay_verify: inputs by
    name as replay_step's, each with a draft axis after the batch ([B, T, ...]); the store must
    have been built for T drafts (max_drafts). Returns y float32 [B, T, H, d_v]; then call
    replay_accept. (The torch engine's verify is the reference `replay.reference`, which reads the
    host; the Triton engine's reads nothing.)"""
    _begin(store, store.kind, False, None)           # pending drafts, on the caller's store
    ts, scalars, lim = _op_args(store, inputs)
    y = _replay_verify_op(store_tensors(store), ts, state_indices,
                          store_meta(store) if meta is None else meta, scalars, lim)
    store.pending_T = y.shape[1]
    return y


def replay_accept(store: ReplayStore, n: torch.Tensor, state_indices: torch.Tensor,
                  meta: str | None = None, check: bool = True) -> None:
    """Commit the first n[b] drafts of each row (int tensor [B], 0..T) through the operator
    replayquant::replay_accept: only the pointers move. check: the range of n is checked on the
    host first (one host read; leave it False inside a captured or compiled step)."""
    T = store.pending_T
    if not T:
        raise ValueError("accept: no drafts pending; call verify first")
    if not isinstance(n, torch.Tensor):
        raise ValueError(f"accept: n must be an integer tensor [batch={state_indices.shape[0]}]")
    n = _check_accept(n, state_indices.shape[0], T, store.committed.device, check)
    _replay_accept_op(store_tensors(store), n, state_indices,
                      store_meta(store) if meta is None else meta, int(T))
    store.pending_T = None
