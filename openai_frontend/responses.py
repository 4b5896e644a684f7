"""Choice events and results → OpenAI response objects, whole or as stream chunks.

Streamed chat chunks follow OpenAI's shape: the first delta of each choice carries the role,
later ones only content, the last one the finish reason; with `stream_options.include_usage`
every chunk has `"usage": null` and one more chunk with no choices carries the usage. Token
strings in log probs are each token's text decoded in context (a token that ends inside a
multi-byte character has an empty string, the next one the whole character), so they always
add up to the returned text. The top alternatives are token ids, each shown as the served
tokenizer's text of that one token (`Context.token_text`): chat lists them as OpenAI's
TopLogprob entries, most likely first; completions as one {text: log prob} dict per token, where
two ids of the same text keep the larger log prob. An echoed prompt's tokens come first in a
completion's log probs (OpenAI's legacy shape): its first token has null for both, as nothing
precedes it, and `text_offset` runs on across the prompt and the completion.

A chat answer read for tool calls (`Plan.tools`) goes through the same `CallStream` whether it
is streamed or not: a whole message has the content before the calls (null if none) and
`tool_calls`; a stream sends content deltas, then each call as a `tool_calls` delta (OpenAI's
chunk shape, `index` per call), and leaves out chunks with nothing new.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace

from openai_frontend.generation import ChoiceEvent, ChoiceResult, Token
from openai_frontend.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                      ChatCompletionChunk, ChoiceLogprobs, Completion, CompletionChoice,
                                      CompletionLogprobs, TokenLogprob, TopLogprob, Usage)
from openai_frontend.sampling import Plan
from openai_frontend.tool_parsers import assemble


@dataclass(frozen=True)
class Context:
    """What every object of one response repeats."""

    id: str
    created: int
    model: str
    plan: Plan
    # A token id's text (the served tokenizer's); needed when plan.top_logprobs > 0.
    token_text: Callable[[int], str] | None = None

    @property
    def num_choices(self) -> int:
        return len(self.plan.requests)

    @property
    def choices_per_prompt(self) -> int:
        return self.plan.choices_per_prompt


def usage(ctx: Context, input_tokens: list[int], output_tokens: list[int]) -> Usage:
    """Each prompt counts once (n choices share it); every choice's output counts."""
    prompt = sum(input_tokens[::ctx.choices_per_prompt])
    completion = sum(output_tokens)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def chat_logprobs(ctx: Context, tokens: list[Token]) -> ChoiceLogprobs:
    def top(token: Token) -> list[TopLogprob]:
        texts = [ctx.token_text(token_id) for token_id, _ in token.top]
        return [TopLogprob(token=text, logprob=lp, bytes=list(text.encode("utf-8")))
                for text, (_, lp) in zip(texts, token.top)]

    return ChoiceLogprobs(content=[TokenLogprob(token=t.text, logprob=t.logprob,
                                                bytes=list(t.text.encode("utf-8")), top_logprobs=top(t))
                                   for t in tokens])


def completion_logprobs(ctx: Context, tokens: list[Token], offset: int) -> CompletionLogprobs:
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token.text)
    top_logprobs = None
    if ctx.plan.top_logprobs:
        top_logprobs = []
        for token in tokens:
            if token.logprob is None:
                top_logprobs.append(None)
                continue
            alternatives: dict[str, float] = {}
            for token_id, lp in token.top:  # most likely first: a repeated text keeps its larger log prob
                alternatives.setdefault(ctx.token_text(token_id), lp)
            top_logprobs.append(alternatives)
    return CompletionLogprobs(tokens=[t.text for t in tokens], token_logprobs=[t.logprob for t in tokens],
                              top_logprobs=top_logprobs, text_offset=offsets)


# ----- whole answers ---------------------------------------------------------------------------

def _chat_choice(ctx: Context, index: int, result: ChoiceResult) -> ChatChoice:
    logprobs = chat_logprobs(ctx, result.tokens) if ctx.plan.logprobs else None
    tools = ctx.plan.tools
    if tools is None:
        return ChatChoice(index=index, message=AssistantMessage(content=result.text), logprobs=logprobs,
                          finish_reason=result.finish_reason)
    stream = tools.stream()
    content, calls = assemble([stream.feed(result.text), stream.finish()])
    message = AssistantMessage(content=content or None, tool_calls=[c.to_json() for c in calls] or None)
    return ChatChoice(index=index, message=message, logprobs=logprobs,
                      finish_reason=tools.finish_reason(result.finish_reason, len(calls)))


def chat_completion(ctx: Context, results: list[ChoiceResult]) -> ChatCompletion:
    choices = [_chat_choice(ctx, i, r) for i, r in enumerate(results)]
    return ChatCompletion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                          usage=usage(ctx, [r.num_input_tokens for r in results],
                                      [r.num_output_tokens for r in results]))


