"""fp32 tolerances of whole-model comparisons, derived from depth and width."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

U = 2.0 ** -24  # fp32 unit roundoff


def fp32_noise_bound(num_layers: int, width: int, magnitude: float) -> float:
    """What separates two fp32 evaluations of the same network that differ only in the order
    of float operations (summation order in norms, attention and GEMM blocking; exp2 vs exp;
    the rows a GEMM is batched with).

    Each reduction of n terms carries ~sqrt(n) u relative error; a layer chains a handful of
    them (norm, projections, attention, MLP) whose errors add up in the residual stream, so
    after L layers and the LM head the outputs differ by about C (L + 1) sqrt(width) u times
    their magnitude. C = 64 covers the chain's constants and amplification by the random
    weights (observed on the tiny checkpoints: 28x below this bound at worst).
    """
    return 64 * (num_layers + 1) * width ** 0.5 * U * magnitude


def logits_tolerance(logits: torch.Tensor, num_layers: int, width: int) -> dict[str, float]:
    """assert_close arguments for two fp32 evaluations of `logits` (see fp32_noise_bound)."""
    return {"rtol": 0.0, "atol": fp32_noise_bound(num_layers, width, float(logits.abs().max()))}


def assert_same_tokens_but_at_a_tie(tokens: Sequence[int], ref: Sequence[int],
                                    ref_logits: Sequence[torch.Tensor],
                                    tie_bound: Callable[[torch.Tensor], float]) -> None:
    """Greedy `tokens` equal `ref` until a step where the reference's top-2 margin is within
    `tie_bound(that step's logits)`: a near tie may break either way, and the rest then parts."""
    for step, (got, want) in enumerate(zip(tokens, ref)):
        if got != want:
            top2 = ref_logits[step].float().topk(2).values
            assert float(top2[0] - top2[1]) <= tie_bound(ref_logits[step].float()), (tokens, ref)
            return
