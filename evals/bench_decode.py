"""GPU: the decode-kernel benchmark in one run (see replayquant/bench/decode.py).

    python evals/bench_decode.py --out results/bench            # or: replayquant bench decode
"""
import argparse

from replayquant.bench.decode import run_decode_bench

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="results/bench")
    ap.add_argument("--batches", default="1,8,32,128,256,512")
    ap.add_argument("--spec-batches", default="32,256,512")
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--name", default="decode")
    a = ap.parse_args()
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    run_decode_bench(out=a.out, batches=ints(a.batches), spec_batches=ints(a.spec_batches), T=a.T,
                     peers=not a.no_peers, checks=not a.no_checks, sweep=not a.no_sweep,
                     name=a.name)
