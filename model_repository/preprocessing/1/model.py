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
dynamic batch carries on. The work itself is `preprocessing.prompts.preprocess`, which the
`tensorrt_llm` model also runs on the ensemble's direct path.
"""

import json

import triton_python_backend_utils as pb_utils

from ensemble import lifeline, params
from ensemble.errors import InputError
from ensemble.io_contract import PREPROCESSING
from preprocessing import step_outputs
from preprocessing.prompts import preprocess, tokenizer_from_params


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        values = params.read_parameters(json.loads(args["model_config"]))
        if "tokenizer_dir" not in values:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        self.tokenizer = tokenizer_from_params(values)

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
            tensor = given.get(PREPROCESSING.input(name).name)
            return tensor.as_numpy() if tensor is not None else None

        return preprocess(find, self.tokenizer)
