"""The engine's live requests: admitted, finished, cancelled or failed, one sequence at a time.

Besides the sequences by key (and the groups of `num_return_sequences` > 1), it keeps counts
and small sets of the requests that need more than a token per step (logits processors, beams,
perf metrics, prompt or generation logits), so a step looks at its rows for them only while
such a request is live.
"""

from __future__ import annotations

from inflight.api.types import FinishReason, Response
from inflight.core.outputs import SchedulerOutput
from inflight.core.scheduler import Scheduler
from inflight.engine.request_state import RequestGroup, RequestState


class LiveRequests:
    """The live sequences and their groups; admitting and ending them keeps the scheduler's
    queues and the counts in step."""

    def __init__(self, scheduler: Scheduler, loras=None):
        """`loras`: the engine's `LoraCache` (None without LoRA): a live sequence holds its
        adapter there, so it is not evicted while in use."""
        self.scheduler = scheduler
        self.loras = loras
        self.num_lora_requests = 0  # live sequences with an adapter
        self.requests: dict[int, RequestState] = {}  # by `RequestState.key`
        self.groups: dict[int, RequestGroup] = {}  # num_return_sequences > 1, by request id
        # Requests whose step-time outputs are still due: perf metrics before their first step,
        # prompt logits before their prompt is computed. Empty for requests asking for neither,
        # so a step looks at its rows for them only while such a request is pending.
        self.awaiting_schedule: set[RequestState] = set()
        self.awaiting_context: set[RequestState] = set()
        self.num_generation_logit_requests = 0  # live ones: rows are looked at only when > 0
        self.groups_waiting: set[RequestGroup] = set()  # sequences wait for the first's prompt
        # Live requests whose sampling reads their tokens on the host (they make steps
        # synchronous, and only they can have logits processors): a count, not a scan per step.
        self.num_host_token_requests = 0
        self.num_beam_requests = 0  # live beam search requests (their rows are built per beam)
        # Requests whose steps may verify a draft (they make steps synchronous: how many tokens
        # a step emits is known only once it is read).
        self.num_speculative_requests = 0
        self.num_completed_requests = 0

    def admit(self, state: RequestState, first: bool = False) -> None:
        """Queue a sequence (`first`: at the head of the queue)."""
        self.requests[state.key] = state
        self.num_host_token_requests += state.needs_host_tokens
        self.num_beam_requests += state.is_beam
        self.num_speculative_requests += state.speculative
        self.num_generation_logit_requests += state.request.output_config.return_generation_logits
        if state.lora is not None:
            self.loras.hold(state.lora)
            self.num_lora_requests += 1
        if state.request.output_config.return_perf_metrics:
            self.awaiting_schedule.add(state)
        if state.outputs.want_context_logits:
            self.awaiting_context.add(state)
        self.scheduler.add(state.seq, first)
        if state.group is not None:
            self.groups[state.request_id] = state.group
            if state.group.waiting:
                self.groups_waiting.add(state.group)

    def admit_others(self, group: RequestGroup) -> None:
        """The first sequence's prompt is computed: queue the others first, so they share its
        prompt blocks while it holds them."""
        self.groups_waiting.discard(group)
        for state in reversed(group.take_waiting()):
            self.admit(state, first=True)

    def forget(self, state: RequestState) -> None:
        """Drop a sequence that is done (finished, cancelled or failed) from the live set."""
        if self.requests.pop(state.key, None) is not None:
            self.num_host_token_requests -= state.needs_host_tokens
            self.num_beam_requests -= state.is_beam
            self.num_speculative_requests -= state.speculative
            self.num_generation_logit_requests -= state.request.output_config.return_generation_logits
            self.awaiting_schedule.discard(state)
            self.awaiting_context.discard(state)
            if state.lora is not None:
                self.loras.release(state.lora)
                self.num_lora_requests -= 1

    def cancel(self, request_id: int) -> Response | None:
        """Stop a request (every sequence of it) now; returns its final (cancelled) response,
        or None if unknown."""
        group = self.groups.get(request_id)
        if group is not None:
            states = [s for s in group.members if self.requests.get(s.key) is s or s in group.waiting]
            group.waiting.clear()
            self.groups_waiting.discard(group)
        else:
            state = self.requests.get(request_id)  # a request id, not another sequence's key
            states = [state] if state is not None and state.request_id == request_id else []
        response = None
        for state in states:
            state.finish_reason = FinishReason.CANCELLED
            response = self.finish(state)
        return response

    def finish(self, state: RequestState) -> Response:
        """Ends one sequence; its request ends with its last sequence."""
        state.drop_placeholder()  # cancelled with a token in flight: it is never sent
        self.scheduler.finish(state.seq)
        self.forget(state)
        is_final = state.is_last_open()
        if state.group is not None:
            state.group.num_open -= 1
            if is_final:
                self.groups.pop(state.request_id, None)
        self.num_completed_requests += is_final
        return state.response(is_final=is_final, is_sequence_final=True)

    def fail(self, batch: SchedulerOutput, message: str) -> list[Response]:
        """Fails every request with a row in `batch` (a step that failed)."""
        responses = []
        for item in batch.scheduled:
            state = self.requests.get(item.seq.request_id)
            if state is None:
                self.scheduler.finish(item.seq)
            else:
                responses.append(self.fail_request(state, message))
        return responses

    def fail_request(self, state: RequestState, message: str) -> Response:
        """Fails the whole request (every sequence of it) with one error response."""
        group = state.group
        for member in group.members if group is not None else [state]:
            if self.requests.get(member.key) is member:
                member.drop_placeholder()
                self.forget(member)
                self.scheduler.finish(member.seq)
        if group is not None:
            group.waiting.clear()
            self.groups_waiting.discard(group)
            self.groups.pop(state.request_id, None)
        return Response(state.request_id, error_msg=message, client_id=state.request.client_id)
