"""Triton adapter of the tokenizer model (`preprocessing`).

Inputs/outputs: `ensemble.io_contract.PREPROCESSING` (NVIDIA's names, plus APPLY_CHAT_TEMPLATE
and ADD_SPECIAL_TOKENS). As NVIDIA's, it answers DECODER_INPUT_ID `[pad_id]` when no
DECODER_QUERY is given (the engine model ignores it for a decoder-only model); multimodal and
decoder inputs are refused, since the served model is a text-only decoder. The ensemble's step
and the BLS model get only the outputs that carry something (`preprocessing.step_outputs`).
Parameters: tokenizer_dir (required), add_special_tokens (default true), trust_remote_code
(default false). A bad request gets its own error; the rest of the dynamic batch carries on.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import lifeline, params
from ensemble.errors import InputError
from ensemble.io_contract import PREPROCESSING
from preprocessing import step_outputs
from preprocessing.tokenizer import TextTokenizer, decode_query

# Inputs of models this repository does not serve: refused by name when they hold anything.
_UNSUPPORTED = {
    "DECODER_QUERY": "decoder_text_input is for encoder-decoder models; this model is decoder-only",
    "IMAGE_BYTES": "image inputs are not supported: this model is text-only",
    "IMAGE_URL": "image inputs are not supported: this model is text-only",
    "VIDEO_BYTES": "video inputs are not supported: this model is text-only",
}


def _strings(tensor) -> list[list[str]]:
    """A [batch, N] BYTES tensor → per-row lists of words (empty entries dropped)."""
    if tensor is None:
        return []
    rows = tensor.as_numpy()
    rows = rows.reshape(rows.shape[0], -1) if rows.ndim > 1 else rows.reshape(1, -1)
    return [[decode_query(w) for w in row if len(w)] for row in rows]


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        values = params.read_parameters(json.loads(args["model_config"]))
        if "tokenizer_dir" not in values:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        self.tokenizer = TextTokenizer(values["tokenizer_dir"],
                                       add_special_tokens=params.get_bool(values, "add_special_tokens", True),
                                       trust_remote_code=params.get_bool(values, "trust_remote_code", False))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = self._process(request)
                if step_outputs.is_pipeline_request(request.requested_output_names()):
                    outputs = step_outputs.pipeline_outputs(outputs)
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor(name, value) for name, value in outputs.items()]))
            except InputError as exc:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
            except Exception as exc:  # one odd request must not fail the rest of the batch
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"preprocessing could not read this request: {type(exc).__name__}: {exc}",
                    pb_utils.TritonError.INVALID_ARG)))
        return responses

    def finalize(self):
        lifeline.skip_teardown_at_exit()

    def _process(self, request) -> dict:
        # One pass over the inputs: pb_utils.get_input_tensor_by_name walks them once per name
        # asked (15 names here).
        given = {tensor.name(): tensor for tensor in request.inputs()}

        def find(name):
            return given.get(PREPROCESSING.input(name).name)

        for name, reason in _UNSUPPORTED.items():
            tensor = find(name)
            values = tensor.as_numpy() if tensor is not None else np.zeros(0)
            # Empty strings are what clients send for "none" (NVIDIA's scripts do).
            if values.size and (values.dtype != np.object_ or any(len(v) for v in values.reshape(-1))):
                raise InputError(reason)
        queries = find("QUERY").as_numpy().reshape(-1)
        batch = len(queries)
        max_tokens = find("REQUEST_OUTPUT_LEN").as_numpy().reshape(batch, -1)
        if (max_tokens <= 0).any():
            raise InputError(f"max_tokens must be > 0, got {int(max_tokens.min())}")
        chat = find("APPLY_CHAT_TEMPLATE")
        chat = bool(chat.as_numpy().reshape(-1)[0]) if chat is not None else False
        special = find("ADD_SPECIAL_TOKENS")
        special = bool(special.as_numpy().reshape(-1)[0]) if special is not None else None
        ids = [self.tokenizer.encode(decode_query(q), apply_chat_template=chat, add_special_tokens=special)
               for q in queries]

        end_id = self._scalar_or(find, "END_ID", self.tokenizer.end_id, batch)
        pad_id = self._scalar_or(find, "PAD_ID", self.tokenizer.pad_id, batch)
        width = max(len(row) for row in ids)
        input_id = np.full((batch, width), pad_id[0, 0], dtype=np.int32)
        for b, row in enumerate(ids):
            input_id[b, :len(row)] = row

        bias_words = _strings(find("EMBEDDING_BIAS_WORDS"))
        bias_weights = find("EMBEDDING_BIAS_WEIGHTS")
        bias_weights = bias_weights.as_numpy().reshape(batch, -1) if bias_weights is not None else None
        biases = [self.tokenizer.embedding_bias(
                      bias_words[b] if b < len(bias_words) else [],
                      bias_weights[b].tolist() if bias_weights is not None else [])
                  for b in range(batch)]
        bias_width = max(len(b) for b in biases)
        embedding_bias = np.zeros((batch, bias_width), dtype=np.float32)
        for b, bias in enumerate(biases):
            embedding_bias[b, :len(bias)] = bias

        outputs = {
            "INPUT_ID": input_id,
            "REQUEST_INPUT_LEN": np.asarray([[len(row)] for row in ids], dtype=np.int32),
            "DECODER_INPUT_ID": pad_id.copy(),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), dtype=np.int32),
            "BAD_WORDS_IDS": self._words(find, "BAD_WORDS_DICT", batch),
            "STOP_WORDS_IDS": self._words(find, "STOP_WORDS_DICT", batch),
            "EMBEDDING_BIAS": embedding_bias,
            "REQUEST_OUTPUT_LEN": max_tokens.astype(np.int32),
            "OUT_END_ID": end_id,
            "OUT_PAD_ID": pad_id,
        }
        extra_id = find("PROMPT_TABLE_EXTRA_ID")
        if extra_id is not None:  # NVIDIA's: the id repeated for every prompt token
            extra = extra_id.as_numpy().reshape(batch, 1).astype(np.uint64)
            outputs["OUT_PROMPT_TABLE_EXTRA_IDS"] = np.repeat(extra, width, axis=1)
        return outputs

    def _scalar_or(self, find, name, default, batch) -> np.ndarray:
        tensor = find(name)
        if tensor is None:
            if default is None:
                raise InputError(f"{name} is required: the tokenizer defines no default")
            return np.full((batch, 1), default, dtype=np.int32)
        return tensor.as_numpy().reshape(batch, 1).astype(np.int32)

    def _words(self, find, name, batch) -> np.ndarray:
        rows = _strings(find(name))
        rows = rows + [[]] * (batch - len(rows))
        return self.tokenizer.word_list(rows)
