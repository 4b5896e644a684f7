"""Which engine request answers to which stub id: the bookkeeping both engine hosts share.

The `tensorrt_llm` model names each engine request (one batch row of a Triton request) by a
stub id; the engine names it by its own request id. `inflight.hosts.engine_process` (the
engine in its own process) and `engine_client.InProcessEngine` (in the stub) both map one to
the other while the request is in flight. Not thread-safe: the caller serialises.
"""

from __future__ import annotations


class StubIds:
    def __init__(self) -> None:
        self._stub_by_engine: dict[int, int] = {}
        self._engine_by_stub: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._stub_by_engine)

    def add(self, engine_id: int, stub_id: int) -> None:
        self._stub_by_engine[engine_id] = stub_id
        self._engine_by_stub[stub_id] = engine_id

    def engine_id(self, stub_id: int) -> int | None:
        return self._engine_by_stub.get(stub_id)

    def forget(self, engine_id: int) -> None:
        stub_id = self._stub_by_engine.pop(engine_id, None)
        if stub_id is not None:
            self._engine_by_stub.pop(stub_id, None)

    def route(self, responses: list) -> list[tuple[int, object]]:
        """(stub id, response) for each response of a request in flight here; others (already
        ended, or not ours) are dropped. A final response or an error ends its request."""
        out = []
        stub_by_engine = self._stub_by_engine
        for response in responses:
            if type(response) is tuple:  # a compact chunk (RequestState.stream_chunk): never final
                stub_id = stub_by_engine.get(response[0])
                if stub_id is not None:
                    out.append((stub_id, response))
                continue
            stub_id = stub_by_engine.get(response.request_id)
            if stub_id is None:
                continue
            if response.has_error() or response.result.is_final:
                self.forget(response.request_id)
            out.append((stub_id, response))
        return out
