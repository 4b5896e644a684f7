#!/usr/bin/env bash
# Guided decoding on CUDA, in one command on the device machine (repository root). The GPU image
# has no xgrammar and no network, so its wheels travel with the work tree:
#
#   bash checks/gpu_guided.sh prepare   # here: xgrammar's CPython 3.12 wheels -> .cache/gpu-wheels
#   bash checks/gpu_guided.sh           # device (carry .cache/gpu-wheels): tests/gpu/test_guided_cuda.py
#
# The device run installs the wheels (versions from requirements.txt, --no-deps) into a scratch
# folder on PYTHONPATH, leaving the image's packages alone, and writes guided.log to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.cache/gpu-wheels}
pins=$(grep -E '^(xgrammar|apache-tvm-ffi)==' requirements.txt)
# xgrammar imports pydantic, which the GPU image lacks: its stack travels too (the versions the
# set-up resolves here; pydantic itself is pinned in requirements.txt).
pins="$pins $(grep -E '^pydantic==' requirements.txt) pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5"

if [[ ${1:-run} == prepare ]]; then
  PIP=${PIP:-.venv/bin/pip}
  # shellcheck disable=SC2086
  $PIP download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" $pins
  ls -la "$WHEELS"
  exit 0
fi

PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_guided}
SITE=$(mktemp -d)
mkdir -p "$OUT"
# shellcheck disable=SC2086
$PY -m pip install --quiet --no-deps --no-index --find-links "$WHEELS" --target "$SITE" $pins
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
$PY -c 'import xgrammar, torch; print("xgrammar ok | torch", torch.__version__, "| cuda", torch.cuda.is_available())' \
  2>&1 | tee "$OUT/guided.log"
timeout 300 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_guided_cuda.py 2>&1 | tee -a "$OUT/guided.log"
