#!/usr/bin/env bash
# LoRA on one GPU, in stages that each fit one device call (~10 minutes), from the repository root:
#   bash bench/gpu_lora.sh kernels   # kernel and engine tests on CUDA, kernel check and timing table
#   bash bench/gpu_lora.sh engine    # 8B shape: 8 adapters of rank 16 vs the base model (bench/bench_lora.py)
# Logs go to $OUT (default /tmp/gpu_lora).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_lora}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-kernels}" in
  kernels)
    python -m pytest -q tests/kernels/test_lora.py tests/gpu/test_lora_cuda.py 2>&1 | tail -15 | tee "$OUT/tests.log"
    python bench/bench_lora_kernels.py --check 2>&1 | tail -5 | tee "$OUT/kernels_check.log"
    python bench/bench_lora_kernels.py 2>&1 | tee "$OUT/kernels.md"
    ;;
  engine)
    (cd bench && OUT="$OUT" timeout 560 python bench_lora.py "${@:2}" 2>&1 | tail -30)
    ;;
esac
