"""One request's preprocessing: its inputs (NVIDIA's names) → the tensors the engine model takes.

Two places run it, so it lives below both: the `preprocessing` model (NVIDIA's step of the
ensemble, and the BLS model's), and the `tensorrt_llm` model itself, when the ensemble sends it
the text directly (`DirectText`; `tools/build_repository.py --tokenize_in tensorrt_llm`). The
direct path saves a first token the hop through a second Python stub at low load (0.9 ms at
concurrency 1 on an H100 host; docs/performance.md).

`find(name)` gives the request's input of that PREPROCESSING name as a numpy array, or None.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ensemble import params
from ensemble.errors import InputError
from ensemble.limits import DEFAULT_MAX_NUM_WORDS, PromptLimits, model_context_length
from ensemble.wiring import DIRECT_TEXT_INPUTS, PREPROCESSING_TO_ENGINE
from preprocessing import step_outputs
from preprocessing.tokenizer import TextTokenizer, decode_query

Find = Callable[[str], "np.ndarray | None"]

# Inputs of models this repository does not serve: refused by name when they hold anything.
UNSUPPORTED = {
    "DECODER_QUERY": "decoder_text_input is for encoder-decoder models; this model is decoder-only",
    "IMAGE_BYTES": "image inputs are not supported: this model is text-only",
    "IMAGE_URL": "image inputs are not supported: this model is text-only",
    "VIDEO_BYTES": "video inputs are not supported: this model is text-only",
}
# The names clients send these inputs under (the ensemble's), for errors.
_CLIENT_NAMES = {"STOP_WORDS_DICT": "stop_words", "BAD_WORDS_DICT": "bad_words"}


def tokenizer_from_params(values: dict[str, str]) -> TextTokenizer:
    """The tokenizer a model's parameters describe: tokenizer_dir (required), add_special_tokens,
    trust_remote_code, parse_special_tokens, and the limits of `ensemble.limits`."""
    tokenizer_dir = values["tokenizer_dir"]
    # The engine's rule: max_seq_len, capped by the model's context.
    contexts = [params.get_int(values, "max_seq_len", None), model_context_length(tokenizer_dir)]
    limits = PromptLimits.derive(params.get_int(values, "max_input_len", None),
                                 min(filter(None, contexts), default=None),
                                 params.get_int(values, "max_input_bytes", None))
    return TextTokenizer(
        tokenizer_dir, add_special_tokens=params.get_bool(values, "add_special_tokens", True),
        trust_remote_code=params.get_bool(values, "trust_remote_code", False), limits=limits,
        max_num_words=params.get_int(values, "max_num_words", DEFAULT_MAX_NUM_WORDS),
        parse_special_tokens=params.get_bool(values, "parse_special_tokens", False))


def _strings(values: np.ndarray | None) -> list[list[str]]:
    """A [batch, N] BYTES array → per-row lists of words (empty entries dropped)."""
    if values is None:
        return []
    rows = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(1, -1)
    return [[decode_query(w) for w in row if len(w)] for row in rows]


def preprocess(find: Find, tokenizer: TextTokenizer) -> dict[str, np.ndarray]:
    """Every PREPROCESSING output of one request (NVIDIA's full answer). Raises InputError."""
    for name, reason in UNSUPPORTED.items():
        values = find(name)
        # Empty strings are what clients send for "none" (NVIDIA's scripts do).
        if values is not None and values.size and (values.dtype != np.object_
                                                   or any(len(v) for v in values.reshape(-1))):
            raise InputError(reason)
    # max_tokens is the engine's to check (inflight.api.types.Request): one rule, one place.
    max_tokens = find("REQUEST_OUTPUT_LEN")
    if max_tokens is None:
        raise InputError("max_tokens is required")
    batch = max_tokens.shape[0]
    max_tokens = max_tokens.reshape(batch, -1)
    ids = _prompts(find, tokenizer, batch)
    end_id = _scalar_or(find, "END_ID", tokenizer.end_id, batch)
    pad_id = _scalar_or(find, "PAD_ID", tokenizer.pad_id, batch)
    width = max(len(row) for row in ids)
    input_id = np.full((batch, width), pad_id[0, 0], dtype=np.int32)
    for b, row in enumerate(ids):
        input_id[b, :len(row)] = row

    bias_words = _strings(find("EMBEDDING_BIAS_WORDS"))
    bias_weights = find("EMBEDDING_BIAS_WEIGHTS")
    bias_weights = bias_weights.reshape(batch, -1) if bias_weights is not None else None
    bias_ids = find("EMBEDDING_BIAS_IDS")
    bias_ids = bias_ids.reshape(batch, -1) if bias_ids is not None else None
    if bias_ids is not None and any(len(words) for words in bias_words):
        raise InputError("send embedding_bias_words or embedding_bias_ids with embedding_bias_weights, "
                         "not both")
    weights_of = (lambda b: bias_weights[b].tolist() if bias_weights is not None else [])
    biases = [tokenizer.embedding_bias_of_ids(bias_ids[b].tolist(), weights_of(b))
              if bias_ids is not None else
              tokenizer.embedding_bias(bias_words[b] if b < len(bias_words) else [], weights_of(b))
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
        "BAD_WORDS_IDS": _words(find, tokenizer, "BAD_WORDS_DICT", batch),
        "STOP_WORDS_IDS": _words(find, tokenizer, "STOP_WORDS_DICT", batch),
        "EMBEDDING_BIAS": embedding_bias,
        "REQUEST_OUTPUT_LEN": max_tokens.astype(np.int32),
        "OUT_END_ID": end_id,
        "OUT_PAD_ID": pad_id,
    }
    extra_id = find("PROMPT_TABLE_EXTRA_ID")
    if extra_id is not None:  # NVIDIA's: the id repeated for every prompt token
        extra = extra_id.reshape(batch, 1).astype(np.uint64)
        outputs["OUT_PROMPT_TABLE_EXTRA_IDS"] = np.repeat(extra, width, axis=1)
    return outputs


def _prompts(find: Find, tokenizer: TextTokenizer, batch: int) -> list[list[int]]:
    """Each row's prompt ids: QUERY tokenized, or QUERY_IDS as the client sent them."""
    query, query_ids = find("QUERY"), find("QUERY_IDS")
    if (query is None) == (query_ids is None):
        raise InputError("send the prompt as text_input or as input_ids (exactly one of them)")
    if query_ids is not None:
        return [tokenizer.check_ids(row) for row in query_ids.reshape(batch, -1)]
    chat = _flag(find, "APPLY_CHAT_TEMPLATE", False)
    special = _flag(find, "ADD_SPECIAL_TOKENS", None)
    parse = _flag(find, "PARSE_SPECIAL_TOKENS", None)
    return [tokenizer.encode_query(q, chat, special, parse) for q in query.reshape(-1)]


def _flag(find: Find, name: str, default):
    values = find(name)
    return bool(values.reshape(-1)[0]) if values is not None else default


def _scalar_or(find: Find, name: str, default, batch: int) -> np.ndarray:
    values = find(name)
    if values is None:
        if default is None:
            raise InputError(f"{name} is required: the tokenizer defines no default")
        return np.full((batch, 1), default, dtype=np.int32)
    return values.reshape(batch, 1).astype(np.int32)


def _words(find: Find, tokenizer: TextTokenizer, name: str, batch: int) -> np.ndarray:
    rows = _strings(find(name))
    rows = rows + [[]] * (batch - len(rows))
    return tokenizer.word_list(rows, _CLIENT_NAMES[name])


class DirectText:
    """The `tensorrt_llm` model's side of the direct path: a request that carries the
    ensemble's text inputs (under the names of `wiring.DIRECT_TEXT_INPUTS`) is preprocessed
    here, and its inputs become the ones the preprocessing step would have handed over, under
    the engine model's names (`PREPROCESSING_TO_ENGINE`), exactly as the ensemble maps them."""

    def __init__(self, tokenizer: TextTokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.names = set(DIRECT_TEXT_INPUTS.values()) - set(PREPROCESSING_TO_ENGINE.values())

    @classmethod
    def from_params(cls, values: dict[str, str]) -> DirectText:
        """With the model's tokenizer when tokenizer_dir is set, else one that refuses text."""
        return cls(tokenizer_from_params(values) if "tokenizer_dir" in values else None)

    def resolve(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`inputs` unchanged when they hold no text input and the engine's own prompt inputs
        (`input_ids` or `input_lengths`: a client of NVIDIA's engine model), else preprocessed
        (InputError): a request with no prompt at all gets preprocessing's answer, as through
        NVIDIA's ensemble."""
        if not self.names.intersection(inputs) and (self.tokenizer is None or "input_ids" in inputs
                                                    or "input_lengths" in inputs):
            return inputs
        if self.tokenizer is None:
            raise InputError("text_input reached the tensorrt_llm model, which has no tokenizer: set its "
                             "tokenizer_dir parameter (tools/build_repository.py does)")
        by_step_name = {step: inputs.get(engine) for step, engine in DIRECT_TEXT_INPUTS.items()}
        outputs = step_outputs.pipeline_outputs(preprocess(by_step_name.get, self.tokenizer))
        resolved = {k: v for k, v in inputs.items() if k not in self.names}
        for name, value in outputs.items():
            resolved[PREPROCESSING_TO_ENGINE[name]] = value
        return resolved
