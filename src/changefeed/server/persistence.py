"""Whether the node's store can persist right now, and what to do while it cannot.

The bucket's flush loop reports each commit's outcome here. After a failed commit (disk full,
an I/O error, a full LMDB map) the node keeps serving reads and streams but refuses writes with
TMPFAIL, answers persistence queries with the error instead of letting clients time out, and
retries with exponential backoff until a commit succeeds again — by itself, when space returns.
Nothing queued is dropped: a failed batch stays in memory (the flusher puts its cursor back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from changefeed import limits
from changefeed.protocol.errors import TemporaryFailureError

log = logging.getLogger("changefeed.persistence")


class PersistenceHealth:
    """Tracks commit failures of one bucket's flusher.

    Args:
        clock: monotonic seconds (backoff, log rate limit); injected so tests replay.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.error: str | None = None  # the last failure while failing, else None
        self.failures_total = 0
        self.failing_since_s: float | None = None
        self._backoff_s = limits.FLUSH_RETRY_BACKOFF_MIN_S
        self._last_log_s = float("-inf")

    @property
    def failing(self) -> bool:
        return self.error is not None

    def failed(self, error: Exception) -> float:
        """A commit failed: record it, log (at most once per FLUSH_FAILURE_LOG_INTERVAL_S),
        and return how long to wait before the next attempt."""
        now = self._clock()
        self.failures_total += 1
        if self.error is None:
            self.failing_since_s = now
        self.error = str(error)
        if now - self._last_log_s >= limits.FLUSH_FAILURE_LOG_INTERVAL_S:
            self._last_log_s = now
            log.error(
                "cannot persist (failure %d, failing for %.1f s; writes are refused with "
                "TMPFAIL and retried every %.2f s): %s",
                self.failures_total,
                now - (self.failing_since_s or now),
                self._backoff_s,
                error,
            )
        wait_s = self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, limits.FLUSH_RETRY_BACKOFF_MAX_S)
        assert wait_s > 0, wait_s
        return wait_s

    def succeeded(self) -> None:
        """A commit succeeded: if the store was failing, it persists again."""
        if self.error is not None:
            since = self.failing_since_s or self._clock()
            log.warning(
                "persistence resumed after %.1f s and %d failed attempts",
                self._clock() - since,
                self.failures_total,
            )
        self.error = None
        self.failing_since_s = None
        self._backoff_s = limits.FLUSH_RETRY_BACKOFF_MIN_S

    def check_writable(self) -> None:
        """Raise TMPFAIL while the store cannot persist: an acknowledged write must be one the
        node can keep (a non-durable write acknowledged now would only live in memory)."""
        if self.error is not None:
            raise TemporaryFailureError(
                f"the store cannot persist ({self.error}); writes resume when it can"
            )
