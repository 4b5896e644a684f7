"""A step's device inputs: the engine's `StepOrder` → a `StepInput`, with the step's one host
→ device transfer.

Every step is built from its plain `StepPlan`, on rank 0 and on the tensor-parallel ranks that
follow it alike (they receive the plan alone). The step goes
- into the static buffers of a CUDA graph, for decode steps that fit a captured batch bucket
  and mixed steps that fit a token bucket (and ask for no prompt logits), or
- into a `StepMetadata`, from which the attention backend builds its own, for an eager step.

A step whose rows use LoRA adapters also stages each token's adapter slot: into its graph's
static segments (the LoRA twin of the graph replays), or into the eager step's `lora` batch.

A row's last token may be a placeholder `-(1 + i)`: "sampled row i of the previous step", whose
id is still on the device (overlapped steps). The metadata records it as a pending copy from
the worker's `sampled_ids`, made on the device before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from inflight.core.outputs import SchedulerOutput
from inflight.distributed.step_plan import StepPlan
from inflight.model.attention import StepMetadata
from inflight.platform import to_device
from inflight.runner.cuda_graph import CudaGraphRunner, GraphStep, MixedStep
from inflight.sampling.row import SamplingRow

# (request_id, token_ids so far, logits [vocab]) -> logits [vocab]
LogitsHook = Callable[[int, list[int], torch.Tensor], torch.Tensor]
# (row in the batch, first of its new tokens, number of tokens): prompt positions whose logits
# a request asked for (`return_context_logits`).
ContextSpan = tuple[int, int, int]


@dataclass(frozen=True)
class PromptLogProbs:
    """What to make of the context spans' logits besides (or instead of) keeping them: each
    position's log prob of `targets[i]` (the next prompt token; -1 where none is wanted) and its
    `num_top` likeliest tokens; `keep_logits`: whether any span's request keeps the raw logits."""

    targets: list[int]  # one per position of the context spans, in order
    num_top: int = 0
    keep_logits: bool = False


@dataclass(frozen=True)
class StepOrder:
    """One step as the engine hands it to the worker (`Worker.launch`).

    `rows` hold one `SamplingRow` per sampled row of `plan`, in batch order; None on a
    tensor-parallel rank other than 0, which computes with rank 0 but samples nothing.
    `hooks` and `request_ids` run parallel to `rows` (logits processors, and their first
    argument). `context_logits` and `generation_logits` name the logits a request asked to keep:
    prompt spans, and sampled rows. `batch` is rank 0's `SchedulerOutput` the plan was made
    from: its live sequences, for stand-in workers in tests; the real worker reads the plan.
    """

    plan: StepPlan
    rows: list[SamplingRow] | None = None
    hooks: list[LogitsHook | None] | None = None
    request_ids: list[int] | None = None
    context_logits: list[ContextSpan] | None = None
    generation_logits: list[int] | None = None
    batch: SchedulerOutput | None = None
    prompt_log_probs: PromptLogProbs | None = None  # with context_logits: their reduction
    # Per scheduled row, its LoRA adapter (`inflight.lora.cache.CachedLora`) or None; None when
    # no row has one.
    loras: list[Any] | None = None

    @classmethod
    def from_batch(cls, batch: SchedulerOutput, block_size: int, rows: list[SamplingRow],
                   **fields) -> "StepOrder":
        """Rank 0's order for the scheduler's `batch` (`fields`: the other fields)."""
        loras = fields.get("loras")
        plan = StepPlan.from_batch(batch, block_size,
                                   [0 if lora is None else lora.key for lora in loras] if loras else None)
        if plan.num_sampled != len(rows):
            raise ValueError(f"{len(rows)} sampling rows for {plan.num_sampled} sampled sequences")
        return cls(plan, rows, batch=batch, **fields)


@dataclass(frozen=True)
class StepInput:
    """Everything `Worker.run_model` and `Worker.sample` need for one step; built by
    `prepare_inputs`. Exactly one of `metadata` (eager) and `graph_step` (replayed) is set."""

    metadata: StepMetadata | None  # the step's layout (backend-neutral), with its input ids
    attn_metadata: Any  # the attention backend's metadata for this step (eager)
    graph_step: GraphStep | MixedStep | None  # a step staged in a CUDA graph's static inputs
    # One per sampled row, in batch order; None on a tensor-parallel rank other than 0 (it
    # computes the logits with rank 0 but does not sample).
    sampling_rows: list[SamplingRow] | None
    logits_hooks: list[LogitsHook | None] | None  # parallel to sampling_rows
    request_ids: list[int] | None  # parallel to sampling_rows (the hooks' first argument)
    context_indices: torch.Tensor | None  # [C] int64: tokens of the step whose logits to keep
    generation_rows: list[int] | None  # sampled rows whose raw logits to keep
    num_sampled: int  # positions sampled: rows whose last token is, and their drafts' (on every rank)
    prompt_targets: torch.Tensor | None = None  # [C] int64 (-1: none): context_indices' targets
    prompt_num_top: int = 0
    keep_prompt_logits: bool = True  # whether the context indices' raw logits are kept
    lora: Any = None  # the step's `LoraBatch` (eager steps whose rows use adapters), else None
    verifies_drafts: bool = False  # rows sample their drafts' positions too

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
    def lora_batch(self, row_loras, row_num_tokens) -> Any: ...  # the step's adapters for the model
    block_size: int
    device: torch.device


