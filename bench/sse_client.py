"""A lean HTTP/1.1 client for streamed OpenAI answers: keep-alive connections, chunked SSE.

bench/bench_openai.py measures the frontend with it by default. httpx (what the `openai` client
uses) spends about 3 ms of Python per streamed request before the first event reaches its caller
on a 2-core machine, which a benchmark would charge to the frontend; this client parses the
status line, the headers and the chunked body as they arrive, and nothing else.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator


class SSEClient:
    """POSTs JSON and yields the `data:` events of the streamed answer, parsed, until `[DONE]`."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    @classmethod
    def for_url(cls, url: str) -> SSEClient:
        host, port = url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        return cls(host, int(port))

    async def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def _send(self, request: bytes):
        """Send on an idle connection, or a new one when there is none or the server has closed
        it (uvicorn closes a connection idle for 5 s); returns the reply's status line."""
        while self._idle:
            reader, writer = self._idle.pop()
            try:
                writer.write(request)
                if status_line := await reader.readline():
                    return reader, writer, status_line
            except ConnectionError:
                pass
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(request)
        return reader, writer, await reader.readline()

    async def events(self, path: str, body: dict) -> AsyncIterator[dict]:
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        reader, writer, status_line = await self._send(head.encode() + payload)
        reusable = False
        try:
            status = int(status_line.split()[1])
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, value = line.decode("latin-1").split(":", 1)
                headers[name.strip().lower()] = value.strip()
            if status != 200:
                raise RuntimeError(f"HTTP {status}: {await reader.read(int(headers.get('content-length', -1)))!r}")
            if headers.get("transfer-encoding") != "chunked":
                raise RuntimeError(f"expected a chunked event stream, got headers {headers}")
            buffer = b""
            while size := int((await reader.readline()).split(b";")[0], 16):
                buffer += (await reader.readexactly(size + 2))[:-2]  # the chunk and its CRLF
                *events, buffer = buffer.split(b"\n\n")
                for item in events:
                    if item.startswith(b"data: ") and item != b"data: [DONE]":
                        yield json.loads(item[6:])
            await reader.readline()  # the CRLF after the last chunk
            reusable = headers.get("connection", "").lower() != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()
