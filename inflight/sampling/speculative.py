"""Acceptance rules of speculative decoding with externally drafted tokens, as pure torch functions.

TensorRT-LLM, as read in its source (NVIDIA/TensorRT-LLM unless noted; facts only, no code taken):
- Requests carry `ExternalDraftTokensConfig(tokens, logits, acceptanceThreshold, fastLogits)`: logits
  [num_draft_tokens, vocab], threshold "Must be > 0.f and <= 1.f" (cpp/include/tensorrt_llm/executor/
  executor.h; checked in cpp/tensorrt_llm/executor/speculativeDecodingConfig.cpp); fastLogits only picks
  a direct transfer. triton-inference-server/tensorrtllm_backend fills it from the inputs draft_input_ids,
  draft_logits, draft_acceptance_threshold (all_models/inflight_batcher_llm/tensorrt_llm/1/model.py).
- The sampling layer gets one scalar per batch: `constantThreshold`, `useRandomAcceptanceThreshold` = no
  threshold given (cpp/tensorrt_llm/layers/decodingParams.h; cpp/tensorrt_llm/runtime/gptDecoderBatched.cpp
  takes the first request's value: "only used for testing").
- cpp/tensorrt_llm/layers/externalDraftTokensLayer.cpp @1d263f15, acceptDraftTokens: q = plain softmax of
  the draft logits (no temperature, top-k or top-p); p = softmax of the target logits after the penalty
  layer (which applies temperature), tokens outside the request's top-k/top-p set at -inf.
- cpp/tensorrt_llm/kernels/speculativeDecoding/externalDraftTokensKernels.cu @2931b93f, with draft logits:
  L170 u = curand_uniform in (0, 1], or the constant threshold instead (no random draw); L173 accept iff
  p(x) > u * q(x): the threshold bounds p/q, not p(x); a random u accepts with probability min(1, p/q).
  On rejection (L189-209) p becomes max(0, p - q) renormalised (a zero sum unguarded), and
  multinomialSampling draws the correction from it; after the last draft (L148-156) the bonus comes
  from p. The older @04a2cacb kernel accepted iff p/q >= threshold (equality accepted).
- Without draft logits (L178) the threshold is unused: accept iff the draft equals the target token drawn
  by the top-k/top-p kernel (`outputIdCurrentStep`, cpp/tensorrt_llm/kernels/samplingTopKKernels.h), the
  argmax when greedy. On a mismatch p is unchanged and the correction is a fresh draw from it, so a
  sampled request emits the draft token d there with probability p(d)(2 - p(d)), not p(d); q = one-hot
  (`point_mass_probs`) makes the rule below exact for such drafts.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ensemble.sampling_distribution import sampling_distribution

# A residual lighter than this is float rounding of p == q (TensorRT-LLM would divide by ~0): draw from p.
# A random threshold rejects with probability TV(p, q) below this, so the bias is negligible.
_RESIDUAL_EPS = 1e-6
# How far a row's sum may stray from 1 (float32 softmax over a large vocabulary).
_SUM_TOL = 1e-3


def accepted_greedy(draft: Sequence[int], target: Sequence[int]) -> int:
    """Number of leading draft tokens equal to the target's greedy choices: draft[j] is checked
    against target[j] (the target's token after the position before it); len(target) == len(draft) + 1."""
    if len(target) != len(draft) + 1:
        raise ValueError(f"target must hold len(draft) + 1 = {len(draft) + 1} tokens, got {len(target)}")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # leading draft tokens accepted
    tokens: list[int]  # emitted this step: the accepted drafts, then the correction or the bonus


def draft_probs_from_logits(draft_logits: torch.Tensor) -> torch.Tensor:
    """[k, V] draft logits -> [k, V] float32 draft probabilities, as TensorRT-LLM: a plain softmax, no
    temperature or top-k/top-p, so the logits must already be those the drafter sampled from. -inf is
    a banned token; NaN, +inf or a row without a finite logit is a ValueError."""
    if (not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 2 or draft_logits.shape[1] == 0
            or not draft_logits.is_floating_point()):
        raise ValueError(f"draft_logits must be a 2-D float tensor [k, vocab], got {_describe(draft_logits)}")
    logits = draft_logits.float()
    if torch.isnan(logits).any() or torch.isposinf(logits).any():
        raise ValueError("draft_logits must not hold NaN or +inf")
    if not torch.isfinite(logits.amax(dim=-1)).all():
        raise ValueError("draft_logits: every row needs at least one finite logit")
    return torch.softmax(logits, dim=-1)


def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
    """[n, V] raw logits -> [n, V] float32: the distribution a request samples from at each
    position (`ensemble.sampling_distribution`: temperature, top-k, top-p; greedy is one-hot)."""
    probs = sampling_distribution(logits.detach().float().cpu().numpy(), temperature, top_k, top_p)
    return torch.from_numpy(probs)


def point_mass_probs(draft: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[k, V] draft probabilities for draft tokens without logits: all mass on each drafted token. Then
    token d is accepted with probability p(d) and the correction is drawn from p without d: exactly p."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    ids = _check_range(_token_ids(draft), vocab_size)
    return torch.nn.functional.one_hot(torch.tensor(ids, dtype=torch.long), vocab_size).float()


def verify_with_draft_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft: Sequence[int],
                            generator: torch.Generator | None = None,
                            threshold: float | None = None) -> Verdict:
    """Rejection sampling (Leviathan et al. 2023; Chen et al. 2023), TensorRT-LLM's rule.

    target_probs [k + 1, V]: the target's sampling distribution p at each position (after temperature,
    top-k and top-p, as the request samples); draft_probs [k, V]: the drafter's q for each draft token;
    draft: the k tokens. Draft token x at position j is accepted iff p_j(x) > u * q_j(x), u uniform in
    [0, 1) from `generator` (probability min(1, p/q)); a `threshold` in (0, 1] replaces u, which makes
    acceptance deterministic and the output no longer distributed as p. p(x) = 0 is always rejected.
    At the first rejection the correction is drawn from max(0, p_j - q_j) renormalised (p_j where that
    is empty); if all k are accepted the bonus is drawn from p_k. Bad input: ValueError naming it.
    """
    ids = _token_ids(draft)
    p = _check_probs("target_probs", target_probs, len(ids) + 1, None)
    q = _check_probs("draft_probs", draft_probs, len(ids), p.shape[1])
    if q.device != p.device:
        raise ValueError(f"draft_probs is on {q.device}, target_probs on {p.device}")
    _check_range(ids, p.shape[1])
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0.0 < threshold <= 1.0):
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    draft_ids = torch.tensor([ids], dtype=torch.long, device=p.device)
    num, extra = _verify_rows(p[None], q[None], draft_ids, generator, threshold)
    n = int(num[0])
    return Verdict(num_accepted=n, tokens=ids[:n] + [int(extra[0])])


