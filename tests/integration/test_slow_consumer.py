"""A consumer that stops reading while 100k+ items are written must not grow the node's memory.

The consumer sets ``connection_buffer_size`` (flow control) and then does not take events for the
whole load: its library stops reading the socket once its event queue is full, the producer's
window fills and the node stops sending. The node's RSS (``/proc/PID/status`` VmRSS, sampled all
along) must stay within a bound over its baseline; then the consumer catches up and must get
everything.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from changefeed.consumer import DcpClient
from support.clients import dcp_config, high_seqnos, kv_connect, upsert_retrying
from support.consumer import StreamedState, drain, reached
from support.nodes import NodeFactory

from .harness import assert_matches_model, rss_sampler

pytestmark = pytest.mark.timeout(180)

RSS_GROWTH_MAX_BYTES = 150 * 1024 * 1024
# Checkpoint memory is the node's own bound on what it keeps for readers (a slow reader's cursor is
# dropped above it and the reader goes to disk); 32 MiB holds ~80k of these items.
QUOTA_BYTES = 32 * 1024 * 1024


def run_slow_consumer(nodes: NodeFactory, rng: random.Random, items_total: int) -> None:
    node = nodes(vbuckets=8, args=["--checkpoint-quota-bytes", str(QUOTA_BYTES)])
    vbs = list(range(8))

    async def scenario() -> None:
        async with await kv_connect(node) as kv:  # warm up imports, caches, the store
            await kv.upsert_many([(b"warm-%d" % i, b"w") for i in range(1000)])
        model: dict[bytes, bytes | None] = {b"warm-%d" % i: b"w" for i in range(1000)}
        await asyncio.sleep(0.2)
        baseline = node.rss_bytes()
        anon_baseline = node.status_kib("RssAnon") * 1024

        client = DcpClient(dcp_config(node, to_latest=False, buffer_bytes=1024 * 1024))
        await client.connect()
        await client.stream(vbs)  # ... and then take no events during the load
        async with rss_sampler(node) as samples:
            async with await kv_connect(node) as kv:
                items = [(b"s-%07d" % i, rng.randbytes(100)) for i in range(items_total)]
                await upsert_retrying(kv, items, chunk=1000)
                model.update(items)
            await asyncio.sleep(0.5)  # the node flushes; the consumer still does not read
        peak = max(samples)
        anon_after = node.status_kib("RssAnon") * 1024
        # LMDB maps its data file: pages read through the map count in VmRSS but are page cache.
        mapped = sum(p.stat().st_size for p in node.data_dir.rglob("*.mdb"))
        print(
            f"{items_total} items; VmRSS baseline {baseline >> 20} MiB, peak {peak >> 20} MiB "
            f"(+{(peak - baseline) >> 20}); RssAnon {anon_baseline >> 20} -> {anon_after >> 20}"
            f" MiB; data file {mapped >> 20} MiB; {len(samples)} samples"
        )
        assert anon_after - anon_baseline < RSS_GROWTH_MAX_BYTES, (anon_baseline, anon_after)
        assert peak - baseline < RSS_GROWTH_MAX_BYTES + mapped, (baseline, peak, mapped)

        # Now catch up: every item arrives.
        streamed = StreamedState()
        targets = await high_seqnos(node)
        await drain(client, streamed, reached(targets), timeout_s=120)
        await client.close()
        assert not streamed.rollbacks
        assert_matches_model(streamed, model)
        print(f"caught up: {streamed.items} items, {len(streamed.markers)} snapshots")

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_slow_consumer_memory_bounded(nodes: NodeFactory, rng: random.Random) -> None:
    run_slow_consumer(nodes, rng, 120_000)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_slow_consumer_memory_bounded_large(nodes: NodeFactory, rng: random.Random) -> None:
    run_slow_consumer(nodes, rng, 600_000)
