#!/usr/bin/env bash
# lm-eval-style scoring (echo + log probs, max_tokens 1) against prefill alone, on one GPU, in one
# device call (~10 minutes; the 8B engine starts in ~1-2 min on an H100), from the repository root:
#   bash bench/gpu_scoring.sh            # 1,000 x 512-token prompts, Llama-3.1-8B shape, bf16
# Rows: prefill-only, scoring with top 1 (what lm-eval asks), scoring with top 5; target:
# scoring / prefill-only >= 0.50 in prompt tok/s. More flags for bench/bench_scoring.py go after
# the script's name (e.g. --max-num-tokens 16384). Results go to $OUT (default /tmp/gpu_scoring):
# bench_scoring.md, bench_scoring.json and scoring.log.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/gpu_scoring}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
OUT="$OUT" timeout 420 python bench/bench_scoring.py --top 5 "$@" 2>&1 | tee "$OUT/scoring.log" | tail -30
