"""Triton adapter of the engine model (`tensorrt_llm`, decoupled, in-flight batching).

Inputs/outputs: `ensemble.io_contract.TENSORRT_LLM` (NVIDIA's names). Parameters: NVIDIA's keys
read by `ensemble.params` and `inflight.serving.params`, plus `executor_backend` (builtin |
tensorrtllm) and `engine_process` (true: the engine runs in a process of its own, off this
stub's interpreter lock; false: in a thread here, as the tensorrtllm backend always does).

`execute` converts and hands each request to `inflight.serving.request_table`, then returns. A
request carrying the ensemble's text (its direct path, `wiring.DIRECT_TEXT_INPUTS`) is
first preprocessed here with `tokenizer_dir`'s tokenizer (`preprocessing.prompts.DirectText`).
Threads: a responder makes every send (the engine's responses, and what the others post to
it: `execute`'s error and stop answers, drain ticks), a poller cancels requests whose client
cancelled or whose `timeout` parameter has passed (every `cancellation_check_period_ms`; see
`inflight.serving.deadlines`), and a housekeeper publishes the metrics,
drives a shutdown drain and unloads the model once its engine has died.

A request with `stop: true` cancels the in-flight requests that carry the same request id, as in
NVIDIA's backend. A stop whose id is a signed control id (`ensemble.control`) is ours instead:
the detokenizer's cancel relay and acknowledgements, or the launcher's drain.
"""

import functools
import json
import os
import threading

import triton_python_backend_utils as pb_utils

from ensemble import control, lifeline, params
from ensemble.errors import InputError
from ensemble.io_contract import TENSORRT_LLM
from inflight.api.types import QueueFullError, RequestError
from inflight.hosts.backend import create_executor, engine_features
from inflight.serving import convert, drain, faults, metrics
from inflight.serving.engine_client import EngineProcess, EngineStartError, InProcessEngine
from inflight.serving.params import executor_config, ignored_parameters
from inflight.serving.request_table import RequestTable
from inflight.serving.timings import Timings
from preprocessing.prompts import DirectText

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Sink:
    """`inflight.serving.pending.Sink` with pb_utils."""

    @staticmethod
    def send_tensors(sender, tensors, final):
        out = [pb_utils.Tensor(name, value) for name, value in tensors.items()]
        sender.send(pb_utils.InferenceResponse(out), flags=FINAL if final else 0)

    @staticmethod
    def send_error(sender, message, code, final=True):
        error = pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL if final else 0)

    @staticmethod
    def send_final(sender):
        sender.send(flags=FINAL)

    @staticmethod
    def send_empty_final(sender):
        """The answer to a stop request: a final response with no outputs, as NVIDIA's."""
        sender.send(pb_utils.InferenceResponse([]), flags=FINAL)

    @staticmethod
    def is_cancelled(sender):
        return sender.is_cancelled()

    @staticmethod
    def warn(message):
        pb_utils.Logger.log_warn(message)


