"""Postprocessing library: token ids → text, streamed without per-request state (no Triton, no torch)."""

from postprocessing.detokenizer import CONTEXT_TOKENS, Detokenizer

__all__ = ["CONTEXT_TOKENS", "Detokenizer"]
