"""Helpers shared by the kernel tests (no triton import here)."""

from __future__ import annotations

import os

import torch

ON_CUDA = torch.cuda.is_available() and os.environ.get("INFLIGHT_KERNELS_INTERPRET") != "1"


def randn(shape, dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dtype)


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN: any element the kernel fails to write shows up."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def cuda_only(values: list, cpu_values: list) -> list:
    """Parameter values for this machine: the bigger set only where kernels are compiled."""
    return values if ON_CUDA else cpu_values


def paged_cache(gen: torch.Generator, dtype: torch.dtype, seq_lens: list[int], block_size: int,
                num_kv_heads: int, head_dim: int, spare_blocks: int = 3):
    """A random cache [2, num_blocks, block_size, Hkv, D] and int32 block tables [B, max_blocks]
    giving each row its own blocks in shuffled order (spare blocks stay unreferenced).
    Table entries past a row's context point far out of the cache: a kernel that read them
    would fault or read garbage."""
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    device = gen.device
    kv_cache = randn((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, gen)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    max_blocks = max(needed + [1]) + 1
    tables = torch.full((len(seq_lens), max_blocks), 1 << 30, dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[used:used + n]
        used += n
    return kv_cache, tables
