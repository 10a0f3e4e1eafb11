"""PersistenceHealth: backoff doubles to its cap and resets, writes are refused only while
failing, and a failing store logs once per interval, not once per retry."""

from __future__ import annotations

import logging

import pytest

from changefeed import limits
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.server.persistence import PersistenceHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_the_cap_and_resets_on_success() -> None:
    health = PersistenceHealth(Clock())
    waits = [health.failed(OSError("No space left on device")) for _ in range(12)]
    assert waits[0] == limits.FLUSH_RETRY_BACKOFF_MIN_S
    assert waits[1] == 2 * waits[0]
    assert max(waits) == limits.FLUSH_RETRY_BACKOFF_MAX_S
    assert waits == sorted(waits)
    health.succeeded()
    assert health.failed(OSError("again")) == limits.FLUSH_RETRY_BACKOFF_MIN_S
    assert health.failures_total == 13


def test_writes_are_refused_only_while_failing() -> None:
    health = PersistenceHealth(Clock())
    health.check_writable()
    health.failed(OSError("No space left on device"))
    with pytest.raises(TemporaryFailureError, match="No space left on device"):
        health.check_writable()
    health.succeeded()
    health.check_writable()
    assert not health.failing


def test_a_failing_store_logs_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    health = PersistenceHealth(clock)
    with caplog.at_level(logging.ERROR, logger="changefeed.persistence"):
        for _ in range(50):
            health.failed(OSError("disk full"))
            clock.now += 0.1
        clock.now += limits.FLUSH_FAILURE_LOG_INTERVAL_S
        health.failed(OSError("disk full"))
    assert len([r for r in caplog.records if "cannot persist" in r.message]) == 2
