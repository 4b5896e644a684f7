"""What the sampler hands back: a step's sampled tokens still on the device (`DeviceSample`,
whose copy to the host is queued without waiting) and on the host (`SamplerOutput`).

`DeviceSample.start_copy` queues the tokens' (and any logits') copy to pinned host memory and
`result` waits for that copy alone (a CUDA event, not the whole stream), so the next step can
be queued before the host reads this one's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inflight.core.beam_search import Candidates

# Sampled id of a row with nothing to sample from (NaN or +inf logits, every token banned).
INVALID_TOKEN = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]  # INVALID_TOKEN for a row with nothing to sample from
    log_probs: list[float | None]  # None for rows that did not ask for log probs
    # Raw logits (before any processing) of the sampled rows that asked for them, in row
    # order: [G, vocab] float32 on the host; and the prompt positions' logits the step was
    # asked for (the worker's `context_logits` spans, in order): [C, vocab].
    generation_logits: torch.Tensor | None = None
    context_logits: torch.Tensor | None = None
    # Row -> why its logits hook failed; such a row's token is INVALID_TOKEN.
    errors: dict[int, str] = field(default_factory=dict)

    beams: dict[int, Candidates] = field(default_factory=dict)  # beam request id -> candidates
    # Per row: (log probs, ids) of its num_top_log_probs most likely tokens, descending; None
    # for rows that did not ask (None altogether when none did).
    top_log_probs: list[tuple[list[float], list[int]] | None] | None = None
    # The context spans' logits reduced to log probs (`reduce_prompt_logits`): [C, 1 + 2K].
    prompt_log_probs: torch.Tensor | None = None

    def result(self) -> SamplerOutput:
        """Already on the host: `DeviceSample.result()`'s answer, for samples made there."""
        return self


@dataclass
class DeviceSample:
    """One step's sampled tokens, still on the logits' device (see the module docstring).

    `generation_logits` / `context_logits` (only when a request asked for them) ride along:
    their device -> host copies are queued with the tokens' and waited for by the same event,
    so returning logits adds no host sync, with or without overlapped steps.
    """

    token_ids: torch.Tensor  # [S] int64
    log_probs: torch.Tensor | None  # [S] float32 log prob of each chosen token, or None
    wants_log_probs: list[bool]  # per row
    generation_logits: torch.Tensor | None = None  # [G, vocab] float32
    context_logits: torch.Tensor | None = None  # [C, vocab] float32 (on CUDA: pinned host, filling)
    errors: dict[int, str] = field(default_factory=dict)  # see SamplerOutput
    _host: torch.Tensor | None = None  # pinned copy: [S] int64, or [2, S] float64 with log probs
    _host_logits: tuple = (None, None)  # pinned copies of (generation_logits, context_logits)
    _ready: object = None  # torch.cuda.Event recorded after the copies
    beam_groups: list[tuple[int, int]] = field(default_factory=list)  # (request id, K) per group
    beam_values: torch.Tensor | None = None  # [4, sum of K] float64 (beam_search.beam_candidates)
    top_values: torch.Tensor | None = None  # [2, S, K max] float64: top log probs, their ids
    top_counts: list[int] = field(default_factory=list)  # per row: its num_top_log_probs
    prompt_log_probs: torch.Tensor | None = None  # [C, 1 + 2K] float32 (reduce_prompt_logits)

    def start_copy(self) -> DeviceSample:
        """Queues the device -> host copies without waiting (CUDA); a no-op on the CPU."""
        if self.token_ids.device.type != "cuda" or self._ready is not None:
            return self
        values = self.token_ids
        if self.log_probs is not None:  # one transfer for both: float64 holds every id exactly
            values = torch.stack([self.token_ids.double(), self.log_probs.double()])
        self._host = _pinned_copy(values)
        self._host_logits = (_pinned_copy(self.generation_logits), _pinned_copy(self.context_logits))
        if self.beam_values is not None:
            self.beam_values = self.beam_values.to("cpu", non_blocking=True)
        self.top_values = _pinned_copy(self.top_values)
        self.prompt_log_probs = _pinned_copy(self.prompt_log_probs)
        self._ready = torch.cuda.Event()
        self._ready.record()
        return self

    def result(self) -> SamplerOutput:
        """The tokens on the host: waits for this step's copies only (the step's one host wait)."""
        generation_logits, context_logits = self.generation_logits, self.context_logits
        if self.token_ids.device.type == "cuda":
            self.start_copy()
            self._ready.synchronize()
            values = self._host
            # Out of pinned memory: a request keeps its rows for its whole life.
            generation_logits, context_logits = (None if t is None else t.clone() for t in self._host_logits)
        elif self.log_probs is not None:
            values = torch.stack([self.token_ids.double(), self.log_probs.double()])
        else:
            values = self.token_ids
        beams = self._beams()
        prompt = self.prompt_log_probs
        if prompt is not None and prompt.device.type == "cpu" and prompt.is_pinned():
            prompt = prompt.clone()  # out of pinned memory: the request keeps its rows
        if self.log_probs is None:
            return SamplerOutput(values.tolist(), [None] * len(self.wants_log_probs),
                                 generation_logits, context_logits, self.errors, beams,
                                 prompt_log_probs=prompt)
        token_list, log_prob_list = values.tolist()
        return SamplerOutput([int(t) for t in token_list],
                             [lp if want else None for lp, want in zip(log_prob_list, self.wants_log_probs)],
                             generation_logits, context_logits, self.errors, beams, self._top(), prompt)

    def _top(self) -> list[tuple[list[float], list[int]] | None] | None:
        if self.top_values is None:
            return None
        log_probs, ids = self.top_values.tolist()  # [S][K max] each
        return [(lp[:k], [int(i) for i in row_ids[:k]]) if k else None
                for lp, row_ids, k in zip(log_probs, ids, self.top_counts)]

    def _beams(self) -> dict[int, Candidates]:
        if self.beam_values is None:
            return {}
        out, start = {}, 0
        tokens, parents, cum, lps = self.beam_values.tolist()
        for group, k in self.beam_groups:
            end = start + k
            out[group] = Candidates([int(t) for t in tokens[start:end]], [int(p) for p in parents[start:end]],
                                    cum[start:end], lps[start:end])
            start = end
        return out


def _pinned_copy(values: torch.Tensor | None) -> torch.Tensor | None:
    if values is None or values.device.type == "cpu":  # None, or already copied (pinned)
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host
