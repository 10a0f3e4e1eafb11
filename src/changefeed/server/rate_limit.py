"""A token bucket in bytes per second: how fast replica catch-up may read from disk.

Catch-up after downtime reads the active's disk (backfill) as fast as the replica takes it;
unbounded, several replicas catching up at once would take the disk and the event loop from
front-end traffic (seed follower-catch-up.md: "don't overload the leader"). One bucket per node
is shared by every replica connection, so the bound holds however many catch up together.
Memory streaming (a replica keeping up) is not charged: it is the steady state.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ByteRate:
    """Up to `bytes_per_s` on average, with bursts of up to one second's worth.

    Args:
        bytes_per_s: the rate; 0 means no limit.
        clock: monotonic seconds.
    """

    def __init__(self, bytes_per_s: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        assert bytes_per_s >= 0, bytes_per_s
        self.bytes_per_s = bytes_per_s
        self._clock = clock
        self._tokens = float(bytes_per_s)
        self._at = clock()
        self.spent_total = 0  # bytes charged over the node's life (stats)

    @property
    def unlimited(self) -> bool:
        return self.bytes_per_s == 0

    def available(self) -> int:
        """Bytes that may be sent now (a large number when unlimited)."""
        if self.unlimited:
            return 1 << 62
        now = self._clock()
        self._tokens = min(
            float(self.bytes_per_s), self._tokens + (now - self._at) * self.bytes_per_s
        )
        self._at = now
        return max(0, int(self._tokens))

    def spend(self, nbytes: int) -> None:
        """Charge `nbytes` sent (may go below zero: one frame over the budget is allowed)."""
        self.spent_total += nbytes
        if not self.unlimited:
            self.available()
            self._tokens -= nbytes

    def wait_s(self) -> float:
        """How long until some bytes are available again."""
        if self.unlimited or self._tokens > 0:
            return 0.0
        return min(1.0, -self._tokens / self.bytes_per_s + 0.001)
