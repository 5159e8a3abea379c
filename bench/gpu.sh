#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one CUDA GPU and no network (about 7 minutes on one H200):
#
#   bash bench/gpu_wheels.sh          # here, with network: the packages that machine lacks, as wheels in .whl/
#   bash bench/gpu.sh OUT_DIR         # there: installs .whl/ into /tmp/site, then runs bench/gpu.py
#   python bench/gpu.py --record OUT_DIR/gpu_results.json   # back here: writes the GPU section of BENCHMARKS.md
#
# Nothing is installed into that machine's Python: the wheels go to /tmp/site, put first on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_out}}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 bench/gpu.py --out "$out"
