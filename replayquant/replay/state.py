"""ReplayState (dual-precision replay, DESIGN section 4) and ConventionalState (the baseline).

    from replayquant.replay import ReplayState
    st = ReplayState(initial_state, "tp4_hi16_sr", delta=True, seed=0, layer=0)
    y = st.step(q, k, v, log_a, beta)            # one decode step     -> [B, H, d_v]
    Y = st.verify(q, k, v, log_a, beta)          # T drafts [B, T, ...] -> [B, T, H, d_v]
    st.accept(n)                                 # n int tensor [B] (or int), 0..T

Shapes: initial_state [B, H, d_v, d_k]; step: q, k [B, H, d_k], v [B, H, d_v], log_a, beta [B, H];
verify: the same with a T axis after B. Inputs may be any floating dtype; arithmetic is FP32.
`delta=True`: Gated DeltaNet (beta required), `delta=False`: Mamba-2 (beta must be None).
`vector_gate=True` (keyword, fixed at construction): one gate per key channel, log_a [B, H, d_k]
(verify [B, T, H, d_k]), the decay of Kimi Delta Attention: S_t = S_{t-1} Diag(a_t) + u_t k_t^T,
u_t = beta_t (v_t - S_{t-1} (a_t * k_t)). The buffer's G is then [B, H, L, d_k]. A log_a of the
other kind is an error.
See `replayquant.replay.frontends` for the model-side mappings.

Semantics (exactly; see replayquant.replay.core for the formulas and the buffer layout):

* Construction: anchor A <- Q_anchor(S0) and read copy R <- Q_read(S0), independently, with
  flush index 0. A shared pair holds one copy (the anchor) that serves both roles.
  Every cast is `fmt.quantize(S, rounding, seed=layer_seed(seed, layer),
  stream=sr_stream(flush_index, ANCHOR or READ, state_indices, H))` (replayquant.streams), with
  `state_indices` the int64 sequence ids [B] (default arange(B)) and flush_index counted per row.
* step: if the committed length h already equals L (left so by accept), flush the committed
  entries first. Append the inputs at slot h; h += 1. If h < L, the output comes from the read
  copy plus the buffer, output-only (no d_v x d_k matrix is formed); GDN computes u of this
  slot against the read copy and caches it for later outputs. If h == L, flush: rebuild the
  unrounded FP32 state S from the dequantized anchor and the L raw entries (GDN: u recomputed
  from the anchor by the triangular solve), output = S q (unrounded), then A <- Q_anchor(S),
  R <- Q_read(S) independently (never Q_read(Q_anchor(S))), flush index += 1, h = 0.
* verify (T drafts, T <= L): rows with h + T > L and h > 0 first flush their h committed entries
  (same rebuild and casts; outputs unaffected), so every verify has T free slots. Drafts go to
  slots h..h+T-1; all T outputs come from the read copy plus the buffer with a causal mask
  (GDN: a T x T forward substitution against the read copy). Nothing committed changes.
* accept(n): h += n per row; rejected slots are ignored and later overwritten. No flush here
  (a row left at h == L flushes at its next step / verify). A flush never folds uncommitted drafts.
  step / verify while drafts are pending is an error: call accept first.
* An empty committed history never touches the anchor (no cast, flush index unchanged).
* Inputs are checked where they enter: a NaN or infinity in q, k, v, log_a or beta of a step
  or verify is one ValueError naming the input, the call (step N of this state: calls of step
  and verify counted together) and the batch
  row, before anything changes (one sum per input and one host read per call,
  `find_nonfinite`). An initial state that overflows an fp16 / bf16 role is refused at
  construction, and a flush whose cast of the rebuilt state into the anchor or read copy is not
  finite (an fp16 role past 65504) is one ValueError at that flush naming layer, batch row,
  step and format (`flush_overflow_error`), before anything changes (one host read per flush):
  it would otherwise give infinite outputs for up to L - 1 steps and then NaN that later
  layers' input checks blame on their inputs. ConventionalState checks each step's cast alike.

Hand-off (teacher forcing, beam reordering, decode stores, other backends): `st.export()` returns
the whole state as a `ScanState` (replayquant.replay.handoff: anchor, read copy, buffer,
counters, state_indices, the pair, seed and layer; its part names also read as keys, ss["anchor"]),
`st.load(ss)` installs one in place (a ScanState, or a dict of its part names) and
`ReplayState.from_parts(ss, pair, delta, seed, layer)` builds a state from one without any cast
(vector-gated when G has a d_k axis). `replayquant.replay.convert` holds the conversions to and
from the decode stores; `replayquant.kernels.chunk.reference.teacher_force` runs a segment through
these.
"""

