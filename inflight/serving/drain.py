"""The engine model's part in a graceful shutdown (a drain); no Triton import.

On SIGTERM or SIGINT the launcher sends the engine model a signed drain request
(`ensemble.control`). From then on the model:
1. refuses new requests with `SHUTDOWN_MESSAGE` (status UNAVAILABLE);
2. unloads the ensembles that use it (`dependent_ensembles`), so Triton rejects new ensemble
   requests at once and `/v2/health/ready` answers 400 while the ones in flight finish;
3. lets the requests in flight run until the grace period ends, then ends each of the rest with
   a final error (`overdue_message`);
4. answers the drain request once nothing is left in flight. The launcher then stops
   tritonserver, which has nothing left to wait for.

Triton's own drain on SIGTERM (`--exit-timeout-secs`) does not work for a streaming ensemble
in 2.51 (measured): HTTP stops answering at once, every model's scheduler stops accepting
requests, and the ensemble streams in flight receive nothing more. They hang until the exit
timeout, after which the server crashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

SHUTDOWN_MESSAGE = "the server is shutting down"


def overdue_message(grace_s: float) -> str:
    if grace_s <= 0:  # a second signal, or --exit_timeout 0
        return f"{SHUTDOWN_MESSAGE}: this request was stopped without a drain period"
    return (f"{SHUTDOWN_MESSAGE}: this request was still running when the {grace_s:g} s drain "
            "period ended, so it was stopped")


@dataclass
class Drain:
    """Drain state. Not thread-safe: the engine model holds its lock around every call."""

    deadline_s: float | None = None  # time.monotonic() at which the rest are ended
    grace_s: float = 0.0
    waiters: list = field(default_factory=list)  # senders of drain requests, answered when idle

    @property
    def is_draining(self) -> bool:
        return self.deadline_s is not None

    def begin(self, grace_s: float, waiter, now_s: float) -> bool:
        """Start the drain, or bring its end forward (a second signal asks for grace 0).
        True the first time."""
        is_first = self.deadline_s is None
        if is_first or now_s + grace_s < self.deadline_s:
            self.deadline_s = now_s + grace_s
            self.grace_s = grace_s
        self.waiters.append(waiter)
        return is_first

    def is_overdue(self, now_s: float) -> bool:
        return self.deadline_s is not None and now_s >= self.deadline_s

    def take_waiters(self) -> list:
        waiters, self.waiters = self.waiters, []
        return waiters


def dependent_ensembles(model_dir: str | Path, model_name: str) -> list[str]:
    """Names of the ensembles, in the repository that holds `model_dir`, with a step that
    runs `model_name`."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    names = []
    for path in sorted(Path(model_dir).resolve().parent.glob("*/config.pbtxt")):
        try:
            config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        except (OSError, text_format.ParseError):
            continue
        steps = config.ensemble_scheduling.step
        if config.platform == "ensemble" and any(s.model_name == model_name for s in steps):
            names.append(config.name or path.parent.name)
    return names


def unload_ensembles(names: list[str], unload, log_warn) -> None:
    """Unload (`unload(name)`, i.e. `pb_utils.unload_model`) each of `names` (the model's
    `dependent_ensembles`, found when it loaded: parsing the repository's configs takes about a
    second on a 2-core machine, and a drain with nothing in flight is answered at once, so the
    launcher's SIGTERM could come first; the stub then crashed in its unload call, 2 stops of 6)."""
    for name in names:
        try:
            unload(name)
        except Exception as exc:
            log_warn(f"could not unload {name} for the drain: {exc}")
