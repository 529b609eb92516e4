"""The bench's GPU checks alone (kernels against their torch references at the real head
shapes, the reference casts on the device against the CPU), with provenance:

    python evals/gpu_checks.py OUT.json

`replayquant bench kernels` runs the same checks as the first part of its grid."""

from __future__ import annotations

import json
import sys

from replayquant.bench import decode as bd
from replayquant.provenance import provenance


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python evals/gpu_checks.py OUT.json", file=sys.stderr)
        return 2
    if bd.no_gpu("gpu_checks"):
        return 2
    checks = bd.gpu_checks("cuda")
    res = {"provenance": provenance("cuda", script="evals/gpu_checks.py"), "checks": checks}
    with open(argv[0], "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(checks, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
