"""Drift report: how far each precision pair's outputs and anchor wander from the unrounded FP32
recurrence over a long random-input decode.

    replayquant drift --kind gdn --pair s32_rs --pair tp4_hi16_sr --steps 4096 --seeds 42,43,44

Kinds: gdn (Gated DeltaNet: scalar decay per head), kda (Kimi Delta Attention: the same delta
rule with a decay per key channel) and mamba2 (no delta correction).

Protocol (one run = one kind, one seed; every pair sees the same inputs):

* shapes: B sequences (default 2), H heads (default 4), d_k x d_v state per head (default 64 x 32),
  zero initial state; `steps` decode steps, one `step` call each (no speculation).
* decay (GDN) a_t ~ U[0.9, 1) per (sequence, head, step): log_a = log a_t.
* GDN: q, k, v ~ N(0, 1), b ~ N(0, 1); through `gdn_inputs` (q, k L2-normalised, q scaled by
  1/sqrt(d_k), beta = sigmoid(b), log_a = g = log a_t).
* KDA: q, k, v, b as GDN; the decay is per key channel, with rates spread from channels that
  forget within a step to channels that hold about a thousand: each (sequence, head, channel)
  draws a rate r log-uniform in [1e-3, 1] once, and each step scales it by U[0.5, 1.5], so
  log a_t = -r * U[0.5, 1.5] (a_t from about 0.22 to 0.9995); through `kda_inputs` (q, k
  L2-normalised as transformers' KDA, q scaled by 1/sqrt(d_k), beta = sigmoid(b)), states
  with vector_gate=True.
* Mamba-2: x ~ N(0, 1); dt_t ~ U[0.01, 0.1]; A_h = -log(a_t)/dt_t would vary per step, so instead
  A_h ~ -U[0.5, 1.05] per head and a_t = exp(dt_t A_h) (so a_t in [0.9, 1)); B ~ N(0, 1) then
  L2-normalised over N (one group), C ~ N(0, 1/N); through `mamba2_inputs` (v = dt x, k = B, q = C).
* reference: `recurrent_reference` (sequential FP32, no rounding) on the same inputs.
* each pair runs as `ReplayState(zeros, pair, seed=seed)` (mode "replay", its own buffer_len);
  a shared pair also runs as `ConventionalState` (mode "conventional": read-modify-write every
  step, what serving engines do) unless disabled.
* metrics: output RMSE over all steps, sequences, heads and d_v; anchor RMSE of the dequantized
  anchor against the reference state at the step of the anchor's last flush (`checkpoints`: also
  at steps ~N/8, N/4, ... multiples of L); relative versions divide by the reference RMS.
  Across seeds: mean and sample standard deviation (ddof = 1).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Table

from replayquant.formats.report import check_dims
from replayquant.memory import check_fits
from replayquant.outputs import check_out_folder, check_owned, output_lock, write_json, write_text
from replayquant.pairs import PrecisionPair, list_pairs
from replayquant.provenance import provenance
from replayquant.replay import (ConventionalState, ReplayState, gdn_inputs, kda_inputs,
                                mamba2_inputs, recurrent_reference)

KINDS = ("gdn", "kda", "mamba2")
DEFAULT_SHAPE = {"batch": 2, "heads": 4, "d_k": 64, "d_v": 32}


def make_inputs(kind: str, steps: int, seed: int, batch: int, heads: int, d_k: int, d_v: int):
    """Inputs of the protocol (module doc) -> (q, k, v, log_a, beta) [B, T, H, ...]."""
    g = torch.Generator().manual_seed(int(seed))
    B, T, H = batch, steps, heads
    if kind == "gdn":
        q = torch.randn(B, T, H, d_k, generator=g)
        k = torch.randn(B, T, H, d_k, generator=g)
        v = torch.randn(B, T, H, d_v, generator=g)
        b = torch.randn(B, T, H, generator=g)
        a = 0.9 + 0.1 * torch.rand(B, T, H, generator=g)
        return gdn_inputs(q, k, v, torch.log(a), b)
    if kind == "kda":
        q = torch.randn(B, T, H, d_k, generator=g)
        k = torch.randn(B, T, H, d_k, generator=g)
        v = torch.randn(B, T, H, d_v, generator=g)
        b = torch.randn(B, T, H, generator=g)
        rate = torch.exp(math.log(1e-3) * torch.rand(B, 1, H, d_k, generator=g))
        log_a = -rate * (0.5 + torch.rand(B, T, H, d_k, generator=g))
        return kda_inputs(q, k, v, log_a, b)
    if kind == "mamba2":
        x = torch.randn(B, T, H, d_v, generator=g)
        dt = 0.01 + 0.09 * torch.rand(B, T, H, generator=g)
        A = -(0.5 + 0.55 * torch.rand(H, generator=g))
        Bm = torch.nn.functional.normalize(torch.randn(B, T, 1, d_k, generator=g), dim=-1)
        Cm = torch.randn(B, T, 1, d_k, generator=g) / math.sqrt(d_k)
        q, k, v, log_a = mamba2_inputs(x, dt, A, Bm, Cm, dt_softplus=False)
        return q, k, v, log_a, None
    raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")


def _checkpoints(steps: int, L: int) -> list[int]:
    """Steps at which the anchor is compared: ~steps/8, /4, /2 and the last flush (multiples of L)."""
    pts = {(steps // d) // L * L for d in (8, 4, 2, 1)}
    return sorted(p for p in pts if p > 0)


def _reference_states(S0, inp, points):
    """Reference outputs [B,T,H,d_v] and states {step: S} at the requested steps."""
    ys, states, S, t = [], {0: S0}, S0, 0
    for p in sorted(set(points)):
        if p > t:
            Y, S = recurrent_reference(S, *(None if x is None else x[:, t:p] for x in inp))
            ys.append(Y)
            t = p
        states[p] = S
    T = inp[0].shape[1]
    if t < T:
        Y, S = recurrent_reference(S, *(None if x is None else x[:, t:T] for x in inp))
        ys.append(Y)
    return torch.cat(ys, dim=1), states


def _rms(x):
    return float(x.pow(2).mean().sqrt())


def run_one(kind, pair: PrecisionPair, mode: str, inp, S0, seed, ref_Y, ref_states, steps,
            advance=None):
    """One run's errors against the reference; `advance(n)`, if given, is told of every
    `_ADVANCE_EVERY` steps done (the progress bar)."""
    delta = kind != "mamba2"
    cls = ReplayState if mode == "replay" else ConventionalState
    L = pair.buffer_len if mode == "replay" else 1
    st = cls(S0, pair, delta=delta, seed=seed, vector_gate=kind == "kda")
    q, k, v, la, beta = inp
    pts = _checkpoints(steps, L)
    ys, anchors, told = [], {}, 0
    for t in range(steps):
        ys.append(st.step(q[:, t], k[:, t], v[:, t], la[:, t], None if beta is None else beta[:, t]))
        if t + 1 in pts:
            anchors[t + 1] = st.anchor()
        if advance is not None and ((t + 1) % _ADVANCE_EVERY == 0 or t + 1 == steps):
            advance(t + 1 - told)
            told = t + 1
    Y = torch.stack(ys, dim=1)
    err = Y - ref_Y
    last = pts[-1]
    out = {
        "output_rmse": _rms(err), "output_rel_rmse": _rms(err) / _rms(ref_Y),
        "anchor_rmse": _rms(anchors[last] - ref_states[last]),
        "anchor_rel_rmse": _rms(anchors[last] - ref_states[last]) / _rms(ref_states[last]),
        "anchor_step": last,
        "anchor_rmse_at": {str(p): _rms(anchors[p] - ref_states[p]) for p in pts},
    }
    if not all(math.isfinite(v) for v in (out["output_rmse"], out["anchor_rmse"])):
        out["diverged"] = True
    return out


def _stats(vals):
    vals = [float(v) for v in vals]
    n = len(vals)
    mean = sum(vals) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1)) if n > 1 else float("nan")
    return {"mean": mean, "std": std, "n": n}


def run_drift(kind: str, pairs, steps: int = 4096, seeds=(42, 43, 44), batch: int = 2,
              heads: int = 4, d_k: int = 64, d_v: int = 32, conventional: bool = True,
              progress: bool = False) -> dict:
    """Run the protocol; returns the results dict (with provenance) that `write_drift` saves.
    progress: a progress bar on stderr over every decode step of every run and seed (the default
    command runs about an hour), each finished run's errors printed above it."""
    seeds = _check_settings(kind, steps, seeds, batch, heads, d_k, d_v)
    pairs = _load_pairs(pairs, d_k)
    runs = _runs(pairs, conventional, steps)
    extra_gate = 2 * d_k if kind == "kda" else 0      # KDA's per-channel decay and its rates
    check_fits(4.0 * batch * steps * heads * (4 * d_k + 7 * d_v + 4 + extra_gate),
               f"a drift of {steps} steps ({batch} x {heads} heads, {d_v} x {d_k} state: its "
               f"inputs, the reference's outputs and one pair's)",
               "give fewer --steps or smaller --batch / --heads / --d-k / --d-v", "cpu")
    t0 = time.time()
    with _Bar(progress, len(seeds) * len(runs) * steps, f"drift {kind}") as bar:
        per = _measure(kind, runs, seeds, steps, batch, heads, d_k, d_v, bar, t0)
    rows = [_row(p, mode, per[i]) for i, (p, mode) in enumerate(runs)]
    params = {"kind": kind, "steps": steps, "seeds": seeds, "batch": batch, "heads": heads,
              "d_k": d_k, "d_v": d_v, "protocol": "replayquant.drift module docstring",
              "wall_s": round(time.time() - t0, 1)}
    return {"kind": DRIFT_KIND, "provenance": provenance(device="cpu", **params), "params": params,
            "rows": rows}


