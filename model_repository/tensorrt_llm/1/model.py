"""Triton adapter of the engine model (`tensorrt_llm`, decoupled, in-flight batching).

Inputs/outputs: `ensemble.io_contract.TENSORRT_LLM` (NVIDIA's names). Parameters: NVIDIA's keys
read by `inflight.triton.params` plus `executor_backend` (builtin | tensorrtllm).

Threading: `execute` only converts and enqueues, then returns. One thread awaits executor
responses and sends them (the final flag rides on the last one); one thread polls
`is_cancelled()` every `cancellation_check_period_ms` and cancels in the executor. A request with
`stop: true` cancels the in-flight requests that carry the same request id.
"""

import json
import threading
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble.io_contract import TENSORRT_LLM
from inflight.executor.types import FinishReason, RequestError
from inflight.triton import convert, params
from inflight.triton.backend import create_executor
from preprocessing.errors import InputError

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass(eq=False)
class Pending:
    """One Triton request in flight."""

    sender: object
    request: object
    user_id: str
    rows: dict = field(default_factory=dict)  # executor id -> convert.RowState
    num_open_rows: int = 0
    is_client_cancelled: bool = False


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        values = params.read_parameters(model_config)
        self.default_exclude_input = params.get_bool(values, "exclude_input_in_output", False)
        self.cancel_period_s = params.get_int(values, "cancellation_check_period_ms", 100) / 1000.0
        config = params.executor_config(values, params.queue_size(model_config))
        if "gpt_model_path" not in values:
            raise pb_utils.TritonModelException("parameter gpt_model_path (engine_dir) is not set")
        try:
            self.executor = create_executor(values.get("executor_backend", "builtin"),
                                            values["gpt_model_path"], config)
        except RuntimeError as exc:  # one clear sentence, not a traceback
            raise pb_utils.TritonModelException(str(exc)) from None
        self.lock = threading.Lock()
        self.by_executor_id = {}  # executor id -> Pending
        self.by_user_id = {}  # client request id -> set of Pending
        self.running = True
        self.threads = [threading.Thread(target=self._respond_loop, daemon=True),
                        threading.Thread(target=self._cancel_loop, daemon=True)]
        for thread in self.threads:
            thread.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = self._inputs(request)
                if convert.is_stop_request(inputs):
                    self._stop(request, sender)
                    continue
                rows, options = convert.request_rows(inputs, self.decoupled, self.default_exclude_input)
                pending = Pending(sender, request, request.request_id(), num_open_rows=len(rows))
                with self.lock:
                    ids = self.executor.enqueue_requests(rows)
                    for index, executor_id in enumerate(ids):
                        pending.rows[executor_id] = convert.RowState(index, options)
                        self.by_executor_id[executor_id] = pending
                    self.by_user_id.setdefault(pending.user_id, set()).add(pending)
            except (RequestError, InputError) as exc:
                self._send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            except Exception as exc:  # keep serving the other requests of this batch
                self._send_error(sender, f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
        return None

    def _inputs(self, request):
        inputs = {}
        for spec in TENSORRT_LLM.inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                inputs[spec.name] = tensor.as_numpy()
        return inputs

    def _stop(self, request, sender):
        user_id = request.request_id()
        if not user_id:
            self._send_error(sender, "A request id must be provided for request cancellation",
                             pb_utils.TritonError.INVALID_ARG)
            return
        with self.lock:
            for pending in self.by_user_id.get(user_id, ()):
                for executor_id in pending.rows:
                    self.executor.cancel_request(executor_id)
        sender.send(pb_utils.InferenceResponse([]), flags=FINAL)

    @staticmethod
    def _send_error(sender, message, code):
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)

    def _respond_loop(self):
        while self.running:
            for response in self.executor.await_responses(timeout=0.05):
                with self.lock:
                    pending = self.by_executor_id.get(response.request_id)
                    if pending is None:
                        continue
                    is_row_done = response.has_error() or response.result.is_final
                    if is_row_done:
                        del self.by_executor_id[response.request_id]
                        pending.num_open_rows -= 1
                    is_last = pending.num_open_rows == 0
                    if is_last:
                        self._forget(pending)
                self._send(pending, response, is_last)

    def _send(self, pending, response, is_last):
        flags = FINAL if is_last else 0
        try:
            if response.has_error():
                error = pb_utils.TritonError(response.error_msg, pb_utils.TritonError.INTERNAL)
                pending.sender.send(pb_utils.InferenceResponse(error=error), flags=flags)
            elif pending.is_client_cancelled and response.result.finish_reasons[0] is FinishReason.CANCELLED:
                if is_last:
                    error = pb_utils.TritonError("Request was cancelled", pb_utils.TritonError.CANCELLED)
                    pending.sender.send(pb_utils.InferenceResponse(error=error), flags=flags)
            else:
                tensors = convert.response_tensors(response, pending.rows[response.request_id])
                out = [pb_utils.Tensor(name, value) for name, value in tensors.items()]
                pending.sender.send(pb_utils.InferenceResponse(out), flags=flags)
        except Exception as exc:  # the client is gone: stop generating for it
            pb_utils.Logger.log_warn(f"sending a response failed ({exc}); cancelling the request")
            self._cancel(pending)

    def _forget(self, pending):
        peers = self.by_user_id.get(pending.user_id)
        if peers is not None:
            peers.discard(pending)
            if not peers:
                del self.by_user_id[pending.user_id]

    def _cancel(self, pending):
        with self.lock:
            open_ids = [i for i in pending.rows if i in self.by_executor_id]
        for executor_id in open_ids:
            self.executor.cancel_request(executor_id)

    def _cancel_loop(self):
        stopped = threading.Event()
        while self.running and not stopped.wait(self.cancel_period_s):
            with self.lock:
                live = set(self.by_executor_id.values())
            for pending in live:
                if pending.is_client_cancelled:
                    continue
                if pending.request.is_cancelled() or pending.sender.is_cancelled():
                    pending.is_client_cancelled = True
                    self._cancel(pending)

    def finalize(self):
        self.running = False
        for thread in self.threads:
            thread.join(timeout=5)
        self.executor.shutdown()
