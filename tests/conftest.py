"""Shared fixtures: where the default model lives, and tiny random checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
