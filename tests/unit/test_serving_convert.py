"""The Triton-free halves of the engine adapter: tensors ↔ executor types, pbtxt parameters."""

from __future__ import annotations

import numpy as np
import pytest

from ensemble import params as pbtxt
from ensemble.io_contract import CANCEL_KEY_PREFIX
from inflight.api.config import CapacitySchedulerPolicy, ConfigError
from inflight.api.features import EngineFeatures
from inflight.api.types import FinishReason, RequestError, RequestPerfMetrics, Response, Result
from inflight.serving import convert, params


def _inputs(**values):
    base = {"input_ids": np.array([[5, 6, 7, 0]], dtype=np.int32),
            "input_lengths": np.array([[3]], dtype=np.int32),
            "request_output_len": np.array([[4]], dtype=np.int32)}
    base.update({k: np.asarray(v) for k, v in values.items()})
    return base


def test_request_rows_maps_nvidia_tensors_to_executor_fields():
    rows, options = convert.request_rows(_inputs(
        end_id=np.array([2], dtype=np.int32), temperature=np.array([0.7], dtype=np.float32),
        runtime_top_k=np.array([5], dtype=np.int32), runtime_top_p=np.array([0.9], dtype=np.float32),
        seed=np.array([42], dtype=np.uint64), min_length=np.array([3], dtype=np.int32),
        streaming=np.array([True]), return_log_probs=np.array([True]),
        stop_words_list=np.array([[[11, 12, 13], [2, 3, -1]]], dtype=np.int32)),
        decoupled=True, default_exclude_input=True)
    [request] = rows
    assert request.input_token_ids == [5, 6, 7]
    assert request.max_tokens == 4 and request.end_id == 2 and request.streaming
    sc = request.sampling_config
    assert (sc.temperature, sc.top_k, sc.seed, sc.min_tokens) == (float(np.float32(0.7)), 5, 42, 3)
    assert request.stop_words == [[11, 12], [13]]
    assert request.output_config.exclude_input_from_output and request.output_config.return_log_probs
    assert options.streaming and options.batch_size == 1


def test_batch_rows_become_separate_requests_with_their_own_lengths():
    inputs = _inputs(input_ids=np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int32),
                     input_lengths=np.array([[3], [2]], dtype=np.int32),
                     request_output_len=np.array([[4], [4]], dtype=np.int32))
    rows, options = convert.request_rows(inputs, decoupled=True, default_exclude_input=False)
    assert [r.input_token_ids for r in rows] == [[5, 6, 7], [8, 9]]
    assert options.batch_size == 2


