"""What every tier shares: where the default model lives. Imports neither torch nor a model.

Tiers (each conftest imports only what its tier needs):
  tests/unit   pure Python + numpy: control plane, wire contract, config readers (no torch, no weights)
  tests/model  torch on the CPU: HF parity, engine, sampler, tokenizer/detokenizer, tiny checkpoints
  tests/e2e    a real tritonserver on loopback ports
  tests/gpu    CUDA only (marker `gpu`); skipped where CUDA is absent
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# gRPC's fork handlers off, before anything imports grpc. Every server, launcher and frontend
# the tests start is a subprocess.Popen with a preexec_fn (ensemble.supervisor.die_with_parent),
# i.e. a real fork of this process, which holds gRPC clients; gRPC runs its pthread_atfork
# handlers in every such fork, and one of them can wait for ever for gRPC's thread pool to go
# idle (it hung a whole suite run in a launch, grpc/grpc#37259). The children exec at once and
# never use this process's gRPC state, so they need no handler.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"


def default_model_dir() -> Path:
    path = Path(os.environ.get("INFLIGHT_MODEL_DIR", DEFAULT_MODEL_DIR))
    if not (path / "config.json").is_file():
        pytest.fail(f"default model not prepared at {path}: run `make test` (it prepares it) "
                    f"or `python tools/prepare_model.py {path}`")
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return default_model_dir()
