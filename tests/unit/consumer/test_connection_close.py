"""``Connection.close`` returns although the peer stopped reading: a node that holds back
while its replies go unread (its request window is full) never drains our queued requests,
and waiting for the socket to flush them hung `changefeed load` after Ctrl-C (seen in CI)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from changefeed.consumer.connection import Connection

QUEUED_BYTES = 64 * 1024 * 1024  # far more than both sockets' buffers hold


@pytest.mark.timeout(60)
def test_close_returns_when_the_peer_reads_nothing() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        async def scenario() -> None:
            conn = await Connection.open("127.0.0.1", port)
            peer, _ = await asyncio.to_thread(listener.accept)
            with peer:  # accepted, never read
                conn.send(b"\x80" * QUEUED_BYTES)
                await asyncio.sleep(0.2)  # the kernel's buffers fill; the rest stays queued
                await asyncio.wait_for(conn.close(), 30)  # hung before: wait_closed forever
                assert conn.closed is not None

        asyncio.run(scenario())
