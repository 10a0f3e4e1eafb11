"""``Wakeup``: callbacks without a loop, one-shot futures with a loop, deadlines."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.checkpoint import Wakeup


def test_callbacks_run_on_every_notify_without_an_event_loop() -> None:
    wakeup = Wakeup()
    calls: list[str] = []

    def callback() -> None:
        calls.append("x")

    wakeup.add_callback(callback)
    wakeup.notify()
    wakeup.notify()
    wakeup.remove_callback(callback)
    wakeup.notify()
    assert calls == ["x", "x"]
    with pytest.raises(ValueError):
        wakeup.remove_callback(callback)


def test_waiters_wake_once_and_late_waiters_wait_for_the_next_notify() -> None:
    wakeup = Wakeup()

    async def scenario() -> tuple[bool, bool, int]:
        first = asyncio.ensure_future(wakeup.wait(5.0))
        await asyncio.sleep(0)
        assert wakeup.waiters == 1
        wakeup.notify()
        woken = await first
        late = await wakeup.wait(0.01)  # nothing notifies again
        return woken, late, wakeup.waiters

    assert asyncio.run(scenario()) == (True, False, 0)


def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    wakeup = Wakeup()

    async def scenario() -> int:
        task = asyncio.ensure_future(wakeup.wait(5.0))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        wakeup.notify()
        return wakeup.waiters

    assert asyncio.run(scenario()) == 0
