"""Stop strings matched on the text, for `tensorrt_llm_bls`.

The engine stops on stop *token sequences*, which miss a stop string that the tokenizer splits
differently in context (" 7" inside "17", a word glued to punctuation). NVIDIA's BLS model also
checks the decoded text; so do we, with its meaning: the output ends right after the first stop
string in the generated text, the stop string included (as token stop words include their
tokens). Unlike NVIDIA's check, a match is found wherever it falls across streamed chunks.
"""

from __future__ import annotations

from ensemble.stop_strings import occurrences


class StopStrings:
    """Watches the generated text of one sequence.

    Streaming: `feed(delta)` returns the part of each chunk to send; once a stop string is
    complete it returns the chunk up to the end of the match and `stopped` turns true. The
    concatenated results equal `truncate(whole_text)`.
    """

    def __init__(self, stop_strings: list[str]) -> None:
        self.stop_strings = [s for s in stop_strings if s]
        self.stopped = False
        # The end of the text seen so far, long enough to hold all but the last character of
        # the longest stop string: a match that spans chunks starts inside it.
        self._tail = ""
        self._keep = max((len(s) for s in self.stop_strings), default=1) - 1

    def _first_end(self, text: str, start: int = 0) -> int | None:
        """End index of the earliest-ending stop string in `text[start:]`, if any (the text
        ends after it)."""
        return min((end for _, end in occurrences(text, self.stop_strings, start)), default=None)

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stop_strings:
            return delta
        window = self._tail + delta
        end = self._first_end(window)
        if end is not None:
            self.stopped = True
            return delta[:max(0, end - len(self._tail))]
        self._tail = window[len(window) - self._keep:] if self._keep else ""
        return delta

    def truncate(self, text: str, generation_start: int = 0) -> str:
        """`text` cut after the first stop string found in `text[generation_start:]`; the prompt
        part (which a non-streamed answer may start with) is not searched."""
        end = self._first_end(text, generation_start) if self.stop_strings else None
        if end is None:
            return text
        self.stopped = True
        return text[:end]
