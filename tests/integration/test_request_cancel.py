"""Cancelling a task waiting on a request is never lost, even when the cancel lands in the same
loop step as the reply.

On CPython 3.11 `asyncio.wait_for(future, t)` returns the future's result if the future is
done when the cancel arrives, and the cancel is gone: a `while True: await kv.get(...)` loop
then never stops (the fuzz test's probe hung CI that way). The reply's future gets a
done-callback that cancels the waiting task, so the cancel arrives exactly then.
"""

from __future__ import annotations

import asyncio

import pytest

from changefeed.consumer.connection import Connection
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from support.clients import raw_connection
from support.nodes import NodeFactory


def test_a_cancel_at_the_reply_is_not_swallowed(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        conn = await raw_connection(node)
        try:
            for _ in range(3):
                await cancelled_at_reply(conn)
        finally:
            await conn.close()

    asyncio.run(scenario())


async def cancelled_at_reply(conn: Connection) -> None:
    waiting: list[asyncio.Task[object]] = []
    expect = conn.expect

    def expect_and_cancel_on_reply(opaque: int) -> asyncio.Future[object]:
        future = expect(opaque)
        future.add_done_callback(lambda _: waiting[0].cancel())  # runs before the request wakes
        return future  # type: ignore[return-value]

    conn.expect = expect_and_cancel_on_reply  # type: ignore[method-assign,assignment]
    try:
        opaque = conn.next_opaque()
        task = asyncio.get_running_loop().create_task(
            conn.request(encode_request(Opcode.NOOP, opaque=opaque), opaque)
        )
        waiting.append(task)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
    finally:
        del conn.expect
