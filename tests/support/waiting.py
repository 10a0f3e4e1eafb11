"""Waiting on the condition a test means, not on a fixed sleep.

Under load (two xdist workers beside other work on two cores) the moment a node's close, a
flush or a map push reaches the test varies by seconds; a fixed sleep before an assert then
fails on timing alone. These poll the condition until a generous deadline and fail naming
what never became true (and its last value), so what is checked stays the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 30.0  # generous: only a wrong answer takes this long
POLL_S = 0.05


async def until(
    value: Callable[[], T],
    holds: Callable[[T], bool],
    what: str,
    *,
    timeout_s: float = DEADLINE_S,
) -> T:
    """Poll ``value()`` until ``holds`` it; returns that value.

    Raises:
        AssertionError: ``what`` never held within ``timeout_s``, with the last value seen.
    """
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        current = value()
        if holds(current):
            return current
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s: {current!r}"
        await asyncio.sleep(POLL_S)
