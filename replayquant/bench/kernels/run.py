"""`replayquant bench kernels` (GPU): the sections of the plan run in priority order under a time
budget, the table written after every section, then rendered. Its random inputs are
replayquant.testing, which the kernel tests draw from too."""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from replayquant.bench import authors as side
from replayquant.bench.kernels.checks import gpu_checks
from replayquant.bench.kernels.grid import PAIR_L, SHAPES, KernelGrid, check_names
from replayquant.bench.kernels.peers import bench_peers, peer_comparison, peer_versions
from replayquant.bench.kernels.plan import estimate_s, plan
from replayquant.bench.kernels.render import plot_kernels, render_markdown
from replayquant.bench.kernels.rows import (ReplayExtras, bench_conventional, bench_replay,
                                            bench_spec)
from replayquant.bench.kernels.sweep import config_sweep
from replayquant.bench.kernels.table import KERNELS_KIND, check_kernels_out, derive_speedups
from replayquant.bench.kernels.timing import copy_bandwidth_GBps, cpu_timing
from replayquant.bench.targets import targets
from replayquant.outputs import output_lock, write_json, write_text
from replayquant.provenance import provenance


def _try(fn, errors: dict, key: str, default=None):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 (one failing section must not lose the rest)
        errors[key] = f"{type(e).__name__}: {e}\n" + traceback.format_exc()[-2000:]
        print(f"[bench kernels] {key} failed: {type(e).__name__}: {e}", flush=True)
        return default


def run_kernels_bench(out: str = "build/bench", name: str = "kernels", **kw) -> dict:
    """`_run_kernels_bench` (its options in `kw`) into the folder `out`, its NAME.json checked
    first (`check_kernels_out`) and locked from the checks to the last write."""
    path = check_kernels_out(out, name, "replayquant bench kernels")
    with output_lock(path):
        check_kernels_out(out, name, "replayquant bench kernels")     # again, holding the lock
        return _run_kernels_bench(out=out, name=name, **kw)


def _run_kernels_bench(grid: KernelGrid = KernelGrid(), out: str = "build/bench",
                       name: str = "kernels", budget_s: float = 500.0, device: str = "cuda",
                       plot: bool = True, authors=None, authors_commit=None) -> dict:
    """`replayquant bench kernels`: copy bandwidth, GPU checks, launch-config sweep, conventional
    / replay / peer decode steps over the grid (B x L x pair) and speculative rounds
    (T), in priority order (plan) under a time budget: sections whose estimate would pass
    budget_s are skipped and listed. Writes {name}.json (after every section), {name}.md and
    {name}_speedup.png. authors: a checkout of the ReplaySSM authors' fork, whose kernels are
    timed beside ours (replayquant.bench.authors; its commit from the checkout, or
    authors_commit).

    device 'cpu' is a smoke run of this code (tiny `grid.shapes`, Triton interpreter,
    wall-clock timing): never a result."""
    cpu, kinds = _check_args(device, grid)
    A = side.load(authors, authors_commit) if authors else None   # bad PATH: before measuring
    t0 = time.time()
    run_shapes = {k: (SHAPES if grid.shapes is None else grid.shapes)[k] for k in kinds}
    with cpu_timing(cpu):
        sections = plan(replace(grid, kinds=tuple(run_shapes), peers=grid.peers and not cpu,
                                checks=grid.checks and not cpu, shapes=run_shapes),
                        A is not None)
        est = estimate_s(sections)
        print(f"[bench kernels] {len(sections)} sections, estimated {est:.0f} s "
              f"(budget {budget_s:.0f} s"
              + ("; the full plan fits)" if est <= budget_s else
                 "; sections past the budget are skipped, lowest priority first: "
                 "pass a subset (--batches/--L/--pairs/--T) to choose)"), flush=True)
        res = {"kind": KERNELS_KIND,
               "provenance": provenance(device, **_params(grid, run_shapes, budget_s, est, cpu)),
               "rows": [], "errors": {}, "skipped": [], "copy_GBps": None}
        if cpu:
            res["provenance"]["note"] = "CPU smoke run of the benchmark code: not a result"
        if A is not None:
            res["provenance"]["authors"] = A.provenance()
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)
        if grid.peers and not cpu:
            peer_versions(res["provenance"]["versions"])
        copy_bw = 1.0 if cpu else copy_bandwidth_GBps(device)
        res["copy_GBps"] = copy_bw
        print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
        run = _Run(res, run_shapes, tuple(grid.pairs), tuple(grid.Ls), grid.peers, device, cpu,
                   copy_bw, A, save=lambda: write_json(outp / f"{name}.json", res, default=str))
        run.sections(sections, t0, budget_s)
        return _finish(run, t0, outp, name, plot)


