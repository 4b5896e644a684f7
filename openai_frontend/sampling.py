"""OpenAI request fields → the ensemble requests that serve them, one per choice.

The rules of what this server can and cannot honour live here, each refused with a 400 that
names the parameter and the limit:
- `n` > 1 becomes n independent requests (the engine takes one return sequence per request);
  with a `seed`, choice i uses seed + i so the choices differ yet stay reproducible.
- Log probabilities: chat's `logprobs` / completions' `logprobs` ask for the chosen tokens'
  (`return_log_probs`); chat's `top_logprobs` (0 to 20, with `logprobs` true) and completions'
  `logprobs` (0 to 5) also ask for that many alternatives per token (`num_top_log_probs`).
  Completions' `echo` with `logprobs` also asks for the prompt's (`return_prompt_log_probs`),
  as lm-evaluation-harness scores log likelihoods: the prompt goes as ids (a text prompt is
  tokenized here, as preprocessing would), so that each prompt token is known, and the echo is
  the prompt as the tokenizer reads those ids back, one text per token.
- `max_tokens` 0 is allowed with `echo` only (scoring the prompt, as OpenAI's legacy API allows):
  the engine generates one token, which the answer leaves out. With `echo` and `logprobs` at
  least one token is generated (`min_tokens` 1: an end token first is passed over), since
  lm-evaluation-harness takes the last log prob for the generated token.
- Completions take a prompt as text, token ids, or a batch of either (choice `index` p*n + i
  for prompt p); ids are checked against the vocabulary and sent as they are (`input_ids`).
- `logit_bias` ({token id: -100 to 100}) goes as the ensemble's `embedding_bias_ids` and
  `embedding_bias_weights`, added to the logits before sampling (as OpenAI defines it).
- `suffix` and `best_of` other than `n` are refused.
- Chat's `tools` and `tool_choice` are planned in `openai_frontend.tools`: the tools go to the
  chat template, `required` and a named function become guided decoding (so they cannot be
  combined with a `response_format`), and the plan says how each answer is read back.
- A prompt's size is checked before it is rendered or tokenized (`ensemble.limits`): its bytes
  against `max_input_bytes`, then its tokens against the context.
- Chat's `response_format` `json_object` / `json_schema` becomes the ensemble's guided decoding
  (guide type `json` / `json_schema`); the server must have it on (`guided_decoding_backend`).
- Defaults follow OpenAI: temperature 1; completions stop after 16 tokens, chat when the
  context is full (or at the engine's `max_output_len`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ensemble.errors import InputError
from ensemble.limits import PromptLimits
from openai_frontend.chat import ChatRenderer
from openai_frontend.errors import bad_request
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from openai_frontend.tools import ToolPlan, plan_tools
from openai_frontend.triton_client import EngineRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; 0 is greedy


@dataclass(frozen=True)
class Limits:
    """Limits of the served model: its context, the engine's per-request output cap, and the
    prompt's (by default derived from the context as preprocessing derives them)."""

    context_length: int
    max_output_len: int | None = None
    prompt: PromptLimits | None = None
    vocab_size: int | None = None  # token-id prompts' ids must be below it (the tokenizer's length)

    @property
    def prompt_limits(self) -> PromptLimits:
        return self.prompt or PromptLimits.derive(max_seq_len=self.context_length)

    def check_prompt_bytes(self, num_bytes: int, param: str) -> None:
        try:
            self.prompt_limits.check_bytes(num_bytes, f"The '{param}'")
        except InputError as exc:
            raise bad_request(f"{exc}.", param, "request_too_large") from None


@dataclass(frozen=True)
class Plan:
    """What to send for one OpenAI request: `requests[i]` serves choice i."""

    requests: list[EngineRequest]
    choices_per_prompt: int = 1  # n: choices p*n .. p*n+n-1 share prompt p
    echo: list[str] = field(default_factory=list)  # text prepended to choice i (completions' echo)
    stops: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token in the log probs (num_top_log_probs)
    stream: bool = False
    include_usage: bool = False
    # With echo and logprobs: the texts of choice i's prompt tokens, which join to echo[i].
    echo_tokens: list[tuple[str, ...]] = field(default_factory=list)
    drop_output: bool = False  # max_tokens 0 with echo: the one token generated is left out
    tools: ToolPlan | None = None  # chat answers read for tool calls


def _common_checks(req: GenerationRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                          "stream_options")
    if any(not s for s in req.stop_strings):
        raise bad_request("Stop sequences must not be empty.", "stop")


def _logit_bias(req: GenerationRequest, limits: Limits) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's `logit_bias` ({token id as a string: -100 to 100}, added to the logits before
    sampling) as (id, bias) pairs for the ensemble's `embedding_bias_ids` / `_weights`."""
    if not req.logit_bias:
        return None
    pairs = []
    for key, bias in req.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id.", "logit_bias") from None
        if token < 0 or (limits.vocab_size is not None and token >= limits.vocab_size):
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary "
                              f"(0 to {(limits.vocab_size or 0) - 1}).", "logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(f"logit_bias value {bias} for token {token} is outside -100 to 100.",
                              "logit_bias")
        pairs.append((token, float(bias)))
    return tuple(pairs)


