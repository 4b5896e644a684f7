"""Table-driven bad input, through the ensemble and straight to `tensorrt_llm`.

Each case must get one clear error naming the input and the rule, while good streams running
at the same time complete intact and unchanged: `GoodTraffic` keeps good streams in flight for
the whole module (each thread starts the next as soon as one ends), every case checks that some
were in flight when it sent its bad request, and every good stream must equal the reference.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

pytestmark = pytest.mark.e2e

GOOD = {"text_input": "What is the capital of France?", "max_tokens": 24, "stream": True,
        "apply_chat_template": True}
LONG_PROMPT = "word " * 9000  # more tokens than SmolLM2's 8192-token context


def _i32(*values):
    return np.array([list(values)], dtype=np.int32)


ENSEMBLE_CASES = [
    ("max_tokens zero", {"text_input": "Hi", "max_tokens": 0}, "request_output_len (max_tokens) must be > 0, got 0"),
    ("max_tokens negative", {"text_input": "Hi", "max_tokens": -5}, "(max_tokens) must be > 0, got -5"),
    ("max_tokens over the context", {"text_input": "Hi", "max_tokens": 100000},
     "exceeds the maximum sequence length"),
    ("max_tokens as FP32", {"text_input": "Hi", "max_tokens": np.array([[3.0]], dtype=np.float32)},
     "data-type is 'FP32', but model 'ensemble' expects 'INT32'"),
    ("text_input as INT32", {"text_input": _i32(3), "max_tokens": 4},
     "data-type is 'INT32', but model 'ensemble' expects 'BYTES'"),
    ("empty prompt", {"text_input": "", "max_tokens": 4}, "text_input is empty"),
    ("invalid UTF-8", {"text_input": b"\xff\xfe bad", "max_tokens": 4}, "text_input is not valid UTF-8"),
    ("prompt longer than the context", {"text_input": LONG_PROMPT, "max_tokens": 4},
     "more than max_input_len (8191) allows"),
    ("top_p above 1", {"text_input": "Hi", "max_tokens": 4, "top_p": 1.5},
     "runtime_top_p (the ensemble's top_p) must be in (0, 1], got 1.5"),
    ("NaN temperature", {"text_input": "Hi", "max_tokens": 4, "temperature": float("nan")},
     "temperature must be a finite number, got nan"),
    ("negative temperature", {"text_input": "Hi", "max_tokens": 4, "temperature": -0.5},
     "temperature must be >= 0"),
    ("negative top_k", {"text_input": "Hi", "max_tokens": 4, "top_k": -1},
     "runtime_top_k (the ensemble's top_k) must be >= 0"),
    ("beam_width 8", {"text_input": "Hi", "max_tokens": 4, "beam_width": 8},
     "beam_width 8 exceeds max_beam_width (4)"),
    ("beam_width -1", {"text_input": "Hi", "max_tokens": 4, "beam_width": -1}, "beam_width must be > 0"),
    ("repetition_penalty 0", {"text_input": "Hi", "max_tokens": 4, "repetition_penalty": 0.0},
     "repetition_penalty must be > 0"),
    ("negative min_tokens", {"text_input": "Hi", "max_tokens": 4, "min_tokens": -1},
     "min_tokens must be >= 0"),
    ("unknown input", {"text_input": "Hi", "max_tokens": 4, "bogus": 1}, "unexpected inference input 'bogus'"),
    ("stop_words as INT32", {"text_input": "Hi", "max_tokens": 4, "stop_words": _i32(5)},
     "data-type is 'INT32', but model 'ensemble' expects 'BYTES'"),
    ("bias words without weights", {"text_input": "Hi", "max_tokens": 4, "embedding_bias_words": ["a"]},
     "embedding_bias_words has 1 entries but embedding_bias_weights has 0"),
    ("bias weights mismatch", {"text_input": "Hi", "max_tokens": 4, "embedding_bias_words": ["a", "b"],
                               "embedding_bias_weights": np.array([[1.0]], dtype=np.float32)},
     "embedding_bias_words has 2 entries but embedding_bias_weights has 1"),
    ("end_id outside the vocabulary", {"text_input": "Hi", "max_tokens": 4, "end_id": 10**6},
     "end_id 1000000 is outside the vocabulary"),
    ("huge batch dimension", {"text_input": np.array([[b"Hi"]] * 1000, dtype=object),
                              "max_tokens": np.full((1000, 1), 4, dtype=np.int32),
                              "stream": np.zeros((1000, 1), dtype=np.bool_)},
     "batch-size must be <= 64"),
    ("two prompts in one row", {"text_input": np.array([[b"a", b"b"]], dtype=object), "max_tokens": 4},
     "unexpected shape for input 'text_input'"),
    ("return_log_probs as INT32", {"text_input": "Hi", "max_tokens": 4, "return_log_probs": _i32(1)},
     "data-type is 'INT32', but model 'ensemble' expects 'BOOL'"),
    # Issue 22's limits: each refused before the work it bounds, naming the limit and its value.
    ("a prompt over max_input_bytes", {"text_input": "x" * 300_000, "max_tokens": 4},
     "text_input is 300000 bytes, more than max_input_bytes (262112) allows"),
    ("num_return_sequences 10^6", {"text_input": "Hi", "max_tokens": 4, "num_return_sequences": 10**6},
     "num_return_sequences 1000000 exceeds max_batch_size (64)"),
    ("10,000 stop words", {"text_input": "Hi", "max_tokens": 4, "stop_words": ["w"] * 10_000},
     "stop_words has 10000 entries, more than max_num_words (256) allows"),
    ("a 1 MB guided-decoding schema", {"text_input": "Hi", "max_tokens": 4,
                                       "guided_decoding_guide_type": "json_schema",
                                       "guided_decoding_guide": '{"description": "' + "x" * (1 << 20) + '"}'},
     "more than max_guide_bytes (65536) allows"),
    ("neither text_input nor input_ids", {"max_tokens": 4},
     "send the prompt as text_input or as input_ids (exactly one of them)"),
    ("both text_input and input_ids", {"text_input": "Hi", "input_ids": _i32(1, 2), "max_tokens": 4},
     "exactly one of them"),
    ("input_ids past the vocabulary", {"input_ids": _i32(5, 10**6), "max_tokens": 4},
     "input_ids hold id 1000000, outside the vocabulary of 49152 tokens"),
]

ENGINE_BASE = {"input_ids": _i32(1, 2, 3), "input_lengths": _i32(3), "request_output_len": _i32(4)}
ENGINE_CASES = [
    ("input_ids missing", {"input_lengths": _i32(3), "request_output_len": _i32(4)},
     "A value is required for input_ids"),
    ("input_lengths past the ids", {**ENGINE_BASE, "input_lengths": _i32(7)}, "input_lengths is 7"),
    ("request_output_len zero", {**ENGINE_BASE, "request_output_len": _i32(0)}, "must be > 0"),
    ("token id outside the vocabulary", {**ENGINE_BASE, "input_ids": _i32(1, 99999, 3)},
     "outside the vocabulary of 49152 tokens"),
    ("stop words offsets past the end", {**ENGINE_BASE, "stop_words_list":
                                         np.array([[[5, 6], [4, -1]]], dtype=np.int32)},
     "offsets past the end"),
    ("bad words offsets decreasing", {**ENGINE_BASE, "bad_words_list":
                                      np.array([[[5, 6, 7], [2, 1, -1]]], dtype=np.int32)},
     "offsets must be strictly increasing"),
    ("embedding bias of the wrong size", {**ENGINE_BASE, "embedding_bias":
                                          np.ones((1, 5), dtype=np.float32)},
     "embedding_bias has 5 entries; expected 49152"),
    ("stop request without an id", {**ENGINE_BASE, "stop": np.array([[True]])},
     "A request id must be provided for request cancellation"),
    ("seed as FP32", {**ENGINE_BASE, "seed": np.array([[1.0]], dtype=np.float32)},
     "data-type is 'FP32', but model 'tensorrt_llm' expects 'UINT64'"),
]


@dataclass
class GoodStream:
    start_s: float
    end_s: float
    text: str
    error: str | None


class GoodTraffic:
    """`num_threads` threads each send GOOD streams back to back until stopped."""

    def __init__(self, server, num_threads: int = 3):
        self.server = server
        self.streams: list[GoodStream] = []
        self.cases: list[tuple[str, float, float]] = []  # (bad case, start_s, end_s)
        self.num_in_flight = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop) for _ in range(num_threads)]

    def _loop(self):
        while not self._stop.is_set():
            with self._lock:
                self.num_in_flight += 1
            start = time.monotonic()
            try:
                result = self.server.stream(GOOD)
            finally:
                with self._lock:
                    self.num_in_flight -= 1
            self.streams.append(GoodStream(start, time.monotonic(), result.text, result.error))

    def start(self) -> "GoodTraffic":
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 30
        while self.num_in_flight < len(self._threads):
            assert time.monotonic() < deadline, "good streams did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def run_case(self, name: str, send_bad) -> None:
        """Runs `send_bad` while good streams are in flight, and remembers when it ran."""
        deadline = time.monotonic() + 5  # a thread may be between two of its streams
        while self.num_in_flight == 0:
            assert time.monotonic() < deadline, "no good stream in flight"
            time.sleep(0.001)
        start = time.monotonic()
        try:
            send_bad()
        finally:
            self.cases.append((name, start, time.monotonic()))

    def check(self, reference: str) -> None:
        """Every good stream so far succeeded with the reference text; a failure names the bad
        cases that ran while it was in flight."""
        for stream in self.streams:
            if stream.error is None and stream.text == reference:
                continue
            culprits = [n for n, a, b in self.cases if a < stream.end_s and stream.start_s < b]
            raise AssertionError(f"a good stream broke while {culprits} ran: "
                                 f"error={stream.error!r} text={stream.text!r}")


@pytest.fixture(scope="module")
def good_reference(server):
    """GOOD's text computed alone. The good streams run three to a batch, which rounds
    differently; their greedy tokens still agree because this answer's top-1/top-2 logit margins
    (0.1 and up) are far above SmolLM2's batch noise (about 5e-4; tests/model/numerics.py)."""
    result = server.stream(GOOD)
    assert result.error is None and "Paris" in result.text
    return result.text


