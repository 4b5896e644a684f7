"""Which requests in flight one cancellation poll asks about.

`is_cancelled` is a round trip to the server on the channel the responses use; asking each of
256 streams every 100 ms took 2,560 of them a second, and each response then waited ~6 ms to go
out (H100 host). So above `MAX_CHECKS_PER_PERIOD` live requests a period asks only that many,
in turns: each is asked once every ceil(n / MAX_CHECKS_PER_PERIOD) periods.
"""

from __future__ import annotations

MAX_CHECKS_PER_PERIOD = 25


class PollTurns:
    def __init__(self, max_per_period: int = MAX_CHECKS_PER_PERIOD):
        self.max_per_period = max_per_period
        self._next = 0  # where the next poll starts among the live requests

    def pick(self, live: list) -> list:
        """The requests of `live` (oldest first) this period asks about."""
        if len(live) <= self.max_per_period:
            return live
        start = self._next % len(live)
        self._next = start + self.max_per_period
        return (live[start:] + live[:start])[:self.max_per_period]
