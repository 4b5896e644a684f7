"""Control requests between our own processes, which clients can neither forge nor guess.

Two kinds reach the engine model (`tensorrt_llm`) as NVIDIA `stop` requests, told apart from a
client's stop by their request id:

- **cancel relay** (postprocessing → tensorrt_llm): the detokenizer saw a cancelled chunk and
  asks the engine to stop the request that chunk came from, named by the chunk's
  `request_key`. Id: `inflight-cancel-key:<key>:<mac>`.
- **ack** (postprocessing → tensorrt_llm): how many chunks of each stream the detokenizer has
  decoded, and since when it has been idle; how the engine model learns that Triton dropped a
  cancelled stream's chunks (see inflight/serving/delivery.py).
  Id: `inflight-ack:<d|k>:<drained_before_us or ->:<key>.<count>,...:<mac>`; `d`: the
  detokenizer may never see a cancelled chunk (dynamic batching), so missing ones mean dropped;
  `k`: it sees every chunk, and relays cancellations itself. Only its MAC keeps a
  client from forging one; with no secret set, acks are refused.
- **drain** (launcher → tensorrt_llm): the server is shutting down; refuse new requests, let
  the ones in flight finish for `grace_ms`, then end the rest.
  Id: `inflight-drain:<grace_ms>:<issued_ms>:<mac>`; valid for `DRAIN_ID_TTL_S` after it was
  issued, so one seen in a verbose log cannot stop a later run (each run has its own secret
  anyway) or, a minute later, this one.

Request keys are 64 random bits, drawn per request, so no client can guess another's. The MAC
is an HMAC-SHA256 under a secret the launcher draws per run and hands to tritonserver (and so to
every python stub) in the environment variable `INFLIGHT_CONTROL_SECRET`: never in the command
line (world-readable), a config parameter (readable through the model-config API) or a log. So
even a client that learns a key cannot stop that request, and only the launcher can drain.
Without the variable (tritonserver started by hand) cancel ids carry no MAC, the key's random
bits alone protect them, and drain ids are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass

from ensemble.io_contract import CANCEL_KEY_PREFIX

SECRET_ENV_VAR = "INFLIGHT_CONTROL_SECRET"
DRAIN_PREFIX = "inflight-drain:"
ACK_PREFIX = "inflight-ack:"
DRAIN_ID_TTL_S = 60
_MAC_HEX_CHARS = 32  # 128 bits of HMAC-SHA256


def new_request_key(taken=()) -> int:
    """A fresh random, nonzero 64-bit key (it travels as a UINT64 tensor) not in `taken`."""
    while True:
        key = secrets.randbits(64)
        if key and key not in taken:
            return key


def new_secret() -> str:
    return secrets.token_hex(32)


@dataclass(frozen=True)
class ControlAuth:
    """Signs and checks control request ids. `secret` None: unsigned cancel ids, no drain."""

    secret: bytes | None

    @classmethod
    def from_env(cls, environ=os.environ) -> "ControlAuth":
        value = environ.get(SECRET_ENV_VAR, "")
        return cls(value.encode() if value else None)

    def _mac(self, message: str) -> str:
        return hmac.new(self.secret, message.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX_CHARS]

    def _verify(self, message: str, mac: str) -> bool:
        return self.secret is not None and hmac.compare_digest(self._mac(message), mac)

    # ----- cancel relay --------------------------------------------------------------------

    def cancel_id(self, key: int) -> str:
        if self.secret is None:
            return f"{CANCEL_KEY_PREFIX}{key}"
        return f"{CANCEL_KEY_PREFIX}{key}:{self._mac(f'cancel:{key}')}"

    def parse_cancel_id(self, request_id: str) -> int | None:
        """The key a genuine cancel id names; None if `request_id` is not one (forged, unsigned
        while a secret is set, or malformed)."""
        if not request_id.startswith(CANCEL_KEY_PREFIX):
            return None
        key, _, mac = request_id[len(CANCEL_KEY_PREFIX):].partition(":")
        if not key.isdigit():
            return None
        if self.secret is None:
            return int(key) if not mac else None
        return int(key) if self._verify(f"cancel:{key}", mac) else None

    # ----- acknowledgements ----------------------------------------------------------------

    def ack_id(self, counts: dict[int, int], drained_before_s: float | None, may_drop: bool) -> str:
        if self.secret is None:
            raise ValueError(f"an acknowledgement needs {SECRET_ENV_VAR}")
        drained = "-" if drained_before_s is None else str(round(drained_before_s * 1e6))
        body = f"{'d' if may_drop else 'k'}:{drained}:" + ",".join(f"{k}.{n}" for k, n in counts.items())
        return f"{ACK_PREFIX}{body}:{self._mac(f'ack:{body}')}"

    def parse_ack_id(self, request_id: str) -> tuple[dict[int, int], float | None, bool] | None:
        """(key → count, drained_before_s, may_drop) of a genuine acknowledgement; None otherwise."""
        if not request_id.startswith(ACK_PREFIX):
            return None
        body, _, mac = request_id[len(ACK_PREFIX):].rpartition(":")
        if not self._verify(f"ack:{body}", mac):
            return None
        mode, _, rest = body.partition(":")
        drained, _, pairs = rest.partition(":")
        try:
            counts = {int(k): int(n) for k, _, n in (p.partition(".") for p in pairs.split(",") if p)}
            return counts, None if drained == "-" else int(drained) / 1e6, mode == "d"
        except ValueError:
            return None

    # ----- drain ---------------------------------------------------------------------------

    def drain_id(self, grace_s: float, now_s: float | None = None) -> str:
        if self.secret is None:
            raise ValueError(f"a drain request needs {SECRET_ENV_VAR}")
        grace_ms = max(0, round(grace_s * 1000))
        issued_ms = round((time.time() if now_s is None else now_s) * 1000)
        return f"{DRAIN_PREFIX}{grace_ms}:{issued_ms}:{self._mac(f'drain:{grace_ms}:{issued_ms}')}"

    def parse_drain_id(self, request_id: str, now_s: float | None = None) -> float | None:
        """The grace period in seconds of a genuine, fresh drain id; None otherwise."""
        if not request_id.startswith(DRAIN_PREFIX):
            return None
        grace_ms, issued_ms, mac = (request_id[len(DRAIN_PREFIX):].split(":") + ["", ""])[:3]
        if not (grace_ms.isdigit() and issued_ms.isdigit()):
            return None
        age_s = (time.time() if now_s is None else now_s) - int(issued_ms) / 1000
        if abs(age_s) > DRAIN_ID_TTL_S or not self._verify(f"drain:{grace_ms}:{issued_ms}", mac):
            return None
        return int(grace_ms) / 1000.0


def is_control_id(request_id: str) -> bool:
    """Ids in our control namespace never match a client's stop by request id."""
    return request_id.startswith((CANCEL_KEY_PREFIX, DRAIN_PREFIX, ACK_PREFIX))
