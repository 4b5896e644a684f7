#!/usr/bin/env python3
"""Tensor parallelism on the GPU: greedy tokens at tp=N equal tp=1, and tp=1 vs tp=N speed.

    python3 bench/gpu_tp.py            # every GPU this machine has (2: tp=1 and tp=2)
    python3 bench/gpu_tp.py --check    # the greedy check alone (~1-2 min)
    python3 bench/gpu_tp.py --check --lora  # ... with two LoRA adapters and the base model mixed
    python3 bench/gpu_tp.py --check --drafts  # ... with tp=N verifying drafts (speculative decoding)
    bash checks/gpu_check.sh tp         # the same, with its log and summary under $OUT
    python3 bench/gpu_tp.py --cpu-dry-run   # every code path on the CPU (gloo, tiny shapes)
    kill -USR1 <pid of any rank>            # its Python stacks into the log, it carries on

Check: a small random Llama (vocabulary 32001, so the last vocabulary shard is padded; weights
N(0, 0.1) so greedy choices are not float ties) is written to a safetensors folder in fp32.
tp=1 generates greedily for 8 prompts; tp=N must produce the same tokens, with the default
path (Triton kernels, CUDA graphs with the collectives captured, overlapped steps) and eagerly.
fp32: the ranks' partial sums are added in another order, which moves logits by float noise
only. With one GPU, tp=1 runs through the same code path and a tp=2 engine must be refused
with the "GPUs are not there" error.

Bench: random weights in the Llama-3.1-8B shape (bf16, written to disk once; each rank reads
only its shards), tp=1 then tp=N on the same machine: batch 1 (128 prompt / 128 output
tokens) decode step latency and batch 64 throughput; the ratios are printed last. Results
go to $OUT/gpu_tp.json (default /tmp/gpu_tp).

Diagnosable whatever happens: rank 0 logs its start-up lines as `[tp rank 0]` (the other ranks
as `[tp rank N]`), each phase is logged as it ends (engine built, tokens generated, ranks
stopped in N s), NCCL_DEBUG=WARN, collectives time out after 150 s (INFLIGHT_TP_TIMEOUT_S), and
`--watchdog-s N` dumps every rank's Python stacks into the log after N s, then exits 3.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench_gpu_runs import SHAPES, profile_decode, random_prompts, run_engine

from ensemble.errors import ConfigError
from inflight.api.config import (ExecutorConfig, ExtendedRuntimePerfKnobConfig, KvCacheConfig, NgramConfig,
                                 ParallelConfig, PeftCacheConfig, SpeculativeConfig)
from inflight.api.types import LoraConfig
from inflight.engine.llm_engine import LLMEngine
from tools.checkpoints import random_lora_adapter
from tools.drafters import KnownContinuation

CHECK_SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=64, vocab_size=32001, tie_word_embeddings=False,
                   max_position_embeddings=4096, rope=SHAPES["llama-3.1-8b"]["rope"])
SHARD_BYTES = 4 << 30
DEVICE = "cuda"  # "cpu" with --cpu-dry-run
BENCH_SHAPE = "llama-3.1-8b"


def log(msg: str) -> None:
    print(msg, flush=True)


def diagnosable() -> None:
    """Whatever happens, the log shows where each rank stands: rank 0's start-up lines like the
    other ranks' (its `inflight` loggers had no handler, so only warnings reached the log),
    NCCL's warnings, collectives that fail after INFLIGHT_TP_TIMEOUT_S (150 s here, not 30 min:
    NCCL's watchdog then names the stuck collective) and Python stacks on SIGUSR1."""
    os.environ.setdefault("NCCL_DEBUG", "WARN")  # before NCCL starts; spawned ranks inherit it
    os.environ.setdefault("INFLIGHT_TP_TIMEOUT_S", "150")
    logging.basicConfig(level=logging.WARNING, format="[tp rank 0] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("inflight").setLevel(logging.INFO)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def start_watchdog(seconds: float) -> None:
    """After `seconds`: every rank's Python stacks into the log (SIGUSR1 to the spawned ranks,
    which print theirs; this process's own), then the ranks and this process are ended
    (exit 3), before the caller's time limit kills them without a word."""
    def fire():
        time.sleep(seconds)
        ranks = multiprocessing.active_children()
        log(f"\nWATCHDOG: still running after {seconds:.0f} s; Python stacks of rank 0 and of "
            f"{len(ranks)} spawned rank process(es) {[p.pid for p in ranks]} follow")
        for p in ranks:  # one at a time: their dumps share this log
            log(f"WATCHDOG: stacks of {p.name} (pid {p.pid}):")
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            time.sleep(3)
        log("WATCHDOG: stacks of rank 0 (this process):")
        faulthandler.dump_traceback(all_threads=True)
        for p in ranks:
            p.kill()
        log("WATCHDOG: killed the ranks; exiting with code 3")
        os._exit(3)
    threading.Thread(target=fire, name="gpu-tp-watchdog", daemon=True).start()


def write_checkpoint(spec: dict, dtype: torch.dtype, std: float, folder: Path, seed: int = 0) -> Path:
    """A random Llama of `spec` written as safetensors shards (+ index) and config.json.
    Matrices N(0, std) drawn on the GPU, norms 1."""
    import transformers
    from safetensors.torch import save_file
    spec = dict(spec)
    rope = spec.pop("rope")
    cfg = transformers.LlamaConfig(**spec, rope_parameters=rope, rms_norm_eps=1e-5,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.save_pretrained(folder)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h, i, d = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    q, kv = spec["num_attention_heads"] * d, spec["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (spec["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(spec["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    if not spec["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (spec["vocab_size"], h)
    weight_map, shard, shard_bytes, files = {}, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, files
        if shard:
            name = f"model-{files:05d}.safetensors"
            save_file(shard, str(folder / name))
            weight_map.update({k: name for k in shard})
            shard, shard_bytes, files = {}, 0, files + 1

    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=dtype, device=DEVICE).normal_(0.0, std, generator=gen).cpu()
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def engine(folder: Path, tp: int, dtype: str, max_batch_size: int, max_seq_len: int,
           graphs: bool | None = None, peft: PeftCacheConfig | None = None,
           spec: SpeculativeConfig | None = None) -> LLMEngine:
    config = ExecutorConfig(
        peft_cache_config=peft, speculative_config=spec or SpeculativeConfig(),
        device=DEVICE if DEVICE == "cpu" else "auto", dtype=dtype, max_batch_size=max_batch_size,
        max_num_tokens=8192, max_seq_len=max_seq_len,
        enable_chunked_context=True, kv_cache_config=KvCacheConfig(
            tokens_per_block=32, max_tokens=max_batch_size * max_seq_len if DEVICE == "cpu" else None),
        extended_runtime_perf_knob_config=ExtendedRuntimePerfKnobConfig(cuda_graph_mode=graphs),
        parallel_config=ParallelConfig(tp))
    return LLMEngine.from_dir(str(folder), config)


def free_memory() -> None:
    """After the caller dropped its engine: its weights, KV cache and graphs go back."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def close(eng: LLMEngine, tp_size: int) -> None:
    """Stops the other ranks (timed: the first 2-GPU run hung here)."""
    start = time.perf_counter()
    eng.close()
    if tp_size > 1:
        log(f"  tp={tp_size}: ranks stopped in {time.perf_counter() - start:.1f} s")


def check(num_gpus: int, tp: int, out: dict, graph_modes=(None, False), lora: bool = False,
          drafts: bool = False) -> bool:
    """`lora`: two random adapters (ranks 4 and 8; all seven projections, and q/v/down only)
    and the base model mixed in the batch, on every engine. `drafts`: the tp=N engines verify
    drafts of 4 tokens taken from tp=1's output (speculative decoding: several positions per row)."""
    log(f"\n== check: greedy tokens, tp=1 vs tp={tp} (fp32, random Llama, vocab {CHECK_SHAPE['vocab_size']})"
        + (", two LoRA adapters and the base model in each batch" if lora else "")
        + (", drafts verified at tp > 1" if drafts else ""))
    folder = write_checkpoint(CHECK_SHAPE, torch.float32, 0.1, Path(tempfile.mkdtemp(prefix="tp-check-")))
    prompts = random_prompts(8, [5, 17, 33, 64, 100, 7, 250, 12], CHECK_SHAPE["vocab_size"], seed=3)
    deadline = time.perf_counter() + 300
    tasks = [1, None, 2, 1, 2, None, 1, 2] if lora else [None] * len(prompts)
    peft = PeftCacheConfig(max_loras=2, max_adapter_size=8) if lora else None

    def generate(tp_size: int, graphs: bool | None, known: list[list[int]] | None = None) -> list[list[int]]:
        start = time.perf_counter()
        spec = SpeculativeConfig(ngram=NgramConfig(max_draft_tokens=4)) if known else None
        eng = engine(folder, tp_size, "float32", 8, 512, graphs, peft, spec)
        if known:
            eng.speculation.drafter = KnownContinuation(prompts, known, CHECK_SHAPE["vocab_size"],
                                                        max_draft_tokens=4)
        log(f"  tp={tp_size} cuda_graph_mode={graphs}: engine built in {time.perf_counter() - start:.1f} s")
        if lora:
            eng.loras.put(1, random_lora_adapter(eng.model_config, 4, 5))
            eng.loras.put(2, random_lora_adapter(eng.model_config, 8, 6, ["q_proj", "v_proj", "down_proj"]))
        try:
            run = run_engine(eng, prompts, [32] * len(prompts), deadline, keep_outputs=True,
                             loras=[task and LoraConfig(task) for task in tasks])
            log(f"  tp={tp_size} cuda_graph_mode={graphs}: {run.output_tokens} tokens, "
                f"{time.perf_counter() - start:.1f} s with start-up")
        finally:
            close(eng, tp_size)
            del eng
            free_memory()
        return run.outputs

    want = generate(1, None)
    results = out.setdefault("check", {})
    if num_gpus < tp:
        try:
            engine(folder, tp, "float32", 8, 512)
            results["refused_without_gpus"] = False
        except ConfigError as exc:
            results["refused_without_gpus"] = True
            log(f"  tp={tp} on {num_gpus} GPU(s) refused as it should be: {exc}")
        log(f"  tp={tp} NOT RUN: this machine has {num_gpus} GPU(s)")
        return results["refused_without_gpus"]
    ok = True
    for graphs in graph_modes:
        got = generate(tp, graphs, want if drafts else None)
        same = sum(g == w for g, w in zip(got, want))
        results[f"tp{tp}_graphs_{graphs}"] = f"{same}/{len(want)} sequences equal"
        log(f"  tp={tp} cuda_graph_mode={graphs}: {same}/{len(want)} sequences equal to tp=1")
        ok &= same == len(want)
    return ok


def bench(num_gpus: int, tp: int, out: dict, profile_dir: Path | None = None,
          sizes: tuple[int, ...] = ()) -> None:
    """tp=1 and tp=`tp` (or `sizes`); with `profile_dir`, each also profiled at batch 1 and 64
    (torch.profiler on rank 0: top kernels per step in the results, Chrome traces there)."""
    shape = SHAPES[BENCH_SHAPE]
    log(f"\n== bench: {BENCH_SHAPE} shape, bf16 random weights, tp=1 vs tp={tp}")
    start = time.perf_counter()
    # Written once per machine (the same seed gives the same weights): a second run reuses it.
    folder = Path(tempfile.gettempdir()) / f"tp-bench-{BENCH_SHAPE}"
    if not (folder / "model.safetensors.index.json").exists():
        write_checkpoint(shape, torch.bfloat16, 0.02, folder)
        log(f"  checkpoint written in {time.perf_counter() - start:.0f} s")
    vocab = shape["vocab_size"]
    results = out.setdefault("bench", {})
    for tp_size in sizes or ([1, tp] if num_gpus >= tp else [1]):
        start = time.perf_counter()
        eng = engine(folder, tp_size, "bfloat16", 64, 1024)
        row = {"startup_s": round(time.perf_counter() - start, 1), "kv_blocks": eng.worker.num_blocks}
        log(f"  tp={tp_size}: engine built in {row['startup_s']} s")
        try:
            deadline = time.perf_counter() + 90
            run_engine(eng, random_prompts(2, 32, vocab, seed=1), [8, 8], deadline)  # warm
            b1 = run_engine(eng, random_prompts(1, 128, vocab, seed=2), [128], deadline)
            b64 = run_engine(eng, random_prompts(64, 128, vocab, seed=4), [128] * 64, deadline)
            row["timed_out"] = b1.timed_out or b64.timed_out
            row.update(batch1_step_ms=round(b1.decode_step_ms, 3), batch1_tok_s=round(b1.decode_tok_s, 1),
                       batch64_step_ms=round(b64.decode_step_ms, 3), batch64_tok_s=round(b64.decode_tok_s, 1))
            if profile_dir is not None:
                profile_dir.mkdir(parents=True, exist_ok=True)
                for batch in (1, 64):
                    prof = profile_decode(eng, batch, 128, vocab, num_steps=16, top=25,
                                          trace_path=profile_dir / f"tp{tp_size}_b{batch}.json")
                    row[f"profile_b{batch}"] = prof
                    busy, wall = prof["gpu_busy_ms_per_step"], prof["wall_ms_per_step"]
                    log(f"  tp={tp_size} B={batch}: {prof['kernels_per_step']:.0f} kernels per step, "
                        f"GPU busy {busy:.3f} of {wall:.3f} ms wall")
                    for k in prof["top_kernels"]:
                        log(f"    {k['us_per_step']:8.1f} us {k['launches_per_step']:5.1f} x "
                            f"{k['share_pct']:5.1f}%  {k['name'][:100]}")
            results[f"tp{tp_size}"] = row
            log(f"  tp={tp_size}: {json.dumps(row)}")
        finally:
            close(eng, tp_size)
            del eng  # before the next engine sizes its KV cache from the free memory
            free_memory()
    if f"tp{tp}" in results and "tp1" in results and tp > 1:
        one, many = results["tp1"], results[f"tp{tp}"]
        results["ratios"] = {
            "batch1_latency_speedup": round(one["batch1_step_ms"] / many["batch1_step_ms"], 2),
            "batch64_throughput_ratio": round(many["batch64_tok_s"] / one["batch64_tok_s"], 2),
            "batch64_throughput_per_gpu": round(many["batch64_tok_s"] / one["batch64_tok_s"] / tp, 2)}
    else:
        results["ratios"] = f"tp={tp} NOT RUN: this machine has {num_gpus} GPU(s)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size compared with tp=1")
    parser.add_argument("--check", action="store_true", help="the greedy check alone")
    parser.add_argument("--bench", action="store_true", help="the benchmark alone")
    parser.add_argument("--drafts", action="store_true",
                        help="the check with tp=N verifying drafts (speculative decoding)")
    parser.add_argument("--lora", action="store_true",
                        help="the check with two LoRA adapters and the base model in each batch")
    parser.add_argument("--profile", action="store_true",
                        help="the benchmark also profiles each engine at batch 1 and 64 (traces under --out)")
    parser.add_argument("--sizes", type=int, nargs="*", default=(),
                        help="the tensor-parallel sizes benchmarked (default: 1 and --tp)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_tp"))
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="tiny shapes on the CPU with gloo ranks: the script's code paths, no numbers")
    parser.add_argument("--check-graphs", choices=["auto", "off", "both"], default="auto",
                        help="cuda_graph_mode of the tp engines checked; on CUDA one tp > 1 engine per "
                             "process (NCCL groups end with the process, see TensorParallel.destroy), "
                             "so check eager mode in a second run with `off`")
    parser.add_argument("--watchdog-s", type=float, default=0,
                        help="after this long, dump every rank's Python stacks and exit 3 (0: never); "
                             "set it below the caller's time limit")
    args = parser.parse_args()
    diagnosable()
    if args.watchdog_s > 0:
        start_watchdog(args.watchdog_s)
    if args.cpu_dry_run:
        global DEVICE, BENCH_SHAPE
        DEVICE, BENCH_SHAPE = "cpu", "tiny"
        CHECK_SHAPE.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=501)
    elif not torch.cuda.is_available():
        log("no CUDA device: nothing to do (the CPU tier runs tests/model/test_tensor_parallel.py)")
        return 2
    if DEVICE == "cpu":
        num_gpus = args.tp  # ranks on the CPU
    else:
        num_gpus = torch.cuda.device_count()
        log(f"{num_gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(num_gpus))}")
    out: dict = {"num_gpus": num_gpus, "tp": args.tp}
    ok = True
    try:
        if not args.bench:
            modes = {"auto": (None,), "off": (False,), "both": (None, False)}[args.check_graphs]
            ok = check(num_gpus, args.tp, out, modes, args.lora, args.drafts)
        if not args.check:
            bench(num_gpus, args.tp, out, Path(args.out) / "profile" if args.profile else None,
                  tuple(args.sizes))
    finally:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_tp.json").write_text(json.dumps(out, indent=1))
        log("\n== summary\n" + json.dumps(out, indent=1))
    log("CHECK " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":  # ranks are spawned: they import this file and must not run it
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: NCCL groups end with the process (see destroy)
