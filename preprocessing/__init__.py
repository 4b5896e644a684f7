"""Preprocessing library: prompt text → token ids and word tensors (no Triton, no torch)."""

from ensemble.errors import InputError
from preprocessing.loader import load_tokenizer
from preprocessing.tokenizer import TextTokenizer, decode_query, parse_word_list

__all__ = ["InputError", "TextTokenizer", "decode_query", "load_tokenizer", "parse_word_list"]
