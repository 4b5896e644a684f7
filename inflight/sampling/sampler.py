"""Per-request sampling for a mixed batch, on the logits' device.

Processing order for each row (all rows processed together as [S, vocab] tensors):
  1. embedding bias (added to the raw logits),
  2. repetition penalty (HF: over prompt + generated tokens), then frequency and presence
     penalties (OpenAI: over generated tokens only),
  3. bad words and min_tokens bans (logit = -inf); guided rows: the grammar's token mask
     (`inflight.sampling.token_mask`), their bans folded into it,
  4. log probs: log_softmax(processed / temperature) at the chosen token, temperature taken
     as 1 for greedy rows, i.e. the distribution the row samples from *before* top-k/top-p
     truncation (for a guided row: within its mask, as TensorRT-LLM, which masks the logits
     before its sampling layers),
  5. greedy rows: argmax; random rows: / temperature, top-k, top-p, then one draw from the
     row's own generator (exponential race), so a row's token never depends on its neighbours.

A row whose logits hold NaN or +inf (extreme penalties overflow fp32), or whose every token is
banned (-inf), has no distribution to sample from: it gets the token id `INVALID_TOKEN` instead
of an arbitrary one, and the engine fails that request alone (TensorRT-LLM would emit garbage).
The flag rides in the sampled ids, so it costs no extra transfer. A user logits hook that
raises marks its row the same way (`apply_logits_hooks`).

The host builds index lists from the rows' token ids (and the guided rows' token masks);
the device work has no host syncs.
`sample_on_device` leaves the sampled ids (and log probs) on the device in a `DeviceSample`,
whose `start_copy` queues their copy to pinned host memory and whose `result` waits for that
copy alone (a CUDA event, not the whole stream): so the next step can be queued before the
host reads this one's tokens. `sample` does both at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from inflight import kernels
from inflight.core.beam_search import BeamRow, Candidates
from inflight.platform import to_device
from inflight.sampling.beam_search import beam_candidates
from inflight.sampling.token_mask import Guide, build_token_mask

_GREEDY_TEMPERATURE = 1e-5
# Sampled id of a row with nothing to sample from (NaN or +inf logits, every token banned).
INVALID_TOKEN = -1


@dataclass
class SamplingRow:
    """One sampled sequence's parameters and history, built by the engine each step."""

    token_ids: list[int]  # prompt + generated so far
    num_prompt_tokens: int
    temperature: float = 0.0  # 0 (anything < 1e-5) => greedy (argmax)
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1.0 => off
    repetition_penalty: float = 1.0  # HF: divide positive logits, multiply negative ones
    presence_penalty: float = 0.0  # logit -= presence * (count > 0), generated tokens
    frequency_penalty: float = 0.0  # logit -= frequency * count, generated tokens
    min_tokens: int = 0  # while generated < min_tokens, end_id gets -inf
    end_id: int | None = None
    # A bad word's last token is banned when the sequence's tail equals its preceding tokens;
    # a single-token bad word is always banned.
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: torch.Tensor | None = None  # [vocab], added to the logits first
    generator: torch.Generator | None = None  # per-request RNG on the logits' device
    return_log_probs: bool = False
    num_top_log_probs: int = 0  # the K most likely tokens' log probs too (same distribution)
    beam: BeamRow | None = None  # set on the rows of a beam search request (its token is unused)
    # Guided decoding: the request's grammar matcher (it has accepted every token so far);
    # only the tokens it allows can be sampled.
    guide: Guide | None = None

    @property
    def is_greedy(self) -> bool:
        # Below ~1e-5 dividing by the temperature overflows fp32 logits to inf (NaN softmax),
        # and the distribution is argmax anyway.
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @cached_property
    def is_plain_greedy(self) -> bool:
        """Argmax with nothing applied to the logits at any step and no log probs. Cached: a
        row's parameters are fixed once it is built (only `token_ids` grows)."""
        return (self.beam is None and self.is_greedy and not self.return_log_probs
                and not self.num_top_log_probs and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0
                and not self.bad_words and self.embedding_bias is None and self.guide is None
                and (self.end_id is None or self.min_tokens <= 0))

    def has_processors(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.bad_words)
                or self.embedding_bias is not None or self._min_tokens_active()
                or self.guide is not None)

    def _min_tokens_active(self) -> bool:
        return self.end_id is not None and self.num_generated_tokens < self.min_tokens

    def banned_token_ids(self) -> list[int]:
        """Tokens this row may not sample at this step (bad words and min_tokens)."""
        banned = []
        for word in self.bad_words:
            if not word:
                continue
            prefix = list(word[:-1])
            if not prefix or (len(prefix) <= len(self.token_ids)
                              and self.token_ids[len(self.token_ids) - len(prefix):] == prefix):
                banned.append(int(word[-1]))
        if self._min_tokens_active():
            banned.append(int(self.end_id))
        return banned


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

    def result(self) -> "SamplerOutput":
        """Already on the host: `DeviceSample.result()`'s answer, for samples made there."""
        return self


