"""Triton adapter of the detokenizer model (`postprocessing`).

Inputs/outputs: `ensemble.io_contract.POSTPROCESSING`: NVIDIA's TOKENS_BATCH [beam, len] and
SEQUENCE_LENGTH [beam] → OUTPUT, plus the optional stream context (CONTEXT_IDS,
CONTEXT_LENGTH, IS_FINAL) that the engine model sends with each streamed chunk so the chunk is
decoded in context without state here. Parameters: tokenizer_dir, skip_special_tokens
(default true), trust_remote_code (default false).

Dynamic batching: one execute decodes the chunks of every request queued, with one vectorised
`batch_decode`; a single instance takes its queue in order, so each request's chunks stay in
order (`preserve_ordering` keeps that on Triton versions that run ensemble callbacks in a pool).

Cancellation: Triton does not tell the engine, the ensemble's running step, that a client left;
it cancels only the steps created afterwards. Without dynamic batching (the shipped config) a
cancelled chunk reaches `execute`, and this model relays its cancellation (it asks Triton about
a stream at most every `CANCEL_CHECK_S`: each question is a round trip to the server). With dynamic
batching the batcher drops it before `execute`; then `tensorrt_llm` infers the drop from
acknowledgements. Either way this model acknowledges, every `ACK_PERIOD_S`, the chunks it
decoded (`postprocessing.acks`): `tensorrt_llm` learns from them how far behind the detokenizer
is (and, only with dynamic batching, which streams were dropped; `inflight.serving.delivery`).
Both control requests are signed (`ensemble.control`), so no client can send one.
"""

import collections
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from ensemble import lifeline, params
from ensemble.control import ControlAuth
from postprocessing.acks import AckLedger
from postprocessing.detokenizer import Detokenizer
from preprocessing.loader import load_tokenizer


ACK_PERIOD_S = 0.05
CANCEL_CHECK_S = 0.1  # tensorrt_llm's default cancellation_check_period_ms
MAX_ASKED_KEYS = 4096
ONE = np.ones((1, 1), dtype=np.int32)


def _stop_request(request_id):
    """NVIDIA's `stop` request to the engine model, carrying one of our control ids."""
    return pb_utils.InferenceRequest(
        model_name="tensorrt_llm", requested_output_names=[], request_id=request_id,
        inputs=[pb_utils.Tensor("input_ids", ONE), pb_utils.Tensor("input_lengths", ONE),
                pb_utils.Tensor("request_output_len", ONE),
                pb_utils.Tensor("stop", np.ones((1, 1), dtype=np.bool_))])


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
                "order, and acknowledgements their meaning, only with one instance")
        self.is_batched = "dynamic_batching" in model_config
        values = params.read_parameters(model_config)
        if "tokenizer_dir" not in values:
            raise pb_utils.TritonModelException("parameter tokenizer_dir is not set")
        tokenizer = load_tokenizer(values["tokenizer_dir"],
                                   trust_remote_code=params.get_bool(values, "trust_remote_code", False))
        self.detokenizer = Detokenizer(tokenizer, params.get_bool(values, "skip_special_tokens", True))
        self.stopped_keys = collections.deque(maxlen=1024)  # relayed already
        self.asked_s = {}  # request key -> when Triton was last asked if it was cancelled
        self.auth = ControlAuth.from_env()
        self.ledger = AckLedger()
        self.stopping = threading.Event()
        self.acker = None
        if self.auth.secret is not None:  # unsigned acks would let a client stop others' streams
            self.acker = threading.Thread(target=self._acknowledge, daemon=True)
            self.acker.start()

    def _acknowledge(self):
        while not self.stopping.wait(ACK_PERIOD_S):
            report = self.ledger.report()
            if report is None:
                continue
            try:
                ack = self.auth.ack_id(*report, may_drop=self.is_batched)
                for _ in _stop_request(ack).exec(decoupled=True):
                    pass
            except Exception as exc:  # the engine model is gone (unloading); keep decoding
                pb_utils.Logger.log_warn(f"acknowledging chunks failed: {exc}")
                self.stopping.wait(1.0)  # not time.sleep: finalize must not wait for it

    def _should_ask(self, key, is_final, now_s):
        """Ask Triton whether this chunk's client cancelled? Each question is a round trip to
        the server, so a stream is asked at most every CANCEL_CHECK_S, from its second chunk on
        (the first one's question sat on every time to first token, ~0.3 ms), its final chunk
        never (nothing is left to stop). With dynamic batching Triton drops cancelled requests
        before execute: never worth asking."""
        if self.is_batched or key is None:
            return False
        if is_final:
            self.asked_s.pop(key, None)
            return False
        last_s = self.asked_s.get(key)
        if last_s is not None and now_s - last_s < CANCEL_CHECK_S:
            return False
        if len(self.asked_s) > MAX_ASKED_KEYS:  # streams whose final never came (cancelled)
            self.asked_s = {k: t for k, t in self.asked_s.items() if now_s - t < 60.0}
        self.asked_s[key] = now_s
        return last_s is not None

    def _relay_cancellation(self, key):
        if key in self.stopped_keys:
            return
        self.stopped_keys.append(key)
        for _ in _stop_request(self.auth.cancel_id(key)).exec(decoupled=True):
            pass

    def execute(self, requests):
        self.ledger.begin()
        chunks = []
        try:
            return self._decode(requests, chunks)
        finally:
            self.ledger.end(chunks)

    def _decode(self, requests, chunks):
        # Decode the whole dynamic batch in one call; answer each request with its own rows.
        token_rows, context_rows, finals, counts = [], [], [], []
        now_s = time.monotonic()
        for request in requests:
            # One pass over the inputs (pb_utils.get_input_tensor_by_name walks them per name).
            inputs = {tensor.name(): tensor for tensor in request.inputs()}
            final = inputs.get("IS_FINAL")
            is_final = bool(final.as_numpy().reshape(-1)[0]) if final is not None else True
            key = inputs.get("REQUEST_KEY")
            key = int(key.as_numpy().reshape(-1)[0]) if key is not None else None
            if key is not None:
                chunks.append((key, is_final))
            if self._should_ask(key, is_final, now_s) and request.is_cancelled():
                self._relay_cancellation(key)
            tokens = inputs["TOKENS_BATCH"].as_numpy()
            rows = _rows(tokens, inputs["SEQUENCE_LENGTH"].as_numpy())
            context, context_len = inputs.get("CONTEXT_IDS"), inputs.get("CONTEXT_LENGTH")
            if context is not None and context_len is not None:
                contexts = _rows(context.as_numpy(), context_len.as_numpy())
            else:
                contexts = [[] for _ in rows]
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

    def finalize(self):
        self.stopping.set()
        if self.acker is not None:
            self.acker.join(timeout=5)
        # No interpreter teardown (ensemble.lifeline): with transformers loaded it held every
        # unload of this model for 9-30 s on a busy machine.
        lifeline.skip_teardown_at_exit()
