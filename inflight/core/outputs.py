"""What the scheduler hands to the model worker each step.

`SchedulerOutput` is the whole contract between the CPU control plane and the device: the worker
computes, for every `ScheduledSequence`, the tokens
`seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]`, writing
their K/V into the slots given by `seq.block_table`, and samples one next token for the rows
whose `is_sampled` is true. The engine then calls `Scheduler.update` to advance
`num_computed_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from inflight.core.sequence import Sequence


@dataclass(slots=True)
class ScheduledSequence:
    """One row of a step. Read-only once built (a plain slotted class, not a frozen dataclass:
    the engine builds one per row per step, and a frozen one costs ~3x as much to build)."""

    seq: Sequence
    # Tokens computed this step: 1 for a decode, up to the whole prompt for a prefill, less for
    # a chunk of a long prompt under chunked context.
    num_new_tokens: int
    # Snapshots taken when the row is scheduled, so the fields below still describe this
    # step after `Scheduler.update` has advanced the sequence.
    start_position: int = field(init=False)  # position of the first token computed this step
    num_seq_tokens: int = field(init=False)  # seq.num_tokens when scheduled
    # True when this step reaches the end of the sequence, so a next token is sampled.
    is_sampled: bool = field(init=False)

    def __post_init__(self) -> None:
        start = self.start_position = self.seq.num_computed_tokens
        num_seq_tokens = self.num_seq_tokens = len(self.seq.token_ids)
        self.is_sampled = start + self.num_new_tokens == num_seq_tokens

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step: what attention reads for the last query."""
        return self.start_position + self.num_new_tokens

    @property
    def is_context(self) -> bool:
        """Context (prefill) phase: more than the last token is still to be computed."""
        return self.num_seq_tokens - self.start_position > 1


@dataclass
class SchedulerOutput:
    # Order is the order of rows in the model batch: running sequences first, then new ones.
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    # Sequences preempted this step (their blocks were freed; they wait to be recomputed).
    preempted: list[Sequence] = field(default_factory=list)

    @cached_property
    def _counts(self) -> tuple[int, int, int, int]:
        """(tokens, context tokens, context rows, sampled rows) in one pass over the rows,
        computed on first use: `scheduled` must be complete by then (the scheduler's is)."""
        num_tokens = num_context_tokens = num_context = num_sampled = 0
        for s in self.scheduled:
            num_tokens += s.num_new_tokens
            if s.num_seq_tokens - s.start_position > 1:
                num_context_tokens += s.num_new_tokens
                num_context += 1
            num_sampled += s.is_sampled
        return num_tokens, num_context_tokens, num_context, num_sampled

    @property
    def num_tokens(self) -> int:
        return self._counts[0]

    @property
    def num_context_tokens(self) -> int:
        return self._counts[1]

    @property
    def num_context_requests(self) -> int:
        return self._counts[2]

    @property
    def num_generation_requests(self) -> int:
        return len(self.scheduled) - self._counts[2]

    @property
    def num_sampled(self) -> int:
        return self._counts[3]

    @property
    def is_decode_only(self) -> bool:
        """Every row computes one token and samples it (a CUDA-graph decode step)."""
        num_rows = len(self.scheduled)
        return num_rows > 0 and self._counts[0] == num_rows == self._counts[3]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls()
