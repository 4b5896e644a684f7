"""A fault in one request fails that request only; a fault that breaks the device fails all.

Over `FakeWorker` logits (exact, milliseconds): three requests share every step; the middle one
carries the fault (a logits processor that raises or returns NaN, an embedding bias that bans
every token, an out-of-range id from the model, a stopping criteria that raises). It must end
with one error naming what broke, and the other two must produce exactly what they produce
alone. A CUDA-style error from a step must instead stop the engine (`EngineFatalError`), so the
executor fails every request and stops accepting new ones.
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import Request
from inflight.engine.llm_engine import LLMEngine
from inflight.fatal_errors import EngineFatalError, breaks_device
from inflight.sampling.outputs import SamplerOutput
from tests.model.engine_utils import DEFAULT_KV, gen_request, output_tokens, run
from tests.model.fake_worker import VOCAB, FakeWorker

PROMPTS = [[1, 17, 250, 33], [40, 41, 40, 41], [7, 300, 301, 9]]
NUM_NEW = 8


def make_engine(worker_class=FakeWorker) -> LLMEngine:
    config = ExecutorConfig(kv_cache_config=DEFAULT_KV)
    return LLMEngine(config, worker_class(config))


def request(prompt, **fields) -> Request:
    return gen_request(prompt, NUM_NEW, **fields)


@pytest.fixture(scope="module")
def solo() -> list[list[int]]:
    """Each prompt's greedy output when it runs alone."""
    return [output_tokens(run(make_engine(), [request(prompt)])[0]) for prompt in PROMPTS]


def raising_processor(request_id, token_ids, logits):
    if len(token_ids) > len(PROMPTS[1]) + 2:
        raise ZeroDivisionError("processor bug")
    return logits


def nan_processor(request_id, token_ids, logits):
    return logits * float("nan")


def overflowing_processor(request_id, token_ids, logits):
    return logits * 1e38  # what a repetition penalty of 1e-38 does: +inf (and -inf) logits


def wrong_shape_processor(request_id, token_ids, logits):
    return logits[:10]


def raising_criteria(request_id, token_ids):
    raise KeyError("stop-word check bug")


@pytest.mark.parametrize("fault, error", [
    (dict(logits_processor=raising_processor),
     "logits processor failed: ZeroDivisionError: processor bug"),
    (dict(logits_processor=nan_processor), "its logits became NaN or infinite, or every token was banned"),
    (dict(logits_processor=overflowing_processor), "its logits became NaN or infinite"),
    (dict(logits_processor=wrong_shape_processor), "logits processor failed: ValueError: returned"),
    (dict(embedding_bias=[float("-inf")] * VOCAB), "its logits became NaN or infinite, or every token was banned"),
    (dict(stopping_criteria=raising_criteria), "stopping criteria failed: 'stop-word check bug'"),
])
def test_one_faulty_request_fails_alone(solo, fault, error):
    engine = make_engine()
    requests = [request(PROMPTS[0]), request(PROMPTS[1], **fault), request(PROMPTS[2])]
    first, faulty, last = run(engine, requests)  # also checks that every KV block came back
    assert faulty[-1].has_error() and error in faulty[-1].error_msg
    assert [output_tokens(first), output_tokens(last)] == [solo[0], solo[2]]


class OutOfVocabWorker(FakeWorker):
    """A broken checkpoint: the model answers an id past its vocabulary for one request."""

    def launch(self, order) -> SamplerOutput:
        output = super().launch(order)
        sampled = [item for item in order.batch.scheduled if item.is_sampled]
        for i, item in enumerate(sampled):
            if item.seq.prompt_token_ids == PROMPTS[1]:
                output.token_ids[i] = VOCAB + 5
        return output


def test_out_of_vocabulary_token_fails_its_request_only(solo):
    engine = make_engine(OutOfVocabWorker)
    first, faulty, last = run(engine, [request(p) for p in PROMPTS])
    assert len(faulty) == 1 and f"token id {VOCAB + 5}, outside its vocabulary" in faulty[0].error_msg
    assert [output_tokens(first), output_tokens(last)] == [solo[0], solo[2]]


@pytest.mark.parametrize("message", ["CUDA error: an illegal memory access was encountered",
                                     "CUDA error: device-side assert triggered"])
def test_device_fault_stops_the_engine(message):
    engine = make_engine()
    engine.add_request(request(PROMPTS[0]))

    def broken_device(batch):
        raise RuntimeError(message)

    engine.fault_hook = broken_device
    with pytest.raises(EngineFatalError, match="RuntimeError: CUDA error"):
        engine.step()


def test_device_broken_classification():
    assert breaks_device(EngineFatalError("x"))
    assert breaks_device(RuntimeError("CUDA error: unspecified launch failure"))
    assert not breaks_device(RuntimeError("shape mismatch"))
    assert not breaks_device(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not breaks_device(ValueError("CUDA error"))  # not a runtime failure of the device