@pytest.mark.parametrize("values, decoupled, message", [
    ({"streaming": np.array([True])}, False, "Streaming is only supported if model is deployed using decoupled mode"),
    ({"request_output_len": np.array([[0]], dtype=np.int32)}, True, "must be > 0"),
    ({"input_lengths": np.array([[9]], dtype=np.int32)}, True, "input_lengths is 9"),
    ({"runtime_top_p": np.array([1.5], dtype=np.float32)}, True,
     "runtime_top_p (the ensemble's top_p) must be in (0, 1], got 1.5"),
    ({"temperature": np.array([-1.0], dtype=np.float32)}, True, "temperature must be >= 0"),
    ({"temperature": np.array([np.nan], dtype=np.float32)}, True, "temperature must be a finite number"),
    ({"runtime_top_p": np.array([-np.inf], dtype=np.float32)}, True,
     "runtime_top_p (the ensemble's top_p) must be a finite number, got -inf"),
    ({"runtime_top_p": np.array([np.nan], dtype=np.float32)}, True,
     "runtime_top_p (the ensemble's top_p) must be a finite number, got nan"),
    ({"runtime_top_k": np.array([-2], dtype=np.int32)}, True, "runtime_top_k (the ensemble's top_k) must be >= 0"),
    ({"len_penalty": np.array([-2.0], dtype=np.float32)}, True,
     "len_penalty (the ensemble's length_penalty) must be >= 0"),
    ({"beam_width": np.array([4], dtype=np.int32)}, True,
     "beam_width 4 exceeds max_beam_width (1)"),
    ({"beam_width": np.array([-1], dtype=np.int32)}, True, "beam_width must be > 0, got -1"),
    ({"runtime_top_p_decay": np.array([0.5], dtype=np.float32)}, True, "runtime_top_p_decay 0.5 is not supported"),
    ({"runtime_top_p_decay": np.array([1.5], dtype=np.float32)}, True, "runtime_top_p_decay must be in (0, 1]"),
    ({"num_return_sequences": np.array([2], dtype=np.int32)}, False,
     "num_return_sequences > 1 requires the tensorrt_llm model to use the decoupled transaction policy"),
    ({"guided_decoding_guide_type": np.array([[b"json"]], dtype=object)}, True,
     "guided decoding (guided_decoding_guide_type) is off in this model: set the tensorrt_llm "
     "parameters guided_decoding_backend (xgrammar) and tokenizer_dir"),
    ({"guided_decoding_guide": np.array([[b"[0-9]+"]], dtype=object)}, True,
     "guided_decoding_guide needs a guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": np.array([[b"yaml"]], dtype=object)}, True,
     "guided_decoding_guide_type must be one of json, json_schema, regex, ebnf_grammar, got yaml"),
    ({"lora_task_id": np.array([[3]], dtype=np.uint64)}, True, "LoRA (lora_task_id) is off in this model"),
    ({"lora_weights": np.zeros((1, 2, 4), dtype=np.float16)}, True, "need a lora_task_id"),
    ({"prompt_embedding_table": np.zeros((1, 2, 4), dtype=np.float16)}, True,
     "input 'prompt_embedding_table': prompt tuning (p-tuning) is not supported by this engine"),
    ({"draft_logits": np.zeros((1, 2, 4), dtype=np.float32)}, True,
     "draft_logits need the draft_input_ids they are for"),
    ({"lookahead_window_size": np.array([[7]], dtype=np.int32)}, True,
     "can only be set if the model instance lookahead parameters are also specified"),
    ({"retention_token_range_starts": np.array([[0]], dtype=np.int32)}, True,
     "retention_token_range_ends must be provided."),
    ({"retention_token_range_starts": np.array([[0]], dtype=np.int32),
      "retention_token_range_ends": np.array([[4, 8]], dtype=np.int32),
      "retention_token_range_priorities": np.array([[50]], dtype=np.int32)}, True,
     "Invalid retention_token_range_ends length. Expected length 1, got length 2"),
    ({"stop_words_list": np.array([[[11, 12], [5, -1]]], dtype=np.int32)}, True, "offsets past the end"),
])
def test_bad_tensors_raise_a_clear_request_error(values, decoupled, message):
    with pytest.raises(RequestError, match=None) as info:
        convert.request_rows(_inputs(**values), decoupled=decoupled, default_exclude_input=False)
    assert message in str(info.value)


def test_missing_input_ids_and_batch_without_decoupled():
    inputs = _inputs()
    del inputs["input_ids"]
    with pytest.raises(RequestError, match="A value is required for input_ids"):
        convert.request_rows(inputs, decoupled=True, default_exclude_input=False)
    batch = _inputs(input_ids=np.zeros((2, 3), dtype=np.int32), input_lengths=np.array([[3], [3]]))
    with pytest.raises(RequestError, match="decoupled"):
        convert.request_rows(batch, decoupled=False, default_exclude_input=False)


def test_streamed_responses_carry_the_preceding_tokens_as_context():
    options = convert.RequestOptions(streaming=True, return_log_probs=True, batch_size=2)
    row = convert.RowState(batch_index=1, options=options, request_key=9)
    sent = []
    for chunk in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]):
        result = Result(output_token_ids=[chunk], log_probs=[[-0.5] * len(chunk)], cum_log_probs=[-1.0])
        sent.append(convert.response_tensors(Response(1, result), row))
    assert sent[0]["stream_context_ids"].shape == (1, 1, 0)
    assert sent[1]["stream_context_ids"].reshape(-1).tolist() == [1, 2, 3]
    assert sent[2]["stream_context_ids"].reshape(-1).tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    assert sent[2]["output_ids"].shape == (1, 1, 1)
    assert sent[2]["batch_index"].item() == 1 and sent[2]["request_key"].item() == 9
    assert sent[1]["output_log_probs"].shape == (1, 1, 7)


