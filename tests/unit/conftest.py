"""Fixtures shared by the engine test modules."""

from __future__ import annotations

import pytest

from tests.unit.checkpoints import save_tiny_checkpoint
from tests.unit.engine_utils import shared_weights, single_thread


@pytest.fixture(scope="module")
def single_threaded():
    """One torch thread for the module: steadier when other processes share the cores."""
    with single_thread():
        yield


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    """The default model's folder, its weights loaded once for the module's engines."""
    with shared_weights():
        yield smollm2_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (llama3 RoPE) checkpoint, weights shared by the module's engines."""
    path = tmp_path_factory.mktemp("llama3")
    save_tiny_checkpoint("llama3", path)
    with shared_weights():
        yield path
