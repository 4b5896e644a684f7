"""Triton adapter of the engine model (`tensorrt_llm`, decoupled, in-flight batching).

Inputs/outputs: `ensemble.io_contract.TENSORRT_LLM` (NVIDIA's names). Parameters: NVIDIA's keys
read by `ensemble.params` and `inflight.serving.params` plus `executor_backend` (builtin | tensorrtllm).

Threading: `execute` only converts and enqueues, then returns. One thread awaits executor
responses and sends them (the final flag rides on the last one); one thread polls
`is_cancelled()` every `cancellation_check_period_ms` and cancels in the executor; one thread
refreshes the metrics and drives a shutdown drain (`inflight.serving.drain`).

A request with `stop: true` cancels the in-flight requests that carry the same request id, as in
NVIDIA's backend: the request id is the handle, so whoever knows it can stop those requests. A
stop whose id is a signed control id (`ensemble.control`) is ours instead: the detokenizer's
cancel relay, naming one request by its random `request_key`, or the launcher's drain.
"""

import json
import os
import threading
import time
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from ensemble import control, lifeline, params
from ensemble.errors import InputError
from ensemble.io_contract import TENSORRT_LLM
from inflight.executor.types import FinishReason, QueueFullError, RequestError
from inflight.serving import convert, drain, faults, metrics
from inflight.serving.backend import create_executor, engine_features
from inflight.serving.params import executor_config, ignored_parameters

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass(eq=False)
class Pending:
    """One Triton request in flight."""

    sender: object
    user_id: str
    key: int  # random, see ensemble.control
    rows: dict = field(default_factory=dict)  # executor id -> convert.RowState
    num_open_rows: int = 0
    is_client_cancelled: bool = False
    # Triton frees the response sender once the final flag is sent; touching it afterwards
    # (even is_cancelled()) crashes the server. `lock` orders sends and checks; `is_done` is
    # set, under it, before the final send.
    lock: threading.Lock = field(default_factory=threading.Lock)
    is_done: bool = False


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        values = params.read_parameters(model_config)
        self.default_exclude_input = params.get_bool(values, "exclude_input_in_output", False)
        self.limits = convert.RequestLimits(params.get_int(values, "max_input_len", None),
                                            params.get_int(values, "max_output_len", None))
        self.cancel_period_s = params.get_int(values, "cancellation_check_period_ms", 100) / 1000.0
        self.stats_period_s = params.get_int(values, "stats_check_period_ms", 100) / 1000.0
        config = executor_config(values, params.queue_size(model_config))
        if ignored_parameters(values):
            pb_utils.Logger.log_warn(f"parameters with no effect on this engine: {ignored_parameters(values)}")
        if "gpt_model_path" not in values:
            raise pb_utils.TritonModelException("parameter gpt_model_path (engine_dir) is not set")
        backend = values.get("executor_backend", "builtin")
        self.features = engine_features(backend, config)
        try:
            self.executor = create_executor(backend, values["gpt_model_path"], config)
        except RuntimeError as exc:  # one clear sentence, not a traceback
            raise pb_utils.TritonModelException(str(exc)) from None
        faults.install_test_hook(self.executor, os.environ.get(faults.ENV_VAR))
        self.model_name = args["model_name"]
        self.model_dir = args["model_repository"]
        self.is_unloading = False
        self.auth = control.ControlAuth.from_env()
        self.drain = drain.Drain()
        self.lock = threading.Lock()
        self.by_executor_id = {}  # executor id -> Pending
        self.by_user_id = {}  # client request id -> set of Pending
        self.by_key = {}  # request key -> Pending
        self.running = True
        self._create_metrics(args["model_name"], args["model_version"])
        self.threads = [threading.Thread(target=self._respond_loop, daemon=True),
                        threading.Thread(target=self._cancel_loop, daemon=True),
                        threading.Thread(target=self._stats_loop, daemon=True)]
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
                if not self.executor.can_enqueue_requests():
                    self._send_error(sender, "the engine has stopped and the model is being unloaded; "
                                     "see the server log", pb_utils.TritonError.UNAVAILABLE)
                    continue
                if self.drain.is_draining:
                    self._send_error(sender, f"{drain.SHUTDOWN_MESSAGE}; retry on another server",
                                     pb_utils.TritonError.UNAVAILABLE)
                    continue
                rows, options = convert.request_rows(inputs, self.decoupled, self.default_exclude_input,
                                                     self.limits, self.features)
                with self.lock:
                    pending = Pending(sender, request.request_id(), control.new_request_key(self.by_key),
                                      num_open_rows=len(rows))
                    ids = self.executor.enqueue_requests(rows)
                    for index, executor_id in enumerate(ids):
                        pending.rows[executor_id] = convert.RowState(index, options, pending.key)
                        self.by_executor_id[executor_id] = pending
                    self.by_user_id.setdefault(pending.user_id, set()).add(pending)
                    self.by_key[pending.key] = pending
            except QueueFullError as exc:
                self._send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
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
        grace_s = self.auth.parse_drain_id(user_id)
        if grace_s is not None:
            self._begin_drain(grace_s, sender)  # answered once nothing is left in flight
            return
        key = self.auth.parse_cancel_id(user_id)
        with self.lock:
            if key is not None:  # the detokenizer saw a cancelled chunk of this request
                targets = [self.by_key[key]] if key in self.by_key else []
                for pending in targets:
                    pending.is_client_cancelled = True
            elif control.is_control_id(user_id):  # forged or stale: it stops nothing
                targets = []
            else:
                targets = list(self.by_user_id.get(user_id, ()))
        for pending in targets:
            self._cancel(pending)
        sender.send(pb_utils.InferenceResponse([]), flags=FINAL)

    def _begin_drain(self, grace_s, sender):
        with self.lock:
            is_first = self.drain.begin(grace_s, sender, time.monotonic())
            num_pending = len(self.by_key)
        if not is_first:
            return
        pb_utils.Logger.log_info(f"{self.model_name}: draining for shutdown; {num_pending} requests "
                                 f"in flight get {grace_s:g} s to finish")
        # New ensemble requests then fail at once, and readiness turns false.
        threading.Thread(target=drain.unload_dependent_ensembles, daemon=True,
                         args=(self.model_dir, self.model_name, pb_utils.unload_model,
                               pb_utils.Logger.log_warn)).start()

    def _drain_tick(self):
        """Ends overdue requests, and answers the drain requests once none is left."""
        if not self.drain.is_draining:
            return
        if self.drain.is_overdue(time.monotonic()):
            self._fail_all(drain.overdue_message(self.drain.grace_s), pb_utils.TritonError.UNAVAILABLE)
        with self.lock:
            waiters = self.drain.take_waiters() if not self.by_key else []
        self._answer(waiters)

    @staticmethod
    def _answer(senders):
        for sender in senders:
            try:
                sender.send(pb_utils.InferenceResponse([]), flags=FINAL)
            except Exception as exc:  # the launcher went away; keep draining
                pb_utils.Logger.log_warn(f"answering a drain request failed: {exc}")

    def _fail_all(self, message, code):
        """End every request in flight with a final error, and cancel it in the executor."""
        with self.lock:
            victims = list(self.by_key.values())
            open_ids = {p: [i for i in p.rows if self.by_executor_id.pop(i, None) is not None]
                        for p in victims}
            for pending in victims:
                self._forget(pending)
        for pending, executor_ids in open_ids.items():
            for executor_id in executor_ids:
                self.executor.cancel_request(executor_id)
            with pending.lock:
                if pending.is_done:
                    continue
                pending.is_done = True
                try:
                    if pending.is_client_cancelled:  # nobody listens; let the ensemble finish
                        pending.sender.send(flags=FINAL)
                    else:
                        self._send_error(pending.sender, message, code)
                except Exception as exc:
                    pb_utils.Logger.log_warn(f"ending a request failed: {exc}")

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
                        if not response.has_error():
                            self._observe_token_lengths(response.result)
                    is_last = pending.num_open_rows == 0
                    if is_last:
                        self._forget(pending)
                self._send(pending, response, is_last)

    def _send(self, pending, response, is_last):
        with pending.lock:
            if pending.is_done:
                return
            pending.is_done = is_last
            self._send_locked(pending, response, is_last)

    def _send_locked(self, pending, response, is_last):
        flags = FINAL if is_last else 0
        try:
            if response.has_error():
                error = pb_utils.TritonError(response.error_msg, pb_utils.TritonError.INTERNAL)
                pending.sender.send(pb_utils.InferenceResponse(error=error), flags=flags)
            elif pending.is_client_cancelled and response.result.finish_reasons[0] is FinishReason.CANCELLED:
                # Nobody listens any more. A flags-only final lets an enclosing ensemble finish
                # (an error response here left some ensemble requests in flight for ever).
                if is_last:
                    pending.sender.send(flags=flags)
            else:
                tensors = convert.response_tensors(response, pending.rows[response.request_id])
                out = [pb_utils.Tensor(name, value) for name, value in tensors.items()]
                pending.sender.send(pb_utils.InferenceResponse(out), flags=flags)
        except Exception as exc:  # the client is gone: stop generating for it
            pb_utils.Logger.log_warn(f"sending a response failed ({exc}); cancelling the request")
            self._cancel(pending)

    def _forget(self, pending):
        self.by_key.pop(pending.key, None)
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
                with pending.lock:
                    if pending.is_done or pending.is_client_cancelled:
                        continue
                    pending.is_client_cancelled = pending.sender.is_cancelled()
                if pending.is_client_cancelled:
                    self._cancel(pending)

    def _create_metrics(self, model_name, model_version):
        labels = {"model": model_name, "version": str(model_version)}
        self.gauges, self.histograms, self.metric_families = {}, {}, []
        try:
            for name, (label_key, description) in metrics.GAUGE_FAMILIES.items():
                family = pb_utils.MetricFamily(name=name, description=description,
                                               kind=pb_utils.MetricFamily.GAUGE)
                self.metric_families.append(family)
                self.gauges[name] = (family, label_key)
            for name, (label_key, label, description) in metrics.HISTOGRAM_FAMILIES.items():
                family = pb_utils.MetricFamily(name=name, description=description,
                                               kind=pb_utils.MetricFamily.HISTOGRAM)
                self.metric_families.append(family)
                self.histograms[name] = family.Metric(labels={**labels, label_key: label},
                                                      buckets=metrics.TOKEN_LEN_BUCKETS)
        except Exception as exc:  # the server runs with --allow-metrics=false
            pb_utils.Logger.log_warn(f"metrics disabled: {exc}")
            self.gauges, self.histograms = {}, {}
        self.gauge_metrics = {}
        self.metric_labels = labels

    def _observe_token_lengths(self, result):
        if self.histograms:
            self.histograms["nv_llm_input_token_len"].observe(result.num_input_tokens)
            self.histograms["nv_llm_output_token_len"].observe(result.num_output_tokens)

    def _unload_if_dead(self):
        """A dead engine must not look ready: unload this model (and the ensemble using it)."""
        if self.is_unloading or self.executor.can_enqueue_requests():
            return
        self.is_unloading = True
        pb_utils.Logger.log_error(f"{self.model_name}: the engine stopped; unloading the model")

        def unload():
            try:
                pb_utils.unload_model(self.model_name, unload_dependents=True)
            except Exception as exc:  # only possible with --model-control-mode=explicit
                pb_utils.Logger.log_error(f"could not unload {self.model_name}: {exc}")

        threading.Thread(target=unload, daemon=True).start()

    def _stats_loop(self):
        stopped = threading.Event()
        while self.running and not stopped.wait(self.stats_period_s):
            self._unload_if_dead()
            self._drain_tick()
            if not self.gauges:
                continue
            stats = self.executor.get_latest_iteration_stats()
            latest = stats[-1] if stats else self.executor.get_current_stats()
            for (family_name, label), value in metrics.gauge_values(latest).items():
                key = (family_name, label)
                if key not in self.gauge_metrics:
                    family, label_key = self.gauges[family_name]
                    self.gauge_metrics[key] = family.Metric(labels={**self.metric_labels, label_key: label})
                self.gauge_metrics[key].set(value)

    def finalize(self):
        self.running = False
        for thread in self.threads:
            thread.join(timeout=5)
        # Normally nothing is left: Triton unloads a model once its requests are done.
        self._fail_all("the model is being unloaded", pb_utils.TritonError.UNAVAILABLE)
        with self.lock:
            waiters = self.drain.take_waiters()
        self._answer(waiters)
        self.executor.shutdown()
        # Metrics must go before their families.
        self.gauge_metrics.clear()
        self.histograms.clear()
        self.metric_families.clear()
