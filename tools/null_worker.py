"""An engine on the CPU whose model does nothing, so that what a step costs is the host's work
alone: `NullWorker`, `make_engine` and `measure`, what bench/host_cost.py times and
tests/model/test_host_cost.py checks.

The engine runs as it does on a GPU (the Triton backend's attention metadata, decode steps
staged for a CUDA graph, overlapped steps), with the real scheduler, block manager, sampling
rows, sampler and response processing; only the model is a null one (it returns zeros at once).
"""

from __future__ import annotations

import cProfile
import statistics
import time

import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import OutputConfig, Request
from inflight.distributed.group import TensorParallel
from inflight.engine.llm_engine import LLMEngine
from inflight.model.attention import AttentionLimits
from inflight.model.attention.triton_paged import TritonPagedAttention
from inflight.model.config import ModelConfig
from inflight.runner.cuda_graph import CudaGraphRunner
from inflight.runner.worker import Worker
from inflight.sampling.sampler import Sampler

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

    def forward(self, input_ids, positions, kv_caches, attn_metadata, lora=None) -> torch.Tensor:
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
