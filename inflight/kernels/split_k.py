"""The split-K epilogue that the skinny GEMV (`gemv`) and the 4-bit GEMM (`int4`) share, and the
SM count their heuristics size grids by.

Split-K: each of the SPLIT_K programs (grid axis 1) of an output tile writes its fp32 partial
([SPLIT_K, M, N]) and counts its arrival on the tile's int32 counter (acq_rel); the last to arrive
sums the partials in split order, so the result does not depend on the arrival order (bitwise
reproducible), adds the bias, writes out and zeroes the counter for the next launch. One launch,
no memset, no host sync: capturable in a CUDA graph. One counter buffer must not serve two
launches at once.
"""

from __future__ import annotations

import functools

import torch

from inflight.kernels._common import tl, triton

DEFAULT_NUM_SMS = 132  # H100 SXM; used off CUDA (the interpreter), so CPU tests pick what an H100 would


@triton.jit
def _store_out(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _finish(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, partial_ptr, count_ptr, tile,
            SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (+ bias) to out; with split-K: write the partial, count the
    arrival, and let the tile's last program reduce the partials in split order."""
    if SPLIT:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        part = partial_ptr + offs_m[:, None] * N + offs_n[None, :]  # partials [SPLIT_K, M, N]
        tl.store(part + tl.program_id(1) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the one-thread release
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            total = tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
            for split in range(1, tl.num_programs(1)):
                total += tl.load(part + split * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _store_out(total, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0)  # zero again for the next launch
    else:
        _store_out(acc, offs_m, offs_n, M, N, out_ptr, stride_om, bias_ptr, HAS_BIAS)


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of `device`; DEFAULT_NUM_SMS off CUDA (the interpreter)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _device_sms(device.index if device.index is not None else torch.cuda.current_device())
