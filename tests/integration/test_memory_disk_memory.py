"""A slow consumer on a node with a tiny checkpoint quota: memory -> disk backfill -> memory.

With ``--checkpoint-quota-bytes`` at 1 MiB, a writer loading 50k x 100-byte items overflows
checkpoint memory many times over. A consumer that reads slowly keeps its cursor in old
checkpoints, memory recovery drops the cursor, the stream falls back to a disk backfill (marker
flag Disk 0x02) and then re-registers in memory (flag Memory 0x01). The consumer must still end
with exactly the writer's data, seqnos rising throughout.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from changefeed.consumer import DcpClient, Event, Snapshot
from support.clients import dcp_config, high_seqnos, kv_connect, upsert_retrying
from support.consumer import MARKER_DISK, MARKER_MEMORY, StreamedState, drain, reached, server_state
from support.nodes import NodeFactory

from .harness import assert_matches_model, assert_same_state

pytestmark = pytest.mark.timeout(180)

QUOTA_BYTES = 1024 * 1024


def run_memory_disk_memory(nodes: NodeFactory, rng: random.Random, items_total: int) -> None:
    node = nodes(vbuckets=4, args=["--checkpoint-quota-bytes", str(QUOTA_BYTES)])
    vbs = list(range(4))

    async def scenario() -> None:
        model: dict[bytes, bytes | None] = {}
        streamed = StreamedState()
        slow = {"on": True}

        async def slow_reader(event: Event) -> None:
            if slow["on"] and not isinstance(event, Snapshot):
                await asyncio.sleep(0.004)  # ~ a few hundred events per second: far behind

        client = DcpClient(dcp_config(node, to_latest=False, buffer_bytes=128 * 1024))
        await client.connect()
        await client.stream(vbs)
        reader = asyncio.get_running_loop().create_task(
            drain(client, streamed, lambda c, m: False, timeout_s=300, per_event=slow_reader)
        )

        # A writer that hammers (its own retry loop, no backoff in the client): the reader's
        # cursor must fall out of memory.
        async with await kv_connect(node, tmpfail_retry_s=0) as kv:
            items = [(b"m-%06d" % i, rng.randbytes(100)) for i in range(items_total)]
            rng.shuffle(items)
            await upsert_retrying(kv, items, chunk=500)
            model.update(items)
        slow["on"] = False  # catch up at full speed
        targets = await high_seqnos(node)
        async with asyncio.timeout(120):
            while not reached(targets)(client, streamed):
                assert not reader.done(), reader
                await asyncio.sleep(0.05)
        disk_at = next((i for i, m in enumerate(streamed.markers) if m[3] & MARKER_DISK), None)
        assert disk_at is not None, f"no disk snapshot among {len(streamed.markers)} markers"

        # Writes after the catch-up arrive from memory again.
        # A writer that hammers (its own retry loop, no backoff in the client): the reader's
        # cursor must fall out of memory.
        async with await kv_connect(node, tmpfail_retry_s=0) as kv:
            tail = [(b"t-%03d-%d" % (i, vb), b"tail") for i in range(200) for vb in range(2)]
            await upsert_retrying(kv, tail)
            model.update(tail)
        targets = await high_seqnos(node)
        async with asyncio.timeout(60):
            while not reached(targets)(client, streamed):
                assert not reader.done(), reader
                await asyncio.sleep(0.02)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await client.close()

        memory_after = [m for m in streamed.markers[disk_at:] if m[3] & MARKER_MEMORY]
        assert memory_after, "no memory snapshot after the disk snapshot"
        disk_markers = sum(1 for m in streamed.markers if m[3] & MARKER_DISK)
        print(
            f"{streamed.items} items, {len(streamed.markers)} markers, {disk_markers} from disk; "
            f"first disk marker #{disk_at}"
        )
        assert not streamed.rollbacks
        assert_matches_model(streamed, model)
        assert_same_state(streamed, await server_state(node), what="slow consumer")

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_memory_disk_memory(nodes: NodeFactory, rng: random.Random) -> None:
    run_memory_disk_memory(nodes, rng, 50_000)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_memory_disk_memory_large(nodes: NodeFactory, rng: random.Random) -> None:
    run_memory_disk_memory(nodes, rng, 300_000)
