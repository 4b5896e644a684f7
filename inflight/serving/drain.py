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

import re
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


# A token of protobuf's text format: a string, a comment, a word (field name, enum value, number)
# or one punctuation mark.
_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'|#[^\n]*|[\w.+-]+|\S')


def ensemble_steps(text: str) -> tuple[str, list[str]] | None:
    """(`name`, the `model_name` of every `ensemble_scheduling` step) of a config.pbtxt whose
    `platform` is "ensemble"; None for any other model, or a text whose brackets do not match.

    A scan of the text format's tokens, not a protobuf parse: importing protobuf and Triton's
    ModelConfig (through tritonclient.grpc) and parsing the repository with them cost the engine
    model's initialize about 0.1 s on an idle 2-core machine and up to a second on a loaded one,
    at every server start; this takes under 0.01 s."""
    frames: list[tuple[str, str | None]] = []  # ("{" or "[", the field it is the value of)
    key: str | None = None
    after_colon = False
    fields: dict[tuple[str | None, ...], list[str]] = {}
    for token in _TOKEN.findall(text):
        if token[0] == "#" or token in (",", ";"):
            continue
        if token in ("{", "["):
            if frames and frames[-1][0] == "[" and not after_colon:
                key = frames[-1][1]  # a message in a list: its field is the list's
            frames.append((token, key))
            after_colon = False
        elif token in ("}", "]"):
            if not frames or frames.pop()[0] != {"}": "{", "]": "["}[token]:
                return None
        elif token == ":":
            after_colon = True
        elif after_colon or (frames and frames[-1][0] == "["):  # a value
            path = tuple(name for bracket, name in frames if bracket == "{") + (key,)
            value = re.sub(r"\\(.)", r"\1", token[1:-1]) if token[0] in "\"'" else token
            fields.setdefault(path, []).append(value)
            after_colon = False
        else:
            key = token
    if frames or fields.get(("platform",)) != ["ensemble"]:
        return None
    return (fields.get(("name",)) or [""])[0], fields.get(("ensemble_scheduling", "step", "model_name"), [])


def dependent_ensembles(model_dir: str | Path, model_name: str) -> list[str]:
    """Names of the ensembles, in the repository that holds `model_dir`, with a step that
    runs `model_name`."""
    names = []
    for path in sorted(Path(model_dir).resolve().parent.glob("*/config.pbtxt")):
        try:
            text = path.read_text()
        except OSError:
            continue
        found = ensemble_steps(text) if "ensemble" in text else None
        if found is not None and model_name in found[1]:
            names.append(found[0] or path.parent.name)
    return names


def unload_ensembles(names: list[str], unload, log_warn) -> None:
    """Unload (`unload(name)`, i.e. `pb_utils.unload_model`) each of `names` (the model's
    `dependent_ensembles`, found when it loaded, not here: a drain with nothing in flight is
    answered at once, so the launcher's SIGTERM could come before a slow look-up ended (parsing
    the configs with protobuf took about a second on a 2-core machine); the stub then crashed in
    its unload call, 2 stops of 6)."""
    for name in names:
        try:
            unload(name)
        except Exception as exc:
            log_warn(f"could not unload {name} for the drain: {exc}")
