#!/usr/bin/env python3
"""The paged decode kernel reading a bf16 against an FP8 (e4m3) KV cache, on the GPU, with its
tile and pipelining settings swept: does reading half the bytes make it faster, and with which
settings.

    PYTHONPATH=$PWD python3 bench/bench_decode_kv.py [--batch 256] [--contexts 192 1000]

Llama-3.1-8B's attention (32 query heads, 8 KV heads, D 128, blocks of 32 tokens), one layer's
decode over B rows of the given context, blocks scattered over a cache of random values. Times
CUDA-graph replays (median of 25 after warm-up) and prints µs and the GB/s of KV read (2 bytes
an element in bf16, 1 in e4m3) for each (block_n, num_warps, num_stages), with the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from inflight.kernels.paged_attention import choose_num_partitions, paged_decode_attention

HQ, HKV, D, BLOCK = 32, 8, 128, 32


def time_us(fn, reps: int = 25) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_us(lambda: dst.copy_(src)) * 1e-6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[192, 1000])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | copy bandwidth {copy_bandwidth() / 1e12:.2f} TB/s")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| context | KV | block_n | warps | stages | partitions | µs | KV GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        blocks_per_row = -(-context // BLOCK)
        num_blocks = args.batch * blocks_per_row + 8
        tables = torch.randperm(num_blocks, device="cuda")[:args.batch * blocks_per_row].view(args.batch, -1)
        tables = tables.to(torch.int32).contiguous()
        seq_lens = torch.full((args.batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(args.batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        base = torch.randn(2, num_blocks, BLOCK, HKV, D, device="cuda", dtype=torch.bfloat16)
        for name, cache in (("bf16", base), ("e4m3", base.to(torch.float8_e4m3fn))):
            kv_bytes = args.batch * context * HKV * D * 2 * cache.element_size()
            for block_n in (32, 64, 128):
                partitions = choose_num_partitions(args.batch, HKV, context, num_sms, block_n)
                for warps in (4, 8):
                    for stages in (1, 2, 3, 4):
                        def call(block_n=block_n, warps=warps, stages=stages, partitions=partitions):
                            return paged_decode_attention(q, cache, tables, seq_lens, D ** -0.5,
                                                          num_partitions=partitions, block_n=block_n,
                                                          num_warps=warps, num_stages=stages)
                        try:
                            us = time_us(call)
                        except Exception as exc:  # noqa: BLE001 (a config that does not compile)
                            print(f"| {context} | {name} | {block_n} | {warps} | {stages} | {partitions} | "
                                  f"{type(exc).__name__} | |")
                            continue
                        print(f"| {context} | {name} | {block_n} | {warps} | {stages} | {partitions} | "
                              f"{us:.1f} | {kv_bytes / (us * 1e-6) / 1e9:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
