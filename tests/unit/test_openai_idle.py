"""openai_frontend while idle: readiness comes from events, and the HTTP server loop and the
worker supervisor sleep until something happens (bench/idle_cost.py measures the CPU cost)."""

from __future__ import annotations

import asyncio
import os

import pytest

from openai_frontend.errors import APIError
from openai_frontend.triton_client import EngineRequest


def _run(coro):
    return asyncio.run(coro)


class _ReadyAnswers:
    """tritonclient's aio client as TritonClient's readiness uses it: answers `ready`, counts the
    round trips, and holds each answer until `release` is set."""

    def __init__(self):
        self.ready = True
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()

    async def is_model_ready(self, model, client_timeout=None):
        self.calls += 1
        await self.release.wait()
        return self.ready

    async def close(self):
        pass


class _LostStream:
    """A ModelStreamInfer call whose connection to Triton is gone."""

    def __init__(self):
        import grpc

        self.error = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                          grpc.aio.Metadata(), "Socket closed")

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self):
        pass


def test_readiness_comes_from_events_not_from_polling():
    """An idle frontend asks Triton nothing: one check makes the model ready, requests then skip
    the round trip until a failure marks it unready (each request asks again until Triton answers
    ready); /health/ready (fresh) always asks; a check answered after a failure seen meanwhile
    does not make the model ready."""
    from openai_frontend.triton_client import TritonClient

    async def scenario():
        client = TritonClient("127.0.0.1:1", "ensemble")  # nothing listens: no call may reach it
        answers = client.client = _ReadyAnswers()
        try:
            for _ in range(3):
                await client.check_ready()
            assert answers.calls == 1
            await client.check_ready(fresh=True)
            assert answers.calls == 2

            client._stream_infer = lambda request: _LostStream()
            with pytest.raises(APIError) as lost:
                async for _ in client.generate(EngineRequest("p", 4)):
                    pass
            assert lost.value.status == 503
            answers.ready = False
            for calls in (3, 4):
                with pytest.raises(APIError) as unready:
                    await client.check_ready()
                assert unready.value.status == 503 and answers.calls == calls
            answers.ready = True
            await client.check_ready()
            await client.check_ready()
            assert answers.calls == 5

            answers.release.clear()  # a failure lands while a fresh check is on the wire
            check = asyncio.ensure_future(client.check_ready(fresh=True))
            await asyncio.sleep(0)
            client.mark_unready()
            answers.release.set()
            await check
            await client.check_ready()
            assert answers.calls == 7
        finally:
            await client.close()

    _run(scenario())


def test_the_idle_http_server_sleeps_until_a_stop_signal():
    """No timer runs the server's loop (uvicorn's woke 10 times a second): a stop signal wakes
    it at once, and the Date header is made when a request reads it."""
    import signal
    import time
    from email.utils import formatdate

    import uvicorn

    from openai_frontend.__main__ import _server

    server = _server(uvicorn.Config(app=None, lifespan="off"), client=None, drain_s=1)
    headers = dict(server.server_state.default_headers)
    assert headers[b"date"] in {formatdate(t, usegmt=True).encode() for t in (time.time() - 1, time.time())}

    async def scenario():
        loop = asyncio.ensure_future(server.main_loop())
        await asyncio.sleep(0.05)
        assert not loop.done()
        server.handle_exit(signal.SIGTERM, None)
        await asyncio.wait_for(loop, timeout=1)

    _run(scenario())


def test_the_worker_supervisor_wakes_on_an_exit_or_a_signal_only():
    import signal
    import subprocess
    import threading

    from openai_frontend.workers import _watch

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        quitter = subprocess.Popen(["true"])
        assert _watch([sleeper, quitter], threading.Event()) is quitter
        stop = threading.Event()
        previous = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.set())
        try:
            threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            assert _watch([sleeper], stop) is None and stop.is_set()
        finally:
            signal.signal(signal.SIGUSR1, previous)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
