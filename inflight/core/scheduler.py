"""In-flight batching scheduler.

There are no separate prefill and decode phases: every sequence has `num_computed_tokens`
catching up with `num_tokens`, and each step the scheduler hands out a token budget
(`max_num_tokens`) and batch rows (`max_batch_size`). Running sequences are served first:
decodes, then the chunks of prompts still being prefilled, so neither new prompts nor a long one
being prefilled in chunks ever starve the streams that are generating; then waiting sequences
are admitted in FIFO order. With `max_loras`, a step's rows use at most that many distinct
LoRA adapters: a waiting sequence whose adapter would be one too many waits (FIFO, like a full
cache) until a running one's adapter leaves.

Capacity policies (TensorRT-LLM's names):
- GUARANTEED_NO_EVICT admits a request only when the KV blocks for its whole life
  (prompt + max_new_tokens) fit next to the budgets of the running ones, so nothing is ever
  preempted.
- MAX_UTILIZATION admits a request as soon as this step's blocks are free; when a running
  sequence later cannot grow, the newest running sequence is preempted (its blocks freed) and
  recomputed from its kept token ids once it is admitted again.
"""

from __future__ import annotations

import math
from collections import deque

from inflight.api.config import CapacitySchedulerPolicy
from inflight.core.block_manager import BlockManager
from inflight.core.outputs import ScheduledSequence, SchedulerOutput
from inflight.core.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides, each step, which sequences compute how many tokens.

    Engine flow per step: `out = schedule()`; the model runs `out`; `update(out)`; the engine
    appends the sampled token of every row with `is_sampled`; `finish(seq)` for finished (or
    cancelled) sequences. An overlapping engine appends a placeholder for the sampled token
    first and fills it in one step later (`Sequence` only counts tokens, so scheduling is the
    same); a sequence may then be finished while its next step is already running.
    """

    def __init__(self, block_manager: BlockManager, max_batch_size: int, max_num_tokens: int,
                 policy: CapacitySchedulerPolicy, enable_chunked_context: bool, max_loras: int | None = None,
                 attention_pairs_per_token: float | None = None):
        """`attention_pairs_per_token`: how many (query, key) pairs of attention cost as much as
        one token's linear layers (`ModelConfig.attention_pairs_per_token`); given, a prompt
        chunk that shares a step with generating rows is cut so that its linear work plus its
        attention over the context fits the token budget (`_chunk_limit`), and a long prompt's
        late chunks hold the streams no longer than its first. None: chunks are cut by tokens
        alone (TensorRT-LLM's rule)."""
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be > 0, got {max_batch_size}")
        if max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be > 0, got {max_num_tokens}")
        self.block_manager = block_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.policy = policy
        self.enable_chunked_context = enable_chunked_context
        self.max_loras = max_loras
        if attention_pairs_per_token is not None and attention_pairs_per_token <= 0:
            raise ValueError(f"attention_pairs_per_token must be > 0, got {attention_pairs_per_token}")
        self.attention_pairs_per_token = attention_pairs_per_token
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Cumulative over the scheduler's life, for stats.
        self.num_preemptions = 0
        # Rows of running beam groups beyond one per group (a group of W beams is W rows).
        self._num_extra_beam_rows = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_running_rows(self) -> int:
        """Batch rows the running sequences take: one each, beam_width for a beam group."""
        return len(self.running) + self._num_extra_beam_rows

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence, first: bool = False) -> None:
        """Queue a sequence; `first` puts it at the head (the other sequences of a request
        already running, so they share its prompt blocks while it holds them)."""
        seq.status = SequenceStatus.WAITING
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> str | None:
        """None if `seq` can ever be scheduled on an otherwise idle engine, else why not.

        GUARANTEED_NO_EVICT budgets prompt + max_new_tokens. MAX_UTILIZATION needs the KV the
        sequence ever holds when it runs alone: prompt + max_new_tokens - 1 (the last sampled
        token is never fed back); less would make a lone sequence preempt itself forever.
        """
        num_prompt_tokens = seq.num_prompt_tokens
        if num_prompt_tokens == 0:
            return "prompt is empty; at least one token is needed"
        if not self.enable_chunked_context and num_prompt_tokens > self.max_num_tokens:
            return (f"prompt of {num_prompt_tokens} tokens exceeds max_num_tokens {self.max_num_tokens}; "
                    f"enable chunked context")
        num_total_blocks = self.block_manager.num_total_blocks
        if seq.beam_width > 1:
            if seq.beam_width > min(self.max_batch_size, self.max_num_tokens):
                return (f"beam_width {seq.beam_width} needs as many batch rows and tokens per step, "
                        f"more than max_batch_size {self.max_batch_size} or max_num_tokens "
                        f"{self.max_num_tokens}")
            num_blocks = self._reserved_blocks(seq)
            if num_blocks > num_total_blocks:
                return (f"request needs {num_blocks} KV blocks (prompt {num_prompt_tokens} + "
                        f"max_tokens {seq.max_new_tokens} tokens for each of {seq.beam_width} beams) "
                        f"but the cache has {num_total_blocks} blocks")
            return None
        if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
            num_tokens = seq.max_total_tokens
            detail = f"prompt {num_prompt_tokens} + max_tokens {seq.max_new_tokens} tokens"
        else:
            num_tokens = max(seq.max_total_tokens - 1, num_prompt_tokens)
            detail = (f"prompt {num_prompt_tokens} + max_tokens {seq.max_new_tokens} tokens, "
                      f"less the last sampled token")
        num_blocks = self.block_manager.num_blocks_for(num_tokens)
        if num_blocks > num_total_blocks:
            return (f"request needs {num_blocks} KV blocks ({detail}) "
                    f"but the cache has {num_total_blocks} blocks")
        return None

    def check_group_fits(self, seq: Sequence, num_sequences: int) -> str | None:
        """None if `num_sequences` sequences like `seq`, sharing its prompt (num_return_sequences
        forks), fit in the cache together, else why not. The prompt's full blocks are held once;
        every sequence holds its own last prompt block and its generated tokens. A request may
        ask for no more than the whole cache, however its sequences are scheduled."""
        block_size = self.block_manager.block_size
        num_blocks_each = self.block_manager.num_blocks_for(seq.max_total_tokens)
        num_shared = seq.num_prompt_tokens // block_size
        num_blocks = num_blocks_each + (num_sequences - 1) * (num_blocks_each - num_shared)
        num_total_blocks = self.block_manager.num_total_blocks
        if num_blocks > num_total_blocks:
            return (f"request needs {num_blocks} KV blocks (prompt {seq.num_prompt_tokens} tokens, "
                    f"shared, + max_tokens {seq.max_new_tokens} tokens for each of "
                    f"{num_sequences} return sequences) but the cache has {num_total_blocks} blocks")
        return None

    def schedule(self) -> SchedulerOutput:
        """Pick this step's rows: running sequences first, then admitted waiting ones.

        Never schedules a row with zero new tokens. After a preemption no waiting sequence is
        admitted in the same step: the cache is known to be short, and admitting would only
        preempt again.
        """
        out = SchedulerOutput()
        num_budget_tokens = self._schedule_running(out, self.max_num_tokens)
        if not out.preempted:
            self._schedule_waiting(out, num_budget_tokens)
        return out

    def update(self, output: SchedulerOutput) -> None:
        """Advance each scheduled sequence by the tokens the model just computed.

        Sequences finished (cancelled) between `schedule` and `update` are skipped: their blocks
        are already gone.
        """
        commit = self.block_manager.commit if self.block_manager.enable_prefix_caching else None
        for scheduled in output.scheduled:
            seq = scheduled.seq
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_computed_tokens += scheduled.num_new_tokens
            if commit is not None:
                commit(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or cancelled sequence and free its blocks; idempotent."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._num_extra_beam_rows -= seq.beam_width - 1
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for beam in seq.group:  # a beam group's leader frees every beam
            self.block_manager.free(beam)
            beam.status = SequenceStatus.FINISHED

    def _chunk_limit(self, num_context_tokens: int, num_budget_tokens: int) -> int:
        """The most tokens n of a prompt chunk after `num_context_tokens` computed tokens whose
        cost fits `num_budget_tokens` token equivalents: n for the linear layers plus the
        chunk's n (c + (n + 1) / 2) attention pairs over K pairs a token. At least 1."""
        k = self.attention_pairs_per_token
        a, b = 1.0 / (2.0 * k), 1.0 + (num_context_tokens + 0.5) / k
        n = (-b + math.sqrt(b * b + 4.0 * a * num_budget_tokens)) / (2.0 * a)
        return max(1, min(num_budget_tokens, int(n)))

    def _num_new_tokens(self, seq: Sequence, num_budget_tokens: int, beside_decodes: bool = False) -> int:
        """Tokens `seq` computes this step within the budget; 0 means it waits.
        `beside_decodes`: the step already carries generating rows (see `_chunk_limit`)."""
        if beside_decodes and self.attention_pairs_per_token is not None and self.enable_chunked_context:
            num_budget_tokens = self._chunk_limit(seq.num_computed_tokens, num_budget_tokens)
        num_uncomputed = seq.num_uncomputed_tokens
        if seq.num_draft_tokens and num_uncomputed > num_budget_tokens:
            # A draft is verified in one step with the last verified token before it (the
            # logits at each of those positions are compared): a chunk stops short of them, or,
            # with no room for them at all, the draft goes and the row decodes plainly.
            num_verified = seq.num_draft_tokens + 1
            if self.enable_chunked_context and num_uncomputed > num_verified:
                return min(num_budget_tokens, num_uncomputed - num_verified)
            seq.drop_draft()
            num_uncomputed = seq.num_uncomputed_tokens
        if self.enable_chunked_context or num_uncomputed > self.max_num_tokens:
            # The second case is a recompute after preemption that outgrew max_num_tokens: it
            # could never run whole, so it is chunked even without chunked context.
            return min(num_uncomputed, num_budget_tokens)
        return num_uncomputed if num_uncomputed <= num_budget_tokens else 0

    def _schedule_running(self, out: SchedulerOutput, num_budget_tokens: int) -> int:
        """Schedule running sequences, decodes before prompt chunks; return the budget left. A
        beam group's rows (one token per beam) are scheduled together or not at all.

        Decode rows (one token each) go first, then the chunks of prompts still being
        prefilled, each in admission order: so a long prompt, chunked under the step's token
        budget, takes only what the generating streams leave and never delays their next
        token (TensorRT-LLM's micro-batch scheduler also puts generation requests first).

        This loop runs once per running row per step (the engine's hottest host loop at large
        batch), so a row whose blocks already cover its new tokens (31 decode steps of 32 at
        block size 32) never calls into the block manager.
        """
        block_size = self.block_manager.block_size
        beside_decodes = False
        scheduled = out.scheduled  # `_make_room` edits it in place
        # A copy: `_make_room` may take sequences out of `self.running` while we walk it.
        order = list(self.running)
        if any(len(s.token_ids) - s.num_computed_tokens - s.num_draft_tokens > 1 for s in order):
            # stable; a row verifying a draft counts as a decode
            order.sort(key=lambda s: len(s.token_ids) - s.num_computed_tokens - s.num_draft_tokens > 1)
        for seq in order:
            if num_budget_tokens <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = len(seq.token_ids)
            if num_tokens - len(seq.prompt_token_ids) >= seq.max_new_tokens:
                # Its last token is being sampled (an overlapped step): it finishes when that
                # token arrives and never computes more. (Never seen by synchronous engines.)
                continue
            num_uncomputed = num_tokens - seq.num_computed_tokens
            if seq.beam_siblings:
                num_new, num_freed_tokens = self._schedule_beams(seq, num_uncomputed, num_budget_tokens,
                                                                 out)
                num_budget_tokens += num_freed_tokens - num_new
                beside_decodes = beside_decodes or num_new > 0
                continue
            if num_uncomputed == 1:  # a decode row
                num_new = 1
                beside_decodes = True
            else:
                num_new = self._num_new_tokens(seq, num_budget_tokens, beside_decodes)
                if num_new == 0:
                    continue
            num_needed_tokens = seq.num_computed_tokens + num_new
            if num_needed_tokens > len(seq.block_table) * block_size:
                kept, num_freed_tokens = self._make_room(seq, num_needed_tokens, out)
                num_budget_tokens += num_freed_tokens
                if not kept:
                    continue  # `seq` itself was preempted
                self.block_manager.allocate(seq, num_needed_tokens)
            scheduled.append(ScheduledSequence(seq, num_new))
            num_budget_tokens -= num_new
        return num_budget_tokens

    def _schedule_beams(self, seq: Sequence, num_uncomputed: int, num_budget_tokens: int,
                        out: SchedulerOutput) -> tuple[int, int]:
        """Schedules every beam of `seq`'s group for one token. Returns (tokens scheduled, 0
        when the group waits for its re-ranking or for budget; tokens of preempted rows taken
        back out of `out`). Makes room by preempting other requests, never beams (their
        blocks are reserved at admission)."""
        num_new = len(seq.beam_siblings) + 1
        if not num_uncomputed or num_new > num_budget_tokens:
            return 0, 0
        _, num_freed_tokens = self._make_room(seq, 0, out)
        for beam in seq.group:
            self.block_manager.allocate(beam, beam.num_computed_tokens + 1)
            out.scheduled.append(ScheduledSequence(beam, 1))
        return num_new, num_freed_tokens

    def _make_room(self, seq: Sequence, num_needed_tokens: int,
                   out: SchedulerOutput) -> tuple[bool, int]:
        """Preempts the newest running sequences (never beams) until `seq` can have its blocks
        (a beam group: every beam its next block). Returns (whether `seq` is still running,
        tokens of victims' rows taken out of `out`, back into the budget)."""
        num_freed_tokens = 0
        while not (self._beams_fit(seq) if seq.beam_siblings else
                   self.block_manager.can_allocate(seq, num_needed_tokens)):
            if self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT:
                raise RuntimeError(
                    f"request {seq.request_id}: KV blocks ran out under guaranteed_no_evict; "
                    f"admission should have reserved them")
            victim = self._victim(seq)
            self._preempt(victim, out)
            num_freed_tokens += sum(s.num_new_tokens for s in out.scheduled if s.seq is victim)
            out.scheduled[:] = [s for s in out.scheduled if s.seq is not victim]
            if victim is seq:
                return False, num_freed_tokens
        return True, num_freed_tokens

    def _beams_fit(self, seq: Sequence) -> bool:
        """Whether every beam of `seq`'s group can take its next token."""
        bm = self.block_manager
        missing = sum(bm.num_missing_blocks(b, b.num_computed_tokens + 1) for b in seq.group)
        return missing <= bm.num_free_blocks

    def _victim(self, seq: Sequence) -> Sequence:
        """The newest running sequence that may be preempted. Beam groups never are: their
        blocks are reserved at admission (`_reserved_blocks`), so preempting the others always
        makes room for them."""
        victims = [s for s in self.running if s.beam_width == 1]
        if not victims:
            raise RuntimeError(f"request {seq.request_id}: KV blocks ran out with only beam search "
                               f"requests running; admission should have reserved them")
        return max(victims, key=lambda s: s.arrival_index)

    def _reserved_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` may hold over its life: prompt + max_new_tokens; for a beam group the
        full prompt blocks once (shared) and every beam's other blocks."""
        num_blocks = self.block_manager.num_blocks_for(seq.max_total_tokens)
        if seq.beam_width == 1:
            return num_blocks
        num_shared = seq.num_prompt_tokens // self.block_manager.block_size
        return num_shared + seq.beam_width * (num_blocks - num_shared)

    def _schedule_waiting(self, out: SchedulerOutput, num_budget_tokens: int) -> None:
        """Admit waiting sequences in FIFO order; stop at the first that cannot be admitted."""
        if not self.waiting:
            return  # the common decode step: skip the O(running) reservation sum
        # Beam groups reserve their blocks under both policies (they are never preempted).
        reserve_all = self.policy is CapacitySchedulerPolicy.GUARANTEED_NO_EVICT
        num_reserved_blocks = sum(self._reserved_blocks(s) for s in self.running
                                  if reserve_all or s.beam_width > 1)
        beside_decodes = any(s.num_new_tokens == 1 and s.is_sampled for s in out.scheduled)
        loras = None
        if self.max_loras is not None:
            loras = {s.lora_id for s in self.running if s.lora_id is not None}
        while self.waiting and self.num_running_rows < self.max_batch_size and num_budget_tokens > 0:
            seq = self.waiting[0]
            if self.num_running_rows + seq.beam_width > self.max_batch_size:
                break
            if loras is not None and seq.lora_id is not None and seq.lora_id not in loras:
                if len(loras) >= self.max_loras:
                    break
                loras.add(seq.lora_id)
            if reserve_all or seq.beam_width > 1:
                num_seq_blocks = self._reserved_blocks(seq)
                if num_reserved_blocks + num_seq_blocks > self.block_manager.num_total_blocks:
                    break
                num_reserved_blocks += num_seq_blocks
            self.block_manager.allocate_prefix(seq)
            num_new = self._num_new_tokens(seq, num_budget_tokens, beside_decodes)
            num_needed_tokens = seq.num_computed_tokens + num_new
            if num_new == 0 or not self.block_manager.can_allocate(seq, num_needed_tokens):
                # Give back the prefix blocks; they stay cached for the next try.
                self.block_manager.release_prefix(seq)
                break
            self.block_manager.allocate(seq, num_needed_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._num_extra_beam_rows += seq.beam_width - 1
            out.scheduled.append(ScheduledSequence(seq, num_new))
            num_budget_tokens -= num_new

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free `seq`'s blocks and put it at the front of the queue to be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.drop_draft()
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1
