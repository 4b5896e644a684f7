"""The model tier: torch on the CPU, the SmolLM2 weights and tiny random checkpoints.

One knob sets the CPU threads for the whole tier: INFLIGHT_TEST_THREADS (default 1). It is applied
to torch before the first test and exported as INFLIGHT_NUM_THREADS, which every `Worker` built
here reads, so an engine cannot quietly run with another count. `checks/numerics_sweep.py` runs
the tier under several counts (and CPU kernel sets) through it. One thread is the default
because the test machines share 2 cores with other jobs: with 2 OpenMP threads every parallel
region waits at a barrier for a thread that may not be running (10-20x slower under load).
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers

from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import shared_weights

THREADS_ENV = "INFLIGHT_TEST_THREADS"


def num_test_threads() -> int:
    value = os.environ.get(THREADS_ENV, "1").strip() or "1"
    if not value.isdigit() or int(value) < 1:
        raise pytest.UsageError(f"{THREADS_ENV} must be a positive integer, got '{value}'")
    return int(value)


def pytest_report_header(config):
    # Read back from torch, not from the environment: the sweep checks this line.
    return (f"model tier: torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")


@pytest.fixture(scope="package", autouse=True)
def cpu_threads():
    """The tier's thread count, for torch here and for every Worker (INFLIGHT_NUM_THREADS)."""
    num_threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFLIGHT_NUM_THREADS", str(num_threads))
        yield num_threads
        assert torch.get_num_threads() == num_threads, "a test changed the thread count"


def pytest_configure(config):
    torch.set_num_threads(num_test_threads())


@pytest.fixture(scope="session")
def smol(smollm2_dir):
    """The default model's folder, its weights loaded once for every engine of the session."""
    with shared_weights():
        yield smollm2_dir


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    """Hugging Face's SmolLM2 in fp32: the reference the model and engine are held to."""
    return transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (llama3 RoPE) checkpoint, weights shared by the module's engines."""
    path = tmp_path_factory.mktemp("llama3")
    save_tiny_checkpoint("llama3", path)
    with shared_weights():
        yield path
