"""Speculative decoding on CUDA (fp32, greedy, a tiny random Llama): verify steps replayed in
the mixed-step CUDA graphs and run eagerly give the tokens of the same engine without drafts,
whether the drafts are always right, never right, or the n-gram drafter's. The same engine
computes both, so the only difference is the verify step's batched positions against one
position a step: fp32 float noise, far below the random model's top-two logit gaps."""

from __future__ import annotations

import pytest

from inflight.api.config import ExecutorConfig, ExtendedRuntimePerfKnobConfig, NgramConfig, SpeculativeConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.engine.drafters import NgramDrafter
from tests.model.engine_utils import DEFAULT_KV, gen_request, output_tokens, run
from tools.checkpoints import save_tiny_checkpoint
from tools.drafters import KnownContinuation

PROMPTS = [[1 + (i * 7 + j) % (9 + i) for j in range(12 + 5 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_spec")
    save_tiny_checkpoint("llama3", path)
    return path


@pytest.mark.parametrize("graphs", [True, False])
def test_verify_steps_give_the_plain_tokens(folder, graphs):
    knobs = ExtendedRuntimePerfKnobConfig(cuda_graph_mode=graphs)
    engine = LLMEngine.from_dir(folder, ExecutorConfig(
        device="cuda", dtype="float32", kv_cache_config=DEFAULT_KV, max_batch_size=32,
        extended_runtime_perf_knob_config=knobs, speculative_config=SpeculativeConfig(ngram=NgramConfig())))
    if graphs:
        assert engine.worker.graph_runner is not None and engine.worker.graph_runner.mixed is not None
    engine.speculation.drafter = None
    want = [output_tokens(r) for r in run(engine, [gen_request(p, 40) for p in PROMPTS])]
    vocab = engine.model_config.vocab_size
    for drafter in (KnownContinuation(PROMPTS, want, vocab, max_draft_tokens=4),
                    KnownContinuation(PROMPTS, want, vocab, wrong=True, max_draft_tokens=3),
                    NgramDrafter(NgramConfig(max_draft_tokens=4, min_ngram=1))):
        engine.speculation.drafter = drafter
        assert [output_tokens(r) for r in run(engine, [gen_request(p, 40) for p in PROMPTS])] == want
    engine.close()


def test_draft_logits_of_the_models_own_distribution_are_accepted(folder):
    """tests/model/test_speculative.py's rejection-rule check on CUDA (graphs on): the verify
    step's raw logits reach the host rule from the mixed-step graph's logits buffer."""
    from ensemble.sampling_distribution import as_logits, sampling_distribution
    from inflight.api.types import ExternalDraftTokensConfig, SamplingConfig

    engine = LLMEngine.from_dir(folder, ExecutorConfig(device="cuda", dtype="float32",
                                                       kv_cache_config=DEFAULT_KV, max_batch_size=8))
    config = SamplingConfig(temperature=0.8, top_k=20, seed=3)
    request = gen_request(PROMPTS[4], 12, sampling_config=config)
    request.output_config.return_generation_logits = True
    [responses] = run(engine, [request])
    tokens = output_tokens(responses)
    logits = responses[-1].result.generation_logits[0].cpu().numpy()
    draft = ExternalDraftTokensConfig(tokens[:6], as_logits(sampling_distribution(logits[:6], 0.8, 20)))
    again = gen_request(PROMPTS[4], 12, sampling_config=config, external_draft_tokens_config=draft)
    again.output_config.return_perf_metrics = True
    [responses] = run(engine, [again])
    metrics = responses[-1].result.request_perf_metrics
    assert output_tokens(responses)[:6] == tokens[:6]
    assert (metrics.total_draft_tokens, metrics.total_accepted_draft_tokens) == (6, 6)
    engine.close()
