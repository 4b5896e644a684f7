# One-command setup: `make serve` serves the default model, `make test` runs the tests.
# Both create .venv and install everything pinned in requirements*.txt on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEFAULT_MODEL := .cache/models/smollm2-135m-instruct
MODEL ?= $(DEFAULT_MODEL)
REPO ?= build/repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
HOST ?= 127.0.0.1
# Extra tools/build_repository.py flags, e.g. BUILD_ARGS="--batch_scheduler_policy max_utilization"
BUILD_ARGS ?=
# HF PEFT LoRA adapters served by name, e.g. LORA_MODULES="sql=/path/to/peft_dir chat=/path/to/other"
LORA_MODULES ?=
# Extra tools/launch_triton_server.py flags, e.g. SERVE_ARGS="--exit_timeout 60"
SERVE_ARGS ?=
PYTEST_ARGS ?=
# checks/numerics_sweep.py flags, e.g. SWEEP_ARGS="--threads 2 --mkl-isa SSE4_2"
SWEEP_ARGS ?=

.PHONY: setup model repository serve serve-triton test test-unit test-model test-e2e test-gpu \
	test-numerics bench bench-serving bench-openai response-cost preprocessing-cost reliability gpu-smoke nvidia-clients clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-test.txt requirements-nodeps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip setuptools
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-test.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

model: setup
ifeq ($(MODEL),$(DEFAULT_MODEL))
	$(PY) tools/prepare_model.py $(DEFAULT_MODEL)
endif

repository: model
	$(PY) tools/build_repository.py --model $(MODEL) --out $(REPO) --force \
		$(if $(LORA_MODULES),--lora_modules "$(LORA_MODULES)") $(BUILD_ARGS)

# Triton and the OpenAI-compatible frontend together; one Ctrl-C stops both.
serve: repository
	$(PY) tools/serve.py --openai_port $(OPENAI_PORT) --model_repo $(REPO) --host $(HOST) \
		--http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT) --metrics_port $(METRICS_PORT) $(SERVE_ARGS)

# Triton alone.
serve-triton: repository
	$(PY) tools/launch_triton_server.py --model_repo $(REPO) --host $(HOST) \
		--http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT) --metrics_port $(METRICS_PORT) $(SERVE_ARGS)

# Every tier (tests/gpu skips itself without CUDA); CI runs this.
test: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# Control plane and wire formats: pure Python, no torch, no weights. Any Python with pytest and
# numpy runs it without .venv: `make test-unit PY=python3`.
test-unit: $(if $(filter $(VENV)/bin/python,$(PY)),setup)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/unit

# torch on the CPU: HF parity, engine, sampler, tokenizer/detokenizer. INFLIGHT_TEST_THREADS=N
# sets its CPU threads (default 1).
test-model: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/model

test-e2e: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/e2e

# NVIDIA's own client scripts, unchanged, against our servers (ports 8000-8002 must be free).
# NVIDIA_REPO: a checkout of triton-inference-server/tensorrtllm_backend at c2e65b8.
NVIDIA_REPO ?=
nvidia-clients: model
	@test -n "$(NVIDIA_REPO)" || { echo "set NVIDIA_REPO=/path/to/tensorrtllm_backend"; exit 2; }
	$(PY) -m pip install --quiet --no-deps --target .cache/nvidia-client-deps -r requirements-nvidia-clients.txt
	$(PY) checks/nvidia_clients.py --nvidia-repo $(NVIDIA_REPO) --model $(MODEL)

# On a CUDA machine.
test-gpu: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/gpu

# The model tier under threads 1/2/4 x ATen kernels default/avx2/avx512 (those this CPU has).
test-numerics: model
	$(PY) checks/numerics_sweep.py $(SWEEP_ARGS)

bench: model
	$(PY) bench/bench_engine.py --model $(MODEL)

# The OpenAI frontend's overhead: the same load through it and straight to Triton, one run.
# Streaming through Triton vs the engine in process (bench/bench_serving.py; perf_analyzer).
# Extra flags: BENCH_SERVING_ARGS="--concurrency 8 --rounds 2"
BENCH_SERVING_ARGS ?=
bench-serving: model
	$(PY) bench/bench_serving.py --model $(MODEL) $(BENCH_SERVING_ARGS)

# CPU µs per streamed response in each serving process (tiny random model; bench/response_cost.py).
# Extra flags: RESPONSE_COST_ARGS="--concurrency 64 --duration-s 30 --profile tensorrt_llm"
RESPONSE_COST_ARGS ?=
response-cost: model
	$(PY) bench/response_cost.py $(RESPONSE_COST_ARGS)

# The preprocessing step's cost per request at concurrency 1: this checkout vs its model.py at a git
# ref, main by default (bench/preprocessing_cost.py). E.g. PREPROCESSING_COST_ARGS="--ref HEAD~1"
preprocessing-cost: model
	$(PY) bench/preprocessing_cost.py $(PREPROCESSING_COST_ARGS)

bench-openai: model
	$(PY) bench/bench_openai.py --model $(MODEL)

# Malformed requests next to good streams, cancellations, fault isolation, drain, and last the
# crash-and-restart phase under the real launcher (RELIABILITY_ARGS=--skip-crashers leaves it out).
RELIABILITY_ARGS ?=
reliability: model
	$(PY) checks/reliability.py --model $(MODEL) $(RELIABILITY_ARGS)

# On a CUDA machine that has the model folder (the device machine runs checks/gpu_smoke.sh
# stage1 + stage2 instead; see that script).
gpu-smoke: model
	PYTHON=$(PY) bash checks/gpu_smoke.sh local $(MODEL)

clean:
	rm -rf build .pytest_cache
