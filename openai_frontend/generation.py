"""One OpenAI request's choices, generated through Triton: text, stop strings, log probs, counts.

`run_choice` streams one choice: it feeds each engine chunk to a `StopMatcher`, releases whole
chunks once no stop string can start in them (so a chunk's text, its log probs and their
alternatives leave together), and on a match stops reading, which cancels the Triton request.
`merge` interleaves the choices of one request as their chunks arrive; `collect` gathers them
for a non-streamed answer. Both are independent of HTTP.

A choice with an echoed prompt whose log probs were asked for starts with the prompt's tokens:
the first without a log prob (nothing precedes it), the others with the engine's prompt log
probs. They leave with the first text released, or with the last event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import NamedTuple

from openai_frontend.errors import APIError
from openai_frontend.stop import StopMatcher
from openai_frontend.triton_client import EngineChunk, EngineRequest, TritonClient


class Token(NamedTuple):
    """One token as released: its text (decoded in context), its log prob (None for a prompt's
    first token), and the alternatives the engine returned for it, (token id, log prob), the most
    likely first."""

    text: str
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class ChoiceEvent:
    """New output of choice `index`; `finish_reason` is set on its last event only."""

    index: int
    text: str
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, as the engine counts them


@dataclass
class _Piece:
    start: int  # offset of `text` in the choice's generated text
    text: str
    log_probs: list[float]
    top: list[list[tuple[int, float]]]  # per token, when the engine sent alternatives; else empty

    def tokens(self, text: str) -> list[Token]:
        # A streamed chunk is one token; should one carry several, the text goes to the first.
        return [Token(text if i == 0 else "", lp, self.top[i] if i < len(self.top) else [])
                for i, lp in enumerate(self.log_probs)]


class _Releaser:
    """Chunks waiting until the stop matcher says their text is safe to send."""

    def __init__(self) -> None:
        self.pieces: list[_Piece] = []
        self.end = 0

    def add(self, text: str, log_probs: list[float] | None,
            top_log_probs: list[list[tuple[int, float]]] | None = None) -> None:
        self.pieces.append(_Piece(self.end, text, log_probs or [], top_log_probs or []))
        self.end += len(text)

    def release(self, safe_end: int, final: bool = False) -> tuple[str, list[Token]]:
        """Whole pieces that end by `safe_end`; when `final`, also the part of the next one
        that starts before it (the text before a stop string)."""
        texts, tokens = [], []
        while self.pieces:
            piece = self.pieces[0]
            if piece.start + len(piece.text) <= safe_end:
                text = piece.text
            elif final and piece.start < safe_end:
                text = piece.text[:safe_end - piece.start]
            else:
                break
            self.pieces.pop(0)
            texts.append(text)
            tokens += piece.tokens(text)
        if final:
            self.pieces.clear()
        return "".join(texts), tokens


def _prompt_tokens(texts: Sequence[str], chunk: EngineChunk) -> list[Token]:
    log_probs, top = chunk.prompt_log_probs or [], chunk.prompt_top_log_probs or []
    if len(log_probs) != len(texts) - 1:
        raise APIError(500, f"The engine returned {len(log_probs)} prompt log probs for a prompt of "
                            f"{len(texts)} tokens.")
    return [Token(texts[0], None, [])] + [Token(text, lp, top[i] if i < len(top) else [])
                                          for i, (text, lp) in enumerate(zip(texts[1:], log_probs))]


async def run_choice(client: TritonClient, request: EngineRequest, index: int, stops: Sequence[str],
                     request_id: str = "", prefix: str = "", prefix_tokens: Sequence[str] = (),
                     drop_output: bool = False) -> AsyncIterator[ChoiceEvent]:
    """Stream choice `index`; its last event has the finish reason and the final counts.

    `prefix` (the echo) goes before the first text; `prefix_tokens`, when given, are the texts of
    its tokens, whose log probs the engine sends (`return_prompt_log_probs`). `drop_output`
    leaves out what is generated, its text, tokens and count (max_tokens 0 with echo).
    """
    matcher, pending = StopMatcher(stops), _Releaser()
    last = None
    awaiting_prompt = bool(prefix_tokens)  # nothing leaves before the prompt's tokens
    echoed: list[Token] = []
    async with aclosing(client.generate(request, request_id)) as chunks:
        async for chunk in chunks:
            last = chunk
            if awaiting_prompt and chunk.prompt_log_probs is not None:
                echoed, awaiting_prompt = _prompt_tokens(prefix_tokens, chunk), False
            if drop_output:
                continue
            pending.add(chunk.text, chunk.log_probs, chunk.top_log_probs)
            safe_end = matcher.feed(chunk.text)
            if matcher.stopped:
                break  # leaving the block cancels the Triton request
            if awaiting_prompt:
                continue
            text, tokens = pending.release(safe_end)
            if text or tokens:
                yield ChoiceEvent(index, prefix + text, echoed + tokens, None, chunk.num_input_tokens,
                                  chunk.num_output_tokens)
                prefix, echoed = "", []
    if last is None:
        raise APIError(500, "Triton ended the stream without a response.")
    if awaiting_prompt:
        raise APIError(500, "The engine returned no prompt log probs.")
    if matcher.stopped:
        finish = "stop"
    else:
        # The engine leaves the end token out of its output and its count, so reaching
        # max_tokens means the limit, not the model, ended the answer.
        finish = "length" if last.num_output_tokens >= request.max_tokens else "stop"
    text, tokens = pending.release(matcher.safe_end if matcher.stopped else pending.end, final=True)
    num_output_tokens = 0 if drop_output else last.num_output_tokens
    yield ChoiceEvent(index, prefix + text, echoed + tokens, finish, last.num_input_tokens, num_output_tokens)


async def merge(streams: Sequence[AsyncIterator[ChoiceEvent]]) -> AsyncIterator[ChoiceEvent]:
    """Events of all choices in arrival order. Closing this cancels every choice still running."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for event in only:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with aclosing(stream):
                async for event in stream:
                    await queue.put(event)
            await queue.put(done)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class ChoiceResult:
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str = "stop"
    num_input_tokens: int = 0
    num_output_tokens: int = 0


async def collect(events: AsyncIterator[ChoiceEvent], num_choices: int) -> list[ChoiceResult]:
    """The whole answer of every choice, in index order."""
    results = [ChoiceResult() for _ in range(num_choices)]
    parts: list[list[str]] = [[] for _ in range(num_choices)]
    async with aclosing(events):
        async for event in events:
            result = results[event.index]
            parts[event.index].append(event.text)
            result.tokens += event.tokens
            result.num_input_tokens = event.num_input_tokens
            result.num_output_tokens = event.num_output_tokens
            if event.finish_reason is not None:
                result.finish_reason = event.finish_reason
    for result, texts in zip(results, parts):
        result.text = "".join(texts)
    return results