def prepare_inputs(target: InputTarget, order: StepOrder) -> StepInput:
    """The step's inputs from its plan: a staged CUDA graph step, or the metadata."""
    plan, rows = order.plan, order.rows
    extras = (rows, order.hooks, order.request_ids)
    runner = target.graph_runner if not order.context_logits else None  # graphs keep no prompt logits
    if runner is not None and order.loras and runner.lora_slots is None:
        runner = None  # no graphs with adapters: the step runs eagerly
    if runner is not None and runner.bucket_for(plan.num_rows) is not None and plan.is_decode():
        step = runner.stage_plan(plan)
        if order.loras:
            step = _stage_lora(runner, step, order.loras, [1] * plan.num_rows)
        return StepInput(None, None, step, *extras, None, order.generation_logits, plan.num_sampled)
    if runner is not None and runner.mixed_bucket_for(sum(map(len, plan.tokens)), plan.num_rows,
                                                      plan.num_sampled) is not None:
        graph_step = runner.stage_mixed(list(zip(plan.starts, plan.tokens, plan.sampled, plan.block_tables)),
                                        plan.num_drafts)
        if order.loras:
            graph_step = _stage_lora(runner, graph_step, order.loras, [len(t) for t in plan.tokens])
        return StepInput(None, None, graph_step, *extras, None, order.generation_logits, plan.num_sampled,
                         verifies_drafts=bool(plan.num_drafts))
    input_ids, row_starts, pending = _flatten(plan.tokens)
    meta = StepMetadata.build(
        [(start, len(tokens), table) for start, tokens, table in zip(plan.starts, plan.tokens, plan.block_tables)],
        target.block_size, target.device, input_ids=input_ids,
        sampled_rows=[i for i, sampled in enumerate(plan.sampled) if sampled], pending=pending,
        num_drafts=[k for k, sampled in zip(plan.num_drafts, plan.sampled) if sampled] if plan.num_drafts
        else None)
    context_indices = None
    if order.context_logits:
        flat = [row_starts[row] + offset + j for row, offset, count in order.context_logits for j in range(count)]
        context_indices = to_device(torch.tensor(flat, dtype=torch.int64), target.device)
    lora = target.lora_batch(order.loras, [len(tokens) for tokens in plan.tokens]) if order.loras else None
    reduction = order.prompt_log_probs
    if reduction is None or context_indices is None:
        return StepInput(meta, target.backend.build_metadata(meta), None, *extras, context_indices,
                         order.generation_logits, plan.num_sampled, lora=lora,
                         verifies_drafts=bool(plan.num_drafts))
    targets = to_device(torch.tensor(reduction.targets, dtype=torch.int64), target.device)
    return StepInput(meta, target.backend.build_metadata(meta), None, *extras, context_indices,
                     order.generation_logits, plan.num_sampled, targets, reduction.num_top,
                     reduction.keep_logits, lora, bool(plan.num_drafts))


def _stage_lora(runner: CudaGraphRunner, step, row_loras, row_num_tokens: list[int]) -> Any:
    return runner.stage_lora(step, runner.lora_slots.token_slots(row_loras, row_num_tokens))


def _flatten(row_tokens: Iterable[list[int]]
             ) -> tuple[list[int], list[int], tuple[list[int], list[int]] | None]:
    """The rows' new tokens as one list, each row's first index in it, and the pending copies
    (destination indices, sampled rows of the previous step; None: none) for rows whose last
    token is a placeholder (written as 0 until the device copy replaces it)."""
    input_ids: list[int] = []
    row_starts: list[int] = []
    pending_dst: list[int] = []
    pending_src: list[int] = []
    for row, tokens in enumerate(row_tokens):
        if tokens[-1] < 0:  # still on the device: sampled row -(1 + t) of the previous step
            pending_dst.append(len(input_ids) + len(tokens) - 1)
            pending_src.append(-1 - tokens[-1])
            tokens = tokens[:-1] + [0]
        if len(tokens) > 1 and min(tokens) < 0:
            raise RuntimeError(f"row {row} of the step: a placeholder token before its last position")
        row_starts.append(len(input_ids))
        input_ids.extend(tokens)
    return input_ids, row_starts, (pending_dst, pending_src) if pending_dst else None
