#!/usr/bin/env python3
"""Prefill speed on the GPU: the attention kernel alone, and whole prompts through the engine.

    python3 bench/bench_prefill.py kernel            # ~1 min on an H100: tile sweep + anchors
    python3 bench/bench_prefill.py engine            # ~2 min: 8B prompts of 2k/8k/32k/100k
    python3 bench/bench_prefill.py itl               # ~1 min: decode streams under a 32k prompt
    python3 bench/bench_prefill.py kernel --device cpu --tiny   # dry run (TRITON_INTERPRET=1)

`kernel`: `paged_prefill_attention` in the Llama-3.1-8B shape (32 query heads, 8 KV heads, head
dim 128; the 1B shape has head dim 64; bf16, KV blocks of 32 tokens) on one row of a chunked prompt: the chunk's queries at
the end of a context (first chunk of 2k / 8k; last 8k chunk of 32k / 100k). For each tile
configuration: median time (CUDA events, triton.testing.do_bench) and TFLOP/s, counting
4 x Hq x D FLOPs per (query, visible key) pair. Anchors on the same shapes where the context is
all new (no prefix): torch SDPA with its flash backend and with cuDNN, on contiguous K/V.

`engine`: one prompt of T tokens through `LLMEngine` (random weights, Llama-3.1-8B shape,
chunked context at the given `--max-num-tokens` budgets), time to its first token after a
warm-up prompt; MFU = model FLOPs / time / 989 TFLOP/s (the H100 SXM's dense bf16 peak), model
FLOPs = 2 x non-embedding parameters x T + attention 4 x L x Hq x D x T(T+1)/2. With
`--profile`, the share of the prefill's GPU time spent in attention, GEMMs and the rest.

`itl`: `--streams` greedy streams decode in the 8B engine; one prompt of `--prompt-tokens`
arrives (bench/bench_long_prompt.py's `measure`), per `--max-num-tokens` budget: the streams'
inter-token latency while it is prefilled (median, worst) beside their plain decode step, and
the prompt's time to first token; last, the same with the engine configured as the default
repository built by tools/build_repository.py (chunked context on, its token budget).

Results go to --out (default $OUT or /tmp/bench_prefill) as prefill_<mode>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch
from bench_gpu_cli import log, open_device, start_random_engine, write_results
from bench_gpu_runs import build_hf, free_memory, sync

from inflight.api.types import Request
from inflight.kernels.prefill_attention import default_tiles, paged_prefill_attention

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, H100 SXM datasheet
KERNEL_SHAPES = {"llama-3.1-8b": dict(num_q_heads=32, num_kv_heads=8, head_dim=128),
                 "llama-3.2-1b": dict(num_q_heads=32, num_kv_heads=8, head_dim=64)}
# (context before the chunk, chunk tokens): 2k and 8k prompts in one step, the last 8k chunk
# of a 32k and of a 100k prompt.
CASES = [(0, 2048), (0, 8192), (24576, 8192), (94208, 8192)]
TINY_CASES = [(0, 64), (64, 64)]
# (BLOCK_M, BLOCK_N, num_warps, num_stages); None: the kernel's defaults.
TILES = {128: [None, (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
         64: [None, (128, 128, 8, 2), (128, 64, 8, 2), (128, 128, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2)]}


def attention_flops(context: int, chunk: int, num_q_heads: int, head_dim: int) -> float:
    """Causal FLOPs of `chunk` queries after `context` cached tokens: QK^T and PV, 2 x 2 x D
    per (query, visible key) pair and head."""
    visible = chunk * context + chunk * (chunk + 1) / 2
    return 4.0 * num_q_heads * head_dim * visible


def paged_inputs(context: int, chunk: int, device, dtype, num_q_heads, num_kv_heads, head_dim,
                 block_size: int = 32, seed: int = 0):
    """One row whose `context + chunk` tokens sit in shuffled cache blocks (as a paged cache
    hands them out), its chunk's queries last."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    total = context + chunk
    num_blocks = math.ceil(total / block_size)
    cache = torch.randn(2, num_blocks + 4, block_size, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    table = (torch.randperm(num_blocks + 4, generator=gen)[:num_blocks] if num_blocks > 1
             else torch.zeros(1, dtype=torch.long)).to(torch.int32).view(1, -1).to(device)
    q = torch.randn(chunk, num_q_heads, head_dim, generator=gen).to(device, dtype)
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    return q, cache, table, qsl, seq_lens


def time_ms(fn, device) -> float:
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def sdpa_anchor(q, cache, table, seq_lens, backend) -> callable | None:
    """torch SDPA (causal, contiguous K/V gathered once outside the timing) on a row with no
    prefix; None if the backend cannot run here."""
    from torch.nn.attention import sdpa_kernel
    total = int(seq_lens[0])
    kv_heads, dim = cache.shape[3], cache.shape[4]
    blocks = cache[:, table[0].long()].reshape(2, -1, kv_heads, dim)[:, :total]
    k = blocks[0].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, T, D]
    v = blocks[1].transpose(0, 1).unsqueeze(0).contiguous()
    qq = q.transpose(0, 1).unsqueeze(0).contiguous()         # [1, Hq, T, D]
    group = qq.shape[1] // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def run():
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(qq, k, v, is_causal=True)
    try:
        run()
    except RuntimeError:
        return None
    return run


