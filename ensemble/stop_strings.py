"""Finding stop strings in generated text, shared by the OpenAI frontend (its text ends before
the first match: `openai_frontend.stop`) and the BLS model (its text ends after it, as NVIDIA's
does: `bls.stop_strings`). Each keeps its own policy; the matching is here. No I/O."""

from __future__ import annotations

from collections.abc import Sequence


def occurrences(text: str, stops: Sequence[str], start: int = 0) -> list[tuple[int, int]]:
    """(start, end) of the first occurrence of each stop string in `text[start:]`."""
    found = []
    for stop in stops:
        position = text.find(stop, start)
        if position >= 0:
            found.append((position, position + len(stop)))
    return found


def partial_tail(text: str, stops: Sequence[str], max_size: int) -> int:
    """Length of the longest tail of `text`, at most `max_size` characters, that some stop
    string starts with: a match that the next piece of text may complete."""
    for size in range(min(max_size, len(text)), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0
