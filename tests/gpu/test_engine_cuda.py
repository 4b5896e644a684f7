"""The engine on CUDA in fp32 gives the CPU engine's greedy tokens (tiny random Llama, llama3 RoPE).

CUDA and CPU kernels round differently; tokens may part only where the CPU run's top-2 margin is
within fp32 noise (tests/model/numerics.py). bf16 and the SmolLM2 weights: checks/gpu_smoke.py.
"""

from __future__ import annotations

from inflight.api.config import ExecutorConfig
from inflight.engine.llm_engine import LLMEngine
from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, gen_request, output_tokens, run
from tests.model.numerics import assert_greedy_tokens_match

PROMPTS = [[1, 17, 250, 33, 499, 8, 120, 64, 3], [1, 5], list(range(3, 34))]
NUM_NEW = 16


def test_cuda_fp32_greedy_matches_cpu(tmp_path):
    save_tiny_checkpoint("llama3", tmp_path)
    recorders = [RecordLogits() for _ in PROMPTS]
    cpu = LLMEngine.from_dir(tmp_path, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV))
    refs = [output_tokens(r) for r in run(cpu, [gen_request(p, NUM_NEW, logits_processor=rec)
                                                for p, rec in zip(PROMPTS, recorders)])]
    cuda = LLMEngine.from_dir(tmp_path, ExecutorConfig(device="cuda", dtype="float32",
                                                       kv_cache_config=DEFAULT_KV))
    for index, (ref, rec, responses) in enumerate(zip(refs, recorders, run(cuda, [gen_request(p, NUM_NEW)
                                                                                  for p in PROMPTS]))):
        assert_greedy_tokens_match(ref, rec.logits, output_tokens(responses), cpu.model_config,
                                   f"prompt {index}")
