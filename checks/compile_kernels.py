#!/usr/bin/env python3
"""Compiles every kernel of inflight/kernels for Hopper (sm_90) on any machine, no GPU needed.

    .venv/bin/python checks/compile_kernels.py     # ~1 minute of CPU

Triton's wheel carries LLVM and ptxas, so the whole pipeline down to SASS runs here. For each
kernel at the Llama-3.1-8B specialisations the wrappers launch (bf16, D 128, KV block 32, G 4,
default tiles; plus fp32/fp16 and D 64 variants) it prints shared memory, registers per thread,
spill bytes (ptxas -v) and which MMA the dots became. Run it after changing a kernel: a compile
error, a spill, or shared memory past 227 KiB here is one on the GPU too. Exit 1 on any failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inflight.kernels import activation, int4, int4_config, kv_cache, norm, paged_attention, prefill_attention, rotary

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
FLOAT_ARGS = {"scale_log2", "eps", "k_scale", "v_scale"}
I64_ARGS = {"stride_plane"}  # may pass 2^31 elements for a large cache


def signature(fn, pointers: dict[str, str], consts: dict) -> tuple[dict, dict]:
    """Types by rule: *_ptr from `pointers`, floats by name, every other runtime arg i32; the
    16-byte divisibility the launcher infers for aligned pointers and strides is declared."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name in I64_ARGS else "i32"
            if name.startswith("stride_") and name != "stride_bt":  # max_blocks: any number
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_one(label: str, kernel, pointers: dict[str, str], consts: dict, num_warps: int,
                num_stages: int) -> bool:
    fn = kernel
    sig, attrs = signature(fn, pointers, consts)
    try:
        compiled = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as exc:  # report every kernel, then fail
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:1500]}")
        return False
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    log = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    os.unlink(f.name)
    regs = max(map(int, re.findall(r"Used (\d+) registers", log)), default=-1)
    spills = max(map(int, re.findall(r"(\d+) bytes spill stores", log)), default=0)
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
    smem = compiled.metadata.shared
    ok = smem <= 227 * 1024
    print(f"{'ok  ' if ok else 'FAIL'} {label:<40} smem {smem:>7} B  regs {regs:>4}  spills {spills:>6} B  {mma}")
    return ok


def attention_pointers(dt: str, names: list[str]) -> dict[str, str]:
    ints = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"}
    return {n: "i32" if n in ints else "fp32" if n.startswith("part_") else dt for n in names}


def compile_int4() -> bool:
    """The W4A16 GEMM at the configurations the heuristic picks for the 8B gate_up projection
    (one row: CUDA cores; 16 and 64 rows: tensor cores, weights on the MMA's M side; from
    DEQUANT_MIN_M rows the engine dequantizes and calls cuBLAS instead), symmetric groups of
    128, bf16, and its dequantize kernel."""
    ok = True
    n, k, group = 28672, 4096, 128
    pointers = {"x_ptr": "bf16", "w_ptr": "i32", "scale_ptr": "bf16", "zp_ptr": "bf16", "bias_ptr": "bf16",
                "out_ptr": "bf16", "partial_ptr": "fp32", "count_ptr": "i32"}
    for m in (1, 16, 64):
        cfg = int4_config.choose_config(m, n, k, group)
        consts = dict(GROUP=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_k // int4_config.PACK,
                      SPLIT=cfg.split_k > 1, HAS_ZP=False, HAS_BIAS=False, EVEN_K=True, EVEN_N=True)
        if cfg.path == "fma":
            kernel, consts = int4._fma_kernel, {**consts, "STAGES": cfg.num_stages}
        else:
            kernel, consts = int4._dot_kernel, {**consts, "GROUP_M": cfg.group_m, "SWAP_AB": cfg.swap_ab,
                                                "PRECISION": "tf32"}
        ok &= compile_one(f"int4 {cfg.path} M={m} {cfg.block_m}x{cfg.block_n}x{cfg.block_k}", kernel, pointers,
                          consts, cfg.num_warps, cfg.num_stages)
    ok &= compile_one("int4 dequantize", int4._dequantize_kernel,
                      {"w_ptr": "i32", "scale_ptr": "bf16", "zp_ptr": "bf16", "out_ptr": "bf16"},
                      dict(GROUP=group, BLOCK_N=int4.DEQUANT_BLOCK_N, BLOCK_KW=int4.DEQUANT_BLOCK_K // int4_config.PACK,
                           HAS_ZP=False), 4, 1)
    return ok