def test_each_sequence_streams_in_its_own_context():
    options = convert.RequestOptions(streaming=True, num_return_sequences=2)
    row = convert.RowState(batch_index=0, options=options)
    sent = [convert.response_tensors(Response(1, Result(output_token_ids=[chunk], sequence_index=index)), row)
            for index, chunk in ((0, [1, 2]), (1, [7]), (0, [3]), (1, [8, 9]))]
    assert [s["stream_context_ids"].reshape(-1).tolist() for s in sent] == [[], [], [1, 2], [7]]
    assert [s["sequence_index"].item() for s in sent] == [0, 1, 0, 1]


def test_engine_logits_become_nvidia_shapes():
    # The engine's tensors ([prompt_len, vocab], [beam 1, steps, vocab]; numpy stands in for torch).
    options = convert.RequestOptions()
    result = Result(is_final=True, output_token_ids=[[5, 6]], context_logits=np.ones((4, 11), np.float64),
                    generation_logits=np.zeros((1, 2, 11), np.float32))
    out = convert.response_tensors(Response(1, result), convert.RowState(0, options))
    assert out["context_logits"].shape == (1, 4, 11) and out["context_logits"].dtype == np.float32
    assert out["generation_logits"].shape == (1, 1, 2, 11) and out["generation_logits"].dtype == np.float32


def test_parameters_follow_nvidia_keys_and_ignore_unfilled_templates():
    config = {"parameters": {
        "batch_scheduler_policy": {"string_value": "max_utilization"},
        "enable_kv_cache_reuse": {"string_value": "true"},
        "max_tokens_in_paged_kv_cache": {"string_value": "${max_tokens_in_paged_kv_cache}"},
        "kv_cache_free_gpu_mem_fraction": {"string_value": "0.5"},
        "max_num_sequences": {"string_value": "8"},
        "dtype": {"string_value": ""},
    }, "dynamic_batching": {"default_queue_policy": {"max_queue_size": 0}}}
    values = pbtxt.read_parameters(config)
    assert "max_tokens_in_paged_kv_cache" not in values and "dtype" not in values
    executor_config = params.executor_config(values, pbtxt.queue_size(config))
    assert executor_config.scheduler_config.capacity_scheduler_policy is CapacitySchedulerPolicy.MAX_UTILIZATION
    assert executor_config.kv_cache_config.enable_block_reuse
    assert executor_config.kv_cache_config.free_gpu_memory_fraction == 0.5
    assert executor_config.max_batch_size == 8 and executor_config.max_queue_size is None


@pytest.mark.parametrize("key, value, message", [
    ("gpt_model_type", "bogus", "Invalid gpt_model_type"),
    ("batch_scheduler_policy", "fastest", "unknown batch_scheduler_policy"),
    ("enable_chunked_context", "maybe", "must be true or false"),
    ("kv_cache_free_gpu_mem_fraction", "1.5", "must be in (0, 1]"),
    ("max_num_tokens", "lots", "must be an integer"),
])
def test_bad_parameters_fail_with_the_key_named(key, value, message):
    with pytest.raises(ConfigError) as info:
        params.executor_config({key: value})
    assert message in str(info.value)


def test_cancel_key_prefix_round_trips():
    assert int(f"{CANCEL_KEY_PREFIX}17"[len(CANCEL_KEY_PREFIX):]) == 17
    assert FinishReason.CANCELLED.name == "CANCELLED"


def test_operator_limits_on_prompt_and_output_length():
    limits = convert.RequestLimits(max_input_len=2, max_output_len=3)
    with pytest.raises(RequestError, match=r"the prompt has 3 tokens, more than max_input_len \(2\)"):
        convert.request_rows(_inputs(), True, False, limits)
    limits = convert.RequestLimits(max_input_len=8, max_output_len=3)
    with pytest.raises(RequestError, match=r"max_tokens\) is 4, more than max_output_len \(3\)"):
        convert.request_rows(_inputs(), True, False, limits)


def test_tensorrtllm_backend_without_the_package_fails_with_one_clear_sentence():
    from inflight.hosts.backend import BackendUnavailable, create_executor

    with pytest.raises(BackendUnavailable) as info:
        create_executor("tensorrtllm", "unused", params.executor_config({}))
    assert str(info.value) == ("executor_backend is 'tensorrtllm' but the tensorrt_llm package is not "
                               "installed; install TensorRT-LLM or set the executor_backend parameter "
                               "to 'builtin'")
    with pytest.raises(BackendUnavailable, match="unknown executor_backend 'vllm'"):
        create_executor("vllm", "unused", params.executor_config({}))


