"""Logits and log probs on CUDA (overlapped steps, decode CUDA graphs) equal the CPU engine's.

The logits ride along with the sampled tokens (copied after them, waited for by the same event),
so requests that ask for them keep the overlapped, graph-replayed decode path; requests that do
not ask get nothing extra. fp32 on both sides: bounds from tests/model/numerics.py.
"""

from __future__ import annotations

import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import OutputConfig, Request, SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import DEFAULT_KV, final, output_tokens, run
from tests.model.numerics import assert_logits_close

PROMPTS = [[1, 17, 250, 33, 499, 8, 120, 64, 3], [1, 5], list(range(3, 34))]
NUM_NEW = 12
ALL = OutputConfig(return_log_probs=True, return_context_logits=True, return_generation_logits=True,
                   return_perf_metrics=True, exclude_input_from_output=True)


def requests() -> list[Request]:
    return [Request(PROMPTS[0], NUM_NEW, end_id=-1, output_config=ALL),
            Request(PROMPTS[1], NUM_NEW, end_id=-1, streaming=True, output_config=ALL),
            Request(PROMPTS[2], NUM_NEW, end_id=-1),  # asks for nothing, batched with the others
            Request(PROMPTS[2], NUM_NEW, end_id=-1, output_config=ALL),
            Request(PROMPTS[0], NUM_NEW, end_id=-1, output_config=ALL,
                    sampling_config=SamplingConfig(num_return_sequences=2))]


GROUP = 4  # the request with two sequences


def logits(responses, name):
    parts = [getattr(r.result, name) for r in responses if getattr(r.result, name) is not None]
    return torch.cat(parts) if name == "context_logits" else torch.cat([p[0] for p in parts])


def sequences(responses) -> dict[int, list]:
    """Each sequence's responses (non-streamed: one each)."""
    out: dict[int, list] = {}
    for r in responses:
        out.setdefault(r.result.sequence_index, []).append(r)
    return out


def cuda_engine(model_dir) -> LLMEngine:
    # max_batch_size 8: the 31-token prompt's logits come back in 4 slices (Worker._prompt_logits).
    return LLMEngine.from_dir(model_dir, ExecutorConfig(device="cuda", dtype="float32", max_batch_size=8,
                                                        kv_cache_config=DEFAULT_KV))


def test_cuda_logits_match_cpu_with_overlap_and_graphs(tmp_path):
    save_tiny_checkpoint("llama3", tmp_path)
    cpu = LLMEngine.from_dir(tmp_path, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV))
    cuda = cuda_engine(tmp_path)
    assert cuda.worker.overlap and cuda.worker.graph_runner is not None
    config = cpu.model_config
    for index, (ref, got) in enumerate(zip(run(cpu, requests()), run(cuda, requests()))):
        if index == 2:
            assert final(got).result.generation_logits is None and final(got).result.context_logits is None
            continue
        pairs = [(ref, got)]
        if index == GROUP:  # greedy: both sequences get the same tokens and logits
            assert sorted(sequences(got)) == sorted(sequences(ref)) == [0, 1]
            pairs = [(sequences(ref)[i], sequences(got)[i]) for i in (0, 1)]
        for ref_seq, got_seq in pairs:
            tokens = [t for r in got_seq for t in r.result.output_token_ids[0]]
            assert tokens == [t for r in ref_seq for t in r.result.output_token_ids[0]], \
                f"request {index}: tokens differ (a near tie?)"
            assert_logits_close(logits(got_seq, "generation_logits"), logits(ref_seq, "generation_logits"),
                                config, f"request {index} generation logits")
        first_ref, first_got = pairs[0]  # only the first sequence returns the prompt's logits
        assert_logits_close(logits(first_got, "context_logits"), logits(first_ref, "context_logits"),
                            config, f"request {index} context logits")


def test_cuda_top_and_prompt_log_probs_match_cpu(tmp_path):
    """num_top_log_probs and return_prompt_log_probs on CUDA (overlap, graphs, the prompt's
    logits reduced slice by slice on the device) against the CPU engine: the same ids (greedy)
    and prompt log probs within the logits' fp32 noise (a logit error e moves a log_softmax
    entry by at most 2e, plus its own rounding), the bound taken from the CPU's context logits."""
    from tests.model.numerics import log_softmax_noise, logit_noise_bound

    save_tiny_checkpoint("llama3", tmp_path)
    asked = OutputConfig(return_log_probs=True, num_top_log_probs=3, return_prompt_log_probs=True,
                         exclude_input_from_output=True)
    with_logits = OutputConfig(**{**asked.__dict__, "return_context_logits": True})

    def reqs(config):
        return [Request(p, NUM_NEW, end_id=-1, output_config=config, streaming=s)
                for p, s in zip(PROMPTS, (False, True, False))]

    cpu = LLMEngine.from_dir(tmp_path, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV))
    cuda = cuda_engine(tmp_path)
    config = cpu.model_config
    for ref, got in zip(run(cpu, reqs(with_logits)), run(cuda, reqs(asked))):
        [ref_prompt] = [r.result for r in ref if r.result.prompt_log_probs is not None]
        [got_prompt] = [r.result for r in got if r.result.prompt_log_probs is not None]
        assert got_prompt.context_logits is None
        positions = ref_prompt.context_logits[:-1]  # [P - 1, vocab]
        bound = 2 * logit_noise_bound(config, positions).reshape(-1) + torch.tensor(
            [log_softmax_noise(config.vocab_size, float(row.abs().max())) for row in positions])
        difference = (torch.tensor(got_prompt.prompt_log_probs, dtype=torch.float64)
                      - torch.tensor(ref_prompt.prompt_log_probs, dtype=torch.float64)).abs()
        assert bool((difference <= bound).all()), float((difference / bound).max())
        assert got_prompt.prompt_top_log_prob_ids == ref_prompt.prompt_top_log_prob_ids
        ref_top = [row for r in ref for row in r.result.top_log_prob_ids[0]]
        assert [row for r in got for row in r.result.top_log_prob_ids[0]] == ref_top
