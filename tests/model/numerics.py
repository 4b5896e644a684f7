"""How far float rounding alone can move a result, so tests allow that and nothing more.

Two computations of the same fp32 values that differ only in the order of their additions
(batched vs alone, our kernels vs Hugging Face's, AVX2 vs AVX-512, MKL's paths, 1 vs 4 threads)
disagree by rounding. These bounds are derived from the dtype's machine epsilon, the reduction
length, the depth and the magnitude of the values, so they hold on any x86 CPU and stay orders of
magnitude below what a real bug moves (a wrong block, a position off by one or a mask that leaks
across rows changes logits by a large fraction of their magnitude).

A sum of K products rounded in any order is within about sqrt(K)·eps of the exact one, relative
to the magnitude of the result: the rounding errors are independent and add like a random walk
(Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019); K·eps is the
worst case, which real kernels do not come near.
"""

from __future__ import annotations

import math

import torch

from inflight.model.config import ModelConfig

FP32_EPS = torch.finfo(torch.float32).eps  # 1.19e-7


def reduction_noise(length: int, magnitude: float, eps: float = FP32_EPS) -> float:
    """Rounding of one length-`length` sum whose result is about `magnitude`, in one ordering."""
    return math.sqrt(length) * eps * magnitude


def forward_noise(config: ModelConfig, eps: float = FP32_EPS) -> float:
    """Relative rounding noise of one forward pass, from embeddings to logits.

    Each rounding stage adds its `reduction_noise` to what it receives (the residual stream and
    the norms carry relative errors through), so the stages a value passes through in series add
    up. Per layer: q/k/v projections (hidden), q·k (head_dim), softmax·v (at most the longest
    context), o_proj (heads × head_dim), gate/up (hidden), down (intermediate); after the last
    layer, the lm_head (hidden). The magnitude it is relative to is the output's: max|logit|.
    """
    c = config
    attention = (reduction_noise(c.hidden_size, 1.0, eps) + reduction_noise(c.head_dim, 1.0, eps)
                 + reduction_noise(c.max_position_embeddings, 1.0, eps)
                 + reduction_noise(c.num_attention_heads * c.head_dim, 1.0, eps))
    mlp = reduction_noise(c.hidden_size, 1.0, eps) + reduction_noise(c.intermediate_size, 1.0, eps)
    return c.num_hidden_layers * (attention + mlp) + reduction_noise(c.hidden_size, 1.0, eps)


def logit_noise_bound(config: ModelConfig, logits: torch.Tensor, eps: float = FP32_EPS) -> torch.Tensor:
    """Per row of `logits` ([..., vocab]): the most two fp32 forward passes of the same tokens may
    differ by when only their reduction order differs: each is `forward_noise` away from the
    exact logits, relative to the row's max|logit|, hence the factor 2. For SmolLM2-135M (30
    layers) that is 1.5e-3·max|logit|, for the 3-layer tiny checkpoints 3.8e-5·max|logit|.
    """
    magnitude = logits.detach().abs().amax(dim=-1, keepdim=True).double()
    return 2 * forward_noise(config, eps) * magnitude


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, config: ModelConfig,
                        what: str = "") -> None:
    """Equal up to `logit_noise_bound`, row by row; the message gives the worst row's ratio."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    bound = logit_noise_bound(config, expected)
    diff = (actual.double() - expected.double()).abs().amax(dim=-1, keepdim=True)
    ratio = diff / bound
    worst = int(ratio.reshape(-1).argmax())
    assert float(ratio.max()) <= 1.0, (
        f"{what}: logits differ by {float(diff.reshape(-1)[worst]):.3g}, more than fp32 rounding "
        f"allows ({float(bound.reshape(-1)[worst]):.3g} for max|logit| "
        f"{float(expected.reshape(-1, expected.shape[-1])[worst].abs().max()):.3g})")


def top2_margin(logits: torch.Tensor) -> float:
    top2 = logits.float().topk(2).values
    return float(top2[0] - top2[1])


def assert_greedy_tokens_match(ref_tokens: list[int], ref_logits: list[torch.Tensor],
                               tokens: list[int], config: ModelConfig, what: str = "") -> int:
    """Greedy tokens equal the reference's, except where the reference's top-1/top-2 margin is
    within rounding noise (a near tie may break either way on another CPU; the sequences then
    legitimately part, so nothing after it is compared). Returns how many tokens were compared.
    """
    assert len(tokens) == len(ref_tokens), (what, tokens, ref_tokens)
    for step, (ref, got, logits) in enumerate(zip(ref_tokens, tokens, ref_logits)):
        if ref == got:
            continue
        margin = top2_margin(logits)
        bound = float(logit_noise_bound(config, logits))
        assert margin <= bound, (
            f"{what}: greedy token {step} is {got}, reference {ref}, with a reference top-2 margin of "
            f"{margin:.3g}, far above fp32 noise ({bound:.3g}): {tokens} vs {ref_tokens}")
        return step
    return len(ref_tokens)


def log_softmax_noise(vocab_size: int, magnitude: float, eps: float = FP32_EPS) -> float:
    """Difference between two fp32 log-softmax evaluations of the same logits: the log of a
    vocab-long sum of exponentials (relative rounding sqrt(V)·eps becomes absolute in the log)
    plus the rounding of `logit - max` (a few eps of the logits' magnitude); each side once."""
    return 2 * (reduction_noise(vocab_size, 1.0, eps) + 2 * eps * magnitude)


def elementwise_noise(num_ops: int, magnitude: float, eps: float = FP32_EPS) -> float:
    """Two evaluations of the same `num_ops` elementwise fp32 operations in another order: each
    rounds to within eps/2 of its result, on both sides."""
    return 2 * num_ops * (eps / 2) * magnitude


def frequency_bound(probability: float, num_draws: int, num_sigmas: float = 5.0) -> float:
    """How far an observed frequency may stray from `probability` over `num_draws` independent
    draws: `num_sigmas` binomial standard deviations (5σ: a false alarm once in ~2 million)."""
    return num_sigmas * math.sqrt(probability * (1 - probability) / num_draws)
