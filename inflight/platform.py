"""Device policy in one place: which device and dtype, how host data reaches the device, and the
CPU-specific tuning that the model and loader apply.

Everything here is a decision about the machine, not about the model: model code asks these
functions instead of branching on `device.type` itself.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from inflight.intmath import cdiv

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA when available, else the CPU; an explicit CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device '{name}' was asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """Maps "auto|float32|bfloat16|float16" to a torch dtype.

    "auto" is float32 on the CPU (bf16/fp16 matmuls are slow there) and bfloat16 on CUDA
    (float16 when the GPU has no bf16 support).
    """
    key = name.strip().lower()
    if key == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; expected one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[key]


# ----- host -> device ------------------------------------------------------------------------

def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor -> `device` without a host sync.

    A plain `.to("cuda")` from pageable memory synchronises the stream; staging through pinned
    memory lets the copy queue behind the GPU's pending work instead.
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


# Every field starts 16-byte aligned: any dtype can view its slice, and Triton, which
# specializes a kernel on whether each pointer is 16-byte aligned, sees the same alignment
# whatever the step's sizes (else a new batch shape can cost a JIT compile mid-serving).
_ALIGN_BYTES = 16


def pack_to_device(fields: Sequence[tuple[Sequence | torch.Tensor, torch.dtype]],
                   device: torch.device | str) -> list[torch.Tensor]:
    """Copies several small host arrays to `device` in one transfer; returns 1-D tensors.

    Each field is `(values, dtype)`. On CUDA the fields are laid out in one pinned byte buffer
    and copied with a single non-blocking copy (no host sync; the caching host allocator keeps
    the buffer alive until the copy has run), then viewed back per field on the device. On the
    CPU the host tensors are returned as they are.
    """
    device = torch.device(device)
    host = [v.to(dtype).reshape(-1) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype)
            for v, dtype in fields]
    if device.type != "cuda":
        return [t.to(device) for t in host]
    offsets, total = [], 0
    for t in host:
        offsets.append(total)
        total += cdiv(t.numel() * t.element_size(), _ALIGN_BYTES) * _ALIGN_BYTES
    staging = torch.empty(max(total, _ALIGN_BYTES), dtype=torch.uint8, pin_memory=True)
    for t, start in zip(host, offsets):
        staging[start:start + t.numel() * t.element_size()].view(t.dtype).copy_(t)
    on_device = staging.to(device, non_blocking=True)
    return [on_device[start:start + t.numel() * t.element_size()].view(t.dtype)
            for t, start in zip(host, offsets)]


# ----- CPU tuning ----------------------------------------------------------------------------

# Per-step token budget when max_num_tokens is "auto". On the CPU a step's time grows with its
# tokens (about 1 s per ~100 prompt tokens for SmolLM2-135M on one core), and every stream in
# flight waits for the whole step: the budget bounds the gap a long prompt's prefill chunks
# put between two tokens of the other streams. CUDA keeps TensorRT-LLM's default, and so does
# an engine without chunked context, where a whole prompt must fit in one step.
CPU_MAX_NUM_TOKENS = 256
CUDA_MAX_NUM_TOKENS = 8192


def default_max_num_tokens(device: torch.device | str, chunked_context: bool) -> int:
    if torch.device(device).type == "cuda" or not chunked_context:
        return CUDA_MAX_NUM_TOKENS
    return CPU_MAX_NUM_TOKENS


def apply_cpu_threads() -> None:
    """INFLIGHT_NUM_THREADS=N sets torch's intra-op CPU threads (default: torch's own, one per
    core). On a CPU shared with other busy processes one thread can be several times faster
    than all cores: OpenMP threads spin at every op's barrier while a sibling is descheduled."""
    value = os.environ.get("INFLIGHT_NUM_THREADS", "").strip()
    if not value:
        return
    try:
        num_threads = int(value)
    except ValueError:
        raise RuntimeError(f"INFLIGHT_NUM_THREADS must be a positive integer, got '{value}'") from None
    if num_threads < 1:
        raise RuntimeError(f"INFLIGHT_NUM_THREADS must be a positive integer, got '{value}'")
    torch.set_num_threads(num_threads)
    logger.info("CPU intra-op threads: %d (INFLIGHT_NUM_THREADS)", num_threads)