def _params(grid: KernelGrid, run_shapes, budget_s, est, cpu) -> dict:
    """The run's settings as its results file records them."""
    g = grid
    return dict(batches=list(g.batches), L=list(g.Ls), pairs=list(g.pairs), T=list(g.Ts),
                spec_batches=list(g.spec_batches), main_L=dict(PAIR_L), shapes=run_shapes,
                peers=g.peers, checks=g.checks, sweep=g.sweep,
                detail_batches=list(g.detail_batches), budget_s=budget_s, estimate_s=est,
                smoke_cpu=cpu, staggered_batches=list(g.staggered_batches),
                main_L_only=g.main_L_only, accuracy=g.accuracy)


def _check_args(device, grid: KernelGrid):
    """One clear error for arguments the run cannot measure, before anything runs: (whether it is
    a CPU smoke run, the kinds measured)."""
    cpu = not str(device).startswith("cuda")
    if not cpu and not torch.cuda.is_available():
        raise ValueError("bench kernels needs a CUDA GPU (device='cpu' only smoke-tests the code)")
    if cpu and grid.shapes is None:
        raise ValueError("a CPU run needs tiny `shapes` (it only smoke-tests the benchmark code)")
    kinds = (tuple(SHAPES if grid.shapes is None else grid.shapes) if grid.kinds is None
             else tuple(grid.kinds))
    check_names(grid.pairs, kinds)
    batches, spec_batches, Ls, Ts = grid.batches, grid.spec_batches, grid.Ls, grid.Ts
    if any(T < 1 for T in Ts) or any(L < 1 for L in Ls) or not Ls \
            or not (batches or spec_batches):
        raise ValueError(f"need batches or spec batches, L >= 1 and T >= 1 (got "
                         f"{list(batches)}, {list(spec_batches)}, {list(Ls)}, {list(Ts)}); a "
                         "speculative T larger than the kind's L is skipped")
    return cpu, kinds


def _finish(run, t0, outp: Path, name: str, plot: bool) -> dict:
    """The launch configs, derived speedups, targets and wall time into the table; NAME.json,
    NAME.md (printed too) and, with plot, NAME_speedup.png written."""
    res = run.res
    res["configs"] = run.cfgs
    derive_speedups(res["rows"])
    res["targets"] = targets(res)
    res["wall_s"] = time.time() - t0
    run.save()
    md = render_markdown(res, run.shapes)
    write_text(outp / f"{name}.md", md)
    print(md, flush=True)
    if plot:
        _try(lambda: plot_kernels(res, str(outp / f"{name}_speedup.png"), run.shapes),
             res["errors"], "plot")
        run.save()
    return res


