#!/usr/bin/env bash
# The GPU fast path checked and measured in one command on the device machine (repository root):
#
#   bash checks/gpu_check.sh            # ~9 min on an H100: kernel tests compiled, the model tier
#                                       # on CUDA, greedy parity of every engine path + sync audit,
#                                       # then bench/bench_gpu.py --quick
#   bash checks/gpu_check.sh bench-full # bench/bench_gpu.py --full alone (<= 9 min)
#   bash checks/gpu_check.sh tests      # the first three stages alone (~5 min)
#   bash checks/gpu_check.sh beam       # beam search on CUDA vs HF, next to greedy requests
#   bash checks/gpu_check.sh tp         # tensor parallelism (bench/gpu_tp.py): greedy tp=2 == tp=1,
#                                       # then Llama-3.1-8B shape tp=1 vs tp=2 (~4 min on one H100,
#                                       # where tp=1 runs alone; ~8 min on 2 GPUs); gpu_tp.json
#   bash checks/gpu_check.sh jit        # ~3 min: Triton compiles after start-up over a mixed
#                                       # workload, 1B and 8B (must be 0), slowest step
#   bash checks/gpu_check.sh profile    # ~3 min: per-kernel GPU time per decode step, 1B and 8B
#                                       # at batch 1/64/256, kernels per step, GPU busy vs wall
#   bash checks/gpu_check.sh tune       # jit then profile (~6 min)
#   bash checks/gpu_check.sh mixed      # ~3.5 min: mixed-step graphs: their kernel and runner tests
#                                       # compiled, parity (staggered paths), the staggered-arrival
#                                       # bench (bench/bench_gpu_mixed.py), jit on the 1B shape
#
# Every stage has its own time limit and runs whatever the others did. Logs and results go to
# $OUT (the device tool brings them back; default /tmp/gpu_check): gpu_check.log, kernels.log,
# model.log, parity.log, bench.json, bench.png, bench.md. The summary at the end (the last ~100
# lines) holds every line that matters: stage status, parity and sync-audit lines, the bench tables.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
# The scripts in bench/ and checks/ import the product (inflight, tools) from the checkout: the
# GPU image has no editable install.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
what=${1:-all}
declare -a SUMMARY=()

stage() {  # NAME LIMIT_S LOG COMMAND...
  local name=$1 limit=$2 log=$3; shift 3
  local start=$SECONDS
  echo "=== $name (limit ${limit}s) ===" | tee -a "$OUT/gpu_check.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$log" >> "$OUT/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  local status=PASS
  [[ $rc -eq 124 || $rc -eq 137 ]] && status="TIMEOUT after ${limit}s"
  [[ $rc -ne 0 && $status == PASS ]] && status="FAIL (exit $rc)"
  SUMMARY+=("$(printf '%-32s %-22s %4ds' "$name" "$status" $((SECONDS - start)))")
  tail -n 3 "$OUT/$log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import sys, torch, triton, transformers, numpy; print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__, "| transformers", transformers.__version__, "| numpy", numpy.__version__, "| cuda", torch.cuda.is_available())'
  git log --oneline -1 2>/dev/null
} 2>&1 | tee "$OUT/gpu_check.log"

if [[ $what == all || $what == tests ]]; then
  stage "kernel tests (compiled)" 100 kernels.log \
    $PY -m pytest -q -p no:cacheprovider tests/kernels
  stage "model tier on CUDA" 75 model.log \
    $PY -m pytest -q -p no:cacheprovider tests/model/test_triton_backend.py tests/model/test_cuda_graph_runner.py
  stage "parity + sync audit" 200 parity.log $PY checks/gpu_parity.py
fi
if [[ $what == mixed ]]; then
  stage "mixed kernels + graph runner" 120 kernels.log \
    $PY -m pytest -q -p no:cacheprovider tests/kernels/test_mixed_attention.py \
    tests/kernels/test_prefill_attention.py tests/model/test_cuda_graph_runner.py
  stage "parity + sync audit" 200 parity.log $PY checks/gpu_parity.py
  stage "mixed steps: staggered bench" 200 mixed.log $PY bench/bench_gpu_mixed.py --out "$OUT"
  stage "jit compiles after start-up (1B)" 150 jit.log \
    $PY bench/bench_gpu_checks.py jit --shapes llama-3.2-1b --out "$OUT"
