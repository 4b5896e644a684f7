"""Acceptance rules of speculative decoding (`inflight.sampling.speculative`), torch on the CPU.

The statistical tests draw the draft tokens from q, run the rule and check with Pearson's chi-square
goodness-of-fit test that every emitted token is distributed as the target's p at its position
(conditioned on the tokens before it being accepted). V = 6, so df = 5; alpha = 1e-3 per test gives the
critical value 20.515. Power: against any distribution at total variation delta from p, the statistic
is noncentral chi-square(5, lambda) with lambda = n * sum_i (p'_i - p_i)^2 / p_i >= n * (2 delta)^2
(Cauchy-Schwarz, since sum_i |p'_i - p_i| = 2 delta and sum_i p_i = 1). With n >= 5000 samples
(asserted for every tested position) and delta = 0.05, lambda >= 50 and the power is 0.998
(Poisson mixture of central chi-square tails, computed with mpmath); the first token uses
n = 20000, where the same power holds down to delta = 0.025. Seeds are fixed, so the tests are
deterministic; alpha is the chance that a correct rule would fail for a seed picked at random.
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.sampling.speculative import (
    Verdict,
    _verify_rows,
    accepted_greedy,
    draft_probs_from_logits,
    point_mass_probs,
    verify_with_draft_probs,
)

V = 6
CHI2_CRITICAL = 20.515  # chi-square, df = V - 1 = 5, upper 1e-3 quantile
N = 20_000
MIN_SAMPLES = 5_000  # the power statement above needs this many samples at every tested position


def dist(seed: int, rows: int) -> torch.Tensor:
    """Random rows over V tokens, each probability >= 0.02 (expected counts >= 100 at MIN_SAMPLES)."""
    g = torch.Generator().manual_seed(seed)
    return 0.88 * torch.softmax(torch.randn(rows, V, generator=g) * 1.2, dim=-1) + 0.02


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = tokens.numel() * p.double()
    return float(((counts - expected) ** 2 / expected).sum())


def emitted_at(j: int, num: torch.Tensor, draft: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """The j-th emitted token of the rows that got that far (their first j drafts accepted)."""
    reached = num >= j
    drafted = draft[:, j] if j < draft.shape[1] else extra
    return torch.where(num > j, drafted, extra)[reached]


# --- greedy ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft, target, expected", [
    ([5, 6, 7], [5, 6, 7, 1], 3),  # all accepted: the target's last token is the bonus
    ([5, 6, 7], [5, 6, 9, 1], 2),
    ([5, 6, 7], [4, 6, 7, 1], 0),  # a later match does not count after a mismatch
    ([], [3], 0),
])
def test_accepted_greedy(draft, target, expected):
    assert accepted_greedy(draft, target) == expected


def test_accepted_greedy_needs_one_more_target_token():
    with pytest.raises(ValueError, match=r"target must hold len\(draft\) \+ 1 = 3 tokens, got 2"):
        accepted_greedy([1, 2], [1, 2])


# --- deterministic cases --------------------------------------------------------------------------

def test_q_equal_p_accepts_everything_and_draws_the_bonus_from_the_last_position():
    p = dist(7, 4)
    p[3] = torch.nn.functional.one_hot(torch.tensor(5), V).float()
    for seed in range(20):
        verdict = verify_with_draft_probs(p, p[:3].clone(), [0, 3, 1], torch.Generator().manual_seed(seed))
        assert verdict == Verdict(num_accepted=3, tokens=[0, 3, 1, 5])


def test_zero_target_probability_is_rejected_and_corrected_from_the_residual():
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0, 0.0], [1 / 6] * 6])
    q = torch.tensor([[0.6, 0.0, 0.1, 0.3, 0.0, 0.0]])
    # residual max(0, p - q) = [0, 0.5, 0.4, 0, 0, 0]: the correction is token 1 or 2
    seen = set()
    for seed in range(40):
        verdict = verify_with_draft_probs(p, q, [0], torch.Generator().manual_seed(seed))
        assert verdict.num_accepted == 0 and verdict.tokens[0] in (1, 2)
        seen.add(verdict.tokens[0])
    assert seen == {1, 2}


def test_no_draft_samples_the_first_position():
    p = torch.nn.functional.one_hot(torch.tensor([4]), V).float()
    assert verify_with_draft_probs(p, torch.empty(0, V), []) == Verdict(0, [4])


def test_the_wrapper_is_the_batched_rule_on_one_row():
    p, q, draft = dist(11, 4), dist(12, 3), [2, 0, 5]
    for seed in range(10):
        verdict = verify_with_draft_probs(p, q, draft, torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed)
        num, extra = _verify_rows(p[None], q[None], torch.tensor([draft]), g, None)
        assert verdict == Verdict(int(num[0]), draft[: int(num[0])] + [int(extra[0])])


# --- statistics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k, seed", [(1, 1), (3, 3)])
def test_emitted_tokens_follow_the_target_distribution(k, seed):
    p, q = dist(seed, k + 1), dist(seed + 100, k)
    g = torch.Generator().manual_seed(seed)
    draft = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], dim=1)
    num, extra = _verify_rows(p.expand(N, -1, -1), q.expand(N, -1, -1), draft, g, None)
    # The first draft token is accepted with probability sum_x min(p, q) = 1 - TV(p, q): 5 sigma.
    rate, expected = float((num >= 1).double().mean()), float(torch.minimum(p[0], q[0]).sum())
    assert abs(rate - expected) < 5 * math.sqrt(expected * (1 - expected) / N)
    for j in range(k + 1):  # every draft position, then the bonus
        tokens = emitted_at(j, num, draft, extra)
        assert tokens.numel() >= MIN_SAMPLES, (j, tokens.numel())
        assert chi2(tokens, p[j]) < CHI2_CRITICAL, j


def test_point_mass_drafts_without_logits_keep_the_target_distribution():
    # Drafts without logits (the drafter's argmax, say) checked against a sampled target: q = one-hot.
    p = dist(5, 3)
    draft = [int(p[0].argmax()), 1]
    q = point_mass_probs(draft, V)
    g = torch.Generator().manual_seed(5)
    num, extra = _verify_rows(p.expand(N, -1, -1), q.expand(N, -1, -1), torch.tensor(draft).expand(N, -1), g,
                              None)
    tokens = emitted_at(0, num, torch.tensor(draft).expand(N, -1), extra)
    assert chi2(tokens, p[0]) < CHI2_CRITICAL


# --- threshold (TensorRT-LLM: a constant in place of the random draw, accept iff p(x) > t * q(x)) --

def two_rows(p_x: float, q_x: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft rows with p(0) = p_x, q(0) = q_x, the rest spread evenly; then a bonus row."""
    p = torch.tensor([[p_x] + [(1 - p_x) / (V - 1)] * (V - 1), [1 / V] * V])
    q = torch.tensor([[q_x] + [(1 - q_x) / (V - 1)] * (V - 1)])
    return p, q