def _seed(req: GenerationRequest, index: int) -> int | None:
    # OpenAI seeds are signed 64-bit; the engine takes an unsigned one.
    return None if req.seed is None else (req.seed + index) % 2**64


def _engine_requests(req: GenerationRequest, prompt: str | list[int], max_tokens: int, num_choices: int,
                     add_special_tokens: bool | None, logprobs: bool, top_logprobs: int, limits: Limits,
                     first_index: int = 0) -> list[EngineRequest]:
    text, ids = (prompt, None) if isinstance(prompt, str) else ("", tuple(prompt))
    base = EngineRequest(
        prompt=text, prompt_ids=ids, max_tokens=max_tokens, add_special_tokens=add_special_tokens,
        temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        # OpenAI's top_p defaults to 1 (sample from everything). The engine follows TensorRT-LLM,
        # where no top_p and no top_k mean greedy whatever the temperature, so send it.
        top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty, repetition_penalty=req.repetition_penalty,
        # The engine never ends before min_tokens, so ignore_eos is min_tokens = max_tokens.
        min_tokens=max_tokens if req.ignore_eos else req.min_tokens, return_log_probs=logprobs,
        num_top_log_probs=top_logprobs, logit_bias=_logit_bias(req, limits))
    return [replace(base, seed=_seed(req, first_index + i)) for i in range(num_choices)]


def _check_max_tokens(max_tokens: int, limits: Limits, param: str) -> None:
    # The engine checks prompt + max_tokens; this catches the common mistake with its name.
    if max_tokens >= limits.context_length:
        raise bad_request(f"'{param}' is {max_tokens}, but the model's context holds "
                          f"{limits.context_length} tokens, the prompt included.", param,
                          "context_length_exceeded")
    if limits.max_output_len is not None and max_tokens > limits.max_output_len:
        raise bad_request(f"'{param}' is {max_tokens}, more than this server allows "
                          f"({limits.max_output_len}).", param)


