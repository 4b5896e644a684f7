"""Beam search on CUDA (fp32, the default fast path: Triton attention, CUDA graphs, overlap on)
gives HF's beams (tiny random Llama), next to greedy requests that keep the CPU's tokens.

With overlap a beam group sits out the step launched before its re-ranking is read (its next
rows and blocks are known on the host only then); its decode steps may replay a CUDA graph, and
its block copies are queued without a host sync. Beam order can only differ from HF's where two
hypotheses' scores are within fp32 noise; the tiny model's logits are well separated.
On the GPU machine: `bash checks/gpu_check.sh beam`.
"""

from __future__ import annotations

import pytest

from inflight.api.config import ExecutorConfig
from inflight.api.types import SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, final, gen_request, output_tokens, run
from tests.model.numerics import assert_greedy_tokens_match
from tests.model.test_beam_search import HF_CASES, PROMPTS, TRT_EARLY_STOPPING, hf_beams


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(HF model, CPU engine, its greedy tokens and logits per prompt, CUDA engine), built once."""
    path = tmp_path_factory.mktemp("beam_cuda")
    hf = save_tiny_checkpoint("llama3", path)
    cpu = LLMEngine.from_dir(path, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV))
    recorders = [RecordLogits() for _ in PROMPTS]
    greedy = [output_tokens(r) for r in run(cpu, [gen_request(p, 12, end_id=-1, logits_processor=rec)
                                                  for p, rec in zip(PROMPTS, recorders)])]
    cuda = LLMEngine.from_dir(path, ExecutorConfig(device="cuda", dtype="float32", max_beam_width=4,
                                                   kv_cache_config=DEFAULT_KV))
    return hf, cpu, greedy, recorders, cuda


@pytest.mark.parametrize("case", HF_CASES, ids=[f"w{c[0]}-lp{c[2]}-es{c[3]}" for c in HF_CASES])
def test_cuda_beams_match_hf_next_to_greedy_requests(engines, case):
    hf, cpu, greedy, recorders, cuda = engines
    width, max_tokens, length_penalty, early_stopping, eos_index = case
    prompt = PROMPTS[0]
    eos = greedy[0][eos_index]
    expected, _ = hf_beams(hf, prompt, width, max_tokens, length_penalty, early_stopping, eos)
    sampling = SamplingConfig(beam_width=width, length_penalty=length_penalty,
                              early_stopping=TRT_EARLY_STOPPING[early_stopping])
    responses = run(cuda, [gen_request(PROMPTS[1], 12, end_id=-1),
                           gen_request(prompt, max_tokens, end_id=eos, sampling_config=sampling),
                           gen_request(PROMPTS[0], 12, end_id=-1)])
    assert final(responses[1]).result.output_token_ids == expected
    for index, got in ((1, responses[0]), (0, responses[2])):  # beams leave their neighbours alone
        assert_greedy_tokens_match(greedy[index], recorders[index].logits, output_tokens(got),
                                   cpu.model_config, f"greedy prompt {index}")
    assert cuda._overlaps() == cuda.worker.overlap  # beams do not switch overlap off
