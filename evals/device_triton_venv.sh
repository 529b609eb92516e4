#!/usr/bin/env bash
# A second virtual environment with the H200 image's Triton (3.6.0), for static SASS of the
# decode kernels as the device compiles them (session 11: Triton 3.6 and 3.9 lay out the same
# kernel differently; this venv reproduced the device's ptxas register and spill reports exactly).
#
#   bash evals/device_triton_venv.sh [VENV]          (default .venv-triton36; needs a package registry)
#   VENV/bin/python -m replayquant.kernels.compile_check sass LAUNCHES.json --kernel NAME
#
# LAUNCHES.json: `compile_check record` with the main venv (the interpreter). Run from the checkout
# (the package is taken from the current folder, not installed into VENV).
set -euo pipefail
venv=${1:-.venv-triton36}
python3 -m venv "$venv"
"$venv/bin/pip" install -q -c constraints.txt torch numpy pyyaml
"$venv/bin/pip" install -q --no-deps triton==3.6.0
"$venv/bin/python" -c "import triton; print('triton', triton.__version__, 'in $venv')"
