"""The I/O contract of the five Triton models, defined once.

Every tensor of NVIDIA's `inflight_batcher_llm` configs (`preprocessing`, `tensorrt_llm`,
`postprocessing`, `ensemble`, `tensorrt_llm_bls`) is here with NVIDIA's name, dtype, dims and
optionality, so its clients work unchanged. The Triton adapters read their tensors through these
specs, `tools/render_templates.py` writes the `input`/`output` sections (and the ensemble's
steps) of every `config.pbtxt` template from them, and the repository builder checks each
rendered config against them. Dims are per request: Triton prepends the batch dimension, since
every model batches.

Rows marked `ext` are ours, not NVIDIA's: the stream-context tensors that let the stateless
detokenizer decode each streamed chunk in context, the chat-template switch,
`add_special_tokens` (a per-request override of the tokenizer parameter, so a client that renders
a chat template itself does not get a second BOS), `parse_special_tokens` (the opt-in that lets
special-token strings in `text_input` become control tokens; `preprocessing.control_tokens`),
`input_ids` (a prompt the client tokenized itself, sent instead of `text_input`, which is
therefore optional here: preprocessing refuses a request with neither or both),
`embedding_bias_ids` (token ids paired with `embedding_bias_weights`, instead of words: OpenAI's
`logit_bias`), `num_top_log_probs` with the outputs `top_log_probs` / `top_log_prob_ids` (the K
most likely tokens at each generated position), `return_prompt_log_probs` with `prompt_log_probs`
(and `prompt_top_log_probs` / `_ids`), `min_length`
(genai-perf sends it; an alias of `min_tokens`), the two token counts NVIDIA added to
`tensorrt_llm` later, and `tensorrt_llm`'s text inputs of the ensemble's direct path
(`ensemble.wiring.DIRECT_TEXT_INPUTS`; with them `input_lengths` is optional there, filled by
the model). Which step's tensor feeds which is `ensemble.wiring`'s.

A dtype written `name=TYPE` is filled from the template variable `name` (NVIDIA's
`logits_datatype`, ...), TYPE being the value the repository builder uses and accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
    "TYPE_UINT64": np.uint64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32,
    "TYPE_STRING": np.object_,
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
    ext: bool = False  # ours, not in NVIDIA's config
    dtype_var: str | None = None  # template variable that sets the dtype (default: `dtype`)

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


def _table(text: str, outputs: bool = False) -> tuple[TensorSpec, ...]:
    """Rows `name DTYPE dims [flags]`: dims like `1`, `-1`, `2,-1`; flags `required`
    (inputs are optional otherwise), `scalar` (reshape to []), `ragged`, `ext`."""
    specs = []
    for line in filter(str.strip, text.splitlines()):
        name, dtype, dims, *flags = line.split()
        var, _, dtype = dtype.rpartition("=")
        specs.append(TensorSpec(
            name, f"TYPE_{dtype}", tuple(int(d) for d in dims.split(",")),
            optional=not outputs and "required" not in flags, reshape_scalar="scalar" in flags,
            allow_ragged_batch="ragged" in flags, ext="ext" in flags, dtype_var=var or None))
    return tuple(specs)


PREPROCESSING = ModelIO(
    inputs=_table("""
QUERY                   STRING  1
QUERY_IDS               INT32   -1      ragged ext
DECODER_QUERY           STRING  1
IMAGE_BYTES             UINT8   -1,-1,-1,-1
IMAGE_URL               STRING  1
VIDEO_BYTES             UINT8   -1,-1,-1,-1
REQUEST_OUTPUT_LEN      INT32   1       required
BAD_WORDS_DICT          STRING  -1
STOP_WORDS_DICT         STRING  -1
EMBEDDING_BIAS_WORDS    STRING  -1
EMBEDDING_BIAS_WEIGHTS  FP32    -1
EMBEDDING_BIAS_IDS      INT32   -1      ext
END_ID                  INT32   1
PAD_ID                  INT32   1
PROMPT_TABLE_EXTRA_ID   UINT64  1
APPLY_CHAT_TEMPLATE     BOOL    1       ext
ADD_SPECIAL_TOKENS      BOOL    1       ext
PARSE_SPECIAL_TOKENS    BOOL    1       ext
"""),
    outputs=_table("""
INPUT_ID                    INT32   -1
REQUEST_INPUT_LEN           INT32   1
DECODER_INPUT_ID            INT32   -1
REQUEST_DECODER_INPUT_LEN   INT32   1
BAD_WORDS_IDS               INT32   2,-1
STOP_WORDS_IDS              INT32   2,-1
EMBEDDING_BIAS              FP32    -1
REQUEST_OUTPUT_LEN          INT32   -1
OUT_END_ID                  INT32   1
OUT_PAD_ID                  INT32   1
OUT_PROMPT_TABLE_EXTRA_IDS  UINT64  -1
PIXEL_VALUES                FP16    -1,-1,-1,-1
ASPECT_RATIO_IDS            INT64   -1
ASPECT_RATIO_MASK           INT64   -1,-1
CROSS_ATTENTION_MASK        INT64   -1,-1,-1
IMAGE_SIZES                 INT64   2
IS_VIDEO_INPUT              BOOL    1
ATTENTION_MASK              INT64   -1
IMAGE_GRID_THW              INT64   3
VISION_INPUT_ID             INT32   -1
""", outputs=True),
)

TENSORRT_LLM = ModelIO(
    inputs=_table("""
