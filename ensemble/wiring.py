"""How the ensemble's steps connect: which model and input each ensemble (and BLS) input
feeds, and which tensors pass from preprocessing to `tensorrt_llm` and from `tensorrt_llm` to
postprocessing, by the names of `ensemble.io_contract`. `tools/render_templates.py` writes the
ensemble's steps from these tables; the BLS model (`bls/pipeline.py`) calls the steps by them.
"""

from __future__ import annotations

# Ensemble (and BLS) input -> (step model, step input). Inputs not listed go to tensorrt_llm
# under the same name.
TEXT_INPUT_ROUTES = {
    "text_input": ("preprocessing", "QUERY"),
    "input_ids": ("preprocessing", "QUERY_IDS"),
    "decoder_text_input": ("preprocessing", "DECODER_QUERY"),
    "max_tokens": ("preprocessing", "REQUEST_OUTPUT_LEN"),
    "bad_words": ("preprocessing", "BAD_WORDS_DICT"),
    "stop_words": ("preprocessing", "STOP_WORDS_DICT"),
    "embedding_bias_words": ("preprocessing", "EMBEDDING_BIAS_WORDS"),
    "embedding_bias_weights": ("preprocessing", "EMBEDDING_BIAS_WEIGHTS"),
    "embedding_bias_ids": ("preprocessing", "EMBEDDING_BIAS_IDS"),
    "end_id": ("preprocessing", "END_ID"),
    "pad_id": ("preprocessing", "PAD_ID"),
    "prompt_table_extra_id": ("preprocessing", "PROMPT_TABLE_EXTRA_ID"),
    "apply_chat_template": ("preprocessing", "APPLY_CHAT_TEMPLATE"),
    "add_special_tokens": ("preprocessing", "ADD_SPECIAL_TOKENS"),
    "parse_special_tokens": ("preprocessing", "PARSE_SPECIAL_TOKENS"),
    "stream": ("tensorrt_llm", "streaming"),
    "top_k": ("tensorrt_llm", "runtime_top_k"),
    "top_p": ("tensorrt_llm", "runtime_top_p"),
    "length_penalty": ("tensorrt_llm", "len_penalty"),
}


def text_input_route(name: str) -> tuple[str, str]:
    """The step model and input that an ensemble/BLS input feeds."""
    return TEXT_INPUT_ROUTES.get(name, ("tensorrt_llm", name))


# preprocessing output -> tensorrt_llm input, and tensorrt_llm output -> postprocessing input.
PREPROCESSING_TO_ENGINE = {
    "INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
    "DECODER_INPUT_ID": "decoder_input_ids", "REQUEST_DECODER_INPUT_LEN": "decoder_input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len", "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list", "EMBEDDING_BIAS": "embedding_bias",
    "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id",
    "OUT_PROMPT_TABLE_EXTRA_IDS": "prompt_table_extra_ids",
}
# The ensemble's direct path (tools/build_repository.py --tokenize_in tensorrt_llm): each
# preprocessing input -> the tensorrt_llm input that takes it instead, the model then running
# the preprocessing itself (`preprocessing.prompts.DirectText`). NVIDIA's input where one has the
# same meaning, else an ext input named as the ensemble's (`input_ids`, taken, becomes
# `query_input_ids`).
DIRECT_TEXT_INPUTS = {
    "QUERY": "text_input", "QUERY_IDS": "query_input_ids", "DECODER_QUERY": "decoder_text_input",
    "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_DICT": "bad_words",
    "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
    "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "EMBEDDING_BIAS_IDS": "embedding_bias_ids",
    "END_ID": "end_id", "PAD_ID": "pad_id", "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id",
    "APPLY_CHAT_TEMPLATE": "apply_chat_template", "ADD_SPECIAL_TOKENS": "add_special_tokens",
    "PARSE_SPECIAL_TOKENS": "parse_special_tokens",
}
ENGINE_TO_POSTPROCESSING = {
    "output_ids": "TOKENS_BATCH", "sequence_length": "SEQUENCE_LENGTH",
    "stream_context_ids": "CONTEXT_IDS", "stream_context_length": "CONTEXT_LENGTH",
    "is_final": "IS_FINAL", "request_key": "REQUEST_KEY",
}
