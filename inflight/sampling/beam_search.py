"""Beam search, device side: each step's best (beam, token) candidates of every beam request.

The host side (selection, hypotheses, early stopping) is `inflight.core.beam_search`.
"""

from __future__ import annotations

import torch

from inflight.core.beam_search import BeamRow
from inflight.platform import to_device


def beam_candidates(logits: torch.Tensor, rows: list[BeamRow]) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """logits [S, vocab] (processed) of beam rows, groups consecutive → ((group, K) per group,
    [4, sum of K] float64: token, parent, cum log prob, token log prob per candidate, the
    groups' candidates one after the other)."""
    device = logits.device
    temperature = to_device(torch.tensor([r.temperature for r in rows], dtype=torch.float32), device)
    log_probs = torch.log_softmax(logits / temperature.unsqueeze(1), dim=-1)  # [S, vocab]
    cum = to_device(torch.tensor([r.cum_log_prob for r in rows], dtype=torch.float32), device)
    total = log_probs + cum.unsqueeze(1)  # [S, vocab]
    groups, outputs, start = [], [], 0
    vocab = logits.shape[1]
    while start < len(rows):
        end = start
        while end < len(rows) and rows[end].group == rows[start].group:
            end += 1
        first = rows[start]
        ranked = total[start:end]
        if first.diversity_rate:
            bonus = torch.tensor([r.index * first.diversity_rate for r in rows[start:end]],
                                 dtype=torch.float32)
            ranked = ranked + to_device(bonus, device).unsqueeze(1)
        k = min(first.num_candidates, ranked.numel())
        flat = ranked.reshape(-1).topk(k).indices  # [K], best first
        outputs.append(torch.stack([(flat % vocab).double(), (flat // vocab).double(),
                                    total[start:end].reshape(-1)[flat].double(),
                                    log_probs[start:end].reshape(-1)[flat].double()]))
        groups.append((first.group, k))
        start = end
    return groups, torch.cat(outputs, dim=1)
