"""tensorrt_llm_bls without Triton: text-level stop strings, accumulate_tokens, the request flow."""

from __future__ import annotations

import numpy as np
import pytest

from bls.pipeline import Pipeline, split_inputs
from bls.stop_strings import StopStrings
from ensemble.errors import InputError


@pytest.mark.parametrize("chunks, stops, expected", [
    (["Count: 1,", " 2,", " 3,"], [" 2"], ["Count: 1,", " 2"]),
    (["ab", "cd", "ef"], ["bcd"], ["ab", "cd"]),  # spans two chunks
    (["xx STO", "P yy"], ["STOP"], ["xx STO", "P"]),
    (["one", "two"], ["zzz"], ["one", "two"]),
    (["a STOP b"], ["b", "STOP"], ["a STOP"]),  # the earliest-ending match wins
])
def test_streamed_chunks_stop_right_after_the_stop_string(chunks, stops, expected):
    matcher = StopStrings(stops)
    sent = [matcher.feed(c) for c in chunks]
    assert [s for s in sent if s] == expected
    assert "".join(sent) == StopStrings(stops).truncate("".join(chunks))


def test_truncate_skips_the_prompt_part():
    assert StopStrings(["Paris"]).truncate("Where is Paris? In France. Paris!", 15) == \
        "Where is Paris? In France. Paris"


class FakeModels:
    """Preprocessing turns text into one id per character, the engine streams the prompt's ids
    back one by one, postprocessing decodes ids (with context) into characters."""

    def __init__(self, answer: str):
        self.answer = answer
        self.stopped = []
        self.engine_inputs = None

    def infer(self, model, inputs, outputs):
        if model == "preprocessing":
            ids = [ord(c) for c in inputs["QUERY"].reshape(-1)[0].decode()]
            return {"INPUT_ID": np.array([ids], np.int32), "REQUEST_INPUT_LEN": np.array([[len(ids)]], np.int32),
                    "REQUEST_OUTPUT_LEN": inputs["REQUEST_OUTPUT_LEN"]}
        tokens, lengths = inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"].reshape(-1)
        rows = tokens.reshape(len(lengths), -1)
        return {"OUTPUT": np.array(["".join(map(chr, r[:n])).encode() for r, n in zip(rows, lengths)],
                                   dtype=object)}

    def stream(self, model, inputs, outputs, request_id):
        self.engine_inputs = inputs
        streaming = bool(inputs.get("streaming", np.array([[False]])).reshape(-1)[0])
        ids = [ord(c) for c in self.answer]
        chunks = [[i] for i in ids] if streaming else [list(inputs["input_ids"][0]) + ids]
        for n, chunk in enumerate(chunks):
            if request_id in self.stopped:
                return
            yield {"output_ids": np.array([[chunk]], np.int32), "sequence_length": np.array([[len(chunk)]], np.int32),
                   "cum_log_probs": np.array([[-1.0]], np.float32)}

    def stop(self, model, request_id):
        self.stopped.append(request_id)


def _request(text="Hi", stream=False, **extra):
    inputs = {"text_input": np.array([[text.encode()]], dtype=object), "max_tokens": np.array([[8]], np.int32),
              "stream": np.array([[stream]])}
    inputs.update(extra)
    return inputs


def _texts(responses):
    return [r["text_output"][0].decode() for r in responses]


def test_inputs_go_where_the_ensemble_sends_them():
    pre, engine = split_inputs(_request(top_k=np.array([[3]], np.int32), length_penalty=np.array([[1.0]], np.float32)))
    assert set(pre) == {"QUERY", "REQUEST_OUTPUT_LEN"}
    assert set(engine) == {"streaming", "runtime_top_k", "len_penalty"}
    with pytest.raises(InputError, match="image inputs are not supported"):
        split_inputs(_request(image_url_input=np.array([[b"http://x"]], dtype=object)))


def test_streaming_sends_deltas_and_passes_engine_outputs_through():
    models = FakeModels(" Paris.")
    responses = list(Pipeline(models).run(_request(stream=True), "r1"))
    assert "".join(_texts(responses)) == " Paris."
    assert all(r["cum_log_probs"].shape == (1, 1) for r in responses)
    assert models.engine_inputs["streaming"].reshape(-1)[0]


def test_accumulate_tokens_sends_the_whole_text_each_time():
    responses = list(Pipeline(FakeModels("abc"), accumulate_tokens=True).run(_request(stream=True), "r"))
    assert _texts(responses) == ["a", "ab", "abc"]


def test_a_stop_string_ends_the_stream_and_stops_the_engine():
    models = FakeModels(" 1, 2, 3, 4")
    words = np.array([[b" 3"]], dtype=object)
    responses = list(Pipeline(models).run(_request(stream=True, stop_words=words), "r2"))
    assert "".join(_texts(responses)) == " 1, 2, 3"
    assert models.stopped == ["r2"]


def test_non_streamed_answer_is_cut_after_the_stop_string_but_not_in_the_prompt():
    words = np.array([[b"Paris"]], dtype=object)
    [response] = Pipeline(FakeModels(" Paris. Paris.")).run(_request("Paris?", stop_words=words), "r")
    assert _texts([response]) == ["Paris? Paris"]


def test_streaming_needs_a_decoupled_model():
    with pytest.raises(InputError, match="not decoupled"):
        list(Pipeline(FakeModels("a"), decoupled=False).run(_request(stream=True), "r"))


def test_a_cancelled_client_stops_the_engine_request():
    models = FakeModels("abcdef")
    calls = iter([False, True])
    responses = list(Pipeline(models).run(_request(stream=True), "r3", lambda: next(calls, True)))
    assert _texts(responses) == ["a"] and models.stopped == ["r3"]


class BeamModels(FakeModels):
    """The engine streams two beams, each whole so far (TensorRT-LLM's beam streaming)."""

    def stream(self, model, inputs, outputs, request_id):
        beams = [[ord(c) for c in text] for text in self.answer]
        for n in range(1, max(map(len, beams)) + 1):
            if request_id in self.stopped:
                return
            rows = [b[:n] + [0] * (n - len(b[:n])) for b in beams]
            yield {"output_ids": np.array([rows], np.int32),
                   "sequence_length": np.array([[len(b[:n]) for b in beams]], np.int32)}


def test_streamed_beams_are_whole_texts_cut_at_stop_strings():
    beam_width = {"beam_width": np.array([[2]], np.int32)}
    responses = list(Pipeline(BeamModels(["abc", "xyz"])).run(_request(stream=True, **beam_width), "b1"))
    assert [[t.decode() for t in r["text_output"]] for r in responses] == \
        [["a", "x"], ["ab", "xy"], ["abc", "xyz"]]
    models = BeamModels(["a,bc", "x,yz"])
    words = np.array([[b","]], dtype=object)
    responses = list(Pipeline(models).run(_request(stream=True, stop_words=words, **beam_width), "b2"))
    assert [t.decode() for t in responses[-1]["text_output"]] == ["a,", "x,"] and models.stopped == ["b2"]
