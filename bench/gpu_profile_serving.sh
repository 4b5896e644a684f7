#!/usr/bin/env bash
# Where the served engine's host time goes on the GPU, streamed vs not (issue 10), in one command
# on the device machine, from the repository root, carrying .device/serving and .device/pyspy:
#
#   bash bench/gpu_profile_serving.sh          # ~5 min on an H100
#
# bench/gpu_serving.sh setup (server environment, random-weight Llama-3.2-1B-shaped checkpoint),
# then bench/response_cost.py at CONCURRENCY (default 256), 128 tokens out: py-spy samples the
# engine process with streamed requests, then with non-streamed ones, then the tensorrt_llm
# stub with streamed ones, and prints each one's top functions and every process's CPU time.
# Logs go to $OUT (default /tmp/gpu_profile_serving).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_profile_serving}
WORK=/tmp/gpu-serving  # bench/gpu_serving.sh's
CONCURRENCY=${CONCURRENCY:-256}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
exec > >(tee -a "$OUT/profile.log") 2>&1
start=$SECONDS
step() { echo "=== [$((SECONDS - start)) s] $*"; }

ls .device/pyspy/py_spy-*.whl >/dev/null 2>&1 || { echo "carry .device/pyspy (the py-spy wheel)"; exit 2; }
OUT=$OUT bash bench/gpu_serving.sh setup || exit $?
SITE=$("$WORK/env/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$WORK/pyspy" && python3 -m zipfile -e .device/pyspy/py_spy-*.whl "$WORK/pyspy"
export PY_SPY
PY_SPY=$(find "$WORK/pyspy" -name py-spy -type f | head -n 1) && chmod +x "$PY_SPY" || exit 3

run() {  # $1: title; the rest: response_cost.py flags
  local title=$1; shift
  step "$title"
  timeout --kill-after=15 240 "$WORK/env/bin/python3" bench/response_cost.py \
    --model "$WORK/llama-3.2-1b-random" --tokenizer "$WORK/pack/tokenizer" \
    --perf-analyzer "$SITE/perf_analyzer/bin/perf_analyzer" --concurrency $CONCURRENCY \
    --output-tokens 128 --duration-s 20 \
    --set device=cuda dtype=bfloat16 max_seq_len=1024 max_num_sequences=256 \
          triton_max_batch_size=256 kv_cache_free_gpu_mem_fraction=0.3 "$@"
}
run "engine process, streamed" --profile engine
run "engine process, not streamed" --profile engine --no-stream
run "tensorrt_llm stub, streamed" --profile tensorrt_llm
step "done"
