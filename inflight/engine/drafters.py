"""The engine's own drafters for speculative decoding (`inflight.engine.speculation`): each
proposes a draft for a batch of running requests about to decode.

- `NgramDrafter`: prompt lookup over each request's verified tokens (`inflight.core.ngram`).
- `DraftModelDrafter`: a smaller model with the same tokenizer, in the engine's process, run by
  its own `LLMEngine` (its own paged KV cache, prefix cache and CUDA graphs), greedy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ensemble.errors import ConfigError
from inflight.api.config import DraftModelConfig, ExecutorConfig, KvCacheConfig, SpeculativeConfig
from inflight.api.types import OutputConfig, Request
from inflight.core.ngram import NgramIndex
from inflight.engine.request_state import RequestState


class Drafter(Protocol):
    def propose(self, asks: list[tuple[RequestState, int]]) -> list[list[int]]:
        """A draft (possibly empty) for each (running request about to decode, at most this many
        tokens); the request's verified tokens are `state.seq.token_ids`."""


def start_drafter(config: SpeculativeConfig, executor_config: ExecutorConfig,
                  start_engine: Callable[[str, ExecutorConfig], Any]) -> Drafter | None:
    """The drafter `config` asks for; `start_engine(model_dir, config)` starts an engine (the
    draft model's: `LLMEngine.from_dir`, passed in since the engine holds this module's user)."""
    if config.ngram is not None:
        return NgramDrafter(config.ngram)
    if config.draft_model is not None:
        return DraftModelDrafter.start(config.draft_model, executor_config, start_engine)
    return None


class NgramDrafter:
    """Prompt lookup: each request keeps an index of its verified tokens (`state.draft_index`)."""

    def __init__(self, config) -> None:
        self.config = config

    def propose(self, asks: list[tuple[RequestState, int]]) -> list[list[int]]:
        drafts = []
        for state, max_tokens in asks:
            tokens = state.seq.token_ids
            index = state.draft_index
            if index is None:
                index = state.draft_index = NgramIndex(self.config, tokens)
            else:
                index.extend(tokens[index.num_tokens:])
            drafts.append(index.propose(min(max_tokens, self.config.max_draft_tokens)))
        return drafts


class DraftModelDrafter:
    """Each ask becomes a greedy request of the draft's length over the ask's verified tokens,
    and the draft engine steps until all are done. Its prefix cache keeps each sequence's blocks
    between rounds, so a round computes the tokens verified since the last one (and the last
    partial block), then one decode step per draft token for the whole batch."""

    # A wrong draft model costs its own steps too (about a plain step per round for a 1B draft of
    # an 8B model): after misses it waits up to 63 steps (0.90x of plain decoding with 15 on an
    # H100 when never right).
    max_backoff_exponent = 6

    def __init__(self, engine, config: DraftModelConfig) -> None:
        self.engine = engine
        self.config = config

    @classmethod
    def start(cls, config: DraftModelConfig, target: ExecutorConfig,
              start_engine: Callable[[str, ExecutorConfig], Any]) -> DraftModelDrafter:
        engine = start_engine(config.model_dir, ExecutorConfig(
            device=target.device, dtype=target.dtype, max_seq_len=target.max_seq_len,
            max_batch_size=target.speculative_config.max_draft_batch_size, enable_chunked_context=True,
            kv_cache_config=KvCacheConfig(enable_block_reuse=True, max_tokens=config.max_kv_tokens,
                                          free_gpu_memory_fraction=config.kv_cache_free_gpu_mem_fraction)))
        return cls(engine, config)

    def check_vocabulary(self, vocab_size: int) -> None:
        if self.engine.model_config.vocab_size != vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({self.engine.model_config.vocab_size} tokens) "
                              f"differs from the model's ({vocab_size}): a draft model shares the tokenizer")

    def propose(self, asks: list[tuple[RequestState, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in asks]
        rows = {}
        for i, (state, max_tokens) in enumerate(asks):
            size = min(max_tokens, self.config.max_draft_tokens)
            request = Request(list(state.seq.token_ids), size,
                              output_config=OutputConfig(exclude_input_from_output=True))
            try:
                rows[self.engine.add_request(request)] = i
            except ValueError:  # e.g. longer than the draft engine's max_seq_len: no draft
                continue
        while self.engine.has_unfinished():
            for response in self.engine.step():
                if not response.has_error() and response.result.is_final:
                    drafts[rows[response.request_id]] = list(response.result.output_token_ids[0])
        return drafts

    def close(self) -> None:
        self.engine.close()