@pytest.mark.parametrize("p_x, q_x, threshold, accepted", [
    (0.3, 0.5, 0.5, True),    # p/q = 0.6 > 0.5
    (0.3, 0.5, 0.7, False),   # p/q = 0.6 < 0.7
    (0.25, 0.5, 0.5, False),  # p/q == threshold: rejected, the comparison is strict
    (0.8, 0.2, 1.0, True),    # p/q > 1 passes any threshold
    (0.3, 0.5, 0.05, True),
])
def test_constant_threshold_bounds_p_over_q_deterministically(p_x, q_x, threshold, accepted):
    p, q = two_rows(p_x, q_x)
    for seed in range(20):
        verdict = verify_with_draft_probs(p, q, [0], torch.Generator().manual_seed(seed), threshold=threshold)
        assert verdict.num_accepted == int(accepted)
        assert (verdict.tokens[0] == 0) if accepted else (verdict.tokens[0] != 0)


def test_threshold_one_rejects_q_equal_p_and_falls_back_to_p():
    # p/q = 1 is not > 1; the residual max(0, p - q) is empty, so the correction is drawn from p.
    p = torch.nn.functional.one_hot(torch.tensor([2, 3]), V).float()
    assert verify_with_draft_probs(p, p[:1].clone(), [2], threshold=1.0) == Verdict(0, [2])


# --- draft logits ---------------------------------------------------------------------------------

def test_draft_probs_are_a_plain_softmax():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, float("-inf"), 3.0], [0.0] * V], dtype=torch.float16)
    probs = draft_probs_from_logits(logits)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits.float(), dim=-1))
    assert probs[0, 4] == 0


@pytest.mark.parametrize("logits, message", [
    (torch.zeros(V), r"draft_logits must be a 2-D float tensor \[k, vocab\], got shape \[6\]"),
    (torch.zeros(2, V, dtype=torch.long), r"draft_logits must be a 2-D float .* torch.int64"),
    (torch.tensor([[0.0, float("nan")]]), "must not hold NaN or \\+inf"),
    (torch.tensor([[0.0, float("inf")]]), "must not hold NaN or \\+inf"),
    (torch.tensor([[0.0, 1.0], [float("-inf")] * 2]), "every row needs at least one finite logit"),
])
def test_draft_logits_validation(logits, message):
    with pytest.raises(ValueError, match=message):
        draft_probs_from_logits(logits)


# --- validation -----------------------------------------------------------------------------------

def _nan_row(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, 0] = float("nan")
    return t


