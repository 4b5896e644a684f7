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

import torch

from inflight import kernels
from inflight.platform import to_device
from inflight.sampling.beam_search import beam_candidates
from inflight.sampling.outputs import INVALID_TOKEN, DeviceSample, SamplerOutput
from inflight.sampling.row import SamplingRow
from inflight.sampling.token_mask import build_token_mask


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
