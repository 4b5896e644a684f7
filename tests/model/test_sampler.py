"""Sampler: logits processors against direct per-row references, seeded reproducibility,
top-k / top-p truncation and log probs."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.sampling import Sampler, SamplingRow
from tests.model.numerics import elementwise_noise, frequency_bound, log_softmax_noise

VOCAB = 50


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=g) * 3.0


def reference_process(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Straightforward one-row implementation of the documented processing order."""
    out = logits.clone()
    if row.embedding_bias is not None:
        out = out + row.embedding_bias
    for tok in set(row.token_ids):
        if out[tok] > 0:
            out[tok] = out[tok] / row.repetition_penalty
        else:
            out[tok] = out[tok] * row.repetition_penalty
    generated = row.token_ids[row.num_prompt_tokens:]
    for tok in set(generated):
        out[tok] -= row.frequency_penalty * generated.count(tok) + row.presence_penalty
    for word in row.bad_words:
        prefix = word[:-1]
        if not prefix or row.token_ids[-len(prefix):] == prefix:
            out[word[-1]] = -math.inf
    if row.end_id is not None and len(generated) < row.min_tokens:
        out[row.end_id] = -math.inf
    return out


def penalised_rows() -> list[SamplingRow]:
    bias = torch.zeros(VOCAB)
    bias[[3, 4, 10]] = torch.tensor([5.0, -7.0, 2.5])
    return [
        SamplingRow(token_ids=[3, 4, 4, 5, 9, 9, 9, 11], num_prompt_tokens=4,
                    repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingRow(token_ids=[1, 2, 3, 7, 8], num_prompt_tokens=3,
                    bad_words=[[8, 20], [7, 21], [22], [2, 3, 23]], min_tokens=4, end_id=30),
        SamplingRow(token_ids=[3, 4, 10, 10], num_prompt_tokens=2, embedding_bias=bias,
                    repetition_penalty=2.0, frequency_penalty=1.0),
        SamplingRow(token_ids=[1, 2, 3, 7, 8, 9], num_prompt_tokens=3, min_tokens=3, end_id=30),
        SamplingRow(token_ids=[5], num_prompt_tokens=1),  # no processors at all
    ]


def test_processors_match_reference():
    rows = penalised_rows()
    logits = random_logits(len(rows))
    processed = Sampler.process_logits(logits, rows)
    for i, row in enumerate(rows):
        ref = reference_process(logits[i], row)
        # Both sides round the same <= 4 elementwise ops per logit, maybe in another order.
        magnitude = float(torch.cat([logits[i], ref[ref.isfinite()]]).abs().max())
        torch.testing.assert_close(processed[i], ref, atol=elementwise_noise(4, magnitude), rtol=0)
    # Spot checks of the semantics the reference encodes.
    assert processed[1, 20].item() == -math.inf  # tail [.., 8] matches bad word [8, 20]
    assert processed[1, 21].isfinite()  # [7, 21] needs the tail to end in 7
    assert processed[1, 22].item() == -math.inf  # single-token bad word
    assert processed[1, 30].item() == -math.inf  # 2 generated < min_tokens 4
    assert processed[3, 30].isfinite()  # 3 generated == min_tokens 3
    assert torch.equal(processed[4], logits[4])
    assert torch.equal(logits, random_logits(len(rows)))  # input left untouched


def test_greedy_sample_uses_processed_logits():
    rows = penalised_rows()
    logits = random_logits(len(rows), seed=1)
    # Make the penalised/banned tokens the raw argmax so the processors must change the answer.
    logits[1, 22] = 100.0
    logits[3, 30] = -1.0
    out = Sampler().sample(logits, rows)
    expected = [int(reference_process(logits[i], r).argmax()) for i, r in enumerate(rows)]
    assert out.token_ids == expected
    assert out.token_ids[1] != 22
    assert out.log_probs == [None] * len(rows)


def test_all_greedy_fast_path():
    logits = random_logits(4)
    rows = [SamplingRow(token_ids=[1, 2], num_prompt_tokens=2) for _ in range(4)]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def _random_row(seed: int | None, **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(token_ids=[1, 2, 3], num_prompt_tokens=3, generator=gen, **kw)


def _draw_sequence(seed: int, neighbours: int, steps: int = 6) -> list[int]:
    """Tokens a seeded row draws over `steps` steps, batched with `neighbours` other rows."""
    sampler = Sampler()
    target = _random_row(seed, temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.1)
    others = [_random_row(1000 + j, temperature=1.3) for j in range(neighbours)]
    others += [SamplingRow(token_ids=[4], num_prompt_tokens=1)]  # a greedy neighbour
    drawn = []
    for step in range(steps):
        logits = random_logits(1 + len(others), seed=step)
        rows = [target] + others if neighbours else [target]
        out = sampler.sample(logits[:len(rows)], rows)
        drawn.append(out.token_ids[0])
        target.token_ids.append(out.token_ids[0])
    return drawn


def test_seeded_sampling_reproducible_alone_and_batched():
    alone = _draw_sequence(seed=7, neighbours=0)
    assert alone == _draw_sequence(seed=7, neighbours=0)
    assert alone == _draw_sequence(seed=7, neighbours=3)
    assert alone == _draw_sequence(seed=7, neighbours=8)
    # Different seeds give different draws (6 draws from ~20 tokens: a collision is ~1e-8).
    assert alone != _draw_sequence(seed=8, neighbours=0)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_rows = 4000
    logits = probs.log().expand(num_rows, -1).contiguous()
    torch.manual_seed(0)
    rows = [_random_row(None, temperature=1.0) for _ in range(num_rows)]
    tokens = torch.tensor(Sampler().sample(logits, rows).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / num_rows
    for token, p in enumerate(probs.tolist()):
        assert abs(float(freq[token]) - p) <= frequency_bound(p, num_rows), (token, freq.tolist())


def test_top_k_one_equals_greedy():
    logits = random_logits(6, seed=3)
    rows = [_random_row(s, temperature=1.5, top_k=1) for s in range(6)]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def _sampled_set(probs: list[float], num_rows: int = 300, **kw) -> set[int]:
    logits = torch.tensor(probs).log().expand(num_rows, -1).contiguous()
    rows = [_random_row(s, temperature=1.0, **kw) for s in range(num_rows)]
    return set(Sampler().sample(logits, rows).token_ids)


def test_top_p_keeps_smallest_nucleus():
    probs = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    assert _sampled_set(probs, top_p=0.45) == {1}
    assert _sampled_set(probs, top_p=0.75) == {1, 3}
    assert _sampled_set(probs, top_p=0.85) == {1, 3, 2}
    assert _sampled_set(probs, top_p=1.0) == {0, 1, 2, 3}


def test_top_k_then_top_p():
    probs = [0.05, 0.5, 0.15, 0.3]
    assert _sampled_set(probs, top_k=3) == {1, 2, 3}
    # After top-k=2 the survivors renormalise to 0.625 / 0.375, so top_p=0.6 keeps only one.
    assert _sampled_set(probs, top_k=2, top_p=0.6) == {1}
    assert _sampled_set(probs, top_k=2, top_p=0.7) == {1, 3}


@pytest.mark.parametrize("with_penalty", [False, True])
def test_log_probs_match_log_softmax(with_penalty):
    penalty = dict(repetition_penalty=1.5, presence_penalty=0.3) if with_penalty else {}
    rows = [
        SamplingRow(token_ids=[1, 2, 3, 3], num_prompt_tokens=2, return_log_probs=True, **penalty),
        _random_row(11, temperature=0.7, return_log_probs=True, **penalty),
        _random_row(12, temperature=1.2, top_k=5, return_log_probs=True, **penalty),
        _random_row(13, temperature=1.0),  # did not ask
    ]
    logits = random_logits(len(rows), seed=5)
    out = Sampler().sample(logits, rows)
    for i, row in enumerate(rows):
        if not row.return_log_probs:
            assert out.log_probs[i] is None
            continue
        processed = reference_process(logits[i], row)
        temperature = row.temperature if row.temperature > 0 else 1.0
        expected = torch.log_softmax(processed / temperature, dim=-1)[out.token_ids[i]]
        finite = processed[processed.isfinite()]
        noise = log_softmax_noise(VOCAB, float(finite.abs().max()) / temperature)
        assert out.log_probs[i] == pytest.approx(float(expected), abs=noise)
    assert out.token_ids[0] == int(reference_process(logits[0], rows[0]).argmax())


def test_mismatched_rows_rejected():
    with pytest.raises(ValueError):
        Sampler().sample(random_logits(2), [SamplingRow(token_ids=[1], num_prompt_tokens=1)])


def test_tiny_temperature_is_greedy_and_long_bad_word_ignored():
    logits = random_logits(2, seed=9)
    rows = [_random_row(1, temperature=1e-7),
            SamplingRow(token_ids=[4], num_prompt_tokens=1, bad_words=[[1, 2, 3, 4, 5]])]
    processed = Sampler.process_logits(logits, rows)
    assert torch.equal(processed, logits)  # the bad word's prefix is longer than the history
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_top_log_probs_are_the_k_largest_of_the_same_distribution():
    """num_top_log_probs: per row its K most likely tokens' log probs, descending, from the
    distribution the chosen token's log prob comes from (processed logits over the
    temperature); the chosen token heads the list of a greedy row; rows that did not ask get
    None, and a row may ask for K without the chosen log prob."""
    rows = [
        SamplingRow(token_ids=[1, 2, 3], num_prompt_tokens=2, num_top_log_probs=3, return_log_probs=True,
                    repetition_penalty=1.5),
        _random_row(21, temperature=0.7, num_top_log_probs=5),
        _random_row(22, temperature=1.0),  # did not ask
    ]
    logits = random_logits(len(rows), seed=9)
    out = Sampler().sample(logits, rows)
    assert out.top_log_probs[2] is None
    for i in (0, 1):
        values, ids = out.top_log_probs[i]
        assert len(values) == len(ids) == rows[i].num_top_log_probs
        assert values == sorted(values, reverse=True)
        processed = reference_process(logits[i], rows[i])
        temperature = rows[i].temperature if rows[i].temperature > 0 else 1.0
        expected = torch.log_softmax(processed / temperature, dim=-1)
        noise = log_softmax_noise(VOCAB, float(processed[processed.isfinite()].abs().max()) / temperature)
        for value, token in zip(values, ids):
            assert value == pytest.approx(float(expected[token]), abs=noise)
        assert values[-1] >= float(expected.topk(len(values)).values[-1]) - noise  # none larger left out
    assert out.top_log_probs[0][1][0] == out.token_ids[0]  # greedy: the chosen token is the top one
    assert out.top_log_probs[0][0][0] == out.log_probs[0]