from __future__ import annotations

import torch

from replayquant.formats import QTensor
from replayquant.policy import resolve_pair
from replayquant.replay import core
from replayquant.replay.handoff import OTHER_NAMES, PART_NAMES, ScanState
from replayquant.streams import ANCHOR, READ, layer_seed, sr_stream

__all__ = ["ReplayState", "ConventionalState", "find_nonfinite", "nonfinite_cast",
           "flush_overflow_error"]


def find_nonfinite(inputs: dict, valid: torch.Tensor | None = None, time_dim: int = 1):
    """None when every tensor of `inputs` ({name: tensor or None}, batch first) is finite, else
    (name, batch row, index along time_dim or None, count of non-finite elements) of the first
    input that is not. The check costs one sum per input and one host read for all of them (a
    sum is finite unless its input holds NaN or infinity, or the sum overflows, which the
    per-input look that follows tells apart). valid [B, T]: only those tokens are checked
    (padding may hold anything; the recurrence skips it)."""
    ts = {}
    for name, t in inputs.items():
        if t is None:
            continue
        if valid is not None and t.dim() > time_dim:
            shape = [1] * t.dim()
            shape[0], shape[time_dim] = valid.shape
            t = torch.where(valid.view(shape), t, torch.zeros((), dtype=t.dtype, device=t.device))
        ts[name] = t
    if not ts:
        return None
    sums = torch.stack([t.sum(dtype=torch.float32) for t in ts.values()])
    if bool(torch.isfinite(sums).all()):
        return None
    for name, t in ts.items():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            first = bad.nonzero()[0].tolist()
            return name, first[0], first[time_dim] if t.dim() > time_dim else None, int(bad.sum())
    return None


def nonfinite_cast(roles, rows=None):
    """None when every dequantized cast of `roles` ((role, spec, X [b, ...]), ...) is finite (in
    the rows where `rows` [b] bool is True, if given), else (role, spec, b) of the first row b
    (and its first role) that is not: one reduction per role and one host read for all."""
    bad = torch.stack([~torch.isfinite(X).flatten(1).all(1) for _, _, X in roles], dim=1)
    if rows is not None:
        bad &= rows[:, None]
    if not bool(bad.any()):
        return None
    b, i = bad.nonzero()[0].tolist()
    return roles[i][0], roles[i][1], b


def flush_overflow_error(layer: int, role: str, spec, pair, row: int, seq: int,
                         at: str) -> ValueError:
    """The error of a flush whose cast of the rebuilt state into `role` ("anchor", "read copy";
    "state" for the conventional baseline) of format `spec` is not finite while its inputs were:
    the state outgrew the format (fp16 past 65504); spec None: the rebuilt state itself is not
    finite (it outgrew FP32). Raised at that flush, before anything changes, because a
    non-finite anchor or read copy would give infinite outputs for up to L - 1 steps and then
    NaN in every later layer, which the next input check would blame on the inputs."""
    grid = None if spec is None else getattr(spec.fmt, "grid", None)
    if grid is not None and grid.max_value < 1e38:            # fp16: a narrower range than FP32
        what = f"the {role} ({spec.format} of pair {pair.label()})"
        why = f"the state rebuilt there is larger than {spec.format} holds ({grid.max_value:g})"
        fix = (f"Give the {role} a wider format (fp32, or bf16, which keeps fp32's range), or "
               f"check the model's activations (the inputs were finite: their size made the "
               f"state this large)")
    else:
        what = (f"the {role} of pair {pair.label()}" if spec is None else
                f"the {role} ({spec.format} of pair {pair.label()})")
        why = "the state rebuilt there is not finite in FP32"
        fix = ("Check the model's activations: the inputs were finite, but their size made the "
               "state exceed FP32's range")
    return ValueError(f"layer {layer}: {what} overflows at the flush of {at}, batch row {row} "
                      f"(sequence {seq}): {why}; the replay state is unchanged. {fix}")


def _overflowed(spec, q: QTensor) -> bool:
    """True where a cast format that overflows to infinity (fp16, bf16: IEEE casts) did."""
    grid = getattr(spec.fmt, "grid", None)
    return bool(grid is not None and grid.ieee_overflow and torch.isinf(q.payload).any())