def _check_settings(kind: str, steps: int, seeds, batch: int, heads: int, d_k: int, d_v: int) -> list[int]:
    """The seeds as ints; a kind, step count, seed list or size no drift can use is one ValueError."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("give at least one seed")
    again = sorted({s for s in seeds if seeds.count(s) > 1})
    if again:
        raise ValueError(f"seed(s) {', '.join(map(str, again))} given more than once: a repeated "
                         f"seed repeats the same run, and its spread over seeds would read 0; "
                         f"give each seed once")
    check_dims({"--batch": batch, "--heads": heads, "--d-k": d_k, "--d-v": d_v})
    if heads >= 1 << 16:
        raise ValueError(f"--heads {heads}: the SR streams allow at most 65535 heads")
    return seeds


def _load_pairs(pairs, d_k: int) -> list[PrecisionPair]:
    """The pairs (names or PrecisionPairs; none: every shipped pair), each once, and each that
    stores NVFP4 with a d_k NVFP4's blocks divide."""
    pairs = [p if isinstance(p, PrecisionPair) else PrecisionPair.load(p) for p in (pairs or list_pairs())]
    labels = [p.label() for p in pairs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"pair(s) {', '.join(dup)} given more than once; give each --pair once")
    for p in pairs:
        if "nvfp4" in (p.anchor.format, p.read_spec.format):
            try:
                check_dims({}, {"--d-k": d_k})
            except ValueError as e:
                raise ValueError(f"{p.label()} stores NVFP4: {e}; choose another --d-k or leave "
                                 f"that pair out") from None
    return pairs


