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
# Extra tools/launch_triton_server.py flags, e.g. SERVE_ARGS="--exit_timeout 60"
SERVE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup model repository serve serve-triton test test-unit test-e2e bench bench-openai gpu-smoke clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements-nodeps.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip setuptools
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

model: setup
ifeq ($(MODEL),$(DEFAULT_MODEL))
	$(PY) tools/prepare_model.py $(DEFAULT_MODEL)
endif

repository: model
	$(PY) tools/build_repository.py --model $(MODEL) --out $(REPO) --force $(BUILD_ARGS)

# Triton and the OpenAI-compatible frontend together; one Ctrl-C stops both.
serve: repository
	$(PY) tools/serve.py --openai_port $(OPENAI_PORT) --model_repo $(REPO) --host $(HOST) \
		--http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT) --metrics_port $(METRICS_PORT)

# Triton alone.
serve-triton: repository
	$(PY) tools/launch_triton_server.py --model_repo $(REPO) --host $(HOST) \
		--http_port $(HTTP_PORT) --grpc_port $(GRPC_PORT) --metrics_port $(METRICS_PORT) $(SERVE_ARGS)

test: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-unit: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/unit

test-e2e: model
	$(PY) -m pytest -q $(PYTEST_ARGS) tests/e2e

bench: model
	$(PY) tools/bench_engine.py --model $(MODEL)

# The OpenAI frontend's overhead: the same load through it and straight to Triton, one run.
bench-openai: model
	$(PY) tools/bench_openai.py --model $(MODEL)

# On a CUDA machine that has the model folder (the device machine runs tools/gpu_smoke.sh
# stage1 + stage2 instead; see that script).
gpu-smoke: model
	PYTHON=$(PY) bash tools/gpu_smoke.sh local $(MODEL)

clean:
	rm -rf build .pytest_cache