class _StateBase:
    """Shared construction and input checking."""

    def _setup(self, initial_state, pair, delta, seed, layer, state_indices,
               vector_gate=False) -> torch.Tensor:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
            raise ValueError("initial_state must be a float tensor [B, H, d_v, d_k], got "
                             + (f"shape {tuple(initial_state.shape)}" if isinstance(initial_state, torch.Tensor)
                                else type(initial_state).__name__))
        if not initial_state.is_floating_point():
            raise ValueError(f"initial_state must be floating point, got {initial_state.dtype}")
        if initial_state.numel() == 0:
            raise ValueError(f"initial_state has shape {list(initial_state.shape)}: B, H, d_v and "
                             f"d_k must each be at least 1")
        S0 = initial_state.detach().to(torch.float32).contiguous()
        if not bool(torch.isfinite(S0).all()):
            raise ValueError("initial_state contains NaN or infinity")
        self.pair = resolve_pair(pair, policy=False)
        self.delta = bool(delta)
        if not isinstance(vector_gate, bool):
            raise ValueError(f"vector_gate must be True (one gate per key channel, log_a [B, H, d_k]) "
                             f"or False (one per head, log_a [B, H]), got {vector_gate!r}")
        self.vector_gate = vector_gate
        self.B, self.H, self.d_v, self.d_k = S0.shape
        self.device = S0.device
        if self.H >= 1 << 16:
            raise ValueError(f"initial_state has {self.H} heads; SR streams allow at most 65535")
        if state_indices is None:
            state_indices = torch.arange(self.B, dtype=torch.int64, device=self.device)
        if not isinstance(state_indices, torch.Tensor):
            state_indices = torch.as_tensor(state_indices)
        if state_indices.shape != (self.B,) or state_indices.is_floating_point() \
                or state_indices.dtype == torch.bool:
            raise ValueError(f"state_indices must be an integer tensor [B={self.B}] of sequence "
                             f"ids, got {state_indices.dtype} {tuple(state_indices.shape)}")
        state_indices = state_indices.to(device=self.device, dtype=torch.int64)
        if bool(((state_indices < 0) | (state_indices >= 1 << 24)).any()):
            raise ValueError("state_indices (sequence ids) must lie in [0, 2^24)")
        self.state_indices = state_indices
        self.seed, self.layer = int(seed), int(layer)
        self._key = layer_seed(seed, layer)
        self._pending = None
        self._calls = 0                 # step / verify calls so far (named in input errors)
        return S0

    def _refuse_overflow(self, S0, casts) -> None:
        """Construction: one ValueError when the initial state overflows a role's format
        (casts: (role, spec, QTensor)); the state would otherwise hold infinity from the start."""
        for role, spec, q in casts:
            if q is not None and _overflowed(spec, q):
                grid = spec.fmt.grid
                raise ValueError(
                    f"initial_state overflows the {role} format {spec.format} of pair "
                    f"{self.pair.label()}: its largest magnitude is {float(S0.abs().max()):.6g}, "
                    f"{spec.format} holds at most {grid.max_value:.6g}; give the {role} a wider "
                    f"format (fp32, or fp8 / nvfp4, which carry scales) or scale the state down")

    # -- casts
    def _cast(self, spec, S, flush_index, role, idx=None):
        ids = self.state_indices if idx is None else self.state_indices[idx]
        return spec.fmt.quantize(S, spec.rounding, seed=self._key,
                                 stream=sr_stream(flush_index, role, ids, self.H))

    def _check_casts(self, roles, idx, at: str) -> None:
        """One ValueError (`flush_overflow_error`) when a flush's cast of rows idx is not finite
        (roles: (role, spec, dequantized cast)); one host read."""
        bad = nonfinite_cast(roles)
        if bad is not None:
            role, spec, b = bad
            row = int(idx[b]) if idx is not None else b
            raise flush_overflow_error(self.layer, role, spec, self.pair, row,
                                       int(self.state_indices[row]), at)

    # -- input checks
    def _check(self, q, k, v, log_a, beta, T=None):
        """Validate and return float32 tensors in buffer layout [B,H,T,d] / [B,H,T]."""
        B, H, dk, dv = self.B, self.H, self.d_k, self.d_v
        lead = (B,) if T is None else (B, T)
        what = "step" if T is None else "verify"
        gate = lead + ((H, dk) if self.vector_gate else (H,))
        expect = {"q": lead + (H, dk), "k": lead + (H, dk), "v": lead + (H, dv), "log_a": gate}
        if self.delta:
            if beta is None:
                raise ValueError(f"{what}: beta is required for delta=True (GDN): pass "
                                 f"beta = sigmoid(b) of shape {list(lead + (H,))}")
            expect["beta"] = lead + (H,)
        elif beta is not None:
            raise ValueError(f"{what}: beta must be None for delta=False (Mamba-2)")
        out = []
        for name, t in zip(("q", "k", "v", "log_a", "beta"), (q, k, v, log_a, beta)):
            if name not in expect:
                out.append(None)
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{what}: {name} must be floating point, got {t.dtype}")
            if name == "log_a" and tuple(t.shape) != gate:
                other = lead + ((H,) if self.vector_gate else (H, dk))
                kind = ("vector_gate=True (one gate per key channel)" if self.vector_gate
                        else "vector_gate=False (one gate per head)")
                hint = ("; for one gate per head build the state with vector_gate=False" if self.vector_gate
                        else "; for per-channel gates (Kimi Delta Attention) build the state with "
                             "vector_gate=True") if tuple(t.shape) == other else ""
                raise ValueError(f"{what}: log_a has shape {list(t.shape)}, expected {list(gate)}: "
                                 f"this state was built with {kind}{hint}")
            if tuple(t.shape) != expect[name]:
                raise ValueError(f"{what}: {name} has shape {list(t.shape)}, expected "
                                 f"{list(expect[name])} ({'[B, T, H, ...]' if T else '[B, H, ...]'}, "
                                 f"B={B}, H={H}, d_k={dk}, d_v={dv})")
            if t.device != self.device:
                raise ValueError(f"{what}: {name} is on {t.device}, the state on {self.device}")
            t = t.to(torch.float32)
            if T is None:
                t = t.unsqueeze(1)
            out.append(t.transpose(1, 2).contiguous())      # [B, H, T, ...]
        bad = find_nonfinite(dict(zip(("q", "k", "v", "log_a", "beta"), out)), time_dim=2)
        if bad is not None:
            name, row, t, n = bad
            n_call = self._calls + 1
            at = (f"step {n_call} of this state" if T is None else
                  f"verify {n_call} of this state, draft index {t}")
            raise ValueError(
                f"{at}: input {name} holds NaN or infinity ({n} element(s), first in "
                f"batch row {row}); nothing was changed. The inputs come from the model's "
                f"activations: find where they first become non-finite (e.g. a float16 overflow)")
        return out

    def _verify_len(self, q):
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("verify: q must be a tensor [B, T, H, d_k]")
        return q.shape[1]

    def _check_accept(self, n):
        if self._pending is None:
            raise ValueError("accept: no drafts pending; call verify first")
        T = self._pending_T
        if isinstance(n, int) and not isinstance(n, bool):
            n = torch.full((self.B,), n, dtype=torch.int64, device=self.device)
        if not isinstance(n, torch.Tensor) or n.is_floating_point() or n.dtype == torch.bool:
            raise ValueError(f"accept: n must be an int or an integer tensor [B={self.B}]")
        n = n.to(device=self.device, dtype=torch.int64).reshape(-1)
        if n.shape != (self.B,):
            raise ValueError(f"accept: n has {n.numel()} entries, expected B={self.B}")
        if bool(((n < 0) | (n > T)).any()):
            raise ValueError(f"accept: every n must lie in 0..T={T}, got {n.tolist()}")
        return n

    def _no_pending(self, what):
        if self._pending is not None:
            raise ValueError(f"{what}: {self._pending_T} drafts are pending; call accept(n) first")


