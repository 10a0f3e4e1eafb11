"""Writes a client was told are persisted survive a kill -9 of the node right after: the client
waits with SEQNO_PERSISTENCE (answered when the flush round that persists the write ends), and
every key comes back after the restart with its value, CAS, flags and datatype."""

from __future__ import annotations

import asyncio

import pytest

from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX, GetResult, KvClient
from changefeed.protocol.kv import MutationResult
from support.clients import kv_connect, node_stats
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(180)

ITEMS = PIPELINE_DEPTH_MAX + 904  # two windows


def test_persisted_writes_survive_a_kill_right_after(nodes: NodeFactory) -> None:
    node = nodes()
    items = [(b"key-%06d" % n, b'{"n": %d}' % n) for n in range(ITEMS)]

    async def write() -> list[MutationResult]:
        kv = await kv_connect(node)
        try:
            await kv.upsert_many(items[:100])  # the flusher has something in flight too
            return await kv.upsert_many(items, durability="persist")
        finally:
            await kv.close()

    results = asyncio.run(write())
    general = asyncio.run(node_stats(node))
    # The client asked the node (0xb6) once per window. Whether the node had to wait depends
    # on how far its flusher got meanwhile (a fresh-clone run under load: it never had to).
    asked = int(general["persistence_waits_requested"])
    assert asked >= 2, general
    assert int(general["persistence_waits_answered"]) <= asked, general
    assert general["persistence_waits"] == "0", general
    node.kill()  # no clean stop: only what was on disk counts
    node.start()

    async def read() -> list[GetResult]:
        async with await kv_connect(node) as kv:
            return [await kv.get(key) for key, _ in items]

    got = asyncio.run(read())
    assert [(g.value, g.cas, g.flags) for g in got] == [
        (value, result.cas, 0) for (_, value), result in zip(items, results, strict=True)
    ]
    assert {g.datatype for g in got} <= {0, 1}  # raw or JSON, as the node stores it


def test_a_wait_for_a_seqno_already_persisted_answers_at_once(nodes: NodeFactory) -> None:
    node = nodes()

    async def scenario() -> tuple[dict[str, str], dict[str, str]]:
        kv: KvClient
        async with await kv_connect(node) as kv:
            written = await kv.upsert(b"k", b"v", durability="persist")
            before = await node_stats(node)
            await kv.wait_persisted(written)
            return before, await node_stats(node)

    before, after = asyncio.run(scenario())
    # Asked once and answered at once: no wait was registered for a flush round to answer
    # (counted, not timed: under load even an answer at once may take a while to arrive).
    assert int(after["persistence_waits_requested"]) == (
        int(before["persistence_waits_requested"]) + 1
    ), (before, after)
    assert after["persistence_waits_answered"] == before["persistence_waits_answered"], after
    assert after["persistence_waits"] == "0", after