def completion(ctx: Context, results: list[ChoiceResult]) -> Completion:
    choices = [CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason,
                                logprobs=completion_logprobs(ctx, r.tokens, 0) if ctx.plan.logprobs else None)
               for i, r in enumerate(results)]
    return Completion(id=ctx.id, created=ctx.created, model=ctx.model, choices=choices,
                      usage=usage(ctx, [r.num_input_tokens for r in results],
                                  [r.num_output_tokens for r in results]))


# ----- streams ---------------------------------------------------------------------------------

class _StreamState:
    chunk_type: type  # ChatCompletionChunk or Completion

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.started = [False] * ctx.num_choices
        self.offsets = [0] * ctx.num_choices
        self.input_tokens = [0] * ctx.num_choices
        self.output_tokens = [0] * ctx.num_choices
        # Every chunk repeats the same fields around its one choice: pydantic writes them once,
        # each chunk only its choice (most chunks are one token: their time is the stream's).
        empty = self.dump(self.chunk_type(id=ctx.id, created=ctx.created, model=ctx.model, choices=[]))
        head, tail = empty.split('"choices":[]')
        self._head, self._tail = head + '"choices":[', "]" + tail

    def fast_json(self, choice: dict) -> str:
        """A chunk of one choice without log probs, as pydantic would write it (compact, UTF-8)."""
        return self._head + json.dumps(choice, ensure_ascii=False, separators=(",", ":")) + self._tail

    def record(self, event: ChoiceEvent) -> None:
        self.input_tokens[event.index] = event.num_input_tokens
        self.output_tokens[event.index] = event.num_output_tokens

    def usage_json(self, chunk_type) -> str | None:
        """The last chunk, with no choices and the usage; None unless it was asked for."""
        if not self.ctx.plan.include_usage:
            return None
        chunk = chunk_type(id=self.ctx.id, created=self.ctx.created, model=self.ctx.model, choices=[],
                           usage=usage(self.ctx, self.input_tokens, self.output_tokens))
        return chunk.model_dump_json()

    def dump(self, chunk) -> str:
        # Without include_usage the field is left out, as OpenAI does.
        return chunk.model_dump_json(exclude=None if self.ctx.plan.include_usage else {"usage"})


class ChatStream(_StreamState):
    chunk_type = ChatCompletionChunk

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        tools = ctx.plan.tools
        self.calls = [tools.stream() for _ in range(ctx.num_choices)] if tools else None
        self.num_calls = [0] * ctx.num_choices

    def chunk_json(self, event: ChoiceEvent) -> str | None:
        self.record(event)
        if self.calls is None:
            delta = {"content": event.text} if event.text or event.finish_reason is None else {}
        else:
            delta, finish_reason = self._tool_delta(event)
            if not delta and finish_reason is None and self.started[event.index] and not self.ctx.plan.logprobs:
                return None  # held back (a call's unfinished JSON): nothing to send yet
            event = replace(event, finish_reason=finish_reason)
        if not self.started[event.index]:
            self.started[event.index] = True
            delta = {"role": "assistant", "content": delta.get("content", "")} | delta
        if not self.ctx.plan.logprobs:
            return self.fast_json({"index": event.index, "delta": delta, "logprobs": None,
                                   "finish_reason": event.finish_reason})
        choice = ChatChunkChoice(index=event.index, delta=delta, finish_reason=event.finish_reason,
                                 logprobs=chat_logprobs(self.ctx, event.tokens))
        return self.dump(ChatCompletionChunk(id=self.ctx.id, created=self.ctx.created, model=self.ctx.model,
                                             choices=[choice]))

    def _tool_delta(self, event: ChoiceEvent) -> tuple[dict, str | None]:
        stream = self.calls[event.index]
        delta = stream.feed(event.text)
        if event.finish_reason is not None:
            delta += stream.finish()
        self.num_calls[event.index] += sum(call.id is not None for call in delta.calls)
        out = {"content": delta.content} if delta.content else {}
        if delta.calls:
            out["tool_calls"] = [call.to_json() for call in delta.calls]
        finish = event.finish_reason
        if finish is not None:
            finish = self.ctx.plan.tools.finish_reason(finish, self.num_calls[event.index])
        return out, finish

    def final_json(self) -> str | None:
        return self.usage_json(ChatCompletionChunk)


class CompletionStream(_StreamState):
    chunk_type = Completion

    def chunk_json(self, event: ChoiceEvent) -> str:
        self.record(event)
        logprobs = None
        if self.ctx.plan.logprobs:
            logprobs = completion_logprobs(self.ctx, event.tokens, self.offsets[event.index])
        self.offsets[event.index] += len(event.text)
        if logprobs is None:
            return self.fast_json({"index": event.index, "text": event.text, "logprobs": None,
                                   "finish_reason": event.finish_reason})
        choice = CompletionChoice(index=event.index, text=event.text, logprobs=logprobs,
                                  finish_reason=event.finish_reason)
        return self.dump(Completion(id=self.ctx.id, created=self.ctx.created, model=self.ctx.model,
                                    choices=[choice]))

    def final_json(self) -> str | None:
        return self.usage_json(Completion)