@dataclass
class _Run:
    """One run's table `res` as its sections fill it, with what they measure on: the run's
    shapes, pairs and L values, the device and its copy bandwidth, the authors' kernels (A or
    None) and the sweep's launch configs per kind (cfgs). save writes the table."""
    res: dict
    shapes: dict
    pairs: tuple
    Ls: tuple
    peers: bool
    device: str
    cpu: bool
    copy_bw: float
    A: object
    save: object
    cfgs: dict = field(default_factory=dict)

    def sections(self, sections, t0, budget_s) -> None:
        """Each section in order unless the time so far plus its estimate passes budget_s (then
        listed as skipped); its seconds into section_s and the table saved after each."""
        res = self.res
        res["section_s"] = {}
        for key, est_s, what in sections:
            el = time.time() - t0
            if el + est_s > budget_s:
                res["skipped"].append(key)
                continue
            if _SECTIONS[what[0]](self, key, *what[1:]) is False:
                continue
            res["section_s"][key] = round(time.time() - t0 - el, 2)
            self.save()

    def main_L(self, kind):
        return PAIR_L[kind] if PAIR_L[kind] in self.Ls else self.Ls[0]

    def cfg(self, kind, B):
        """The sweep's launch configs of `kind` for rows at batch B >= 128, else None."""
        return self.cfgs.get(kind) if B >= 128 else None

    def add_rows(self, fn, key) -> None:
        self.res["rows"] += _try(fn, self.res["errors"], key, [])

    def _checks(self, key):
        E = self.res["errors"]
        self.res["checks"] = _try(lambda: gpu_checks(self.device, self.shapes), E, "checks")
        if self.peers:
            self.res["peer_comparison"] = _try(lambda: peer_comparison(self.device, self.shapes),
                                               E, "peer_comparison")

    def _sweep(self, key, kind):
        got = _try(lambda: config_sweep(kind, 256 if not self.cpu else 2, self.device,
                                        self.copy_bw, self.pairs, S=self.shapes[kind]),
                   self.res["errors"], key)
        if got:
            self.res["rows"] += got[0]
            self.cfgs[kind] = got[1]

    def _conv(self, key, kind, B):
        self.add_rows(lambda: bench_conventional(kind, B, self.device, self.copy_bw,
                                                 self.cfg(kind, B), S=self.shapes[kind]), key)

    def _replay(self, key, kind, B, pair, L, det, forced, ptr):
        extras = ReplayExtras(detail=det, forced=forced, pointer=ptr)
        self.add_rows(lambda: bench_replay(kind, B, pair, L, self.device, self.copy_bw,
                                           self.cfg(kind, B), extras, S=self.shapes[kind]), key)

    def _spec(self, key, kind, B, T):
        """The speculative rounds; False (not run) where T passes the kind's L."""
        L = self.main_L(kind)
        if T > L:
            self.res["skipped"].append(key + " (T > L)")
            return False
        self.add_rows(lambda: bench_spec(kind, B, T, self.device, self.copy_bw, self.cfg(kind, B),
                                         self.pairs, L, S=self.shapes[kind]), key)

    def _accuracy(self, key, kind):
        acc = _try(lambda: side.accuracy(kind, self.shapes[kind], 8 if not self.cpu else 2,
                                         self.main_L(kind), self.device, self.A,
                                         pairs=[p for p in self.pairs if p in side.ACC_PAIRS]),
                   self.res["errors"], key)
        if acc:
            self.res.setdefault("accuracy", {})[kind] = acc
            side.print_accuracy(kind, acc)

    def _authors(self, key, kind, B, staggered):
        self.add_rows(lambda: side.bench_window(kind, B, self.main_L(kind), self.device,
                                                self.copy_bw, self.shapes[kind], self.A,
                                                staggered), key)

    def _staggered(self, key, kind, B, pair):
        self.add_rows(lambda: side.bench_ours_staggered(kind, B, pair, self.main_L(kind),
                                                        self.device, self.copy_bw,
                                                        self.shapes[kind]), key)

    def _spec_authors(self, key, kind, B, T):
        self.add_rows(lambda: side.bench_spec(kind, B, T, self.main_L(kind), self.device,
                                              self.copy_bw, self.shapes[kind], self.A), key)

    def _peers(self, key, kind, B):
        self.add_rows(lambda: bench_peers(kind, B, self.device, self.copy_bw,
                                          S=self.shapes[kind]), key)


# plan's section ops (the first entry of a section's `what`) and the step that runs each
_SECTIONS = {"checks": _Run._checks, "sweep": _Run._sweep, "conv": _Run._conv,
             "replay": _Run._replay, "spec": _Run._spec, "accuracy": _Run._accuracy,
             "authors": _Run._authors, "staggered": _Run._staggered,
             "spec-authors": _Run._spec_authors, "peers": _Run._peers}
