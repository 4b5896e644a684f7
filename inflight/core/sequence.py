"""Per-request state shared by the scheduler, the block manager and the engine.

A `Sequence` holds token ids only: no tensors, no sampling state, nothing on a device. The
central invariant is `num_computed_tokens <= num_tokens`: the first `num_computed_tokens`
positions of `token_ids` have their keys and values in the paged KV cache (blocks listed in
`block_table`); the rest still have to be run through the model. A prefill, a chunk of a
prefill, a decode step and a recompute after preemption are all the same thing: computing some
of the tokens that are not computed yet.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"  # left the scheduler; its blocks were returned


@dataclass(eq=False)
class Sequence:
    """One request as the control plane sees it, or one beam of a beam search request.

    A beam search request enters as one sequence (its prompt); once the prompt is computed the
    engine forks `beam_width - 1` siblings that share its blocks. The first sequence (the
    leader) stands for the whole group in the scheduler's queues: the group is scheduled,
    reserved and freed as one.

    Filled by the engine at enqueue time; `num_computed_tokens`, `block_table`, `status` and
    `num_cached_tokens` are owned by the scheduler and block manager; the engine appends each
    sampled token with `append_token`.
    """

    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Prompt tokens found in the prefix cache at the last admission (0 without reuse).
    num_cached_tokens: int = 0
    # Number of times this sequence was preempted and had to be recomputed.
    num_preemptions: int = 0
    # KV blocks over the sequence's life (per-request perf metrics): handed out fresh, and
    # attached already computed (prefix cache or the parent's prompt).
    num_new_blocks: int = 0
    num_reused_blocks: int = 0
    # False: every prompt token is computed here, none attached (its prompt logits are needed).
    reuse_prefix: bool = True
    # Another sequence of the same request (num_return_sequences > 1) whose computed prompt
    # blocks this one may share instead of recomputing them.
    fork_parent: "Sequence | None" = None
    # Monotonic admission order; preemption picks the largest (newest) first.
    arrival_index: int = field(default_factory=lambda: next(_arrival_counter))
    beam_width: int = 1  # of the request (the leader's; siblings copy it)
    beam_siblings: list["Sequence"] = field(default_factory=list)  # the leader's other beams
    # The LoRA adapter's task id (None: the base model). Its KV differs from the base model's,
    # so its cached prefix blocks are its own, and a step holds at most max_loras adapters.
    lora_id: int | None = None
    # Speculative decoding: the last `num_draft_tokens` of `token_ids` are a draft, not yet
    # verified. The step that computes them also computes the last verified token before them,
    # and samples at each of those positions; the engine then keeps the accepted prefix.
    num_draft_tokens: int = 0

    @property
    def group(self) -> list["Sequence"]:
        """The sequences scheduled together: this one and its sibling beams."""
        return [self, *self.beam_siblings] if self.beam_siblings else [self]

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def max_total_tokens(self) -> int:
        """Upper bound on `num_tokens` over the request's life (prompt + max_new_tokens)."""
        return len(self.prompt_token_ids) + self.max_new_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def add_draft(self, draft: list[int]) -> None:
        """Draft tokens after the last verified one (no draft may be pending)."""
        if self.num_draft_tokens:
            raise RuntimeError(f"request {self.request_id}: a draft is already pending")
        self.token_ids.extend(draft)
        self.num_draft_tokens = len(draft)

    def drop_draft(self) -> None:
        """Forget a pending draft that was not computed (the step's budget had no room)."""
        if self.num_draft_tokens:
            if self.num_computed_tokens > len(self.token_ids) - self.num_draft_tokens:
                raise RuntimeError(f"request {self.request_id}: a computed draft cannot be dropped")
            del self.token_ids[-self.num_draft_tokens:]
            self.num_draft_tokens = 0
