"""Postprocessing library: token ids → text, streamed without per-request state (no Triton, no torch)."""

from ensemble.io_contract import CONTEXT_TOKENS
from postprocessing.detokenizer import Detokenizer

__all__ = ["CONTEXT_TOKENS", "Detokenizer"]