fi
if [[ $what == beam ]]; then
  stage "beam search on CUDA" 280 beam.log \
    $PY -m pytest -q -p no:cacheprovider tests/gpu/test_beam_cuda.py
fi
if [[ $what == all ]]; then
  stage "bench --quick" 235 bench.log $PY bench/bench_gpu.py --quick --out "$OUT"
fi
if [[ $what == tp ]]; then
  # --watchdog-s: below the limit, so a hang leaves every rank's Python stacks in the log
  # One tp > 1 engine per process on CUDA (NCCL groups end with the process): a stage per mode.
  stage "tp: greedy tp=2 == tp=1, graphs" 150 tp_check.log $PY bench/gpu_tp.py --check --check-graphs auto --watchdog-s 130 --out "$OUT/tp_check"
  stage "tp: greedy tp=2 == tp=1, eager" 150 tp_check_eager.log $PY bench/gpu_tp.py --check --check-graphs off --watchdog-s 130 --out "$OUT/tp_check_eager"
  stage "tp: 8B tp=1 vs tp=2" 330 tp_bench.log $PY bench/gpu_tp.py --bench --watchdog-s 305 --out "$OUT"
fi
if [[ $what == jit || $what == tune ]]; then
  stage "jit compiles after start-up" 280 jit.log $PY bench/bench_gpu_checks.py jit --out "$OUT"
fi
if [[ $what == profile || $what == tune ]]; then
  stage "decode profile" 280 profile.log $PY bench/bench_gpu_checks.py profile --out "$OUT"
fi
if [[ $what == bench-full ]]; then
  stage "bench --full" 570 bench.log $PY bench/bench_gpu.py --full --out "$OUT"
fi

{
  echo
  echo "==================== SUMMARY ===================="
  head -n 3 "$OUT/gpu_check.log"
  for line in "${SUMMARY[@]}"; do echo "$line"; done
  for log in kernels.log model.log beam.log; do
    [[ -f $OUT/$log ]] && echo "$log: $(grep -E '(passed|failed|error)' "$OUT/$log" | tail -n 1)"
  done
  if [[ -f $OUT/parity.log ]]; then
    echo "--- parity.log ---"
    grep -E '^(PARITY|BF16|SYNC|RESULT|    flagged)' "$OUT/parity.log"
  fi
  for log in tp_check.log tp_check_eager.log tp_bench.log; do
    [[ -f $OUT/$log ]] && { echo "--- $log ---"; grep -vE '^\[tp rank' "$OUT/$log" | grep -E '^(  tp=|CHECK|WATCHDOG|  "batch|   "batch|.*NOT RUN|.*refused)' ; }
  done
  if [[ -f $OUT/jit.log ]]; then
    echo "--- jit.log ---"
    grep -E '^(RESULT|==|  COMPILED|  [0-9a-z].*step)' "$OUT/jit.log"
  fi
  if [[ -f $OUT/mixed.log ]]; then
    echo "--- mixed.log ---"
    grep -E '^(  staggered|  steady|staggered|\||llama|tiny)' "$OUT/mixed.log"
  fi
  if [[ -f $OUT/profile.log ]]; then
    echo "--- profile.log ---"
    grep -vE '^(USDT|STAGE|\[W)' "$OUT/profile.log" | tail -n 100
  fi
  if [[ -f $OUT/bench.md ]]; then
    echo "--- bench.md ---"
    cat "$OUT/bench.md"
  elif [[ -f $OUT/bench.log ]]; then
    echo "--- bench.log (no bench.md) ---"
    tail -n 30 "$OUT/bench.log"
  fi
} 2>&1 | tee -a "$OUT/gpu_check.log"
