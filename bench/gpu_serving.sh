#!/usr/bin/env bash
# Streaming through Triton vs the engine in process on the GPU (issue 10), in one command on the
# device machine, from the repository root, carrying .device/serving (bench/gpu_serving_pack.sh):
#
#   bash bench/gpu_serving.sh            # ~3-4 min on an H100
#   bash bench/gpu_serving.sh trace      # where a streamed first token's time goes, per stage
#                                        # (bench/serving_trace.py), at CONCURRENCY_TRACE (default 1 64)
#   bash bench/gpu_serving.sh setup      # steps 1 and 2 only (bench/gpu_openai.sh starts with it)
#
# 1. The server's Python environment: a venv over the image's packages in which numpy 1.26.4
#    (Triton 2.51's python backend stub corrupts BYTES tensors with numpy 2) comes first, and
#    scipy and scikit-learn, built for the image's numpy 2 and imported by transformers when
#    present, are hidden (a .pth marks them absent in sys.modules). tritonserver, perf_analyzer,
#    tritonclient and msgpack come from the carried archive; this checkout is on its path.
# 2. A random-weight Llama-3.2-1B-shaped checkpoint (bf16) with SmolLM2's tokenizer.
# 3. bench/bench_serving.py: a real tritonserver serves it behind the ensemble; perf_analyzer
#    (gRPC streaming) at concurrency 1, 16, 64, 256, `stream` true and false, beside the engine
#    in this process, same prompts (128 tokens), 128 tokens out, greedy; ratios and the issue's
#    targets (c64/c256 streaming tok/s >= 0.95x, ITL p50 <= 1.10x, c1 TTFT within 5 ms) last.
# Logs go to $OUT (default /tmp/gpu_serving): serving.log and server.log.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_serving}
IMG_PY=${PYTHON:-python3}
WORK=/tmp/gpu-serving
ENV=$WORK/env
MODEL=$WORK/llama-3.2-1b-random
BUDGET_S=${BUDGET_S:-330}  # no new concurrency level starts after this (the bench's own clock)
CONCURRENCY=${CONCURRENCY:-1 16 64 256}  # the levels measured (fewer for a quick diagnosis)
# SET: more repository values (k:v,k:v, e.g. engine_process:false); BENCH_ARGS: more flags.
mkdir -p "$OUT" "$WORK/pack"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1 PYTHONDONTWRITEBYTECODE=1
exec > >(tee -a "$OUT/serving.log") 2>&1
start=$SECONDS
step() { echo "=== [$((SECONDS - start)) s] $*"; }

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$IMG_PY -c 'import sys, torch, transformers, numpy; print("image: python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__, "| numpy", numpy.__version__, "| cuda", torch.cuda.is_available())'
git log --oneline -1 2>/dev/null
[[ -f .device/serving/serving.tar.xz ]] || { echo "carry .device/serving (make it with bench/gpu_serving_pack.sh)"; exit 2; }

step "server environment in $ENV"
if [[ ! -x $ENV/bin/python3 ]]; then
  if ! $IMG_PY -m venv --without-pip "$ENV"; then  # what venv writes, by hand
    mkdir -p "$ENV/bin" && ln -sf "$($IMG_PY -c 'import sys; print(sys._base_executable)')" "$ENV/bin/python3"
    $IMG_PY -c 'import sys, os; print(f"home = {os.path.dirname(sys._base_executable)}\ninclude-system-site-packages = false\nversion = {sys.version.split()[0]}")' > "$ENV/pyvenv.cfg"
  fi
  SITE=$("$ENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  tar -xJf .device/serving/serving.tar.xz -C "$WORK/pack" || exit 3
  cp -r "$WORK/pack/site/." "$SITE/"
  echo "import sys; sys.modules.update(dict.fromkeys(('scipy', 'sklearn'), None))" > "$SITE/00_hide_numpy2_builds.pth"
  echo "$REPO" > "$SITE/10_inflight_checkout.pth"
  # The image's own site directories, after ours (site.addsitedir also runs their .pth files).
  $IMG_PY -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' |
    while read -r dir; do echo "import site; site.addsitedir('$dir')"; done > "$SITE/zz_image_site.pth"
fi
SITE=$("$ENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PA=$SITE/perf_analyzer/bin/perf_analyzer
chmod +x "$PA" "$SITE/pytriton/tritonserver/bin/tritonserver" "$SITE/pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub"
"$ENV/bin/python3" -c 'import numpy, torch, transformers, msgpack, tritonclient.grpc, inflight; print("server env: numpy", numpy.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__, "| msgpack", msgpack.version, "| inflight from", inflight.__file__)' || exit 3
"$PA" --version 2>&1 | head -n 2

step "random-weight Llama-3.2-1B-shaped checkpoint"
if [[ ! -f $MODEL/model.safetensors ]]; then
  # The image's Python has no editable install: the checkout goes on its path for this script.
  PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout 300 $IMG_PY bench/random_checkpoint.py --shape llama-3.2-1b --tokenizer "$WORK/pack/tokenizer" \
    --out "$MODEL" --dtype bfloat16 || exit 4
fi

if [[ ${1:-bench} == setup ]]; then
  step "done (environment $ENV, checkpoint $MODEL)"
  exit 0
fi

if [[ ${1:-bench} == trace ]]; then
  step "serving_trace: Triton's trace of streamed requests, c = ${CONCURRENCY_TRACE:-1 64}"
  timeout --kill-after=15 400 "$ENV/bin/python3" bench/serving_trace.py \
    --model "$MODEL" --device cuda --dtype bfloat16 --concurrency ${CONCURRENCY_TRACE:-1 64} \
    --prompt-tokens 128 --output-tokens 128 --perf-analyzer "$PA" --server-log "$OUT/server_trace.log" \
    --set "max_seq_len:1024${SET:+,$SET}" ${TRACE_ARGS:-}
  rc=$?
  step "done (exit $rc)"
  exit $rc
fi

step "bench_serving: Triton (streaming, non-streaming) vs in process, c = $CONCURRENCY"
timeout --kill-after=15 $((BUDGET_S + 180)) "$ENV/bin/python3" bench/bench_serving.py \
  --model "$MODEL" --device cuda --dtype bfloat16 --concurrency $CONCURRENCY \
  --prompt-tokens 128 --output-tokens 128 --rounds 3 --perf-analyzer "$PA" --targets gpu \
  --budget-s "$BUDGET_S" --server-log "$OUT/server.log" --set "max_seq_len:1024${SET:+,$SET}" ${BENCH_ARGS:-}
rc=$?
step "done (exit $rc)"
exit $rc
