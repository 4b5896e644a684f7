"""LoRA on CUDA: the engine with the Triton shrink/expand kernels, in eager steps and in the
decode CUDA graphs, against the CPU engine's torch path on the same adapters (fp32, greedy): a
batch mixing the base model and two adapters, with more rows than one graph bucket."""

from __future__ import annotations

import pytest

from inflight.api.config import ExecutorConfig, ExtendedRuntimePerfKnobConfig, PeftCacheConfig
from inflight.api.types import LoraConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.lora.nvidia import to_nvidia
from inflight.model.config import ModelConfig
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, gen_request, output_tokens, run
from tests.model.tolerances import assert_same_tokens_but_at_a_tie, fp32_noise_bound
from tools.checkpoints import random_lora_adapter, save_tiny_checkpoint

PEFT = PeftCacheConfig(max_loras=2, max_adapter_size=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_lora")
    save_tiny_checkpoint("llama3", path)
    return path


def test_graphs_and_eager_steps_give_the_cpu_engines_tokens(folder):
    config = ModelConfig.from_dir(folder)
    rows = [to_nvidia(random_lora_adapter(config, 8, 1), dtype="float32"),
            to_nvidia(random_lora_adapter(config, 4, 2, ["q_proj", "v_proj", "down_proj"]), dtype="float32")]
    prompts = [[1 + (7 * i + j) % 200 for j in range(5 + i)] for i in range(6)]
    loras = [None, 1, 2, 1, None, 2]

    def requests(recorders=None):
        out = []
        for i, (prompt, task) in enumerate(zip(prompts, loras)):
            extra = {"logits_processor": recorders[i]} if recorders else {}
            request = gen_request(prompt, 10, **extra)
            request.lora_config = None if task is None else LoraConfig(task, *rows[task - 1])
            out.append(request)
        return out

    recorders = [RecordLogits() for _ in prompts]
    cpu = LLMEngine.from_dir(folder, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV,
                                                    peft_cache_config=PEFT))
    refs = [output_tokens(r) for r in run(cpu, requests(recorders))]
    knobs = ExtendedRuntimePerfKnobConfig(cuda_graph_mode=True)  # buckets 1, 2, 4, 8
    cuda = LLMEngine.from_dir(folder, ExecutorConfig(device="cuda", dtype="float32", kv_cache_config=DEFAULT_KV,
                                                     peft_cache_config=PEFT, max_batch_size=8,
                                                     extended_runtime_perf_knob_config=knobs))
    runner = cuda.worker.graph_runner
    assert runner is not None and runner.lora_slots is not None
    assert all(bucket.lora_graph is not None for bucket in runner.buckets.values())
    for ref, rec, responses in zip(refs, recorders, run(cuda, requests())):
        # Two fp32 evaluations, each with the adapters' extra reductions next to every adapted
        # projection's (twice the base forward's noise each, as in test_lora_engine): 2 x 2.
        assert_same_tokens_but_at_a_tie(
            output_tokens(responses), ref, rec.logits,
            lambda logits: 4 * fp32_noise_bound(3, 128, logits.abs().max().item()))
    cuda.close()