def apply_logits_hooks(logits: torch.Tensor, hooks, request_ids: list[int],
                       rows: list[SamplingRow]) -> dict[int, str]:
    """Runs each row's logits hook in place (`logits[i] = hook(id, tokens, logits[i])`). A hook
    that raises or returns a tensor of another shape fails its own row only: the row's logits
    become NaN (so it samples `INVALID_TOKEN`) and its error is returned, by row."""
    errors: dict[int, str] = {}
    for i, hook in enumerate(hooks or []):
        if hook is None:
            continue
        try:
            out = hook(request_ids[i], rows[i].token_ids, logits[i])
            if not isinstance(out, torch.Tensor) or out.shape != logits[i].shape:
                raise ValueError(f"returned {type(out).__name__} "
                                 f"{list(getattr(out, 'shape', []))}, expected a tensor "
                                 f"{list(logits[i].shape)}")
            logits[i] = out
        except Exception as exc:  # a user's processor: fail its request, not the batch
            errors[i] = f"logits processor failed: {type(exc).__name__}: {exc}"
            logits[i] = float("nan")
    return errors


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

    def start_copy(self) -> "DeviceSample":
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


def reduce_prompt_logits(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> torch.Tensor:
    """Prompt positions' raw logits [n, vocab] -> [n, 1 + 2 num_top] float32: the log prob of
    each position's target (the next prompt token; 0 where the target is -1), its num_top top
    log probs (descending), and their ids (exact in float32 below 2^24). The distribution is
    the model's own (temperature 1, nothing applied), as prompt log probs are defined."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = log_probs.gather(1, targets.clamp_min(0).unsqueeze(1))  # [n, 1]
    chosen = torch.where(targets.unsqueeze(1) >= 0, chosen, torch.zeros_like(chosen))
    if not num_top:
        return chosen
    top = log_probs.topk(num_top, dim=-1)
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def _pinned_copy(values: torch.Tensor | None) -> torch.Tensor | None:
    if values is None or values.device.type == "cpu":  # None, or already copied (pinned)
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _row_param(rows: list[SamplingRow], attr: str, device: torch.device) -> torch.Tensor:
    values = [float(getattr(r, attr)) for r in rows]
    return _to_device(values, torch.float32, device).unsqueeze(1)  # [S, 1]


def _flat_indices(per_row: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Indices into logits.view(-1) for (row, token) pairs: row * vocab + token."""
    flat = [r * vocab_size + t for r, tokens in enumerate(per_row) for t in tokens]
    return _to_device(flat, torch.int64, device)


def _flag_invalid(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`tokens` with INVALID_TOKEN where a row of (processed) `logits` has a NaN, a +inf or no
    token above -inf: exactly the rows whose maximum is not finite (amax propagates NaN). One
    reduction over [S, vocab]; no host sync."""
    usable = torch.isfinite(logits.amax(dim=-1))  # [S]
    return torch.where(usable, tokens, torch.full_like(tokens, INVALID_TOKEN))


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """`_flag_invalid(logits, logits.argmax(dim=-1))`; on CUDA as two Triton launches
    (inflight/kernels/greedy.py) instead of torch's one-block-per-row argmax and four more
    kernels (41 us against ~5 at one row of 128k logits on an H100). No host sync."""
    if logits.is_cuda and kernels.triton_available():
        return kernels.greedy_tokens(logits, INVALID_TOKEN)
    return _flag_invalid(logits, logits.argmax(dim=-1))


class Sampler:
    """Stateless; `sample` may be called with any mix of greedy and random rows."""

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits [S, vocab] float32, one SamplingRow per logits row -> one token per row."""
        return self.sample_on_device(logits, rows).result()

    def sample_on_device(self, logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
        """`sample` without reading the tokens back: no host sync."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
        if all(r.is_plain_greedy for r in rows):  # the common case, checked in one pass
            return DeviceSample(_greedy(logits), None, [False] * len(rows))
        wants = [r.return_log_probs or r.num_top_log_probs > 0 for r in rows]
        want_log_probs = any(wants)
        if any(r.beam is not None for r in rows):
            return self._with_beams(logits, rows)
        if all(r.is_greedy and not r.has_processors() for r in rows) and not want_log_probs:
            return DeviceSample(_greedy(logits), None, wants)

        logits = self.process_logits(logits, rows)  # [S, vocab]
        if all(r.is_greedy for r in rows):
            tokens = logits.argmax(dim=-1)  # [S]
        else:
            greedy = _to_device([r.is_greedy for r in rows], torch.bool, logits.device)  # [S]
            tokens = torch.where(greedy, logits.argmax(dim=-1), self._sample_random(logits, rows))
        tokens = _flag_invalid(logits, tokens)

        if not want_log_probs:
            return DeviceSample(tokens, None, wants)
        temperature = _to_device([1.0 if r.is_greedy else r.temperature for r in rows],
                                 torch.float32, logits.device).unsqueeze(1)  # [S, 1]
        log_probs = torch.log_softmax(logits / temperature, dim=-1)  # [S, vocab]
        chosen = log_probs.gather(1, tokens.clamp_min(0).unsqueeze(1)).squeeze(1)  # [S]
        sample = DeviceSample(tokens, chosen, wants)
        counts = [r.num_top_log_probs for r in rows]
        if any(counts):  # one topk over the rows, as wide as the widest ask
            top = log_probs.topk(max(counts), dim=-1)  # sorted, descending
            sample.top_values = torch.stack([top.values.double(), top.indices.double()])  # [2, S, K]
            sample.top_counts = counts
        return sample

    def _with_beams(self, logits: torch.Tensor, rows: list[SamplingRow]) -> DeviceSample:
        """A step with beam rows: the other rows sample as usual (beam rows get an unused
        greedy token), the beam rows' candidates ride along in the same host copy."""
        beam_index = [i for i, r in enumerate(rows) if r.beam is not None]
        beam_rows = [rows[i] for i in beam_index]
        index = _to_device(beam_index, torch.int64, logits.device)
        processed = self.process_logits(logits.index_select(0, index), beam_rows)
        groups, values = beam_candidates(processed, [r.beam for r in beam_rows])
        sample = self.sample_on_device(logits, [_plain(r) for r in rows])
        sample.beam_groups, sample.beam_values = groups, values
        return sample

    @staticmethod
    def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Applies bias, penalties, bans and token masks (steps 1-3); returns a new [S, vocab]
        tensor."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        logits = logits.clone()
        if any(r.embedding_bias is not None for r in rows):
            bias = torch.zeros_like(logits)
            for i, r in enumerate(rows):
                if r.embedding_bias is not None:
                    bias[i] = to_device(r.embedding_bias, device).to(logits.dtype)
            logits += bias

        if any(r.repetition_penalty != 1.0 for r in rows):
            seen = torch.zeros(num_rows * vocab_size, dtype=torch.bool, device=device)
            per_row = [list(set(r.token_ids)) if r.repetition_penalty != 1.0 else [] for r in rows]
            # index_fill_, not `seen[idx] = True`: the latter syncs on CUDA.
            seen.index_fill_(0, _flat_indices(per_row, vocab_size, device), True)
            seen = seen.view(num_rows, vocab_size)
            penalty = _row_param(rows, "repetition_penalty", device)  # [S, 1]
            penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
            logits = torch.where(seen, penalised, logits)

        if any(r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 for r in rows):
            per_row = [r.token_ids[r.num_prompt_tokens:]
                       if r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 else []
                       for r in rows]
            counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
            index = _flat_indices(per_row, vocab_size, device)
            counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
            counts = counts.view(num_rows, vocab_size)
            logits -= _row_param(rows, "frequency_penalty", device) * counts
            logits -= _row_param(rows, "presence_penalty", device) * (counts > 0).float()

        banned = [r.banned_token_ids() if r.guide is None else [] for r in rows]
        if any(banned):
            logits.view(-1).index_fill_(0, _flat_indices(banned, vocab_size, device), float("-inf"))
        token_mask = build_token_mask(rows, vocab_size, device)
        if token_mask is not None:
            token_mask.apply(logits)
        return logits

    @staticmethod
    def _sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and a per-row draw; [S] token ids (greedy rows: junk)."""
        device = logits.device
        vocab_size = logits.shape[1]
        temperature = _to_device([r.temperature if not r.is_greedy else 1.0 for r in rows],
                                 torch.float32, device).unsqueeze(1)  # [S, 1]
        logits = logits / temperature

        use_top_k = any(0 < r.top_k < vocab_size for r in rows)
        use_top_p = any(r.top_p < 1.0 for r in rows)
        if use_top_k or use_top_p:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [S, vocab]
            if use_top_k:
                top_k = _to_device([r.top_k if 0 < r.top_k < vocab_size else vocab_size
                                    for r in rows], torch.int64, device)
                # Threshold at the k-th largest value: ties with it survive, as in HF.
                kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))  # [S, 1]
                sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
            if use_top_p:
                top_p = _row_param(rows, "top_p", device)  # [S, 1]
                sorted_probs = sorted_logits.softmax(dim=-1)
                mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [S, vocab]
                # Smallest nucleus: drop a token once the better ones already reach top_p
                # (the best token always has mass_before == 0 and stays).
                drop = (mass_before >= top_p) & (top_p < 1.0)
                sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)

        probs = logits.softmax(dim=-1)  # [S, vocab]
        # Exponential race: argmax(p / E) with E ~ Exp(1) picks token i with probability p_i.
        # Each row draws its noise from its own generator, so its token is independent of
        # the other rows and reproducible from its seed.
        noise = torch.ones_like(probs)
        for i, r in enumerate(rows):
            if r.is_greedy:
                continue  # its token comes from argmax; leave its RNG untouched
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
            else:
                noise[i].exponential_()
        return (probs / noise).argmax(dim=-1)


def _plain(row: SamplingRow) -> SamplingRow:
    """A beam row as a plain greedy row (its sampled token is not used)."""
    if row.beam is None:
        return row
    return SamplingRow(row.token_ids, row.num_prompt_tokens, return_log_probs=row.return_log_probs)
