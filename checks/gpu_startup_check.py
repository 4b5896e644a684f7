"""GPU start-up check: the warm-up step, the KV cache sized after it, and the largest step for real.

    python checks/gpu_startup_check.py --model DIR [--max-batch-size 512] [--max-num-tokens 8192]
    python checks/gpu_startup_check.py --model DIR --device cpu --max-batch-size 8 --max-num-tokens 64
                                                     # a dry run of the script (no warm-up on CPU)

Starts an engine on CUDA (bf16) the way the server does, with `kv_cache_free_gpu_mem_fraction`
0.9 and no token cap, so the fraction decides the cache size. Prints the weights, the warm-up
step's peak, the cache, and the memory left free (about 10 % of what was free after the
warm-up); then fills the batch with `max_batch_size` requests whose prompts add up to
`max_num_tokens`, generates a few tokens, and prints the peak during that. Exit status 0 when
every request finished (a step that runs out of memory fails its requests).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import Request
from inflight.engine.llm_engine import LLMEngine

GIB = 2 ** 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--num-tokens", type=int, default=4, help="tokens generated per request")
    args = parser.parse_args()
    on_cuda = torch.device(args.device).type == "cuda"
    config = ExecutorConfig(device=args.device, dtype="bfloat16" if on_cuda else "float32",
                            max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                            kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.9))
    if on_cuda:
        free_at_start, total = torch.cuda.mem_get_info()
        print(f"GPU {torch.cuda.get_device_name()}: {free_at_start / GIB:.2f} of {total / GIB:.2f} GiB free")
    engine = LLMEngine.from_dir(str(args.model), config)
    worker = engine.worker
    kv_bytes = sum(c.numel() * c.element_size() for c in worker.kv_caches)
    weight_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    print(f"weights {weight_bytes / GIB:.2f} GiB; warm-up step peak {worker.peak_step_bytes / GIB:.2f} GiB "
          f"(weights included); KV cache {worker.num_blocks} blocks x {worker.block_size} tokens = "
          f"{kv_bytes / GIB:.2f} GiB")
    ok = True
    if on_cuda:
        free_after, _ = torch.cuda.mem_get_info()
        print(f"free after the KV allocation: {free_after / GIB:.2f} GiB")
        torch.cuda.reset_peak_memory_stats()

    num_rows = min(args.max_batch_size, args.max_num_tokens)
    prompt_len = max(1, min(args.max_num_tokens // num_rows, worker.max_seq_len - args.num_tokens))
    vocab = worker.model_config.vocab_size
    for i in range(num_rows):
        engine.add_request(Request([(i * 131 + j) % vocab for j in range(prompt_len)], args.num_tokens,
                                   end_id=-1))
    steps = 0
    while engine.has_unfinished():
        for response in engine.step():
            if response.has_error():
                print(f"request {response.request_id} failed: {response.error_msg}")
                ok = False
        steps += 1
    print(f"{num_rows} requests x {prompt_len} prompt tokens, {args.num_tokens} generated each: {steps} steps")
    if on_cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free_now, total = torch.cuda.mem_get_info()
        print(f"peak while serving {peak / GIB:.2f} GiB allocated (KV cache included); "
              f"{free_now / GIB:.2f} GiB free now of {total / GIB:.2f}")
    print(f"RESULT: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
