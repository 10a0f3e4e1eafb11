"""A watch follows the client to another etcd member: ``_next_event`` gives up on a watch as
soon as the client moves (a watch left on a member given up on may never fire nor fail)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from changefeed.cluster import metadata
from changefeed.cluster.metadata import ClusterMetadata


async def _silent() -> AsyncIterator[int]:
    await asyncio.Event().wait()  # a watch that never fires nor fails
    yield 0


async def _events(*values: int) -> AsyncIterator[int]:
    for value in values:
        yield value


def test_a_silent_watch_ends_when_the_client_moves() -> None:
    async def run() -> tuple[object, object]:
        switched = asyncio.Event()
        events = aiter(_silent())
        waiting = asyncio.ensure_future(metadata._next_event(events, switched))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing came and the client did not move: still waiting
        switched.set()
        got = await asyncio.wait_for(waiting, 5)
        again = await metadata._next_event(aiter(_events(1)), switched)  # already moved
        return got, again

    assert asyncio.run(run()) == (None, None)


def test_events_pass_and_the_end_is_none() -> None:
    async def run() -> list[object]:
        switched = asyncio.Event()
        events = aiter(_events(1, 2))
        return [await metadata._next_event(events, switched) for _ in range(3)]

    assert asyncio.run(run()) == [1, 2, None]


def test_a_failed_member_moves_the_client_and_tells_the_watches() -> None:
    async def run() -> tuple[str, int, bool, bool]:
        meta = ClusterMetadata([object(), object(), object()], ["a", "b", "c"], "c1", 1.0)
        before = meta._switched
        meta._fail_over(0)
        meta._fail_over(0)  # a second failure of the member already left: no second move
        return meta.endpoint, meta.switches, before.is_set(), meta._switched.is_set()

    assert asyncio.run(run()) == ("b", 1, True, False)