@pytest.mark.parametrize("change, message", [
    ({"target_probs": dist(0, 3)[0]}, r"target_probs must be a 2-D floating-point tensor, got shape \[6\]"),
    ({"target_probs": torch.ones(3, V, dtype=torch.long)}, "target_probs must be a 2-D floating-point"),
    ({"target_probs": dist(0, 2)}, r"target_probs must have shape \[3, vocab\] \(k = len\(draft\)\)"),
    ({"draft_probs": dist(1, 2)[:, :5]}, r"draft_probs must have shape \[2, 6\]"),
    ({"draft_probs": dist(1, 1)}, r"draft_probs must have shape \[2, 6\]"),
    ({"target_probs": _nan_row(dist(0, 3))}, "target_probs must be finite and non-negative"),
    ({"draft_probs": -dist(1, 2)}, "draft_probs must be finite and non-negative"),
    ({"target_probs": 2 * dist(0, 3)}, "target_probs: every row must sum to 1, one sums to 2"),
    ({"draft": [1, 6]}, r"draft token 6 is outside the vocabulary \[0, 6\)"),
    ({"draft": [1, -1]}, "draft token -1 is outside"),
    ({"draft": [1.0, 2]}, "draft must be a sequence of integer token ids"),
    ({"draft": 3}, "draft must be a sequence of integer token ids"),
    ({"threshold": 0.0}, r"threshold must be in \(0, 1\], got 0.0"),
    ({"threshold": 1.5}, r"threshold must be in \(0, 1\], got 1.5"),
    ({"threshold": float("nan")}, r"threshold must be in \(0, 1\], got nan"),
    ({"threshold": True}, r"threshold must be in \(0, 1\], got True"),
])
def test_verify_validation(change, message):
    kwargs = {"target_probs": dist(0, 3), "draft_probs": dist(1, 2), "draft": [1, 4]} | change
    with pytest.raises(ValueError, match=message):
        verify_with_draft_probs(**kwargs)


def test_point_mass_validation():
    with pytest.raises(ValueError, match="vocab_size must be a positive int, got 0"):
        point_mass_probs([0], 0)
    with pytest.raises(ValueError, match=r"draft token 7 is outside the vocabulary \[0, 6\)"):
        point_mass_probs([7], V)


# --- sampled rows without draft probabilities: the engine compares its own samples ---------------

def _compare_samples(draft_model: torch.Tensor, target_model: torch.Tensor, start: int, n: int,
                     fresh_draw_on_mismatch: bool, generator: torch.Generator) -> torch.Tensor:
    """The engine's rule for a sampled row (inflight.engine.speculation): a Markov target P and
    drafter Q over V tokens, a draft of 2 tokens from Q after token `start`; the target samples
    every position (t_j after the draft's first j tokens), the row emits t[:a + 1] with a =
    accepted_greedy(draft, t), and plain decoding supplies a second token if only one came.
    `fresh_draw_on_mismatch`: TensorRT-LLM's rule instead (the token at the mismatch redrawn),
    the biased variant this test must catch. Returns the first two emitted tokens [n, 2]."""
    def draw(rows):
        return torch.multinomial(rows, 1, generator=generator).squeeze(1)

    first = torch.full((n,), start)
    d1 = draw(draft_model[first])
    d2 = draw(draft_model[d1])
    t0, t1 = draw(target_model[first]), draw(target_model[d1])
    out0 = t0.clone()
    if fresh_draw_on_mismatch:
        out0 = torch.where(t0 == d1, t0, draw(target_model[first]))
    out1 = torch.where(t0 == d1, t1, draw(target_model[out0]))  # accepted d1: t1 is the next token
    del d2  # the second draft token only decides whether t2 is emitted, after these two
    return torch.stack([out0, out1], 1)


@pytest.mark.parametrize("fresh_draw", [False, True])
def test_comparing_samples_keeps_the_target_distribution(fresh_draw):
    """The joint law of the first two emitted tokens is p(x0) p(x1 | x0): Pearson's test over the
    V^2 = 36 cells, df = 35, alpha = 1e-3 (critical value 66.62); n = 40000, so a joint law at total
    variation 0.05 gives lambda >= n (2 delta)^2 = 400 (power ~1). TensorRT-LLM's redraw at a
    mismatch emits the draft token with probability p(d)(2 - p(d)): that variant must fail."""
    g = torch.Generator().manual_seed(11)
    target_model = 0.8 * torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1) + 0.2 / V
    draft_model = 0.8 * torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1) + 0.2 / V
    n, start = 40_000, 2
    pairs = _compare_samples(draft_model, target_model, start, n, fresh_draw, g)
    expected = (target_model[start][:, None] * target_model).reshape(-1).double() * n  # [V * V]
    counts = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    critical = 66.619  # chi-square, df = 35, upper 1e-3 quantile
    assert (statistic > critical) == fresh_draw, statistic
