"""What a request returns besides its tokens: its logits and its perf metrics.

`RequestOutputs` collects, for one sequence, what its `OutputConfig` asked for and nothing else:
- context logits: the raw logits of every prompt position, `[prompt_len, vocab]` float32
  (TensorRT-LLM's `Result.context_logits`). A request that asks for them computes its whole
  prompt itself (no prefix-cache hit skips a position: TensorRT-LLM then returns only the
  recomputed suffix's); chunked prompts and recomputes after preemption gather each position
  once (`context_span`).
- generation logits: the raw logits (before bias, penalties, bans and temperature) of every
  sampling step, the one that picked end_id included, as Hugging Face's
  `generate(output_logits=True)` returns them; `[1, steps, vocab]` (beam 1) per response: all
  of them when not streaming, the new ones when streaming.
- prompt log probs: each prompt token's log prob given the tokens before it, reduced on the
  device from the same prompt positions' logits (with the K likeliest tokens there when
  num_top_log_probs asks), `[prompt_len, 1 + 2K]` rows gathered here; sent once, as
  `Result.prompt_log_probs` and its top lists.
- perf metrics: the engine's clocks (ns since the epoch: arrival at `enqueue`, first step
  that computes the request, first and last sampled token read on the host) and the
  sequence's KV blocks (fresh, attached reused), as TensorRT-LLM's `RequestPerfMetrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from inflight.api.types import OutputConfig, RequestPerfMetrics, Result
from inflight.core.sequence import Sequence


@dataclass(eq=False)
class RequestOutputs:
    config: OutputConfig
    num_prompt_tokens: int
    want_context_logits: bool = False  # the config's, for the request's first sequence only
    arrival_time_ns: int = field(default_factory=time.time_ns)
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    num_context_logits_scheduled: int = 0  # prompt positions whose logits a step computes
    context_logits: list[torch.Tensor] = field(default_factory=list)  # chunks [n, vocab]
    generation_logits: list[torch.Tensor] = field(default_factory=list)  # rows [vocab]
    num_sent_generation_logits: int = 0
    is_context_logits_sent: bool = False
    # Reduced prompt rows [n, 1 + 2K] (chosen log prob, K top log probs, their ids), in order.
    prompt_log_prob_rows: list[torch.Tensor] = field(default_factory=list)
    num_context_positions: int = 0  # prompt positions whose logits (or their reduction) arrived
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    num_accepted_draft_tokens: int = 0

    def __post_init__(self) -> None:
        config = self.config
        # Fixed for the request's life; read per token and per response. want_context_logits
        # (the prompt's positions computed, none from the prefix cache) serves both the raw
        # logits and the prompt log probs.
        self.keeps_context_logits = self.want_context_logits and config.return_context_logits
        self.wants_prompt_log_probs = self.want_context_logits and config.return_prompt_log_probs
        self.tracks_tokens = config.return_perf_metrics or config.return_generation_logits
        self.is_asked = self.tracks_tokens or self.want_context_logits

    @property
    def needs_context_logits(self) -> bool:
        return self.want_context_logits and self.num_context_logits_scheduled < self.num_prompt_tokens

    def context_span(self, start_position: int, num_new_tokens: int) -> tuple[int, int] | None:
        """For a step computing positions [start_position, +num_new_tokens): (first of them,
        how many) whose logits to keep, or None; marks them scheduled."""
        start = max(start_position, self.num_context_logits_scheduled)
        end = min(start_position + num_new_tokens, self.num_prompt_tokens)
        if end <= start:
            return None
        self.num_context_logits_scheduled = end
        return start - start_position, end - start

    def on_token(self, generation_logits: torch.Tensor | None) -> None:
        """A sampled token arrived on the host (end_id included), with its step's raw logits."""
        now_ns = time.time_ns()
        if not self.first_token_time_ns:
            self.first_token_time_ns = now_ns
        self.last_token_time_ns = now_ns
        if generation_logits is not None:
            self.generation_logits.append(generation_logits)

    def fill(self, result: Result, seq: Sequence, streaming: bool) -> None:
        """Sets the logits and perf metrics `result` (a response being built) carries."""
        if self.want_context_logits and not self.is_context_logits_sent and (
                result.is_sequence_final or streaming) and self._context_complete():
            if self.keeps_context_logits:
                result.context_logits = torch.cat(self.context_logits)  # [prompt_len, vocab]
            if self.wants_prompt_log_probs:
                self._fill_prompt_log_probs(result)
            self.is_context_logits_sent = True
            self.context_logits, self.prompt_log_prob_rows = [], []  # sent once
        if self.config.return_generation_logits and (streaming or result.is_sequence_final):
            rows = self.generation_logits[self.num_sent_generation_logits:] if streaming else self.generation_logits
            self.num_sent_generation_logits = len(self.generation_logits)
            if rows:
                result.generation_logits = torch.stack(rows).unsqueeze(0)  # [beam 1, steps, vocab]
        if self.config.return_perf_metrics:
            result.request_perf_metrics = RequestPerfMetrics(
                arrival_time_ns=self.arrival_time_ns, first_scheduled_time_ns=self.first_scheduled_time_ns,
                first_token_time_ns=self.first_token_time_ns, last_token_time_ns=self.last_token_time_ns,
                kv_cache_alloc_new_blocks=seq.num_new_blocks, kv_cache_reused_blocks=seq.num_reused_blocks,
                kv_cache_alloc_total_blocks=seq.num_new_blocks + seq.num_reused_blocks,
                acceptance_rate=self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1),
                total_accepted_draft_tokens=self.num_accepted_draft_tokens,
                total_draft_tokens=self.num_draft_tokens)

    def _context_complete(self) -> bool:
        return self.num_context_positions == self.num_prompt_tokens

    def _fill_prompt_log_probs(self, result: Result) -> None:
        # Position i predicts prompt token i + 1: the last position's row has no target.
        rows = torch.cat(self.prompt_log_prob_rows)[:-1].double()  # [prompt_len - 1, 1 + 2K max]
        result.prompt_log_probs = rows[:, 0].tolist()
        k = self.config.num_top_log_probs
        if k:
            result.prompt_top_log_probs = rows[:, 1:1 + k].tolist()
            result.prompt_top_log_prob_ids = rows[:, 1 + k:1 + 2 * k].long().tolist()

    def take_prompt_rows(self, rows: torch.Tensor) -> None:
        """A step's reduced rows for this request's positions: [n, 1 + 2W] (W the step's widest
        K), kept as [n, 1 + 2K] with this request's K."""
        k, width = self.config.num_top_log_probs, (rows.shape[1] - 1) // 2
        self.prompt_log_prob_rows.append(torch.cat([rows[:, :1 + k], rows[:, 1 + width:1 + width + k]], 1))
