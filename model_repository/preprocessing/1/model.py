"""Triton adapter of the tokenizer model (`preprocessing`).

Inputs/outputs: `ensemble.io_contract.PREPROCESSING` (NVIDIA's names, plus APPLY_CHAT_TEMPLATE,
ADD_SPECIAL_TOKENS, PARSE_SPECIAL_TOKENS and QUERY_IDS: a prompt already tokenized, sent instead of
QUERY). As NVIDIA's, it answers DECODER_INPUT_ID `[pad_id]` when no
DECODER_QUERY is given (the engine model ignores it for a decoder-only model); multimodal and
decoder inputs are refused, since the served model is a text-only decoder. The ensemble's step
and the BLS model get only the outputs that carry something (`preprocessing.step_outputs`).
Parameters: tokenizer_dir (required), add_special_tokens (default true), trust_remote_code
(default false), parse_special_tokens (default false: special-token strings in prompts stay text),
and the size limits of `ensemble.limits`: max_input_len (tokens; default the model's context less
one, from max_seq_len or tokenizer_dir's config.json), max_input_bytes (default 32 bytes a token),
max_num_words (per word list, default 256). A bad request gets its own error; the rest of the
dynamic batch carries on.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import lifeline, params
from ensemble.errors import InputError
from ensemble.io_contract import PREPROCESSING
from ensemble.limits import DEFAULT_MAX_NUM_WORDS, PromptLimits, model_context_length
from preprocessing import step_outputs
from preprocessing.tokenizer import TextTokenizer, decode_query

# Inputs of models this repository does not serve: refused by name when they hold anything.
_UNSUPPORTED = {
    "DECODER_QUERY": "decoder_text_input is for encoder-decoder models; this model is decoder-only",
    "IMAGE_BYTES": "image inputs are not supported: this model is text-only",
    "IMAGE_URL": "image inputs are not supported: this model is text-only",
    "VIDEO_BYTES": "video inputs are not supported: this model is text-only",
}


# The names clients send these inputs under (the ensemble's), for errors.
_CLIENT_NAMES = {"STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words"}


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
        tokenizer_dir = values["tokenizer_dir"]
        # The engine's rule: max_seq_len, capped by the model's context.
        contexts = [params.get_int(values, "max_seq_len", None), model_context_length(tokenizer_dir)]
        limits = PromptLimits.derive(params.get_int(values, "max_input_len", None),
                                     min(filter(None, contexts), default=None),
                                     params.get_int(values, "max_input_bytes", None))
        self.tokenizer = TextTokenizer(
            tokenizer_dir, add_special_tokens=params.get_bool(values, "add_special_tokens", True),
            trust_remote_code=params.get_bool(values, "trust_remote_code", False), limits=limits,
            max_num_words=params.get_int(values, "max_num_words", DEFAULT_MAX_NUM_WORDS),
            parse_special_tokens=params.get_bool(values, "parse_special_tokens", False))

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
        # max_tokens is the engine's to check (inflight.api.types.Request): one rule, one place.
        max_tokens = find("REQUEST_OUTPUT_LEN").as_numpy()
        batch = max_tokens.shape[0]
        max_tokens = max_tokens.reshape(batch, -1)
        ids = self._prompts(find, batch)
        end_id = self._scalar_or(find, "END_ID", self.tokenizer.end_id, batch)
        pad_id = self._scalar_or(find, "PAD_ID", self.tokenizer.pad_id, batch)
        width = max(len(row) for row in ids)
        input_id = np.full((batch, width), pad_id[0, 0], dtype=np.int32)
        for b, row in enumerate(ids):
            input_id[b, :len(row)] = row

        bias_words = _strings(find("EMBEDDING_BIAS_WORDS"))
        bias_weights = find("EMBEDDING_BIAS_WEIGHTS")
        bias_weights = bias_weights.as_numpy().reshape(batch, -1) if bias_weights is not None else None
        bias_ids = find("EMBEDDING_BIAS_IDS")
        bias_ids = bias_ids.as_numpy().reshape(batch, -1) if bias_ids is not None else None
        if bias_ids is not None and any(len(words) for words in bias_words):
            raise InputError("send embedding_bias_words or embedding_bias_ids with embedding_bias_weights, "
                             "not both")
        weights_of = (lambda b: bias_weights[b].tolist() if bias_weights is not None else [])
        biases = [self.tokenizer.embedding_bias_of_ids(bias_ids[b].tolist(), weights_of(b))
                  if bias_ids is not None else
                  self.tokenizer.embedding_bias(bias_words[b] if b < len(bias_words) else [], weights_of(b))
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

    def _prompts(self, find, batch) -> list[list[int]]:
        """Each row's prompt ids: QUERY tokenized, or QUERY_IDS as the client sent them."""
        query, query_ids = find("QUERY"), find("QUERY_IDS")
        if (query is None) == (query_ids is None):
            raise InputError("send the prompt as text_input or as input_ids (exactly one of them)")
        if query_ids is not None:
            return [self.tokenizer.check_ids(row) for row in query_ids.as_numpy().reshape(batch, -1)]
        chat = self._flag(find, "APPLY_CHAT_TEMPLATE", False)
        special = self._flag(find, "ADD_SPECIAL_TOKENS", None)
        parse = self._flag(find, "PARSE_SPECIAL_TOKENS", None)
        return [self.tokenizer.encode_query(q, chat, special, parse) for q in query.as_numpy().reshape(-1)]

    @staticmethod
    def _flag(find, name, default):
        tensor = find(name)
        return bool(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else default

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
        return self.tokenizer.word_list(rows, _CLIENT_NAMES[name])
