#!/usr/bin/env bash
# Quantized weights and KV cache on one GPU, in stages that each fit one device call (~10 minutes):
#   bash bench/gpu_quantization.sh kernels   # W4A16 kernel and layer tests on CUDA, GEMM table, config sweep
#   bash bench/gpu_quantization.sh engine    # no compile after start-up; decode and 128/128, bf16 vs w4a16
#   bash bench/gpu_quantization.sh profile   # where a w4a16 decode step goes (batch 1, 64); FP8 vs FP8 KV at 256
#   bash bench/gpu_quantization.sh fp8kv     # the decode kernel over bf16 / e4m3 caches; FP8 KV at 1000/1000
# Logs go to $OUT (default /tmp/gpu_quantization).
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_quantization}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
case "${1:-kernels}" in
  kernels)
    python -m pytest -q tests/kernels/test_int4.py tests/gpu/test_int4_cuda.py 2>&1 | tail -25 | tee "$OUT/tests.log"
    python bench/bench_int4_gemm.py 2>&1 | tee "$OUT/int4_gemm.md"
    timeout 300 python bench/bench_int4_gemm.py --sweep 2>&1 | tail -60 | tee "$OUT/int4_sweep.md"
    ;;
  engine)
    (cd bench && timeout 200 python bench_gpu_checks.py jit --quantization w4a16 --shapes llama-3.1-8b \
        2>&1 | tail -8 | tee "$OUT/jit_w4a16.log")
    (cd bench && OUT="$OUT" timeout 380 python bench_quantization.py --variants bf16 w4a16 --batches 1 64 256 \
        --throughput 128:3000 --max-batch-size 1024 --budget-s 150 2>&1 | tail -20)
    ;;
  profile)
    (cd bench && OUT="$OUT/w4a16" timeout 250 python bench_quantization.py --variants w4a16 --batches \
        --profile 1 64 2>&1 | grep -v "^|" | tail -32)
    (cd bench && OUT="$OUT/fp8kv" timeout 300 python bench_quantization.py --variants fp8 fp8-kv --batches 256 \
        --profile 256 2>&1 | grep -v "^|" | tail -34)
    ;;
  fp8kv)
    python -m pytest -q tests/kernels/test_fp8_kv_cache.py tests/kernels/test_paged_attention.py 2>&1 | tail -3
    timeout 120 python bench/bench_decode_kv.py --contexts 192 1000 2>&1 | grep -E "TB/s|\| (64|128) \| 4 \|" \
        | tee "$OUT/decode_kv.md"
    (cd bench && timeout 150 python bench_gpu_checks.py jit --quantization fp8 --kv-cache-dtype fp8 \
        --shapes llama-3.1-8b 2>&1 | tail -3)
    (cd bench && OUT="$OUT" timeout 420 python bench_quantization.py --variants fp8 fp8-kv --batches 256 \
        --throughput 1000:1000 --max-batch-size 512 --budget-s 200 2>&1 | tail -12)
    ;;
esac
