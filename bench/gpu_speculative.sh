#!/usr/bin/env bash
# Speculative decoding on one GPU, from the repository root (one device call, ~6 minutes on an H100):
#   bash bench/gpu_speculative.sh           # CUDA tests (graphs and eager), then bench/bench_speculative.py
#   bash bench/gpu_speculative.sh bench     # the benchmark alone (8B shape, random weights)
# Logs go to $OUT (default /tmp/gpu_speculative).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_speculative}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${1:-all}" != bench ]; then
  timeout 240 python -m pytest -q tests/gpu/test_speculative_cuda.py tests/model/test_speculative.py 2>&1 \
    | tail -15 | tee "$OUT/tests.log"
fi
(cd bench && OUT="$OUT" timeout 420 python bench_speculative.py "${@:2}" 2>&1 | tail -25)