class ReplayState(_StateBase):
    """Dual-precision replay state of one layer: anchor, read copy, replay buffer (module doc)."""

    def __init__(self, initial_state, pair, delta: bool, seed: int = 0, layer: int = 0,
                 state_indices=None,
                 *, vector_gate: bool = False):
        S0 = self._setup(initial_state, pair, delta, seed, layer, state_indices, vector_gate)
        B, H, dv, dk, buffer_len = self.B, self.H, self.d_v, self.d_k, self.pair.buffer_len
        self.buffer_len = buffer_len
        dev = self.device
        self._committed = torch.zeros(B, dtype=torch.int64, device=dev)
        self._n_flush = torch.zeros(B, dtype=torch.int64, device=dev)
        self._k = torch.zeros(B, H, buffer_len, dk, device=dev)
        self._v = torch.zeros(B, H, buffer_len, dv, device=dev)
        self._G = torch.zeros((B, H, buffer_len, dk) if self.vector_gate else (B, H, buffer_len), device=dev)
        self._beta = torch.zeros(B, H, buffer_len, device=dev) if self.delta else None
        self._u = torch.zeros(B, H, buffer_len, dv, device=dev) if self.delta else None
        self._A = self._cast(self.pair.anchor, S0, 0, ANCHOR)
        self._R = None if self.pair.shared else self._cast(self.pair.read, S0, 0, READ)
        self._refuse_overflow(S0, (("anchor", self.pair.anchor, self._A),
                                   ("read copy", self.pair.read, self._R)))
        # decoded read copy: what non-flush steps read (a GPU kernel decodes the packed copy
        # on the fly); kept in sync with the packed copy at every cast.
        self._R32 = self.pair.read_spec.fmt.dequantize(self._R if self._R is not None else self._A)

    # ---------------------------------------------------------------- public
    @property
    def committed(self) -> torch.Tensor:
        """int64 [B]: committed buffer entries per row (0..L)."""
        return self._committed.clone()

    @property
    def n_flush(self) -> torch.Tensor:
        """int64 [B]: flush index of the current anchor per row (0 = the initial cast)."""
        return self._n_flush.clone()

    flushes = n_flush       # the property's public name before n_flush, kept for its callers

    @property
    def anchor_q(self) -> QTensor:
        """The packed anchor (do not modify)."""
        return self._A

    @property
    def read_q(self) -> QTensor:
        """The packed read copy (the anchor itself for a shared pair; do not modify)."""
        return self._A if self._R is None else self._R

    @property
    def buffer(self) -> dict:
        """Views of the replay buffer (layout in replayquant.replay.core): k, v, G (cumulative
        log gate, [B, H, L] or [B, H, L, d_k] for vector gates), and for GDN beta and u (u
        computed against the read copy)."""
        out = {"k": self._k, "v": self._v, "G": self._G}
        if self.delta:
            out.update(beta=self._beta, u=self._u)
        return out

    def anchor(self) -> torch.Tensor:
        """Dequantized anchor, float32 [B, H, d_v, d_k]."""
        return self.pair.anchor.fmt.dequantize(self._A)

    def read_copy(self) -> torch.Tensor:
        """Dequantized read copy, float32 [B, H, d_v, d_k] (the anchor for a shared pair)."""
        return self.pair.read_spec.fmt.dequantize(self.read_q)

    def current_state(self) -> torch.Tensor:
        """Unrounded FP32 state after the committed entries: deq(A) replayed through the buffer
        (what a flush now would cast). Changes nothing."""
        S, _ = core.rebuild(self.anchor(), self._k, self._v, self._G, self._beta, self._committed)
        return S

    # ---------------------------------------------------------------- hand-off
    PART_NAMES = PART_NAMES

    def export(self) -> ScanState:
        """The whole state as a `ScanState` (the tensors themselves, no copy: treat them as
        read-only; layout in replayquant.replay.core and replay.handoff): anchor, read copy
        (None for a shared pair), the buffer k, v, G and, for GDN / KDA, beta and u (u against
        the read copy), committed entries and flush index per row, state_indices (the int64 sequence ids
        keying the SR streams), and this state's pair, seed and layer. Slots >= committed are
        ignored. Raises ValueError while drafts are pending."""
        if self._pending is not None:
            raise ValueError("the ReplayState has pending drafts; call accept(n) before export()")
        return ScanState(anchor=self._A, read=self._R, k=self._k, v=self._v, G=self._G,
                         beta=self._beta, committed=self._committed, n_flush=self._n_flush,
                         state_indices=self.state_indices, u=self._u, pair=self.pair, seed=self.seed,
                         layer=self.layer)

    def load(self, parts) -> None:
        """Make this state hold a copy of `parts` (a ScanState, as `export` returns it, or a dict
        of its part names, PART_NAMES; in place). B, H, d_v, d_k and the pair stay those of this
        state; `state_indices` is optional (default: keep), `u` is optional for GDN (default: recomputed
        from the read copy and the buffer, as the read steps would have computed it). Pending
        drafts are dropped. Bad parts raise one ValueError naming the part."""
        parts = self._check_parts(parts)
        buffer_len, dev = self.buffer_len, self.device
        # copies: the state writes its anchor and buffer in place, parts must not alias them
        self._A = core.qt_clone(parts["anchor"])
        self._R = None if parts["read"] is None else core.qt_clone(parts["read"])
        self._R32 = self.pair.read_spec.fmt.dequantize(self.read_q)
        f32 = torch.float32
        self._k = parts["k"].to(device=dev, dtype=f32).clone()
        self._v = parts["v"].to(device=dev, dtype=f32).clone()
        self._G = parts["G"].to(device=dev, dtype=f32).clone()
        self._committed = parts["committed"].to(device=dev, dtype=torch.int64).clone()
        self._n_flush = parts["n_flush"].to(device=dev, dtype=torch.int64).clone()
        if parts.get("state_indices") is not None:
            self.state_indices = parts["state_indices"].to(device=dev, dtype=torch.int64).clone()
        self._beta = self._u = None
        if self.delta:
            self._beta = parts["beta"].to(device=dev, dtype=f32).clone()
            if parts.get("u") is not None:
                self._u = parts["u"].to(device=dev, dtype=f32).clone()
            else:
                valid = core.committed_mask(self._committed, buffer_len)
                self._u = core.solve_u(self._R32, self._k, self._v, self._G, self._beta, valid)
        self._pending = None

    @classmethod
    def from_parts(cls, parts, pair, delta: bool, seed: int = 0, layer: int = 0) -> "ReplayState":
        """A ReplayState holding `parts` (a ScanState, as `export` returns it, or a dict of its
        part names; `state_indices` optional, default arange(B)), without any cast: B, H, d_v, d_k come
        from the anchor's shape, vector_gate from parts['G'] (4 dimensions [B, H, L, d_k]:
        vector gates; 3: one gate per head)."""
        anchor = parts.get("anchor") if isinstance(parts, (dict, ScanState)) else None
        if not isinstance(anchor, QTensor) or len(anchor.shape) != 4:
            raise ValueError("parts['anchor'] must be a QTensor of shape [B, H, d_v, d_k] "
                             "(pass the ScanState ReplayState.export() returns)")
        G = parts.get("G")
        st = cls.__new__(cls)
        st._setup(torch.zeros(anchor.shape, device=anchor.device), pair, delta, seed, layer,
                  parts.get("state_indices"), isinstance(G, torch.Tensor) and G.dim() == 4)
        st.buffer_len = st.pair.buffer_len
        st.load(parts)
        return st

    def _check_parts(self, parts) -> dict:
        """The parts as a dict of PART_NAMES, after one ValueError for any that is wrong."""
        if isinstance(parts, ScanState):
            parts = dict(parts.items())
        if isinstance(parts, dict):
            parts = {OTHER_NAMES.get(n, n): t for n, t in parts.items()}
        if not isinstance(parts, dict):
            raise ValueError(f"parts must be a ScanState (as ReplayState.export() returns) or a "
                             f"dict of its parts, got {type(parts).__name__}")
        unknown = sorted(set(parts) - set(self.PART_NAMES))
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}; a state has {', '.join(self.PART_NAMES)}")
        B, H, dv, dk, buffer_len = self.B, self.H, self.d_v, self.d_k, self.buffer_len
        shape = (B, H, dv, dk)
        for role, spec, q in (("anchor", self.pair.anchor, parts.get("anchor")),
                              ("read", self.pair.read, parts.get("read"))):
            if spec is None:
                if q is not None:
                    raise ValueError(f"the pair {self.pair.label()} is shared: parts['read'] must be None")
                continue
            if not isinstance(q, QTensor):
                raise ValueError(f"parts[{role!r}] must be a QTensor of format {spec.format}")
            if q.format != spec.format or tuple(q.shape) != shape:
                raise ValueError(f"parts[{role!r}] is {q.format} {list(q.shape)}, the pair "
                                 f"{self.pair.label()} needs {spec.format} {list(shape)}")
        need = {"k": (B, H, buffer_len, dk), "v": (B, H, buffer_len, dv),
                "G": (B, H, buffer_len, dk) if self.vector_gate else (B, H, buffer_len), "committed": (B,),
                "n_flush": (B,)}
        if self.delta:
            need["beta"] = (B, H, buffer_len)
            if parts.get("u") is not None:
                need["u"] = (B, H, buffer_len, dv)
        elif parts.get("beta") is not None or parts.get("u") is not None:
            raise ValueError("a Mamba-2 state (delta=False) has no beta / u parts: pass None")
        if parts.get("state_indices") is not None:
            need["state_indices"] = (B,)
        for name, shp in need.items():
            t = parts.get(name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shp:
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"parts[{name!r}] must be a tensor {list(shp)} (B={B}, H={H}, "
                                 f"L={buffer_len}, d_k={dk}, d_v={dv}), got {got}")
        for name in ("committed", "n_flush", "state_indices"):
            t = parts.get(name)
            if t is not None and (t.is_floating_point() or t.dtype == torch.bool):
                raise ValueError(f"parts[{name!r}] must be an integer tensor, got {t.dtype}")
        c = parts["committed"]
        if bool(((c < 0) | (c > buffer_len)).any()):
            raise ValueError(f"parts['committed'] must lie in 0..L={buffer_len}, got {c.tolist()}")
        return parts

    def step(self, q, k, v, log_a, beta=None) -> torch.Tensor:
        """One decode step -> y float32 [B, H, d_v] (module doc for the exact semantics)."""
        self._no_pending("step")
        q, k, v, log_a, beta = self._check(q, k, v, log_a, beta)
        at = f"step {self._calls + 1} of this state"
        y = self._append(q, k, v, log_a, beta, at)        # [B,H,1,dv], pre-flush included
        full = self._committed + 1 == self.buffer_len
        if bool(full.any()):
            idx = full.nonzero()[:, 0]
            S = self._flush(idx, self._committed[idx] + 1, at)    # an overflow raises: nothing changed
            y[idx] = core.matvec(S, q[idx])
        self._committed += (~full).long()                         # flushed rows are at 0
        self._calls += 1
        return y[:, :, 0, :]

    def verify(self, q, k, v, log_a, beta=None) -> torch.Tensor:
        """Outputs of T draft steps [B, T, H, d_v]; inputs [B, T, H, ...]. Then call accept(n)."""
        self._no_pending("verify")
        T = self._verify_len(q)
        if T < 1 or T > self.buffer_len:
            raise ValueError(f"verify: T={T} drafts, but 1 <= T <= buffer_len={self.buffer_len} is required; "
                             f"use a pair with a longer buffer or fewer drafts")
        q, k, v, log_a, beta = self._check(q, k, v, log_a, beta, T=T)
        y = self._append(q, k, v, log_a, beta, f"verify {self._calls + 1} of this state")
        self._calls += 1
        self._pending, self._pending_T = True, T
        return y.transpose(1, 2).contiguous()

    def accept(self, n) -> None:
        """Commit the first n[b] drafts of each row (int or int tensor [B], 0..T)."""
        n = self._check_accept(n)
        self._committed += n
        self._pending = None

    # ---------------------------------------------------------------- internals
    def _append(self, q, k, v, log_a, beta, at: str):
        T = q.shape[2]
        need = (self._committed + T > self.buffer_len) & (self._committed > 0)
        if bool(need.any()):
            idx = need.nonzero()[:, 0]
            self._flush(idx, self._committed[idx], at)
        h = self._committed
        Gprev = torch.where((h > 0).view(-1, *([1] * (self._G.dim() - 2))),
                            core._gather_slot(self._G, (h - 1).clamp(min=0)),
                            torch.zeros((), device=self.device))
        for i in range(T):
            p = h + i
            Gprev = Gprev + log_a[:, :, i]
            core._scatter_slot(self._G, p, Gprev)
            core._scatter_slot(self._k, p, k[:, :, i])
            core._scatter_slot(self._v, p, v[:, :, i])
            if self.delta:
                core._scatter_slot(self._beta, p, beta[:, :, i])
        return core.read_outputs(self._R32, self._k, self._v, self._G, self._beta, self._u, h, q)

    def _flush(self, idx, n, at: str):
        """Flush rows idx over their first n entries; returns the unrounded S of those rows. A
        cast that is not finite (`flush_overflow_error`, naming `at`) raises before anything
        changes."""
        B, pair = self.B, self.pair
        Sc = pair.anchor.fmt.dequantize(core.qt_take(self._A, idx, B))
        beta = None if self._beta is None else self._beta[idx]
        S, _ = core.rebuild(Sc, self._k[idx], self._v[idx], self._G[idx], beta, n)
        fi = self._n_flush[idx] + 1
        try:
            A = self._cast(pair.anchor, S, fi, ANCHOR, idx)
            R = None if self._R is None else self._cast(pair.read, S, fi, READ, idx)
        except ValueError:                                # a cast refuses a non-finite S
            self._check_casts((("rebuilt state", None, S),), idx, at)
            raise
        A32 = pair.anchor.fmt.dequantize(A)
        R32 = A32 if R is None else pair.read.fmt.dequantize(R)
        roles = (("anchor", pair.anchor, A32),)
        if R is not None:
            roles += (("read copy", pair.read, R32),)
        self._check_casts(roles, idx, at)
        core.qt_put(self._A, idx, A, B)
        if R is not None:
            core.qt_put(self._R, idx, R, B)
        self._R32[idx] = R32
        self._n_flush[idx] = fi
        self._committed[idx] = 0
        return S


