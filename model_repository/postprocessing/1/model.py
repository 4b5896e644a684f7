"""Triton adapter of the detokenizer model (`postprocessing`).

Inputs/outputs: `ensemble.io_contract.POSTPROCESSING`: NVIDIA's TOKENS_BATCH [beam, len] and
SEQUENCE_LENGTH [beam] → OUTPUT, plus the optional stream context (CONTEXT_IDS,
CONTEXT_LENGTH, IS_FINAL) that the engine model sends with each streamed chunk so the chunk is
decoded in context without state here. Parameters: tokenizer_dir, skip_special_tokens
(default true), trust_remote_code (default false).

Cancellation relay: a chunk whose request is cancelled means the client left; this model then
asks `tensorrt_llm` to stop generating for it, since Triton does not tell the engine, the
ensemble's running step, itself. The stop names the request by its random key and is signed
(`ensemble.control`), so no client can send one.
"""

import collections
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import lifeline, params
from ensemble.control import ControlAuth
from postprocessing.detokenizer import Detokenizer
from preprocessing.loader import load_tokenizer


def _rows(tokens: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """[batch, beam, len] ids and [batch, beam] lengths → one id list per (batch, beam)."""
    lengths = lengths.reshape(-1)
    tokens = tokens.reshape(len(lengths), tokens.shape[-1])
    return [tokens[i, :max(0, int(n))].tolist() for i, n in enumerate(lengths)]


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        model_config = json.loads(args["model_config"])
        count = sum(int(g.get("count", 1)) for g in model_config.get("instance_group", [])) or 1
        if count != 1:
            raise pb_utils.TritonModelException(
                f"postprocessing must run as 1 instance (got {count}): streamed chunks keep their "
                "order only with one instance and no dynamic batching")
        values = params.read_parameters(model_config)
        if "tokenizer_dir" not in values:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        tokenizer = load_tokenizer(values["tokenizer_dir"],
                                   trust_remote_code=params.get_bool(values, "trust_remote_code", False))
        self.detokenizer = Detokenizer(tokenizer, params.get_bool(values, "skip_special_tokens", True))
        self.stopped_keys = collections.deque(maxlen=1024)  # relayed already
        self.auth = ControlAuth.from_env()

    def finalize(self):
        lifeline.skip_teardown_at_exit()

    def _relay_cancellation(self, request):
        key = pb_utils.get_input_tensor_by_name(request, "REQUEST_KEY")
        if key is None:
            return
        key = int(key.as_numpy().reshape(-1)[0])
        if key in self.stopped_keys:
            return
        self.stopped_keys.append(key)
        one = np.ones((1, 1), dtype=np.int32)
        stop = pb_utils.InferenceRequest(
            model_name="tensorrt_llm", requested_output_names=[],
            request_id=self.auth.cancel_id(key),
            inputs=[pb_utils.Tensor("input_ids", one), pb_utils.Tensor("input_lengths", one),
                    pb_utils.Tensor("request_output_len", one),
                    pb_utils.Tensor("stop", np.ones((1, 1), dtype=np.bool_))])
        for _ in stop.exec(decoupled=True):
            pass

    def execute(self, requests):
        # Decode the whole dynamic batch in one call; answer each request with its own rows.
        token_rows, context_rows, finals, counts = [], [], [], []
        for request in requests:
            if request.is_cancelled():
                self._relay_cancellation(request)
            tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH").as_numpy()
            rows = _rows(tokens, lengths)
            context = pb_utils.get_input_tensor_by_name(request, "CONTEXT_IDS")
            context_len = pb_utils.get_input_tensor_by_name(request, "CONTEXT_LENGTH")
            if context is not None and context_len is not None:
                contexts = _rows(context.as_numpy(), context_len.as_numpy())
            else:
                contexts = [[] for _ in rows]
            final = pb_utils.get_input_tensor_by_name(request, "IS_FINAL")
            is_final = bool(final.as_numpy().reshape(-1)[0]) if final is not None else True
            token_rows += rows
            context_rows += contexts
            finals += [is_final] * len(rows)
            counts.append((len(rows), tokens.shape[0] if tokens.ndim == 3 else 1))
        texts = self.detokenizer.decode_batch(token_rows, context_rows, finals)
        responses, start = [], 0
        for num_rows, _ in counts:
            chunk = [t.encode("utf-8") for t in texts[start:start + num_rows]]
            start += num_rows
            # One 1-D string per (row, beam), as NVIDIA's model sends them: its clients read
            # `text_output[0].decode()`.
            output = np.asarray(chunk, dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", output)]))
        return responses