input_ids                           INT32   -1      ragged
encoder_input_features              encoder_input_features_data_type=FP16  -1,-1  ragged
encoder_output_lengths              INT32   1       scalar
input_lengths                       INT32   1       scalar
request_output_len                  INT32   1       required scalar
num_return_sequences                INT32   1       scalar
draft_input_ids                     INT32   -1      ragged
decoder_input_ids                   INT32   -1      ragged
decoder_input_lengths               INT32   1       scalar
draft_logits                        logits_datatype=FP32  -1,-1  ragged
draft_acceptance_threshold          FP32    1       scalar
end_id                              INT32   1       scalar
pad_id                              INT32   1       scalar
stop_words_list                     INT32   2,-1    ragged
bad_words_list                      INT32   2,-1    ragged
embedding_bias                      FP32    -1      ragged
beam_width                          INT32   1       scalar
temperature                         FP32    1       scalar
runtime_top_k                       INT32   1       scalar
runtime_top_p                       FP32    1       scalar
runtime_top_p_min                   FP32    1       scalar
runtime_top_p_decay                 FP32    1       scalar
runtime_top_p_reset_ids             INT32   1       scalar
len_penalty                         FP32    1       scalar
early_stopping                      BOOL    1       scalar
repetition_penalty                  FP32    1       scalar
min_tokens                          INT32   1       scalar
min_length                          INT32   1       scalar ext
beam_search_diversity_rate          FP32    1       scalar
presence_penalty                    FP32    1       scalar
frequency_penalty                   FP32    1       scalar
seed                                UINT64  1       scalar
return_log_probs                    BOOL    1       scalar
num_top_log_probs                   INT32   1       scalar ext
return_prompt_log_probs             BOOL    1       scalar ext
return_context_logits               BOOL    1       scalar
return_generation_logits            BOOL    1       scalar
return_perf_metrics                 BOOL    1       scalar
return_num_input_tokens             BOOL    1       scalar
return_num_output_tokens            BOOL    1       scalar
exclude_input_in_output             BOOL    1       scalar
stop                                BOOL    1       scalar
streaming                           BOOL    1       scalar
prompt_embedding_table              prompt_embedding_table_data_type=FP16  -1,-1  ragged
prompt_table_extra_ids              UINT64  -1      ragged
prompt_vocab_size                   INT32   1       scalar
cross_attention_mask                BOOL    -1,-1   ragged
mrope_rotary_cos_sin                FP32    -1
mrope_position_deltas               INT64   1
lora_task_id                        UINT64  1       scalar
lora_weights                        FP16    -1,-1   ragged
lora_config                         INT32   -1,3    ragged
context_phase_params                UINT8   -1      ragged
skip_cross_attn_blocks              BOOL    1       ragged
retention_token_range_starts        INT32   -1      ragged
retention_token_range_ends          INT32   -1      ragged
retention_token_range_priorities    INT32   -1      ragged
retention_token_range_durations_ms  INT32   -1      ragged
retention_decode_priority           INT32   1       ragged
retention_decode_duration_ms        INT32   1       ragged
guided_decoding_guide_type          STRING  1       ragged
guided_decoding_guide               STRING  1       ragged
lookahead_window_size               INT32   1       ragged
lookahead_ngram_size                INT32   1       ragged
lookahead_verification_set_size     INT32   1       ragged
text_input                          STRING  1       ext
query_input_ids                     INT32   -1      ragged ext
decoder_text_input                  STRING  1       ext
bad_words                           STRING  -1      ragged ext
stop_words                          STRING  -1      ragged ext
embedding_bias_words                STRING  -1      ragged ext
embedding_bias_weights              FP32    -1      ragged ext
embedding_bias_ids                  INT32   -1      ragged ext
prompt_table_extra_id               UINT64  1       ext
apply_chat_template                 BOOL    1       ext
add_special_tokens                  BOOL    1       ext
parse_special_tokens                BOOL    1       ext
"""),
    outputs=_table("""
