"""Kernel tier: each Triton kernel against its torch reference (inflight/kernels/reference.py).

On a machine with CUDA the kernels run compiled; elsewhere they run in Triton's CPU interpreter,
which must be chosen (TRITON_INTERPRET=1) before triton is first imported: hence here, before
any test module imports a kernel. INFLIGHT_KERNELS_INTERPRET=1 forces the interpreter on CUDA.
The interpreter is slow (~1 ms per tl op per program), so CPU shapes are tiny; larger shapes
are parametrized only when CUDA is present.

Inputs are random on every run: the session seed is in the report header, and each test's
generator is seeded from it and the test id, so `KERNEL_TEST_SEED=<seed>` replays a run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import zlib

import pytest
import torch

from tests.kernels.helpers import ON_CUDA

if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# Without triton only the import-contract tests run.
collect_ignore_glob = [] if HAVE_TRITON else ["test_[!p]*.py"]

SEED = int(os.environ.get("KERNEL_TEST_SEED", random.SystemRandom().randrange(2 ** 31)))


def pytest_configure(config):
    # The 3.6 interpreter converts 1-element arrays to ints through a numpy deprecation path.
    config.addinivalue_line("filterwarnings",
                            "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_report_header(config):
    mode = "compiled on CUDA" if ON_CUDA else "Triton interpreter on CPU"
    return f"kernels: {mode}; KERNEL_TEST_SEED={SEED}"


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def gen(request, device) -> torch.Generator:
    """Random generator for the test, seeded from the session seed and the test id."""
    g = torch.Generator(device=device)
    g.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))
    return g