def kernel_sweep(device, tiny: bool, shapes: list[str]) -> list[dict]:
    rows = []
    for name in ["tiny"] if tiny else shapes:
        shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=16) if tiny else KERNEL_SHAPES[name]
        log(f"{name}: {shape}")
        rows += [dict(shape=name, **row) for row in kernel_cases(device, tiny, shape)]
    return rows


def kernel_cases(device, tiny: bool, shape: dict) -> list[dict]:
    from torch.nn.attention import SDPBackend
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for context, chunk in (TINY_CASES if tiny else CASES):
        q, cache, table, qsl, seq_lens = paged_inputs(context, chunk, device, dtype, **shape)
        flops = attention_flops(context, chunk, shape["num_q_heads"], shape["head_dim"])
        scale = shape["head_dim"] ** -0.5
        ref = paged_prefill_attention(q, cache, table, qsl, seq_lens, chunk, scale)
        for tiles in TILES.get(shape["head_dim"], [None]) if device.type == "cuda" else [None]:
            bm, bn, w, s = tiles or default_tiles(dtype, shape["head_dim"])
            label = f"{bm}x{bn} w{w} s{s}" + (" (default)" if tiles is None else "")

            def run(bm=bm, bn=bn, w=w, s=s, inputs=(q, cache, table, qsl, seq_lens, chunk, scale)):
                return paged_prefill_attention(*inputs, block_m=bm, block_n=bn, num_warps=w, num_stages=s)
            try:
                err = float((run().float() - ref.float()).norm() / ref.float().norm())
                ms = time_ms(run, device)
            except Exception as exc:  # noqa: BLE001  (a tile that does not fit: listed, not fatal)
                rows.append(dict(context=context, chunk=chunk, variant=label, error=str(exc)[:200]))
                log(f"  ctx {context:>6} chunk {chunk:>5} {label:<22} FAILED {str(exc)[:120]}")
                continue
            rows.append(dict(context=context, chunk=chunk, variant=label, ms=ms,
                             tflops=flops / ms / 1e9, rel_err_vs_default=err))
            log(f"  ctx {context:>6} chunk {chunk:>5} {label:<22} {ms:8.3f} ms "
                f"{flops / ms / 1e9:7.1f} TFLOP/s  (rel. diff vs default {err:.1e})")
        if context == 0 and device.type == "cuda":
            for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
                run = sdpa_anchor(q, cache, table, seq_lens, backend)
                if run is None:
                    continue
                ms = time_ms(run, device)
                rows.append(dict(context=context, chunk=chunk, variant=name, ms=ms, tflops=flops / ms / 1e9))
                log(f"  ctx {context:>6} chunk {chunk:>5} {name:<22} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
        del q, cache
        free_memory(device)
    return rows


def model_flops(engine, num_tokens: int) -> float:
    cfg = engine.worker.model_config
    params = sum(p.numel() for name, p in engine.worker.model.named_parameters()
                 if "embed_tokens" not in name and "lm_head" not in name)
    attention = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * num_tokens * (num_tokens + 1) / 2
    return 2.0 * params * num_tokens + attention


def time_prompt(engine, prompt: list[int]) -> float:
    sync(engine.worker.device)
    start = time.perf_counter()
    rid = engine.add_request(Request(prompt, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    sync(engine.worker.device)
    del rid
    return time.perf_counter() - start


def engine_prefill(device, args) -> list[dict]:
    rows = []
    shape = "tiny" if args.tiny else "llama-3.1-8b"
    lengths = [48, 200] if args.tiny else args.lengths
    for budget in args.max_num_tokens:
        engine, vocab, _ = start_random_engine(shape, device, max_batch_size=8,
                                               max_seq_len=max(lengths) + 8, max_num_tokens=budget)
        time_prompt(engine, [5] * min(lengths))  # warm-up: kernels compiled, graphs captured
        for n in lengths:
            prompt = [(7 + 31 * j) % (vocab - 3) + 3 for j in range(n)]
            seconds = min(time_prompt(engine, prompt) for _ in range(args.repeat))
            flops = model_flops(engine, n)
            row = dict(prompt_tokens=n, max_num_tokens=budget, seconds=seconds,
                       tflops=flops / seconds / 1e12, mfu=flops / seconds / H100_BF16_PEAK)
            if args.profile and device.type == "cuda":
                row["gpu_time_shares"] = profile_prompt(engine, prompt)
            rows.append(row)
            log(f"  budget {budget:>6} prompt {n:>7}: {seconds * 1e3:9.1f} ms  {row['tflops']:6.1f} TFLOP/s"
                f"  MFU {100 * row['mfu']:4.1f} %  {row.get('gpu_time_shares', '')}")
        del engine
        free_memory(device)
    return rows


def profile_prompt(engine, prompt: list[int]) -> dict:
    """Shares of GPU time (attention / GEMM / other kernels) over one prompt's prefill."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_prompt(engine, prompt)
    shares = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    for evt in prof.events():
        if getattr(evt.device_type, "name", "") != "CUDA":
            continue
        name = evt.name.lower()
        us = evt.time_range.end - evt.time_range.start
        kind = ("attention" if "prefill" in name or "attn" in name or "mixed" in name
                else "gemm" if "gemm" in name or "nvjet" in name or "cutlass" in name or "sm90" in name
                else "other")
        shares[kind] += us
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 3) for k, v in shares.items()} | {"gpu_ms": round(total / 1e3, 1)}


def plain_step_ms(engine, num_streams: int, num_steps: int = 20) -> float:
    """Median wall ms of a decode step of `num_streams` greedy rows, nothing else in flight."""
    ids = [engine.add_request(Request([3 + i, 17, 42], max_tokens=num_steps + 8)) for i in range(num_streams)]
    for _ in range(4):
        engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.cancel(rid)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * sorted(times)[len(times) // 2]


def repository_engine(shape: str, device, max_seq_len: int):
    """An engine configured as tools/build_repository.py's default repository configures the
    `tensorrt_llm` model (guided decoding aside: a random checkpoint has no tokenizer)."""
    from tools.build_repository import DEFAULTS

    from inflight.engine.llm_engine import LLMEngine
    from inflight.serving.params import executor_config
    params = {k: v for k, v in DEFAULTS.items() if v and k != "guided_decoding_backend"}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dataclasses.replace(executor_config(params), device=str(device), max_seq_len=max_seq_len,
                                 dtype=str(dtype).removeprefix("torch."))
    hf, folder = build_hf(shape, device, dtype)
    weights, vocab = dict(hf.state_dict()), hf.config.vocab_size
    del hf
    free_memory(device)
    return LLMEngine.from_dir(str(folder), config, weights=weights), vocab


def itl_under_prefill(device, args) -> list[dict]:
    from bench_long_prompt import measure
    rows = []
    shape = "tiny" if args.tiny else "llama-3.1-8b"
    prompt_tokens = 300 if args.tiny else args.prompt_tokens
    for budget in args.max_num_tokens + ["repository"]:
        if budget == "repository":
            engine, vocab = repository_engine(shape, device, prompt_tokens + 64)
            config, budget = "default repository", engine.max_num_tokens
        else:
            engine, vocab, _ = start_random_engine(shape, device, max_batch_size=args.streams + 1,
                                                   max_seq_len=prompt_tokens + 64, max_num_tokens=budget)
            config = "chunked"
        plain_ms = plain_step_ms(engine, args.streams)
        measure(engine, args.streams, min(prompt_tokens, 2 * budget), vocab)  # warm-up
        r = measure(engine, args.streams, prompt_tokens, vocab)
        row = dict(config=config, max_num_tokens=budget, streams=args.streams, prompt_tokens=prompt_tokens,
                   plain_step_ms=plain_ms, itl_median_ms=1e3 * r["itl_median_s"],
                   itl_max_ms=1e3 * r["itl_max_s"], ttft_s=r["ttft_s"], steps=r["steps"])
        rows.append(row)
        log(f"  {config}, budget {budget}: {args.streams} streams' ITL under a {prompt_tokens}-token prompt "
            f"median {row['itl_median_ms']:.1f} ms, worst {row['itl_max_ms']:.1f} ms (plain step "
            f"{plain_ms:.1f} ms); the prompt's TTFT {r['ttft_s']:.2f} s in {r['steps']} steps")
        del engine
        free_memory(device)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["kernel", "engine", "itl"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    parser.add_argument("--kernel-shapes", nargs="+", default=list(KERNEL_SHAPES), choices=list(KERNEL_SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768, 100000])
    parser.add_argument("--max-num-tokens", type=int, nargs="+", default=[8192])
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per prompt (best kept)")
    parser.add_argument("--profile", action="store_true", help="GPU time shares per prompt")
    parser.add_argument("--streams", type=int, default=8, help="itl: decoding streams")
    parser.add_argument("--prompt-tokens", type=int, default=32768, help="itl: the long prompt")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/bench_prefill")
    args = parser.parse_args()
    device = open_device(args.device)
    if device is None:
        return 2
    torch.manual_seed(0)
    run = {"kernel": lambda: kernel_sweep(device, args.tiny, args.kernel_shapes), "engine": lambda: engine_prefill(device, args),
           "itl": lambda: itl_under_prefill(device, args)}[args.mode]
    rows = run()
    write_results(args.out, f"prefill_{args.mode}.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