class TritonPythonModel:
    def initialize(self, args):
        lifeline.exit_with_server()
        model_config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        values = params.read_parameters(model_config)
        self.default_exclude_input = params.get_bool(values, "exclude_input_in_output", False)
        self.limits = convert.RequestLimits.from_params(values)
        self.cancel_period_s = params.get_int(values, "cancellation_check_period_ms", 100) / 1000.0
        self.stats_period_s = params.get_int(values, "stats_check_period_ms", 100) / 1000.0
        if ignored_parameters(values):
            pb_utils.Logger.log_warn(f"parameters with no effect on this engine: {ignored_parameters(values)}")
        if "gpt_model_path" not in values:
            raise pb_utils.TritonModelException("parameter gpt_model_path (engine_dir) is not set")
        try:
            engine = self._start_engine(values, params.queue_size(model_config))
        except RuntimeError as exc:  # one clear sentence, not a traceback
            raise pb_utils.TritonModelException(str(exc)) from None
        self.model_name = args["model_name"]
        self.model_dir = args["model_repository"]
        self.ensembles = drain.dependent_ensembles(self.model_dir, self.model_name)  # a drain unloads them
        self.is_unloading = False
        self.auth = control.ControlAuth.from_env()
        self.metrics = metrics.TritonMetrics(pb_utils, args["model_name"], args["model_version"],
                                             pb_utils.Logger.log_warn)
        self.timings = Timings.from_env()
        self.table = RequestTable(engine, Sink(), self.metrics.observe, self.timings)
        self.published_stats = None
        self.input_names = frozenset(spec.name for spec in TENSORRT_LLM.inputs)
        self.direct_text = DirectText.from_params(values)  # the ensemble's text, tokenized here
        self.stopping = threading.Event()
        # Only the responder sends; the poller only asks (guarded against a final being sent).
        self.threads = [threading.Thread(target=self._respond, daemon=True),
                        threading.Thread(target=self._every, args=(self.cancel_period_s,
                                                                   self.table.poll_cancelled), daemon=True),
                        threading.Thread(target=self._every, args=(self.stats_period_s, self._housekeep),
                                         daemon=True)]
        for thread in self.threads:
            thread.start()

    def _start_engine(self, values, queue_size):
        config = executor_config(values, queue_size)  # a bad parameter fails here, in this process
        backend = values.get("executor_backend", "builtin")
        self.features = engine_features(backend, config)
        fault_spec = os.environ.get(faults.ENV_VAR)
        if backend == "builtin" and params.get_bool(values, "engine_process", True):
            try:
                return EngineProcess(values["gpt_model_path"], values, queue_size, self.stats_period_s,
                                     fault_spec)
            except EngineStartError as exc:
                raise RuntimeError(str(exc)) from None
        executor = create_executor(backend, values["gpt_model_path"], config)
        if backend == "builtin":
            faults.install_test_hook(executor.engine, fault_spec)
        return InProcessEngine(executor)

    def _respond(self):
        while not self.stopping.is_set():
            try:
                self.table.respond(timeout_s=0.05)
            except Exception as exc:  # a dead responder would leave every request hanging
                pb_utils.Logger.log_error(f"{self.model_name}: sending responses failed: "
                                          f"{type(exc).__name__}: {exc}")

    def _every(self, period_s, work):
        while not self.stopping.wait(period_s):
            work()

    def execute(self, requests):
        with self.timings.timed("execute"):
            self._execute(requests)
        return None

    def _execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = self.direct_text.resolve(self._inputs(request))
                if convert.is_stop_request(inputs):
                    self._control(request.request_id(), sender)
                    continue
                refusal = self.table.refusal()
                if refusal is not None:
                    self._answer_error(sender, refusal, "UNAVAILABLE")
                    continue
                rows, options = convert.request_rows(inputs, self.decoupled, self.default_exclude_input,
                                                     self.limits, self.features)
                self.table.add(sender, request.request_id(), rows, options,
                               timeout_s=request.timeout() / 1e6)  # Triton's is in microseconds
            except QueueFullError as exc:
                self._answer_error(sender, str(exc), "UNAVAILABLE")
            except (RequestError, InputError) as exc:
                self._answer_error(sender, str(exc), "INVALID_ARG")
            except Exception as exc:  # keep serving the other requests of this batch
                self._answer_error(sender, f"{type(exc).__name__}: {exc}", "INTERNAL")

    def _answer_error(self, sender, message, code):
        """A final error, sent by the responder thread (the only one that sends)."""
        self.table.post(functools.partial(Sink.send_error, sender, message, code))

    def _inputs(self, request):
        # One pass over what the request carries (get_input_tensor_by_name walks every input
        # once per name asked: ~40 names here).
        known = self.input_names
        return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in known}

    def _control(self, user_id, sender):
        """A stop request: by client request id, or one of our signed control requests."""
        if not user_id:
            self._answer_error(sender, "A request id must be provided for request cancellation", "INVALID_ARG")
            return
        grace_s = self.auth.parse_drain_id(user_id)
        if grace_s is not None:
            self._begin_drain(grace_s, sender)  # answered once nothing is left in flight
            return
        ack = self.auth.parse_ack_id(user_id)
        if ack is not None:
            self.table.ack(*ack)
        elif (key := self.auth.parse_cancel_id(user_id)) is not None:
            self.table.stop(user_id, key)  # the detokenizer saw a cancelled chunk
        elif not control.is_control_id(user_id):  # a forged or stale one stops nothing
            self.table.stop(user_id, None)
        self.table.post(functools.partial(Sink.send_empty_final, sender))

    def _begin_drain(self, grace_s, sender):
        is_first, num_pending = self.table.begin_drain(grace_s, sender)
        if not is_first:
            return
        pb_utils.Logger.log_info(f"{self.model_name}: draining for shutdown; {num_pending} requests "
                                 f"in flight get {grace_s:g} s to finish")
        # New ensemble requests then fail at once, and readiness turns false.
        threading.Thread(target=drain.unload_ensembles, daemon=True,
                         args=(self.ensembles, pb_utils.unload_model, pb_utils.Logger.log_warn)).start()

    def _housekeep(self):
        report = self.timings.report()
        if report is not None:
            pb_utils.Logger.log_info(f"{self.model_name}: {report}")
        self._unload_if_dead()
        self.table.post(self.table.tick, once=True)  # it may answer and fail requests
        stats = self.table.latest_stats
        if stats is not None and stats is not self.published_stats:  # each set is a round trip
            self.published_stats = stats
            self.metrics.publish(stats)
        self.metrics.flush_finished()  # after the gauges: a burst of finished requests is slow

    def _unload_if_dead(self):
        """A dead engine must not look ready: unload this model (and the ensemble using it)."""
        if self.is_unloading or self.table.dead_message is None:
            return
        self.is_unloading = True
        pb_utils.Logger.log_error(f"{self.model_name}: {self.table.dead_message}; unloading the model")

        def unload():
            try:
                pb_utils.unload_model(self.model_name, unload_dependents=True)
            except Exception as exc:  # only possible with --model-control-mode=explicit
                pb_utils.Logger.log_error(f"could not unload {self.model_name}: {exc}")

        threading.Thread(target=unload, daemon=True).start()

    def finalize(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        # Normally nothing is left: Triton unloads a model once its requests are done.
        self.table.close()
        self.table.engine.shutdown()
        self.metrics.close()
        lifeline.skip_teardown_at_exit()  # as the other models: the unload ends with the stub