def main() -> int:
    ok = True
    dec = paged_attention._decode_kernel
    dec_ptrs = [n for n in dec.arg_names if n.endswith("_ptr")]
    for dt, d, g, bs, fp8 in (("bf16", 128, 4, 32, False), ("fp16", 64, 8, 16, False),
                              ("fp32", 128, 4, 32, False), ("bf16", 128, 4, 32, True)):
        block_n = paged_attention.FP32_BLOCK_N if dt == "fp32" else paged_attention.DEFAULT_BLOCK_N
        stages = paged_attention.FP8_NUM_STAGES if fp8 else paged_attention.DEFAULT_NUM_STAGES
        for single in (True, False):
            consts = dict(GROUP=g, GROUP_PAD=16, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=block_n, SINGLE=single,
                          PRECISION="ieee" if dt == "fp32" else "tf32", KV_FP8=fp8)
            pointers = attention_pointers(dt, dec_ptrs)
            if fp8:  # the cache's e4m3 bytes, read as uint8
                pointers.update(k_ptr="u8", v_ptr="u8")
            ok &= compile_one(f"decode {dt}{' e4m3 KV' if fp8 else ''} D={d} G={g} P{'=1' if single else '>1'}",
                              dec, pointers, consts, 4, stages)
    ok &= compile_one("decode reduce P<=64", paged_attention._reduce_kernel,
                      {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": "bf16"},
                      dict(HEAD_DIM=128, PART_PAD=64), 4, 1)
    pre = prefill_attention._prefill_kernel
    pre_ptrs = [n for n in pre.arg_names if n.endswith("_ptr")]
    for dt, torch_dt, d, g in (("bf16", torch.bfloat16, 128, 4), ("bf16", torch.bfloat16, 64, 3),
                               ("fp16", torch.float16, 128, 8), ("fp32", torch.float32, 128, 4)):
        for fp8 in (False, True) if (dt, d) == ("bf16", 128) else (False,):
            bm, bn, w, s = prefill_attention.default_tiles(torch_dt, d, narrow=fp8)
            consts = dict(GROUP=g, HEAD_DIM=d, BLOCK_SIZE=32, BLOCK_M=bm, BLOCK_N=bn,
                          PRECISION="ieee" if dt == "fp32" else "tf32", KV_FP8=fp8)
            pointers = attention_pointers(dt, pre_ptrs)
            if fp8:
                pointers.update(k_ptr="u8", v_ptr="u8")
            ok &= compile_one(f"prefill {dt}{' e4m3 KV' if fp8 else ''} D={d} G={g} {bm}x{bn} w{w} s{s}",
                              pre, pointers, consts, w, s)
    ok &= compile_one("store_kv_cache bf16", kv_cache._store_kv_kernel,
                      {"k_ptr": "bf16", "v_ptr": "bf16", "cache_ptr": "bf16", "slot_ptr": "i64"},
                      dict(BLOCK_SIZE=32, HEADS_PAD=8, DIM_PAD=128, FP8=False), 4, 1)
    for add in (False, True):
        ok &= compile_one(f"rms_norm bf16 H=4096 add={add}", norm._rms_norm_kernel,
                          {"x_ptr": "bf16", "residual_ptr": "bf16", "weight_ptr": "bf16", "out_ptr": "bf16"},
                          dict(BLOCK=4096, ADD_RESIDUAL=add), 8, 1)
    ok &= compile_one("apply_rotary bf16 32+8 heads", rotary._rotary_kernel,
                      {"q_ptr": "bf16", "k_ptr": "bf16", "pos_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32"},
                      dict(HQ_PAD=32, HK_PAD=8, HALF_PAD=64), 4, 1)
    ok &= compile_one("silu_and_mul bf16", activation._silu_and_mul_kernel,
                      {"x_ptr": "bf16", "out_ptr": "bf16"}, dict(BLOCK=activation.BLOCK), 4, 1)
    ok &= compile_int4()
    print("all kernels compile for sm_90" if ok else "SOME KERNELS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
