"""Beam search through the engine.

Against Hugging Face: `generate(num_beams=W, do_sample=False, length_penalty, early_stopping)`
on a tiny random checkpoint gives the same beams, in the same order, with the same scores (the
selection rules are HF's; TensorRT-LLM's early_stopping 1/0/2 are HF's True/False/"never").
The end id is a token the model likes, so hypotheses end early and the early-stopping rules
matter. Over `FakeWorker` logits (exact): beams next to other requests, streaming, cancellation,
preemption and prefix reuse, with the fake KV cache checking every beam's context after each
fork and copy-on-write.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.api.config import CapacitySchedulerPolicy, ExecutorConfig, KvCacheConfig, SchedulerConfig
from inflight.api.types import (
    FinishReason,
    GuidedDecodingParams,
    OutputConfig,
    Request,
    RequestError,
    SamplingConfig,
)
from inflight.core.beam_search import BeamRow
from inflight.engine.llm_engine import LLMEngine
from inflight.sampling.beam_search import beam_candidates
from tools.checkpoints import save_tiny_checkpoint
from tests.model.engine_utils import assert_kv_idle, final, gen_request, make_engine, run
from tests.model.fake_worker import EOS, FakeWorker
from tests.model.tolerances import fp32_noise_bound

PROMPTS = [[1, 17, 250, 33, 499, 8], [7, 300, 301, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
# (beam_width, max_tokens, length_penalty, HF early_stopping, end id = greedy token at this index)
HF_CASES = [(2, 8, 1.0, False, 2), (3, 10, 0.0, True, 3), (4, 12, 1.5, "never", 1), (4, 9, 0.5, False, 4)]
TRT_EARLY_STOPPING = {True: 1, False: 0, "never": 2}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam_llama3")
    hf = save_tiny_checkpoint("llama3", path)
    # 16-token blocks: neither prompt fills its last block, so every fork copies one.
    return hf, make_engine(path, max_beam_width=4), path


def hf_beams(hf, prompt, width, max_tokens, length_penalty, early_stopping, eos):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_tokens, num_beams=width, num_return_sequences=width,
                          do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping,
                          eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    # HF keeps the end token and pads with it; our outputs stop before it.
    rows = [row[:row.index(eos)] if eos in row else row for row in out.sequences[:, len(prompt):].tolist()]
    return rows, out.sequences_scores.tolist()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
@pytest.mark.parametrize("case", HF_CASES, ids=[f"w{c[0]}-lp{c[2]}-es{c[3]}" for c in HF_CASES])
def test_beams_match_hf_generate(tiny, prompt, case):
    hf, engine, _ = tiny
    width, max_tokens, length_penalty, early_stopping, eos_index = case
    [greedy] = run(engine, [gen_request(prompt, 6, end_id=-1)])
    eos = final(greedy).result.output_token_ids[0][eos_index]
    expected, scores = hf_beams(hf, prompt, width, max_tokens, length_penalty, early_stopping, eos)
    sampling = SamplingConfig(beam_width=width, length_penalty=length_penalty,
                              early_stopping=TRT_EARLY_STOPPING[early_stopping])
    [responses] = run(engine, [gen_request(prompt, max_tokens, return_log_probs=True, end_id=eos,
                                           sampling_config=sampling)])
    result = final(responses).result
    assert result.output_token_ids == expected
    ends = [r is FinishReason.END_ID for r in result.finish_reasons]
    ours = [cum / (len(t) + end) ** length_penalty
            for cum, t, end in zip(result.cum_log_probs, result.output_token_ids, ends)]
    # fp32 log-softmax sums over <= 12 tokens of O(1) log probs: ~1e-6 relative.
    assert ours == pytest.approx(scores, rel=1e-4, abs=1e-5)
    assert [math.fsum(lp) for lp in result.log_probs] == pytest.approx(result.cum_log_probs, abs=1e-5)


def test_non_streamed_output_starts_with_the_prompt_and_returns_num_return_sequences(tiny):
    _, engine, _ = tiny
    prompt = PROMPTS[0]
    request = Request(prompt, 6, end_id=-1, sampling_config=SamplingConfig(beam_width=4))
    [four] = run(engine, [request])
    two = Request(prompt, 6, end_id=-1, sampling_config=SamplingConfig(beam_width=4, num_return_sequences=2))
    [responses] = run(engine, [two])
    beams = final(four).result.output_token_ids
    assert all(b[:len(prompt)] == prompt for b in beams)
    assert final(responses).result.output_token_ids == beams[:2]


# ----- over FakeWorker logits ----------------------------------------------------------------

def fake_engine(**config) -> LLMEngine:
    config.setdefault("kv_cache_config", KvCacheConfig(max_tokens=4096, tokens_per_block=4))
    executor_config = ExecutorConfig(max_beam_width=4, **config)
    return LLMEngine(executor_config, FakeWorker(executor_config, check_kv=True))


def beam_request(prompt, max_tokens=10, width=3, streaming=False, **sampling) -> Request:
    return gen_request(prompt, max_tokens, return_log_probs=True, end_id=EOS, streaming=streaming,
                       sampling_config=SamplingConfig(beam_width=width, **sampling))


def outcome(responses) -> tuple:
    result = final(responses).result
    return result.output_token_ids, result.cum_log_probs, result.finish_reasons


def test_beams_next_to_other_requests_change_nothing_and_share_the_prompt():
    alone = fake_engine()
    beams = outcome(run(alone, [beam_request(PROMPTS[0])])[0])
    greedy = outcome(run(alone, [gen_request(PROMPTS[1], 12, end_id=-1)])[0])
    engine = fake_engine()
    mixed = run(engine, [gen_request(PROMPTS[1], 12, end_id=-1), beam_request(PROMPTS[0]),
                         beam_request(PROMPTS[0], width=2), gen_request([5, 6, 7], 5, end_id=-1)])
    assert outcome(mixed[0]) == greedy and outcome(mixed[1]) == beams
    assert len(final(mixed[2]).result.output_token_ids) == 2
    assert engine.worker.num_copied_blocks > 0  # 6-token prompt, 4-token blocks: a shared partial block


def test_streamed_beams_carry_every_token_so_far_and_end_like_the_non_streamed_answer():
    engine = fake_engine()
    plain = outcome(run(engine, [beam_request(PROMPTS[0], width=2, length_penalty=1.0)])[0])
    [streamed] = run(engine, [beam_request(PROMPTS[0], width=2, streaming=True, length_penalty=1.0)])
    assert outcome(streamed) == plain
    for step, response in enumerate(streamed[:-1], start=1):
        beams = response.result.output_token_ids
        assert len(beams) == 2 and all(len(b) == step for b in beams) and not response.result.is_final
        assert [len(lp) for lp in response.result.log_probs] == [step, step]


def test_cancelling_a_beam_request_frees_every_beam_block():
    engine = fake_engine(kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=4,
                                                       enable_block_reuse=True))
    request_id = engine.add_request(beam_request(PROMPTS[1], max_tokens=40, width=4))
    for _ in range(5):
        engine.step()
    state = engine.requests[request_id]
    assert len(state.seq.group) == 4 and engine.block_manager.num_used_blocks > 5
    response = engine.cancel(request_id)
    assert response.result.is_final and response.result.finish_reasons == [FinishReason.CANCELLED] * 4
    assert_kv_idle(engine)


def test_a_failed_step_fails_the_beam_request_once_and_frees_its_beams():
    engine = fake_engine()
    beam_id = engine.add_request(beam_request(PROMPTS[0], max_tokens=12, width=3))
    other_id = engine.add_request(gen_request(PROMPTS[1], 12, end_id=-1))
    for _ in range(3):
        engine.step()

    def fail_beams(batch):
        if any(item.seq.request_id == beam_id for item in batch.scheduled):
            engine.fault_hook = None
            raise RuntimeError("injected")

    engine.fault_hook = fail_beams
    responses = engine.step()  # the step's rows (the beams and their neighbour) fail, once each
    errors = [r.request_id for r in responses if r.has_error()]
    assert sorted(errors) == sorted([beam_id, other_id])
    assert_kv_idle(engine)
    [after] = run(engine, [beam_request(PROMPTS[0], max_tokens=12, width=3)])  # and it carries on
    assert len(final(after).result.output_token_ids) == 3


def test_max_utilization_preempts_plain_requests_for_beams_and_outputs_hold():
    roomy = fake_engine()
    requests = lambda: [gen_request(PROMPTS[1], 20, end_id=-1), beam_request(PROMPTS[0], max_tokens=16, width=4),
                        gen_request(PROMPTS[0] * 2, 20, end_id=-1)]
    expected = [outcome(r) for r in run(roomy, requests())]
    tight = fake_engine(kv_cache_config=KvCacheConfig(max_tokens=96, tokens_per_block=4),
                        scheduler_config=SchedulerConfig(CapacitySchedulerPolicy.MAX_UTILIZATION))
    got = [outcome(r) for r in run(tight, requests())]
    assert got == expected and tight.scheduler.num_preemptions > 0


def test_diversity_rate_ranks_candidates_by_beam_index_as_tensorrt_llm():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]]))
    rows = [BeamRow(group=1, cum_log_prob=0.0, index=i, num_candidates=2, diversity_rate=0.5) for i in range(2)]
    [(group, k)], values = beam_candidates(logits, rows)
    tokens, parents, cum, _ = values.tolist()
    # score + 0.5 * beam index: beam 1's two tokens (log 0.4 + 0.5) beat beam 0's best (log 0.5).
    assert (group, k) == (1, 2) and parents == [1.0, 1.0] and sorted(tokens) == [0.0, 1.0]
    assert cum == pytest.approx([math.log(0.4)] * 2)  # the reported score has no diversity term


def test_overlapped_steps_give_the_synchronous_beams_and_neighbours(tiny):
    """Beam groups sit out the step launched before their re-ranking; the rest overlaps."""
    _, sync, path = tiny
    requests = lambda: [gen_request(PROMPTS[1], 12, end_id=-1, streaming=True),
                        beam_request(PROMPTS[0], max_tokens=8, width=3, streaming=True, length_penalty=1.0),
                        beam_request(PROMPTS[1], max_tokens=6, width=2)]
    expected = run(sync, requests())
    overlapped = make_engine(path, max_beam_width=4, enable_overlap_scheduler=True)
    assert overlapped.worker.overlap
    got = run(overlapped, requests())
    assert [[x.result.output_token_ids for x in r] for r in got] == \
        [[x.result.output_token_ids for x in r] for r in expected]  # every streamed chunk too
    for mine, theirs in zip(got[1:], expected[1:]):
        (_, cum, reasons), (tokens, cum_sync, reasons_sync) = outcome(mine), outcome(theirs)
        assert reasons == reasons_sync
        # Rows share steps differently, and fp32 GEMM results depend on the batch's row count:
        # each token's log prob may move by the model's fp32 noise.
        for c, c_sync, t in zip(cum, cum_sync, tokens):
            assert math.isclose(c, c_sync, abs_tol=len(t) * fp32_noise_bound(3, 64, max(1.0, abs(c_sync))))


def test_guided_decoding_with_beam_search_is_refused_clearly():
    request = beam_request(PROMPTS[0], width=2)
    request.guided_decoding_params = GuidedDecodingParams("json")
    with pytest.raises(RequestError, match="guided decoding is not supported with beam search"):
        fake_engine().add_request(request)
