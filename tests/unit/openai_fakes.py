"""Stand-ins for the OpenAI frontend's unit tests: a tokenizer with a toy chat template and a
Triton client that streams fixed pieces (the e2e tests use the real ones)."""

from __future__ import annotations

import asyncio

from tritonclient.grpc import service_pb2

from openai_frontend.sampling import Limits
from openai_frontend.triton_client import EngineChunk, EngineRequest, classify

LIMITS = Limits(context_length=256)
SAME_TEXT_IDS = {9: "é", 12: "é"}  # two ids of one text, as BPE vocabularies have


class FakeTokenizer:
    """Renders `<role>content` per message then `<assistant>`; a word is a token, numbered by
    its length. Decoding gives token n back as n letters w, but 9 and 12 are both "é"."""

    chat_template = "fake"

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        return [len(word) for word in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(SAME_TEXT_IDS.get(i, "w" * i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict=True,
                            sanitize_control_tokens=False, tools=None):
        assert add_generation_prompt and tokenize and not return_dict and sanitize_control_tokens
        self.rendered = (messages, tools)  # what the template was given, for the tests to read
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return [len(word) for word in text.split()]


class FakeTriton:
    """Answers every request with `pieces` (one chunk each, log prob -0.5 per token) and, when
    asked for top log probs, the first num_top_log_probs of `alternatives` for every token. Asked
    for the prompt's log probs, its first chunk carries `prompt_log_probs(P)` and as many rows of
    the same alternatives."""

    ALTERNATIVES = ((5, -0.25), (9, -1.0), (6, -2.0), (12, -3.0), (7, -4.0))  # (id, log prob), sorted

    def __init__(self, pieces=("Hel", "lo", " wor", "ld", "!"), error: str | None = None):
        self.pieces = pieces
        self.error = error
        self.requests: list[EngineRequest] = []
        self.num_closed = 0
        self.num_sent = 0

    async def check_ready(self, fresh=False):
        pass

    @staticmethod
    def prompt_log_probs(num_prompt_tokens: int) -> list[float]:
        return [-0.125 * (i + 1) for i in range(num_prompt_tokens - 1)]

    async def generate(self, request: EngineRequest, request_id: str = ""):
        self.requests.append(request)
        try:
            for i, text in enumerate(self.pieces[:request.max_tokens]):
                await asyncio.sleep(0)
                if self.error and i == 2:
                    raise classify(self.error)
                self.num_sent += 1
                top = [list(self.ALTERNATIVES[:request.num_top_log_probs])] if request.num_top_log_probs else None
                prompt = prompt_top = None
                if request.return_prompt_log_probs and i == 0:
                    prompt = self.prompt_log_probs(len(request.prompt_ids))
                    prompt_top = top and top * len(prompt)
                yield EngineChunk(text, [-0.5] if request.return_log_probs else None, 7, i + 1, top,
                                  prompt, prompt_top)
        finally:
            self.num_closed += 1


def stream_response(outputs) -> service_pb2.ModelInferResponse:
    """A streamed response of the ensemble: (name, datatype, shape, raw bytes) per output."""
    return service_pb2.ModelInferResponse(
        outputs=[service_pb2.ModelInferResponse.InferOutputTensor(name=n, datatype=d, shape=s)
                 for n, d, s, _ in outputs],
        raw_output_contents=[raw for *_, raw in outputs])
