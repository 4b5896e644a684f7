"""One Triton request in flight in the engine model (`Pending`), and how its answers reach
Triton (`Sink`, which the adapter implements with `pb_utils`); no Triton import.
`inflight.serving.request_table` keeps the requests and sends their answers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol


class Sink(Protocol):
    """How responses reach Triton (the adapter implements it with `pb_utils`)."""

    def send_tensors(self, sender, tensors: dict, final: bool) -> None: ...
    def send_error(self, sender, message: str, code: str, final: bool = True) -> None: ...
    def send_final(self, sender) -> None: ...
    def is_cancelled(self, sender) -> bool: ...
    def warn(self, message: str) -> None: ...


@dataclass(eq=False)
class Pending:
    """One Triton request in flight."""

    sender: object
    user_id: str
    key: int  # random, see ensemble.control
    rows: dict = field(default_factory=dict)  # stub id -> convert.RowState
    num_open_rows: int = 0
    is_client_cancelled: bool = False
    # Triton frees the response sender once the final flag is sent; touching it afterwards
    # (even is_cancelled()) crashes the server. `lock` orders sends and checks; `is_done` is
    # set, under it, before the final send.
    lock: threading.Lock = field(default_factory=threading.Lock)
    is_done: bool = False
