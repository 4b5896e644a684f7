"""The offline API (`ModelRunner`): StoppingCriteria, LogitsProcessor, text output, and that a
failing call leaves no request behind; over `FakeWorker` logits (no weights, exact)."""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import FinishReason, RequestError
from inflight.engine.llm_engine import LLMEngine
from inflight.hosts.runtime import LogitsProcessor, ModelRunner, StoppingCriteria
from preprocessing import load_tokenizer
from tests.model.engine_utils import DEFAULT_KV, assert_kv_idle
from tests.model.fake_worker import FakeWorker

PROMPTS = [[40, 41, 40, 41, 40, 41], [1, 17, 250, 33, 499, 8], [7, 300, 301, 9, 120]]


def fake_engine(**config) -> LLMEngine:
    executor_config = ExecutorConfig(kv_cache_config=DEFAULT_KV, **config)
    return LLMEngine(executor_config, FakeWorker(executor_config))


@pytest.fixture(scope="module")
def runner(smollm2_dir) -> ModelRunner:
    """A runner with SmolLM2's tokenizer (ids below the fake vocabulary decode to text)."""
    return ModelRunner(fake_engine(), load_tokenizer(smollm2_dir))


class StopOnToken(StoppingCriteria):
    def __init__(self, token_id: int):
        self.token_id = token_id
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, request_id: int, token_ids: list[int]) -> bool:
        self.calls.append((request_id, list(token_ids)))
        return token_ids[-1] == self.token_id


class BanTokens(LogitsProcessor):
    def __init__(self, banned: set[int]):
        self.banned = sorted(banned)
        self.request_ids: set[int] = set()

    def __call__(self, request_id: int, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.request_ids.add(request_id)
        logits = logits.clone()
        logits[self.banned] = float("-inf")
        return logits


def test_runner_stopping_criteria(runner):
    plain = runner.generate(PROMPTS, max_new_tokens=16, end_id=-1)
    stop_token = plain[0].output_token_ids[3]
    criteria = StopOnToken(stop_token)
    outputs = runner.generate(PROMPTS, max_new_tokens=16, end_id=-1, stopping_criteria=criteria)
    for ref, out in zip(plain, outputs):
        if stop_token in ref.output_token_ids:  # stops right after it, keeping it
            cut = ref.output_token_ids.index(stop_token) + 1
            assert out.output_token_ids == ref.output_token_ids[:cut]
            assert out.finish_reason is FinishReason.STOP_WORDS
        else:
            assert out.output_token_ids == ref.output_token_ids
            assert out.finish_reason is FinishReason.LENGTH
    # Called once per generated token with the whole sequence (prompt first).
    assert len(criteria.calls) == sum(len(o.output_token_ids) for o in outputs)
    _, token_ids = criteria.calls[0]
    assert token_ids[:-1] in PROMPTS


class RaiseOnCall(StoppingCriteria):
    def __call__(self, request_id: int, token_ids: list[int]) -> bool:
        raise ValueError("broken criteria")


def test_a_raising_stopping_criteria_fails_only_its_request(runner):
    with pytest.raises(RuntimeError, match="stopping criteria failed: broken criteria"):
        runner.generate(PROMPTS[:1], max_new_tokens=4, end_id=-1, stopping_criteria=RaiseOnCall())
    assert runner.engine.block_manager.num_free_blocks == runner.engine.block_manager.num_total_blocks
    assert runner.generate(PROMPTS[:1], max_new_tokens=4, end_id=-1)[0].output_token_ids


def test_runner_logits_processor(runner):
    plain = runner.generate(PROMPTS[:2], max_new_tokens=12, end_id=-1)
    banned = {t for out in plain for t in out.output_token_ids}
    processor = BanTokens(banned)
    outputs = runner.generate(PROMPTS[:2], max_new_tokens=12, end_id=-1, logits_processor=processor,
                              return_log_probs=True)
    for out in outputs:
        assert len(out.output_token_ids) == 12 and not banned & set(out.output_token_ids)
        assert len(out.log_probs) == 12 and all(lp <= 0.0 for lp in out.log_probs)
        assert out.text == runner.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    assert len(processor.request_ids) == 2


def test_runner_leaves_no_request_behind_on_errors(runner):
    too_long = list(range(10, 10 + runner.engine.worker.max_seq_len))
    with pytest.raises(RequestError, match="exceeds the model's maximum sequence length"):
        runner.generate([PROMPTS[0], too_long], max_new_tokens=4)
    assert_kv_idle(runner.engine)
    # A failed step fails its request; the call raises and cancels the ones still queued.
    one_at_a_time = ModelRunner(fake_engine(max_batch_size=1))

    def fail_second_step(batch):
        if one_at_a_time.engine.iteration == 1:
            raise RuntimeError("injected")

    one_at_a_time.engine.fault_hook = fail_second_step
    with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: injected"):
        one_at_a_time.generate(PROMPTS, max_new_tokens=4)
    assert_kv_idle(one_at_a_time.engine)
    one_at_a_time.engine.fault_hook = None
    assert len(one_at_a_time.generate(PROMPTS[:1], max_new_tokens=4)[0].output_token_ids) == 4
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        ModelRunner(runner.engine).generate(["hello"])
    with pytest.raises(TypeError, match="unknown ExecutorConfig fields"):
        ModelRunner.from_dir("unused-dir", max_batch=3)

