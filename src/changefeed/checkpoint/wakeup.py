"""Wakeup of readers that wait at the end of the checkpoint list.

Contract: `notify()` runs every registered callback and resolves every pending `wait()`. It is
called by the manager after each queued item (and after a cursor drop), from the writer's thread,
with or without a running event loop: callbacks serve synchronous code and non-asyncio schedulers;
`wait()` serves coroutines. A wait registered before `notify()` always wakes; one registered after
waits for the next notify, so callers check for data first and wait only when there is none (no
await in between, asyncio being single-threaded, so no wakeup is lost).

Not here: what is ready (the cursor's `has_next`); cross-thread wakeups (callers share one loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Wakeup:
    """A callback list plus one-shot asyncio futures, per checkpoint manager."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._futures: list[asyncio.Future[None]] = []

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on every notify until removed.

        It runs inside the writer's `queue()`: it must not raise and must not call back into the
        manager (schedule the reading instead, e.g. `loop.call_soon`).
        """
        assert callback not in self._callbacks, callback
        self._callbacks.append(callback)

    def remove_callback(self, callback: Callable[[], None]) -> None:
        """Stop calling `callback`; it must have been added."""
        self._callbacks.remove(callback)

    @property
    def waiters(self) -> int:
        """Coroutines currently waiting (for stats and tests)."""
        return len(self._futures)

    def notify(self) -> None:
        """Wake everyone: run callbacks, resolve waiting futures."""
        if self._callbacks:
            for callback in tuple(self._callbacks):
                callback()
        if self._futures:
            futures, self._futures = self._futures, []
            for future in futures:
                if not future.done():
                    future.set_result(None)

    async def wait(self, timeout_s: float) -> bool:
        """Wait for the next notify, at most `timeout_s` seconds.

        Returns:
            True if notified, False on timeout.
        """
        assert timeout_s >= 0, timeout_s
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures.append(future)
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        finally:
            if future in self._futures:
                self._futures.remove(future)
        return True
