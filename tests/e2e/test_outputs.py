"""Logits, log probs, perf metrics and num_return_sequences through a real server, in NVIDIA's
shapes (their values are checked against HF in tests/model/test_engine_outputs.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.test_nvidia_compat import PROMPT_IDS, stream_once, text_inputs, token_inputs

pytestmark = pytest.mark.e2e

VOCAB = 49152
TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
KV = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")


def test_streamed_sequences_with_logits_and_metrics_through_the_ensemble(server):
    flag = np.array([[True]])
    values = text_inputs(max_tokens=4, stream=flag, num_return_sequences=np.array([[2]], np.int32),
                         top_p=np.array([[0.9]], np.float32), seed=np.array([[5]], np.uint64),
                         exclude_input_in_output=flag, return_log_probs=flag, return_context_logits=flag,
                         return_generation_logits=flag, return_perf_metrics=flag)
    outputs = ["text_output", "sequence_index", "context_logits", "generation_logits", "output_log_probs",
               "cum_log_probs", *TIMES, *KV]
    results, errors, _ = stream_once(server, values, "ensemble", outputs)
    assert not errors, errors
    index = [int(r.as_numpy("sequence_index")[0][0]) for r in results]
    assert sorted(set(index)) == [0, 1]
    contexts = [(i, r.as_numpy("context_logits")) for i, r in zip(index, results)
                if r.as_numpy("context_logits") is not None]
    assert len(contexts) == 1 and contexts[0][0] == 0  # once, with the first sequence
    assert contexts[0][1].shape[0] == 1 and contexts[0][1].shape[2] == VOCAB
    for r in results:
        logits = r.as_numpy("generation_logits")
        if logits is not None:
            assert logits.shape[:2] == (1, 1) and logits.shape[3] == VOCAB and logits.dtype == np.float32
        times = [int(r.as_numpy(name)[0][0]) for name in TIMES]
        assert 0 < times[0] <= times[1] <= times[2] <= times[3], times
        new, reused, total = (int(r.as_numpy(name)[0][0]) for name in KV)
        assert total == new + reused and total > 0
    assert sum(r.as_numpy("generation_logits") is not None for r in results) >= 2


def test_greedy_logits_pick_the_tokens_of_tensorrt_llm(server):
    flag = np.array([[True]])
    values = token_inputs(PROMPT_IDS, output_len=4, return_context_logits=flag, return_generation_logits=flag,
                          end_id=np.array([[-1]], np.int32))
    results, errors, _ = stream_once(server, values, "tensorrt_llm",
                                     ["output_ids", "context_logits", "generation_logits"])
    assert not errors, errors
    [result] = results
    generated = result.as_numpy("output_ids")[0][0][len(PROMPT_IDS):].tolist()
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert context.shape == (1, len(PROMPT_IDS), VOCAB)
    assert generation.shape == (1, 1, 4, VOCAB)
    assert generation[0, 0].argmax(axis=-1).tolist() == generated
    assert int(context[0, -1].argmax()) == generated[0]


@pytest.mark.parametrize("stream", [False, True])
def test_two_sequences_through_the_bls_model(server, stream):
    values = text_inputs(max_tokens=4, stream=np.array([[stream]]), num_return_sequences=np.array([[2]], np.int32),
                         top_p=np.array([[0.9]], np.float32), seed=np.array([[9]], np.uint64),
                         exclude_input_in_output=np.array([[True]]))
    results, errors, _ = stream_once(server, values, "tensorrt_llm_bls", ["text_output", "sequence_index"])
    assert not errors, errors
    texts: dict[int, str] = {}
    for r in results:
        index = int(r.as_numpy("sequence_index")[0][0])
        texts[index] = texts.get(index, "") + r.as_numpy("text_output")[0].decode("utf-8")
    assert sorted(texts) == [0, 1] and all(texts.values())


def test_draft_tokens_are_verified_by_tensorrt_llm(server):
    """NVIDIA's draft-target request: draft_input_ids for the next step. A right draft and a wrong
    one give the greedy tokens of a request without a draft, and the counts say what passed."""
    flag, no_end = np.array([[True]]), np.array([[-1]], np.int32)
    outputs = ["output_ids", "total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate"]

    def generate(draft=None):
        extra = {} if draft is None else {"draft_input_ids": np.array([draft], np.int32)}
        values = token_inputs(PROMPT_IDS, output_len=6, end_id=no_end, return_perf_metrics=flag, **extra)
        results, errors, _ = stream_once(server, values, "tensorrt_llm", outputs)
        assert not errors, errors
        [result] = results
        counts = [float(result.as_numpy(name)[0][0]) for name in outputs[1:]]
        return result.as_numpy("output_ids")[0][0][len(PROMPT_IDS):].tolist(), counts

    want, counts = generate()
    assert counts == [0, 0, 0]
    assert generate(want[:4]) == (want, [4, 4, 1.0])
    assert generate([(t + 1) % VOCAB for t in want[:3]]) == (want, [3, 0, 0.0])
