#!/usr/bin/env bash
# What the OpenAI frontend adds to a real tritonserver on the GPU (issue 12), in one command on
# the device machine, from the repository root, carrying .device/serving and .device/openai
# (bench/gpu_serving_pack.sh, bench/gpu_openai_pack.sh):
#
#   bash bench/gpu_openai.sh             # ~3 min on an H100
#
# 1. bench/gpu_serving.sh setup: the server's Python environment and the random-weight
#    Llama-3.2-1B-shaped checkpoint (bf16, SmolLM2's tokenizer), as for the serving benchmark.
# 2. The frontend's packages (.device/openai/frontend.tar.xz) unpacked into that environment.
# 3. bench/bench_openai.py: tritonserver serves the checkpoint on the GPU behind the ensemble; the
#    same streamed chat requests go through the frontend and straight to the gRPC ensemble,
#    taking turns, at concurrency 1 (time to first token; target: frontend adds <= 1 ms) and 64
#    (output tok/s; target: >= 0.95x). Greedy, min_tokens = max_tokens.
# The random weights produce ids that SmolLM2's tokenizer does not know (they decode to nothing),
# so "first token" is the first one with text, the same on both paths (same greedy tokens).
# Logs go to $OUT (default /tmp/gpu_openai): openai.log and server.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_openai}
WORK=/tmp/gpu-serving  # bench/gpu_serving.sh's
ENV=$WORK/env
MODEL=$WORK/llama-3.2-1b-random
CONCURRENCY=${CONCURRENCY:-1 64}
# SET: more repository values (k:v,k:v); BENCH_ARGS: more flags for bench/bench_openai.py;
# FRONTEND_WORKERS: the frontend's --workers (default auto: 4 on a 16-core host).
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
exec > >(tee -a "$OUT/openai.log") 2>&1
start=$SECONDS
step() { echo "=== [$((SECONDS - start)) s] $*"; }

[[ -f .device/openai/frontend.tar.xz ]] || { echo "carry .device/openai (make it with bench/gpu_openai_pack.sh)"; exit 2; }
step "server environment and checkpoint (bench/gpu_serving.sh setup)"
OUT=$OUT bash bench/gpu_serving.sh setup || exit $?

step "frontend packages"
SITE=$("$ENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ ! -f $SITE/.openai_frontend_pack ]]; then
  mkdir -p "$WORK/openai-pack"
  tar -xJf .device/openai/frontend.tar.xz -C "$WORK/openai-pack" || exit 3
  cp -r "$WORK/openai-pack/site/." "$SITE/" && touch "$SITE/.openai_frontend_pack"
fi
"$ENV/bin/python3" -c 'import fastapi, uvicorn, uvloop, httptools, httpx, openai_frontend.app, tritonclient.grpc.aio; print("frontend env: fastapi", fastapi.__version__, "| uvicorn", uvicorn.__version__, "| uvloop", uvloop.__version__, "| httpx", httpx.__version__)' || exit 3

step "bench_openai: frontend vs direct gRPC, c = $CONCURRENCY"
timeout --kill-after=15 420 "$ENV/bin/python3" bench/bench_openai.py \
  --model "$MODEL" --device cuda --dtype bfloat16 --concurrency $CONCURRENCY \
  --requests-at-1 48 --max-tokens-at-1 16 --rounds 4 --max-tokens 128 \
  --set "max_seq_len:1024${SET:+,$SET}" --server-log "$OUT/server.log" \
  --frontend-workers "${FRONTEND_WORKERS:-auto}" ${BENCH_ARGS:-}
rc=$?
step "done (exit $rc)"
exit $rc
