"""One-row projections through the Triton GEMV (`inflight.kernels.gemv`) where it beats cuBLAS.

A batch-1 decode step multiplies one row by every weight of the model; there the step's time is
the weights' read time. Measured on an H100 (bench/bench_gemv.py, bf16, 2026-11-28), at one row
`skinny_linear` against cuBLAS: 1.04x on Llama-3.2-1B's gate/up, 1.06x on its down, 1.11x on its
LM head; 1.01-1.09x on every Llama-3.1-8B projection; but 0.82-0.88x on the 1B's q/k/v and o
and the 8B's o shard at tensor parallelism 2 (4-8 M weights: too little to fill the SMs
either way). With programmatic dependent launch (`inflight.kernels._common.pdl_options`, sm_90)
the GEMV reads its first weight tiles while the kernel before it still runs: then 1.05x on the
1B's q/k/v, 1.04-1.15x on the 8B's tp=2 shards, 0.95x on the 1B's o (whose cuBLAS split-K
needs a second kernel in the engine). From two rows cuBLAS is as fast or faster. Hence the
rule: one row and at least `min_weights` weights (16 M without PDL, the smallest 8B
projection; 4 M with it, the smallest projection of either model).

`use_skinny_gemv` applies it to a loaded model's plain bf16/fp16 `nn.Linear` projections and LM
head on CUDA by giving each its own forward (the module, its type and its weights stay as they
are, so LoRA, the loader and the tensor-parallel shards see no difference). Quantized
projections keep their own kernels.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

MIN_WEIGHTS = 1 << 24
MIN_WEIGHTS_PDL = 1 << 22


def min_weights(device: torch.device) -> int:
    """The smallest weight routed to the GEMV on `device`."""
    from inflight.kernels._common import pdl_options
    return MIN_WEIGHTS_PDL if pdl_options(device)["PDL"] else MIN_WEIGHTS


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0] == 1:  # a CUDA graph's batch-1 bucket: fixed per capture
        from inflight.kernels.gemv import skinny_linear
        return skinny_linear(x, self.weight, bias=self.bias)
    return F.linear(x, self.weight, self.bias)


def use_skinny_gemv(model: nn.Module) -> int:
    """Routes one-row inputs of `model`'s large plain projections to the GEMV; returns how many
    modules now do. Call once after loading, on CUDA with bf16 or fp16 weights."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and weight is not None and weight.is_cuda
                and weight.dtype in (torch.bfloat16, torch.float16)
                and weight.numel() >= min_weights(weight.device) and weight.stride(-1) == 1):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
