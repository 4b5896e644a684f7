"""The BLS model's draft-target speculative decoding: NVIDIA's `num_draft_tokens` flow.

Each round the draft model (`tensorrt_llm_draft_model_name`, a smaller model with the same
tokenizer) continues the sequence so far by up to `num_draft_tokens` tokens; the target
(`tensorrt_llm_model_name`) gets the same sequence with those tokens as `draft_input_ids`,
verifies them in one step and answers with the accepted ones and its own next token (and, if
the draft was cut short, plain tokens up to the round's length: they are the target's too).
The round's tokens join the sequence; rounds go on until max_tokens, the end id or a stop word
ends the target's answer. Every token is the target's: the output is what the target alone
gives (greedy: token for token).

With `use_draft_logits` the draft's generation logits go with its tokens as `draft_logits`, and
the target accepts by rejection sampling against them (a sampled request then keeps more of
the draft; greedy ones compare tokens either way).

Beyond NVIDIA's flow (batch 1, no streaming): each row of a batch runs its own rounds, and a
streamed request gets each round's new text as one response. Not built: beams, several
sequences.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ensemble.errors import InputError
from ensemble.sampling_distribution import as_logits, sampling_distribution

Tensors = dict[str, np.ndarray]
# Inputs the rounds set themselves, or that ask for outputs the BLS flow does not return.
_ROUND_INPUTS = ("input_ids", "input_lengths", "request_output_len", "draft_input_ids", "streaming",
                 "exclude_input_in_output", "return_log_probs", "return_context_logits",
                 "return_generation_logits", "return_perf_metrics", "num_return_sequences")


def check(engine_inputs: Tensors) -> None:
    """InputError for what the flow does not do."""
    for name, what in (("beam_width", "beam search"), ("num_return_sequences", "several sequences")):
        value = engine_inputs.get(name)
        if value is not None and value.size and int(value.reshape(-1)[0]) > 1:
            raise InputError(f"speculative decoding (num_draft_tokens > 0) does not support {what} "
                             f"({name} > 1)")


def _sampling(row: Tensors) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) as the engine reads the row's inputs (`SamplingConfig`):
    greedy at temperature 0, top_k 1, or with neither top_k nor top_p set (0 is unset)."""
    def value(name):
        v = row.get(name)
        return v.reshape(-1)[0].item() if v is not None and v.size else None

    temperature, top_k, top_p = value("temperature"), int(value("runtime_top_k") or 0), value("runtime_top_p")
    top_p = float(top_p) if top_p else None
    if temperature == 0.0 or top_k == 1 or (not top_k and top_p is None):
        return 0.0, 0, 1.0
    return float(1.0 if temperature is None else temperature), top_k, 1.0 if top_p is None else top_p


@dataclass
class DraftTarget:
    """The rounds over `models` (a `bls.pipeline.Models`): `target` and `draft` are the two
    engine models' names."""

    models: object
    target: str
    draft: str
    use_draft_logits: bool = False

    def rows(self, engine_inputs: Tensors, num_draft_tokens: int) -> Iterator[tuple[int, list[int]]]:
        """(batch row, the tokens of one round) for each round of each row, in order."""
        ids, lengths = engine_inputs["input_ids"], engine_inputs["input_lengths"].reshape(-1)
        max_tokens = engine_inputs["request_output_len"].reshape(-1)
        for b in range(ids.shape[0]):
            row = {k: v[b:b + 1] if v.shape[0] == ids.shape[0] and ids.shape[0] > 1 else v
                   for k, v in engine_inputs.items() if k not in _ROUND_INPUTS}
            sequence = ids[b, :int(lengths[b])].tolist()
            limit = int(max_tokens[min(b, max_tokens.shape[0] - 1)])
            for tokens in self._rounds(row, sequence, limit, num_draft_tokens):
                yield b, tokens

    def _rounds(self, row: Tensors, sequence: list[int], max_tokens: int, k: int) -> Iterator[list[int]]:
        num_generated = 0
        while num_generated < max_tokens:
            size = min(k, max_tokens - num_generated - 1)
            want_logits = {"return_generation_logits": np.asarray([[True]])} if self.use_draft_logits else {}
            draft, logits = ([], None) if size <= 0 else self._generate(self.draft, row, sequence, size,
                                                                         want_logits)
            extra = {"draft_input_ids": np.asarray([draft], dtype=np.int32)} if draft else {}
            if draft and logits is not None:  # the distribution the draft's sampling drew from
                extra["draft_logits"] = as_logits(sampling_distribution(logits, *_sampling(row)))[None]
            tokens, _ = self._generate(self.target, row, sequence, len(draft) + 1, extra)
            if tokens:
                yield tokens
            sequence += tokens
            num_generated += len(tokens)
            if len(tokens) < len(draft) + 1:  # the end id or a stop word ended the answer
                return

    def _generate(self, model: str, row: Tensors, sequence: list[int], num_tokens: int,
                  extra: Tensors | None = None) -> tuple[list[int], np.ndarray | None]:
        """The model's new tokens for `sequence` (and its generation logits [n, vocab] when asked)."""
        inputs = dict(row, input_ids=np.asarray([sequence], dtype=np.int32),
                      input_lengths=np.asarray([[len(sequence)]], dtype=np.int32),
                      request_output_len=np.asarray([[num_tokens]], dtype=np.int32),
                      streaming=np.asarray([[False]]), exclude_input_in_output=np.asarray([[True]]),
                      **(extra or {}))
        tokens: list[int] = []
        logits = []
        outputs = ["output_ids", "sequence_length"] + (["generation_logits"] if extra and
                                                        "return_generation_logits" in extra else [])
        for out in self.models.stream(model, inputs, outputs, ""):
            length = int(out["sequence_length"].reshape(-1)[0])
            tokens += out["output_ids"].reshape(-1)[:length].tolist()
            if out.get("generation_logits") is not None:
                step_logits = out["generation_logits"]  # [1, beam 1, n, vocab]
                logits.append(step_logits.reshape(-1, step_logits.shape[-1]))
        return tokens, np.concatenate(logits)[:len(tokens)] if logits else None
