"""The OpenAI-compatible frontend, end to end: a real frontend process in front of the session's
real tritonserver, driven by the official `openai` client (sync and async) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import time

import httpx
import openai
import pytest
import torch

from tests.e2e.conftest import Frontend
from tools import serve
from tools.local_server import free_ports

pytestmark = pytest.mark.e2e

CONVERSATION = [
    {"role": "system", "content": "You are a geography tutor. Answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what is the capital of Italy?"},
]
COUNT = "Count: 1, 2, 3, 4, 5,"  # greedy: " 6, 7, 8, 9, 10, ..."
USED = ("nv_trt_llm_kv_cache_block_metrics", "used")


def _post(frontend, path, body) -> httpx.Response:
    return httpx.post(frontend.url + path, json=body, timeout=120)


# ----- chat -----------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["ensemble"]


def test_multi_turn_chat_with_a_system_prompt_streamed_and_not(client, tokenizer):
    whole = client.chat.completions.create(model="ensemble", messages=CONVERSATION, max_tokens=24,
                                           temperature=0)
    [choice] = whole.choices
    assert "Rome" in choice.message.content and choice.finish_reason == "stop"
    # Exact counts: the prompt as the model's own template renders it, and the engine's count.
    expected_prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    assert whole.usage.prompt_tokens == len(expected_prompt)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="ensemble", messages=CONVERSATION, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and len(deltas) > 3
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_async_client_seeded_sampling_streams_the_same_text(frontend):
    async def run():
        async with openai.AsyncOpenAI(base_url=frontend.url + "/v1", api_key="unused",
                                      max_retries=0) as aclient:
            params = dict(model="ensemble", messages=[{"role": "user", "content": "Name a colour."}],
                          max_completion_tokens=16, temperature=0.9, top_p=0.95, seed=11,
                          frequency_penalty=0.3, presence_penalty=0.2)
            whole = await aclient.chat.completions.create(**params)
            stream = await aclient.chat.completions.create(**params, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(run())
    assert whole and streamed == whole


def test_chat_log_probs_cover_the_answer(client):
    reply = client.chat.completions.create(model="ensemble", messages=[{"role": "user", "content": "Hi!"}],
                                           max_tokens=8, temperature=0, logprobs=True, top_logprobs=0)
    [choice] = reply.choices
    entries = choice.logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert "".join(e.token for e in entries) == choice.message.content
    assert all(e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in entries)


# ----- completions ----------------------------------------------------------------------------

def test_max_tokens_ends_with_length_and_counts_exactly(client, tokenizer):
    reply = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens == len(tokenizer.encode(COUNT))


def test_stop_strings_cut_the_text_and_never_leak(client):
    free = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=20,
                                     temperature=0).choices[0].text
    for stop in (" 7", ", 9,"):  # ", 9," straddles three tokens
        assert stop in free
        expected = free[:free.index(stop)]
        reply = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=20, temperature=0,
                                          stop=[stop, "never seen"])
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens < 20
        stream = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=20, temperature=0,
                                           stop=stop, stream=True)
        pieces = [c.choices[0].text for c in stream]
        assert "".join(pieces) == expected and all(stop not in p for p in pieces)


def test_n_choices_are_the_single_requests_with_seed_plus_index(client):
    params = dict(model="ensemble", prompt="Once upon a time", max_tokens=10, temperature=1.0)
    both = client.completions.create(**params, n=2, seed=5)
    assert [c.index for c in both.choices] == [0, 1]
    singles = [client.completions.create(**params, seed=seed).choices[0].text for seed in (5, 6)]
    assert [c.text for c in both.choices] == singles
    assert both.usage.completion_tokens == 20  # prompt counted once, both outputs


def test_response_format_json_schema_is_guided_decoding(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model="ensemble", messages=[{"role": "user", "content": "Capital of France, as JSON?"}],
        max_tokens=24, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    assert json.loads(reply.choices[0].message.content)["city"] in ("Paris", "Rome")
    assert reply.choices[0].finish_reason == "stop"  # the grammar ended it


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == COUNT + plain.choices[0].text


def test_token_id_prompts_generate_what_their_text_does(client, frontend, tokenizer):
    """A prompt sent as the ids the text encodes to gives the same greedy text; a batch of
    prompts (ids and ids) comes back with each choice's index; echo decodes the ids."""
    ids = tokenizer(COUNT)["input_ids"]
    plain = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=6, temperature=0)
    as_ids = client.completions.create(model="ensemble", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert as_ids.choices[0].text == tokenizer.decode(ids) + plain.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids) == plain.usage.prompt_tokens
    short = tokenizer("Count: 1,")["input_ids"]
    batch = client.completions.create(model="ensemble", prompt=[ids, short], max_tokens=4, temperature=0)
    by_index = {choice.index: choice.text for choice in batch.choices}
    assert by_index[0] == plain.choices[0].text[:len(by_index[0])] and set(by_index) == {0, 1}
    reply = _post(frontend, "/v1/completions",
                  {"model": "ensemble", "prompt": [1, 10 ** 9], "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def test_logit_bias_bans_and_forces_tokens(client, frontend, tokenizer):
    """OpenAI's logit_bias through the ensemble's embedding_bias_ids: -100 bans the greedy next
    token, +100 forces another; an id outside the vocabulary is a 400 naming logit_bias."""
    plain = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=1, temperature=0)
    greedy = tokenizer(plain.choices[0].text, add_special_tokens=False)["input_ids"][0]
    banned = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=1, temperature=0,
                                       logit_bias={str(greedy): -100})
    assert banned.choices[0].text != plain.choices[0].text
    forced_id = tokenizer(" Paris", add_special_tokens=False)["input_ids"][0]
    forced = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=2, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert tokenizer(forced.choices[0].text, add_special_tokens=False)["input_ids"] == [forced_id] * 2
    reply = _post(frontend, "/v1/completions",
                  {"model": "ensemble", "prompt": COUNT, "logit_bias": {str(10 ** 7): 1}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logit_bias"


def test_top_log_probs_are_sorted_and_head_with_the_greedy_token(client):
    """Chat top_logprobs and completions logprobs > 0 through the real engine: K alternatives
    per token, descending, the greedy token's own log prob first; streamed as whole."""
    ask = {"model": "ensemble", "messages": CONVERSATION[:2], "max_tokens": 5, "temperature": 0,
           "logprobs": True, "top_logprobs": 3}
    content = client.chat.completions.create(**ask).choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        values = [top.logprob for top in item.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True) and values[0] == item.logprob
        assert all(top.bytes == list(top.token.encode("utf-8")) for top in item.top_logprobs)
    streamed = [item for chunk in client.chat.completions.create(**ask, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for item in chunk.choices[0].logprobs.content]
    assert [[t.logprob for t in i.top_logprobs] for i in streamed] == [[t.logprob for t in i.top_logprobs]
                                                                      for i in content]
    reply = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=4, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 4
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == chosen


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, smollm2_dir, tokenizer):
    """What lm-evaluation-harness sends to score a continuation: a token-id prompt, echo,
    logprobs 1, max_tokens 1 (or 0). The prompt's log probs (the first null) equal transformers'
    fp32 log_softmax of the same model (the server computes in fp32 on the CPU), each with its
    top alternative, which is the greedy token; max_tokens 0 scores the prompt alone."""
    import transformers

    from tests.model.numerics import log_softmax_noise
    from tests.model.tolerances import fp32_noise_bound

    ids = tokenizer(COUNT)["input_ids"]
    reply = client.completions.create(model="ensemble", prompt=[ids], max_tokens=1, temperature=0,
                                      echo=True, logprobs=1)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None and reply.choices[0].text.startswith(tokenizer.decode(ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()  # [P, vocab]
    expected = torch.log_softmax(logits, dim=-1)
    config = hf.config
    for i in range(1, len(ids)):
        # A logit error e moves a log_softmax entry by at most 2e, then its own rounding.
        magnitude = float(logits[i - 1].abs().max())
        bound = (2 * fp32_noise_bound(config.num_hidden_layers, config.hidden_size, magnitude)
                 + log_softmax_noise(config.vocab_size, magnitude))
        assert abs(logprobs.token_logprobs[i] - float(expected[i - 1, ids[i]])) <= bound, (i, bound)
        [(_, top)] = logprobs.top_logprobs[i].items()
        assert abs(top - float(expected[i - 1].max())) <= bound
    scored = client.completions.create(model="ensemble", prompt=[ids], max_tokens=0, echo=True, logprobs=0)
    assert scored.usage.completion_tokens == 0 and len(scored.choices[0].logprobs.token_logprobs) == len(ids)
    assert scored.choices[0].logprobs.token_logprobs[1:] == logprobs.token_logprobs[1:len(ids)]


def test_completion_log_probs_one_per_generated_token(client):
    reply = client.completions.create(model="ensemble", prompt=COUNT, max_tokens=5, temperature=0, logprobs=0)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 5 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == reply.choices[0].text


def test_raw_sse_ends_with_done(frontend):
    body = {"model": "ensemble", "prompt": COUNT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", frontend.url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


# ----- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]},
     404, "model"),
    ("/v1/completions", {"model": "ensemble", "prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "ensemble", "prompt": "Hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"model": "ensemble", "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}],
                              "top_logprobs": 5}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "ensemble", "messages": [{"role": "wizard", "content": "Hi"}]},
     400, "messages.0.role"),
    # Refused by the engine itself (prompt + max_tokens beyond the context), streamed or not.
    ("/v1/completions", {"model": "ensemble", "prompt": "Hi " * 300, "max_tokens": 8000}, 400, None),
    ("/v1/completions", {"model": "ensemble", "prompt": "Hi " * 300, "max_tokens": 8000, "stream": True},
     400, None),
])
def test_bad_requests_get_openai_errors(frontend, path, body, status, param):
    reply = _post(frontend, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def side_frontends(smollm2_dir, tmp_path_factory):
    """A frontend whose Triton is down, and one whose tokenizer has no chat template."""
    plain = tmp_path_factory.mktemp("no_template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, plain / name)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    [dead_port] = free_ports(1)
    down = Frontend(f"127.0.0.1:{dead_port}", ["--tokenizer", str(smollm2_dir)])
    no_template = Frontend(f"127.0.0.1:{dead_port}", ["--tokenizer", str(plain)])
    yield down.wait("/health/live"), no_template.wait("/health/live")
    down.stop()
    no_template.stop()


def test_triton_down_is_a_503(side_frontends):
    down, _ = side_frontends
    reply = _post(down, "/v1/completions", {"model": "ensemble", "prompt": "Hi"})
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "service_unavailable"
    assert httpx.get(down.url + "/health/ready").status_code == 503


def test_a_model_without_chat_template_is_a_400(side_frontends):
    _, no_template = side_frontends
    reply = _post(no_template, "/v1/chat/completions",
                  {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "no_chat_template"


# ----- cancellation ---------------------------------------------------------------------------

def _assert_freed_at_once(server, timeout_s: float = 5):
    """A 400-token answer takes ~10 s here: idle within a few seconds means it was cancelled."""
    metrics = server.wait_idle(timeout_s=timeout_s)
    assert metrics[USED] == 0, metrics
    before = server.metrics()[("nv_trt_llm_general_metrics", "iteration_counter")]
    time.sleep(0.5)
    assert server.metrics()[("nv_trt_llm_general_metrics", "iteration_counter")] == before


def test_a_client_leaving_mid_stream_frees_the_kv_blocks_at_once(server, frontend):
    body = {"model": "ensemble",
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}  # see the next test
    with httpx.stream("POST", frontend.url + "/v1/chat/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        [next(lines) for _ in range(6)]  # three events and their blank lines
        deadline = time.monotonic() + 5  # the gauges follow the engine every stats period
        while server.metrics()[USED] == 0:
            assert time.monotonic() < deadline, "the request's blocks never showed"
            time.sleep(0.05)
    _assert_freed_at_once(server)


def test_a_client_leaving_a_non_streamed_request_frees_the_kv_blocks_at_once(server, frontend):
    # ignore_eos: sampled at temperature 1, this prompt sometimes ends at its first token, before
    # any stats period could show its blocks (the flake this test once had).
    payload = json.dumps({"model": "ensemble", "prompt": "Write a very long story about a dragon.",
                          "max_tokens": 400, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", frontend.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 60
        while server.metrics()[USED] == 0:  # leave once the engine is generating for us
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    _assert_freed_at_once(server)


# ----- shutdown --------------------------------------------------------------------------------

def _refused_or_unready(url: str) -> bool:
    try:
        return httpx.get(url + "/health/ready", timeout=5).status_code == 503
    except httpx.TransportError:  # the listening socket is closed
        return True


def test_sigterm_drains_the_stream_in_flight(server):
    """SIGTERM (what `make serve` and supervisors send): the frontend stops taking requests and
    turns unready at once, the stream in flight still finishes whole, then the process exits."""
    handle = Frontend(server.grpc_url, ["--drain-timeout-s", "60"]).wait("/health/ready")
    body = {"model": "ensemble", "prompt": COUNT, "max_tokens": 16, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=120) as reply:
            lines = (line for line in reply.iter_lines() if line)
            events = [next(lines)]
            handle.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not _refused_or_unready(handle.url) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _refused_or_unready(handle.url)
            events += list(lines)
        assert handle.process.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        handle.stop()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ----- workers ---------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as f:
        return [int(p) for p in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _two_workers(server) -> tuple[Frontend, list[int]]:
    handle = Frontend(server.grpc_url, ["--workers", "2"]).wait("/health/ready")
    deadline = time.monotonic() + 60
    while len(_children(handle.process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return handle, _children(handle.process.pid)


def test_workers_share_the_port_and_stop_together_on_sigterm(server):
    handle, workers = _two_workers(server)
    try:
        assert len(workers) == 2
        body = {"model": "ensemble", "prompt": COUNT, "max_tokens": 4, "temperature": 0}

        async def four():
            async with httpx.AsyncClient(base_url=handle.url, timeout=60) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(4)))

        replies = asyncio.run(four())
        assert [r.status_code for r in replies] == [200] * 4
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        handle.process.send_signal(signal.SIGTERM)
        assert handle.process.wait(timeout=30) == 0
    finally:
        handle.stop()
    assert not any(_alive(pid) for pid in workers)


def test_a_dead_worker_stops_the_frontend_with_an_error(server):
    handle, workers = _two_workers(server)
    try:
        os.kill(workers[0], signal.SIGKILL)
        assert handle.process.wait(timeout=30) == 1
    finally:
        handle.stop()
    assert not any(_alive(pid) for pid in workers)


def test_a_worker_that_cannot_start_stops_the_frontend_with_an_error():
    """Triton unreachable: each worker gives up reading the model's parameters; the parent
    exits 1 rather than serving with fewer workers."""
    process = serve.start([sys.executable, "-m", "openai_frontend", "--workers", "2", "--port", "0",
                           "--triton-url", "127.0.0.1:1", "--triton-timeout-s", "1"])
    try:
        assert process.wait(timeout=60) == 1
    finally:
        serve.stop(process, timeout_s=5)
    left = []
    for proc in os.listdir("/proc"):
        try:
            with open(f"/proc/{proc}/cmdline", "rb") as f:
                if b"127.0.0.1:1\0" in f.read() and _alive(int(proc)):
                    left.append(proc)
        except (OSError, ValueError):
            continue
    assert not left