@pytest.fixture(scope="module")
def traffic(server, good_reference):
    traffic = GoodTraffic(server).start()
    yield traffic
    traffic.stop()
    traffic.check(good_reference)


@pytest.mark.parametrize("name, values, message", ENSEMBLE_CASES, ids=[c[0] for c in ENSEMBLE_CASES])
def test_bad_ensemble_input(server, traffic, name, values, message):
    def send_bad():
        result = server.stream({"stream": False, **values})
        assert result.error is not None, f"{name}: no error"
        assert message in result.error, result.error

    traffic.run_case(name, send_bad)


@pytest.mark.parametrize("name, values, message", ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
def test_bad_engine_input(server, traffic, name, values, message):
    def send_bad():
        result = server.stream(values, model="tensorrt_llm")
        assert result.error is not None, f"{name}: no error"
        assert message in result.error, result.error

    traffic.run_case(name, send_bad)


def test_missing_input_gets_a_clear_error_over_http(server, traffic):
    # text_input is optional (input_ids may stand in), so preprocessing names both; Triton's own
    # missing-input error never reached a gRPC stream (2.51 dropped it).
    def send_bad():
        [reply] = server.http_generate({"max_tokens": 5})
        assert "send the prompt as text_input or as input_ids" in reply["error"]

    traffic.run_case("missing text_input over HTTP", send_bad)


def test_good_streams_survive_every_bad_input(server, traffic, good_reference):
    traffic.stop()
    assert len(traffic.streams) >= 3
    traffic.check(good_reference)
    metrics = server.wait_idle()
    assert metrics[("nv_trt_llm_request_metrics", "active")] == 0
