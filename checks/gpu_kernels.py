#!/usr/bin/env python3
"""Checks and times inflight/kernels on a CUDA GPU at Llama-3.1-8B shapes, in bf16.

    python3 checks/gpu_kernels.py            # ~1-2 minutes on an H100; the table is printed last
    python3 checks/gpu_kernels.py --quick    # a few cases per kernel

Shapes: Hq 32, Hkv 8, head_dim 128, KV block 32, hidden 4096, MLP 14336; decode batch 1..256 at
contexts 128..8k. Each case runs the kernel, compares it with the fp32 torch reference
(`inflight/kernels/reference.py`, tolerances derived there from the dtype and context), then
times with `triton.testing.do_bench` (median, L2 flushed before each call):
  - kernel us : the Triton kernel(s);
  - torch us  : what the engine does today in torch (gather + SDPA for attention, HF-style eager
                ops elsewhere);
  - floor us  : bytes that must move / copy bandwidth measured in this run (a 1 GiB
                device-to-device copy, read + write counted), or for prefill the larger of that and
                FLOPs / a measured 8192^3 bf16 matmul rate;
  - call us   : wall time per call when called back to back (host launch cost shows up here);
  - % floor   : floor / kernel (100 % = at the bandwidth or compute ceiling).
It also replays a decode step (KV store + split-K attention) from a CUDA graph with new inputs, and
runs the kernels under torch's sync-debug mode to prove no host synchronisation. Exit status 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import triton
import triton.testing

from inflight import kernels
from inflight.kernels import reference as ref
from inflight.model.rotary import RotaryEmbedding, apply_rotary_signed

HQ, HKV, D, BS, HIDDEN, INTER = 32, 8, 128, 32, 4096, 14336
DT = torch.bfloat16
SCALE = D ** -0.5
DEV = "cuda"


@dataclass
class Row:
    kernel: str
    shape: str
    error: float
    ok: bool
    kernel_us: float
    torch_us: float
    floor_us: float
    call_us: float


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def call_us(fn, calls: int = 100) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def randn(*shape, scale=1.0):
    return (torch.randn(shape, device=DEV) * scale).to(DT)


def check(out, expected, tol) -> tuple[float, bool]:
    err = (out.float() - expected.float()).abs().max().item()
    try:
        torch.testing.assert_close(out.float(), expected.float(), **tol)
        return err, True
    except AssertionError:
        return err, False


class Ceilings:
    """Copy bandwidth and bf16 matmul rate of this GPU, measured now."""

    def __init__(self) -> None:
        src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        self.bandwidth = 2 * src.numel() / (bench_us(lambda: dst.copy_(src)) * 1e-6)
        a = torch.randn(8192, 8192, device=DEV, dtype=DT)
        self.flops = 2 * 8192 ** 3 / (bench_us(lambda: a @ a) * 1e-6)
        self.num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        del src, dst, a

    def floor_us(self, num_bytes: float, flops: float = 0.0) -> float:
        return max(num_bytes / self.bandwidth, flops / self.flops) * 1e6


def paged(lens: list[int]):
    """Random bf16 cache holding each row's blocks (shuffled) and valid int32 tables."""
    needed = [-(-n // BS) for n in lens]
    num_blocks = sum(needed) + 1
    cache = randn(2, num_blocks, BS, HKV, D)
    order = torch.randperm(num_blocks, device=DEV).to(torch.int32)
    tables = torch.zeros(len(lens), max(needed), dtype=torch.int32, device=DEV)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[used:used + n]
        used += n
    return cache, tables, torch.tensor(lens, dtype=torch.int32, device=DEV)


def decode_case(ceil: Ceilings, batch: int, ctx: int, partitions: int | None = None) -> Row:
    lens = [ctx - 7 if b % 3 == 2 else ctx for b in range(batch)]  # ragged, not block multiples
    cache, tables, lens_t = paged(lens)
    q = randn(batch, HQ, D)
    p = partitions or kernels.choose_num_partitions(batch, HKV, ctx, ceil.num_sms)
    ws = kernels.DecodeWorkspace.allocate(batch * p, HQ, D, DEV)
    out = torch.empty_like(q)
    run = lambda: kernels.paged_decode_attention(q, cache, tables, lens_t, SCALE, out=out,  # noqa: E731
                                                 num_partitions=p, workspace=ws)
    run()
    err, ok = check(out, ref.paged_decode_ref(q, cache, tables, lens_t, SCALE),
                    ref.attention_tol(DT, ctx, cache.abs().max().item()))
    num_bytes = sum(lens) * HKV * D * 2 * 2 + 2 * q.numel() * 2
    torch_us = bench_us(lambda: ref.decode_attention_sdpa(q, cache, tables, lens_t, SCALE))
    return Row("decode attention", f"B={batch} ctx={ctx} P={p}", err, ok, bench_us(run), torch_us,
               ceil.floor_us(num_bytes), call_us(run))


def prefill_sdpa(q, cache, tables, rows):
    """The engine's prefill path per row: gather the row's blocks, one masked SDPA (GQA)."""
    out, start = torch.empty_like(q), 0
    for b, (q_len, ctx) in enumerate(rows):
        kv = cache[:, tables[b, :-(-ctx // BS)].long()].flatten(1, 2)[:, :ctx]  # [2, ctx, Hkv, D]
        query = q[start:start + q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        pos = torch.arange(ctx, device=DEV)
        mask = pos[None, :] <= (ctx - q_len + torch.arange(q_len, device=DEV))[:, None]
        o = F.scaled_dot_product_attention(query, kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None],
                                           attn_mask=mask, scale=SCALE, enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1)
        start += q_len
    return out


def prefill_case(ceil: Ceilings, label: str, rows: list[tuple[int, int]]) -> Row:
    cache, tables, lens_t = paged([c for _, c in rows])
    q_lens = [n for n, _ in rows]
    qsl = torch.tensor([0] + q_lens, device=DEV).cumsum(0).to(torch.int32)
    q = randn(sum(q_lens), HQ, D)
    out = torch.empty_like(q)
    run = lambda: kernels.paged_prefill_attention(q, cache, tables, qsl, lens_t, max(q_lens),  # noqa: E731
                                                  SCALE, out=out)
    run()
    err, ok = check(out, ref.paged_attention_ref(q, cache, qsl, lens_t, tables, SCALE),
                    ref.attention_tol(DT, max(c for _, c in rows), cache.abs().max().item()))
    visible = sum((c - n) * n + n * (n + 1) // 2 for n, c in rows)  # (query, key) pairs
    num_bytes = 2 * q.numel() * 2 + sum(c for _, c in rows) * HKV * D * 2 * 2
    floor = ceil.floor_us(num_bytes, 4 * HQ * D * visible)
    torch_us = bench_us(lambda: prefill_sdpa(q, cache, tables, rows))
    return Row("prefill attention", label, err, ok, bench_us(run), torch_us, floor, call_us(run))


def elementwise_cases(ceil: Ceilings, tokens: list[int]) -> list[Row]:
    rows = []
    weight = randn(HIDDEN)
    rope = RotaryEmbedding(D, 8192, 500000.0, None)
    rope.reset_cache(DEV)
    for t in tokens:
        # KV store: k, v of t tokens into random distinct slots.
        cache = randn(2, max(t // BS * 2, 4), BS, HKV, D)
        k, v = randn(t, HKV, D), randn(t, HKV, D)
        slots = torch.randperm(cache.shape[1] * BS, device=DEV)[:t]
        expected = cache.clone()
        ref.store_kv_cache_ref(k, v, expected, slots)
        store = lambda: kernels.store_kv_cache(k, v, cache, slots)  # noqa: E731
        store()
        flat = cache.view(2, -1, HKV, D)
        torch_store = lambda: (flat[0].index_copy_(0, slots, k), flat[1].index_copy_(0, slots, v))  # noqa: E731
        rows.append(_row(ceil, "store_kv_cache", t, cache, expected, {"rtol": 0, "atol": 0}, store,
                         torch_store, 2 * 2 * k.numel() * 2))
        # RMSNorm and fused residual add + RMSNorm.
        x, res = randn(t, HIDDEN), randn(t, HIDDEN, scale=4.0)
        out = torch.empty_like(x)
        norm = lambda: kernels.rms_norm(x, weight, 1e-5, out=out)  # noqa: E731
        norm()
        rows.append(_row(ceil, "rms_norm", t, out, ref.rms_norm_ref(x, weight, 1e-5),
                         ref.elementwise_tol(DT, 2, 4.0), norm,
                         lambda: ref.rms_norm_ref(x, weight, 1e-5), 2 * x.numel() * 2))
        exp_out, exp_res = ref.fused_add_rms_norm_ref(x, res, weight, 1e-5)
        kernels.fused_add_rms_norm(x, res, weight, 1e-5, out=out)
        rows.append(_row(ceil, "fused_add_rms_norm", t, torch.cat([out, res]), torch.cat([exp_out, exp_res]),
                         ref.elementwise_tol(DT, 2, 16.0),
                         lambda: kernels.fused_add_rms_norm(x, res, weight, 1e-5, out=out),
                         lambda: ref.fused_add_rms_norm_ref(x, res, weight, 1e-5), 4 * x.numel() * 2))
        # RoPE on q and k (in place), positions up to 8k.
        q, k = randn(t, HQ, D), randn(t, HKV, D)
        pos = torch.randint(0, 8192, (t,), device=DEV)
        expected = torch.cat([ref.rotary_ref(q, pos, rope.cos_cache, rope.sin_cache).flatten(1),
                              ref.rotary_ref(k, pos, rope.cos_cache, rope.sin_cache).flatten(1)], 1)
        rot = lambda: kernels.apply_rotary(q, k, pos, rope.cos_cache, rope.sin_cache)  # noqa: E731
        rot()
        cos, sin = rope.cos_sin_signed(pos, DT)
        rows.append(_row(ceil, "apply_rotary (q+k)", t, torch.cat([q.flatten(1), k.flatten(1)], 1),
                         expected, ref.elementwise_tol(DT, 1, 4.0), rot,
                         lambda: (apply_rotary_signed(q, cos, sin), apply_rotary_signed(k, cos, sin)),
                         2 * (q.numel() + k.numel()) * 2 + t * 2 * D * 4))
        # SiLU-gated MLP activation.
        gate_up = randn(t, 2 * INTER, scale=3.0)
        act_out = torch.empty(t, INTER, dtype=DT, device=DEV)
        act = lambda: kernels.silu_and_mul(gate_up, out=act_out)  # noqa: E731
        act()
        rows.append(_row(ceil, "silu_and_mul", t, act_out, ref.silu_and_mul_ref(gate_up),
                         ref.elementwise_tol(DT, 2, 100.0), act,
                         lambda: ref.silu_and_mul_ref(gate_up), 3 * t * INTER * 2))
    return rows


def _row(ceil, name, tokens, out, expected, tol, run, torch_run, num_bytes) -> Row:
    err, ok = check(out, expected, tol)
    return Row(name, f"T={tokens}", err, ok, bench_us(run), bench_us(torch_run),
               ceil.floor_us(num_bytes), call_us(run))


def graph_and_sync_check(ceil: Ceilings) -> tuple[bool, str]:
    """Decode step (store + split-K attention) captured once, replayed with new inputs."""
    batch, max_ctx = 8, 2048
    p = kernels.choose_num_partitions(batch, HKV, max_ctx, ceil.num_sms)
    cache, tables, lens = paged([max_ctx] * batch)
    ws = kernels.DecodeWorkspace.for_limits(batch, HQ, HKV, D, max_ctx, ceil.num_sms, DEV)
    q, k, v = randn(batch, HQ, D), randn(batch, HKV, D), randn(batch, HKV, D)
    slots, out = torch.zeros(batch, dtype=torch.int64, device=DEV), torch.empty(batch, HQ, D, dtype=DT, device=DEV)

    def step():
        kernels.store_kv_cache(k, v, cache, slots)
        kernels.paged_decode_attention(q, cache, tables, lens, SCALE, out=out, num_partitions=p, workspace=ws)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32)
    new_lens[0] = 0  # a padded row: slot -1, zero output
    lens.copy_(new_lens)
    last = (new_lens - 1).clamp(min=0).long()
    slots.copy_(tables.long().gather(1, (last // BS)[:, None])[:, 0] * BS + last % BS)
    slots[0] = -1
    for t in (q, k, v):
        t.copy_(torch.randn_like(t, dtype=torch.float32))
    graph.replay()
    err, ok = check(out, ref.paged_decode_ref(q, cache, tables, lens, SCALE),
                    ref.attention_tol(DT, max_ctx, cache.abs().max().item()))
    ok = ok and bool((out[0] == 0).all())
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        x = randn(4, HIDDEN)
        kernels.fused_add_rms_norm(x, x.clone(), randn(HIDDEN), 1e-5)
        synced = False
    except RuntimeError:
        synced = True
    finally:
        torch.cuda.set_sync_debug_mode(0)
    msg = (f"CUDA graph decode step (B={batch}, P={p}) replayed with new inputs: max err {err:.2e} "
           f"{'ok' if ok else 'MISMATCH'}; replay {bench_us(graph.replay):.1f} us vs eager "
           f"{call_us(step):.1f} us/call; host sync in kernel calls: {'YES' if synced else 'none'}")
    return ok and not synced, msg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few cases per kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs | torch {torch.__version__} | triton {triton.__version__}")
    ceil = Ceilings()
    print(f"copy bandwidth {ceil.bandwidth / 1e12:.2f} TB/s (read+write), bf16 matmul {ceil.flops / 1e12:.0f} TFLOP/s")
    decode = [(1, 128), (1, 8192), (8, 2048), (64, 1024), (256, 1024)] if args.quick else \
        [(1, 128), (1, 1024), (1, 8192), (8, 2048), (32, 1024), (64, 1024), (128, 2048), (256, 1024),
         (256, 4096)]
    rows: list[Row] = [decode_case(ceil, b, c) for b, c in decode]
    rows += [decode_case(ceil, 1, 8192, partitions=1), decode_case(ceil, 8, 2048, partitions=1)]
    rows.append(prefill_case(ceil, "1 x 1024 new", [(1024, 1024)]))
    rows.append(prefill_case(ceil, "1 x 2048 chunk @4096", [(2048, 4096)]))
    if not args.quick:
        rows.append(prefill_case(ceil, "4 x 512 new", [(512, 512)] * 4))
        rows.append(prefill_case(ceil, "2x512 new + 64 dec @1k", [(512, 512)] * 2 + [(1, 1024)] * 64))
    rows += elementwise_cases(ceil, [1, 256] if args.quick else [1, 64, 256, 8192])
    graph_ok, graph_msg = graph_and_sync_check(ceil)
    print(graph_msg)
    print(f"\n{'kernel':<20} {'shape':<24} {'max err':>8} {'check':>5} {'kernel us':>10} {'torch us':>9} "
          f"{'floor us':>9} {'% floor':>8} {'call us':>8}")
    for r in rows:
        print(f"{r.kernel:<20} {r.shape:<24} {r.error:8.1e} {'ok' if r.ok else 'FAIL':>5} {r.kernel_us:10.1f} "
              f"{r.torch_us:9.1f} {r.floor_us:9.1f} {100 * r.floor_us / r.kernel_us:7.0f}% {r.call_us:8.1f}")
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks ok; CUDA graph + sync audit: {'ok' if graph_ok else 'FAIL'}")
    return 0 if not failed and graph_ok else 1


if __name__ == "__main__":
    sys.exit(main())
