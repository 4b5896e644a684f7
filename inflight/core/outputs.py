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

from inflight.core.sequence import Sequence


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    # Tokens computed this step: 1 for a decode, up to the whole prompt for a prefill, less for
    # a chunk of a long prompt under chunked context.
    num_new_tokens: int
    # Snapshots taken when the row is scheduled, so the properties below still describe this
    # step after `Scheduler.update` has advanced the sequence.
    start_position: int = field(init=False)  # position of the first token computed this step
    num_seq_tokens: int = field(init=False)  # seq.num_tokens when scheduled

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_position", self.seq.num_computed_tokens)
        object.__setattr__(self, "num_seq_tokens", self.seq.num_tokens)

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step: what attention reads for the last query."""
        return self.start_position + self.num_new_tokens

    @property
    def is_sampled(self) -> bool:
        """True when this step reaches the end of the sequence, so a next token is sampled."""
        return self.context_len == self.num_seq_tokens

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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_context_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_context)

    @property
    def num_context_requests(self) -> int:
        return sum(1 for s in self.scheduled if s.is_context)

    @property
    def num_generation_requests(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_context)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls()
