"""Connection deadlines and the connection limit, on an in-process node with a test clock.

Before: 1,100 idle unauthenticated sockets locked legitimate clients out silently (no auth
deadline, no idle timeout, no limit). Now a connection must authenticate within
AUTH_DEADLINE_S, an authenticated KV connection idle for idle_timeout_s is closed, a request
left unfinished for PARTIAL_FRAME_DEADLINE_S is closed, and connections over max_connections
are refused at once with one logged line. The node's own deadline task does the closing; the
test only moves the node's monotonic clock.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from changefeed import limits
from changefeed.consumer import KvClient
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.server.config import NodeConfig
from changefeed.server.node import Node
from support.clients import HOST, PASSWORD, USER

IDLE_S = 60.0


class ManualClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def closed_by_node(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), 5.0) == b""
    except (ConnectionResetError, TimeoutError):
        return False


async def checker_pass() -> None:
    """Let the node's deadline task (every DEADLINE_CHECK_INTERVAL_S) run once."""
    await asyncio.sleep(limits.DEADLINE_CHECK_INTERVAL_S * 1.5)


def test_deadlines_close_what_overstays_and_spare_the_rest(tmp_path: Path) -> None:
    clock = ManualClock()
    config = NodeConfig(data_dir=tmp_path, port=0, vbuckets=4, durable=False, idle_timeout_s=IDLE_S)

    async def scenario() -> None:
        node = Node(config, monotonic=clock)
        await node.start()
        try:
            silent_reader, silent_writer = await asyncio.open_connection(HOST, node.port)
            kv = await KvClient.connect(HOST, node.port, user=USER, password=PASSWORD)
            clock.now += limits.AUTH_DEADLINE_S + 1
            await checker_pass()
            assert await closed_by_node(silent_reader), "unauthenticated socket was kept"
            await kv.upsert(b"alive", b"yes")  # authenticated and active: kept

            # Half a request header, then nothing: closed after the partial-frame deadline.
            raw_reader, raw_writer = await asyncio.open_connection(HOST, node.port)
            raw_writer.write(encode_request(Opcode.NOOP, opaque=1)[:10])
            await raw_writer.drain()
            await asyncio.sleep(0.2)
            clock.now += 5  # the node saw the half header at this clock; give it a moment
            await checker_pass()
            assert not raw_reader.at_eof()
            clock.now += limits.PARTIAL_FRAME_DEADLINE_S + 1
            await checker_pass()
            assert await closed_by_node(raw_reader), "a half request was kept forever"

            await kv.upsert(b"alive", b"still")
            clock.now += IDLE_S + 1  # kv idle from now on
            await checker_pass()
            # The node closed the idle connection: the client (which follows the cluster map)
            # finds it closed on its next request and reconnects, as the SDKs do.
            assert (await kv.get(b"alive")).value == b"still"
            assert kv.reconnects == 1, "the idle connection was not closed"
            await kv.close()
            silent_writer.close()
            raw_writer.close()
        finally:
            await node.stop()

    asyncio.run(scenario())


def test_connections_over_the_limit_are_refused_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = NodeConfig(data_dir=tmp_path, port=0, vbuckets=4, durable=False, max_connections=3)

    async def scenario() -> None:
        node = Node(config)
        await node.start()
        try:
            kept = [await asyncio.open_connection(HOST, node.port) for _ in range(3)]
            await asyncio.sleep(0.1)
            refused = [await asyncio.open_connection(HOST, node.port) for _ in range(5)]
            for reader, _ in refused:
                assert await closed_by_node(reader)
            for reader, _ in kept:
                assert not reader.at_eof()
            for _, writer in kept[:1]:  # one leaves: a new client gets in
                writer.close()
            await asyncio.sleep(0.2)
            kv = await KvClient.connect(HOST, node.port, user=USER, password=PASSWORD)
            await kv.upsert(b"in", b"yes")
            await kv.close()
            for _, writer in kept[1:] + refused:
                writer.close()
        finally:
            await node.stop()

    with caplog.at_level(logging.WARNING, logger="changefeed.server"):
        asyncio.run(scenario())
    refusals = [r for r in caplog.records if "max_connections 3 reached" in r.message]
    assert len(refusals) == 1, [r.message for r in refusals]  # a flood logs once per interval
