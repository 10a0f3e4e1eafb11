"""SIGTERM is a clean shutdown: it ends even with busy clients connected, flushes every
acknowledged write, and the restart keeps the failover log (no new branch, so no rollback)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from changefeed.consumer import DcpClient
from support.clients import HOST, dcp_config, high_seqnos, kv_connect, raw_connection, stats
from support.consumer import StreamedState, drain, server_state, stream_to_latest
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)


def test_sigterm_flushes_and_keeps_history(nodes: NodeFactory, rng: random.Random) -> None:
    node = nodes(vbuckets=8)
    vbs = list(range(8))

    async def scenario() -> None:
        async with await kv_connect(node) as kv:
            await kv.upsert_many([(b"first-%d" % i, b"1") for i in range(2000)])
        _, session = await stream_to_latest(node)
        conn = await raw_connection(node)
        before = await stats(conn, "failovers")
        await conn.close()

        # Busy clients at the moment of SIGTERM: a DCP consumer that stopped reading with a full
        # window, an idle KV client, a socket holding half a frame.
        paused = DcpClient(dcp_config(node, to_latest=False, buffer_bytes=64 * 1024))
        await paused.connect()
        await paused.stream(vbs)
        idle = await kv_connect(node)
        _, half = await asyncio.open_connection(HOST, node.port)
        half.write(b"\x80\x01\x00\x05")
        model = {}
        async with await kv_connect(node) as kv:  # acknowledged, not waited for on disk
            items = [(b"last-%05d" % i, rng.randbytes(64)) for i in range(20000)]
            await kv.upsert_many(items)
            model.update(items)
        highs = await high_seqnos(node)

        began = time.monotonic()
        code = node.stop(timeout_s=30)
        took = time.monotonic() - began
        assert code == 0, node.log_tail()
        assert took < 10, f"clean stop took {took:.1f} s"
        for client in (paused, idle):
            await client.close()
        half.close()

        node.start()
        assert await high_seqnos(node) == highs  # every acknowledged write was flushed
        conn = await raw_connection(node)
        after = await stats(conn, "failovers")
        await conn.close()
        assert after == before, "a clean restart must not start a new failover branch"
        truth = await server_state(node)
        live = truth.values()
        assert all(live.get(k) == v for k, v in model.items())
        # The consumer from before the restart resumes without rollback.
        resumed, _ = await stream_to_latest(node, start=session, state=StreamedState())
        assert not resumed.rollbacks, resumed.rollbacks
        assert resumed.items == 20000, resumed.items

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_stop_during_disk_backfill(nodes: NodeFactory) -> None:
    """SIGTERM while streams are in a disk backfill (LMDB read transactions open) is clean."""
    node = nodes(vbuckets=4)

    async def scenario() -> None:
        async with await kv_connect(node) as kv:
            await kv.upsert_many([(b"b-%06d" % i, b"x" * 200) for i in range(40000)])
        node.restart(clean=True)  # everything on disk now, nothing in memory
        client = DcpClient(dcp_config(node, to_latest=True, buffer_bytes=64 * 1024))
        await client.connect()
        await client.stream(list(range(4)))
        streamed = StreamedState()
        await drain(client, streamed, lambda c, m: False, stop_after_items=5000)
        assert any(flags & 0x02 for _, _, _, flags in streamed.markers)
        code = node.stop(timeout_s=30)
        assert code == 0, node.log_tail()
        await client.close()
        node.start()
        truth = await server_state(node)
        assert len(truth.values()) == 40000

    asyncio.run(scenario())
    assert node.errors_in_log() == []
