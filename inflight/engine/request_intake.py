"""Request intake: a `Request` checked against the engine's limits and turned into the
`RequestState`s the engine schedules (one per returned sequence).

Nothing here touches the scheduler's queues, so the executor calls it on the caller's thread:
a bad request is refused before it reaches the engine loop, and a large guided-decoding schema
compiles without holding that loop up.
"""

from __future__ import annotations

from typing import Callable

import torch

from ensemble.errors import InputError
from inflight.api.config import ExecutorConfig
from inflight.api.features import GUIDED_DECODING_OFF, LORA_OFF
from inflight.api.types import QueueFullError, Request, RequestError
from inflight.core.scheduler import Scheduler
from inflight.core.sequence import Sequence
from inflight.engine.beam_state import BeamRequestState
from inflight.engine.request_outputs import RequestOutputs
from inflight.engine.request_state import RequestGroup, RequestState
from inflight.lora.nvidia import from_nvidia


class RequestIntake:
    """Validates requests and builds their states. `worker` gives the limits and the device:
    `model_config`, `max_seq_len`, `device` and, at tensor parallelism, `tp`."""

    def __init__(self, config: ExecutorConfig, worker, scheduler: Scheduler, loras=None):
        """`loras`: the engine's `LoraCache` (None: LoRA off)."""
        self.config = config
        self.worker = worker
        self.vocab_size = worker.model_config.vocab_size
        self.scheduler = scheduler
        self.loras = loras
        self.grammars = None
        if config.guided_decoding_config is not None:
            from inflight.sampling.grammar import GrammarCompiler  # xgrammar: only when it is used

            self.grammars = GrammarCompiler(config.guided_decoding_config, self.vocab_size)

    def prepare(self, request: Request, request_id: int, num_queued: int,
                new_request_id: Callable[[], int]) -> RequestState:
        """The state of the request's first sequence (a group's others hang off it), or
        RequestError (QueueFullError when `num_queued` reached the queue's limit)."""
        self.validate(request)
        max_queue = self.config.max_queue_size
        if max_queue is not None and num_queued >= max_queue:
            raise QueueFullError(f"Maximum queue size of {max_queue} has been reached, "
                                 "please try again later")
        bias = self._embedding_bias(request)
        lora = self.lora(request)
        first = self._new_state(request, request_id, request_id, 0, bias, None, lora)
        # Beam search returns its beams in one sequence (num_return_sequences picks them).
        num_sequences = 1 if request.sampling_config.beam_width > 1 else request.sampling_config.num_sequences
        reason = self.scheduler.check_fits(first.seq)
        if not reason and num_sequences > 1:
            reason = self.scheduler.check_group_fits(first.seq, num_sequences)
        if reason:
            raise RequestError(reason)
        if num_sequences > 1:  # TensorRT-LLM's child requests: they wait for the first's prompt
            others = [self._new_state(request, request_id, new_request_id(), i, bias, first.seq, lora)
                      for i in range(1, num_sequences)]
            group = RequestGroup(request_id, [first, *others], others, num_sequences)
            for state in group.members:
                state.group = group
        return first

    def lora(self, request: Request):
        """The request's adapter (`CachedLora`; None without one): its weights parsed and cached
        under its task id when it carries them, else the cached ones. RequestError with
        TensorRT-LLM's text when the id is not cached, or the weights do not fit the model."""
        lora_config = request.lora_config
        if lora_config is None:
            return None
        if self.loras is None:
            raise RequestError(LORA_OFF)
        try:
            if lora_config.weights is None and lora_config.config is None:
                return self.loras.get(lora_config.task_id)
            if lora_config.weights is None or lora_config.config is None:
                raise InputError("lora_weights and lora_config come together: send both with an adapter's "
                                 "first request, neither afterwards")
            adapter = from_nvidia(lora_config.weights, lora_config.config, self.worker.model_config,
                                  max_rank=self.config.peft_cache_config.max_adapter_size)
            return self.loras.put(lora_config.task_id, adapter)
        except InputError as exc:
            raise RequestError(str(exc)) from None

    def guide(self, request: Request):
        """A grammar matcher for the request's guide (None without one), its grammar compiled
        or taken from the cache. Raises RequestError for a guide that does not compile or an
        engine without guided decoding."""
        params = request.guided_decoding_params
        return None if params is None else self._compiler().matcher(params)

    def compile_guide(self, request: Request) -> None:
        """Compiles the request's guide into the cache now (errors as `guide`), so that
        `prepare` later finds it there."""
        if request.guided_decoding_params is not None:
            self._compiler().compile(request.guided_decoding_params)

    def _compiler(self):
        if self.grammars is None:
            raise RequestError(GUIDED_DECODING_OFF)
        return self.grammars

    def validate(self, request: Request) -> None:
        """RequestError naming what is wrong, for a request this engine cannot serve."""
        vocab = self.vocab_size
        max_seq_len = self.worker.max_seq_len
        num_prompt = len(request.input_token_ids)
        if max(request.input_token_ids) >= vocab:
            raise RequestError(f"input_token_ids hold id {max(request.input_token_ids)}, outside the "
                               f"vocabulary of {vocab} tokens")
        if num_prompt >= max_seq_len:
            raise RequestError(f"prompt of {num_prompt} tokens exceeds the model's maximum sequence "
                               f"length of {max_seq_len} tokens")
        beam_width = request.sampling_config.beam_width
        if beam_width > self.config.max_beam_width:
            raise RequestError(f"beam_width {beam_width} exceeds max_beam_width ({self.config.max_beam_width})")
        if 2 * beam_width > vocab:
            raise RequestError(f"beam_width {beam_width} needs 2 * beam_width <= the vocabulary ({vocab})")
        if beam_width > 1 and getattr(getattr(self.worker, "tp", None), "is_parallel", False):
            raise RequestError("beam search is not supported with tensor_parallel_size > 1 yet")
        if beam_width > 1 and request.guided_decoding_params is not None:
            raise RequestError("guided decoding is not supported with beam search (beam_width > 1)")
        if beam_width > 1 and request.output_config.num_top_log_probs:
            raise RequestError("num_top_log_probs is not supported with beam search (beam_width > 1)")
        tp_parallel = getattr(getattr(self.worker, "tp", None), "is_parallel", False)
        for flag in ("return_context_logits", "return_prompt_log_probs"):
            if getattr(request.output_config, flag) and tp_parallel:
                raise RequestError(f"{flag} is not supported with tensor_parallel_size > 1 yet")
        num_sequences = request.sampling_config.num_sequences
        if beam_width == 1 and num_sequences > self.config.max_batch_size:
            # Checked before any sequence state is built: each would cost memory up front.
            raise RequestError(f"num_return_sequences {num_sequences} exceeds max_batch_size "
                               f"({self.config.max_batch_size}): each sequence takes a batch row")
        if num_prompt + request.max_tokens > max_seq_len:
            raise RequestError(f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) "
                               f"exceeds the maximum sequence length of {max_seq_len}; "
                               f"ask for at most {max_seq_len - num_prompt} tokens")
        if request.end_id is not None and not (-1 <= request.end_id < vocab):
            raise RequestError(f"end_id {request.end_id} is outside the vocabulary of {vocab} tokens")
        for name in ("bad_words", "stop_words"):
            for word in getattr(request, name) or []:
                if min(word) < 0 or max(word) >= vocab:
                    raise RequestError(f"{name} hold a token id outside the vocabulary of {vocab} tokens")
        bias = request.embedding_bias
        if bias is not None and len(bias) not in (0, vocab):
            raise RequestError(f"embedding_bias has {len(bias)} entries; expected {vocab} (the vocabulary size)")
        if bias is not None and len(bias):
            values = torch.as_tensor(bias, dtype=torch.float32)
            if bool(values.isnan().any() or values.isposinf().any()):
                raise RequestError("embedding_bias (the ensemble's embedding_bias_weights) holds NaN or "
                                   "+inf; it must be finite (or -inf to ban a token)")

    def _new_state(self, request: Request, request_id: int, key: int, index: int,
                   bias: torch.Tensor | None, parent: Sequence | None, lora=None) -> RequestState:
        """Sequence `index` of a request. Only the first returns the prompt's logits, and it
        then computes its whole prompt (no cached prefix); the others share its prompt blocks."""
        config = request.output_config
        want_context_logits = (config.return_context_logits or config.return_prompt_log_probs) and index == 0
        beam_width = request.sampling_config.beam_width
        seq = Sequence(request_id=key, prompt_token_ids=list(request.input_token_ids),
                       max_new_tokens=request.max_tokens, reuse_prefix=not want_context_logits,
                       fork_parent=parent, beam_width=beam_width,
                       lora_id=None if lora is None else lora.key)
        outputs = RequestOutputs(request.output_config, seq.num_prompt_tokens, want_context_logits)
        state_class = BeamRequestState if beam_width > 1 else RequestState
        return state_class(request_id, request, seq, self._make_generator(request, index), bias, outputs,
                           guide=self.guide(request), sequence_index=index, lora=lora)

    def _make_generator(self, request: Request, index: int = 0) -> torch.Generator | None:
        """The RNG of sequence `index`: seeded `seed + index`, so the first sequence draws what
        the same request with one sequence draws."""
        if request.sampling_config.is_greedy:
            return None
        generator = torch.Generator(device=self.worker.device)
        seed = request.sampling_config.seed
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed((seed + index) % 2**63)
        return generator

    def _embedding_bias(self, request: Request) -> torch.Tensor | None:
        bias = request.embedding_bias
        if bias is None or len(bias) == 0:
            return None
        return torch.as_tensor(bias, dtype=torch.float32).to(self.worker.device)
