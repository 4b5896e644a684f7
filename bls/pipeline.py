"""The `tensorrt_llm_bls` request flow: preprocessing → tensorrt_llm → postprocessing, in Python.

`run` takes one client request (the ensemble's inputs, as numpy arrays) and yields the client's
responses (`text_output` plus tensorrt_llm's pass-through outputs). It talks to the three models
only through a `Models` object, so the Triton adapter supplies BLS calls and tests supply fakes.

On top of what the ensemble does, as NVIDIA's BLS model does:
- stop strings are matched on the decoded text (`bls.stop_strings`); when every sequence has
  stopped, the engine request is stopped by its request id;
- `accumulate_tokens`: each streamed `text_output` is the whole text so far, not a delta.
Streamed chunks are decoded in context (the engine's `stream_context_ids`), exactly as in the
ensemble, so the concatenated deltas equal the non-streamed text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import numpy as np

from bls import speculative
from bls.stop_strings import StopStrings
from ensemble.errors import InputError
from ensemble.io_contract import ENGINE_PASS_THROUGH
from ensemble.wiring import ENGINE_TO_POSTPROCESSING, PREPROCESSING_TO_ENGINE, text_input_route

Tensors = dict[str, np.ndarray]
ENGINE_OUTPUTS = list(ENGINE_TO_POSTPROCESSING) + list(ENGINE_PASS_THROUGH)
# BLS-only inputs of features that need models this repository does not have.
_UNSUPPORTED = {
    "image_input": "image inputs are not supported: this model is text-only",
    "image_bytes_input": "image inputs are not supported: this model is text-only",
    "image_url_input": "image inputs are not supported: this model is text-only",
    "video_bytes_input": "video inputs are not supported: this model is text-only",
}


class Models(Protocol):
    def infer(self, model: str, inputs: Tensors, outputs: list[str]) -> Tensors:
        """One request, one response; raises InputError with the model's error message."""

    def stream(self, model: str, inputs: Tensors, outputs: list[str], request_id: str) -> Iterator[Tensors]:
        """Every response of a (possibly decoupled) request, until the final one."""

    def stop(self, model: str, request_id: str) -> None:
        """NVIDIA's `stop` request: the engine cancels the request with this id."""


@dataclass
class _Row:
    """What the BLS remembers about one (batch row, sequence) of the engine's answer."""

    stop_strings: list[str]
    beams: list[StopStrings] = field(default_factory=list)  # one matcher per beam
    tokens: list[int] = field(default_factory=list)  # accumulate_tokens: everything so far

    def matchers(self, num_beams: int) -> list[StopStrings]:
        while len(self.beams) < num_beams:
            self.beams.append(StopStrings(self.stop_strings))
        return self.beams[:num_beams]

    @property
    def stopped(self) -> bool:
        return bool(self.beams) and all(m.stopped for m in self.beams)


def _flag(inputs: Tensors, name: str) -> bool:
    value = inputs.get(name)
    return bool(value.reshape(-1)[0]) if value is not None and value.size else False


def _beam_width(inputs: Tensors) -> int:
    value = inputs.get("beam_width")
    return max(int(value.reshape(-1)[0]), 1) if value is not None and value.size else 1


def _words(value: np.ndarray | None, row: int) -> list[str]:
    if value is None or value.size == 0:
        return []
    words = value[min(row, value.shape[0] - 1)].reshape(-1)
    return [w.decode("utf-8") if isinstance(w, bytes) else str(w) for w in words]


def _num_sequences(engine_inputs: Tensors) -> int:
    value = engine_inputs.get("num_return_sequences")
    return max(1, int(value.reshape(-1)[0])) if value is not None and value.size else 1


def split_inputs(inputs: Tensors) -> tuple[Tensors, Tensors]:
    """Client inputs → (preprocessing inputs, tensorrt_llm inputs), by the ensemble's routes."""
    for name, reason in _UNSUPPORTED.items():
        if name in inputs and inputs[name].size:
            raise InputError(reason)
    pre, engine = {}, {}
    for name, value in inputs.items():
        if name in ("num_draft_tokens", "use_draft_logits"):
            continue
        model, step_input = text_input_route(name)
        (pre if model == "preprocessing" else engine)[step_input] = value
    return pre, engine