def test_responses_have_nvidia_shapes_beams_padded_with_minus_one():
    options = convert.RequestOptions(return_log_probs=True, exclude_input=True, num_return_sequences=2)
    row = convert.RowState(batch_index=0, options=options)
    result = Result(is_final=True, output_token_ids=[[5, 6, 7], [8]], cum_log_probs=[-1.0, -2.0],
                    log_probs=[[-0.1, -0.2, -0.7], [-2.0]], sequence_index=1,
                    context_logits=np.zeros((3, 11), np.float32),
                    generation_logits=np.zeros((2, 3, 11), np.float32),
                    request_perf_metrics=RequestPerfMetrics(arrival_time_ns=10, kv_cache_reused_blocks=2))
    out = convert.response_tensors(Response(1, result), row)
    assert out["output_ids"].tolist() == [[[5, 6, 7], [8, -1, -1]]]
    assert out["sequence_length"].tolist() == [[3, 1]]
    assert out["cum_log_probs"].shape == (1, 2) and out["output_log_probs"].shape == (1, 2, 3)
    assert out["context_logits"].shape == (1, 3, 11) and out["generation_logits"].shape == (1, 2, 3, 11)
    assert out["sequence_index"].tolist() == [[1]] and "batch_index" not in out
    assert out["arrival_time_ns"].dtype == np.int64 and out["kv_cache_reused_blocks"].tolist() == [[2]]
    assert out["acceptance_rate"].dtype == np.float32


def test_a_feature_the_engine_has_is_let_through():
    inputs = _inputs(return_perf_metrics=np.array([True]), beam_width=np.array([1], dtype=np.int32),
                     num_return_sequences=np.array([0], dtype=np.int32),
                     runtime_top_p=np.array([0.0], dtype=np.float32))
    with_metrics = EngineFeatures(perf_metrics=True)
    [request], options = convert.request_rows(inputs, decoupled=True, default_exclude_input=False,
                                              features=with_metrics)
    assert request.output_config.return_perf_metrics
    # NVIDIA's meanings: top_p <= 0 is "not set", num_return_sequences 0 is 1.
    assert request.sampling_config.top_p is None and options.num_return_sequences == 1
    assert request.sampling_config.is_greedy


def test_guided_decoding_inputs_become_the_rows_guide():
    guided = EngineFeatures(guided_decoding=True)
    inputs = _inputs(guided_decoding_guide_type=np.array([[b"regex"]], dtype=object),
                     guided_decoding_guide=np.array([[b"[0-9]+"]], dtype=object))
    [request], _ = convert.request_rows(inputs, True, False, features=guided)
    params = request.guided_decoding_params
    assert (params.guide_type, params.guide) == ("regex", "[0-9]+")
    # No type, or an empty one (NVIDIA's clients send ""), is no guide at all.
    for absent in ({}, {"guided_decoding_guide_type": np.array([[b""]], dtype=object)}):
        [request], _ = convert.request_rows(_inputs(**absent), True, False, features=guided)
        assert request.guided_decoding_params is None
    with pytest.raises(RequestError, match="guided_decoding_guide is required for guide type json_schema"):
        convert.request_rows(_inputs(guided_decoding_guide_type=np.array([[b"json_schema"]], dtype=object)),
                             True, False, features=guided)


@pytest.mark.parametrize("values, message", [
    ({"guided_decoding_backend": "outlines"},
     "unknown guided_decoding_backend 'outlines'; expected one of: xgrammar"),
    ({"guided_decoding_backend": "xgrammar"},
     "neither tokenizer_dir nor xgrammar_tokenizer_info_path is set"),
])
def test_guided_decoding_parameters_are_checked_at_load(values, message):
    with pytest.raises(ConfigError, match=message):
        params.executor_config(values)
    assert params.executor_config({}).guided_decoding_config is None  # unset: off, as NVIDIA's


def test_decoder_ids_retention_hints_and_prompt_table_ids_alone_are_accepted():
    inputs = _inputs(decoder_input_ids=np.array([[2]], dtype=np.int32),
                     decoder_input_lengths=np.array([[1]], dtype=np.int32),
                     prompt_table_extra_ids=np.array([[7, 7, 7]], dtype=np.uint64),
                     retention_token_range_starts=np.array([[0]], dtype=np.int32),
                     retention_token_range_ends=np.array([[-1]], dtype=np.int32),
                     retention_token_range_priorities=np.array([[80]], dtype=np.int32))
    [request], _ = convert.request_rows(inputs, decoupled=True, default_exclude_input=False)
    assert request.input_token_ids == [5, 6, 7]


