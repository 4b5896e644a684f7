"""Offline API in the spirit of TensorRT-LLM's Python runtime.

    runner = ModelRunner.from_dir("path/to/hf_model")
    outputs = runner.generate(["Hello"], SamplingConfig(temperature=0.7, top_p=0.95, seed=1), max_new_tokens=32)

`generate` feeds every prompt to one engine at once, so they share steps (in-flight batching),
and returns when all are done. `StoppingCriteria` and `LogitsProcessor` are the extension points.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import torch

from inflight.api.config import ExecutorConfig
from inflight.api.types import FinishReason, OutputConfig, Request, SamplingConfig
from inflight.engine.llm_engine import LLMEngine


class StoppingCriteria:
    """Return True to stop a request after its latest token (its tokens are kept)."""

    def __call__(self, request_id: int, token_ids: list[int]) -> bool:
        raise NotImplementedError


class LogitsProcessor:
    """Rewrite one request's next-token logits ([vocab] float32) before sampling."""

    def __call__(self, request_id: int, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class GenerationOutput:
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason
    log_probs: list[float] | None = None
    text: str | None = None


class ModelRunner:
    def __init__(self, engine: LLMEngine, tokenizer=None):
        self.engine = engine
        self.tokenizer = tokenizer

    @classmethod
    def from_dir(cls, model_dir: str | Path, load_tokenizer: bool = True, **config) -> "ModelRunner":
        """Load a Hugging Face folder. Keyword arguments are `ExecutorConfig` fields."""
        known = {f.name for f in fields(ExecutorConfig)}
        unknown = set(config) - known
        if unknown:
            raise TypeError(f"unknown ExecutorConfig fields: {sorted(unknown)}")
        engine = LLMEngine.from_dir(model_dir, ExecutorConfig(**config))
        tokenizer = None
        if load_tokenizer:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(engine, tokenizer)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling_config: SamplingConfig | None = None, max_new_tokens: int = 32,
                 end_id: int | None = None, stop_words: list[list[int]] | None = None,
                 stopping_criteria: StoppingCriteria | None = None,
                 logits_processor: LogitsProcessor | None = None,
                 return_log_probs: bool = False) -> list[GenerationOutput]:
        """Generate for every prompt (text or token ids); outputs keep the prompts' order."""
        sampling_config = sampling_config or SamplingConfig()
        if sampling_config.num_sequences > 1:  # one GenerationOutput per prompt
            raise ValueError("num_return_sequences > 1 is not supported by ModelRunner.generate; "
                             "send the prompt several times with different seeds, or use the Executor")
        if end_id is None:
            eos = self.engine.model_config.eos_token_ids
            end_id = eos[0] if eos else None
        ids = []
        finals = {}
        try:
            for prompt in prompts:
                tokens = self._encode(prompt)
                ids.append(self.engine.add_request(Request(
                    input_token_ids=tokens, max_tokens=max_new_tokens, end_id=end_id,
                    stop_words=stop_words, sampling_config=sampling_config,
                    output_config=OutputConfig(return_log_probs=return_log_probs,
                                               exclude_input_from_output=True),
                    logits_processor=logits_processor, stopping_criteria=stopping_criteria)))
            prompt_ids = {rid: list(self.engine.requests[rid].seq.prompt_token_ids) for rid in ids}
            while self.engine.has_unfinished():
                for response in self.engine.step():
                    if response.has_error():
                        raise RuntimeError(response.error_msg)
                    if response.result.is_final:
                        finals[response.request_id] = response.result
        finally:
            # A rejected prompt or a failed step must not leave the call's other requests
            # queued in the engine (holding KV blocks, and run by the next call).
            for rid in ids:
                if rid not in finals:
                    self.engine.cancel(rid)
        outputs = []
        for rid in ids:
            result = finals[rid]
            tokens = result.output_token_ids[0]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else None
            outputs.append(GenerationOutput(prompt_ids[rid], tokens, result.finish_reasons[0],
                                            result.log_probs[0] if result.log_probs else None, text))
        return outputs

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids or load_tokenizer=True")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return [int(t) for t in prompt]