def _num_draft_tokens(inputs: Tensors) -> int:
    value = inputs.get("num_draft_tokens")
    return max(0, int(value.reshape(-1)[0])) if value is not None and value.size else 0


@dataclass
class Pipeline:
    models: Models
    engine_name: str = "tensorrt_llm"
    accumulate_tokens: bool = False
    decoupled: bool = True
    draft_name: str = ""  # tensorrt_llm_draft_model_name: num_draft_tokens > 0 runs bls.speculative

    def run(self, inputs: Tensors, request_id: str,
            is_cancelled: Callable[[], bool] = lambda: False) -> Iterator[Tensors]:
        streaming = _flag(inputs, "stream")
        if streaming and not self.decoupled:
            raise InputError("stream is true but the tensorrt_llm_bls model is not decoupled "
                             "(decoupled_mode: false): streaming needs a decoupled model")
        pre_inputs, engine_inputs = split_inputs(inputs)
        num_draft_tokens = _num_draft_tokens(inputs)
        if num_draft_tokens:
            if not self.draft_name:
                raise InputError("speculative decoding (num_draft_tokens > 0) needs a draft model, and this "
                                 "repository has none (tensorrt_llm_draft_model_name is not set)")
            speculative.check(engine_inputs)
        num_sequences = _num_sequences(engine_inputs)
        if num_sequences > 1 and not self.decoupled:
            raise InputError("num_return_sequences > 1 needs a decoupled tensorrt_llm_bls model "
                             "(decoupled_mode: true): each sequence is its own response")
        pre = self.models.infer("preprocessing", pre_inputs, list(PREPROCESSING_TO_ENGINE))
        engine_inputs.update((PREPROCESSING_TO_ENGINE[k], v) for k, v in pre.items()
                             if k in PREPROCESSING_TO_ENGINE)
        batch = pre["INPUT_ID"].shape[0]
        if num_draft_tokens:
            yield from self._speculate(inputs, engine_inputs, pre, streaming, num_draft_tokens)
            return
        stop_words = inputs.get("stop_words")
        rows: dict[tuple[int, int], _Row] = {}
        ended = False  # the engine request was stopped: drain its last responses unseen
        for out in self.models.stream(self.engine_name, engine_inputs, ENGINE_OUTPUTS, request_id):
            if ended:
                continue
            if is_cancelled():
                ended = True
                self.models.stop(self.engine_name, request_id)
                continue
            b = int(out["batch_index"].reshape(-1)[0]) if "batch_index" in out else 0
            s = int(out["sequence_index"].reshape(-1)[0]) if "sequence_index" in out else 0
            row = rows.setdefault((b, s), _Row(_words(stop_words, b)))
            if row.stopped:
                continue
            text = self._text(out, row, streaming, pre, b, inputs)
            yield {"text_output": text, **{k: v for k, v in out.items() if k in ENGINE_PASS_THROUGH}}
            if streaming and len(rows) == batch * num_sequences and all(r.stopped for r in rows.values()):
                ended = True  # NVIDIA's rule: stop the engine once every row has stopped
                self.models.stop(self.engine_name, request_id)

    def _text(self, out: Tensors, row: _Row, streaming: bool, pre: Tensors, b: int,
              inputs: Tensors) -> np.ndarray:
        """This response's `text_output`: one string per beam, stop strings applied."""
        tokens, lengths = out["output_ids"], out["sequence_length"]
        post_inputs = {"TOKENS_BATCH": tokens, "SEQUENCE_LENGTH": lengths}
        if streaming and self.accumulate_tokens and _beam_width(inputs) == 1:
            row.tokens += tokens[0, 0, :int(lengths.reshape(-1)[0])].tolist()
            post_inputs = {"TOKENS_BATCH": np.asarray([[row.tokens]], dtype=np.int32),
                           "SEQUENCE_LENGTH": np.asarray([[len(row.tokens)]], dtype=np.int32)}
        elif streaming:
            post_inputs.update((ENGINE_TO_POSTPROCESSING[k], v) for k, v in out.items()
                               if k in ENGINE_TO_POSTPROCESSING and k not in ("output_ids", "sequence_length"))
        texts = [t.decode("utf-8") for t in self._decode(post_inputs)]
        matchers = row.matchers(len(texts))
        # Streamed beams carry every token so far (TensorRT-LLM re-sends re-ranked beams whole).
        if streaming and (self.accumulate_tokens or _beam_width(inputs) > 1):
            texts = [m.truncate(t) for m, t in zip(matchers, texts)]
        elif streaming:
            texts = [m.feed(t) for m, t in zip(matchers, texts)]
        else:
            start = 0 if _flag(inputs, "exclude_input_in_output") else None
            if row.stop_strings and start is None:
                start = self._prompt_chars(pre, b)
            texts = [m.truncate(t, start or 0) for m, t in zip(matchers, texts)]
        return np.asarray([t.encode("utf-8") for t in texts], dtype=np.object_)

    def _speculate(self, inputs: Tensors, engine_inputs: Tensors, pre: Tensors, streaming: bool,
                   num_draft_tokens: int) -> Iterator[Tensors]:
        """`bls.speculative`'s rounds as responses: streamed, each round's new text (a trailing
        incomplete character waits for the next round); else one response per row."""
        flow = speculative.DraftTarget(self.models, self.engine_name, self.draft_name,
                                       _flag(inputs, "use_draft_logits"))
        batch = pre["INPUT_ID"].shape[0]
        tokens: dict[int, list[int]] = {b: [] for b in range(batch)}
        sent: dict[int, int] = dict.fromkeys(range(batch), 0)
        for b, new in flow.rows(engine_inputs, num_draft_tokens):
            tokens[b] += new
            if streaming:
                text = self._decode_ids(tokens[b]).rstrip("\ufffd")
                if len(text) > sent[b]:
                    yield self._row_text(text[sent[b]:], b, batch)
                    sent[b] = len(text)
        if not streaming:
            for b in range(batch):
                text = self._decode_ids(tokens[b])
                if not _flag(inputs, "exclude_input_in_output"):
                    length = int(pre["REQUEST_INPUT_LEN"].reshape(-1)[b])
                    text = self._decode_ids(pre["INPUT_ID"][b, :length].tolist() + tokens[b])
                yield self._row_text(text, b, batch)

    def _decode_ids(self, ids: list[int]) -> str:
        return self._decode({"TOKENS_BATCH": np.asarray([[ids]], dtype=np.int32),
                             "SEQUENCE_LENGTH": np.asarray([[len(ids)]], dtype=np.int32)})[0].decode("utf-8")

    @staticmethod
    def _row_text(text: str, b: int, batch: int) -> Tensors:
        out = {"text_output": np.asarray([text.encode("utf-8")], dtype=np.object_)}
        if batch > 1:
            out["batch_index"] = np.asarray([[b]], dtype=np.int32)
        return out

    def _decode(self, post_inputs: Tensors) -> np.ndarray:
        return self.models.infer("postprocessing", post_inputs, ["OUTPUT"])["OUTPUT"].reshape(-1)

    def _prompt_chars(self, pre: Tensors, b: int) -> int:
        """Length of the decoded prompt, where a non-streamed answer's generated text starts."""
        length = int(pre["REQUEST_INPUT_LEN"].reshape(-1)[b])
        ids = pre["INPUT_ID"][b:b + 1, :length]
        text = self._decode({"TOKENS_BATCH": ids[:, None, :],
                             "SEQUENCE_LENGTH": np.asarray([[length]], dtype=np.int32)})
        return len(text[0].decode("utf-8"))
