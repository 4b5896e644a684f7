"""Start-up precompilation: every Triton kernel variant a served step can ask for, compiled
before the first request, so no request pays a JIT compile.

Triton compiles a kernel per specialization (argument types, integers' value classes, pointer
alignment, constexprs; see `inflight.kernels.jit_stats`). The kernels do not specialize on
what varies per step (token and row counts only size grids; block-table widths, split-K
partition counts and metadata pointers are `do_not_specialize`d, and the step metadata is
16-byte aligned), so what remains to compile is a short list of step *kinds*, each run here
once as an eager step through the real model and sampler:

- a prefill of one row, and a mixed step (prefill rows, a chunk after cached tokens, a decode
  row), greedy and sampled rows (top-k/top-p, penalties, log probs) side by side;
- a decode-only eager step for every split-K class the backend can choose (one partition,
  and each power-of-two padding of the reduce kernel): graphs cover the captured buckets,
  but decode runs eagerly when graphs are off (or their capture failed).

The steps run against the real KV cache (its strides and sizes are part of the key), every
row's blocks pointing at block 0: at start-up no block holds anything, and a request writes
its positions before it reads them. CUDA graphs (decode and mixed-step buckets) compile their
own variants when they are captured, which also happens before the first request.
"""

from __future__ import annotations

import logging
import time

import torch

from inflight.core.outputs import ScheduledSequence, SchedulerOutput
from inflight.core.sequence import Sequence
from inflight.intmath import cdiv
from inflight.runner.step_inputs import StepOrder
from inflight.sampling.row import SamplingRow

logger = logging.getLogger(__name__)


def step_kinds(worker) -> list[list[tuple[int, int]]]:
    """The eager steps to run, each a list of rows `(start_position, num_new_tokens)`."""
    bs, max_len = worker.block_size, worker.max_seq_len
    short = min(5, max_len)
    kinds = [[(0, short)]]  # one prefill row
    mixed = [(0, short), (0, min(bs + 3, max_len))]  # prefill rows of one and several blocks
    if max_len > bs + 2:
        mixed.append((bs, 2))  # a chunk after cached tokens
    if max_len > 7:
        mixed.append((6, 1))  # a decode row
    kinds.append(mixed)
    kinds += [[(length - 1, 1)] for length in _decode_lengths(worker)]
    return [part for kind in kinds for part in _within_limits(kind, worker.max_batch_size,
                                                              worker.max_num_tokens)]


def _within_limits(kind: list[tuple[int, int]], max_rows: int,
                   max_tokens: int) -> list[list[tuple[int, int]]]:
    """`kind` as consecutive steps that each fit the engine's own limits (its buffers are sized
    by them: a bigger step fails at start-up), so a small engine still meets every row type; a
    row longer than the token budget is cut to it."""
    steps, rows, tokens = [], [], 0
    for start, num_new in kind:
        num_new = min(num_new, max_tokens)
        if rows and (len(rows) == max_rows or tokens + num_new > max_tokens):
            steps.append(rows)
            rows, tokens = [], 0
        rows.append((start, num_new))
        tokens += num_new
    return steps + [rows]


def _decode_lengths(worker) -> list[int]:
    """One context length per split-K class of a one-row decode step (P = 1, and each
    power of two that pads P > 1); one row reaches every P the engine can choose (P falls
    as rows are added)."""
    backend, max_len = worker.backend, worker.max_seq_len
    choose = getattr(backend, "_num_partitions", None)
    if choose is None:
        return [min(7, max_len)]
    by_class: dict[int, int] = {}
    lengths = sorted({min(max_len, 8 * 2 ** i) for i in range(40)} |
                     {min(max_len, 128 * k) for k in range(1, 65)})
    for length in lengths:
        num_partitions = choose(1, length)
        pad = 1 if num_partitions == 1 else 1 << (num_partitions - 1).bit_length()
        by_class.setdefault(pad, length)
    return [by_class[pad] for pad in sorted(by_class)]


def precompile(worker) -> int:
    """Runs `step_kinds` on `worker` (eagerly, against its KV cache); returns the steps run.
    Call at start-up only: it writes block 0 of the cache."""
    start = time.perf_counter()
    vocab = worker.model_config.vocab_size
    runner = worker.graph_runner
    worker.graph_runner = None  # eager, whatever the batch
    try:
        kinds = step_kinds(worker)
        for kind in kinds:
            scheduled, rows = [], []
            for i, (start_pos, num_new) in enumerate(kind):
                ids = [(i * 7919 + j * 31) % vocab for j in range(start_pos + num_new)]
                seq = Sequence(request_id=-1 - i, prompt_token_ids=ids, max_new_tokens=1,
                               num_computed_tokens=start_pos,
                               block_table=[0] * cdiv(start_pos + num_new, worker.block_size))
                scheduled.append(ScheduledSequence(seq, num_new))
                rows.append(_sampling_row(ids, sampled=i % 2 == 1, device=worker.device))
            worker.launch(StepOrder.from_batch(SchedulerOutput(scheduled), worker.block_size, rows)).result()
    finally:
        worker.graph_runner = runner
    if worker.device.type == "cuda":
        torch.cuda.synchronize(worker.device)
    logger.info("precompiled %d step kinds in %.1f s", len(kinds), time.perf_counter() - start)
    return len(kinds)


def _sampling_row(ids: list[int], sampled: bool, device: torch.device) -> SamplingRow:
    if not sampled:
        return SamplingRow(token_ids=ids, num_prompt_tokens=len(ids))
    return SamplingRow(token_ids=ids, num_prompt_tokens=max(len(ids) - 1, 0), temperature=0.8,
                       top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.1,
                       generator=torch.Generator(device).manual_seed(0), return_log_probs=True)
