"""The GPU tier: tests that need CUDA. Every test here gets the `gpu` marker and, where CUDA is
absent (CI, the 2-core CPU machines), is skipped with the reason. On a CUDA machine:
`make test-gpu` (or `pytest tests/gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