output_ids                   INT32   -1,-1
sequence_length              INT32   -1
cum_log_probs                FP32    -1
output_log_probs             FP32    -1,-1
context_logits               logits_datatype=FP32  -1,-1
generation_logits            logits_datatype=FP32  -1,-1,-1
batch_index                  INT32   1
sequence_index               INT32   1
context_phase_params         UINT8   -1
kv_cache_alloc_new_blocks    INT32   1
kv_cache_reused_blocks       INT32   1
kv_cache_alloc_total_blocks  INT32   1
arrival_time_ns              INT64   1
first_scheduled_time_ns      INT64   1
first_token_time_ns          INT64   1
last_token_time_ns           INT64   1
acceptance_rate              FP32    1
total_accepted_draft_tokens  INT32   1
total_draft_tokens           INT32   1
num_input_tokens             INT32   1
num_output_tokens            INT32   1
top_log_probs                FP32    -1,-1,-1 ext
top_log_prob_ids             INT32   -1,-1,-1 ext
prompt_log_probs             FP32    -1      ext
prompt_top_log_probs         FP32    -1,-1   ext
prompt_top_log_prob_ids      INT32   -1,-1   ext
stream_context_ids           INT32   -1,-1   ext
stream_context_length        INT32   -1      ext
is_final                     BOOL    1       ext
request_key                  UINT64  1       ext
""", outputs=True),
)

POSTPROCESSING = ModelIO(
    inputs=_table("""
TOKENS_BATCH     INT32   -1,-1   required
SEQUENCE_LENGTH  INT32   -1      required
CONTEXT_IDS      INT32   -1,-1   ext
CONTEXT_LENGTH   INT32   -1      ext
IS_FINAL         BOOL    1       ext
REQUEST_KEY      UINT64  1       ext
"""),
    outputs=_table("""
OUTPUT  STRING  -1
""", outputs=True),
)

# The text-level inputs shared by the ensemble and tensorrt_llm_bls (NVIDIA's names).
_TEXT_INPUTS = """
text_input              STRING  1
input_ids               INT32   -1      ragged ext
decoder_text_input      STRING  1
max_tokens              INT32   1       required
num_return_sequences    INT32   1
bad_words               STRING  -1
stop_words              STRING  -1
exclude_input_in_output BOOL    1
end_id                  INT32   1
pad_id                  INT32   1
top_k                   INT32   1
top_p                   FP32    1
temperature             FP32    1
length_penalty          FP32    1
repetition_penalty      FP32    1
min_tokens              INT32   1
min_length              INT32   1       ext
presence_penalty        FP32    1
frequency_penalty       FP32    1
seed                    UINT64  1
return_log_probs        BOOL    1
num_top_log_probs       INT32   1       ext
return_prompt_log_probs BOOL    1       ext
return_context_logits   BOOL    1
return_generation_logits BOOL   1
return_perf_metrics     BOOL    1
return_num_input_tokens BOOL    1
return_num_output_tokens BOOL   1
beam_width              INT32   1
stream                  BOOL    1
prompt_embedding_table  prompt_embedding_table_data_type=FP16  -1,-1
prompt_table_extra_id   UINT64  1
prompt_vocab_size       INT32   1
embedding_bias_words    STRING  -1
embedding_bias_weights  FP32    -1
embedding_bias_ids      INT32   -1      ext
lora_task_id            UINT64  1
lora_weights            FP16    -1,-1   ragged
lora_config             INT32   -1,3    ragged
guided_decoding_guide_type STRING 1     ragged
guided_decoding_guide   STRING  1       ragged
apply_chat_template     BOOL    1       ext
add_special_tokens      BOOL    1       ext
parse_special_tokens    BOOL    1       ext
"""


def _text_outputs() -> tuple[TensorSpec, ...]:
    """What both text models answer: the text, then tensorrt_llm's outputs passed through."""
    text = _table("text_output STRING -1", outputs=True)
    passed = tuple(t for t in TENSORRT_LLM.outputs if t.name in ENGINE_PASS_THROUGH)
    return text + passed


# tensorrt_llm outputs that the ensemble and the BLS model return to the client as they are:
# NVIDIA's, and our top log probs.
EXT_PASS_THROUGH = ("top_log_probs", "top_log_prob_ids", "prompt_log_probs", "prompt_top_log_probs",
                    "prompt_top_log_prob_ids")
ENGINE_PASS_THROUGH = tuple(
    t.name for t in TENSORRT_LLM.outputs
    if (not t.ext or t.name in EXT_PASS_THROUGH)
    and t.name not in ("output_ids", "sequence_length", "context_phase_params"))

ENSEMBLE = ModelIO(inputs=_table(_TEXT_INPUTS), outputs=_text_outputs())

TENSORRT_LLM_BLS = ModelIO(
    inputs=_table(_TEXT_INPUTS + """
image_input             FP16    -1,3,-1,-1
image_bytes_input       UINT8   -1,-1,-1,-1
image_url_input         STRING  1
video_bytes_input       UINT8   -1,-1,-1,-1
num_draft_tokens        INT32   1
use_draft_logits        BOOL    1
"""),
    outputs=_text_outputs(),
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
    "tensorrt_llm_bls": TENSORRT_LLM_BLS,
}
