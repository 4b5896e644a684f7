"""The I/O contract of the four Triton models, defined once.

Names, dtypes and dims follow NVIDIA's `inflight_batcher_llm` repository so clients can switch
between the two. The Triton adapters read their tensors through these specs, the repository
builder checks every rendered `config.pbtxt` against them, and the tests build requests from
them. Dims are per request (Triton prepends the batch dimension, since every model batches).

Extensions over NVIDIA's contract are marked `ext`: the stream-context tensors that let the
stateless detokenizer decode each streamed chunk in context, the chat-template switch,
`add_special_tokens` (a per-request override of the tokenizer parameter, so a client that renders
a chat template itself does not get a second BOS), and `min_length` (genai-perf sends it; an alias
of `min_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64, "TYPE_FP32": np.float32, "TYPE_STRING": np.object_,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton config type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    optional: bool = False
    # Scalars declared [1] that the model sees as shape [batch] (`reshape: { shape: [ ] }`).
    reshape_scalar: bool = False
    allow_ragged_batch: bool = False

    @property
    def numpy_dtype(self):
        return _NUMPY[self.dtype]

    @property
    def client_dtype(self) -> str:
        """The datatype string tritonclient uses ("INT32", "BYTES", ...)."""
        return "BYTES" if self.dtype == "TYPE_STRING" else self.dtype.removeprefix("TYPE_")


@dataclass(frozen=True)
class ModelIO:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        return _find(self.inputs, name)

    def output(self, name: str) -> TensorSpec:
        return _find(self.outputs, name)

    @property
    def required_inputs(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.inputs if not t.optional)


def _find(specs: tuple[TensorSpec, ...], name: str) -> TensorSpec:
    for spec in specs:
        if spec.name == name:
            return spec
    raise KeyError(name)


def _in(name, dtype, dims=(1,), optional=True, **kw) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(dims), optional, **kw)


def _scalar(name, dtype, optional=True) -> TensorSpec:
    return TensorSpec(name, dtype, (1,), optional, reshape_scalar=True)


PREPROCESSING = ModelIO(
    inputs=(
        _in("QUERY", "TYPE_STRING", optional=False),
        _in("REQUEST_OUTPUT_LEN", "TYPE_INT32", optional=False),
        _in("BAD_WORDS_DICT", "TYPE_STRING", (-1,)),
        _in("STOP_WORDS_DICT", "TYPE_STRING", (-1,)),
        _in("EMBEDDING_BIAS_WORDS", "TYPE_STRING", (-1,)),
        _in("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", (-1,)),
        _in("END_ID", "TYPE_INT32"),
        _in("PAD_ID", "TYPE_INT32"),
        _in("APPLY_CHAT_TEMPLATE", "TYPE_BOOL"),  # ext
        _in("ADD_SPECIAL_TOKENS", "TYPE_BOOL"),  # ext: per-request override of the parameter
    ),
    outputs=(
        _in("INPUT_ID", "TYPE_INT32", (-1,)),
        _in("REQUEST_INPUT_LEN", "TYPE_INT32"),
        _in("BAD_WORDS_IDS", "TYPE_INT32", (2, -1)),
        _in("STOP_WORDS_IDS", "TYPE_INT32", (2, -1)),
        _in("EMBEDDING_BIAS", "TYPE_FP32", (-1,)),
        _in("REQUEST_OUTPUT_LEN", "TYPE_INT32", (-1,)),
        _in("OUT_END_ID", "TYPE_INT32"),
        _in("OUT_PAD_ID", "TYPE_INT32"),
    ),
)

TENSORRT_LLM = ModelIO(
    inputs=(
        _in("input_ids", "TYPE_INT32", (-1,), allow_ragged_batch=True),
        _in("input_lengths", "TYPE_INT32", optional=False),
        _in("request_output_len", "TYPE_INT32", optional=False),
        _scalar("end_id", "TYPE_INT32"),
        _scalar("pad_id", "TYPE_INT32"),
        _in("stop_words_list", "TYPE_INT32", (2, -1), allow_ragged_batch=True),
        _in("bad_words_list", "TYPE_INT32", (2, -1), allow_ragged_batch=True),
        _in("embedding_bias", "TYPE_FP32", (-1,), allow_ragged_batch=True),
        _scalar("beam_width", "TYPE_INT32"),
        _scalar("num_return_sequences", "TYPE_INT32"),
        _scalar("temperature", "TYPE_FP32"),
        _scalar("runtime_top_k", "TYPE_INT32"),
        _scalar("runtime_top_p", "TYPE_FP32"),
        _scalar("repetition_penalty", "TYPE_FP32"),
        _scalar("presence_penalty", "TYPE_FP32"),
        _scalar("frequency_penalty", "TYPE_FP32"),
        _scalar("min_tokens", "TYPE_INT32"),
        _scalar("min_length", "TYPE_INT32"),  # ext
        _scalar("seed", "TYPE_UINT64"),
        _scalar("return_log_probs", "TYPE_BOOL"),
        _scalar("return_num_input_tokens", "TYPE_BOOL"),
        _scalar("return_num_output_tokens", "TYPE_BOOL"),
        _scalar("exclude_input_in_output", "TYPE_BOOL"),
        _scalar("stop", "TYPE_BOOL"),
        _scalar("streaming", "TYPE_BOOL"),
        _in("guided_decoding_guide_type", "TYPE_STRING", allow_ragged_batch=True),
        _in("guided_decoding_guide", "TYPE_STRING", allow_ragged_batch=True),
    ),
    outputs=(
        _in("output_ids", "TYPE_INT32", (-1, -1)),
        _in("sequence_length", "TYPE_INT32", (-1,)),
        _in("cum_log_probs", "TYPE_FP32", (-1,)),
        _in("output_log_probs", "TYPE_FP32", (-1, -1)),
        _in("batch_index", "TYPE_INT32"),
        _in("num_input_tokens", "TYPE_INT32"),
        _in("num_output_tokens", "TYPE_INT32"),
        _in("stream_context_ids", "TYPE_INT32", (-1, -1)),  # ext: tokens preceding this chunk
        _in("stream_context_length", "TYPE_INT32", (-1,)),  # ext
        _in("is_final", "TYPE_BOOL"),  # ext: last response of this request
        _in("request_key", "TYPE_UINT64"),  # ext: see CANCEL_KEY_PREFIX
    ),
)

POSTPROCESSING = ModelIO(
    inputs=(
        _in("TOKENS_BATCH", "TYPE_INT32", (-1, -1), optional=False),
        _in("SEQUENCE_LENGTH", "TYPE_INT32", (-1,), optional=False),
        _in("CONTEXT_IDS", "TYPE_INT32", (-1, -1)),  # ext
        _in("CONTEXT_LENGTH", "TYPE_INT32", (-1,)),  # ext
        _in("IS_FINAL", "TYPE_BOOL"),  # ext
        _in("REQUEST_KEY", "TYPE_UINT64"),  # ext
    ),
    outputs=(_in("OUTPUT", "TYPE_STRING", (-1,)),),
)

ENSEMBLE = ModelIO(
    inputs=(
        _in("text_input", "TYPE_STRING", optional=False),
        _in("max_tokens", "TYPE_INT32", optional=False),
        _in("stream", "TYPE_BOOL"),
        _in("bad_words", "TYPE_STRING", (-1,)),
        _in("stop_words", "TYPE_STRING", (-1,)),
        _in("embedding_bias_words", "TYPE_STRING", (-1,)),
        _in("embedding_bias_weights", "TYPE_FP32", (-1,)),
        _in("end_id", "TYPE_INT32"),
        _in("pad_id", "TYPE_INT32"),
        _in("top_k", "TYPE_INT32"),
        _in("top_p", "TYPE_FP32"),
        _in("temperature", "TYPE_FP32"),
        _in("repetition_penalty", "TYPE_FP32"),
        _in("presence_penalty", "TYPE_FP32"),
        _in("frequency_penalty", "TYPE_FP32"),
        _in("min_tokens", "TYPE_INT32"),
        _in("min_length", "TYPE_INT32"),  # ext
        _in("seed", "TYPE_UINT64"),
        _in("beam_width", "TYPE_INT32"),
        _in("num_return_sequences", "TYPE_INT32"),
        _in("exclude_input_in_output", "TYPE_BOOL"),
        _in("return_log_probs", "TYPE_BOOL"),
        _in("return_num_input_tokens", "TYPE_BOOL"),
        _in("return_num_output_tokens", "TYPE_BOOL"),
        _in("apply_chat_template", "TYPE_BOOL"),  # ext
        _in("add_special_tokens", "TYPE_BOOL"),  # ext
        _in("guided_decoding_guide_type", "TYPE_STRING"),
        _in("guided_decoding_guide", "TYPE_STRING"),
    ),
    outputs=(
        _in("text_output", "TYPE_STRING", (-1,)),
        _in("cum_log_probs", "TYPE_FP32", (-1,)),
        _in("output_log_probs", "TYPE_FP32", (-1, -1)),
        _in("batch_index", "TYPE_INT32"),
        _in("num_input_tokens", "TYPE_INT32"),
        _in("num_output_tokens", "TYPE_INT32"),
    ),
)

# Triton tells an ensemble's running step nothing when the client cancels: only steps started
# afterwards see `is_cancelled()`. The detokenizer is such a step (it runs once per streamed
# chunk), so when it sees a cancelled chunk it sends the engine model a `stop` request whose
# request id is this prefix + the chunk's `request_key` (64 random bits) + a MAC, and the engine
# cancels that request. `ensemble.control` signs and checks these ids.
CANCEL_KEY_PREFIX = "inflight-cancel-key:"

# Generated ids preceding a streamed chunk that the engine model sends along with it
# (`stream_context_ids`), so the stateless detokenizer decodes the chunk in context. Must cover
# the tokens an incomplete character can be held in (3) plus at least one neighbour for spacing.
CONTEXT_TOKENS = 8

MODELS = {
    "preprocessing": PREPROCESSING,
    "tensorrt_llm": TENSORRT_LLM,
    "postprocessing": POSTPROCESSING,
    "ensemble": ENSEMBLE,
}

# Ensemble input -> (step model, step input). Everything else flows between steps.
ENSEMBLE_ROUTES = {
    "text_input": ("preprocessing", "QUERY"),
    "max_tokens": ("preprocessing", "REQUEST_OUTPUT_LEN"),
    "bad_words": ("preprocessing", "BAD_WORDS_DICT"),
    "stop_words": ("preprocessing", "STOP_WORDS_DICT"),
    "embedding_bias_words": ("preprocessing", "EMBEDDING_BIAS_WORDS"),
    "embedding_bias_weights": ("preprocessing", "EMBEDDING_BIAS_WEIGHTS"),
    "end_id": ("preprocessing", "END_ID"),
    "pad_id": ("preprocessing", "PAD_ID"),
    "apply_chat_template": ("preprocessing", "APPLY_CHAT_TEMPLATE"),
    "add_special_tokens": ("preprocessing", "ADD_SPECIAL_TOKENS"),
    "stream": ("tensorrt_llm", "streaming"),
    "top_k": ("tensorrt_llm", "runtime_top_k"),
    "top_p": ("tensorrt_llm", "runtime_top_p"),
    "temperature": ("tensorrt_llm", "temperature"),
    "repetition_penalty": ("tensorrt_llm", "repetition_penalty"),
    "presence_penalty": ("tensorrt_llm", "presence_penalty"),
    "frequency_penalty": ("tensorrt_llm", "frequency_penalty"),
    "min_tokens": ("tensorrt_llm", "min_tokens"),
    "min_length": ("tensorrt_llm", "min_length"),
    "seed": ("tensorrt_llm", "seed"),
    "beam_width": ("tensorrt_llm", "beam_width"),
    "num_return_sequences": ("tensorrt_llm", "num_return_sequences"),
    "exclude_input_in_output": ("tensorrt_llm", "exclude_input_in_output"),
    "return_log_probs": ("tensorrt_llm", "return_log_probs"),
    "return_num_input_tokens": ("tensorrt_llm", "return_num_input_tokens"),
    "return_num_output_tokens": ("tensorrt_llm", "return_num_output_tokens"),
    "guided_decoding_guide_type": ("tensorrt_llm", "guided_decoding_guide_type"),
    "guided_decoding_guide": ("tensorrt_llm", "guided_decoding_guide"),
}