def uses_cpu_gemm_layout(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decoder projection weights are stored transposed in memory (column-major).

    `F.linear(x, W)` computes x @ W^T. With W row-major that is MKL's "NT" sgemm; with W's
    storage transposed it is the "NN" kernel, which on the AVX-512 CPUs measured for this
    project is about 20 % faster for the 2..64-row products of batched decode (same speed at
    one row). Only the layout changes: names, shapes ([out, in]) and values stay the
    checkpoint's, and `.contiguous()` gives the row-major copy back.
    """
    return device.type == "cpu" and dtype == torch.float32


def to_cpu_gemm_layout(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] with the same values, stored column-major (see uses_cpu_gemm_layout)."""
    return weight.t().contiguous().t()


# Row counts of the CPU fp32 LM-head product that are padded up to _CPU_LM_HEAD_PAD_TO: MKL's
# sgemm against the row-major [vocab, hidden] head is ~1.5x slower for 4..15 rows than for 16
# (measured on the project's AVX-512 CPUs); the zero rows are free.
_CPU_LM_HEAD_PAD_FROM = 4
_CPU_LM_HEAD_PAD_TO = 16


def lm_head_padded_rows(num_rows: int, device: torch.device, dtype: torch.dtype) -> int:
    """How many rows to run the LM-head product with for `num_rows` real ones (>= num_rows)."""
    if (device.type == "cpu" and dtype == torch.float32
            and _CPU_LM_HEAD_PAD_FROM <= num_rows < _CPU_LM_HEAD_PAD_TO):
        return _CPU_LM_HEAD_PAD_TO
    return num_rows


def packs_projections(device: torch.device) -> bool:
    """Whether q/k/v and gate/up run as one GEMM each (`qkv_proj`, `gate_up_proj`).

    On CUDA fewer, larger GEMMs mean fewer launches and better tiles. On the CPU (fp32, MKL,
    one thread, SmolLM2-135M) packing measured no faster: one [2I, H] sgemm ran slower than
    two [I, H] ones for 32-256 rows, and whole decode steps of 8-32 rows and a 128-token
    prefill were 9-16 % slower packed (batch 1 about even), so the CPU keeps the checkpoint's
    separate projections.
    """
    return device.type == "cuda"


# ----- memory ----------------------------------------------------------------------------------

def cuda_memory_for_kv(device: torch.device, peak_allocated_bytes: int) -> int:
    """Bytes free for the KV cache after the weights and the runtime buffers (TensorRT-LLM's
    meaning of `kv_cache_free_gpu_mem_fraction`'s base).

    Call after a warm-up step at the largest batch with the peak memory statistics reset before
    it: `peak_allocated_bytes` is `torch.cuda.max_memory_allocated`. Memory the caching
    allocator holds but does not use now is reusable; the step's transient peak above what is
    allocated now must stay free for later steps.
    """
    free_bytes, _ = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    cached_unused = torch.cuda.memory_reserved(device) - allocated
    runtime_bytes = max(peak_allocated_bytes - allocated, 0)
    return max(free_bytes + cached_unused - runtime_bytes, 0)


# ----- how steps run -------------------------------------------------------------------------

def uses_cuda_graphs(requested: bool | None, device: torch.device, backend_supports: bool) -> bool:
    """`cuda_graph_mode`: None (auto) means on wherever it can be (CUDA with an attention
    backend that supports graphs), so the default is the fast path; True/False as written.
    True off CUDA is ignored with a warning (an explicit `device` cpu is refused by the config)."""
    if device.type != "cuda":
        if requested:
            logger.warning("cuda_graph_mode is ignored: the engine runs on %s", device)
        return False
    return backend_supports if requested is None else requested


def overlaps_steps(requested: bool | None, device: torch.device) -> bool:
    """`enable_overlap_scheduler`: None (auto) means on CUDA, off on the CPU (where the host
    computes the step itself, so there is nothing to overlap); True/False as written."""
    return device.type == "cuda" if requested is None else requested