def _runs(pairs: list[PrecisionPair], conventional: bool, steps: int) -> list[tuple[PrecisionPair, str]]:
    """(pair, mode) of every run: replay for each pair, and conventional for a shared-format pair
    when `conventional`; one ValueError when no output step of a run reads a flushed state:
    the first flush is step L (1-based; its output comes from the unrounded state), so the
    outputs measure the anchor and read copy only from step L + 1 on."""
    runs = []
    for p in pairs:
        runs.append((p, "replay"))
        if conventional and p.shared:
            runs.append((p, "conventional"))
    for p, mode in runs:
        L = p.buffer_len if mode == "replay" else 1
        if steps <= L:
            raise ValueError(f"steps={steps} is not more than {p.label()}'s buffer_len {L} "
                             f"({mode}): the first flush is step {L}, and no output step after "
                             f"it would read the flushed state, so the output error would "
                             f"measure no rounding; give --steps {L + 1} or more")
    return runs


# steps between two updates of the progress bar (an update per step would cost more than a
# drift step of the default shape)
_ADVANCE_EVERY = 64


class _Bar:
    """A rich progress bar on stderr over `total` decode steps, with the time left; lines printed
    through `say` go above it. Disabled: nothing is shown."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.p = None
        if enabled:
            self.p = Progress(TextColumn("{task.description}"), BarColumn(),
                              MofNCompleteColumn(), TextColumn("steps"), TimeElapsedColumn(),
                              TextColumn("left"), TimeRemainingColumn(),
                              console=Console(stderr=True))
            self.task = self.p.add_task(label, total=total)

    def __enter__(self):
        if self.p is not None:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self.p is not None:
            self.p.__exit__(*exc)

    def advance(self, n: int) -> None:
        if self.p is not None:
            self.p.advance(self.task, n)

    def say(self, line: str) -> None:
        if self.p is not None:
            self.p.console.print(line, markup=False, highlight=False)


def _measure(kind: str, runs: list, seeds: list[int], steps: int, batch: int, heads: int, d_k: int,
             d_v: int, bar: _Bar, t0: float) -> dict[int, list[dict]]:
    """Per run (by its index in `runs`), its `run_one` result for each seed, in seed order; each
    seed's inputs and reference states are made once and serve every run."""
    per = {i: [] for i in range(len(runs))}
    S0 = torch.zeros(batch, heads, d_v, d_k)
    for seed in seeds:
        inp = make_inputs(kind, steps, seed, batch, heads, d_k, d_v)
        pts = {0}
        for p, mode in runs:
            pts.update(_checkpoints(steps, p.buffer_len if mode == "replay" else 1))
        ref_Y, ref_states = _reference_states(S0, inp, pts)
        for i, (p, mode) in enumerate(runs):
            r = run_one(kind, p, mode, inp, S0, seed, ref_Y, ref_states, steps, bar.advance)
            r["seed"] = seed
            per[i].append(r)
            bar.say(f"{kind} seed {seed} {p.label()} {mode}: out {r['output_rel_rmse']:.3g} "
                    f"anchor {r['anchor_rel_rmse']:.3g} ({time.time() - t0:.0f}s)")
    return per


