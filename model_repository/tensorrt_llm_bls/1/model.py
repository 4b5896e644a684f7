"""Triton adapter of `tensorrt_llm_bls`: the ensemble's inputs and outputs, run as BLS calls.

Inputs/outputs: `ensemble.io_contract.TENSORRT_LLM_BLS` (NVIDIA's names). Parameters (NVIDIA's):
accumulate_tokens (default false), tensorrt_llm_model_name (default tensorrt_llm),
tensorrt_llm_draft_model_name (a draft model for num_draft_tokens > 0: `bls.speculative`); a
multimodal model name is refused, since this repository has none. The flow itself is
`bls.pipeline`.

Each request runs on its own thread, so one instance serves many requests at once (NVIDIA's
model serves one at a time per instance). Every request ends with exactly one final response:
the last text, or one error naming the problem. A client that cancels stops the engine request.
"""

import json
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from bls.pipeline import Pipeline
from ensemble import lifeline, params
from ensemble.errors import InputError
from inflight.api.types import RequestError

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _TritonModels:
    """`bls.pipeline.Models` over BLS requests."""

    @staticmethod
    def _request(model, inputs, outputs, request_id=""):
        tensors = [pb_utils.Tensor(name, value) for name, value in inputs.items()]
        return pb_utils.InferenceRequest(model_name=model, inputs=tensors,
                                         requested_output_names=outputs, request_id=request_id)

    @staticmethod
    def _tensors(response):
        if response.has_error():
            raise InputError(response.error().message())
        return {t.name(): t.as_numpy() for t in response.output_tensors()}

    def infer(self, model, inputs, outputs):
        return self._tensors(self._request(model, inputs, outputs).exec())

    def stream(self, model, inputs, outputs, request_id):
        for response in self._request(model, inputs, outputs, request_id).exec(decoupled=True):
            tensors = self._tensors(response)
            if tensors:  # the last response of a decoupled model may be a bare final flag
                yield tensors

    def stop(self, model, request_id):
        one = np.ones((1, 1), dtype=np.int32)
        stop = self._request(model, {"input_ids": one, "input_lengths": one, "request_output_len": one,
                                     "stop": np.ones((1, 1), dtype=np.bool_)}, [], request_id)
        for _ in stop.exec(decoupled=True):
            pass


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        model_config = json.loads(args["model_config"])
        values = params.read_parameters(model_config)
        if "multimodal_encoders_name" in values:
            raise pb_utils.TritonModelException(
                "parameter multimodal_encoders_name is set, but this repository has no multimodal model")
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        self.pipeline = Pipeline(_TritonModels(), values.get("tensorrt_llm_model_name", "tensorrt_llm"),
                                 params.get_bool(values, "accumulate_tokens", False), self.decoupled,
                                 values.get("tensorrt_llm_draft_model_name", ""))

    def execute(self, requests):
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            threading.Thread(target=self._serve, args=(request.get_response_sender(), request, inputs),
                             daemon=True).start()
        return None

    def _serve(self, sender, request, inputs):
        request_id = f"bls-{uuid.uuid4().hex}"  # unguessable: only this thread can stop it
        is_cancelled = sender.is_cancelled if self.decoupled else request.is_cancelled
        last = None
        try:
            for response in self.pipeline.run(inputs, request_id, is_cancelled):
                if self.decoupled:
                    sender.send(self._response(response))
                else:
                    last = response
            if self.decoupled:
                sender.send(flags=FINAL)
            elif last is None:
                self._error(sender, "the request was cancelled", pb_utils.TritonError.CANCELLED)
            else:
                sender.send(self._response(last), flags=FINAL)
        except (InputError, RequestError) as exc:
            self._error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
        except Exception as exc:  # one request fails, the model carries on
            self._error(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)

    @staticmethod
    def _response(tensors):
        return pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in tensors.items()])

    @staticmethod
    def _error(sender, message, code):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