def test_word_lists_and_guides_are_bounded_before_they_are_read():
    limits = convert.RequestLimits(max_num_words=2, max_guide_bytes=10)
    three = np.array([[[5, 6, 7], [1, 2, 3]]], dtype=np.int32)
    with pytest.raises(RequestError, match=r"stop_words_list has 3 words, more than max_num_words \(2\)"):
        convert.request_rows(_inputs(stop_words_list=three), True, False, limits)
    with pytest.raises(RequestError, match=r"bad_words_list has 3 words"):
        convert.request_rows(_inputs(bad_words_list=three), True, False, limits)
    two = np.array([[[5, 6, 7], [1, 3, -1]]], dtype=np.int32)
    [request], _ = convert.request_rows(_inputs(stop_words_list=two), True, False, limits)
    assert request.stop_words == [[5], [6, 7]]
    guide = {"guided_decoding_guide_type": np.array([[b"json_schema"]], dtype=object),
             "guided_decoding_guide": np.array([[b'{"type": "object"}']], dtype=object)}
    with pytest.raises(RequestError, match=r"guided_decoding_guide is 18 bytes, more than max_guide_bytes \(10\)"):
        convert.request_rows(_inputs(**guide), True, False, limits)
    assert convert.RequestLimits.from_params({"max_num_words": "9", "max_guide_bytes": "99"}) == \
        convert.RequestLimits(max_num_words=9, max_guide_bytes=99)


def test_top_log_probs_cross_the_wire_and_become_tensors():
    """num_top_log_probs reaches the row's OutputConfig; the K alternatives per token cross the
    engine-process boundary and go out as [1, beam, tokens, K] top_log_probs / _ids."""
    from inflight.serving import wire

    [request], _ = convert.request_rows(_inputs(num_top_log_probs=np.array([3], np.int32)), True, True)
    assert request.output_config.num_top_log_probs == 3
    with pytest.raises(RequestError, match="num_top_log_probs must be 0 to 20, got 21"):
        convert.request_rows(_inputs(num_top_log_probs=np.array([21], np.int32)), True, True)
    result = Result(output_token_ids=[[5, 6]], top_log_probs=[[[-0.1, -2.0], [-0.3, -1.5]]],
                    top_log_prob_ids=[[[5, 9], [6, 2]]])
    back = wire.response_from_wire(1, wire.unpack(wire.pack(wire.response_to_wire(Response(1, result))))).result
    assert (back.top_log_probs, back.top_log_prob_ids) == (result.top_log_probs, result.top_log_prob_ids)
    out = convert.response_tensors(Response(1, back), convert.RowState(0, convert.RequestOptions()))
    assert out["top_log_probs"].shape == (1, 1, 2, 2) and out["top_log_probs"].dtype == np.float32
    assert out["top_log_prob_ids"].tolist() == [[[[5, 9], [6, 2]]]]


def test_prompt_log_probs_cross_the_wire_and_become_tensors():
    from inflight.serving import wire

    [request], _ = convert.request_rows(_inputs(return_prompt_log_probs=np.array([True])), True, True)
    assert request.output_config.return_prompt_log_probs
    result = Result(output_token_ids=[[5]], prompt_log_probs=[-1.5, -0.25],
                    prompt_top_log_probs=[[-0.5, -1.5], [-0.25, -3.0]], prompt_top_log_prob_ids=[[7, 6], [5, 1]])
    back = wire.response_from_wire(1, wire.unpack(wire.pack(wire.response_to_wire(Response(1, result))))).result
    assert back.prompt_log_probs == [-1.5, -0.25] and back.prompt_top_log_prob_ids == [[7, 6], [5, 1]]
    out = convert.response_tensors(Response(1, back), convert.RowState(0, convert.RequestOptions()))
    assert out["prompt_log_probs"].tolist() == [[-1.5, -0.25]]
    assert out["prompt_top_log_probs"].shape == (1, 2, 2) and out["prompt_top_log_prob_ids"].dtype == np.int32