def _row(p: PrecisionPair, mode: str, rs: list[dict]) -> dict:
    """One run's row of the results: the pair, mode and format, each error's mean and spread over
    seeds, and the per-seed results `rs`."""
    return {
        "pair": p.label(), "mode": mode, "config": p.to_dict(),
        "buffer_len": p.buffer_len if mode == "replay" else 1,
        "read": "(shared)" if p.shared else str(p.read), "anchor": str(p.anchor),
        **{m: _stats([r[m] for r in rs]) for m in
           ("output_rmse", "output_rel_rmse", "anchor_rmse", "anchor_rel_rmse")},
        "per_seed": rs,
    }


DRIFT_KIND = "replayquant.drift"     # the "kind" of a drift results file


def _is_drift(old: dict) -> bool:
    """A drift results file written before they carried a "kind"."""
    return isinstance(old.get("params"), dict) and "rows" in old and \
        old["params"].get("protocol") == "replayquant.drift module docstring"


def drift_out_path(out_dir, kind: str, steps: int, name: str | None = None) -> Path:
    """Where `write_drift` writes (OUT/KIND_NsSteps.json and .md), checked before any work: the
    folder is not a file and can be written (created if missing), neither target is a folder,
    and the JSON there, if any, is drift results (`replayquant.outputs.check_owned`; the .md is
    replaced only with it). One ValueError saying what to give instead."""
    out = check_out_folder(out_dir, "drift writes KIND_NsSteps.json and .md")
    path = out / f"{name or kind + '_' + str(steps) + 'steps'}.json"
    for target in (path, path.with_suffix(".md")):
        if target.is_dir():
            raise ValueError(f"--out {out}: {target} is a folder; move it away or give another --out")
    check_owned(path, DRIFT_KIND, "replayquant drift", beside=(path.with_suffix(".md"),),
                unkinded=_is_drift)
    return path