class ConventionalState(_StateBase):
    """The baseline serving engines run: one state in one format, read-modify-write every step,
    S_t = Q(a_t deq(S_{t-1}) + u_t k_t^T) (GDN: u_t = beta_t (v_t - a_t deq(S_{t-1}) k_t); with
    vector_gate=True, deq(S_{t-1}) Diag(a_t) in place of a_t deq(S_{t-1})), output from the
    unrounded S_t. Equal, bit for bit, to ReplayState with L = 1 and the same
    shared pair (same SR streams: the cast after step n uses flush index n, role ANCHOR).

    The pair must be shared; its buffer_len is ignored. Speculation as vLLM does it: verify runs
    the T drafts sequentially and keeps a packed snapshot of the state after each draft
    (T extra states per sequence); accept(n) restores snapshot n (n = 0: the state before).
    """

    def __init__(self, initial_state, pair, delta: bool, seed: int = 0, layer: int = 0,
                 state_indices=None,
                 *, vector_gate: bool = False):
        S0 = self._setup(initial_state, pair, delta, seed, layer, state_indices, vector_gate)
        if not self.pair.shared:
            raise ValueError(f"ConventionalState needs a shared pair (one format), got read="
                             f"{self.pair.read} anchor={self.pair.anchor}; use ReplayState for "
                             f"dual-precision pairs")
        self.spec = self.pair.anchor
        self._n_flush = torch.zeros(self.B, dtype=torch.int64, device=self.device)
        self._S = self._cast(self.spec, S0, 0, ANCHOR)
        self._refuse_overflow(S0, (("state", self.spec, self._S),))

    @property
    def committed(self) -> torch.Tensor:
        """Always zeros [B]: there is no buffer."""
        return torch.zeros(self.B, dtype=torch.int64, device=self.device)

    @property
    def n_flush(self) -> torch.Tensor:
        """int64 [B]: committed steps per row (each step is a cast, the flush of a shared pair
        with L = 1)."""
        return self._n_flush.clone()

    flushes = n_flush       # the property's public name before n_flush, kept for its callers

    @property
    def anchor_q(self) -> QTensor:
        return self._S

    read_q = anchor_q

    def anchor(self) -> torch.Tensor:
        return self.spec.fmt.dequantize(self._S)

    read_copy = anchor
    current_state = anchor

    def _advance(self, Sq, steps, q, k, v, log_a, beta, i, at: str):
        """One read-modify-write step on draft/step i of the [B,H,T,...] inputs; a cast that is
        not finite raises (`flush_overflow_error`, naming `at`)."""
        sl = slice(i, i + 1)
        Sc = self.spec.fmt.dequantize(Sq)
        ones = torch.ones(self.B, dtype=torch.int64, device=self.device)
        S, _ = core.rebuild(Sc, k[:, :, sl], v[:, :, sl], log_a[:, :, sl],
                            None if beta is None else beta[:, :, sl], ones)
        y = core.matvec(S, q[:, :, sl])[:, :, 0, :]
        try:
            Snew = self._cast(self.spec, S, steps + 1, ANCHOR)
        except ValueError:                                # the cast refuses a non-finite S
            self._check_casts((("rebuilt state", None, S),), None, at)
            raise
        self._check_casts((("state", self.spec, self.spec.fmt.dequantize(Snew)),), None, at)
        return y, Snew

    def step(self, q, k, v, log_a, beta=None) -> torch.Tensor:
        self._no_pending("step")
        q, k, v, log_a, beta = self._check(q, k, v, log_a, beta)
        y, self._S = self._advance(self._S, self._n_flush, q, k, v, log_a, beta, 0,
                                   f"step {self._calls + 1} of this state")
        self._calls += 1
        self._n_flush += 1
        return y

    def verify(self, q, k, v, log_a, beta=None) -> torch.Tensor:
        self._no_pending("verify")
        T = self._verify_len(q)
        if T < 1:
            raise ValueError("verify: needs at least one draft (T >= 1)")
        q, k, v, log_a, beta = self._check(q, k, v, log_a, beta, T=T)
        snaps, ys, Sq = [], [], self._S
        for i in range(T):
            y, Sq = self._advance(Sq, self._n_flush + i, q, k, v, log_a, beta, i,
                                  f"verify {self._calls + 1} of this state, draft index {i}")
            ys.append(y)
            snaps.append(Sq)
        self._calls += 1
        self._pending, self._pending_T = snaps, T
        return torch.stack(ys, dim=1)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by pending per-draft snapshots (0 when none are pending)."""
        return 0 if self._pending is None else sum(s.nbytes for s in self._pending)

    def accept(self, n) -> None:
        n = self._check_accept(n)
        for j in range(1, self._pending_T + 1):
            idx = (n == j).nonzero()[:, 0]
            if len(idx):
                core.qt_put(self._S, idx, core.qt_take(self._pending[j - 1], idx, self.B), self.B)
        self._n_flush += n
        self._pending = None
