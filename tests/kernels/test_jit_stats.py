"""Specialization keys: what varies per step must not change a kernel's key (or a new batch
shape would JIT-compile mid-serving), and what the key does depend on is still seen."""

from __future__ import annotations

import torch

from inflight.kernels import jit_stats
from inflight.kernels.norm import _rms_norm_kernel
from inflight.kernels.paged_attention import _decode_kernel, _reduce_kernel
from inflight.kernels.prefill_attention import _prefill_kernel


def _decode_args(tables: torch.Tensor, seq_lens: torch.Tensor, num_partitions: int) -> tuple:
    q = torch.zeros(4, 8, 64)
    k = torch.zeros(16, 16, 2, 64)
    return (q, k, k, tables, seq_lens, q, q, q, 0.1, 1.0, num_partitions,
            512, 64, 2048, 128, 64, tables.stride(0), 512, 64)


def _decode_key(tables, seq_lens, num_partitions):
    return jit_stats.specialization_key(
        _decode_kernel, _decode_args(tables, seq_lens, num_partitions),
        dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_N=64, SINGLE=False,
             PRECISION="ieee", KV_FP8=False, num_warps=4, num_stages=2))


def test_decode_key_ignores_table_width_partitions_and_metadata_alignment():
    pool = torch.zeros(4096, dtype=torch.int32)
    keys = set()
    for width, offset, num_partitions in ((1, 0, 2), (16, 0, 16), (5, 2, 7), (32, 1, 64)):
        tables = pool[offset:offset + 4 * width].view(4, width)  # offset 1: 4-byte aligned only
        seq_lens = pool[offset + 1000:offset + 1004]
        keys.add(_decode_key(tables, seq_lens, num_partitions))
    assert len(keys) == 1


def test_prefill_and_reduce_keys_ignore_per_step_values():
    pool = torch.zeros(4096, dtype=torch.int32)
    q = torch.zeros(8, 8, 64)
    k = torch.zeros(16, 16, 2, 64)
    keys, reduce_keys = set(), set()
    for width, offset in ((1, 0), (16, 1), (7, 3)):
        tables = pool[offset:offset + 3 * width].view(3, width)
        qsl, lens = pool[offset + 1000:offset + 1004], pool[offset + 2000:offset + 2003]
        keys.add(jit_stats.specialization_key(
            _prefill_kernel, (q, k, k, tables, qsl, lens, q, 0.1, 1.0, 512, 64, 2048, 128, 64,
                              tables.stride(0), 512, 64),
            dict(GROUP=4, HEAD_DIM=64, BLOCK_SIZE=16, BLOCK_M=32, BLOCK_N=32, PRECISION="ieee",
                 KV_FP8=False)))
    for num_partitions in (2, 16, 33):
        reduce_keys.add(jit_stats.specialization_key(
            _reduce_kernel, (q, q, q, num_partitions, 512, 64), dict(HEAD_DIM=64, PART_PAD=64)))
    assert len(keys) == 1 and len(reduce_keys) == 1


def test_fp8_keys_ignore_the_row_count():
    """A decode batch of 1 and a prefill chunk of 64 rows share each FP8 kernel's variant."""
    from inflight.kernels.fp8 import _quantize_kernel, _scale_output_kernel

    acc, s = torch.zeros(64, 256), torch.ones(64)
    scale_keys = {jit_stats.specialization_key(
        _scale_output_kernel, (acc, acc, s, s, s, rows, 256, 256, 256),
        dict(SA_PER_ROW=True, SB_PER_COL=True, HAS_BIAS=False, BLOCK_N=256)) for rows in (1, 16, 33, 64)}
    quantize_keys = {jit_stats.specialization_key(
        _quantize_kernel, (acc[:rows], acc, s, s, 256, 256, 256),
        dict(STATIC=False, EPS=1e-7, BLOCK=256, ONE_PASS=True)) for rows in (1, 16, 33, 64)}
    assert len(scale_keys) == 1 and len(quantize_keys) == 1


def test_int4_keys_ignore_the_row_count():
    """Every decode batch size (and prefill chunk) of one weight shares each INT4 kernel's variant."""
    from inflight.kernels.int4 import MAGIC, _dot_kernel, _fma_kernel

    x, out = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(64, 128, dtype=torch.bfloat16)
    words, scale, counters = torch.zeros(32, 128, dtype=torch.int32), torch.zeros(2, 128), torch.zeros(8)

    def keys(kernel, consts):
        return {jit_stats.specialization_key(
            kernel, (x[:rows], words, scale, scale, scale, out[:rows], scale, counters, rows, 128, 256, 256,
                     128, MAGIC), consts) for rows in (1, 3, 16, 33, 64)}
    common = {"GROUP": 128, "BLOCK_N": 128, "BLOCK_KW": 8, "SPLIT": True, "HAS_ZP": False, "HAS_BIAS": False,
              "EVEN_K": True, "EVEN_N": True}
    assert len(keys(_fma_kernel, {**common, "BLOCK_M": 1, "STAGES": 3})) == 1
    dot = {**common, "BLOCK_M": 16, "GROUP_M": 8, "SWAP_AB": True, "PRECISION": "tf32"}
    assert len(keys(_dot_kernel, dot)) == 1


def test_key_still_sees_data_alignment_and_constexprs():
    """Not vacuous: the hidden-state pointer's alignment and the constexprs are in the key."""
    x = torch.zeros(64)

    def key(t, block):
        return jit_stats.specialization_key(_rms_norm_kernel, (t, t, x, t, 16, 16, 16, 16, 1e-5),
                                            dict(BLOCK=block, ADD_RESIDUAL=False))
    assert key(x[:16], 16) != key(x[1:17], 16)
    assert key(x[:16], 16) != key(x[:16], 32)


def test_every_launched_kernel_is_listed_and_nothing_is_compiled_here():
    names = set(jit_stats.launched_kernels())
    assert {"paged_attention._decode_kernel", "paged_attention._reduce_kernel",
            "prefill_attention._prefill_kernel", "kv_cache._store_kv_kernel", "norm._rms_norm_kernel",
            "rotary._rotary_kernel", "activation._silu_and_mul_kernel", "fp8._scale_output_kernel",
            "fp8._quantize_kernel", "int4._fma_kernel", "int4._dot_kernel",
            "int4._dequantize_kernel"} <= names
    if not torch.cuda.is_available():
        assert jit_stats.num_compiled() == 0  # the interpreter compiles nothing