def write_drift(result: dict, out_dir="build/drift", name: str | None = None) -> Path:
    p = result["params"]
    path = drift_out_path(out_dir, p["kind"], p["steps"], name)
    with output_lock(path):
        drift_out_path(out_dir, p["kind"], p["steps"], name)   # again: another run may have written
        write_json(path, result)
        write_text(path.with_suffix(".md"), render_markdown(result))
    return path


def _pm(s, fmt="{:.3g}"):
    return f"{fmt.format(s['mean'])} ± {fmt.format(s['std'])}" if s["n"] > 1 else fmt.format(s["mean"])


def render_markdown(result: dict) -> str:
    p = result["params"]
    pv = result["provenance"]
    lines = [f"# Drift: {p['kind']}, {p['steps']} steps, seeds {p['seeds']}", "",
             f"B={p['batch']}, H={p['heads']}, d_k={p['d_k']}, d_v={p['d_v']}; "
             f"git {pv['git_commit']}, {pv['device']}, {pv['date']}. "
             "Mean ± sample std over seeds; relative = RMSE / RMS of the FP32 reference; "
             "anchor compared at its last flush. Protocol: replayquant/drift.py.", "",
             "| pair | mode | L | read | anchor | output RMSE | output rel | anchor RMSE | anchor rel |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['pair']} | {r['mode']} | {r['buffer_len']} | {r['read']} | {r['anchor']} | "
                     f"{_pm(r['output_rmse'])} | {_pm(r['output_rel_rmse'])} | {_pm(r['anchor_rmse'])} | "
                     f"{_pm(r['anchor_rel_rmse'])} |")
    return "\n".join(lines) + "\n"


_COLUMNS = ("pair", "mode", "L", "read", "anchor", "output RMSE", "output rel", "anchor RMSE",
            "anchor rel")
# left out in this order where the console is too narrow (the .md beside the JSON has them all)
_DROP = ("read", "anchor", "output RMSE", "anchor RMSE", "L")


def print_drift(result: dict, console=None, md_path=None) -> None:
    """The table of one drift result fitted to the console's width (80 columns through a pipe):
    columns that do not fit are left out and named, never a number cut."""
    from replayquant.kl.report import fit_table      # rich tables of the KL report
    console = console or Console()
    p = result["params"]
    title = (f"drift vs FP32 recurrence: {p['kind']}, {p['steps']} steps, seeds {p['seeds']} "
             f"(B={p['batch']} H={p['heads']} {p['d_v']}x{p['d_k']})")
    rows = [[r["pair"], r["mode"], str(r["buffer_len"]), r["read"], r["anchor"],
             _pm(r["output_rmse"]), _pm(r["output_rel_rmse"]), _pm(r["anchor_rmse"]),
             _pm(r["anchor_rel_rmse"])] for r in result["rows"]]
    t, dropped = fit_table(console, title, list(_COLUMNS), rows, _DROP)
    console.print(t)
    if dropped:
        console.print(f"(left out at {console.width} columns: {', '.join(dropped)}; "
                      f"{md_path or 'the .md beside the results'} has them all)", highlight=False)
