"""GPU: the decode-kernel benchmark of issue 4 in one run (see replayquant/bench/decode.py).

    python evals/bench_decode.py --out results/bench      # = replayquant bench kernels
    python evals/bench_decode.py --estimate-only          # the plan and its runtime estimate

Writes results/bench/kernels.{json,md} and kernels_speedup.png. results/bench/decode.* are the
record of the earlier run (commit e980202) and are not overwritten (different stem).
"""
import argparse

from replayquant.bench.decode import GRID, PAIRS, estimate_s, plan, run_kernels_bench

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    j = lambda t: ",".join(map(str, t))  # noqa: E731
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--batches", default=j(GRID["batches"]))
    ap.add_argument("--L", default=j(GRID["Ls"]))
    ap.add_argument("--pairs", default=j(PAIRS))
    ap.add_argument("--T", default=j(GRID["Ts"]))
    ap.add_argument("--spec-batches", default=j(GRID["spec_batches"]))
    ap.add_argument("--kinds", default="gdn,mamba2")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--estimate-only", action="store_true")
    ap.add_argument("--name", default="kernels")
    a = ap.parse_args()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    strs = lambda s: tuple(x for x in s.split(",") if x)  # noqa: E731
    kw = dict(batches=ints(a.batches), Ls=ints(a.L), pairs=strs(a.pairs), Ts=ints(a.T),
              spec_batches=ints(a.spec_batches), kinds=strs(a.kinds), peers=not a.no_peers,
              checks=not a.no_checks, sweep=not a.no_sweep)
    if a.estimate_only:
        sec = plan(**kw)
        print(f"{len(sec)} sections, estimated {estimate_s(sec):.0f} s (budget {a.budget_s:.0f} s)")
    else:
        run_kernels_bench(out=a.out, budget_s=a.budget_s, name=a.name, **kw)
