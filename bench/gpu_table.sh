#!/usr/bin/env bash
# Issue 28's GPU table in one command, from the repository root on the device machine:
#
#   bash bench/gpu_table.sh                  # ~8 min on one H100 (half without a baseline)
#   BASE=.device/base bash bench/gpu_table.sh   # the same rows for an older checkout, same run
#   PARTS="base" BASE=... bash bench/gpu_table.sh   # some parts only (new base itl tp; all by default)
#
# Rows: decode % of the bandwidth roofline (1B and 8B shapes, batch 1/64/256; bench_gpu.py
# --decode), 8B prefill MFU at 2k/8k/32k/100k tokens (bench_prefill.py engine), 8 streams'
# inter-token latency under a 32k prompt at two budgets and with the default repository's
# configuration (bench_prefill.py itl), and, on a machine with two GPUs, tp=2 vs tp=1
# (gpu_tp.py --bench). BASE: a folder holding an older `inflight/` and `ensemble/` (e.g.
# `git archive <rev> inflight ensemble | tar -x -C .device/base`), run with the same scripts.
# Writes OUT/table.md and OUT/table.svg (bench/gpu_table_report.py) and prints the table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_table}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
quiet() { grep -v -i "warn" || true; }
rows() {  # $1: new|base, $2: the PYTHONPATH of the code measured
  local dir=$OUT/$1
  echo "=== $1: decode"
  PYTHONPATH=$2 timeout 240 python3 bench/bench_gpu.py --decode --out "$dir/decode" 2>&1 | quiet | grep " B=\|ERROR"
  echo "=== $1: prefill"
  PYTHONPATH=$2 timeout 150 python3 bench/bench_prefill.py engine --repeat 1 --out "$dir/prefill" 2>&1 | quiet
}
PARTS=${PARTS:-new base itl tp}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name --format=csv,noheader
if part new; then rows new "$PWD"; fi
if part base && [ -n "${BASE:-}" ]; then rows base "$(realpath "$BASE")"; fi
if part itl; then
  echo "=== new: inter-token latency under a 32k prompt"
  PYTHONPATH=$PWD timeout 200 python3 bench/bench_prefill.py itl --max-num-tokens 2048 8192 --out "$OUT/new/itl" 2>&1 | quiet
fi
if part tp && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "=== new: tp=2 vs tp=1"
  PYTHONPATH=$PWD timeout 300 python3 bench/gpu_tp.py --bench --watchdog-s 280 --out "$OUT/new/tp" 2>&1 | quiet | grep "tp=\|ratio"
fi
python3 bench/gpu_table_report.py "$OUT"
