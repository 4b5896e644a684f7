"""The BLS model's draft-target flow (`bls.speculative` through `bls.pipeline`) against fake
models: one id per character; the target continues any text with a fixed story (its greedy
answer, whatever the draft), and the draft guesses that story with some characters wrong. The
answer must be the target's, streamed or not, and each round must send the draft's guess as
`draft_input_ids`."""

from __future__ import annotations

import numpy as np
import pytest

from bls.pipeline import Pipeline
from ensemble.errors import InputError

STORY = "the cat sat on the mat and the dog sat on the log."
VOCAB = 128


def _next_chars(prompt: str, num: int, wrong_every: int = 0) -> str:
    """The story's next `num` characters after `prompt` (which starts with "Q:"); every
    `wrong_every`-th position replaced by '#' (a draft that is sometimes wrong)."""
    done = len(prompt) - len(prompt.split("|", 1)[0]) - 1  # characters already answered
    chars = list(STORY[done:done + num] if done >= 0 else STORY[:num])
    if wrong_every:
        chars = ["#" if (done + i) % wrong_every == 0 else c for i, c in enumerate(chars)]
    return "".join(chars)


class FakeModels:
    def __init__(self, end_after: int | None = None):
        self.calls: list[tuple[str, str, list[int]]] = []  # (model, sequence, draft ids)
        self.inputs: list[tuple[str, dict]] = []
        self.end_after = end_after  # the target's answer ends (end id) after this many characters

    def infer(self, model, inputs, outputs):
        if model == "preprocessing":
            ids = [ord(c) for c in inputs["QUERY"].reshape(-1)[0].decode() + "|"]
            return {"INPUT_ID": np.array([ids], np.int32),
                    "REQUEST_INPUT_LEN": np.array([[len(ids)]], np.int32),
                    "REQUEST_OUTPUT_LEN": inputs["REQUEST_OUTPUT_LEN"]}
        tokens, lengths = inputs["TOKENS_BATCH"], inputs["SEQUENCE_LENGTH"].reshape(-1)
        rows = tokens.reshape(len(lengths), -1)
        texts = ["".join(map(chr, r[:n])).encode() for r, n in zip(rows, lengths)]
        return {"OUTPUT": np.array(texts, dtype=object)}

    def stream(self, model, inputs, outputs, request_id):
        sequence = "".join(map(chr, inputs["input_ids"][0][:int(inputs["input_lengths"].reshape(-1)[0])]))
        num = int(inputs["request_output_len"].reshape(-1)[0])
        draft = inputs["draft_input_ids"].reshape(-1).tolist() if "draft_input_ids" in inputs else []
        self.calls.append((model, sequence, draft))
        self.inputs.append((model, inputs))
        answer = _next_chars(sequence, num, wrong_every=5 if model == "draft" else 0)
        if model == "tensorrt_llm" and self.end_after is not None:
            done = len(sequence) - sequence.index("|") - 1
            answer = answer[:max(0, self.end_after - done)]
        ids = [ord(c) for c in answer]
        out = {"output_ids": np.array([[ids]], np.int32), "sequence_length": np.array([[len(ids)]], np.int32)}
        if "return_generation_logits" in inputs:  # the drafted token 4.0 above the rest, +0.001 per id
            logits = np.tile(np.arange(VOCAB, dtype=np.float32) * 0.001, (len(ids), 1))
            logits[np.arange(len(ids)), ids] += 4.0
            out["generation_logits"] = logits[None, None]
        yield out

    def stop(self, model, request_id):
        pass


def _request(max_tokens: int, stream: bool = False, num_draft_tokens: int = 4, **extra):
    inputs = {"text_input": np.array([[b"Q:"]], dtype=object),
              "max_tokens": np.array([[max_tokens]], np.int32),
              "stream": np.array([[stream]]), "exclude_input_in_output": np.array([[True]]),
              "num_draft_tokens": np.array([[num_draft_tokens]], np.int32)}
    inputs.update(extra)
    return inputs


def _text(responses) -> str:
    return "".join(r["text_output"][0].decode() for r in responses)


@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_is_the_targets_and_every_round_sends_the_draft(stream):
    models = FakeModels()
    responses = list(Pipeline(models, draft_name="draft").run(_request(30, stream), "r1"))
    assert _text(responses) == STORY[:30]
    assert len(responses) == (len(models.calls) // 2 if stream else 1)  # a round: draft, then target
    drafts = [call for call in models.calls if call[0] == "draft"]
    targets = [call for call in models.calls if call[0] == "tensorrt_llm"]
    assert len(drafts) == len(targets) and all(len(t[2]) == 4 for t in targets[:-1])
    for (_, sequence, _), (_, target_sequence, sent) in zip(drafts, targets):
        assert target_sequence == sequence  # the target verifies what the draft continued
        assert sent == [ord(c) for c in _next_chars(sequence, len(sent), wrong_every=5)]


def test_the_last_round_is_cut_to_max_tokens_and_an_end_stops_the_rounds():
    models = FakeModels()
    assert _text(Pipeline(models, draft_name="draft").run(_request(7), "r")) == STORY[:7]
    assert [len(c[2]) for c in models.calls if c[0] == "tensorrt_llm"] == [4, 1]  # 5 + 2 tokens
    ended = FakeModels(end_after=12)
    assert _text(Pipeline(ended, draft_name="draft").run(_request(40), "r")) == STORY[:12]


def test_what_the_flow_refuses():
    with pytest.raises(InputError, match="needs a draft model"):
        list(Pipeline(FakeModels()).run(_request(8), "r"))
    with pytest.raises(InputError, match="beam search"):
        list(Pipeline(FakeModels(), draft_name="draft").run(_request(8, beam_width=np.array([[2]], np.int32)),
                                                            "r"))


@pytest.mark.parametrize("sampling, num_finite", [
    ({}, 1), ({"temperature": np.array([[0.5]], np.float32), "runtime_top_k": np.array([[3]], np.int32)}, 3)])
def test_use_draft_logits_sends_the_distribution_the_draft_drew_from(sampling, num_finite):
    """The draft's generation logits become draft_logits whose plain softmax (TensorRT-LLM's q) is
    the distribution the draft sampled from: greedy, all mass on its token (log 1 = 0, -inf
    elsewhere); temperature 0.5 with top-k 3, three finite entries whose softmax is that."""
    from ensemble.sampling_distribution import sampling_distribution

    models = FakeModels()
    inputs = _request(12, use_draft_logits=np.array([[True]]), **sampling)
    assert _text(Pipeline(models, draft_name="draft").run(inputs, "r")) == STORY[:12]
    sent = [(i["draft_input_ids"][0], i["draft_logits"][0]) for m, i in models.inputs
            if m == "tensorrt_llm" and "draft_logits" in i]
    assert sent
    for draft, logits in sent:
        assert logits.shape == (len(draft), VOCAB)
        assert (np.isfinite(logits).sum(-1) == num_finite).all()
        assert (logits.argmax(-1) == draft).all()
        if num_finite == 3:
            raw = np.tile(np.arange(VOCAB, dtype=np.float32) * 0.001, (len(draft), 1))
            raw[np.arange(len(draft)), draft] += 4.0
            want = sampling_distribution(raw, 0.5, 3)
            got = np.exp(logits - logits.max(-1, keepdims=True))
            # float32 log then exp: exp(x (1 + e)) is off by |x| e relatively, |x| <= ~17 here
            # (log of the smallest kept probability) and e one rounding (6e-8): 1e-6, bounded 10x.
            np.testing.assert_allclose(got / got.sum(-1, keepdims=True), want, rtol=1e-5, atol=1e-7)
