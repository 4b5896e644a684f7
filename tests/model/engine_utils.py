"""Helpers for the engine and executor tests: engines that share loaded weights, driving an
engine to completion, and Hugging Face greedy references."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import pytest
import torch

import inflight.runner.worker
from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import OutputConfig, Request, Response
from inflight.engine.llm_engine import LLMEngine
from inflight.hosts.runtime import LogitsProcessor

# Small enough that allocating (zeroing) the cache is cheap; tests that exercise capacity pass
# their own KvCacheConfig.
DEFAULT_KV = KvCacheConfig(max_tokens=4096, tokens_per_block=16)


class RecordLogits(LogitsProcessor):
    """Keeps every raw logits row it sees; changes nothing."""

    def __init__(self):
        self.logits: list[torch.Tensor] = []

    def __call__(self, request_id: int, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.clone())
        return logits


@contextlib.contextmanager
def shared_weights() -> Iterator[None]:
    """Engines built inside share one loaded copy of each checkpoint (weights are read-only at
    inference; every engine still gets its own KV cache, scheduler and block manager)."""
    cache: dict = {}
    real_load = inflight.runner.worker.load_model

    def cached_load(model_dir, dtype, device, *args, **kwargs):
        if kwargs:  # a tensor-parallel rank's shards (tp=...) or in-memory weights: not shared
            return real_load(model_dir, dtype, device, *args, **kwargs)
        key = (str(Path(model_dir).resolve()), dtype, str(device), *args)
        if key not in cache:
            cache[key] = real_load(model_dir, dtype, device, *args)
        return cache[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inflight.runner.worker, "load_model", cached_load)
        yield


def make_engine(model_dir, **config) -> LLMEngine:
    """An fp32 CPU engine; keyword arguments are ExecutorConfig fields."""
    config.setdefault("kv_cache_config", DEFAULT_KV)
    return LLMEngine.from_dir(model_dir, ExecutorConfig(dtype="float32", device="cpu", **config))


def gen_request(prompt: list[int], max_tokens: int, return_log_probs: bool = False, **fields) -> Request:
    """A Request whose output holds the generated tokens only."""
    return Request(prompt, max_tokens, output_config=OutputConfig(
        exclude_input_from_output=True, return_log_probs=return_log_probs), **fields)


def run(engine: LLMEngine, requests: list[Request], max_steps: int = 2000) -> list[list[Response]]:
    """Adds every request at once, steps until idle; returns each request's responses in order.
    Asserts the KV accounting contract once the engine is idle."""
    ids = [engine.add_request(r) for r in requests]
    responses: dict[int, list[Response]] = {i: [] for i in ids}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for response in engine.step():
            responses[response.request_id].append(response)
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps")
    assert_kv_idle(engine)
    return [responses[i] for i in ids]


def final(responses: list[Response]) -> Response:
    """The single final response of a request (asserts there is exactly one, and it is last)."""
    finals = [r for r in responses if r.has_error() or r.result.is_final]
    assert len(finals) == 1 and finals[0] is responses[-1], responses
    return finals[0]


def output_tokens(responses: list[Response]) -> list[int]:
    """All output tokens of a request, whether it streamed or not."""
    assert not final(responses).has_error(), final(responses).error_msg
    return [t for r in responses for t in r.result.output_token_ids[0]]


def assert_kv_idle(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.requests and not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_total_blocks, (bm.num_free_blocks, bm.num_total_blocks)


def hf_greedy(hf, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF greedy continuation (fp32, eos disabled) and the raw logits of each generated token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]
