#!/usr/bin/env bash
# Build what bench/gpu_openai.sh needs besides .device/serving (bench/gpu_serving_pack.sh) and
# cannot download on the GPU machine (no network):
#
#   bash bench/gpu_openai_pack.sh        # here, after `make setup`; writes .device/openai/
#
# One file, .device/openai/frontend.tar.xz (a few MiB): site/, the OpenAI frontend's and
# bench/bench_openai.py's packages for the server's Python 3.12 environment, unpacked from cp312
# manylinux x86_64 wheels at requirements.txt's versions (fastapi, starlette, uvicorn, uvloop,
# httptools, httpx and what they import). pydantic, tritonclient, grpcio and numpy come from
# .device/serving; transformers and torch from the image.
# PY_VERSION=3.11 builds the same for this machine's Python (to check the list in a clean venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PY_VERSION=${PY_VERSION:-3.12}
OUT=${PACK_OUT:-.device/openai}
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$OUT" "$STAGE/site"
pin() { grep -E "^($1)==" requirements.txt; }
"$PY" -m pip install --quiet --no-deps --only-binary=:all: --target "$STAGE/site" \
  --python-version "$PY_VERSION" --implementation cp --abi "cp${PY_VERSION/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  $(pin 'fastapi|uvicorn|uvloop|httptools|httpx') \
  starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 click==8.5.1 h11==0.16.0 \
  httpcore==1.0.9 anyio==4.16.0 idna==3.20 certifi==2026.10.18 sniffio==1.3.1 \
  typing-extensions==4.16.0
rm -rf "$STAGE/site/bin"  # scripts written for this machine's interpreter
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$STAGE" -cf - site | xz -T2 -6 > "$OUT/frontend.tar.xz"
echo "$OUT/frontend.tar.xz: $(( $(stat -c %s "$OUT/frontend.tar.xz") / 1024 )) KiB"
