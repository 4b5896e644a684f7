#!/usr/bin/env bash
# Build what bench/gpu_serving.sh needs on the GPU machine and cannot download there (no network):
#
#   bash bench/gpu_serving_pack.sh        # here, after `make setup`; writes .device/serving/
#
# then run, on the device machine, `bash bench/gpu_serving.sh` carrying `.device/serving`
# (gitignored). One file, .device/serving/serving.tar.xz (< 64 MiB), holds:
#   site/   packages for the server's Python 3.12 environment, cp312 wheels unpacked: numpy 1.26.4
#           (the python backend stub of Triton 2.51 corrupts BYTES tensors with numpy 2),
#           tritonclient (gRPC) + grpcio + protobuf + python-rapidjson, msgpack (the engine
#           process's wire), xgrammar + pydantic (guided decoding is on in the default repository),
#           perf_analyzer 2.60 (site/perf_analyzer/bin/perf_analyzer: glibc 2.38, the GPU image has 2.39),
#           and the tritonserver 2.51 binary, python backend and 3.12 stub from nvidia-pytriton
#           (pytriton/ + nvidia_pytriton.libs/, without the bundled libpython3.13)
#   tokenizer/   the default model's tokenizer (SmolLM2), used with the random 1B-shaped weights
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.device/serving
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$OUT" "$STAGE/site" "$STAGE/tokenizer"

"$PY" -m pip install --quiet --no-deps --only-binary=:all: --target "$STAGE/site" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_38_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  numpy==1.26.4 tritonclient==2.73.0 grpcio==1.85.1 protobuf==6.33.6 msgpack==1.2.4 \
  perf-analyzer==2.60.0 python-rapidjson==1.25 \
  $(grep -E '^(xgrammar|apache-tvm-ffi|pydantic)==' requirements.txt) \
  pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5

SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SRC="$SITE/pytriton/tritonserver"
DST="$STAGE/site/pytriton/tritonserver"
mkdir -p "$DST/python_backend_stubs/3.12" "$DST/backends/python"
touch "$STAGE/site/pytriton/__init__.py"  # launch_triton_server.py only looks the package up
cp -r "$SRC/bin" "$SRC/caches" "$DST/"
cp "$SRC/backends/python/"*.so "$SRC/backends/python/"*.py "$DST/backends/python/"
cp "$SRC/python_backend_stubs/3.12/triton_python_backend_stub" "$DST/python_backend_stubs/3.12/"
cp -r "$SITE/nvidia_pytriton.libs" "$STAGE/site/"
rm -f "$STAGE/site/nvidia_pytriton.libs/"libpython3*13*
rm -rf "$STAGE/site/bin"  # scripts written for this machine's interpreter

cp .cache/models/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,chat_template.jinja} \
  "$STAGE/tokenizer/"
find "$STAGE" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$STAGE" -cf - site tokenizer | xz -T2 -6 > "$OUT/serving.tar.xz"
size=$(stat -c %s "$OUT/serving.tar.xz")
echo "$OUT/serving.tar.xz: $((size / 1048576)) MiB (the device tool carries at most 64 MiB)"
(( size < 64 * 1048576 )) || { echo "too large to carry" >&2; exit 1; }
