"""Guided decoding with xgrammar: each guide compiled once, one matcher per request.

`GrammarCompiler` turns a request's `GuidedDecodingParams` into a `GuideMatcher`, compiling the
guide against the engine's tokenizer the way TensorRT-LLM does (`json`: xgrammar's built-in
JSON grammar; `json_schema`, `regex`, `ebnf_grammar`: the guide itself, xgrammar's defaults).
Compiled grammars are kept in an LRU cache keyed by (guide type, guide), so a schema sent with
every request is compiled once. A guide that does not compile raises `RequestError` for that
request alone.

The matcher follows its request's accepted tokens (`accept`); the sampler asks it for the next
token mask (`fill_next_token_bitmask`, see `inflight.sampling.token_mask`). Both run on the host,
between the step that sampled a token and the step that samples the next: a guided request
makes the engine step synchronously while it is live.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from pathlib import Path

import torch
import xgrammar

from ensemble.errors import ConfigError
from inflight.api.config import GuidedDecodingConfig
from inflight.api.types import GuidedDecodingParams, RequestError
from inflight.sampling.token_mask import GuideViolation

# Compiled grammars kept. Over SmolLM2's 49k-token vocabulary one measured 1 KB (a two-word EBNF)
# to 115 KB (the built-in JSON grammar), compiled in 1-63 ms on a loaded 2-core machine.
MAX_CACHED_GRAMMARS = 256


class GuideMatcher:
    """One request's grammar state: the tokens it may sample next, and whether it has ended."""

    def __init__(self, matcher: xgrammar.GrammarMatcher):
        self._matcher = matcher

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        """Advances over a sampled token; True when it ended the grammar (a stop token, which
        is not part of the output). Raises GuideViolation for a token the grammar refuses."""
        if not self._matcher.accept_token(token):
            raise GuideViolation(f"guided decoding: the sampled token {token} does not follow the "
                                 "request's grammar")
        return self._matcher.is_terminated()

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles guides against one tokenizer. Thread-safe: the executor compiles on its
    callers' threads (`LLMEngine.compile_guide`)."""

    def __init__(self, config: GuidedDecodingConfig, vocab_size: int,
                 max_cached: int = MAX_CACHED_GRAMMARS):
        """`vocab_size`: the model's (its logits' width), which may exceed the tokenizer's."""
        if len(config.encoded_vocab) > vocab_size:
            raise ValueError(f"the tokenizer has {len(config.encoded_vocab)} tokens, more than the "
                             f"model's vocabulary of {vocab_size}")
        self.tokenizer_info = xgrammar.TokenizerInfo(
            list(config.encoded_vocab), vocab_size=vocab_size,
            stop_token_ids=list(config.stop_token_ids) if config.stop_token_ids else None,
            **_vocab_metadata(config))
        # Our cache instead of xgrammar's: bounded by count and observable (`num_compiled`).
        self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: collections.OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = \
            collections.OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self.num_compiled = 0

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def matcher(self, params: GuidedDecodingParams) -> GuideMatcher:
        return GuideMatcher(xgrammar.GrammarMatcher(self.compile(params)))

    def compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar of a guide, from the cache when it was compiled before. Raises
        RequestError, naming the guide type, when the guide is not valid. The lock guards only
        the cache: a long compile holds up no other caller (two may compile the same guide)."""
        key = (params.guide_type, "" if params.guide_type == "json" else params.guide)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(params)
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = grammar
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        guide_type, guide = params.guide_type, params.guide
        compilers = {
            "json": lambda: self._compiler.compile_builtin_json_grammar(),
            "json_schema": lambda: self._compiler.compile_json_schema(_json_text(guide)),
            "regex": lambda: self._compiler.compile_regex(guide),
            "ebnf_grammar": lambda: self._compiler.compile_grammar(guide),
        }
        try:
            return compilers[guide_type]()
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse errors
            raise RequestError(f"guided_decoding_guide is not a valid {guide_type}: "
                               f"{_short_reason(exc)}") from None


def _json_text(schema: str) -> str:
    """The schema, checked to be JSON first: json's message is clearer than xgrammar's."""
    try:
        json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    return schema


_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _short_reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location, first line only."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _XGRAMMAR_PREFIX.sub("", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _vocab_metadata(config: GuidedDecodingConfig) -> dict:
    """How the vocabulary's strings encode bytes: as detected from the loaded tokenizer, else
    from `tokenizer_str` (TensorRT-LLM's way), else raw strings."""
    if config.vocab_type is not None:
        return dict(vocab_type=xgrammar.VocabType[config.vocab_type],
                    add_prefix_space=bool(config.add_prefix_space))
    if config.tokenizer_str:
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(config.tokenizer_str)
        return dict(vocab_type=metadata["vocab_type"], add_prefix_space=metadata["add_prefix_space"])
    return dict(vocab_type=xgrammar.VocabType.RAW, add_prefix_space=False)


def guided_decoding_config(tokenizer) -> GuidedDecodingConfig:
    """The engine's guided decoding config from a Hugging Face tokenizer (TensorRT-LLM builds
    its `GuidedDecodingConfig` from the same three things: vocabulary, tokenizer JSON, EOS)."""
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)  # detects the vocabulary's encoding
    vocab = tokenizer.get_vocab()
    encoded = [""] * (max(vocab.values()) + 1)
    for text, token_id in vocab.items():
        encoded[token_id] = text
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return GuidedDecodingConfig(
        encoded_vocab=tuple(encoded),
        tokenizer_str=backend.to_str() if backend is not None else None,
        stop_token_ids=tuple(info.stop_token_ids) or None,
        vocab_type=info.vocab_type.name,
        add_prefix_space=bool(info.add_prefix_space))


def guided_decoding_config_from_dir(tokenizer_dir: str | Path) -> GuidedDecodingConfig:
    """`guided_decoding_config` of the tokenizer in a Hugging Face folder (`tokenizer_dir`)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the tokenizer for guided decoding from tokenizer_dir "
                         f"'{tokenizer_dir}': {exc}") from None
    return guided_decoding_config(tokenizer)


def guided_decoding_config_from_info(path: str | Path) -> GuidedDecodingConfig:
    """The config from a tokenizer-info JSON file (`xgrammar_tokenizer_info_path`): TensorRT-LLM
    writes `encoded_vocab`, `tokenizer_str` and `stop_token_ids` there."""
    try:
        info = json.loads(Path(path).read_text(encoding="utf-8"))
        return GuidedDecodingConfig(encoded_vocab=tuple(info["encoded_vocab"]),
                                    tokenizer_str=info.get("tokenizer_str"),
                                    stop_token_ids=tuple(info.get("stop_token_ids") or ()) or None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the xgrammar tokenizer info in xgrammar_tokenizer_info_path "
                          f"'{path}': {type(exc).__name__}: {exc}") from None