def _verify_rows(target: torch.Tensor, draft_probs: torch.Tensor, draft: torch.Tensor,
                 generator: torch.Generator | None, threshold: float | None) -> tuple[torch.Tensor, ...]:
    """The rule over B independent rows, unchecked: target [B, k + 1, V], draft_probs [B, k, V] float32,
    draft [B, k] long. Returns (num_accepted [B], the extra token [B]) without a host sync."""
    b, k, v = draft_probs.shape
    p_x = target[:, :k].gather(2, draft[..., None]).squeeze(2)
    q_x = draft_probs.gather(2, draft[..., None]).squeeze(2)
    if threshold is None:
        # u in [0, 1) rather than curand's (0, 1]: P(p > u * q) = min(1, p/q) either way.
        u = torch.rand(b, k, generator=generator, device=target.device)
    else:
        u = torch.full((b, k), float(threshold), device=target.device)
    num = (p_x > u * q_x).long().cumprod(dim=1).sum(dim=1)
    # The extra token comes from position num; a zero draft row past the last draft token makes the
    # residual there p itself, the bonus distribution.
    rows = torch.arange(b, device=target.device)
    p_n = target[rows, num]
    q_n = torch.cat([draft_probs, draft_probs.new_zeros(b, 1, v)], dim=1)[rows, num]
    residual = (p_n - q_n).clamp_min(0)
    dist = torch.where(residual.sum(-1, keepdim=True) < _RESIDUAL_EPS, p_n, residual)
    return num, torch.multinomial(dist, 1, generator=generator).squeeze(1)


def _check_probs(name: str, probs: object, rows: int, vocab: int | None) -> torch.Tensor:
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(f"{name} must be a 2-D floating-point tensor, got {_describe(probs)}")
    if probs.shape[0] != rows or (vocab is not None and probs.shape[1] != vocab) or probs.shape[1] == 0:
        want = f"[{rows}, {'vocab' if vocab is None else vocab}]"
        raise ValueError(f"{name} must have shape {want} (k = len(draft)), got {list(probs.shape)}")
    probs = probs.float()
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError(f"{name} must be finite and non-negative")
    error = probs.sum(-1) - 1
    if rows and (error.abs() > _SUM_TOL).any():
        raise ValueError(f"{name}: every row must sum to 1, one sums to {1 + float(error.abs().max()):.6g}")
    return probs


def _token_ids(draft: Sequence[int]) -> list[int]:
    try:
        return [operator.index(t) for t in draft]
    except TypeError:
        raise ValueError(f"draft must be a sequence of integer token ids, got {draft!r:.80}") from None


def _check_range(ids: list[int], vocab_size: int) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"draft token {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def _describe(x: object) -> str:
    return f"shape {list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
