"""The malformed requests of `checks/reliability.py`: each with the words a clear error names.

An error is "clear" when it contains one of `expect` (the input's name, or the rule broken), so
a client can tell what to fix. gRPC cases go to the ensemble's stream (or `tensorrt_llm`'s);
HTTP cases to `/generate` or `/generate_stream` as JSON, or as raw bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Case:
    name: str
    protocol: str  # grpc | http
    values: dict
    expect: tuple[str, ...]
    model: str = "ensemble"
    http_path: str = "generate"
    raw: bytes | Callable[[], bytes] | None = None  # a callable builds a large body when sent

    def body(self) -> bytes:
        """The HTTP body: `raw` (built now if it is a callable), else `values` as JSON."""
        if callable(self.raw):
            return self.raw()
        return self.raw if self.raw is not None else json.dumps(self.values).encode()


BASE = {"text_input": "Hello", "max_tokens": 8}


def _sampling_cases() -> list[tuple[str, dict, tuple[str, ...]]]:
    """Out-of-range or non-finite sampling values (sent over both protocols)."""
    cases = []
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "length_penalty"):
        for bad in (NAN, INF, -INF):
            cases.append((f"{name}={bad}", {name: bad}, (name,)))
    cases += [
        ("temperature=-1", {"temperature": -1.0}, ("temperature",)),
        ("top_p=1.5", {"top_p": 1.5}, ("top_p",)),
        ("top_k=-1", {"top_k": -1}, ("top_k",)),
        ("repetition_penalty=0", {"repetition_penalty": 0.0}, ("repetition_penalty",)),
        ("repetition_penalty=-2", {"repetition_penalty": -2.0}, ("repetition_penalty",)),
        ("length_penalty=-1", {"length_penalty": -1.0}, ("length_penalty", "len_penalty")),
        ("min_tokens=-1", {"min_tokens": -1}, ("min_tokens",)),
        ("min_length=-5", {"min_length": -5}, ("min_tokens", "min_length")),
        ("max_tokens=0", {"max_tokens": 0}, ("max_tokens",)),
        ("max_tokens=-3", {"max_tokens": -3}, ("max_tokens",)),
        ("max_tokens=2^31-1", {"max_tokens": 2**31 - 1}, ("max_tokens",)),
        ("beam_width=-1", {"beam_width": -1}, ("beam_width",)),
        ("beam_width=5", {"beam_width": 5}, ("beam_width",)),  # max_beam_width is 4
        ("num_return_sequences=-2", {"num_return_sequences": -2}, ("num_return_sequences",)),
        ("end_id=-7", {"end_id": -7}, ("end_id",)),
        ("end_id=10^9", {"end_id": 10**9}, ("end_id",)),
        ("embedding_bias_weights=NaN", {"embedding_bias_words": ["Hello"],
                                        "embedding_bias_weights": NAN}, ("embedding_bias",)),
        ("embedding_bias_weights=inf", {"embedding_bias_words": ["Hello"],
                                        "embedding_bias_weights": INF}, ("embedding_bias",)),
        ("embedding_bias_weights without words", {"embedding_bias_weights": 1.0},
         ("embedding_bias",)),
        ("guided_decoding_guide_type=xml", {"guided_decoding_guide_type": "xml"},
         ("guided_decoding",)),
        ("guided_decoding_guide without type", {"guided_decoding_guide": "{}"}, ("guided_decoding",)),
        ("lora_task_id", {"lora_task_id": 3}, ("lora",)),
    ]
    return cases


def _grpc_only() -> list[Case]:
    one = np.ones((1, 1), dtype=np.int32)
    llm = "tensorrt_llm"
    return [
        Case("no text_input", "grpc", {"max_tokens": 8}, ("text_input",)),
        Case("no max_tokens", "grpc", {"text_input": "Hello"}, ("max_tokens",)),
        Case("text_input not UTF-8", "grpc", {"text_input": b"\xff\xfe\xfa", "max_tokens": 8},
             ("utf-8", "text_input", "QUERY")),
        Case("tensorrt_llm: input id past the vocabulary", "grpc",
             {"input_ids": np.array([[1, 10**8]], dtype=np.int32), "input_lengths": one * 2,
              "request_output_len": one * 4}, ("input_ids", "vocabulary"), llm),
        Case("tensorrt_llm: negative input id", "grpc",
             {"input_ids": np.array([[-5]], dtype=np.int32), "input_lengths": one,
              "request_output_len": one * 4}, ("input_token_ids", "input_ids"), llm),
        Case("tensorrt_llm: input_lengths 0", "grpc",
             {"input_ids": one, "input_lengths": one * 0, "request_output_len": one * 4},
             ("input_lengths",), llm),
        Case("tensorrt_llm: input_lengths past input_ids", "grpc",
             {"input_ids": one, "input_lengths": one * 9, "request_output_len": one * 4},
             ("input_lengths",), llm),
        Case("tensorrt_llm: no input_lengths", "grpc",
             {"input_ids": one, "request_output_len": one * 4}, ("input_lengths",), llm),
        Case("tensorrt_llm: no request_output_len", "grpc",
             {"input_ids": one, "input_lengths": one}, ("request_output_len",), llm),
        Case("tensorrt_llm: stop_words_list offsets past the end", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "stop_words_list": np.array([[[5, 6], [9, -1]]], dtype=np.int32)},
             ("stop_words_list", "word list"), llm),
        Case("tensorrt_llm: bad_words_list decreasing offsets", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "bad_words_list": np.array([[[5, 6, 7], [2, 1, -1]]], dtype=np.int32)},
             ("bad_words_list", "word list"), llm),
        Case("tensorrt_llm: stop word id past the vocabulary", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "stop_words_list": np.array([[[10**8], [1]]], dtype=np.int32)},
             ("stop_words", "vocabulary"), llm),
        Case("tensorrt_llm: embedding_bias of the wrong size", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "embedding_bias": np.ones((1, 7), dtype=np.float32)}, ("embedding_bias",), llm),
        Case("tensorrt_llm: embedding_bias NaN", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "embedding_bias": np.full((1, 49152), np.nan, dtype=np.float32)},
             ("embedding_bias",), llm),
        Case("tensorrt_llm: runtime_top_p_decay 0.5", "grpc",
             {"input_ids": one, "input_lengths": one, "request_output_len": one * 4,
              "runtime_top_p_decay": np.array([[0.5]], dtype=np.float32)}, ("top_p_decay",), llm),
        Case("tensorrt_llm: prompt too long for the model", "grpc",
             {"input_ids": np.ones((1, 9000), dtype=np.int32), "input_lengths": one * 9000,
              "request_output_len": one * 4}, ("maximum sequence length", "prompt"), llm),
    ]


def _http_only() -> list[Case]:
    return [
        Case("body not JSON", "http", {}, ("json", "parse"), raw=b"{not json"),
        Case("body a JSON list", "http", {}, ("json", "object", "parse"), raw=b"[1, 2]"),
        Case("max_tokens a string", "http", {"text_input": "Hi", "max_tokens": "many"},
             ("max_tokens",)),
        Case("top_p a string", "http", {**BASE, "top_p": "high"}, ("top_p",)),
        Case("unknown input", "http", {**BASE, "temprature": 0.5}, ("temprature",)),
        Case("empty body", "http", {}, ("text_input", "max_tokens", "json"), raw=b""),
        Case("stream to /generate_stream with NaN temperature", "http",
             {**BASE, "stream": True, "temperature": NAN}, ("temperature",),
             http_path="generate_stream"),
    ]


def _huge_body(num_bytes: int) -> Callable[[], bytes]:
    return lambda: b'{"text_input": "' + b"x" * num_bytes + b'", "max_tokens": 8}'


def _size_cases() -> list[Case]:
    """Issue 22: one request must not exhaust memory or hold everyone up. Each is refused before
    the work it bounds, naming the limit (ensemble.limits)."""
    schema = json.dumps({"type": "object", "description": "x" * (1 << 20)})
    return [
        Case("a 100 MB body to /generate", "http", {}, ("max_input_bytes",), raw=_huge_body(100 << 20)),
        Case("a 10 MB prompt", "grpc", {**BASE, "text_input": "x" * (10 << 20)}, ("max_input_bytes",)),
        Case("num_return_sequences=10^6", "grpc", {**BASE, "num_return_sequences": 10**6},
             ("num_return_sequences", "max_batch_size")),
        Case("num_return_sequences=2^31-1", "grpc", {**BASE, "num_return_sequences": 2**31 - 1},
             ("num_return_sequences", "max_batch_size")),
        Case("10,000 stop strings", "grpc", {**BASE, "stop_words": [f"w{i}" for i in range(10_000)]},
             ("max_num_words",)),
        Case("10,000 bad words", "grpc", {**BASE, "bad_words": [f"w{i}" for i in range(10_000)]},
             ("max_num_words",)),
        Case("a 1 MB guided-decoding schema", "grpc",
             {**BASE, "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema},
             ("max_guide_bytes",)),
        Case("tensorrt_llm: 10,000 stop words", "grpc",
             {"input_ids": np.ones((1, 1), dtype=np.int32), "input_lengths": np.ones((1, 1), dtype=np.int32),
              "request_output_len": np.full((1, 1), 4, dtype=np.int32),
              "stop_words_list": np.stack([np.stack([np.full(10_000, 5), np.arange(1, 10_001)])]).astype(np.int32)},
             ("max_num_words",), "tensorrt_llm"),
    ]


def _cases() -> list[Case]:
    cases = []
    for name, extra, expect in _sampling_cases():
        values = {**BASE, **extra}
        cases.append(Case(name, "grpc", values, expect))
        if not any(isinstance(v, float) and v != v for v in extra.values()) \
                and not any(v in (INF, -INF) for v in extra.values() if isinstance(v, float)):
            cases.append(Case(name, "http", values, expect))
    # JSON has no NaN or inf; Triton's parser takes the JavaScript spellings in bodies.
    for name in ("temperature", "repetition_penalty", "presence_penalty"):
        for spelling in ("NaN", "Infinity", "-Infinity"):
            raw = ('{"text_input": "Hello", "max_tokens": 8, "%s": %s}' % (name, spelling)).encode()
            cases.append(Case(f"{name}={spelling} (raw JSON)", "http", {}, (name, "json"), raw=raw))
    return cases + _grpc_only() + _http_only() + _size_cases()


CASES = _cases()
