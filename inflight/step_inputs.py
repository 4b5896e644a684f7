"""A step's device inputs: the scheduler's rows → a `StepInput`, with the step's one host →
device transfer.

Two sources, one result: the scheduler's `SchedulerOutput` (one rank, `inputs_from_batch`) or
its plain `StepPlan` (tensor parallelism: every rank builds the same inputs from the plan
alone, `inputs_from_plan`). Either way the step goes
- into the static buffers of a CUDA graph, for decode steps that fit a captured batch bucket
  and mixed steps that fit a token bucket (and ask for no prompt logits), or
- into a `StepMetadata`, from which the attention backend builds its own, for an eager step.

A row's last token may be a placeholder `-(1 + i)`: "sampled row i of the previous step", whose
id is still on the device (overlapped steps). The metadata records it as a pending copy from
the worker's `sampled_ids`, made on the device before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from inflight.core.outputs import SchedulerOutput
from inflight.cuda_graph import CudaGraphRunner, GraphStep, MixedStep
from inflight.model.attention import StepMetadata
from inflight.platform import to_device
from inflight.sampling.sampler import SamplingRow
from inflight.step_plan import StepPlan

# (request_id, token_ids so far, logits [vocab]) -> logits [vocab]
LogitsHook = Callable[[int, list[int], torch.Tensor], torch.Tensor]
# (row in the batch, first of its new tokens, number of tokens): prompt positions whose logits
# a request asked for (`return_context_logits`).
ContextSpan = tuple[int, int, int]


@dataclass(frozen=True)
class StepInput:
    """Everything `run_model` and `sample` need for one step; built by `prepare_inputs`.
    Exactly one of `metadata` (eager) and `graph_step` (replayed) is set."""

    metadata: StepMetadata | None  # the step's layout (backend-neutral), with its input ids
    attn_metadata: Any  # the attention backend's metadata for this step (eager)
    graph_step: GraphStep | MixedStep | None  # a step staged in a CUDA graph's static inputs
    sampling_rows: list[SamplingRow]  # one per sampled row, in batch order
    logits_hooks: list[LogitsHook | None] | None = None  # parallel to sampling_rows
    request_ids: list[int] | None = None  # parallel to sampling_rows (the hooks' first argument)
    context_indices: torch.Tensor | None = None  # [C] int64: tokens of the step whose logits to keep
    generation_rows: list[int] | None = None  # sampled rows whose raw logits to keep

    # Tensor-parallel ranks other than 0 have no sampling rows (they compute the logits with
    # rank 0 but do not sample): `sampling_rows` is None and this is their count.
    follower_num_sampled: int = 0

    @property
    def num_sampled(self) -> int:
        return len(self.sampling_rows) if self.sampling_rows is not None else self.follower_num_sampled

    @property
    def input_ids(self) -> torch.Tensor:  # [T] int64 (eager steps)
        return self.metadata.input_ids

    @property
    def positions(self) -> torch.Tensor:  # [T] int64 (eager steps)
        return self.metadata.positions

    @property
    def logits_indices(self) -> torch.Tensor | None:  # see StepMetadata.logits_indices
        return self.metadata.logits_indices


class InputTarget(Protocol):
    """Where a step's inputs go (the `Worker`): its graphs (None: eager only, or at warm-up),
    its attention backend, KV block size and device."""

    graph_runner: CudaGraphRunner | None
    backend: Any  # an attention backend: `build_metadata(StepMetadata)`
    block_size: int
    device: torch.device


def inputs_from_batch(target: InputTarget, batch: SchedulerOutput, rows: list[SamplingRow],
                      hooks: list[LogitsHook | None] | None = None,
                      request_ids: list[int] | None = None,
                      context_logits: list[ContextSpan] | None = None,
                      generation_logits: list[int] | None = None) -> StepInput:
    """The step's inputs from the scheduler's rows (`rows`: one per sampled row, in batch order)."""
    num_sampled = batch.num_sampled
    if num_sampled != len(rows):
        raise ValueError(f"{len(rows)} sampling rows for {num_sampled} sampled sequences")
    runner = target.graph_runner
    if (not context_logits and runner is not None and runner.bucket_for(len(batch.scheduled)) is not None
            and batch.is_decode_only):
        graph_step = runner.stage_decode(batch.scheduled)
        return StepInput(None, None, graph_step, rows, hooks, request_ids, None, generation_logits)
    if (not context_logits and runner is not None
            and runner.mixed_bucket_for(batch.num_tokens, len(batch.scheduled)) is not None):
        graph_step = runner.stage_mixed([
            (s.start_position, s.seq.token_ids[s.start_position:s.context_len], s.is_sampled,
             s.seq.block_table) for s in batch.scheduled])
        return StepInput(None, None, graph_step, rows, hooks, request_ids, None, generation_logits)
    row_tokens = [item.seq.token_ids[item.start_position:item.context_len] for item in batch.scheduled]
    input_ids, row_starts, pending = _flatten(row_tokens,
                                              [item.seq.request_id for item in batch.scheduled])
    sampled_rows = [i for i, item in enumerate(batch.scheduled) if item.is_sampled]
    meta = StepMetadata.build(
        [(s.start_position, s.num_new_tokens, s.seq.block_table) for s in batch.scheduled],
        target.block_size, target.device, input_ids=input_ids, sampled_rows=sampled_rows,
        pending=pending)
    context_indices = None
    if context_logits:
        flat = [row_starts[row] + offset + j for row, offset, count in context_logits for j in range(count)]
        context_indices = to_device(torch.tensor(flat, dtype=torch.int64), target.device)
    return StepInput(meta, target.backend.build_metadata(meta), None, rows, hooks, request_ids,
                     context_indices, generation_logits)


def inputs_from_plan(target: InputTarget, plan: StepPlan, rows: list[SamplingRow] | None,
                     hooks: list[LogitsHook | None] | None = None,
                     request_ids: list[int] | None = None,
                     generation_logits: list[int] | None = None) -> StepInput:
    """The step's inputs from its plan: a staged CUDA graph step, or the metadata. `rows` None:
    a tensor-parallel rank other than 0 (it samples nothing)."""
    num_sampled = plan.num_sampled
    runner = target.graph_runner
    if runner is not None and runner.bucket_for(plan.num_rows) is not None and plan.is_decode():
        graph_step = runner.stage_plan(plan)
        return StepInput(None, None, graph_step, rows, hooks, request_ids, None, generation_logits,
                         num_sampled)
    if (runner is not None
            and runner.mixed_bucket_for(sum(map(len, plan.tokens)), plan.num_rows) is not None):
        graph_step = runner.stage_mixed(list(zip(plan.starts, plan.tokens, plan.sampled,
                                                 plan.block_tables)))
        return StepInput(None, None, graph_step, rows, hooks, request_ids, None, generation_logits,
                         num_sampled)
    input_ids, _, pending = _flatten(plan.tokens)
    sampled_rows = [i for i, sampled in enumerate(plan.sampled) if sampled]
    meta = StepMetadata.build(
        [(start, len(tokens), table)
         for start, tokens, table in zip(plan.starts, plan.tokens, plan.block_tables)],
        target.block_size, target.device, input_ids=input_ids, sampled_rows=sampled_rows,
        pending=pending)
    return StepInput(meta, target.backend.build_metadata(meta), None, rows, hooks, request_ids,
                     None, generation_logits, num_sampled)


def _flatten(row_tokens: Iterable[list[int]], request_ids: list[int] | None = None
             ) -> tuple[list[int], list[int], tuple[list[int], list[int]] | None]:
    """The rows' new tokens as one list, each row's first index in it, and the pending copies
    (destination indices, sampled rows of the previous step; None: none) for rows whose last
    token is a placeholder (written as 0 until the device copy replaces it)."""
    input_ids: list[int] = []
    row_starts: list[int] = []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    for i, tokens in enumerate(row_tokens):
        if tokens[-1] < 0:  # still on the device: sampled row -(1 + t) of the previous step
            pending_dst.append(len(input_ids) + len(tokens) - 1)
            pending_src.append(-1 - tokens[-1])
            tokens = tokens[:-1] + [0]
        if len(tokens) > 1 and min(tokens) < 0:
            if request_ids is None:
                raise RuntimeError("a placeholder token before a row's last position")
            raise RuntimeError(f"request {request_ids[i]}: a placeholder token before its last position")
        row_starts.append(len(input_ids))
        input_ids.extend(tokens)
    return input_ids, row_starts, (pending_dst, pending_src) if pending_dst else None