def _prompts(req: CompletionRequest, limits: Limits) -> list[str | list[int]]:
    """The request's prompts, each text or token ids, checked: none empty, text within the
    byte limit, ids integers of the vocabulary and fewer than the context holds."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]  # one text, or one prompt of ids
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise bad_request("The prompt must not be empty.", "prompt")
    for index, item in enumerate(prompts):
        if isinstance(item, str):
            limits.check_prompt_bytes(len(item.encode("utf-8")), "prompt")
            continue
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise bad_request("A prompt is text, a list of token ids, or a list of either.", "prompt")
        bad = [t for t in item if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size)]
        if bad:
            raise bad_request(f"Prompt {index} holds token id {bad[0]}, outside the vocabulary "
                              f"(0 to {(limits.vocab_size or 0) - 1}).", "prompt")
        if len(item) >= limits.context_length:
            raise bad_request(f"Prompt {index} has {len(item)} tokens; the model's context holds "
                              f"{limits.context_length}, the output included.", "prompt",
                              "context_length_exceeded")
    return prompts


def completion_plan(req: CompletionRequest, limits: Limits,
                    decode: Callable[[list[int]], str] | None = None,
                    encode: Callable[[str], list[int]] | None = None) -> Plan:
    """`decode` renders a token-id prompt as text for `echo` (the served tokenizer's decode);
    `encode` tokenizes a text prompt whose log probs `echo` with `logprobs` asks for."""
    _common_checks(req)
    prompts = _prompts(req, limits)
    if req.suffix:
        raise bad_request("'suffix' is not supported by this server.", "suffix", "unsupported_parameter")
    n = req.n or 1
    if req.best_of is not None and req.best_of != n:
        raise bad_request("'best_of' must equal 'n' (or be left out): choices are not ranked.", "best_of")
    logprobs = req.logprobs is not None
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    drop_output = max_tokens == 0
    if drop_output and not req.echo:
        raise bad_request("'max_tokens' must be at least 1; 0 is allowed only with 'echo' (to score "
                          "the prompt).", "max_tokens")
    max_tokens = max(max_tokens, 1)  # the engine generates at least one token
    _check_max_tokens(max_tokens, limits, "max_tokens")
    score_prompt = bool(req.echo) and logprobs
    requests, echo, echo_tokens = [], [], []
    for p, prompt in enumerate(prompts):
        if score_prompt:
            prompt = _prompt_ids(prompt, encode, limits, p)
        # Completions keep the tokenizer's own rule for special tokens (BOS for most models).
        choices = _engine_requests(req, prompt, max_tokens, n, None, logprobs, req.logprobs or 0, limits,
                                   first_index=p * n)
        if score_prompt:
            texts = _texts_in_context(prompt, _need(decode, "'echo' with 'logprobs'"))
            # At least one generated token: lm-evaluation-harness reads the last log prob as the
            # generated one (token_logprobs[ctxlen:-1]), and the engine leaves an end token out.
            choices = [replace(r, return_prompt_log_probs=True, min_tokens=max(r.min_tokens or 0, 1))
                       for r in choices]
            echo += ["".join(texts)] * n
            echo_tokens += [texts] * n
        else:
            echo += [_echo_text(prompt, decode) if req.echo else ""] * n
        requests += choices
    return Plan(requests, n, echo, req.stop_strings, logprobs, req.logprobs or 0, bool(req.stream),
                bool(req.stream_options and req.stream_options.include_usage), echo_tokens, drop_output)


def _need(function: Callable | None, what: str) -> Callable:
    if function is None:
        raise bad_request(f"{what} needs the server's tokenizer.", "echo")
    return function


def _prompt_ids(prompt: str | list[int], encode: Callable[[str], list[int]] | None, limits: Limits,
                index: int) -> list[int]:
    """A prompt as ids, a text one tokenized, checked against the context as token prompts are."""
    if not isinstance(prompt, str):
        return prompt
    ids = _need(encode, "'echo' with 'logprobs' of a text prompt")(prompt)
    if not ids:
        raise bad_request(f"Prompt {index} encodes to no tokens.", "prompt")
    if len(ids) >= limits.context_length:
        raise bad_request(f"Prompt {index} has {len(ids)} tokens; the model's context holds "
                          f"{limits.context_length}, the output included.", "prompt",
                          "context_length_exceeded")
    return ids


_CONTEXT_TOKENS = 4  # left context a token is decoded with (SentencePiece's leading space, ...)
_MAX_HELD_TOKENS = 3  # an incomplete UTF-8 character spans at most 3 tokens


def _texts_in_context(ids: list[int], decode: Callable[[list[int]], str]) -> tuple[str, ...]:
    """Each token's text in context: what it adds to the decode of the few tokens before it.

    A token that ends inside a character (the decode ends in U+FFFD) gets an empty string and
    the token that completes it the whole character, as generated tokens' texts are. The texts
    join to the prompt as the tokenizer reads it back; a prompt-long window per token would be
    quadratic in the prompt's length.
    """
    texts: list[str] = []
    done = 0  # tokens whose text is out
    for end in range(1, len(ids) + 1):
        start = max(0, done - _CONTEXT_TOKENS)
        text = decode(ids[start:end])
        if text.endswith("\ufffd") and end < len(ids) and end - done <= _MAX_HELD_TOKENS:
            texts.append("")
            continue
        before = decode(ids[start:done]) if done > start else ""
        common = len(before) if text.startswith(before) else _common_prefix_len(before, text)
        texts.append(text[common:])
        done = end
    return tuple(texts)


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _echo_text(prompt: str | list[int], decode: Callable[[list[int]], str] | None) -> str:
    if isinstance(prompt, str):
        return prompt
    if decode is None:
        raise bad_request("'echo' of a token-id prompt needs the server's tokenizer.", "echo")
    return decode(prompt)


def chat_plan(req: ChatCompletionRequest, renderer: ChatRenderer, limits: Limits) -> Plan:
    _common_checks(req)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, renderer.tool_format)
    if tools.guide_type is not None and _guide(req.response_format)[0] is not None:
        raise bad_request("'response_format' cannot be combined with 'tool_choice' required or a named "
                          "function: both constrain the answer.", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    tool_bytes = len(json.dumps(req.tools).encode("utf-8")) if tools.template_tools else 0
    limits.check_prompt_bytes(sum(_message_bytes(m) for m in req.messages) + tool_bytes, "messages")
    prompt = renderer.encode(req.messages, tools.template_tools)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        room = limits.context_length - len(prompt)
        if room <= 0:
            raise bad_request(f"The messages take {limits.context_length - room} tokens, which fills the "
                              f"model's context of {limits.context_length} tokens.", "messages",
                              "context_length_exceeded")
        max_tokens = min(room, limits.max_output_len or room)
    _check_max_tokens(max_tokens, limits, param)
    n = req.n or 1
    guide_type, guide = (tools.guide_type, tools.guide) if tools.guide_type else _guide(req.response_format)
    top_logprobs = req.top_logprobs or 0
    requests = [replace(r, guide_type=guide_type, guide=guide)
                for r in _engine_requests(req, prompt, max_tokens, n, None, bool(req.logprobs), top_logprobs,
                                          limits)]
    return Plan(requests, n, [""] * n, req.stop_strings, bool(req.logprobs), top_logprobs, bool(req.stream),
                bool(req.stream_options and req.stream_options.include_usage), tools=tools.plan)


def _message_bytes(message) -> int:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    calls = json.dumps(message.tool_calls) if message.tool_calls else ""
    return len((content or "").encode("utf-8")) + len((message.name or "").encode("utf-8")) + len(calls.encode())


def _guide(response_format: dict | None) -> tuple[str | None, str | None]:
    """OpenAI's `response_format` → (guided_decoding_guide_type, guided_decoding_guide)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return "json", None
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise bad_request("'response_format' of type 'json_schema' needs a 'json_schema' object "
                              "with a 'schema'.", "response_format")
        return "json_schema", json.dumps(schema)
    raise bad_request(f"Unknown 'response_format' type '{kind}': expected text, json_object or "
                      "json_schema.", "response_format", "unsupported_value")
