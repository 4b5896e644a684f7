"""End to end through a real tritonserver: tokenizer → engine → detokenizer (SmolLM2, CPU)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

# Completions only (NVIDIA's default, false, echoes the prompt in non-streamed answers).
CHAT = {"apply_chat_template": True, "exclude_input_in_output": True}


def test_chat_prompt_answers_paris(server):
    result = server.stream({"text_input": "What is the capital of France?", "max_tokens": 24,
                            "stream": False, **CHAT})
    assert result.error is None, result.error
    assert len(result.texts) == 1
    assert "Paris" in result.text


@pytest.mark.parametrize("prompt", [
    "What is the capital of France?",
    "Write the numbers from 1 to 12, separated by spaces.",
    "Translate 'good morning, friend' into Chinese and Japanese.",
    "Reply with three emoji that describe the sea, then explain each.",
])
def test_streamed_chunks_concatenate_to_the_non_streamed_text(server, prompt):
    values = {"text_input": prompt, "max_tokens": 48, **CHAT}
    whole = server.stream({**values, "stream": False})
    streamed = server.stream({**values, "stream": True})
    assert whole.error is None and streamed.error is None
    assert len(streamed.texts) > 3  # really streamed, one delta per step
    assert streamed.text == whole.text
    assert "\ufffd" not in streamed.text


LOAD_PROMPTS = ["Write the numbers from 1 to 12, separated by spaces.",
                "Translate 'good morning, friend' into Chinese and Japanese.",
                "Reply with three emoji that describe the sea, then explain each.",
                "List five rivers of Europe with one fact each."]


def test_streams_under_load_keep_their_order_and_bytes(server):
    """32 streams at once (8 per prompt, one non-streamed answer per prompt in the same wave):
    every stream's chunks, concatenated in arrival order, equal the non-streamed text byte for
    byte. The detokenizer decodes each chunk in context (no state), so a chunk delivered out of
    order, twice, merged wrongly or dropped shows up as a different text. Copies of one prompt
    run in the same engine steps; fp32 batched rows of equal inputs compute alike."""
    values = [{"text_input": p, "max_tokens": 32, **CHAT} for p in LOAD_PROMPTS]
    jobs = [(i, True) for i in range(len(values)) for _ in range(8)] + [(i, False) for i in range(len(values))]
    results: dict[int, object] = {}

    def run(n):
        i, stream = jobs[n]
        results[n] = server.stream({**values[i], "stream": stream}, timeout_s=300)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=400)
    assert len(results) == len(jobs) and all(r.error is None for r in results.values())
    whole = {i: results[n].text for n, (i, stream) in enumerate(jobs) if not stream}
    for n, (i, stream) in enumerate(jobs):
        if stream:
            assert results[n].text == whole[i], (LOAD_PROMPTS[i], results[n].texts)
            # Only the end may hold an incomplete character: max_tokens can cut a multi-byte one.
            assert "\ufffd" not in results[n].text.rstrip("\ufffd")


def test_exclude_input_in_output_returns_only_the_completion(server):
    prompt = "The three most important inventions are"
    echoed = server.stream({"text_input": prompt, "max_tokens": 8, "stream": False,
                            "exclude_input_in_output": False})
    completion = server.stream({"text_input": prompt, "max_tokens": 8, "stream": False,
                                "exclude_input_in_output": True})
    assert echoed.text == prompt + completion.text
    assert not completion.text.startswith(prompt)


def test_optional_outputs(server):
    result = server.stream({"text_input": "Hello", "max_tokens": 5, "stream": False,
                            "exclude_input_in_output": True, "return_log_probs": True, "return_num_input_tokens": True,
                            "return_num_output_tokens": True, "temperature": 0.8, "top_p": 1.0, "seed": 7})
    assert result.error is None, result.error
    out = result.outputs[-1]
    assert out["num_input_tokens"].reshape(-1)[0] > 0
    num_output = int(out["num_output_tokens"].reshape(-1)[0])
    log_probs = out["output_log_probs"].reshape(-1)
    assert 0 < num_output <= 5 and len(log_probs) == num_output
    assert np.all(log_probs <= 0)
    # The same log probs summed in double then sent as float32, vs sent as float32 then summed in
    # float32: num_output + 1 roundings of at most eps/2 of the sum's magnitude each, both sides.
    noise = (num_output + 1) * float(np.finfo(np.float32).eps) * float(np.abs(log_probs).sum())
    assert out["cum_log_probs"].reshape(-1)[0] == pytest.approx(float(log_probs.sum()), abs=noise)


def test_seeded_sampling_is_reproducible(server):
    values = {"text_input": "Once upon a time", "max_tokens": 12, "stream": False,
              "temperature": 1.0, "top_p": 0.95, "seed": 1234}
    assert server.stream(values).text == server.stream(values).text


def test_stop_words_end_generation(server):
    values = {"text_input": "Count: 1, 2, 3, 4, 5,", "max_tokens": 30, "stream": False}
    free = server.stream(values).text
    assert " 7" in free
    stopped = server.stream({**values, "stop_words": [" 7"]}).text
    assert stopped.endswith(" 7") and len(stopped) < len(free)


def test_bad_words_and_embedding_bias_steer_generation(server, tokenizer):
    """Word lists and a bias (by words, or by token ids) reach the engine through the ensemble
    and the BLS model (preprocessing sends them to the engine only when they hold something)."""
    values = {"text_input": "Count: 1, 2, 3, 4, 5,", "max_tokens": 12, "stream": False,
              "exclude_input_in_output": True}
    free = server.stream(values).text
    assert free.startswith(" 6")
    six = tokenizer(" 6", add_special_tokens=False)["input_ids"]
    banned = ({"bad_words": [" 6"]},
              {"embedding_bias_words": [" 6"], "embedding_bias_weights": np.array([[-np.inf]], np.float32)},
              {"embedding_bias_ids": np.array([six], np.int32),
               "embedding_bias_weights": np.full((1, len(six)), -np.inf, np.float32)})
    for model in ("ensemble", "tensorrt_llm_bls"):
        for extra in banned:
            result = server.stream({**values, **extra}, model=model)
            assert result.error is None, (model, extra, result.error)
            assert " 6" not in result.text, (model, extra, result.text)


def test_top_log_probs_pass_through_the_ensemble_and_the_bls_model(server):
    """num_top_log_probs reaches the engine through both text models, and top_log_probs /
    top_log_prob_ids come back per streamed token, [1, 1, 1, K], descending."""
    values = {"text_input": "Count: 1, 2, 3, 4, 5,", "max_tokens": 3, "stream": True,
              "return_log_probs": True, "num_top_log_probs": np.array([[4]], np.int32)}
    for model in ("ensemble", "tensorrt_llm_bls"):
        result = server.stream(values, model=model)
        assert result.error is None, (model, result.error)
        chunks = [o for o in result.outputs if o.get("top_log_probs") is not None]
        assert len(chunks) == 3, model
        for out in chunks:
            top, ids = out["top_log_probs"], out["top_log_prob_ids"]
            assert top.shape == ids.shape == (1, 1, 1, 4) and top.dtype == np.float32
            assert list(top[0, 0, 0]) == sorted(top[0, 0, 0], reverse=True)
            assert top[0, 0, 0, 0] == out["output_log_probs"].reshape(-1)[-1]  # greedy: chosen first


def test_prompt_log_probs_pass_through_the_ensemble_and_the_bls_model(server):
    """return_prompt_log_probs: once per request, [1, P - 1] with its [1, P - 1, K] alternatives,
    each position's likeliest token no less likely than the prompt's own."""
    values = {"text_input": "Count: 1, 2, 3, 4, 5,", "max_tokens": 2, "stream": True,
              "return_prompt_log_probs": True, "num_top_log_probs": np.array([[2]], np.int32),
              "return_num_input_tokens": True}
    for model in ("ensemble", "tensorrt_llm_bls"):
        result = server.stream(values, model=model)
        assert result.error is None, (model, result.error)
        carrying = [o for o in result.outputs if o.get("prompt_log_probs") is not None]
        assert len(carrying) == 1, model
        out = carrying[0]
        num_prompt = int(out["num_input_tokens"].reshape(-1)[0])
        chosen, top = out["prompt_log_probs"], out["prompt_top_log_probs"]
        assert chosen.shape == (1, num_prompt - 1) and top.shape == (1, num_prompt - 1, 2)
        assert out["prompt_top_log_prob_ids"].shape == (1, num_prompt - 1, 2)
        # Both come from one log_softmax on the device: the top one is exactly no smaller.
        assert bool((chosen <= 0).all()) and bool((top[0, :, 0] >= chosen[0]).all())


def test_a_plain_request_ends_without_the_outputs_it_does_not_need(server):
    """preprocessing answers the pipeline without word lists, bias or decoder inputs
    (preprocessing.step_outputs): each request still ends, streamed or not, over gRPC and HTTP,
    with the same text, and leaves nothing in the engine. A direct call gets every output."""
    import tritonclient.http as httpclient

    from ensemble.wiring import PREPROCESSING_TO_ENGINE

    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    try:
        query = [httpclient.InferInput("QUERY", [1, 1], "BYTES"),
                 httpclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")]
        query[0].set_data_from_numpy(np.array([[b"Hello"]], dtype=object))
        query[1].set_data_from_numpy(np.array([[4]], np.int32))
        every = client.infer("preprocessing", query).get_response()["outputs"]
        asked = [httpclient.InferRequestedOutput(name) for name in PREPROCESSING_TO_ENGINE]
        short = client.infer("preprocessing", query, outputs=asked).get_response()["outputs"]
    finally:
        client.close()  # an open HTTP connection would hold up the server's exit
    # NVIDIA's full answer (no prompt table id was sent; the multimodal outputs are never sent).
    assert {o["name"] for o in every} == set(PREPROCESSING_TO_ENGINE) - {"OUT_PROMPT_TABLE_EXTRA_IDS"}
    assert {o["name"] for o in short} == {"INPUT_ID", "REQUEST_INPUT_LEN", "REQUEST_OUTPUT_LEN", "OUT_END_ID",
                                          "OUT_PAD_ID"}

    values = {"text_input": "The three most important inventions are", "max_tokens": 8,
              "exclude_input_in_output": True}
    texts = []
    for model in ("ensemble", "tensorrt_llm_bls"):
        for stream in (False, True):
            result = server.stream({**values, "stream": stream}, model=model)
            assert result.error is None, (model, stream, result.error)
            texts.append(result.text)
    [single] = server.http_generate(values)
    events = server.http_generate({**values, "stream": True}, stream=True)
    texts += [single["text_output"], "".join(e["text_output"] for e in events)]
    assert texts[0] and texts == [texts[0]] * len(texts)
    metrics = server.wait_idle(timeout_s=10)
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0, metrics
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "used")] == 0, metrics


def test_http_generate_and_generate_stream(server):
    body = {"text_input": "What is the capital of France?", "max_tokens": 24, **CHAT}
    [single] = server.http_generate(body)
    assert "Paris" in single["text_output"]
    events = server.http_generate({**body, "stream": True}, stream=True)
    assert len(events) > 3 and all("error" not in e for e in events)
    assert "".join(e["text_output"] for e in events) == single["text_output"]


def test_cancelling_a_stream_stops_generation_and_frees_kv_blocks(server):
    client, results = server.open_stream()
    server.send(client, {"text_input": "Write a very long story about a dragon.", "max_tokens": 400,
                         "stream": True, **CHAT})
    first = results.get(timeout=60)
    assert first[1] is None
    time.sleep(0.5)
    assert server.metrics()[("nv_trt_llm_request_metrics", "active")] == 1
    client.stop_stream(cancel_requests=True)
    client.close()
    metrics = server.wait_idle(timeout_s=10)
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0, metrics
    assert metrics[("nv_trt_llm_kv_cache_block_metrics", "free")] == \
        metrics[("nv_trt_llm_kv_cache_block_metrics", "max")]
    # It stopped early: the iteration counter no longer moves.
    before = server.metrics()[("nv_trt_llm_general_metrics", "iteration_counter")]
    time.sleep(0.5)
    assert server.metrics()[("nv_trt_llm_general_metrics", "iteration_counter")] == before
