#!/usr/bin/env python3
"""The engine's host cost per step, measured on a CPU with the device work taken away.

    python tools/host_cost.py                    # batch 1, 64, 256; 128-token prompts
    python tools/host_cost.py --batches 256 --profile   # + cProfile of the decode steps

The engine runs as it does on a GPU (the Triton backend's attention metadata, decode steps
staged for a CUDA graph, overlapped steps), with the real scheduler, block manager, sampling
rows, sampler and response processing; only the model is a null one (it returns zeros at
once), so what is timed is what the host must do per step. With overlap that host work has to
fit inside the GPU time of one step (1B at batch 64: ~1.0 ms of roofline), or the GPU idles.

Prints, per batch: median CPU µs (this thread's time, so other processes on the machine
do not count) per decode-only step and µs per decode row (step / batch), and the
marginal µs per row between the smallest and largest batch (the slope that matters at scale).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inflight.api.config import ExecutorConfig, KvCacheConfig  # noqa: E402
from inflight.api.types import OutputConfig, Request  # noqa: E402
from inflight.distributed.group import TensorParallel  # noqa: E402
from inflight.engine.llm_engine import LLMEngine  # noqa: E402
from inflight.model.attention import AttentionLimits  # noqa: E402
from inflight.model.attention.triton_paged import TritonPagedAttention  # noqa: E402
from inflight.model.config import ModelConfig  # noqa: E402
from inflight.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from inflight.runner.worker import Worker  # noqa: E402
from inflight.sampling.sampler import Sampler  # noqa: E402

# Llama-3.2-1B's attention shape (what sizes the block tables and split-K), a small vocabulary
# (the null model's logits are host memory here: argmax over 128k columns would time the CPU).
MODEL = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=2048,
             intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, max_position_embeddings=131072)


class NullModel(torch.nn.Module):
    """What the worker and the graph runner call of a model, returning zeros at once."""

    def __init__(self, config: ModelConfig, backend, max_rows: int, max_tokens: int) -> None:
        super().__init__()
        self.config = config
        self.attention_backend = backend
        self.hidden = torch.zeros(max_tokens, 1)
        self.logits = torch.zeros(max_rows, config.vocab_size)

    def forward(self, input_ids, positions, kv_caches, attn_metadata) -> torch.Tensor:
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.logits[:hidden.shape[0]]
        return logits if out is None else out.copy_(logits)


class NoDecodeSteps(RuntimeError):
    """A run measured no decode-only step (its steps failed, or none had the whole batch)."""


class NullWorker(Worker):
    """A `Worker` on the CPU whose model is a `NullModel`: its host work (graph staging of
    decode steps, step metadata and the Triton backend's for the others, sampling, overlap's
    pending tokens) is the real one. Greedy rows all sample token 0.

    It skips `Worker.__init__` (which loads a checkpoint), so it sets every attribute the
    step reads itself; tests/model/test_host_cost.py runs it, so one added to `Worker` and
    missed here fails there rather than in a measurement."""

    def __init__(self, config: ExecutorConfig, model: dict) -> None:
        self.tp = TensorParallel.single()
        self.ranks = None  # one rank: steps run here, none is sent
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.model_config = ModelConfig.from_hf_dict(model)
        mc = self.model_config
        self.max_seq_len = config.max_seq_len
        self.block_size = config.kv_cache_config.tokens_per_block
        self.num_blocks = -(-config.kv_cache_config.max_tokens // self.block_size)
        self.overlap = bool(config.enable_overlap_scheduler)
        self.backend = TritonPagedAttention()
        self.backend.reserve(AttentionLimits(mc.num_attention_heads, mc.num_key_value_heads,
                                             mc.head_dim, config.max_batch_size, self.max_seq_len,
                                             self.device))
        self.model = NullModel(mc, self.backend, config.max_batch_size, config.max_num_tokens)
        self.sampler = Sampler()
        self.sampled_ids = torch.zeros(config.max_batch_size, dtype=torch.int64)
        self.kv_caches = []
        self.cuda_graph_mode = True
        self.graph_runner = CudaGraphRunner(
            self.model, config.extended_runtime_perf_knob_config.cuda_graph_batch_sizes(
                config.max_batch_size), self.max_seq_len, self.block_size, self.sampled_ids,
            self.device)
        self.graph_runner.bind(self.kv_caches)


def make_engine(max_batch_size: int, max_seq_len: int) -> LLMEngine:
    config = ExecutorConfig(device="cpu", dtype="float32", max_batch_size=max_batch_size,
                            max_num_tokens=8192, max_seq_len=max_seq_len, enable_chunked_context=True,
                            enable_overlap_scheduler=True,
                            kv_cache_config=KvCacheConfig(tokens_per_block=32,
                                                          max_tokens=max_batch_size * max_seq_len))
    return LLMEngine(config, NullWorker(config, MODEL))


def measure(engine: LLMEngine, batch: int, prompt_len: int, num_decode_steps: int,
            profiler: cProfile.Profile | None = None, streaming: bool = False) -> dict:
    """Median CPU seconds of the decode-only steps of `batch` requests run to completion.

    Raises `NoDecodeSteps` when there is none to take the median of: a failed step fails its
    requests and the engine carries on, so the first error response says why."""
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = [(i * 7919 + j * 31) % (vocab - 10) + 10 for j in range(prompt_len)]
        engine.add_request(Request(prompt, num_decode_steps + 2, streaming=streaming,
                                   output_config=OutputConfig(exclude_input_from_output=True)))
    times = []
    errors = []
    while engine.has_unfinished():
        decode = engine.scheduler.num_waiting == 0 and all(
            s.num_uncomputed_tokens <= 1 for s in engine.scheduler.running)
        if decode and profiler is not None:
            profiler.enable()
        start = time.thread_time()  # CPU time: robust to other processes sharing the cores
        responses = engine.step()
        elapsed = time.thread_time() - start
        if profiler is not None:
            profiler.disable()
        stats = engine.last_stats.inflight_batching_stats
        if stats.num_ctx_tokens == 0 and stats.num_scheduled_requests == batch:
            times.append(elapsed)
        errors += [r.error_msg for r in responses if r.has_error()]
    if errors:
        raise NoDecodeSteps(f"batch {batch}: {len(errors)} of {batch} requests failed; the first: "
                            f"{errors[0]}")
    if not times:
        raise NoDecodeSteps(f"batch {batch}: no step computed all {batch} rows' decode tokens "
                            f"and nothing else ({num_decode_steps} decode steps per request)")
    median = statistics.median(times)
    return {"batch": batch, "steps": len(times), "us_per_step": median * 1e6,
            "us_per_row": median * 1e6 / batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=120, help="decode steps per batch")
    parser.add_argument("--repeats", type=int, default=3, help="runs per batch (best median kept)")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="cProfile the decode steps")
    parser.add_argument("--streaming", action="store_true",
                        help="streaming requests (a response per row per step, as Triton serves)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        run(args)
    except NoDecodeSteps as exc:
        print(f"host_cost: nothing measured: {exc}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> None:
    engine = make_engine(max(args.batches), args.max_seq_len)
    measure(engine, min(4, max(args.batches)), args.prompt_len, 8)  # warm caches and allocators
    rows = []
    for batch in args.batches:
        runs = [measure(engine, batch, args.prompt_len, args.steps, streaming=args.streaming)
                for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["us_per_step"])
        rows.append(best)
        print(f"batch {batch:>4}: {best['us_per_step']:8.1f} us per decode step, "
              f"{best['us_per_row']:6.2f} us per row  ({best['steps']} steps)", flush=True)
    if len(rows) > 1:
        lo, hi = rows[0], rows[-1]
        slope = (hi["us_per_step"] - lo["us_per_step"]) / (hi["batch"] - lo["batch"])
        print(f"marginal: {slope:.2f} us per extra decode row (batch {lo['batch']} -> {hi['batch']})")
    if args.profile:
        profiler = cProfile.Profile()
        measure(engine, max(args.batches), args.prompt_len, args.steps, profiler, args.streaming)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    sys.exit(main())
