"""silu_and_mul against HF's act(gate) * up in the activation dtype."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels.activation import silu_and_mul
from inflight.kernels.reference import elementwise_tol, silu_and_mul_ref
from tests.kernels.helpers import cuda_only, poisoned, randn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", cuda_only([100, 1027, 14336], [100, 1027]))
def test_silu_and_mul(gen, dtype, inter):
    gate_up = randn((3, 2 * inter), dtype, gen, scale=4.0)
    out = poisoned((3, inter), dtype, gen.device)
    assert silu_and_mul(gate_up, out=out) is out
    # Two roundings (silu's output, the product); magnitudes up to ~|4 sigma|^2.
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **elementwise_tol(dtype, 2, 300.0))


def test_strided_rows_and_single_token(gen):
    wide = randn((2, 300), torch.bfloat16, gen)
    gate_up = wide[:1, :256]  # one token, row stride 300
    out = silu_and_mul(gate_up)
    assert out.shape == (1, 128)
    torch.testing.assert_close(out, silu_and_mul_ref(gate_up), **elementwise_tol(torch.bfloat16, 2, 20.0))


def test_rejects_odd_width(gen):
    with pytest.raises(ValueError):
        silu_and_mul(randn((2, 7), torch.float32, gen))
